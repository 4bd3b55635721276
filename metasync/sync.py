"""Push and pull: agreeing on versions and bringing them into the folder.

The flow of a change (paper Figure 3): ``push`` learns the latest version
first (so a push that cannot reach a quorum changes nothing), commits, uploads
the outbox (data before anything refers to it), and proposes its commit through
pPaxos; if master moved, it merges three ways and proposes the merge. ``pull``
learns master and integrates it: a fast-forward, or a merge commit when there
are local commits, then a checkout that loses no local change.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING

from metasync.checkout import Checkout, PullResult
from metasync.committer import CommitResult, Committer
from metasync.context import RepoContext
from metasync.errors import BackendError, Interrupted, ObjectUnavailable
from metasync.faults import crash_point
from metasync.graph import ANCESTRY_LIMIT, ObjectGraph
from metasync.names import display_path
from metasync.objects import Commit, FileObject, TreeEntry, Version
from metasync.outbox import ObjectWriter, Outbox
from metasync.progress import CANCEL
from metasync.replicator import Replicator
from metasync.scanner import Scanner
from metasync.state import PendingCheckout
from metasync.versions import Versions
from metasync.worktree import ScanEntry, ScanProblems, remove_stale_temps

if TYPE_CHECKING:
    from metasync.merge import MergeConflict

#: A push merges with a moving master at most this many times before giving up.
MAX_MERGES = 50


@dataclass
class PushResult:
    version: Version | None
    commit: CommitResult | None
    objects_uploaded: int = 0
    bytes_uploaded: int = 0
    up_to_date: bool = False
    #: Copies not yet on their holders (this client's missing-copy rows): spilled
    #: elsewhere, or short; any later push or daemon cycle writes them.
    missing_copies: int = 0
    #: Conflict copies a merge with a moved master made.
    conflicts: list[str] = field(default_factory=list)
    #: Copies written to another backend because a holder could not take them.
    spilled: int = 0
    #: Backends that refused copies for want of space (id -> why): their copies
    #: spilled to others, or wait for room (``BackendFull``).
    full: dict[str, str] = field(default_factory=dict)
    #: Objects of this client's versions with fewer copies than the configuration
    #: asks for (fewer backends took writes than R, when this push or an earlier
    #: one uploaded them) that the repair before it could not complete: the
    #: version is readable, less durable.
    short: list[str] = field(default_factory=list)
    #: The warning of a learned version that did not descend from the one this
    #: client had (history forked); the local side was merged on top and pushed.
    fork: str = ""
    #: Paths this push's commit left out (it could not read them); said on stderr.
    skipped: list[str] = field(default_factory=list)
    #: What the commit's scan did not sync: paths it could not read (their last
    #: committed version was kept) and special files.
    problems: ScanProblems = field(default_factory=ScanProblems)


def commit_stamp(time_ns: int) -> str:
    """A commit time as conflict-copy names show it (local time). The time comes
    from a commit (untrusted): one no calendar can show reads as all zeros."""
    try:
        return datetime.fromtimestamp(time_ns / 1e9).strftime("%Y-%m-%d %H%M%S")
    except (OverflowError, OSError, ValueError):
        return "0000-00-00 000000"


class Sync:
    """Push, pull and the integration of learned versions, for one repository."""

    def __init__(self, ctx: RepoContext, versions: Versions, graph: ObjectGraph,
                 scanner: Scanner, outbox: Outbox, replicator: Replicator,
                 checkout: Checkout, committer: Committer) -> None:
        self.ctx = ctx
        self.state = ctx.state
        self.versions = versions
        self.graph = graph
        self.scanner = scanner
        self.outbox = outbox
        self.replicator = replicator
        self.checkout = checkout
        self.committer = committer

    # ---------------------------------------------------------------- push
    def push(self, message: str = "") -> PushResult:
        """Commit pending changes, upload them, and make them master through pPaxos.

        A quorum of acceptors is consulted before anything changes, so with too
        few reachable nothing is committed or uploaded. If master moved since the
        last pull, the local commits are merged with it three ways (see
        :mod:`metasync.merge`), the folder is updated, and the merge is proposed --
        again until it wins. Objects are uploaded before the commit naming them is
        proposed; copies a backend missed earlier are written again from a
        verified copy. The result's ``short`` lists every object still below R
        copies, whichever push of this client uploaded it.

        Stopped by the user (Ctrl-C: :data:`~metasync.progress.CANCEL`), it raises
        :class:`Interrupted` saying what was kept; the next push continues.
        """
        try:
            return self._push(message)
        except KeyboardInterrupt:
            if not CANCEL.requested():
                raise
            # Outside the upload (which says how much it kept): every step is
            # crash-safe, so the next push picks up wherever this one stopped.
            raise Interrupted("the push stopped; `metasync push` continues it") from None

    def _push(self, message: str) -> PushResult:
        self.checkout.resume()
        latest = self.versions.learn_latest()
        crash_point("push:learned")
        fork = ""
        if latest.config != self.versions.config_id:
            # Place this push's objects by the new configuration's mapping.
            fork = self.integrate(latest).fork
        skipped: list[str] = []
        try:
            result = self.committer.commit(message, skipped, upload_early=True)
            uploaded = self.outbox.flush()
        finally:
            # Stopped between the two (Ctrl-C), no early upload outlives the push.
            self.outbox.stop_early()
        self.replicator.repair_missing()
        conflicts: list[str] = []
        for _ in range(MAX_MERGES):
            if latest.number > self.state.prev.number:
                integrated = self.integrate(latest)
                conflicts += integrated.conflicts
                fork = fork or integrated.fork
                uploaded.add(self.outbox.flush())
            prev, head = self.state.prev, self.state.head
            done = PushResult(prev, result, uploaded.objects, uploaded.bytes,
                              missing_copies=len(self.ctx.db.missing_copies()),
                              conflicts=conflicts, spilled=uploaded.spilled,
                              short=self.replicator.short_objects(), fork=fork,
                              full=self.ctx.note_full_backends(), skipped=skipped,
                              problems=self.committer.unsynced)
            if head is None or head == prev.master:
                done.up_to_date = True
                return done
            proposal = Version(prev.number + 1, head, prev.config)
            crash_point("push:propose")
            consensus = self.versions.consensus
            chosen = consensus.propose(proposal.number, proposal)
            crash_point("push:decided")
            if chosen == proposal:
                self.record_decided(chosen)
                consensus.publish(chosen)
                self.outbox.publish_client_state()
                done.version = chosen
                return done
            latest = self.versions.learn_latest()
        raise BackendError(
            f"other clients kept committing during {MAX_MERGES} merges; run `metasync push` again",
            transient=True,
        )

    def record_decided(self, version: Version) -> None:
        """``version`` (whose master is our head) is decided: it is the new base.

        The local indexes master lists are now the line's. One it does not list --
        packs a commit made without using them (one that found the folder unchanged
        after a busy file, or what :meth:`Outbox.clean` kept of a stopped commit) --
        stays local for the next commit to list, and stays announced with its packs
        so no gc collects them meanwhile: their objects are located, so the next
        commit refers to them instead of storing them again."""
        db = self.ctx.db
        listed = set(self.graph.load_commit(version.master).indexes) if version.master else set()
        local = set(db.local_indexes())
        unlisted = local - listed
        still_announced = {p for i in unlisted for p, _ in self.graph.read_index(i).packs}
        with self.state.transaction():
            self.versions.set_base(version)
            # All the rest is reachable from master now.
            self.state.announced = sorted(still_announced | unlisted)
            for index_id in listed & local:
                db.set_index_state(index_id, "remote")
        self.versions.adopt_config()

    # ---------------------------------------------------------------- pull
    def pull(self) -> PullResult:
        """Bring master into the folder.

        Local commits not yet pushed are merged with master three ways into a new
        local commit (pushed by the next ``push``). Uncommitted changes stay in the
        folder: a remote change applies only where the file is unchanged here;
        where both changed, the local file is kept as a conflict copy; a remote
        delete of a locally changed file keeps the file.
        """
        remove_stale_temps(self.ctx.root)
        try:
            resumed = self.checkout.resume()
            latest = self.versions.learn_latest()
            prev = self.state.prev
            if latest.number == prev.number and not (self.state.head is None and latest.master):
                self._clone_finished()
                return resumed or PullResult(prev, up_to_date=True)
            result = self.integrate(latest)
            self._clone_finished()
        except (Interrupted, KeyboardInterrupt) as exc:
            if not CANCEL.requested() and not isinstance(exc, Interrupted):
                raise
            # The new version and the checkout still to do are recorded in one
            # transaction before the folder changes: the next pull (or any command
            # that resumes a checkout) finishes what was not written.
            raise Interrupted(
                "the pull stopped; files already written are kept and `metasync pull` "
                "finishes it") from None
        self.outbox.publish_client_state()
        return result

    def _clone_finished(self) -> None:
        """A pull finished: so did the clone, if this folder is one that had not
        (``LocalState.unfinished_clone``)."""
        if self.state.unfinished_clone:
            self.state.unfinished_clone = False

    def integrate(self, learned: Version) -> PullResult:
        """Make ``learned`` (decided, newer than prev) the base of head and the folder:
        fast-forward if there are no local commits, else a three-way merge commit.

        The new head, prev and the pending checkout are recorded in one transaction
        before the folder changes, so a crash leaves a checkout the next command
        finishes (:meth:`Checkout.resume`).
        """
        state, versions = self.state, self.versions
        prev, head = state.prev, state.head
        if head is not None and head != prev.master:
            first = (learned if learned.number == prev.number + 1
                     else versions.consensus.learn(prev.number + 1))
            if first is not None and first.master == head:
                # Our commit won, but we stopped before recording it (a crash).
                self.record_decided(first)
                prev = first
                if learned == first:
                    return PullResult(learned, up_to_date=True)
        if learned.master is None or (learned.master == prev.master and head == prev.master):
            # Nothing new in the folder (the first versions, or only a configuration change).
            with state.transaction():
                versions.set_base(learned)
            versions.adopt_config()
            return PullResult(learned, up_to_date=True)
        # Read what the learned version needs by its own configuration: a client a
        # few configurations behind finds its objects only on the newer backends.
        conflicts: list[MergeConflict] = []
        merging = head is not None and head != prev.master
        with versions.reading_with(versions.load_config(learned.config)):
            theirs = self.graph.load_commit(learned.master)
            versions.note_gc_epoch(versions.load_config(learned.config).gc_epoch)
            base, fork = self._check_descent(learned, prev)
            if fork:
                # Keep this client's side: merged on top of the learned master from
                # where the two histories meet, never fast-forwarded over.
                merging = True
                head = head or prev.master
            self.graph.load_indexes(theirs)
            ours = self.graph.head_commit()
            if not merging:
                with state.transaction():
                    state.head = learned.master
                    versions.set_base(learned)
                    state.checkout_pending = PendingCheckout(
                        ours.tree if ours is not None else None, theirs.tree)
            else:
                assert head is not None
                ours = ours or self.graph.load_commit(head)
                conflicts = self._merge(learned, theirs, ours, head, base)
        versions.adopt_config()
        for c in conflicts:
            self.ctx.reporter.note(f"conflict: {display_path(c.path)} changed on both sides; "
                                   f"the other version is {display_path(c.copy)}")
        if merging:
            crash_point("merge:sealed")
        result = self.checkout.run_pending()
        result.conflicts[:0] = [c.copy for c in conflicts]
        result.fork = fork
        return result

    def _check_descent(self, learned: Version, prev: Version) -> tuple[str | None, str]:
        """Check that ``learned``'s master descends from ``prev``'s (the last version
        this client had), or is a merge that contains it. Every honest version
        does (docs/protocol.md, "Linear history"); one that does not means two
        clients were each told a different version ``prev.number`` or later was
        decided -- a backend lost or hid a log entry, which crash mode does not
        tolerate. Returns the base to merge local commits from (prev's master, or
        where the two histories meet) and, for a fork, the one-line warning."""
        if prev.master is None or learned.master is None or learned.master == prev.master:
            return prev.master, ""
        ancestry = self.graph.ancestry(learned.master, prev.master)
        if ancestry.contains is False:
            return ancestry.base, (
                f"history forked: version {learned.number} does not descend from the version "
                f"{prev.number} this client had, so a backend lost or hid a log entry (crash "
                f"mode does not tolerate that); this client's files are kept, merged on top "
                f"of version {learned.number} (a push publishes them); run `metasync fsck`, "
                "and use `init --bft` (4+ backends) to tolerate a backend that lies")
        if ancestry.contains is None:
            self.ctx.reporter.note(
                f"note: that version {learned.number} descends from version {prev.number} "
                f"was not checked (more than {ANCESTRY_LIMIT} commits apart, or part of its "
                "history unreadable); `metasync log` shows its history")
        return prev.master, ""

    def _merge(self, learned: Version, theirs: Commit, ours: Commit, head: str,
               base_master: str | None) -> list[MergeConflict]:
        """Merge head (``ours``) with ``learned``'s master (``theirs``) three ways,
        base ``base_master``, into a local commit whose parents are (master, head),
        recorded with the checkout of it as pending; return the conflicts."""
        from metasync.merge import Side, merge_trees

        assert learned.master is not None
        theirs_id = learned.master
        graph = self.graph
        # tree_at: a fork's base is an older commit, whose indexes may not be known.
        base_flat = graph.tree_at(base_master) if base_master else {}
        ours_flat = graph.flatten(ours.tree)
        writer = self.outbox.writer()
        self._repack_collected(ours_flat, writer)
        selection = self.scanner.selection()
        merged, conflicts = merge_trees(
            base_flat,
            Side(ours_flat, ours.device, commit_stamp(ours.time_ns)),
            Side(graph.flatten(theirs.tree), theirs.device, commit_stamp(theirs.time_ns)),
            (lambda path, is_dir: not selection.selects(path, is_dir)) if selection.active else None,
        )
        files = {p: e for p, e in merged.items() if e.type != "dir"}
        dirs = {p for p, e in merged.items() if e.type == "dir"}
        root_id, trees = self.scanner.build_trees(files, dirs)
        moves = {c.copy: c.path for c in conflicts if c.moved == "ours"}

        def then() -> None:
            self.versions.set_base(learned)
            self.state.checkout_pending = PendingCheckout(ours.tree, root_id, moves)

        self.committer.seal(
            writer, root_id, trees, parents=(theirs_id, head),
            message=f"merge version {learned.number}", inherited=[theirs, ours], refreshed=[],
            then=then,
        )
        return conflicts

    def _repack_collected(self, flat: dict[str, TreeEntry], writer: ObjectWriter) -> None:
        """Objects an unpushed local commit shares with content a concurrent gc
        collected (it deduplicated against them just before): pack them again from
        the folder, so the merge commit about to be made refers only to objects
        that exist. Content no longer in the folder cannot be recovered: fail."""
        db = self.ctx.db
        lost: list[str] = []
        for path, entry in flat.items():
            if entry.type not in ("file", "chunked"):
                continue
            needed = [entry.ref]
            cached = db.cached_object(entry.ref) if entry.type == "chunked" else None
            if cached is not None:
                needed += [c.blob_id for c in FileObject.from_bytes(cached).chunks]
            if all(db.is_located(i) for i in needed):
                continue
            try:
                st = os.lstat(self.ctx.root / path)
            except OSError:
                lost.append(path)
                continue
            scanned = ScanEntry(path, "file", st.st_size, st.st_mtime_ns, st.st_ino,
                                entry.executable)
            got = self.scanner.hash_one(scanned, writer.sink) if stat.S_ISREG(st.st_mode) else None
            if got is None or got[1] != entry.ref:
                lost.append(path)
        if lost:
            raise ObjectUnavailable(
                f"{len(lost)} file(s) of your unpushed changes ({', '.join(sorted(lost)[:3])}) "
                "shared content with files a concurrent gc collected, and that content is no "
                "longer in the folder; restore them from your backup or re-create them, then push"
            )
