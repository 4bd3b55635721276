"""Changing this machine's sparse selection (``metasync sparse``, docs/sparse.md).

Which paths a selection checks out is :mod:`metasync.selection`; how the scan and
the checkout keep paths outside it (index rows marked
:data:`~metasync.localdb.OUTSIDE`) is theirs. This module changes the selection:

* narrowing removes a file leaving it only if its content is safe in master --
  the file here is the one master has (the last master this client learned:
  decided, so its objects are on the backends) -- else it refuses, naming the
  paths, and changes nothing;
* widening writes exactly the files entering it, from the tree the folder is at,
  through the checkout (recorded as pending first, so an interruption is finished
  by the next command).

The new selection and the rows of the paths leaving it are recorded in one
transaction before any file is removed: a crash leaves a file outside the
selection that the scan ignores (and the next narrowing removes), never one a
commit takes for deleted.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Sequence
from dataclasses import dataclass, field

from metasync.checkout import Checkout
from metasync.context import RepoContext
from metasync.errors import UsageError
from metasync.graph import ObjectGraph
from metasync.localdb import OUTSIDE, IndexRow
from metasync.names import display_path
from metasync.objects import Commit, Tree, TreeEntry, same_entry
from metasync.scanner import Scanner
from metasync.selection import Selection, check_patterns, drop_selected_rows, parents_of
from metasync.state import PendingCheckout
from metasync.worktree import Folders, ScanEntry, content_is, lstat_name

#: Paths a refusal names (the rest are counted).
NAMED = 3


@dataclass
class SparseChange:
    """What changing the selection did to the folder."""

    #: The selection now (empty: everything).
    patterns: list[str]
    #: Files removed here (safe in master), and files written (entering it).
    removed: list[str] = field(default_factory=list)
    written: list[str] = field(default_factory=list)
    #: Files left in place although outside the selection now (changed while
    #: being removed): not synced until selected again.
    kept: list[str] = field(default_factory=list)


class Sparse:
    """This machine's selection of one repository."""

    def __init__(self, ctx: RepoContext, graph: ObjectGraph, scanner: Scanner,
                 checkout: Checkout) -> None:
        self.ctx = ctx
        self.graph = graph
        self.scanner = scanner
        self.checkout = checkout

    def patterns(self) -> list[str]:
        """The selection's patterns, in order (empty: everything is checked out)."""
        return list(self.ctx.state.sparse_patterns)

    def outside_count(self) -> int:
        """Files and links of the tree not checked out here."""
        return self.ctx.db.count_index_marked(OUTSIDE)

    def outside_changes(self, commit_id: str) -> list[str]:
        """Paths commit ``commit_id`` changed (against its first parent) that are
        outside this machine's selection (what ``log`` marks)."""
        selection = self.scanner.selection()
        if not selection.active:
            return []
        return outside_changes(self.graph, selection, self.graph.load_commit(commit_id))

    def set(self, patterns: Sequence[str]) -> SparseChange:
        """Make ``patterns`` the selection (see the module's contract)."""
        return self._change(check_patterns(patterns))

    def add(self, patterns: Sequence[str]) -> SparseChange:
        """Append ``patterns`` to the selection (with none yet: they are the selection)."""
        return self._change(self.patterns() + check_patterns(patterns))

    def off(self) -> SparseChange:
        """Check out everything again."""
        return self._change([])

    # ------------------------------------------------------------------ the change
    def _change(self, patterns: list[str]) -> SparseChange:
        self.checkout.resume()  # a checkout left pending first: it uses the old selection
        state, db = self.ctx.state, self.ctx.db
        new = Selection(patterns)
        scan = self.scanner.scan(None)  # under the old selection
        leaving = sorted(p for p in scan.files if p in scan.seen and not new.selects(p))
        # Folders here that the new selection neither selects nor needs as a parent.
        needed = parents_of([p for p, e in scan.seen.items() if new.selects(p, e.type == "dir")])
        leaving_dirs = sorted((d for d in scan.dirs if d in scan.seen and d not in needed
                               and not new.selects(d, True)),
                              key=lambda d: d.count("/"), reverse=True)
        unread = sorted(
            [p for p in scan.skipped if not new.selects(p)]
            + [u.path for u in scan.problems.unreadable if not new.selects(u.path, u.folder)])
        master = self._master() if leaving or leaving_dirs else {}
        unsafe = unread + [p for p in leaving if not same_entry(scan.files[p], master.get(p))]
        # An empty folder is content too: one master does not have is not safe there.
        unsafe += [d + "/" for d in leaving_dirs if not same_entry(scan_dir(d), master.get(d))]
        if unsafe:
            unsafe.sort()
            named = ", ".join(display_path(p) for p in unsafe[:NAMED])
            more = f" and {len(unsafe) - NAMED} more" if len(unsafe) > NAMED else ""
            raise UsageError(
                f"cannot take {named}{more} out of this machine's selection: not in master "
                "as it is here (changed, new, or not pushed); run `metasync push` first, "
                "then change the selection")
        head = self.graph.head_commit()
        entering = [p for p in scan.outside if new.selects(p, scan.files.get(p) is None)]
        rows = [IndexRow(p, e.type, e.ref, e.size, e.executable, OUTSIDE, 0, 0)
                for p, e in ((p, scan.files[p]) for p in leaving)]
        rows += [IndexRow(d, "dir", "", 0, False, OUTSIDE, 0, 0) for d in leaving_dirs]
        # A file leaving that was deleted here and not committed stays as the last
        # commit has it (nothing of it is lost; a deletion is a change to push first),
        # and the scan's entries of paths outside the new selection get their marker.
        kept = {p: e for p, e in scan.files.items() if p in scan.outside and not new.selects(p)}
        if new.active and head is not None:
            kept.update((p, e) for p, e in self.graph.flatten(head.tree).items()
                        if e.type != "dir" and p not in scan.files and not new.selects(p))
        rows += [IndexRow(p, e.type, e.ref, e.size, e.executable, OUTSIDE, 0, 0)
                 for p, e in kept.items()]
        with state.transaction():
            state.sparse_patterns = patterns
            db.upsert_index(rows)
            state.tree_memo = None
            if entering and head is not None:
                state.checkout_pending = PendingCheckout(head.tree, head.tree)
        change = SparseChange(patterns)
        self._remove(leaving, leaving_dirs, scan.seen, scan.files, change)
        drop_selected_rows(db, new, self.ctx.root)  # folders here (taken in as parents)
        if entering and head is not None:
            self.checkout.run_pending()
            change.written = sorted(p for p in entering if p in scan.files
                                    and os.path.lexists(self.ctx.root / p))
        return change

    def _master(self) -> dict[str, TreeEntry]:
        """The tree of the last master this client learned (empty before any)."""
        master_id = self.ctx.state.prev.master
        return self.graph.tree_at(master_id) if master_id else {}

    def _remove(self, files: list[str], dirs: list[str], seen: dict[str, ScanEntry],
                scanned: dict[str, TreeEntry], change: SparseChange) -> None:
        """Remove ``files`` (each still as the scan saw it -- its size and mtime, and
        where timestamps are too coarse to tell a rewrite within the tick, its
        content: :func:`~metasync.worktree.content_is` -- one changed since is kept
        and said), then ``dirs`` that are empty, deepest first. Never through a link."""
        with Folders(self.ctx.root) as folders:
            for path in files:
                parent, _, name = path.rpartition("/")
                with folders.opened(parent) as fd:
                    st = lstat_name(fd, name) if fd is not None else None
                    if fd is None or st is None or stat.S_ISDIR(st.st_mode):
                        continue
                    was, entry = seen.get(path), scanned.get(path)
                    if (was is None or entry is None
                            or (was.size, was.mtime_ns) != (st.st_size, st.st_mtime_ns)
                            or not content_is(self.ctx.chunker, fd, name, path, st, entry.ref)):
                        change.kept.append(path)
                        self.ctx.reporter.note(
                            f"kept {display_path(path)}: it changed while the selection "
                            "changed; it is outside the selection now, so it is not synced "
                            "(`metasync sparse add` takes it back)")
                        continue
                    os.unlink(name, dir_fd=fd)
                    change.removed.append(path)
            for path in dirs:
                parent, _, name = path.rpartition("/")
                with folders.opened(parent) as fd:
                    try:
                        if fd is not None:
                            os.rmdir(name, dir_fd=fd)  # a link fails: rmdir never follows
                            folders.forget(path)
                    except OSError:
                        pass  # something of its own is still in it: it stays


def scan_dir(path: str) -> TreeEntry:
    """A folder found by a scan, as a tree entry (folders compare by kind only)."""
    return TreeEntry(path.rpartition("/")[2], "dir", "")


def outside_changes(graph: ObjectGraph, selection: Selection, commit: Commit,
                    limit: int = 1000) -> list[str]:
    """The paths ``commit`` changed against its first parent that are outside
    ``selection`` (at most ``limit``): only folders whose tree ids differ are read."""
    if not selection.active:
        return []
    graph.load_indexes(commit, historic=True)
    parent = None
    if commit.parents:
        first = graph.load_commit(commit.parents[0])
        graph.load_indexes(first, historic=True)
        parent = first.tree
    out: list[str] = []

    def tree(tree_id: str | None) -> dict[str, TreeEntry]:
        if tree_id is None:
            return {}
        return Tree.from_bytes(graph.fetch_packed([tree_id])[tree_id]).by_name()

    def walk(old_id: str | None, new_id: str | None, prefix: str) -> None:
        old, new = tree(old_id), tree(new_id)
        for name in sorted(old.keys() | new.keys()):
            if len(out) >= limit:
                return
            path = f"{prefix}/{name}" if prefix else name
            o, n = old.get(name), new.get(name)
            if o is not None and n is not None and o.type == n.type and o.ref == n.ref \
                    and o.executable == n.executable:
                continue
            o_dir = o.ref if o is not None and o.type == "dir" else None
            n_dir = n.ref if n is not None and n.type == "dir" else None
            if o_dir or n_dir:
                walk(o_dir, n_dir, path)
            changed_file = (o is not None and o.type != "dir") or (n is not None and n.type != "dir")
            if changed_file and not selection.selects(path):
                out.append(path)

    walk(parent, commit.tree, "")
    return out
