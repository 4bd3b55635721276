"""Writing stored content to files: the checkout's and restore's one writer.

A file or link of a tree is written to a temporary name beside its target (the
caller renames it into place in the same folder), or at its own name where a
fresh clone has nothing to protect (docs/design.md, "Writing the folder"); blobs
are read in groups of bounded size, each checked against the tree's length, and
runs of zeros are left as holes, so a sparse file stays sparse.
"""

from __future__ import annotations

import errno
import os
import threading

from metasync.context import InPlaceWrite, RepoContext
from metasync.errors import CorruptObject
from metasync.faults import crash_point
from metasync.fstraits import NAME_REFUSED, cannot_write
from metasync.graph import ObjectGraph
from metasync.objects import TreeEntry
from metasync.portable import O_CLOEXEC, O_NOFOLLOW, SYNC_ALL_FLUSHES_FILES, sync_all
from metasync.worktree import CHUNK_MAX, temp_name

#: What creating a file at its own name may answer that the temporary-file way then
#: sorts out (:meth:`FileWriter.write`): something made there since the scan, or a
#: name the file system refuses (some say so with ENOENT or EPERM).
RETRY_ASIDE = frozenset({errno.EEXIST, errno.ENOENT, errno.EPERM}) | NAME_REFUSED


#: Written in place since the last background flush began, that starts the next.
FLUSH_EVERY = 32 * 1024 * 1024


class EarlyFlush:
    """Files written in place are made durable by one flush at the end
    (:meth:`durable`), before any index row says they are written. Until then a
    thread flushes in the background (``sync_all``) each time :data:`FLUSH_EVERY`
    more bytes were written, one flush at a time: the disk writes while the clone
    computes, and the last flush has only the rest to write (on this machine it
    took 0.3 s of a 3.4 s clone when it had everything)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._since = 0
        self._thread: threading.Thread | None = None

    def wrote(self, size: int) -> None:
        """``size`` more bytes were written in place (any thread)."""
        with self._lock:
            self._since += size
            if self._since < FLUSH_EVERY or (self._thread and self._thread.is_alive()):
                return
            self._since = 0
            self._thread = threading.Thread(target=sync_all, name="metasync-flush", daemon=True)
            self._thread.start()

    def durable(self) -> None:
        """Return once everything written so far is on disk."""
        with self._lock:
            thread, self._thread, self._since = self._thread, None, 0
        if thread is not None:
            thread.join()
        sync_all()


class FileWriter:
    """Writes files and links of stored content into an open folder: to temporary
    files the caller renames into place (:meth:`write_temp`), or -- where nothing is
    there and nothing can be lost (a fresh clone) -- at their own names, once
    (:meth:`write_new`)."""

    def __init__(self, ctx: RepoContext, graph: ObjectGraph) -> None:
        self.ctx = ctx
        self.graph = graph
        #: What was written in place is flushed early and made durable by the caller.
        self.in_place_flush = EarlyFlush()

    def write(
        self, folder: int, name: str, entry: TreeEntry, chunks: list[tuple[str, int]],
        prefetched: dict[str, bytes] | None = None, *, in_place: str | None,
    ) -> tuple[str | None, os.stat_result | None]:
        """Write the file or link ``name`` of the folder open as ``folder``: with
        ``in_place`` (its path in the repository's folder, as on disk), at ``name``
        itself (:meth:`write_new`; the name returned is None; recorded in the
        context's ``written_in_place``), else -- or if something is at ``name`` by
        now, or this file system may refuse the name -- to a temporary name returned
        for the caller to rename."""
        if in_place:
            try:
                fd = self._create(folder, name, entry)
            except OSError as exc:
                # Made since the scan (EEXIST), or a name this file system may refuse
                # (exfat-fuse says ENOENT or EPERM): the rename of a temporary file
                # tells which. Anything else -- no space, a failing disk -- is raised.
                if exc.errno not in RETRY_ASIDE or cannot_write(entry.type, exc) is not None:
                    raise
            else:
                st = self._finish(folder, name, fd, entry, chunks, prefetched)
                self.ctx.written_in_place.append(
                    InPlaceWrite(in_place, st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev,
                                 None, entry.ref)
                    if st is not None else _link_written(folder, name, in_place, entry.ref))
                self.in_place_flush.wrote(entry.size)
                return None, st
        return self.write_temp(folder, entry, chunks, prefetched)

    def write_temp(
        self, folder: int, entry: TreeEntry, chunks: list[tuple[str, int]],
        prefetched: dict[str, bytes] | None = None, *, durable: bool = False,
    ) -> tuple[str, os.stat_result | None]:
        """Write one file or link to a new temporary name in the folder open as
        ``folder`` (a descriptor from :class:`~metasync.worktree.Folders`); return
        the name and, for a file, its final stat (size, mtime and inode survive the
        rename). ``durable`` fsyncs the file (a checkout flushes whole batches
        instead). Every blob's length is checked against the tree."""
        tmp = temp_name()
        return tmp, self.write_new(folder, tmp, entry, chunks, prefetched, durable=durable)

    def write_new(
        self, folder: int, name: str, entry: TreeEntry, chunks: list[tuple[str, int]],
        prefetched: dict[str, bytes] | None = None, *, durable: bool = False,
    ) -> os.stat_result | None:
        """Create ``name`` in the folder open as ``folder`` and write the file or link
        there; return a file's stat (None for a link). Raises ``FileExistsError`` if
        anything is at ``name`` (nothing is ever replaced or followed). A write that
        fails or is interrupted removes what it created, so no file that looks whole
        but is not is left behind (a crash can leave one: the caller records what it
        is writing, and checks it again after a crash)."""
        return self._finish(folder, name, self._create(folder, name, entry), entry, chunks,
                            prefetched, durable=durable)

    def _create(self, folder: int, name: str, entry: TreeEntry) -> int | None:
        """Create ``name`` in ``folder``: a link, whole (None), or an empty file whose
        descriptor is returned. ``FileExistsError`` if anything is there."""
        if entry.type == "link":
            os.symlink(entry.ref, name, dir_fd=folder)
            return None
        # Unbuffered writes on the descriptor: a file costs open, write(s), fstat and
        # close -- no buffer object and its fstat, ioctl and lseek.
        return os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | O_NOFOLLOW | O_CLOEXEC,
                       self.ctx.file_modes[entry.executable], dir_fd=folder)

    def _finish(self, folder: int, name: str, fd: int | None, entry: TreeEntry,
                chunks: list[tuple[str, int]], prefetched: dict[str, bytes] | None,
                *, durable: bool = False) -> os.stat_result | None:
        """Write the content of the file :meth:`_create` made (``fd``; None: a link,
        done) and close it; return its stat. A failure removes the file."""
        if fd is None:
            return None
        try:
            try:
                self._fill(fd, entry, chunks, prefetched)
                if durable or not SYNC_ALL_FLUSHES_FILES:
                    os.fsync(fd)
                return os.fstat(fd)
            finally:
                os.close(fd)
        except BaseException:
            os.unlink(name, dir_fd=folder)
            raise

    def _fill(self, fd: int, entry: TreeEntry, chunks: list[tuple[str, int]],
              prefetched: dict[str, bytes] | None) -> None:
        """Write the content of ``entry`` (its ``chunks``) to the new file ``fd``."""
        holes = False
        many = len(chunks) > 1
        for group in chunk_groups(chunks):
            data = prefetched if prefetched is not None else self.graph.read_blobs(group)
            for blob_id, length in group:
                piece = data[blob_id]
                if len(piece) != length:
                    raise CorruptObject(
                        f"blob {blob_id[:12]} of {entry.name!r} has the wrong length "
                        f"({len(piece)} bytes where its tree says {length})")
                if all_zero(piece):
                    os.lseek(fd, length, os.SEEK_CUR)  # a hole: a sparse file stays sparse
                    holes = True
                else:
                    write_all(fd, piece)
                self.ctx.reporter.advance(length)
                if many:
                    crash_point("write:piece")  # a file left part-written (crash tests)
        if holes:
            os.ftruncate(fd, os.lseek(fd, 0, os.SEEK_CUR))  # the size, if it ends in a hole


def _link_written(folder: int, name: str, path: str, target: str) -> InPlaceWrite:
    """The record of the link just made at ``name`` in ``folder`` (its inode too: a
    link the user made with the same target is not the clone's to remove)."""
    st = os.stat(name, dir_fd=folder, follow_symlinks=False)
    return InPlaceWrite(path, 0, 0, st.st_ino, st.st_dev, target)


def write_all(fd: int, data: bytes) -> None:
    """``os.write`` all of ``data`` to ``fd`` (a write may take less than asked)."""
    done = os.write(fd, data)
    if done < len(data):
        view = memoryview(data)
        while done < len(data):
            done += os.write(fd, view[done:])


#: Zeros to compare chunks with (a chunk is at most CHUNK_MAX bytes; allocated by
#: calloc, so its pages cost nothing until read, and then map the zero page).
_ZEROS = bytes(CHUNK_MAX)


def all_zero(data: bytes) -> bool:
    """True if ``data`` (not empty) is all zero bytes. A chunk with content almost
    always fails on its first or last byte; the others are compared by one memcmp
    (``startswith``), which stops at the first non-zero byte."""
    return (bool(data) and not data[0] and not data[-1] and len(data) <= CHUNK_MAX
            and _ZEROS.startswith(data))


def chunk_groups(chunks: list[tuple[str, int]], budget: int = 4 * 1024 * 1024) -> list[list[tuple[str, int]]]:
    """Split a file's chunks into groups of about ``budget`` bytes (bounded memory)."""
    groups: list[list[tuple[str, int]]] = [[]]
    size = 0
    for blob_id, length in chunks:
        if groups[-1] and size + length > budget:
            groups.append([])
            size = 0
        groups[-1].append((blob_id, length))
        size += length
    return [g for g in groups if g] or [[]]
