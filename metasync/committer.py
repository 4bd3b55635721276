"""Local commits: what changed in the folder, and recording it as a commit.

``status`` compares the folder with the head commit, reading only files whose
size, mtime or inode changed since they were last hashed. ``commit`` packs the
changed content into the outbox and records the new head; nothing here talks to
a backend except to read trees a status compares with.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from metasync import quickstatus
from metasync.checkout import Checkout
from metasync.context import RepoContext
from metasync.faults import crash_point, pause_point
from metasync.graph import ObjectGraph
from metasync.localdb import IndexRow
from metasync.names import display_path, json_path
from metasync.objects import FORMAT_VERSION, Commit, Tree, TreeEntry, same_entry
from metasync.outbox import ObjectWriter, Outbox
from metasync.scanner import Scanner, ScanResult, tree_fingerprint
from metasync.worktree import ScanEntry, ScanProblems


@dataclass(frozen=True)
class Change:
    path: str
    kind: str  # "added", "modified", "deleted"
    type: str


@dataclass
class Status:
    """What ``metasync status`` reports: changes against the last local commit."""

    changes: list[Change]
    version: int
    head: str | None
    unpushed: bool
    files_hashed: int
    #: Paths not synced: unreadable ones and special files (see :class:`ScanProblems`).
    problems: ScanProblems = field(default_factory=ScanProblems)
    #: This machine's sparse selection (empty: everything is here) and how many
    #: files and links of the tree are outside it (docs/sparse.md).
    sparse_patterns: list[str] = field(default_factory=list)
    outside: int = 0
    #: What the scan saw, by path, when the quick path may answer this status again
    #: (:meth:`Committer.keep_quick_answer` digests it then: a status whose answer
    #: is not kept, the daemon's, pays nothing), else None.
    quick: dict[str, ScanEntry] | None = field(default=None, repr=False, compare=False)

    @property
    def clean(self) -> bool:
        """Nothing to commit or push, and nothing that cannot be read."""
        return not self.changes and not self.unpushed and not self.problems.unreadable

    def to_json(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "head": self.head,
            "unpushed": self.unpushed,
            "clean": self.clean,
            "changes": [{**json_path(c.path), "change": c.kind, "type": c.type} for c in self.changes],
            **problems_json(self.problems),
            "sparse": ({"patterns": self.sparse_patterns, "outside": self.outside}
                       if self.sparse_patterns else None),
        }


def problems_json(problems: ScanProblems) -> dict[str, Any]:
    """The JSON fields of what a scan did not sync: ``unreadable`` (path, reason,
    type ``file`` or ``dir``) and ``special`` (FIFOs, sockets, devices: path, reason)."""
    return {
        "unreadable": [{**json_path(u.path), "reason": u.reason,
                        "type": "dir" if u.folder else "file"} for u in problems.unreadable],
        "special": [{**json_path(u.path), "reason": u.reason} for u in problems.special],
    }


@dataclass
class CommitResult:
    commit_id: str
    tree_id: str
    new_objects: dict[str, int]
    packs: int
    files_hashed: int


def quick_stamp(seen: dict[str, ScanEntry]) -> str:
    """The digest of what a scan saw (``seen``), as :func:`metasync.quickstatus.walk`
    sees it (in the scan's order)."""
    found = quickstatus.Found()
    for e in seen.values():
        found.add(*e[:7])
    return found.digest()


class Committer:
    """Status and local commits of one repository."""

    def __init__(self, ctx: RepoContext, graph: ObjectGraph, scanner: Scanner,
                 outbox: Outbox, checkout: Checkout) -> None:
        self.ctx = ctx
        self.state = ctx.state
        self.graph = graph
        self.scanner = scanner
        self.outbox = outbox
        self.checkout = checkout
        #: What the last scan of :meth:`status` or :meth:`commit` did not sync
        #: (unreadable paths, special files): a push reports it even when there
        #: was nothing to commit.
        self.unsynced = ScanProblems()

    # ---------------------------------------------------------------- status
    def status(self) -> Status:
        """Changes in the folder against the last commit. A checkout an interrupted
        pull left is finished first (else its unapplied changes would look like the
        user's)."""
        # Opened read-only while another command has the folder (a push, the
        # daemon): that command owns the checkout and the index; only read.
        exclusive = self.ctx.exclusive
        if exclusive:
            self.checkout.resume()
        elif self.state.checkout_pending is not None:
            self.ctx.reporter.note("note: another metasync command is updating the folder; "
                                   "some changes listed may be its own")
        scan = self.scanner.scan(None)
        db = self.ctx.db
        if scan.rows and exclusive:
            with db.transaction():
                db.upsert_index(scan.rows)
        head = self.graph.head_commit()
        self.keep_unread(scan, head)
        changes: list[Change] = []
        fingerprint = tree_fingerprint(scan.files, scan.dirs)
        if head is None or self.state.tree_memo != (fingerprint, head.tree):
            root_id, trees = self.scanner.build_trees(scan.files, scan.dirs)
            if head is not None and head.tree == root_id and exclusive:
                self.state.tree_memo = (fingerprint, root_id)
            else:
                # Descend only into folders whose tree ids differ: an unchanged subtree
                # costs nothing, and an unchanged folder costs one comparison.
                self._diff_trees(head.tree if head else None, root_id, trees, "", changes)
        changes.sort(key=lambda c: c.path)
        prev, head_id = self.state.prev, self.state.head
        # The quick path may give this answer again (metasync.quickstatus): clean by
        # the tree memo, every file's index row trusted (none read), nothing else
        # (unreadable, special, outside the selection) that the quick walk declines.
        quick = exclusive and head is not None and not changes and not scan.skipped \
            and scan.files_hashed == 0 and not scan.rows and bool(scan.seen) \
            and not scan.problems.unreadable and not scan.problems.special \
            and not scan.outside and not self.state.sparse_patterns \
            and self.state.tree_memo == (fingerprint, head.tree)
        return Status(
            changes=changes,
            version=prev.number,
            head=head_id,
            unpushed=head_id is not None and head_id != prev.master,
            files_hashed=scan.files_hashed,
            problems=scan.problems,
            sparse_patterns=self.state.sparse_patterns,
            outside=sum(1 for p in scan.outside if p in scan.files),
            quick=scan.seen if quick else None,
        )

    def keep_quick_answer(self, st: Status, answer: dict[str, Any]) -> None:
        """Keep ``answer``, what an offline ``status`` printed for ``st``, for the quick
        path (:mod:`metasync.quickstatus`) when ``st`` allows it; the last write of
        the command (the memo's stamp digests the other settings)."""
        state = self.state
        traits = self.scanner.traits
        if (st.quick is None or not self.ctx.exclusive or state.checkout_pending is not None
                or state.waiting_folders or state.unfinished_clone
                or state.folder_traits != traits or state.format != FORMAT_VERSION):
            return
        db = self.ctx.db
        with db.transaction():
            db.set(quickstatus.MEMO_KEY, quickstatus.memo(
                db.conn, str(self.ctx.root), quick_stamp(st.quick), traits.device, answer))

    def keep_unread(self, scan: ScanResult, head: Commit | None) -> None:
        """Put back into ``scan`` the committed version of every path it could not
        read -- a file that kept changing or that cannot be read keeps its content,
        a folder that cannot be listed keeps its whole subtree -- so that what was
        not read is never taken for deleted. The base is ``head``, else the master
        this folder was last brought to. A path never committed stays out."""
        self.unsynced = scan.problems
        scan.problems.unreadable.sort(key=lambda u: u.path)
        scan.problems.special.sort(key=lambda u: u.path)
        unread = [(p, False) for p in scan.skipped]
        unread += [(u.path, u.folder) for u in scan.problems.unreadable]
        if not unread:
            return
        base = head
        if base is None and self.state.prev.master is not None:
            base = self.graph.load_commit(self.state.prev.master)
            self.graph.load_indexes(base)
        if base is None:
            return
        for path, _ in unread:
            entry = self._committed_entry(base.tree, path)
            if entry is None:
                continue
            if entry.type != "dir":
                scan.files[path] = entry
                continue
            scan.dirs.add(path)
            for sub, e in self.graph.flatten(entry.ref).items():
                if e.type == "dir":
                    scan.dirs.add(f"{path}/{sub}")
                else:
                    scan.files[f"{path}/{sub}"] = e

    def _committed_entry(self, tree_id: str, path: str) -> TreeEntry | None:
        """The entry at ``path`` of the committed tree ``tree_id``, or None."""
        entry: TreeEntry | None = None
        for name in path.split("/"):
            if entry is not None:
                if entry.type != "dir":
                    return None
                tree_id = entry.ref
            entry = Tree.from_bytes(self.graph.fetch_packed([tree_id])[tree_id]).by_name().get(name)
            if entry is None:
                return None
        return entry

    def _diff_trees(
        self,
        old_id: str | None,
        new_id: str | None,
        new_trees: dict[str, bytes],
        prefix: str,
        out: list[Change],
    ) -> None:
        """Append the changes from tree ``old_id`` (stored) to ``new_id`` (just built)."""
        old = Tree.from_bytes(self.graph.fetch_packed([old_id])[old_id]).by_name() if old_id else {}
        new = Tree.from_bytes(new_trees[new_id]).by_name() if new_id else {}
        for name in old.keys() | new.keys():
            path = f"{prefix}/{name}" if prefix else name
            o, n = old.get(name), new.get(name)
            if o is not None and n is not None and o.type == "dir" and n.type == "dir":
                if o.ref != n.ref:
                    self._diff_trees(o.ref, n.ref, new_trees, path, out)
                continue
            if o is not None and n is not None and same_entry(o, n):
                continue
            if o is not None:
                if n is not None and o.type != "dir" and n.type != "dir":
                    out.append(Change(path, "modified", n.type))
                    continue
                out.append(Change(path, "deleted", o.type))
                if o.type == "dir":
                    self._diff_trees(o.ref, None, new_trees, path, out)
            if n is not None:
                out.append(Change(path, "added", n.type))
                if n.type == "dir":
                    self._diff_trees(None, n.ref, new_trees, path, out)

    # ---------------------------------------------------------------- commit
    def commit(self, message: str = "", skipped: list[str] | None = None,
               upload_early: bool = False) -> CommitResult | None:
        """Record the folder as a new local commit; ``None`` if nothing changed.
        Paths the scan had to leave out (each noted to the reporter) are appended
        to ``skipped`` when given.

        New objects are packed, encrypted and written to the outbox (flushed to
        disk) before the commit that refers to them is recorded. With
        ``upload_early`` (a push, which flushes next) finished packs are already
        uploaded meanwhile (:class:`~metasync.outbox.EarlyUpload`).
        """
        self.checkout.resume()
        self.outbox.clean()
        writer = self.outbox.writer(upload_early)
        try:
            return self._commit(writer, message, skipped)
        except BaseException:
            writer.abandon()
            raise

    def _commit(self, writer: ObjectWriter, message: str,
                skipped: list[str] | None) -> CommitResult | None:
        # A checkout scans again before it compares anything with a scan, so a commit
        # need not keep this one (on a huge tree it is a third of the memory).
        scan = self.scanner.scan(writer.sink, flush_index=True, keep_seen=False)
        if skipped is not None:
            skipped += scan.skipped
        for path in scan.skipped:
            self.ctx.reporter.note(f"skipped {display_path(path)}: it changed while being read; "
                                   "it is committed next time")
        self.keep_unread(scan, self.graph.head_commit())
        fingerprint = tree_fingerprint(scan.files, scan.dirs)
        empty = not scan.files and not scan.dirs
        db = self.ctx.db

        def emit(tree_id: str, data: bytes) -> None:
            # Packed and cached as built; both are keyed by content, so a commit that
            # fails after this leaves nothing wrong behind.
            writer.sink("tree", tree_id, data)
            db.cache_object(tree_id, "tree", data)

        with db.transaction():
            root_id, trees = self.scanner.build_trees(scan.files, scan.dirs, emit)  # empties files
            self.state.tree_memo = (fingerprint, root_id)
        head = self.graph.head_commit()
        prev = self.state.prev
        unchanged = (head is not None and head.tree == root_id) or (
            head is None and empty and prev.master is None
        )
        if unchanged:
            # Every pack gets an index, even without a commit (a busy file may have left
            # new blobs): a later commit that reuses them must be able to list them.
            stored = writer.finish()
            self.outbox.store_standalone(stored)
            with db.transaction():
                self.outbox.record_packs(writer.finished, scan.rows)
                self.outbox.record_standalone(stored)
            return None
        parent = head or (self.graph.load_commit(prev.master) if prev.master else None)
        if head is None and parent is not None:
            self.graph.load_indexes(parent)
        head_id = self.state.head
        commit_id = self.seal(
            writer, root_id, trees, parents=(head_id,) if head_id else (),
            message=message, inherited=[parent] if parent else [], refreshed=scan.rows,
        )
        return CommitResult(commit_id, root_id, writer.counts, len(writer.finished),
                            scan.files_hashed)

    def seal(
        self,
        writer: ObjectWriter,
        root_id: str,
        trees: dict[str, bytes],
        *,
        parents: tuple[str, ...],
        message: str,
        inherited: list[Commit],
        refreshed: list[IndexRow],
        then: Callable[[], None] | None = None,
    ) -> str:
        """Pack the new trees, write indexes and the commit to the outbox, and make
        it head -- and run ``then`` -- in one transaction. Returns its id."""
        for tid, data in trees.items():
            writer.sink("tree", tid, data)
        stored = writer.finish()
        indexes, merged_away = self.outbox.commit_indexes(inherited, stored)
        commit = Commit(
            tree=root_id,
            parents=parents,
            client=self.ctx.client_id,
            device=self.ctx.device,
            time_ns=time.time_ns(),
            message=message,
            indexes=tuple(sorted(indexes)),
        )
        commit_bytes = commit.to_bytes()
        commit_id = self.ctx.codec.id_of("commit", commit_bytes)
        stored.append(("commit", commit_id, commit_bytes))
        self.outbox.store_standalone(stored)
        crash_point("commit:stored")
        # Every pack is finished and offered to the push's early upload, nothing is
        # recorded: a test runs another client's gc here (tests/test_gc.py).
        pause_point("commit:stored")
        db = self.ctx.db
        with db.transaction():
            self.outbox.record_packs(writer.finished, refreshed)
            for tid, data in trees.items():
                db.cache_object(tid, "tree", data)
            self.outbox.record_standalone(stored)
            for index_id in merged_away:
                db.set_index_state(index_id, "remote")
            self.state.head = commit_id
            if then is not None:
                then()
        return commit_id
