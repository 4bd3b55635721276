"""Reading any version without checking it out: the versions, their trees, and
files read by range (what ``metasync mount`` shows, docs/mount.md).

:class:`VersionReader` names the versions there are to read -- ``latest`` (master,
re-learned at most every ``poll`` seconds, and then only when a ``latest`` hint
moved), the numbered versions this client knows (the numbers ``metasync log``
shows), the snapshots, and every commit of master's first-parent line by date --
and gives each one's tree. Listing costs only commits and trees (from the local
object cache, else fetched once and cached there); no file content is read.

:meth:`VersionReader.open_file` returns a :class:`FileReader`: ``read(offset,
size)`` fetches only the chunks covering that range, each through
:meth:`ObjectGraph.read_blobs` -- a range read of its pack, from the holder the
store expects to answer first, falling back to the other holders on any error or
failed check, and verified by the codec. Fetched chunks are kept in a
:class:`ChunkCache` (a bounded folder, least recently used dropped first), checked
again against their id when read back from it.
"""

from __future__ import annotations

import os
import tempfile
import time
from bisect import bisect_right
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from metasync.context import RepoContext
from metasync.errors import MetasyncError
from metasync.graph import ObjectGraph
from metasync.layout import HINT_KEY
from metasync.objects import Commit, TreeEntry, Version
from metasync.retention import commit_datetime
from metasync.versions import Versions

#: Default bound of the chunk cache on disk.
DEFAULT_CACHE_SIZE = 1024 * 1024 * 1024
#: Decoded chunks kept in memory: a file read 128 KiB at a time by the kernel
#: reads each chunk many times in a row.
MEMORY_CHUNKS = 8
#: Trees kept in memory (a flattened tree of a big version is big).
MEMORY_TREES = 16
#: Bytes of the following chunks fetched with a sequential read's missing ones
#: (one range request of a pack carries them: a copy of a big file goes at the
#: backend's throughput, not one round trip per chunk).
READAHEAD = 4 * 1024 * 1024
#: Every this many looks, the latest version is learned even if no hint moved (a
#: client that died between deciding a version and writing its hints).
FULL_CHECK_EVERY = 10
#: The chunk cache's folder inside ``.metasync``.
CACHE_DIR = "mount-cache"


class ChunkCache:
    """Blobs fetched for reads, by id, in a folder of at most ``limit`` bytes.

    The least recently used are removed first. Every blob read back is checked
    against its id (``check``): a damaged file is dropped and fetched again.
    Writes are atomic (temporary file, rename), so several mounts of one
    repository can share the folder. ``limit`` 0 keeps nothing on disk."""

    def __init__(self, folder: Path, limit: int, check: Callable[[str, bytes], bool]) -> None:
        self.folder = folder
        self.limit = limit
        self.check = check
        self.memory: OrderedDict[str, bytes] = OrderedDict()
        #: Blob id -> size of the files on disk, least recently used first.
        self.disk: OrderedDict[str, int] = OrderedDict()
        if limit > 0:
            folder.mkdir(parents=True, exist_ok=True)
            found = []
            for entry in os.scandir(folder):
                if entry.name.startswith("."):  # a temporary file a crash left
                    os.unlink(entry.path)
                    continue
                st = entry.stat()
                found.append((st.st_mtime, entry.name, st.st_size))
            for _, name, size in sorted(found):
                self.disk[name] = size
            self._evict()

    @property
    def used(self) -> int:
        """Bytes on disk."""
        return sum(self.disk.values())

    def has(self, blob_id: str) -> bool:
        """Whether ``blob_id`` is kept (in memory or on disk; not checked here)."""
        return blob_id in self.memory or blob_id in self.disk

    def get(self, blob_id: str) -> bytes | None:
        data = self.memory.get(blob_id)
        if data is not None:
            self.memory.move_to_end(blob_id)
            return data
        if blob_id not in self.disk:
            return None
        path = self.folder / blob_id
        try:
            data = path.read_bytes()
        except OSError:
            data = None
        if data is None or not self.check(blob_id, data):
            self._drop(blob_id)
            return None
        self.disk.move_to_end(blob_id)
        os.utime(path)  # the order survives a restart
        self._remember(blob_id, data)
        return data

    def put(self, blob_id: str, data: bytes) -> None:
        self._remember(blob_id, data)
        if blob_id in self.disk or len(data) > self.limit:
            return
        fd, tmp = tempfile.mkstemp(dir=self.folder, prefix=".")
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
            os.replace(tmp, self.folder / blob_id)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        self.disk[blob_id] = len(data)
        self._evict()

    def _remember(self, blob_id: str, data: bytes) -> None:
        self.memory[blob_id] = data
        self.memory.move_to_end(blob_id)
        while len(self.memory) > MEMORY_CHUNKS:
            self.memory.popitem(last=False)

    def _evict(self) -> None:
        total = self.used
        while total > self.limit and self.disk:
            oldest, size = next(iter(self.disk.items()))
            self._drop(oldest)
            total -= size

    def _drop(self, blob_id: str) -> None:
        self.disk.pop(blob_id, None)
        (self.folder / blob_id).unlink(missing_ok=True)


class FileReader:
    """One file of one version, read by range (see the module docstring)."""

    def __init__(self, graph: ObjectGraph, cache: ChunkCache, entry: TreeEntry) -> None:
        self.graph = graph
        self.cache = cache
        self.size = entry.size
        #: (blob id, length) of each chunk, and where each starts in the file.
        self.chunks = graph.file_chunks(entry) if entry.type in ("file", "chunked") else []
        self.starts: list[int] = []
        #: Where the last read ended: a read starting there is sequential.
        self.next_offset = 0
        offset = 0
        for _, length in self.chunks:
            self.starts.append(offset)
            offset += length

    def read(self, offset: int, size: int) -> bytes:
        """Up to ``size`` bytes from ``offset`` (fewer at the end of the file).
        Only the chunks covering the range are fetched (those not cached, in one
        batch: nearby ones of one pack come in one range request) -- and, when the
        read follows the previous one, the next :data:`READAHEAD` bytes of chunks."""
        end = min(offset + size, self.size)
        if offset >= end:
            return b""
        sequential, self.next_offset = offset == self.next_offset, end
        first = bisect_right(self.starts, offset) - 1
        last = bisect_right(self.starts, end - 1) - 1
        wanted = self.chunks[first:last + 1]
        have = {b: d for b, _ in wanted if (d := self.cache.get(b)) is not None}
        missing = {b: (b, n) for b, n in wanted if b not in have}
        if missing and sequential:
            ahead = 0
            for blob_id, length in self.chunks[last + 1:]:
                if ahead >= READAHEAD:
                    break
                ahead += length
                if not self.cache.has(blob_id):
                    missing.setdefault(blob_id, (blob_id, length))
        if missing:
            fetched = self.graph.read_blobs(list(missing.values()))
            for blob_id in missing:
                self.cache.put(blob_id, fetched[blob_id])
            have.update(fetched)
        out = b"".join(have[b] for b, _ in wanted)
        start = offset - self.starts[first]
        return out[start:start + end - offset]


@dataclass(frozen=True)
class VersionTree:
    """One commit's tree, flattened, with each folder's names."""

    commit_id: str
    time_ns: int
    paths: dict[str, TreeEntry]
    children: dict[str, list[str]]


class VersionReader:
    """The versions of one repository and their files (see the module docstring).
    Not thread-safe: one thread (the mount's) uses it."""

    def __init__(self, ctx: RepoContext, versions: Versions, graph: ObjectGraph, *,
                 cache_size: int = DEFAULT_CACHE_SIZE, poll: float = 30.0,
                 cache_dir: Path | None = None, share_folder: bool = False) -> None:
        """``cache_size``: bytes of fetched content kept on disk, in ``cache_dir``
        (default ``.metasync/mount-cache``); ``poll``: seconds between looks for a
        new version; ``share_folder``: let other commands (and the daemon) have the
        folder while this reader lives (it then writes nothing but
        content-addressed caches)."""
        if share_folder:
            ctx.share_folder()
        self.ctx = ctx
        self.versions = versions
        self.graph = graph
        self.poll = poll
        codec = ctx.codec
        self.cache = ChunkCache(cache_dir or ctx.meta / CACHE_DIR, cache_size,
                                lambda blob_id, data: codec.id_of("blob", data) == blob_id)
        self._latest: Version | None = None
        self._checked = 0.0
        self._looks = 0
        self._hints: dict[str, str | None] = {}
        #: Versions learned while running: number -> master.
        self._learned: dict[int, str] = {}
        self._trees: OrderedDict[str, VersionTree] = OrderedDict()
        self._by_date: tuple[str, dict[str, str]] | None = None
        self._numbered: tuple[float, Version, dict[int, str]] | None = None
        self._collected: tuple[tuple[str, int], Callable[[Commit], bool]] | None = None

    # ---------------------------------------------------------------- versions
    def latest(self) -> Version:
        """The newest decided version, learned again when ``poll`` seconds have
        passed since the last look and a ``latest`` hint of an acceptor moved (an
        acceptor that does not answer is skipped), or at every
        :data:`FULL_CHECK_EVERY`-th look. A failure keeps the last one."""
        now = time.monotonic()
        if self._latest is not None and now - self._checked < self.poll:
            return self._latest
        self._checked = now
        self._looks += 1
        hints = self._read_hints()
        if self._latest is None or hints != self._hints or self._looks % FULL_CHECK_EVERY == 0:
            try:
                self._latest = self.versions.learn_latest()
                self._hints = hints
            except MetasyncError as exc:
                if self._latest is None:
                    raise
                self.ctx.reporter.note(f"could not learn the latest version: {exc}")
            if self._latest.master is not None:
                self._learned.setdefault(self._latest.number, self._latest.master)
        return self._latest

    def _read_hints(self) -> dict[str, str | None]:
        """Each reachable acceptor's change token of the ``latest`` hint."""
        config = self.versions.config
        tokens: dict[str, str | None] = {}
        for backend_id in config.acceptors:
            backend = self.versions.backends.get(backend_id)
            if backend is None:
                continue
            try:
                tokens[backend_id] = backend.poll(HINT_KEY)
            except MetasyncError:
                continue
        return tokens

    def numbered(self) -> dict[int, str]:
        """Version number -> master, for every version this client knows the number
        of (those it synchronised with, as ``metasync log`` numbers them, and those
        learned while running), without collected ones. Worked out again only when
        the latest version moved or ``poll`` seconds passed (every ``stat`` in the
        mount asks)."""
        latest = self.latest()
        now = time.monotonic()
        memo = self._numbered
        if memo is not None and memo[1] == latest and now - memo[0] < self.poll:
            return memo[2]
        out = {n: c for c, n in self.ctx.db.master_numbers().items()}
        prev = self.ctx.state.prev
        if prev.master is not None and prev.master not in out.values():
            out[prev.number] = prev.master
        for number, master in self._learned.items():
            if master not in out.values():
                out[number] = master
        kept = {n: c for n, c in out.items() if self._kept(c, latest)}
        self._numbered = (now, latest, kept)
        return kept

    def snapshots(self) -> dict[str, str]:
        """Snapshot name -> commit, as the latest configuration names them."""
        return dict(self.versions.load_config(self.latest().config).snapshots)

    def by_date(self) -> dict[str, str]:
        """``YYYY-MM-DD-HHMMSS`` (local time; ``-2``, ``-3``... for more in one
        second) -> commit, for master and its first parents still kept."""
        latest = self.latest()
        if latest.master is None:
            return {}
        if self._by_date is not None and self._by_date[0] == latest.master:
            return self._by_date[1]
        out: dict[str, str] = {}
        line = [(c, commit) for c, commit in self.graph.first_parents(latest.master)
                if self._kept(c, latest, commit)]
        for commit_id, commit in reversed(line):
            # Local time, clamped: a commit's time is untrusted (year 99999 must not raise).
            stamp = commit_datetime(commit.time_ns, None).strftime("%Y-%m-%d-%H%M%S")
            name, n = stamp, 1
            while name in out:
                n += 1
                name = f"{stamp}-{n}"
            out[name] = commit_id
        self._by_date = (latest.master, out)
        return out

    def _kept(self, commit_id: str, latest: Version, commit: Commit | None = None) -> bool:
        """False for a commit whose content a gc collected -- restore's own test
        (:meth:`ObjectGraph.collected_test`), so the mount shows what restore reads."""
        if latest.master is None:
            return True
        config = self.versions.load_config(latest.config)
        memo = self._collected
        if memo is None or memo[0] != (latest.master, config.gc_cutoff_ns):
            memo = ((latest.master, config.gc_cutoff_ns),
                    self.graph.collected_test(latest.master, config.gc_cutoff_ns))
            self._collected = memo
        return not memo[1](commit or self.graph.load_commit(commit_id))

    def commit_time(self, commit_id: str) -> int:
        """When ``commit_id`` was made (ns since the epoch)."""
        return self.graph.load_commit(commit_id).time_ns

    # ---------------------------------------------------------------- trees and files
    def tree(self, commit_id: str) -> VersionTree:
        """``commit_id``'s tree (trees fetched once, then from the local cache)."""
        found = self._trees.get(commit_id)
        if found is not None:
            self._trees.move_to_end(commit_id)
            return found
        commit = self.graph.load_commit(commit_id)
        paths = self.graph.tree_at(commit_id)
        children: dict[str, list[str]] = {"": []}
        for path, entry in paths.items():
            parent, _, name = path.rpartition("/")
            children.setdefault(parent, []).append(name)
            if entry.type == "dir":
                children.setdefault(path, [])
        tree = VersionTree(commit_id, commit.time_ns, paths, children)
        self._trees[commit_id] = tree
        while len(self._trees) > MEMORY_TREES:
            self._trees.popitem(last=False)
        return tree

    def open_file(self, commit_id: str, path: str) -> FileReader:
        """A reader of file ``path`` (``/``-separated, relative) of ``commit_id``;
        KeyError if it is not a file there."""
        entry = self.tree(commit_id).paths[path]
        if entry.type not in ("file", "chunked"):
            raise KeyError(path)
        return FileReader(self.graph, self.cache, entry)
