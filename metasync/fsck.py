"""fsck: check that every copy history needs is where the latest configuration
puts it, and (``--repair``) re-create what is missing or bad through the
replicator, from verified good copies.

It checks what gc keeps: every commit of history, and the content of the
commits gc has not pruned. ``--quick`` checks listings only; the default
downloads and verifies every copy and fragment. Temporary files that killed
uploads left on backends are reported with their total size (``--repair``
removes them once older than the grace period).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from metasync.backends import Backend
from metasync.context import RepoContext
from metasync.errors import BackendError, CorruptObject, MetasyncError, ObjectNotFound
from metasync.graph import ObjectGraph
from metasync.layout import fragment_key, object_key
from metasync.maintenance.gc import TempSweep, sweep_temp_files
from metasync.objects import Config, Version
from metasync.replicator import Replicator, take_inventory
from metasync.store import fragment_mapping_of, mapping_of
from metasync.versions import Versions

#: Checks fsck starts over when a concurrent gc collects what it was checking.
FSCK_ATTEMPTS = 5


@dataclass(frozen=True)
class FsckProblem:
    backend: str
    kind: str
    object_id: str
    problem: str  # "missing", "corrupt", "unreachable"


@dataclass
class FsckReport:
    checked_copies: int = 0
    objects: int = 0
    problems: list[FsckProblem] = field(default_factory=list)
    #: Copies ``--repair`` re-created from a good copy (each was a problem above).
    repaired: list[FsckProblem] = field(default_factory=list)
    #: Temporary files of killed uploads older than the grace period (removed with
    #: ``--repair``). Not problems: no copy is wrong, they only take space.
    temp_files: TempSweep = field(default_factory=TempSweep)

    @property
    def ok(self) -> bool:
        """No problem is left (repaired ones do not count)."""
        fixed = set(self.repaired)
        return all(p in fixed for p in self.problems)


class Fsck:
    """Checks (and repairs) the copies of one repository's history."""

    def __init__(self, ctx: RepoContext, versions: Versions, graph: ObjectGraph,
                 replicator: Replicator) -> None:
        self.ctx = ctx
        self.versions = versions
        self.graph = graph
        self.replicator = replicator

    def run(self, *, quick: bool = False, repair: bool = False) -> FsckReport:
        """Check every copy of every object reachable from master's history on every
        backend the latest configuration places it on: by downloading and verifying
        it, or with ``quick`` only that it is listed there. With ``repair``, re-create
        each missing or corrupt copy from a good one and report what was fixed.

        A gc that another client finishes meanwhile may collect versions this check
        started from: then it starts again from the new latest version (a few times)
        rather than report their objects as missing.

        It also looks for temporary files of killed uploads older than the grace
        period (:func:`~metasync.maintenance.gc.sweep_temp_files`), which ``repair``
        removes; they are reported, not problems."""
        versions = self.versions
        for _ in range(FSCK_ATTEMPTS):
            epoch = versions.load_config(versions.learn_latest().config).gc_epoch
            report = self._check(quick=quick, repair=False)
            if report.ok or versions.load_config(versions.learn_latest().config).gc_epoch == epoch:
                break
        if repair:
            report = self._check(quick=quick, repair=True)
        report.temp_files = sweep_temp_files(
            self.ctx, self.ctx.pool.open(versions.load_config(versions.learn_latest().config)),
            delete=repair)
        return report

    def _check(self, *, quick: bool, repair: bool) -> FsckReport:
        report = FsckReport()
        latest = self.versions.learn_latest()
        config = self.versions.load_config(latest.config)
        backends = self.ctx.pool.open(config)
        mapping = mapping_of(config)
        with self.versions.reading_with(config):
            standalone, packs = self._reachable(latest, config, report)
        report.objects = len(standalone) + len(packs)
        coded: dict[str, dict[int, dict[str, int]]] = {}
        if config.erasure is not None:
            fragments = take_inventory(backends, self.ctx.store.executor).fragments
            wanted = {oid for _, oid in standalone} | packs
            coded = {oid: held for oid, held in fragments.items() if oid in wanted}
            self._check_fragments(config, backends, coded, quick, report)
        jobs = [(kind, oid, b) for kind, oid in standalone if oid not in coded
                for b in mapping.locate(oid)]
        jobs += [("pack", p, b) for p in sorted(packs) if p not in coded for b in mapping.locate(p)]
        executor = self.ctx.store.executor
        if quick:
            listed = self._listed(backends, report)
            for kind, oid, b in jobs:
                report.checked_copies += 1
                if b in listed and object_key(oid) not in listed[b]:
                    report.problems.append(FsckProblem(b, kind, oid, "missing"))
        else:
            reporter = self.ctx.reporter
            reporter.start("verify", len(jobs))
            try:
                for problem in executor.map(lambda j: self._verify_copy(backends, *j), jobs):
                    report.checked_copies += 1
                    reporter.advance(1)
                    if problem is not None:
                        report.problems.append(problem)
            finally:
                reporter.finish()
        self._check_records(backends, report, repair)
        if repair:
            broken: dict[str, set[str]] = {}
            for p in report.problems:
                if p.problem in ("missing", "corrupt") or p.problem.startswith("unreadable"):
                    broken.setdefault(p.object_id, set()).add(p.backend)
            repaired = self.replicator.repair(backends, broken, coded, config)
            report.repaired += [p for p in report.problems
                                if p.backend in repaired.get(p.object_id, ())]
        return report

    def _check_records(self, backends: dict[str, Backend], report: FsckReport,
                       repair: bool) -> None:
        """Compaction floors, marks, recovery marks and ``latest`` hints that do not
        authenticate as what their names say (readers ignore them; a backend may be
        tampering): each is a problem, and ``repair`` deletes it -- no client wrote
        those bytes under that name."""
        from metasync.consensus import untrusted_keys

        def check(item: tuple[str, Backend]) -> list[FsckProblem]:
            backend_id, backend = item
            try:
                found = untrusted_keys(self.ctx.codec, backend)
            except MetasyncError as exc:
                return [FsckProblem(backend_id, "-", "-", f"unreachable: {exc}")]
            problems = []
            for key, why in sorted(found.items()):
                problem = FsckProblem(backend_id, "record", key, f"forged or damaged ({why})")
                problems.append(problem)
                if repair:
                    try:
                        backend.delete(key)
                    except ObjectNotFound:
                        pass
                    except MetasyncError:
                        continue
                    report.repaired.append(problem)
            return problems

        for problems in self.ctx.store.executor.map(check, sorted(backends.items())):
            report.problems += problems

    def _check_fragments(
        self, config: Config, backends: dict[str, Backend],
        coded: dict[str, dict[int, dict[str, int]]], quick: bool, report: FsckReport,
    ) -> None:
        """Each of an erasure-coded object's n holders must hold a fragment of its
        own index (verified unless ``quick``)."""
        from metasync.erasure import verify_fragment

        holders_of = fragment_mapping_of(config)
        hasher = self.ctx.codec.hasher

        def check(item: tuple[str, dict[int, dict[str, int]]]) -> list[FsckProblem]:
            oid, held = item
            problems: list[FsckProblem] = []
            seen: set[int] = set()
            for backend_id in holders_of.locate(oid):
                mine = sorted(i for i, where in held.items() if backend_id in where and i not in seen)
                if not mine:
                    problems.append(FsckProblem(backend_id, "fragment", oid, "missing"))
                    continue
                seen.add(mine[0])
                if quick:
                    continue
                try:
                    data = backends[backend_id].get(fragment_key(oid, mine[0]))
                    verify_fragment(hasher, oid, mine[0], data)
                except ObjectNotFound:
                    problems.append(FsckProblem(backend_id, "fragment", oid, "missing"))
                except CorruptObject:
                    problems.append(FsckProblem(backend_id, "fragment", oid, "corrupt"))
                except BackendError as exc:
                    problems.append(FsckProblem(backend_id, "fragment", oid, f"unreadable: {exc}"))
            return problems

        for problems in self.ctx.store.executor.map(check, sorted(coded.items())):
            report.checked_copies += holders_of.replicas
            report.problems += problems

    def _listed(self, backends: dict[str, Backend], report: FsckReport) -> dict[str, set[str]]:
        """The object keys each reachable backend lists (an unreachable one is a problem)."""
        def listing(backend: Backend) -> set[str]:
            return set(backend.list("objects"))

        out: dict[str, set[str]] = {}
        futures = {b: self.ctx.store.executor.submit(listing, be) for b, be in backends.items()}
        for backend_id, fut in futures.items():
            try:
                out[backend_id] = fut.result()
            except MetasyncError as exc:
                report.problems.append(FsckProblem(backend_id, "-", "-", f"unreachable: {exc}"))
        return out

    def _reachable(
        self, latest: Version, config: Config, report: FsckReport
    ) -> tuple[list[tuple[str, str]], set[str]]:
        """Standalone objects ``(kind, id)`` and packs that must exist: every commit of
        master's history, and the indexes and content of every commit a gc has not
        pruned (younger than its cutoff, master, or a snapshot)."""
        history = self.graph.history(latest.master) if latest.master else {}
        kept = {cid for cid, c in history.items()
                if c.time_ns >= config.gc_cutoff_ns or cid == latest.master}
        kept |= {cid for _, cid in config.snapshots if cid in history}
        standalone = [("commit", cid) for cid in sorted(history)]
        standalone += [("index", i) for i in sorted({i for cid in kept for i in history[cid].indexes})]
        reachable: set[str] = set()
        for cid in sorted(kept):
            reachable |= self.graph.reachable_objects(history[cid])
        packs: set[str] = set()
        db = self.ctx.db
        for object_id in reachable:
            loc = db.location(object_id)
            if loc is None:
                report.problems.append(FsckProblem("-", "object", object_id, "unindexed"))
            else:
                packs.add(loc[0])
        return standalone, packs

    def _verify_copy(self, backends: dict[str, Backend], kind: str, object_id: str,
                     backend_id: str) -> FsckProblem | None:
        backend = backends[backend_id]
        try:
            data = backend.get(object_key(object_id))
        except ObjectNotFound:
            return FsckProblem(backend_id, kind, object_id, "missing")
        except BackendError as exc:
            return FsckProblem(backend_id, kind, object_id, f"unreadable: {exc}")
        codec = self.ctx.codec
        try:
            if kind == "pack":
                codec.pack_entries(object_id, data)
            else:
                codec.decode(kind, object_id, data)
        except CorruptObject:
            return FsckProblem(backend_id, kind, object_id, "corrupt")
        return None
