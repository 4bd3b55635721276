"""What the file system of a repository's folder can hold, and how it says it
cannot (docs/design.md, "Folders that cannot hold everything").

exFAT, FAT, NTFS through ntfs-3g, SMB mounts, macOS and Windows each refuse
something another client's file system holds: a name (a character, a reserved
word, a length), a symbolic link, an exec bit, a second name that differs only in
case, a file over 4 GiB. The folder's traits are probed once per file system
(:func:`probe_traits`); what writing a path fails with is told apart from a real
failure here (:func:`name_refused`, :func:`cannot_write`) and put in words
(:func:`cannot_hold`).
"""

from __future__ import annotations

import errno
import os
import stat
import unicodedata
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from metasync.names import display_path
from metasync.portable import O_CLOEXEC

#: What a file system answers when it cannot hold a name: too long (another
#: client's system allows longer ones), not in the encoding it requires (macOS,
#: ZFS utf8only: EILSEQ), or characters it forbids (SMB, the kernel's vfat: EINVAL).
#: FUSE file systems answer a forbidden character with ENOENT (exfat-fuse) or EPERM
#: (fusefat) too; those are told from their usual meaning where they can be
#: (:func:`name_refused`, :class:`NameRefused`).
NAME_REFUSED = frozenset({errno.ENAMETOOLONG, errno.EILSEQ, errno.EINVAL})
#: What creating a symbolic link answers on a file system that has none (exFAT,
#: FAT: ENOSYS; the kernel's vfat: EPERM; some network mounts: EOPNOTSUPP).
LINKS_REFUSED = frozenset({errno.ENOSYS, errno.EPERM, errno.EOPNOTSUPP})

#: Why a name ending in a dot is not written where the folder drops trailing dots.
DROPS_DOT = "this file system drops a name's trailing dot (it would be another name here)"


class NameRefused(OSError):
    """This file system refused a name, whatever errno it said it with (see
    :data:`NAME_REFUSED`): raised with ``errno.EINVAL``, so a caller checks one set."""

    def __init__(self, name: str) -> None:
        super().__init__(errno.EINVAL, "this file system refuses the name", name)


def name_refused(exc: OSError, fd: int, tmp: str, name: str) -> bool:
    """True if renaming the temporary file ``tmp`` to ``name`` in folder ``fd`` failed
    with ``exc`` because this file system cannot hold ``name``: an errno of
    :data:`NAME_REFUSED`, or ENOENT/EPERM while ``tmp`` is still there and nothing
    is at ``name`` (exfat-fuse and fusefat say a forbidden character so)."""
    if exc.errno in NAME_REFUSED:
        return True
    if exc.errno not in (errno.ENOENT, errno.EPERM):
        return False
    try:
        os.stat(tmp, dir_fd=fd, follow_symlinks=False)
    except OSError:
        return False  # the temporary file is gone: not about the name
    try:
        os.stat(name, dir_fd=fd, follow_symlinks=False)
    except FileNotFoundError:
        return True
    except OSError:
        return True  # even looking the name up fails: it cannot be here
    return False


def cannot_hold(exc: OSError) -> str:
    """Why this file system cannot hold a path, from what writing it failed with:
    the words ``cannot be written here: PATH: WHY`` end with."""
    if exc.errno == errno.ENAMETOOLONG:
        return "File name too long for this file system"
    if exc.errno == errno.EFBIG:
        return "File too large for this file system"
    if isinstance(exc, NameRefused) or exc.errno in NAME_REFUSED:
        return "this file system refuses the name"
    return exc.strerror or str(exc)


@dataclass(frozen=True)
class FolderTraits:
    """What the folder's file system can hold, probed (:func:`probe_traits`) in
    ``.metasync`` and recorded in the local state with the file system's device
    number (probed again when that changes: the folder moved to another disk, or
    the disk was mounted again). As git's ``core.ignorecase`` and ``core.fileMode``:

    - ``case_insensitive``: a name looked up in another case finds the file
      (exFAT, FAT, macOS and Windows by default); names of a tree that differ only
      in case are one file here, so only one of them is written.
    - ``exec_bits``: a file's exec bit sticks (not on exFAT, FAT, NTFS through
      ntfs-3g): where it does not, the scan takes each file's exec bit from the
      index, never from the disk.
    - ``trailing_dots``: a name's trailing dots stay (not on Linux's vfat, nor on
      Windows, which drop them without an error: ``a.`` is written as ``a``).
      Where they do not, a name ending in a dot is one this folder cannot hold
      (:meth:`drops_dot`). None in a record written before it was probed: taken as
      keeping them, and probed again (``Scanner.traits``).
    """

    device: int
    case_insensitive: bool
    exec_bits: bool
    trailing_dots: bool | None = True

    #: What a folder that could not be probed is taken to be (a POSIX file system).
    POSIX: ClassVar[tuple[bool, bool, bool]] = (False, True, True)

    def drops_dot(self, name: str) -> bool:
        """True if this folder would silently write the name ``name`` without its
        trailing dot (so it cannot hold ``name``: that is another name here)."""
        return self.trailing_dots is False and name.endswith(".")

    def to_json(self) -> dict[str, object]:
        return {"device": self.device, "case_insensitive": self.case_insensitive,
                "exec_bits": self.exec_bits, "trailing_dots": self.trailing_dots}

    @classmethod
    def from_json(cls, raw: object) -> FolderTraits | None:
        """The record ``raw`` describes; None for anything else (probed again). A
        record without ``trailing_dots`` (older code's) has None there."""
        if not isinstance(raw, dict):
            return None
        dev, case, bits = raw.get("device"), raw.get("case_insensitive"), raw.get("exec_bits")
        if not (isinstance(dev, int) and isinstance(case, bool) and isinstance(bits, bool)):
            return None
        dots = raw.get("trailing_dots")
        return cls(dev, case, bits, dots if isinstance(dots, bool) else None)


def probe_traits(root: Path, meta: Path) -> FolderTraits | None:
    """Probe the file system of the folder ``root`` with a scratch file in ``meta``
    (its ``.metasync``, a child: same file system, and on Linux's per-folder case
    folding the same flag): create it with a name ending in a dot and list ``meta``
    to see whether the dot stayed; look it up in upper case; create it without exec
    bits and set one. None if no scratch file can be made there (a read-only mount:
    nothing will be written either)."""
    name = f"probe-{os.urandom(6).hex()}"
    try:
        fd = os.open(meta / f"{name}.", os.O_WRONLY | os.O_CREAT | os.O_EXCL | O_CLOEXEC, 0o644)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        os.close(fd)
        # vfat and Windows drop the dot without an error: only the listing tells.
        listed = set(os.listdir(meta))
        trailing_dots = f"{name}." in listed or name not in listed
        path = meta / (f"{name}." if trailing_dots else name)
        case_insensitive = os.path.lexists(meta / path.name.upper())
        exec_bits = False
        if not st.st_mode & stat.S_IXUSR:  # exFAT and FAT show every file executable
            try:
                os.chmod(path, 0o744)
                exec_bits = bool(os.stat(path).st_mode & stat.S_IXUSR)
            except OSError:
                pass  # fusefat: ENOSYS
    finally:
        for spelling in (f"{name}.", name):
            try:
                os.unlink(meta / spelling)
            except FileNotFoundError:
                pass
    return FolderTraits(os.stat(root).st_dev, case_insensitive, exec_bits, trailing_dots)


def cannot_write(kind: str, exc: OSError) -> str | None:
    """Why this file system cannot hold a path of type ``kind`` (``link``, ``file``,
    ...) if writing it failed with ``exc`` for that reason (a link where there are
    none, a file over its largest size: FAT32's 4 GiB), else None."""
    if kind == "link" and exc.errno in LINKS_REFUSED:
        return "this file system has no symbolic links"
    if exc.errno == errno.EFBIG:
        return cannot_hold(exc)
    return None


def not_written_note(path: str, why: str) -> str:
    """The one line that says a path of the tree is not on this disk, and why."""
    return (f"cannot be written here: {display_path(path)}: {why}; it stays in the "
            "repository (and on the other clients)")


def clash_reason(path: str, other: str) -> str:
    """Why ``path`` is not written where ``other`` is (the two are one name here:
    :func:`~metasync.scanner.name_clashes`)."""
    if unicodedata.normalize("NFC", path) == unicodedata.normalize("NFC", other):
        return f"the same name as {display_path(other)} in another Unicode form"
    return (f"differs from {display_path(other)} only in case, and this folder "
            "does not tell case apart")
