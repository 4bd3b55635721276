"""The pPaxos simulator: seeded schedules hold every invariant, replay bit for bit,
and the checker does catch a broken protocol (so a pass means something).

Nothing here sleeps or looks at a clock: the simulator runs in virtual time.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

import pytest

from metasync import follow, paxos, simulator
from metasync.errors import Compacted
from metasync.mapping import StableMapping
from metasync.objects import Version
from metasync.paxos import FAST_ROUND, AcceptorState, Message, Quorums, Round
from metasync.simulator import Simulation, run
from metasync.simulator.sessions import Sessions
from metasync.simulator.storage import Storage, Upload

# Seeds whose schedule breaks an invariant under one broken rule (found by running
# the broken variant over seeds 0 and up; each passes with the real rule).
SEED_FROM_ZERO = 3
SEED_NO_SPILL = 144
SEED_EARLY_DROP = 109
SEED_TAMPER = 4  # a finished schedule with acknowledged pushes, to tamper with

#: The findings (docs/simulator.md), each fixed in production since: the rules
#: production followed before (switched off), a seed they break and the invariant
#: that reports it. F1 and F2 show together: a change decided after an incomplete
#: copy is healed by the rebalance after it unless that was never recorded.
FINDINGS = [
    ("F1+F2", [(Sessions, "copy_first_completely"), (Sessions, "rebalance_pending_first")],
     2224, simulator.DEFAULT_BFT_SHARE, "durability"),
    ("F3", [(Sessions, "rebalance_to_latest")], 2893, 0.5, "durability"),
    ("F4", [(Sessions, "ack_counts_earlier_short")], 460, simulator.DEFAULT_BFT_SHARE,
     "durability"),
    # Without the seal, only a loss rule guarding the old configuration's majority
    # kept clients behind able to learn the change.
    ("F5", [(Sessions, "seal_on_new"), (Simulation, "guard_decider")], 1367,
     simulator.DEFAULT_BFT_SHARE, "liveness"),
]


def violations(seeds: Sequence[int], bft_share: float = simulator.DEFAULT_BFT_SHARE) -> list[str]:
    out = []
    for seed in seeds:
        result = run(seed, bft_share)
        out += [f"seed {seed}: {v} (replay: bin/simulate --seeds 1 --first-seed {seed} -v)"
                for v in result.violations]
    return out


def first_violation(seeds: Sequence[int], bft_share: float = simulator.DEFAULT_BFT_SHARE) -> str | None:
    """The first violation any of ``seeds`` shows (stops there: these runs are slow-ish)."""
    for seed in seeds:
        result = run(seed, bft_share)
        if result.violations:
            return f"seed {seed}: {result.violations[0]}"
    return None


# ============================================================== the real protocol holds
def test_mixed_schedules_hold_every_invariant() -> None:
    """200 schedules of the default mix (crash and Byzantine mode, all fault kinds)."""
    assert violations(range(200)) == []


def test_byzantine_schedules_hold_every_invariant() -> None:
    """100 schedules in Byzantine mode only: lying acceptors plus all the other faults."""
    assert violations(range(50_000, 50_100), bft_share=1.0) == []


def test_schedules_exercise_the_faults() -> None:
    """The schedules above are not vacuous: every kind of fault happens, both fast and
    classic rounds decide versions, and some pushes are only learned after a crash."""
    totals: Counter[str] = Counter()
    for seed in range(60):
        totals.update(run(seed).stats)
    for key in ("client crashes", "acceptor outages", "outages beyond the tolerated faults",
                "partitions", "requests failed", "requests torn", "replies lost",
                "round trips timed out", "long delays", "plain appends duplicated",
                "versions decided in the fast round", "versions decided in a classic round",
                "pushes already in master", "propose raised Contended",
                "get_recent raised NoQuorum", "schedules in Byzantine mode"):
        assert totals[key] > 0, key


# ============================================================== determinism
def test_same_seed_same_trace() -> None:
    first = run(11, trace=True)
    again = run(11, trace=True)
    assert first.trace == again.trace
    assert len(first.trace) > 100
    assert run(12, trace=True).trace != first.trace


@pytest.mark.parametrize("seed", [3, 50_007])
def test_trace_does_not_depend_on_the_hash_seed(seed: int) -> None:
    """Two processes with different string hashing print the very same trace."""
    outputs = []
    for hash_seed in ("1", "4242"):
        env = {**os.environ, "PYTHONHASHSEED": hash_seed}
        proc = subprocess.run(
            [sys.executable, "-m", "metasync.simulator", "--seeds", "1", "--first-seed", str(seed),
             "--bft-share", "0.5", "-v"],
            env=env, capture_output=True, text=True, check=True,
        )
        outputs.append(proc.stdout)
    assert outputs[0] == outputs[1]
    assert outputs[0].rstrip().endswith("1 schedules, 0 violations")
    assert "\n".join(run(seed, 0.5, trace=True).trace) in outputs[0]


# ============================================================== the CLI
def test_cli_summary_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert simulator.main(["--seeds", "3", "--first-seed", "20", "--jobs", "1"]) == 0
    assert capsys.readouterr().out == "3 schedules, 0 violations\n"


def test_cli_reports_failing_seeds(monkeypatch: pytest.MonkeyPatch,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(paxos, "choose_value", _always_own)
    assert simulator.main(["--seeds", "20", "--jobs", "1"]) == 1
    lines = capsys.readouterr().out.splitlines()
    failing = [line for line in lines if line.startswith("seed ")]
    assert failing
    seed = int(failing[0].split()[1].rstrip(":"))
    assert failing[0].endswith(f"replay: bin/simulate --seeds 1 --first-seed {seed} -v")
    assert lines[-1] == f"20 schedules, {len(failing)} violations"


# ============================================================== the checker can fail
def _always_own(reports: Sequence[tuple[Round, Version] | None], quorums: Quorums,
                own: Version | None) -> Version | None:
    """Broken Paxos: ignore what the promises report and propose one's own value."""
    if own is not None:
        return own
    return next((report[1] for report in reports if report is not None), None)


def test_checker_catches_proposers_ignoring_promises(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(paxos, "choose_value", _always_own)
    assert first_violation(range(40)) is not None


def test_checker_catches_deciding_on_one_acceptance(monkeypatch: pytest.MonkeyPatch) -> None:
    """Broken learner: any single acceptance counts as decided."""

    def decided(states: Iterable[AcceptorState], quorums: Quorums) -> Version | None:
        for state in states:
            for value in state.accepts.values():
                return value
        return None

    monkeypatch.setattr(paxos, "decided", decided)
    assert first_violation(range(40)) is not None


def test_checker_catches_a_too_small_fast_quorum(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fast quorums of a bare majority break ``classic + 2 * fast > 2 * n``: two
    fast-round values can each look possibly chosen to a classic-round proposer."""
    monkeypatch.setattr(Quorums, "crash", classmethod(lambda cls, n: cls(n, n // 2 + 1, n // 2 + 1)))
    found = first_violation(range(400), bft_share=0.0)
    assert found is not None and "different values chosen" in found


def test_checker_catches_fast_recovery_off_by_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """choose_value asking one more fast-round report than needed may drop a value a
    fast quorum chose."""
    original = paxos.choose_value

    def choose_value(reports: Sequence[tuple[Round, Version] | None], quorums: Quorums,
                     own: Version | None) -> Version | None:
        prior = [r for r in reports if r is not None]
        if prior and max(rnd for rnd, _ in prior) == FAST_ROUND and quorums.fast is not None:
            counts = Counter(value for _, value in prior)
            needed = quorums.fast - (quorums.acceptors - len(reports)) + 1
            for value, count in counts.items():
                if count >= needed:
                    return value
            return own if own is not None else original(reports, quorums, own)
        return original(reports, quorums, own)

    monkeypatch.setattr(paxos, "choose_value", choose_value)
    found = first_violation(range(400), bft_share=0.0)
    assert found is not None and "different values chosen" in found


def test_checker_catches_crash_quorums_against_byzantine_acceptors(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Majority quorums are not enough when acceptors lie."""
    monkeypatch.setattr(Quorums, "bft",
                        classmethod(lambda cls, n: cls(n, n // 2 + 1, None, byzantine=True)))
    assert first_violation(range(300), bft_share=1.0) is not None


# ----------------------------------------------- each invariant, on a tampered outcome
def _finished(seed: int = 4) -> Simulation:
    sim = Simulation(seed)
    result = sim.run()
    assert result.ok and result.versions >= 2, result.violations
    sim.violations.clear()
    return sim


def test_invariant_one_value_per_instance() -> None:
    sim = _finished()
    other = Version(1, "e" * 64, simulator.CONFIG)
    sim.commits[other.master or ""] = (None, frozenset({"x"}))
    for acc in sim.acceptors.values():
        acc.logs[1] = [Message("prepare", Round(99, "evil")), Message("accept", Round(99, "evil"), other)]
    sim.check()
    assert any("instance 1: 2 different values chosen" in v for v in sim.violations)


def test_invariant_decisions_need_an_honest_quorum() -> None:
    sim = _finished()
    bogus = Version(1, "e" * 64, simulator.CONFIG)
    sim.observed[1].append((bogus, "c9.s0 (propose)"))
    sim.check()
    assert any("c9.s0 (propose) decided" in v and "no quorum" in v for v in sim.violations)


def test_invariant_successful_pushes_survive() -> None:
    sim = _finished()
    version = sim.successes[0][2]
    sim.successes.append(("c7-0", "c7.s0", version))
    sim.check()
    assert any(v.startswith("lost push: c7.s0 pushed c7-0") for v in sim.violations)


def test_invariant_clients_converge() -> None:
    sim = _finished()
    sim.clients[1].final = Version(0, None, simulator.CONFIG)
    sim.check()
    assert any(v.startswith("clients did not converge") for v in sim.violations)


def test_invariant_history_is_linear() -> None:
    sim = _finished()
    final = sim.clients[0].final
    assert final is not None and final.master is not None
    _, changes = sim.commits[final.master]
    sim.commits[final.master] = ("d" * 64, changes)
    sim.check()
    assert any(v.startswith(f"history: version {final.number}") and "has parent" in v
               for v in sim.violations)


def test_checker_catches_a_driver_that_drops_undecodable_entries(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Liveness: fetches must keep a slot for each entry that does not decode (a torn
    write), or a conditional append aims at the wrong position for ever: seed 91
    stalls without the slots."""
    apply = Simulation.apply

    def dropping(self: Simulation, acc: simulator.Acceptor, req: paxos.Request,
                 config: str) -> paxos.Reply | tuple[int, str]:
        reply = apply(self, acc, req, config)
        return [m for m in reply if m is not None] if isinstance(reply, list) else reply

    assert run(91, 0.0).ok
    monkeypatch.setattr(Simulation, "apply", dropping)
    # The stall shows within a minute of simulated time as well as within ten: a
    # shorter wait spares the checker simulating ~20 minutes of a client spinning.
    monkeypatch.setattr(simulator.simulation, "HEAL_LIMIT", 60.0)
    found = first_violation([91], bft_share=0.0)
    assert found is not None and "liveness" in found and "did not finish its pushes" in found


# ============================================================== log compaction
def test_schedules_exercise_log_compaction() -> None:
    """Compaction runs in the schedules, clients behind it jump over the deleted
    logs, and a proposal that started below the floor is stopped by it."""
    totals: Counter[str] = Counter()
    for seed in range(60):
        totals.update(run(seed).stats)
    for key in ("compactions", "logs compacted", "get_recent jumped over compacted instances"):
        assert totals[key] > 0, key
    assert run(2040).stats.get("proposals stopped at the compaction floor", 0) > 0


def test_checker_catches_compaction_without_floors(monkeypatch: pytest.MonkeyPatch) -> None:
    """Deleting logs without recording the floor first lets a client that is behind
    take an emptied instance for a free one."""

    def compact(setup: paxos.Setup, below: int) -> paxos.Run[int]:
        removed = yield [paxos.DropLogs(a, below) for a in setup.acceptors]
        return sum(r for r in removed or [] if type(r) is int)

    monkeypatch.setattr(simulator.simulation, "compact", compact)
    assert first_violation(range(40)) is not None


def test_checker_catches_proposals_that_skip_the_floor(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the floor read in a proposal's first round trip, a proposer that read
    an instance just before compaction emptied it decides a second value there."""

    def split(self: paxos._FloorCheck, size: int,
              replies: list[paxos.Reply] | None) -> tuple[list[paxos.Reply] | None, set[str]]:
        return replies, set(self.setup.acceptors)

    monkeypatch.setattr(paxos._FloorCheck, "extend", lambda self, batch: batch)
    monkeypatch.setattr(paxos._FloorCheck, "split", split)
    assert first_violation([58]) is not None


def test_checker_catches_past_floor_following_a_moved_floor(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Safety: a reader behind a floor whose floor moves on while it reads must not
    follow it on its own acceptors -- the new floor may be another configuration's.
    Following it there (paxos.past_floor did), a sleeper decided a second value in
    an instance the newer configuration had decided (seed 18872)."""
    real = paxos.past_floor

    def following(setup: paxos.Setup, floor: int, rng: Any) -> paxos.Run[Version]:
        while True:
            try:
                return (yield from real(setup, floor, rng))
            except Compacted as exc:
                floor = exc.floor

    assert run(18872).ok
    monkeypatch.setattr(simulator.following, "past_floor", following)
    found = first_violation([18872])
    assert found is not None and "different values chosen" in found, found


def test_checker_catches_compaction_without_the_grace(monkeypatch: pytest.MonkeyPatch) -> None:
    """Compacting an instance a running proposal began before (what the grace period
    rules out) loses or splits decisions."""
    monkeypatch.setattr(Simulation, "compactable",
                        lambda self, config: max(self.observed_at, default=0))
    # Rare (3 of the first 3,000 seeds): a proposal must see part of a decision, then
    # stall across a whole compaction.
    assert first_violation([400, 2847, 2995]) is not None


# ============================================================== configurations and losses
def test_schedules_exercise_configuration_changes_and_losses() -> None:
    """The schedules change the configuration every way, lose backends, spill and
    hand copies home, confirm hints, clone late and sleep through changes."""
    totals: Counter[str] = Counter()
    for seed in range(60):
        totals.update(run(seed).stats)
    for key in ("configuration changes decided: add", "configuration changes decided: remove",
                "configuration changes decided: remove dead",
                "configuration changes decided: replicas", "backends lost for good",
                "configuration changes followed by clients", "copies spilled",
                "spilled objects handed off", "spilled copies dropped", "missing copies written",
                "hints confirmed by reading", "hint reads of a client following configurations",
                "walks behind a floor other acceptors decided", "clones joining",
                "clones started from a confirmed hint", "clients asleep through the changes",
                "pushes acknowledged with R copies", "objects of acknowledged pushes checked"):
        assert totals[key] > 0, key


def _from_version_0_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """The old bug: no hint is ever followed; a client walks from its base, a clone
    from version 0."""

    def newer_from_hints(own: str, current: str, after: int) -> follow.Follow[Version | None]:
        return None
        yield  # a generator

    def start(hint: tuple[int, str] | None, known: Version) -> follow.Follow[Version | None]:
        return None
        yield

    monkeypatch.setattr(follow, "newer_from_hints", newer_from_hints)
    monkeypatch.setattr(follow, "start", start)


def test_checker_catches_following_from_version_0_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Liveness of following: once a dead backend was removed and another lost, the
    first configuration has no quorum left; a client that can only walk from it
    never learns the newest version (seed SEED_FROM_ZERO)."""
    assert run(SEED_FROM_ZERO).ok
    _from_version_0_only(monkeypatch)
    found = first_violation([SEED_FROM_ZERO])
    assert found is not None and ("liveness" in found or "did not converge" in found), found


def test_checker_catches_an_upload_that_does_not_spill(monkeypatch: pytest.MonkeyPatch) -> None:
    """Durability: copies that stay single while a holder is away (the old upload,
    which wrote the holders only and acknowledged one copy) are lost with it."""

    def upload(self: Storage, who: int, oid: str, mapping: StableMapping) -> Upload:
        holders = mapping.preference(oid)[: mapping.replicas]
        copies: list[str] = []
        missed: list[str] = []
        for backend in holders:
            (copies if self.put(who, backend, oid) else missed).append(backend)
        return Upload(oid, tuple(copies) or holders, copies, missed)

    assert run(SEED_NO_SPILL).ok
    monkeypatch.setattr(Storage, "upload", upload)
    found = first_violation([SEED_NO_SPILL])
    assert found is not None and "durability" in found, found


def test_checker_catches_a_hand_off_that_drops_too_early(monkeypatch: pytest.MonkeyPatch) -> None:
    """Durability: a hand-off that drops the spilled copy without every holder's copy
    verified (here: the holder's write failed) leaves fewer copies than R."""
    assert run(SEED_EARLY_DROP).ok
    monkeypatch.setattr(Storage, "may_hand_off", lambda self, holders, verified: True)
    found = first_violation([SEED_EARLY_DROP])
    assert found is not None and "durability" in found, found


@pytest.mark.parametrize("finding, rules, seed, bft_share, kind", FINDINGS,
                         ids=[f[0] for f in FINDINGS])
def test_findings_production_rules_fail(monkeypatch: pytest.MonkeyPatch, finding: str,
                                        rules: list[tuple[type, str]], seed: int,
                                        bft_share: float, kind: str) -> None:
    """The rules the model found production lacked (docs/simulator.md, "Findings",
    each since fixed in production): with the rules production followed before,
    these schedules break an invariant."""
    assert run(seed, bft_share).ok
    for owner, rule in rules:
        monkeypatch.setattr(owner, rule, False)
    result = run(seed, bft_share)
    assert result.violations and kind in result.violations[0], result.violations[:1]


def _storage(names: Sequence[str], replicas: int) -> tuple[Storage, StableMapping, set[str]]:
    backends = {b: simulator.Acceptor(b, False) for b in names}
    down: set[str] = set()
    storage = Storage(backends, lambda who, b: b not in down, Counter(), lambda text: None)
    return storage, StableMapping([(b, 1) for b in names], replicas), down


def test_storage_spills_to_the_next_backend_of_the_preference_order() -> None:
    storage, mapping, down = _storage(["a0", "a1", "a2", "a3"], 2)
    oid = "ab" * 32
    order = mapping.preference(oid)
    down.add(order[0])
    up = storage.upload(0, oid, mapping)
    assert up.copies == [order[1], order[2]] and up.missed == [order[0]] and not up.short
    assert storage.backends[order[2]].spills[oid] == (order[1], order[2])
    # Home again: the holder gets its copy, the spilled one and the records go.
    down.clear()
    left, _ = storage.repair(1, {(oid, order[0])}, mapping)
    assert left == set()
    assert sorted(b for b in order if oid in storage.backends[b].objects) == sorted(order[:2])
    assert not any(oid in storage.backends[b].spills for b in order)


def test_storage_keeps_a_spilled_copy_until_every_holder_has_one() -> None:
    storage, mapping, down = _storage(["a0", "a1", "a2"], 2)
    oid = "cd" * 32
    order = mapping.preference(oid)
    down.add(order[1])
    up = storage.upload(0, oid, mapping)
    assert up.spilled == [order[2]]
    storage.repair(1, set(), mapping)  # the holder is still away: nothing is dropped
    assert oid in storage.backends[order[2]].objects and oid in storage.backends[order[2]].spills
    fewer = storage.upload(0, "ef" * 32, StableMapping([(b, 1) for b in ["a0", "a1", "a2"]], 3))
    assert fewer.short


def test_invariant_durability() -> None:
    sim = _finished(SEED_TAMPER)
    version, _, _ = sim.acknowledged[0]
    assert version.master is not None
    for backend in sim.acceptors.values():
        backend.objects.discard(version.master)
    sim.check()
    assert any(v.startswith("durability:") and version.master[:6] in v for v in sim.violations)


def test_invariant_liveness_of_following() -> None:
    """A client that can reach the current configuration but did not learn the
    newest version breaks convergence; one that cannot reach it is not counted."""
    sim = _finished(SEED_TAMPER)
    sim.clients[0].final = None
    sim.check()
    assert any(v.startswith("clients did not converge") for v in sim.violations)
