"""Exclusive publish of a complete file: how the ``dir:`` backend creates a name only
if it is absent, on whatever filesystem its folder is.

``put_if_absent`` and every log append of the ``dir:`` backend write a temporary file
completely, then give it its final name in one step that fails if the name exists.
Readers therefore see either no file or the complete one, and of several writers
racing for one name exactly one wins. Two primitives do that step:

- ``link``: a hard link (``link()`` fails with ``EEXIST``); most local filesystems,
  NTFS through ntfs-3g, SMB with unix extensions, NFS;
- ``rename``: a no-replace rename -- ``renameat2(RENAME_NOREPLACE)`` on Linux,
  ``renamex_np(RENAME_EXCL)`` on macOS, ``MoveFileEx`` without
  ``MOVEFILE_REPLACE_EXISTING`` (``os.rename``) on Windows -- for filesystems without
  hard links whose driver supports it (Linux's own exfat and vfat drivers, APFS,
  every Windows filesystem).

Both leave exactly the same file under the final name, so clients using either on
one folder interoperate. :func:`probe_publish` finds which one a folder honours
(and that it really refuses an existing name); :func:`describe_filesystem` names the
filesystem for the one-line error when neither works (FUSE drivers built on libfuse 2,
such as exfat-fuse and fusefat, implement neither).
"""

from __future__ import annotations

import errno
import os
import secrets
import stat
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # loaded on the first no-replace rename (start-up time)
    import ctypes

#: The primitives, in the order they are tried.
LINK = "link"
RENAME = "rename"
#: What each one is called in messages.
NAMES = {LINK: "an exclusive hard link", RENAME: "a no-replace rename"}


def _errnos(*names: str) -> frozenset[int]:
    # Not every platform defines every errno; take the ones that exist.
    return frozenset(getattr(errno, n) for n in names if hasattr(errno, n))


#: The filesystem (or its driver) does not offer the primitive at all.
UNSUPPORTED = _errnos("EPERM", "ENOTSUP", "EOPNOTSUPP", "ENOSYS", "EXDEV", "EINVAL")


def link_exclusive(source: str, target: str) -> bool:
    """Give the complete file ``source`` the additional name ``target`` unless it exists.

    Returns False if ``target`` already exists; other failures raise :class:`OSError`.
    The link count check is the classic NFS-safe exclusive create: a retransmitted
    ``link`` may report ``EEXIST`` (or another error) although the first transmission
    succeeded. The caller removes ``source`` afterwards in every case.
    """
    try:
        os.link(source, target)
        return True
    except OSError as exc:
        try:
            linked = os.stat(source).st_nlink == 2
        except OSError:
            linked = False
        if linked:
            return True
        if isinstance(exc, FileExistsError):
            return False
        raise


_libc: ctypes.CDLL | None = None


def _c_library() -> ctypes.CDLL:
    global _libc
    import ctypes.util

    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    return _libc


def _rename_noreplace_call(source: str, target: str) -> None:
    """Rename ``source`` to ``target``, failing with ``EEXIST`` if ``target`` exists;
    :class:`OSError` with an errno in :data:`UNSUPPORTED` where this OS or driver has
    no such rename."""
    if sys.platform == "win32":
        # MoveFileEx without MOVEFILE_REPLACE_EXISTING refuses an existing target.
        os.rename(source, target)
        return
    args: tuple[object, ...] = ()
    if sys.platform == "darwin":
        function = getattr(_c_library(), "renamex_np", None)
        args = (os.fsencode(source), os.fsencode(target), 0x4)  # RENAME_EXCL
    elif sys.platform.startswith("linux"):
        function = getattr(_c_library(), "renameat2", None)  # glibc >= 2.28, musl >= 1.2.2
        at_fdcwd = -100
        args = (at_fdcwd, os.fsencode(source), at_fdcwd, os.fsencode(target), 1)  # NOREPLACE
    else:
        function = None
    if function is None:
        raise OSError(errno.ENOSYS, "no no-replace rename on this platform")
    if function(*args) != 0:
        import ctypes

        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), target)


def rename_noreplace(source: str, target: str) -> bool:
    """Move the complete file ``source`` to ``target`` unless ``target`` exists.

    Returns False (``source`` left in place) if it exists; other failures raise
    :class:`OSError`. A network filesystem may answer ``EEXIST`` to a retransmitted
    rename that did succeed: the source being gone then means ours won (nobody else
    removes a writer's own temporary file while it runs)."""
    try:
        _rename_noreplace_call(source, target)
        return True
    except FileExistsError:
        return not os.path.lexists(source)


def publish(method: str, source: str, target: str) -> bool:
    """Publish ``source`` as ``target`` by ``method`` (:data:`LINK` or :data:`RENAME`)
    unless ``target`` exists; True if this call did. The caller removes ``source``
    afterwards if it is still there."""
    if method == LINK:
        return link_exclusive(source, target)
    return rename_noreplace(source, target)


def probe_publish(folder: str, write_temp: Callable[[bytes], str]) -> str | None:
    """The primitive ``folder``'s filesystem honours: :data:`LINK`, else
    :data:`RENAME`, else None. ``write_temp(data)`` writes a complete temporary file
    in ``folder`` and returns its path.

    Each one is checked on two temporary files as it is used: publishing to a free
    name must succeed, and publishing a second file to that name must fail and
    leave the first one's bytes. Errors other than "not supported" raise
    :class:`OSError`. Every file made here is removed again."""
    made: list[str] = []
    try:
        for method in (LINK, RENAME):
            tag = secrets.token_hex(8)
            # Each one recorded as soon as it exists: a failing second write must not
            # leave the first behind.
            first = write_temp(b"first " + tag.encode())
            made.append(first)
            second = write_temp(b"second")
            made.append(second)
            target = os.path.join(folder, os.path.basename(first) + "-probe")
            made.append(target)
            try:
                if not publish(method, first, target):
                    continue  # a fresh random name taken: the primitive is not honoured
            except OSError as exc:
                if exc.errno in UNSUPPORTED:
                    continue
                raise
            try:
                refused = not publish(method, second, target)
            except OSError as exc:
                if exc.errno not in UNSUPPORTED:
                    raise
                refused = False
            with open(target, "rb") as f:
                kept = f.read() == b"first " + tag.encode()
            if refused and kept:
                return method
        return None
    finally:
        for path in made:
            try:
                os.unlink(path)
            except OSError:
                pass


# The first bytes of a volume: the boot sector names exFAT, NTFS and FAT32 (the
# drivers of FUSE mounts do not say in /proc/self/mountinfo which one they serve).
_SIGNATURES = ((3, b"EXFAT   ", "exFAT"), (3, b"NTFS    ", "NTFS"), (82, b"FAT32   ", "FAT32"),
               (54, b"FAT16   ", "FAT16"), (54, b"FAT12   ", "FAT12"))


#: FUSE drivers that name themselves in the type (``fuse.<driver>``), by driver.
_FUSE_DRIVERS = {"fusefat": "FAT", "exfat": "exFAT", "exfat-fuse": "exFAT", "ntfs-3g": "NTFS",
                 "ntfs": "NTFS", "ntfs3": "NTFS"}


def _readable_volume(mode: int) -> bool:
    # A block device or an image file; never a FIFO (reading it blocks and takes
    # another program's bytes) nor a character device (opening a tape rewinds it).
    return stat.S_ISBLK(mode) or stat.S_ISREG(mode)


def _volume_kind(source: str) -> str | None:
    """exFAT, NTFS or FAT from the boot sector of ``source`` (a block device or an
    image file: the mount's source as /proc/self/mountinfo names it, which is not
    trusted to be either), if it can be read here; None otherwise."""
    try:
        if not _readable_volume(os.stat(source).st_mode):
            return None
        # Non-blocking, and checked again on what was opened: the name may have been
        # replaced since the stat.
        fd = os.open(source, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
        try:
            if not _readable_volume(os.fstat(fd).st_mode):
                return None
            head = os.read(fd, 512)
        finally:
            os.close(fd)
    except OSError:
        return None
    for offset, magic, kind in _SIGNATURES:
        if head[offset : offset + len(magic)] == magic:
            return kind
    return None


def _unescape(field: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as \ooo (octal).
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and field[i + 1 : i + 4].isdigit():
            out.append(chr(int(field[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def _mount_of(path: str) -> tuple[str, str, str] | None:
    """``(mount point, type, source)`` of the mount holding ``path``, from
    ``/proc/self/mountinfo``; None where that cannot be read (other OSes)."""
    best: tuple[str, str, str] | None = None
    real = os.path.realpath(path)
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        fields = line.split(" ")
        if "-" not in fields or len(fields) < 5:
            continue
        tail = fields[fields.index("-") + 1 :]
        if len(tail) < 2:
            continue
        mountpoint = _unescape(fields[4])
        inside = real == mountpoint or real.startswith(mountpoint.rstrip("/") + "/")
        if inside and (best is None or len(mountpoint) >= len(best[0])):
            best = (mountpoint, tail[0], _unescape(tail[1]))
    return best


def is_fuse(path: str) -> bool:
    """Whether ``path`` is on a FUSE filesystem (Linux; False where unknown). Their
    drivers -- exfat-fuse, fusefat, ntfs-3g -- replace a file on rename by removing
    it first, so a reader may find no file in that moment."""
    mount = _mount_of(path)
    return mount is not None and mount[1].startswith("fuse")


def describe_filesystem(path: str) -> str:
    """The filesystem holding ``path`` in a few words: its type and mount point from
    ``/proc/self/mountinfo``, e.g. ``fuseblk (exFAT) at /media/usb``; "the
    filesystem at PATH" where that cannot be read (other OSes)."""
    mount = _mount_of(path)
    if mount is None:
        return f"the filesystem at {path}"
    mountpoint, fstype, source = mount
    kind = None
    if fstype.startswith("fuse"):
        kind = _FUSE_DRIVERS.get(fstype.partition(".")[2]) or _volume_kind(source)
    return f"{fstype} ({kind}) at {mountpoint}" if kind else f"{fstype} at {mountpoint}"
