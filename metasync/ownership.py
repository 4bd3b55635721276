"""Whose ``.metasync`` it is: a repository folder is found (searching upwards, as
git does) only if its ``.metasync`` belongs to the user running the command, or
the user trusts the folder (``metasync trust``, like git's ``safe.directory``).
Split from :mod:`metasync.worktree`."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from metasync.errors import UnsafeRepository, UsageError
from metasync.portable import effective_uid
from metasync.worktree import META_DIR

#: Folders (separated by ``os.pathsep``) whose ``.metasync`` is opened whoever owns
#: it, for this process; ``*`` trusts every folder (as git's ``safe.directory``).
SAFE_FOLDERS_ENV = "METASYNC_SAFE_DIRECTORIES"
#: This user's trusted folders, one absolute path a line, in metasync's configuration
#: folder (``metasync trust``).
TRUST_FILE = "trusted-folders"
#: The files of ``.metasync`` a command reads before anything else: their owner is
#: checked too (others cannot reach them in a private ``.metasync``, but one made
#: while the folder was open to them may be theirs).
_READ_FIRST = ("state.db", "key")


def find_root(path: str | Path) -> Path | None:
    """The repository folder containing ``path`` (searching upwards, as git does);
    None if there is none. The nearest ``.metasync`` found must pass
    :func:`check_owner` (else :class:`UnsafeRepository`): a folder another user
    made in a shared parent is never taken for this user's repository."""
    start = Path(path).absolute()
    for candidate in (start, *start.parents):
        if (candidate / META_DIR / "state.db").is_file():
            check_owner(candidate)
            return candidate
    return None


def check_owner(root: Path) -> None:
    """Raise :class:`UnsafeRepository` (one line naming the fix) unless ``root`` is
    trusted (:func:`trusted_folders`) or its ``.metasync`` is a real folder that
    belongs to the user running this process, that no one else can write to, and
    whose state and key files belong to that user. Root is no exception (as git):
    a folder another user planted is theirs to control whoever opens it."""
    problem = _ownership_problem(root)
    if problem is not None and not _is_trusted(root):
        raise UnsafeRepository(problem)


def _ownership_problem(root: Path) -> str | None:
    me = effective_uid()
    if me is None:  # Windows: a folder's owner is an ACL's, checked by the OS on open
        return None
    meta = root / META_DIR
    trust = f"if you trust it, run `metasync trust {root}` (or set {SAFE_FOLDERS_ENV})"
    st = os.lstat(meta)
    if not stat.S_ISDIR(st.st_mode):
        return f"{meta} is a link, not a folder; {trust}"
    if st.st_uid != me:
        return f"{meta} is owned by uid {st.st_uid}, not you (uid {me}); {trust}"
    if st.st_mode & 0o022 and _keeps_modes(meta, st):
        return (f"{meta} is writable by others (mode {stat.S_IMODE(st.st_mode):04o}); "
                f"run `chmod go-w {meta}`, or {trust}")
    for name in _READ_FIRST:
        try:
            fst = os.lstat(meta / name)
        except FileNotFoundError:
            continue
        if not stat.S_ISREG(fst.st_mode):
            return f"{meta / name} is not a regular file; {trust}"
        if fst.st_uid != me:
            return f"{meta / name} is owned by uid {fst.st_uid}, not you (uid {me}); {trust}"
    return None


def _keeps_modes(path: Path, st: os.stat_result) -> bool:
    """True if the file system of ``path`` (a folder that shows mode ``st``) keeps
    permission bits. exFAT and FAT keep none and show every folder writable by all
    (who may write is the mount's business): a mode that does not stick says
    nothing. Probed by taking group and other write away and putting the mode back."""
    mode = stat.S_IMODE(st.st_mode)
    try:
        os.chmod(path, mode & ~0o022)
        kept = not os.stat(path).st_mode & 0o022
        if kept:
            os.chmod(path, mode)
    except OSError:
        return False  # fusefat: no chmod at all
    return kept


def _is_trusted(root: Path) -> bool:
    env = os.environ.get(SAFE_FOLDERS_ENV, "")
    entries = [e for e in env.split(os.pathsep) if e]
    if "*" in entries:
        return True
    real = root.resolve()
    return any(Path(e).resolve() == real for e in entries) or real in trusted_folders()


def trust_file() -> Path:
    """Where this user's trusted folders are listed."""
    from metasync.backends.cloud import config_dir  # loaded only when a check fails

    return config_dir() / TRUST_FILE


def trusted_folders() -> list[Path]:
    """The folders this user trusts (``metasync trust``), as listed."""
    try:
        text = trust_file().read_text()
    except FileNotFoundError:
        return []
    return [Path(line) for line in text.splitlines() if line.strip()]


def set_trusted(folder: str | Path, trusted: bool = True) -> Path:
    """Add ``folder`` (a repository's folder) to this user's trusted folders, or with
    ``trusted=False`` remove it; return its absolute path. The list is rewritten
    atomically, readable by this user only."""
    path = Path(folder).resolve()
    if trusted and not (path / META_DIR).is_dir():
        raise UsageError(f"{path} holds no {META_DIR} folder; give the repository's folder")
    listed = [p for p in trusted_folders() if p != path] + ([path] if trusted else [])
    target = trust_file()
    target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = target.with_name(f".tmp-{os.urandom(6).hex()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.writelines(f"{p}\n" for p in listed)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, target)
    return path
