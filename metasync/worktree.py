"""The user's folder: scanning it, hashing files into objects, writing files back.

Scanning never follows symbolic links (a link is recorded as a link) and skips
``.metasync`` and our temporary files. Hashing streams each file through
FastCDC, so a large file is never held in memory and an edit re-creates only
the chunks around it. Writing goes to a temporary file beside the target and
is renamed over it only after the data is flushed, so a reader (or a crash)
sees the old file or the new one, never a mix. Every write, rename and delete in
the folder goes through :class:`Folders`, which opens each parent folder without
following a symbolic link, so nothing is ever written through one.
"""

from __future__ import annotations

import errno
import os
import stat
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import NamedTuple

from metasync.errors import UsageError
from metasync.fstraits import NAME_REFUSED, NameRefused
from metasync.objects import Chunk, FileObject, ObjectHasher
from metasync.portable import O_CLOEXEC, O_DIRECTORY, O_NOFOLLOW, O_NONBLOCK, effective_uid

META_DIR = ".metasync"
TEMP_PREFIX = ".metasync-tmp-"

#: FastCDC parameters: 1 MiB average chunks, as restic; part of the format because
#: they decide chunk ids (and so deduplication), not of correctness.
CHUNK_AVG = 1024 * 1024
CHUNK_MIN = 256 * 1024
CHUNK_MAX = 4 * 1024 * 1024
READ_SIZE = 1024 * 1024

#: Sink for objects a hash produced: (kind, id, canonical bytes).
ObjectSink = Callable[[str, str, bytes], None]


class ScanEntry(NamedTuple):
    """One path found in the working tree (``path`` is ``/``-separated, relative).
    A named tuple: a scan makes one per path."""

    path: str
    type: str  # "file", "dir" or "link"
    size: int
    mtime_ns: int
    ino: int
    executable: bool
    target: str = ""
    #: The name on disk when it is spelled otherwise than ``path`` (another Unicode
    #: form of an indexed name: :func:`metasync.scanner.respell`), else "".
    disk: str = ""


def is_ignored(name: str) -> bool:
    return name == META_DIR or name.startswith(TEMP_PREFIX)


#: Patterns (gitignore syntax) of paths not to synchronise; the file itself is synced.
IGNORE_FILE = ".metasyncignore"


class IgnoreRules:
    """The patterns of ``.metasyncignore``, as git applies ``.gitignore``: they keep
    *untracked* paths out; a path already tracked stays synchronised."""

    def __init__(self, lines: list[str], tracked: Iterable[str] = ()) -> None:
        import pathspec  # only repositories with an ignore file pay for the import

        self.spec = pathspec.GitIgnoreSpec.from_lines(lines)
        self.tracked = set(tracked)
        self.tracked_dirs = {p.rpartition("/")[0] for p in self.tracked}
        for d in list(self.tracked_dirs):
            while d:
                d = d.rpartition("/")[0]
                self.tracked_dirs.add(d)

    @classmethod
    def load(cls, root: Path, tracked: Iterable[str] = ()) -> IgnoreRules | None:
        """The rules of ``root``, or None if it has no (readable) ignore file."""
        try:
            text = (root / IGNORE_FILE).read_text(errors="replace")
        except OSError:
            return None
        return cls(text.splitlines(), tracked)

    def ignores(self, path: str, is_dir: bool) -> bool:
        if path in self.tracked or (is_dir and path in self.tracked_dirs):
            return False
        return self.spec.match_file(path + "/" if is_dir else path)


class Unsynced(NamedTuple):
    """A path a scan found and does not sync: one it cannot read (``reason`` is
    the system's, e.g. ``Permission denied``) or one with no content to sync (a
    FIFO, a socket, a device: ``reason`` says which)."""

    path: str
    reason: str
    folder: bool = False

    def display(self) -> str:
        """The path as the CLI shows it: a folder ends with ``/``."""
        return self.path + "/" if self.folder else self.path


@dataclass
class ScanProblems:
    """What a scan found and could not (``unreadable``) or would not (``special``)
    sync, in the order found."""

    unreadable: list[Unsynced] = field(default_factory=list)
    special: list[Unsynced] = field(default_factory=list)


#: What a special file is called in a report, by file type.
_SPECIAL_KINDS = {
    stat.S_IFIFO: "a FIFO",
    stat.S_IFSOCK: "a socket",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
}


class _ReadCheck:
    """Whether this process may read a file, from the mode bits the scan already has
    (no system call); a file they deny is asked about once more with ``access``
    (ACLs and capabilities may still allow it). Root reads everything."""

    def __init__(self) -> None:
        self.uid = effective_uid()
        self.gids: set[int] = set()
        if sys.platform != "win32":
            self.gids = {os.getegid(), *os.getgroups()}

    def denied(self, path: str, st: os.stat_result) -> bool:
        if self.uid is None:  # Windows: its mode bits say nothing of ACLs; ask it
            return not os.access(path, os.R_OK)
        if self.uid == 0:
            return False
        mode = st.st_mode
        if st.st_uid == self.uid:
            allowed = mode & stat.S_IRUSR
        elif st.st_gid in self.gids:
            allowed = mode & stat.S_IRGRP
        else:
            allowed = mode & stat.S_IROTH
        return not allowed and not os.access(path, os.R_OK, effective_ids=True)


def scan(root: Path, ignore: IgnoreRules | None = None,
         problems: ScanProblems | None = None) -> dict[str, ScanEntry]:
    """Every file, folder and link under ``root`` (not following links), except
    what ``ignore`` excludes. Folders and files this process may not read, and
    special files, are left out and listed in ``problems`` (a folder it cannot
    list or enter is itself in the result, its contents are not).

    One ``lstat`` per path (from ``scandir``) and nothing else for a regular file
    its owner may read: this loop is most of a no-change ``status``."""
    found: dict[str, ScanEntry] = {}
    problems = problems if problems is not None else ScanProblems()
    check = _ReadCheck()
    uid = -1 if check.uid is None else check.uid  # -1: no st_uid is it (Windows asks)
    everything = check.uid == 0  # root reads every file
    new = tuple.__new__  # a ScanEntry without its Python-level __new__
    s_ifmt, s_ifreg, s_ifdir, s_iflnk = 0o170000, stat.S_IFREG, stat.S_IFDIR, stat.S_IFLNK
    s_irusr, s_ixusr = stat.S_IRUSR, stat.S_IXUSR
    stack: list[tuple[str, str]] = [(str(root), "")]
    while stack:
        abs_dir, rel_dir = stack.pop()
        try:
            it = os.scandir(abs_dir)
        except (FileNotFoundError, NotADirectoryError):
            continue  # vanished while scanning: it is simply not there
        except OSError as exc:
            if not rel_dir:
                raise
            problems.unreadable.append(Unsynced(rel_dir, exc.strerror or str(exc), True))
            continue
        prefix = f"{rel_dir}/" if rel_dir else ""
        with it:
            for de in it:
                name = de.name
                if name.startswith(META_DIR) and is_ignored(name):  # TEMP_PREFIX too
                    continue
                rel = prefix + name
                try:
                    st = de.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                except PermissionError as exc:
                    if not rel_dir:
                        raise
                    # Listed but not entered (no search permission): nothing in
                    # it can be read; the folder is what cannot be read.
                    inside = rel_dir + "/"
                    for gone in [k for k in found if k.startswith(inside)]:
                        del found[gone]
                    stack = [(a, r) for a, r in stack if not r.startswith(inside)]
                    problems.unreadable.append(Unsynced(rel_dir, exc.strerror or str(exc), True))
                    break
                mode = st.st_mode
                kind = mode & s_ifmt
                if ignore is not None and ignore.ignores(rel, kind == s_ifdir):
                    continue
                if kind == s_ifreg:
                    if not (everything or (st.st_uid == uid and mode & s_irusr)) and \
                            check.denied(de.path, st):
                        problems.unreadable.append(Unsynced(rel, os.strerror(errno.EACCES)))
                        continue
                    found[rel] = new(ScanEntry, (rel, "file", st.st_size, st.st_mtime_ns,
                                                 st.st_ino, bool(mode & s_ixusr), "", ""))
                elif kind == s_ifdir:
                    found[rel] = ScanEntry(rel, "dir", 0, st.st_mtime_ns, st.st_ino, False)
                    stack.append((de.path, rel))
                elif kind == s_iflnk:
                    target = os.readlink(de.path)
                    size = len(os.fsencode(target))
                    found[rel] = ScanEntry(rel, "link", size, st.st_mtime_ns, st.st_ino, False, target)
                else:  # no content to sync (and opening a FIFO would block)
                    special = _SPECIAL_KINDS.get(kind, "a special file")
                    problems.special.append(Unsynced(rel, special))
    return found


class FileChanged(Exception):
    """The file changed while it was being read; try again later."""


def coarse_time(mtime_ns: int) -> bool:
    """True if ``mtime_ns`` has nothing below 10 ms: a file system that keeps times
    to 2 s (FAT), 1 s (HFS+) or 10 ms (exFAT), where a file rewritten with as many
    bytes in the same tick keeps its size, mtime and inode. (On one that keeps
    nanoseconds, a time that falls on a whole 10 ms is one in ten million.)"""
    return mtime_ns % 10_000_000 == 0


def content_is(chunker: Chunker | None, fd: int, name: str, path: str,
               st: os.stat_result, ref: str) -> bool:
    """Whether the regular file ``name`` in folder ``fd`` -- ``st`` its lstat, whose
    size and mtime the caller found as it recorded them along with content ``ref``
    -- still holds that content, as far as can be told before removing it. Where
    timestamps are fine the stat tells; where they are coarse (:func:`coarse_time`)
    a rewrite of as many bytes within the tick keeps them, so the content is hashed
    with ``chunker`` and compared. False where it cannot tell: no chunker or
    ``ref``, or the file cannot be read or changes meanwhile."""
    if not coarse_time(st.st_mtime_ns):
        return True
    if chunker is None or not ref:
        return False
    try:
        expect = ScanEntry(path, "file", st.st_size, st.st_mtime_ns, st.st_ino, False)
        return chunker.hash_file(name, expect, None, dir_fd=fd).ref == ref
    except (FileChanged, OSError):
        return False


@dataclass(frozen=True)
class HashedFile:
    """A file's content as objects: ``type`` is ``file`` (one blob) or ``chunked``."""

    type: str
    ref: str
    size: int
    blobs: int


class Chunker:
    """Splits files into content-defined chunks and names them."""

    def __init__(self, hasher: ObjectHasher) -> None:
        self.hasher = hasher

    def hash_file(self, path: Path | str, expect: ScanEntry, sink: ObjectSink | None,
                  dir_fd: int | None = None) -> HashedFile:
        """Read ``path`` once, stream its chunks to ``sink`` and return its reference.
        With ``dir_fd``, ``path`` is a name in that folder, and a link is not followed.

        Raises :class:`FileChanged` if the file's size or mtime moved during the read
        (a file still being written must not be committed half-written)."""
        if expect.size <= CHUNK_MIN:
            return self._hash_small(path, expect, sink, dir_fd)
        chunks: list[Chunk] = []
        opener = _open_nonblocking if dir_fd is None else _opener_at(dir_fd)
        with open(path, "rb", buffering=0, opener=opener) as fh:
            st = os.fstat(fh.fileno())
            if (not stat.S_ISREG(st.st_mode) or st.st_size != expect.size
                    or st.st_mtime_ns != expect.mtime_ns):
                raise FileChanged(str(path))
            from pyfastcdc import FastCDC  # not loaded by status (start-up time)

            # FastCDC objects are not thread-safe; one per call is cheap. Its stream
            # reader holds 2 * CHUNK_MAX bytes: a file up to that size is read whole.
            cdc = FastCDC(CHUNK_AVG, min_size=CHUNK_MIN, max_size=CHUNK_MAX)
            small = st.st_size <= 2 * CHUNK_MAX
            for piece in cdc.cut_buf(read_upto(fh.read, st.st_size + 1)) if small else cdc.cut_stream(fh):
                self._emit(piece.data, piece.offset, chunks, sink)
            after = os.fstat(fh.fileno())
        size = sum(c.length for c in chunks)
        if after.st_size != expect.size or after.st_mtime_ns != expect.mtime_ns or size != expect.size:
            raise FileChanged(str(path))
        if len(chunks) == 1:
            return HashedFile("file", chunks[0].blob_id, size, 1)
        obj = FileObject(size, tuple(chunks))
        data = obj.to_bytes()
        file_id = self.hasher.id_of("file", data)
        if sink is not None:
            sink("file", file_id, data)
        return HashedFile("chunked", file_id, size, len(chunks))

    def _hash_small(self, path: Path | str, expect: ScanEntry, sink: ObjectSink | None,
                    dir_fd: int | None) -> HashedFile:
        """:meth:`hash_file` of a file the scan saw at most CHUNK_MIN long (most files):
        one blob, read with no file object."""
        flags = os.O_RDONLY | O_CLOEXEC | O_NONBLOCK | getattr(os, "O_BINARY", 0)
        fd = os.open(path, flags) if dir_fd is None else os.open(
            path, flags | O_NOFOLLOW, dir_fd=dir_fd)
        try:
            st = os.fstat(fd)
            # One byte more than expected is read: a file that grew.
            data = (read_upto(partial(os.read, fd), expect.size + 1)
                    if stat.S_ISREG(st.st_mode) else b"")
            after = os.fstat(fd)
        finally:
            os.close(fd)
        if (not stat.S_ISREG(st.st_mode) or len(data) != expect.size
                or {st.st_size, after.st_size} != {expect.size}
                or {st.st_mtime_ns, after.st_mtime_ns} != {expect.mtime_ns}):
            raise FileChanged(str(path))
        blob_id = self.hasher.id_of("blob", data)
        if sink is not None:
            sink("blob", blob_id, data)
        return HashedFile("file", blob_id, len(data), 1)

    def _emit(self, data: bytes | memoryview, offset: int, chunks: list[Chunk],
              sink: ObjectSink | None) -> None:
        if not data:
            return
        blob_id = self.hasher.id_of("blob", data)
        chunks.append(Chunk(blob_id, offset, len(data)))
        if sink is not None:
            sink("blob", blob_id, bytes(data))


def read_upto(read: Callable[[int], bytes | None], limit: int) -> bytes:
    """Up to ``limit`` bytes from ``read`` (a file's ``read`` or ``os.read`` on its
    descriptor), fewer only at its end: one read may return less than asked (a FUSE
    or network file system, a signal)."""
    parts: list[bytes] = []
    got = 0
    while got < limit and (more := read(limit - got)):
        parts.append(more)
        got += len(more)
    return parts[0] if len(parts) == 1 else b"".join(parts)


def _open_nonblocking(path: str, flags: int) -> int:
    """An ``open()`` opener that never blocks: a FIFO put where the scan saw a file
    opens at once (and is refused as no longer a regular file); on a regular file
    ``O_NONBLOCK`` changes nothing."""
    return os.open(path, flags | O_NONBLOCK)


def _opener_at(dir_fd: int) -> Callable[[str, int], int]:
    """An ``open()`` opener of names in folder ``dir_fd`` that never follows a link
    (nor blocks, as :func:`_open_nonblocking`)."""
    return lambda name, flags: os.open(name, flags | O_NOFOLLOW | O_NONBLOCK, dir_fd=dir_fd)


def temp_name() -> str:
    """A fresh name for a temporary file beside the file it will become."""
    return f"{TEMP_PREFIX}{os.urandom(6).hex()}"


#: Opens a folder, failing on a symbolic link (ELOOP) or anything not a folder (ENOTDIR).
_FOLDER_FLAGS = os.O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC
#: What opening a path that is not a real folder fails with.
NOT_A_FOLDER = (errno.ELOOP, errno.ENOTDIR)


#: Folders a :class:`Folders` keeps open at most (besides those in use): well under
#: the usual limit of 1024 open files, and more than the folders a checkout of a
#: source tree writes into at once (it writes folder by folder, in pack order).
FOLDER_FDS = 512

#: Called with (parent folder's descriptor, name, path) for something that is not a
#: folder where a folder must be made; it must remove it (rename or unlink) or raise.
InTheWay = Callable[[int, str, str], None]


@dataclass
class _OpenFolder:
    fd: int
    pins: int = 0
    #: Forgotten (renamed or removed by us) while in use: closed at its last release.
    gone: bool = False


class Folders:
    """The folders of a tree, opened by relative path without following links.

    Every folder is opened relative to its parent's descriptor with ``O_NOFOLLOW |
    O_DIRECTORY``, starting at ``root`` (which the user named: a link there is
    followed), so a symbolic link anywhere on a path -- one that history put in the
    place of a folder, or one a local process swapped in during a checkout -- is
    never followed: writes, renames and deletes use ``dir_fd`` relative to the
    folder that was checked, never a path resolved again. Descriptors are cached
    (at most :data:`FOLDER_FDS` besides those in use, least recently used go
    first) and pinned while in use, so worker threads can use them; :meth:`close`
    closes them all. Thread-safe.
    """

    def __init__(self, root: Path, capacity: int | None = None) -> None:
        self.root = root
        self.capacity = FOLDER_FDS if capacity is None else capacity
        self._lock = threading.RLock()
        self._cache: OrderedDict[str, _OpenFolder] = OrderedDict()
        self._by_fd: dict[int, _OpenFolder] = {}
        if sys.platform == "win32":  # no folder descriptors there (no dir_fd)
            raise UsageError("writing the folder on Windows is not supported yet (it needs "
                             "folder descriptors); use WSL, or metasync on another system")
        root_fd = os.open(root, os.O_RDONLY | O_DIRECTORY | O_CLOEXEC)
        self._root = _OpenFolder(root_fd, pins=1)  # never evicted
        self._cache[""] = self._root
        self._by_fd[root_fd] = self._root

    # ------------------------------------------------------------ pinned descriptors
    def open(self, rel: str) -> int | None:
        """The folder ``rel`` (``""``: the root), pinned until :meth:`release`; None
        if some part of the path is missing or is not a real folder (a link, a
        file): then there is nothing at or under ``rel`` in this tree."""
        with self._lock:
            entry = self._walk(rel, None)
            if entry is None:
                return None
            entry.pins += 1
            self._evict()
            return entry.fd

    def make(self, rel: str, in_the_way: InTheWay) -> int:
        """The folder ``rel``, pinned until :meth:`release`, creating missing folders;
        a link or file in the place of one is handed to ``in_the_way`` (which moves it
        aside or raises) and a folder made instead."""
        with self._lock:
            entry = self._walk(rel, in_the_way)
            assert entry is not None
            entry.pins += 1
            self._evict()
            return entry.fd

    def release(self, fd: int) -> None:
        """Unpin a descriptor :meth:`open` or :meth:`make` returned."""
        with self._lock:
            entry = self._by_fd[fd]
            entry.pins -= 1
            if entry.pins == 0 and entry.gone:
                del self._by_fd[fd]
                os.close(fd)
            self._evict()

    @contextmanager
    def opened(self, rel: str) -> Iterator[int | None]:
        """:meth:`open` for a ``with`` block."""
        fd = self.open(rel)
        try:
            yield fd
        finally:
            if fd is not None:
                self.release(fd)

    @contextmanager
    def made(self, rel: str, in_the_way: InTheWay) -> Iterator[int]:
        """:meth:`make` for a ``with`` block."""
        fd = self.make(rel, in_the_way)
        try:
            yield fd
        finally:
            self.release(fd)

    @contextmanager
    def cursor(self, in_the_way: InTheWay | None = None) -> Iterator[FolderCursor]:
        """A :class:`FolderCursor` over these folders for a ``with`` block."""
        cur = FolderCursor(self, in_the_way)
        try:
            yield cur
        finally:
            cur.close()

    def forget(self, rel: str) -> None:
        """Drop ``rel`` and everything under it: the caller renamed or removed it."""
        with self._lock:
            prefix = rel + "/"
            for key in [k for k in self._cache if k == rel or k.startswith(prefix)]:
                entry = self._cache.pop(key)
                if entry.pins:
                    entry.gone = True
                else:
                    del self._by_fd[entry.fd]
                    os.close(entry.fd)

    def move_aside(self, fd: int, path: str, device: str, stamp: str) -> str:
        """Rename ``path``, an entry of the open folder ``fd``, to a free conflict name
        in that folder (:func:`conflict_name`); return the new path."""
        parent, _, name = path.rpartition("/")
        new_name = conflict_name(name, device, stamp)
        n = 2
        while lstat_at(fd, new_name) is not None:
            new_name = conflict_name(name, f"{device} {n}", stamp)
            n += 1
        os.rename(name, new_name, src_dir_fd=fd, dst_dir_fd=fd)
        self.forget(path)  # if it was a folder, its descriptors name the copy now
        return f"{parent}/{new_name}" if parent else new_name

    def close(self) -> None:
        """Close every descriptor (none may be in use any more)."""
        with self._lock:
            for entry in self._by_fd.values():
                os.close(entry.fd)
            self._by_fd.clear()
            self._cache.clear()

    def __enter__(self) -> Folders:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------ inside the lock
    def _walk(self, rel: str, in_the_way: InTheWay | None) -> _OpenFolder | None:
        entry = self._cache.get(rel)
        if entry is not None:
            self._cache.move_to_end(rel)
            return entry
        parent_rel, _, name = rel.rpartition("/")
        parent = self._walk(parent_rel, in_the_way)
        if parent is None:
            return None
        parent.pins += 1  # kept open while its child is opened
        try:
            fd = self._open_child(parent.fd, name, rel, in_the_way)
        finally:
            parent.pins -= 1
        if fd is None:
            return None
        entry = _OpenFolder(fd)
        self._cache[rel] = entry
        self._by_fd[fd] = entry
        return entry

    @staticmethod
    def _open_child(parent_fd: int, name: str, rel: str, in_the_way: InTheWay | None) -> int | None:
        try:
            return os.open(name, _FOLDER_FLAGS, dir_fd=parent_fd)
        except FileNotFoundError:
            if in_the_way is None:
                return None
        except OSError as exc:
            if exc.errno in NAME_REFUSED and in_the_way is None:
                return None  # a name this file system cannot hold is not here
            if exc.errno not in NOT_A_FOLDER:
                raise
            if in_the_way is None:
                return None
            in_the_way(parent_fd, name, rel)
        try:
            os.mkdir(name, dir_fd=parent_fd)
        except FileExistsError:
            pass  # made meanwhile (by another process): opened below, never followed
        except OSError as exc:
            # Nothing is there (opening it said so) in a folder that is open: ENOENT
            # or EPERM is the name (exfat-fuse, fusefat), not the path.
            if exc.errno in (errno.ENOENT, errno.EPERM):
                raise NameRefused(name) from exc
            raise
        return os.open(name, _FOLDER_FLAGS, dir_fd=parent_fd)

    def _evict(self) -> None:
        excess = len(self._cache) - self.capacity
        if excess <= 0:
            return
        # The least recently used unpinned ones, found in one pass that stops as soon
        # as it has enough (not a copy of the whole cache on every call).
        victims: list[str] = []
        for key, entry in self._cache.items():
            if entry.pins == 0:
                victims.append(key)
                if len(victims) == excess:
                    break
        for key in victims:
            entry = self._cache.pop(key)
            del self._by_fd[entry.fd]
            os.close(entry.fd)


class FolderCursor:
    """Holds one folder of a :class:`Folders` at a time, for loops over paths that
    come folder by folder (a pack's files, a batch of renames): the folder is
    looked up once per run of paths in it, not once per path."""

    def __init__(self, folders: Folders, in_the_way: InTheWay | None) -> None:
        self.folders = folders
        self.in_the_way = in_the_way
        self._rel: str | None = None
        self._fd: int | None = None

    def at(self, rel: str) -> int | None:
        """The folder ``rel``: made (with ``in_the_way``) or only opened (None if it is
        not a real folder), as :meth:`Folders.make` and :meth:`Folders.open`."""
        if rel != self._rel:
            self.close()
            if self.in_the_way is not None:
                self._fd = self.folders.make(rel, self.in_the_way)
            else:
                self._fd = self.folders.open(rel)
            self._rel = rel
        return self._fd

    def close(self) -> None:
        if self._fd is not None:
            self.folders.release(self._fd)
        self._rel, self._fd = None, None


def lstat_at(fd: int, name: str) -> os.stat_result | None:
    """The entry ``name`` of the folder ``fd`` (a link is not followed); None if absent."""
    try:
        return os.stat(name, dir_fd=fd, follow_symlinks=False)
    except FileNotFoundError:
        return None


def lstat_name(fd: int, name: str) -> os.stat_result | None:
    """:func:`lstat_at`, where a name this file system refuses is simply absent."""
    try:
        return lstat_at(fd, name)
    except OSError as exc:
        if exc.errno in NAME_REFUSED:
            return None
        raise


def remove_stale_temps(root: Path) -> int:
    """Delete temporary files (and links) a crashed command left behind; return how
    many. Walks by folder descriptors, never through a link."""
    if sys.platform == "win32":
        return _remove_stale_temps_by_path(root)
    removed = 0
    for _, dirnames, filenames, dir_fd in os.fwalk(root):
        # A temporary link to a folder is listed with the folders (not descended into).
        stale = [n for n in (*filenames, *dirnames) if n.startswith(TEMP_PREFIX)]
        dirnames[:] = [d for d in dirnames if d != META_DIR and not d.startswith(TEMP_PREFIX)]
        for name in stale:
            st = lstat_at(dir_fd, name)
            if st is None or stat.S_ISDIR(st.st_mode):
                continue
            try:
                os.unlink(name, dir_fd=dir_fd)
                removed += 1
            except FileNotFoundError:
                pass
    return removed


def _remove_stale_temps_by_path(root: Path) -> int:
    """:func:`remove_stale_temps` where there are no folder descriptors (Windows):
    ``os.walk`` follows no link to a folder, and each name is checked before it
    is removed."""
    removed = 0
    for dirpath, dirnames, filenames in os.walk(root):
        stale = [n for n in (*filenames, *dirnames) if n.startswith(TEMP_PREFIX)]
        dirnames[:] = [d for d in dirnames if d != META_DIR and not d.startswith(TEMP_PREFIX)]
        for name in stale:
            path = os.path.join(dirpath, name)
            try:
                if not stat.S_ISDIR(os.lstat(path).st_mode):
                    os.unlink(path)
                    removed += 1
            except FileNotFoundError:
                pass
    return removed


def file_mode(executable: bool) -> int:
    umask = os.umask(0)
    os.umask(umask)
    return (0o777 if executable else 0o666) & ~umask


#: Longest file name, in bytes, most filesystems accept.
MAX_NAME_BYTES = 255


def conflict_name(name: str, device: str, when: str) -> str:
    """``NAME (conflict DEVICE YYYY-MM-DD HHMMSS).EXT``: the extension stays last so
    applications still open the copy. NAME is shortened if the result would pass
    MAX_NAME_BYTES."""
    stem, dot, ext = name.rpartition(".")
    if not dot or not stem or len(os.fsencode(ext)) > MAX_NAME_BYTES // 2:
        stem, ext = name, ""  # no extension, or one too long to keep whole
    suffix = f" (conflict {device} {when})" + (f".{ext}" if ext else "")
    budget = MAX_NAME_BYTES - len(os.fsencode(suffix))
    while len(os.fsencode(stem)) > budget and stem:
        stem = stem[:-1]
    return f"{stem}{suffix}"


def write_durable(path: Path, data: bytes) -> None:
    """Temp file, fsync, rename: ``path`` holds all of ``data`` or does not exist."""
    tmp = path.with_name(f".tmp-{os.urandom(6).hex()}")
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def write_private(path: Path, data: bytes) -> None:
    """Create ``path`` readable by its owner only (0600), durably; fails if it exists."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
