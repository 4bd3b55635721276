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

import pytest

from metasync import paxos, simulator
from metasync.objects import Version
from metasync.paxos import FAST_ROUND, AcceptorState, Message, Quorums, Round
from metasync.simulator import Simulation, run


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
    write), or a conditional append aims at the wrong position for ever. Seed 25
    (one acceptor with conditional appends, torn writes) stalls without the slots."""
    apply = Simulation.apply

    def dropping(self: Simulation, acc: simulator.Acceptor, req: paxos.Request) -> paxos.Reply:
        reply = apply(self, acc, req)
        return [m for m in reply if m is not None] if isinstance(reply, list) else reply

    assert run(25, 0.0).ok
    monkeypatch.setattr(Simulation, "apply", dropping)
    found = first_violation([25], bft_share=0.0)
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
    assert run(800).stats.get("proposals stopped at the compaction floor", 0) > 0


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
    assert first_violation([986]) is not None


def test_checker_catches_compaction_without_the_grace(monkeypatch: pytest.MonkeyPatch) -> None:
    """Compacting an instance a running proposal began before (what the grace period
    rules out) loses or splits decisions."""
    monkeypatch.setattr(Simulation, "compactable", lambda self: max(self.observed_at, default=0))
    # Rare (3 of the first 3,000 seeds): a proposal must see part of a decision, then
    # stall across a whole compaction.
    assert first_violation([400, 2847, 2995]) is not None
