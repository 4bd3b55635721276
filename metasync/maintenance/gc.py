"""Garbage collection (paper 3.8; docs/FORMAT.md §10) and log compaction.

gc lists every object, reads every client's state, keeps what master, the
versions younger than the retention, the versions the retention policy keeps
(docs/retention.md), the snapshots and every client's head and base need, plus
every object a push announced, and decides a version with a gc commit and a configuration whose ``gc_epoch`` is one higher. It deletes only
after that version is decided; docs/design.md, "Garbage collection", argues why
a push in progress loses nothing.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field, replace

from metasync.backends import Backend
from metasync.backends.base import TempFile
from metasync.consensus import DEFAULT_LOG_GRACE_S
from metasync.context import RepoContext
from metasync.errors import (
    BackendUnavailable,
    CorruptObject,
    MetasyncError,
    ObjectNotFound,
    ObjectUnavailable,
)
from metasync.faults import crash_point, pause_point
from metasync.graph import ObjectGraph
from metasync.layout import CLIENTS_PREFIX, fragment_key, object_key, spill_key
from metasync.maintenance.reconfig import Reconfiguration
from metasync.objects import Commit, PackEntry, Version, is_object_id
from metasync.outbox import Outbox
from metasync.paxos import announcement_quorum
from metasync.replicator import Replicator, take_inventory
from metasync.retention import decide
from metasync.versions import Versions


@dataclass
class ClientStates:
    """What the clients published in ``clients/<id>`` (union over backends)."""

    heads: set[str] = field(default_factory=set)
    prev_masters: set[str] = field(default_factory=set)
    #: Objects announced by pushes in progress (uploaded or about to be).
    pending: set[str] = field(default_factory=set)


@dataclass
class TempSweep:
    """Temporary upload files that killed writers left on backends, older than the
    grace period (:func:`sweep_temp_files`)."""

    #: ``(backend id, temporary file)`` of each found (and removed, if asked).
    found: list[tuple[str, TempFile]] = field(default_factory=list)
    #: Whether they were removed.
    removed: bool = False
    #: Backends that could not be swept, by id: why.
    errors: dict[str, str] = field(default_factory=dict)

    @property
    def size(self) -> int:
        """Their total size in bytes."""
        return sum(t.size for _, t in self.found)


def sweep_temp_files(ctx: RepoContext, backends: dict[str, Backend], *, delete: bool,
                     grace_s: float | None = None, now: float | None = None) -> TempSweep:
    """Find -- and with ``delete`` remove -- the temporary upload files (``.tmp-*``)
    on ``backends`` last written more than the grace period before ``now``: the
    leftovers of writers killed mid-upload (:meth:`Backend.sweep_temp_files`). The
    grace is gc's for in-flight work (``gc --log-grace``, default
    :data:`DEFAULT_LOG_GRACE_S`): an upload in progress keeps its file younger than
    that (every write touches it), and clocks of clients and services are assumed to
    differ by less than half of it (docs/protocol.md). A backend that cannot be swept
    is recorded, not fatal."""
    grace = DEFAULT_LOG_GRACE_S if grace_s is None else grace_s
    older_than = (time.time() if now is None else now) - grace
    sweep = TempSweep(removed=delete)

    def one(item: tuple[str, Backend]) -> tuple[str, list[TempFile] | str]:
        backend_id, backend = item
        try:
            return backend_id, backend.sweep_temp_files(older_than, delete=delete)
        except MetasyncError as exc:
            return backend_id, str(exc)

    for backend_id, result in ctx.store.executor.map(one, sorted(backends.items())):
        if isinstance(result, str):
            sweep.errors[backend_id] = result
        else:
            sweep.found += [(backend_id, t) for t in sorted(result, key=lambda t: t.path)]
    return sweep


@dataclass
class GcReport:
    """What a gc did."""

    #: The version the gc decided (its commit names what survives), or None.
    version: Version | None = None
    objects: int = 0
    deleted: int = 0
    bytes_deleted: int = 0
    #: Copies that could not be deleted (an unreachable backend): the next gc retries.
    failed: int = 0
    #: Commits whose content is no longer kept (older than the retention).
    pruned_commits: int = 0
    cutoff_ns: int = 0
    #: Another client's version won the instance: nothing was deleted.
    lost_race: bool = False
    #: Log compaction: the floor it set (0: nothing old enough yet) and the log
    #: objects it removed, or why it was postponed.
    log_floor: int = 0
    logs_removed: int = 0
    log_compaction_error: str = ""
    #: Temporary files of killed uploads it removed (older than the grace period).
    temp_files: TempSweep = field(default_factory=TempSweep)


class GarbageCollector:
    """gc and log compaction for one repository."""

    def __init__(self, ctx: RepoContext, versions: Versions, graph: ObjectGraph,
                 outbox: Outbox, replicator: Replicator, reconfig: Reconfiguration) -> None:
        self.ctx = ctx
        self.versions = versions
        self.graph = graph
        self.outbox = outbox
        self.replicator = replicator
        self.reconfig = reconfig

    def collect_garbage(self, now_ns: int | None = None,
                        log_grace_s: float | None = None) -> GcReport:
        """Collect unneeded objects (:meth:`collect_objects`), then compact the pPaxos
        logs of versions decided more than the grace period ago (default one day; see
        :meth:`metasync.consensus.Consensus.compact_logs`). A compaction that cannot
        record its floor on every backend is postponed, which is no error."""
        latest = self.versions.learn_latest()
        learned_ns = time.time_ns()
        report = self.collect_objects(latest, now_ns)
        try:
            report.log_floor, report.logs_removed = self.versions.consensus_for(
                latest.config).compact_logs(
                latest, learned_ns, time.time_ns() if now_ns is None else now_ns, log_grace_s)
        except MetasyncError as exc:
            report.log_compaction_error = str(exc)
        report.temp_files = sweep_temp_files(
            self.ctx, self.ctx.pool.open(self.versions.load_config(latest.config)),
            delete=True, grace_s=log_grace_s,
            now=None if now_ns is None else now_ns / 1e9)
        return report

    def collect_objects(self, latest: Version, now_ns: int | None = None) -> GcReport:
        """Delete every stored object no version still needs (paper 3.8).

        Kept: every commit of master's history (they are small, and keep ``log``
        whole); the trees, files, blobs and indexes of master, of every commit younger
        than the retention, of every version the retention policy keeps
        (:func:`metasync.retention.decide`), of every snapshot, and of every
        client's published head and base; and every object a push in progress announced. The gc then writes a
        commit with master's tree whose indexes list exactly the surviving objects, and
        decides it through pPaxos together with a configuration whose ``gc_epoch`` is
        one higher. Only if that version wins does it delete -- so a push that raced it
        either won first (and its objects were kept as master's) or learns the new
        epoch, forgets what it knew of collected objects and re-packs what it needs."""
        report = GcReport()
        versions, ctx = self.versions, self.ctx
        config = versions.load_config(latest.config)
        if latest.master is None:
            return report
        now_ns = time.time_ns() if now_ns is None else now_ns
        cutoff = max(config.gc_cutoff_ns, now_ns - config.retention_days * 86_400 * 10**9)
        report.cutoff_ns = cutoff
        backends = ctx.pool.open(config)
        with versions.reading_with(config):
            inventory = take_inventory(backends, ctx.store.executor)
            states = self.read_client_states(backends, config.fault_model == "byzantine")
            report.objects = len(inventory.stored_ids())
            history = self.graph.history(latest.master)
            # One decision for gc and `forget --dry-run`: the window, the policy,
            # master and the snapshots (metasync.retention.decide).
            decision = decide(latest.master, history, config.policy, config.snapshots, cutoff)
            retained = set(decision.keep) | {cid for _, cid in config.snapshots}
            retained |= states.heads | states.prev_masters
            live_packs, live_indexes, kept_commits = self._live(
                retained, required={latest.master, *(c for _, c in config.snapshots)})
            report.pruned_commits = sum(
                1 for cid, c in history.items()
                if cid not in kept_commits and c.time_ns >= config.gc_cutoff_ns)
            master = history[latest.master]
            indexes = self.outbox.index_objects(sorted(
                (pack_id, tuple(sorted(entries.values(), key=lambda e: e.offset)))
                for pack_id, entries in live_packs.items()))
            commit = Commit(tree=master.tree, parents=(latest.master,), client=ctx.client_id,
                            device=ctx.device, time_ns=now_ns, message="gc",
                            indexes=tuple(sorted(i for _, i, _ in indexes)))
            commit_bytes = commit.to_bytes()
            commit_id = ctx.codec.id_of("commit", commit_bytes)
            keep = (set(history) | kept_commits | live_indexes | set(live_packs) | states.pending
                    | {i for _, i, _ in indexes} | {commit_id})
            garbage = _garbage_keys(inventory.copies, inventory.fragments, keep)
            if not garbage:
                return report
            self.outbox.upload_standalone([*indexes, ("commit", commit_id, commit_bytes)])
        new = replace(config, gc_epoch=config.gc_epoch + 1, gc_cutoff_ns=cutoff)
        new_id = self.reconfig.store_config(new, backends.values())
        consensus = versions.consensus_for(latest.config)
        proposal = Version(latest.number + 1, commit_id, new_id)
        # Its commit, indexes and configuration are stored, nothing refers to them.
        crash_point("gc:stored")
        pause_point("gc:propose")  # garbage chosen, not yet decided: a push may win first
        chosen = consensus.propose(proposal.number, proposal)
        if chosen != proposal:
            report.lost_race = True
            return report
        crash_point("gc:decided")  # nothing deleted yet: the next gc deletes it all
        consensus.publish(chosen)
        report.version = chosen

        def delete(item: tuple[str, dict[str, dict[str, int]]]) -> tuple[int, int, int]:
            _, held = item
            done = size = failed = 0
            for backend_id, keys in held.items():
                crash_point("gc:delete")  # some copies gone: the next gc deletes the rest
                d, s, f = self.replicator.delete(backends[backend_id], keys)
                done, size, failed = done + d, size + s, failed + f
            return done, size, failed

        # Spill records of collected objects go too (there is nothing left to move).
        for stored_id, record in self.replicator.spill_records(backends, read=False).items():
            if stored_id in garbage:
                for backend_id in record.listed_on:
                    self.replicator.delete(backends[backend_id], {spill_key(stored_id): 0})
        reporter = ctx.reporter
        reporter.start("gc", len(garbage))
        try:
            for done, size, failed in ctx.store.executor.map(delete, sorted(garbage.items())):
                report.deleted += done
                report.bytes_deleted += size
                report.failed += failed
                reporter.advance(1)
        finally:
            reporter.finish()
        return report

    def read_client_states(self, backends: dict[str, Backend], byzantine: bool) -> ClientStates:
        """Read every client's state from every backend (of a configuration whose
        fault model is ``byzantine`` or not); the union counts, so a
        backend serving an older record (or none) hides nothing another one shows.
        A push announces its uploads on :func:`~metasync.paxos.announcement_quorum`
        backends before making them, and this needs as many to answer: two
        majorities share a backend (crash faults); two Byzantine quorums share
        ``f + 1``, so an honest one that has the announcement (docs/protocol.md,
        "Garbage collection and Byzantine backends"). So every announcement made
        before this read started is seen."""
        states = ClientStates()
        codec = self.ctx.codec

        def read_all(backend: Backend) -> list[dict[str, object]]:
            docs = []
            for key in backend.list(CLIENTS_PREFIX):
                try:
                    raw = codec.decode("client", key, backend.get(key))
                    doc = json.loads(raw)
                except ObjectNotFound:
                    continue
                except (CorruptObject, ValueError, RecursionError):
                    continue  # unreadable: as if absent (it cannot announce anything)
                if isinstance(doc, dict):
                    docs.append(doc)
            return docs

        answered = 0
        errors: list[str] = []
        executor = self.ctx.store.executor
        futures = {b: executor.submit(read_all, backend) for b, backend in backends.items()}
        for backend_id, future in futures.items():
            try:
                docs = future.result()
            except MetasyncError as exc:
                errors.append(f"{backends[backend_id].name}: {exc}")
                continue
            answered += 1
            for doc in docs:
                head = doc.get("head")
                if is_object_id(head):
                    states.heads.add(str(head))
                prev = doc.get("prev")
                if isinstance(prev, dict) and is_object_id(prev.get("master")):
                    states.prev_masters.add(str(prev["master"]))
                pending = doc.get("pending")
                if isinstance(pending, list):
                    states.pending.update(p for p in pending if is_object_id(p))
        needed = announcement_quorum(len(backends), byzantine)
        if answered < needed:
            raise BackendUnavailable(
                f"only {answered} of {len(backends)} backends could be read; gc needs {needed} "
                f"to see every push in progress ({errors[0] if errors else ''}); nothing was deleted"
            )
        return states

    def _live(
        self, retained: set[str], required: set[str]
    ) -> tuple[dict[str, dict[str, PackEntry]], set[str], set[str]]:
        """Live pack entries by pack, live index ids, and the retained commits whose
        content could be read (a commit pruned by an earlier gc is only a name now).

        Each retained commit's objects are located through *its own* indexes, and every
        pack so named is live: a client reading that commit (say master, just before
        it learns of this gc) finds each object where that commit says, even when
        another pack holds a copy too."""
        packs: dict[str, dict[str, PackEntry]] = {}
        indexes: set[str] = set()
        kept: set[str] = set()
        maps: dict[str, dict[str, tuple[str, PackEntry]]] = {}
        graph = self.graph

        def index_map(index_id: str) -> dict[str, tuple[str, PackEntry]]:
            found = maps.get(index_id)
            if found is None:
                index = graph.read_index(index_id)
                found = maps[index_id] = {
                    e.object_id: (pack_id, e) for pack_id, entries in index.packs for e in entries}
            return found

        for cid in sorted(retained):
            try:
                commit = graph.load_commit(cid)
                objects = graph.reachable_objects(commit)
                located = [index_map(i) for i in commit.indexes]
            except ObjectUnavailable as exc:
                if cid in required:  # master or a snapshot must be whole: stop, delete nothing
                    raise ObjectUnavailable(
                        f"cannot read all of version {cid[:12]} ({exc}); run `metasync fsck`; "
                        "gc deleted nothing") from None
                continue  # an unpushed head, or a version an earlier gc already collected
            kept.add(cid)
            indexes.update(commit.indexes)
            for object_id in objects:
                hit = next((m[object_id] for m in located if object_id in m), None)
                if hit is None:
                    raise ObjectUnavailable(
                        f"object {object_id[:12]} of commit {cid[:12]} is in none of its indexes; "
                        "run `metasync fsck` (gc deleted nothing)")
                packs.setdefault(hit[0], {})[object_id] = hit[1]
        return packs, indexes, kept


def _garbage_keys(
    copies: dict[str, dict[str, int]], fragments: dict[str, dict[int, dict[str, int]]],
    keep: set[str],
) -> dict[str, dict[str, dict[str, int]]]:
    """Stored id -> backend -> key -> size of every copy and fragment not in ``keep``."""
    garbage: dict[str, dict[str, dict[str, int]]] = {}
    for sid, held in copies.items():
        if sid not in keep:
            for b, size in held.items():
                garbage.setdefault(sid, {}).setdefault(b, {})[object_key(sid)] = size
    for sid, by_index in fragments.items():
        if sid not in keep:
            for index, where in by_index.items():
                for b, size in where.items():
                    garbage.setdefault(sid, {}).setdefault(b, {})[fragment_key(sid, index)] = size
    return garbage

