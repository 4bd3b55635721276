"""Writing stored content to files: the checkout's and restore's one writer.

A file or link of a tree is written to a temporary name beside its target (the
caller renames it into place in the same folder); blobs are read in groups of
bounded size, each checked against the tree's length, and runs of zeros are
left as holes, so a sparse file stays sparse.
"""

from __future__ import annotations

import os

from metasync.context import RepoContext
from metasync.errors import CorruptObject
from metasync.graph import ObjectGraph
from metasync.objects import TreeEntry
from metasync.portable import O_CLOEXEC, O_NOFOLLOW, SYNC_ALL_FLUSHES_FILES
from metasync.worktree import CHUNK_MAX, temp_name


class FileWriter:
    """Writes files and links of stored content to temporary files in an open
    folder (the caller renames them into place in the same folder)."""

    def __init__(self, ctx: RepoContext, graph: ObjectGraph) -> None:
        self.ctx = ctx
        self.graph = graph

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
        if entry.type == "link":
            os.symlink(entry.ref, tmp, dir_fd=folder)
            return tmp, None
        mode = self.ctx.file_modes[entry.executable]
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | O_NOFOLLOW | O_CLOEXEC,
                     mode, dir_fd=folder)
        try:
            with os.fdopen(fd, "wb") as fh:
                holes = False
                for group in chunk_groups(chunks):
                    data = prefetched if prefetched is not None else self.graph.read_blobs(group)
                    for blob_id, length in group:
                        piece = data[blob_id]
                        if len(piece) != length:
                            raise CorruptObject(
                                f"blob {blob_id[:12]} of {entry.name!r} has the wrong length "
                                f"({len(piece)} bytes where its tree says {length})")
                        if all_zero(piece):
                            fh.seek(length, os.SEEK_CUR)  # a hole: a sparse file stays sparse
                            holes = True
                        else:
                            fh.write(piece)
                        self.ctx.reporter.advance(length)
                if holes:
                    fh.truncate()  # the size, if the file ends in a hole
                fh.flush()
                if durable or not SYNC_ALL_FLUSHES_FILES:
                    os.fsync(fh.fileno())
                st = os.fstat(fh.fileno())
        except BaseException:
            os.unlink(tmp, dir_fd=folder)
            raise
        return tmp, st


#: Zeros to compare chunks with (a chunk is at most CHUNK_MAX bytes; allocated by
#: calloc, so its pages cost nothing until read, and then map the zero page).
_ZEROS = bytes(CHUNK_MAX)


def all_zero(data: bytes) -> bool:
    """True if ``data`` (not empty) is all zero bytes. A chunk with content almost
    always fails on its first or last byte; the others are compared by one memcmp
    (``startswith``), which stops at the first non-zero byte."""
    return (bool(data) and not data[0] and not data[-1] and len(data) <= CHUNK_MAX
            and _ZEROS.startswith(data))


def chunk_groups(chunks: list[tuple[str, int]], budget: int = 8 * 1024 * 1024) -> list[list[tuple[str, int]]]:
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
