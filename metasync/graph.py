"""The object graph: commits, indexes, trees and file contents, read back.

Commits name their tree and the index objects that locate every object the tree
needs (docs/FORMAT.md §6); this module loads them (from the local cache or the
store), flattens trees, walks history, and reads blobs for checkouts and
restores. Everything read is verified by the codec on the way (ids, MACs), and
metadata objects are cached locally so an unchanged history costs no reads.
"""

from __future__ import annotations

import sqlite3
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from metasync.context import RepoContext
from metasync.errors import CorruptObject, ObjectUnavailable
from metasync.localdb import location_in
from metasync.objects import Commit, FileObject, Index, PackEntry, Tree, TreeEntry

#: Worker threads' own read-only connections to the local database.
_thread_conns = threading.local()

#: :meth:`ObjectGraph.ancestry` reads at most this many commits of the newer side
#: before it gives up undecided: a client that many commits behind pays for no
#: more (each may be one request to a backend).
ANCESTRY_LIMIT = 2000
#: First parents :meth:`ObjectGraph.ancestry` follows before anything else: the
#: usual learned master is a few commits ahead of the one this client had.
ANCESTRY_QUICK = 16


@dataclass(frozen=True)
class Ancestry:
    """Where a commit ``mine`` stands in the history of a commit ``top``
    (:meth:`ObjectGraph.ancestry`)."""

    #: True: ``mine`` is ``top`` or one of its ancestors (through any parent);
    #: False: it is not (history forked); None: not decided within the limit.
    contains: bool | None
    #: When not contained: the newest commit of ``mine``'s first-parent line that
    #: ``top``'s history also has (the base to merge the two sides from); None
    #: when no common commit is known.
    base: str | None = None


class ObjectGraph:
    """Reads of commits, indexes, trees and blobs for one repository."""

    def __init__(self, ctx: RepoContext) -> None:
        self.ctx = ctx
        self.db = ctx.db
        self.store = ctx.store

    # ---------------------------------------------------------------- commits
    def load_commit(self, commit_id: str) -> Commit:
        data = self.db.cached_object(commit_id)
        if data is None:
            data = self.store.get_standalone("commit", commit_id)
            self.db.cache_object(commit_id, "commit", data)
        return Commit.from_bytes(data)

    def head_commit(self) -> Commit | None:
        """This client's latest local commit, if it has one."""
        head = self.ctx.state.head
        return self.load_commit(head) if head else None

    def first_parents(self, start: str | None) -> Iterator[tuple[str, Commit]]:
        """``(id, commit)`` from ``start`` back to the first commit along first
        parents: the versions master went through (a merge's first parent is the
        version it merged into), newest first."""
        current = start
        while current:
            commit = self.load_commit(current)
            yield current, commit
            current = commit.parents[0] if commit.parents else None

    def history(self, master: str) -> dict[str, Commit]:
        """Every commit reachable from ``master`` through any parent."""
        out: dict[str, Commit] = {}
        todo = [master]
        while todo:
            cid = todo.pop()
            if cid in out:
                continue
            commit = self.load_commit(cid)
            out[cid] = commit
            todo.extend(p for p in commit.parents if p not in out)
        return out

    def ancestry(self, top: str, mine: str, limit: int = ANCESTRY_LIMIT) -> Ancestry:
        """Whether ``mine`` is ``top`` or one of its ancestors, and if not, where the
        two histories meet.

        Cost: the usual case -- ``top`` a few first parents ahead -- reads those
        few commits. Otherwise the walk covers ``top``'s history through every
        parent (a merge contains both sides), stopping at commits of ``mine``'s
        own first-parent line: those are ancestors of ``mine``, so ``mine`` is not
        behind them, and the newest one met is the merge base. ``mine``'s line is
        taken from the local cache only (this client made or learned it), never
        from a backend. At most ``limit`` commits of ``top``'s side are read; a
        walk that needs more, or meets a commit no backend has, is undecided."""
        try:
            for steps, (cid, _) in enumerate(self.first_parents(top)):
                if cid == mine:
                    return Ancestry(True)
                if steps + 1 >= ANCESTRY_QUICK:
                    break
        except ObjectUnavailable:
            return Ancestry(None)
        line = self._cached_line(mine, limit)
        seen: set[str] = set()
        todo = deque([top])
        best: int | None = None
        while todo:
            cid = todo.popleft()
            if cid in seen:
                continue
            seen.add(cid)
            if cid == mine:
                return Ancestry(True)
            position = line.get(cid)
            if position is not None:
                # An ancestor of mine: nothing below it can be mine (no cycles).
                best = position if best is None else min(best, position)
                continue
            if len(seen) > limit:
                return Ancestry(None)
            try:
                commit = self.load_commit(cid)
            except ObjectUnavailable:
                return Ancestry(None)
            todo.extend(commit.parents)
        by_position = {position: cid for cid, position in line.items()}
        return Ancestry(False, by_position[best] if best is not None else None)

    def _cached_line(self, start: str, limit: int) -> dict[str, int]:
        """``start`` and its first parents -> their distance from ``start``, as far as
        the local cache has the commits (the last one named may not be cached)."""
        line: dict[str, int] = {}
        current: str | None = start
        while current and current not in line and len(line) <= limit:
            line[current] = len(line)
            data = self.db.cached_object(current)
            if data is None:
                break
            parents = Commit.from_bytes(data).parents
            current = parents[0] if parents else None
        return line

    # ---------------------------------------------------------------- indexes
    def load_index(self, index_id: str, historic: bool = False) -> None:
        """Learn the locations index ``index_id`` lists (see :meth:`load_indexes`)."""
        state = self.db.index_state(index_id)
        if state is not None and (historic or state != "historic"):
            return
        data = self.db.cached_object(index_id) or self.store.get_standalone("index", index_id)
        index = Index.from_bytes(data)
        with self.db.transaction():
            self.db.cache_object(index_id, "index", data)
            for pack_id, entries in index.packs:
                self.db.add_locations(pack_id, entries, historic=historic)
            self.db.set_index_state(index_id, "historic" if historic else "remote")

    def load_indexes(self, commit: Commit, historic: bool = False) -> None:
        """Learn where ``commit``'s objects are. ``historic``: the commit is older than
        the current master's line (a version being restored or compared): its
        indexes may list packs a gc has collected, so they serve reads only."""
        for index_id in commit.indexes:
            self.load_index(index_id, historic)

    def read_index(self, index_id: str) -> Index:
        """An index object, from the local cache or the backends."""
        data = self.db.cached_object(index_id)
        if data is None:
            data = self.store.get_standalone("index", index_id)
            with self.db.transaction():
                self.db.cache_object(index_id, "index", data)
        return Index.from_bytes(data)

    def live_objects(self, master: str) -> set[str]:
        """Every object the indexes of commit ``master`` list. A commit lists the
        indexes of every pack its line still has (a push inherits its parents'; a
        gc's commit lists exactly what survived it), so an object outside this set
        is not stored any more, or was never in master's line."""
        out: set[str] = set()
        for index_id in self.load_commit(master).indexes:
            for _, entries in self.read_index(index_id).packs:
                out.update(e.object_id for e in entries)
        return out

    def collected_test(self, master: str, gc_cutoff_ns: int) -> Callable[[Commit], bool]:
        """Whether a gc collected a version's content: the one test restore, the
        mount and ``forget --dry-run`` use. True for a commit older than the last
        gc's cutoff (``gc_cutoff_ns``, 0: no gc ran) whose tree master's indexes no
        longer list (:meth:`live_objects`). Whatever a later policy says, what an
        earlier gc collected is gone; and whatever today's policy says, a version
        whose tree survived is readable (a gc keeps everything a kept tree needs).
        A younger commit is never "collected": a missing object there is damage,
        which reading it reports. Master's indexes are read at the first older
        commit asked about, once."""
        live: set[str] | None = None

        def collected(commit: Commit) -> bool:
            nonlocal live
            if gc_cutoff_ns == 0 or commit.time_ns >= gc_cutoff_ns:
                return False
            if live is None:
                live = self.live_objects(master)
            return commit.tree not in live

        return collected

    # ---------------------------------------------------------------- trees
    def fetch_packed(self, ids: Iterable[str]) -> dict[str, bytes]:
        """Plaintexts of packed metadata objects (trees, files), cached locally."""
        result: dict[str, bytes] = {}
        by_pack: dict[str, list[PackEntry]] = {}
        for object_id in ids:
            data = self.db.cached_object(object_id)
            if data is not None:
                result[object_id] = data
                continue
            loc = self.db.location(object_id)
            if loc is None:
                raise ObjectUnavailable(f"object {object_id[:12]} is in no known pack")
            by_pack.setdefault(loc[0], []).append(loc[1])
        futures = [
            self.store.executor.submit(self.store.read_entries, pack_id, entries)
            for pack_id, entries in by_pack.items()
        ]
        with self.db.transaction():
            for fut in futures:
                for object_id, data in fut.result().items():
                    entry = self.db.location(object_id)
                    kind = entry[1].kind if entry else "tree"
                    self.db.cache_object(object_id, kind, data)
                    result[object_id] = data
        return result

    def flatten(self, tree_id: str | None) -> dict[str, TreeEntry]:
        """Every path in a tree (folders included), fetching trees level by level."""
        flat: dict[str, TreeEntry] = {}
        if tree_id is None:
            return flat
        level: list[tuple[str, str]] = [("", tree_id)]
        while level:
            fetched = self.fetch_packed(t for _, t in level)
            nxt: list[tuple[str, str]] = []
            for prefix, tid in level:
                tree = Tree.from_bytes(fetched[tid])
                for entry in tree.entries:
                    path = f"{prefix}/{entry.name}" if prefix else entry.name
                    flat[path] = entry
                    if entry.type == "dir":
                        nxt.append((path, entry.ref))
            level = nxt
        return flat

    def tree_at(self, commit_id: str) -> dict[str, TreeEntry]:
        """Every path of a commit's tree (flattened), loading what it needs. The
        indexes of this client's head and base become current locations, unless a
        gc ran since that base (this client learned a newer ``gc_epoch`` than the
        base's configuration has, and has not moved its base yet: a merge, or the
        daemon's deletion guard, in between): then they may list collected packs
        and serve reads only, as an older commit's do -- deduplicating against them
        would refer to deleted objects (docs/FORMAT.md §10)."""
        commit = self.load_commit(commit_id)
        state = self.ctx.state
        current = (commit_id in (state.head, state.prev.master)
                   and state.config.gc_epoch >= state.gc_epoch)
        self.load_indexes(commit, historic=not current)
        return self.flatten(commit.tree)

    def file_chunks(self, entry: TreeEntry) -> list[tuple[str, int]]:
        """(blob id, length) of a file entry's content, in order."""
        if entry.type == "file":
            return [(entry.ref, entry.size)]
        obj = FileObject.from_bytes(self.fetch_packed([entry.ref])[entry.ref])
        if obj.size != entry.size:
            raise CorruptObject(f"file object {entry.ref[:12]} size differs from its entry")
        return [(c.blob_id, c.length) for c in obj.chunks]

    def reachable_objects(self, commit: Commit) -> set[str]:
        """Every tree, file object and blob ``commit``'s tree needs."""
        self.load_indexes(commit, historic=True)
        out = {commit.tree}
        for entry in self.flatten(commit.tree).values():
            if entry.type in ("dir", "file"):
                out.add(entry.ref)
            elif entry.type == "chunked":
                out.add(entry.ref)
                out.update(b for b, _ in self.file_chunks(entry))
        return out

    # ---------------------------------------------------------------- blobs
    def location(self, object_id: str) -> tuple[str, PackEntry]:
        """Where ``object_id`` is; usable from worker threads (own read-only connection)."""
        conn = getattr(_thread_conns, "conn", None)
        if conn is None or getattr(_thread_conns, "path", None) != self.db.path:
            conn = sqlite3.connect(f"file:{self.db.path}?mode=ro", uri=True)
            _thread_conns.conn, _thread_conns.path = conn, self.db.path
        found = location_in(conn, object_id)
        if found is None:
            raise ObjectUnavailable(f"object {object_id[:12]} is in no known pack")
        return found

    def read_located(self, pack_id: str, entries: list[PackEntry]) -> dict[str, bytes]:
        """Plaintexts of ``entries`` of pack ``pack_id`` (already looked up), by id
        (from any thread)."""
        return self.store.read_entries(pack_id, list({e.object_id: e for e in entries}.values()))

    def read_blobs(self, group: list[tuple[str, int]]) -> dict[str, bytes]:
        """Plaintexts of the blobs ``(id, length)`` of ``group``, by id (from any thread)."""
        by_pack: dict[str, list[PackEntry]] = {}
        for blob_id, _ in group:
            loc = self.location(blob_id)
            by_pack.setdefault(loc[0], []).append(loc[1])
        data: dict[str, bytes] = {}
        for pack_id, entries in by_pack.items():
            unique = list({e.object_id: e for e in entries}.values())
            data.update(self.store.read_entries(pack_id, unique))
        return data
