"""pPaxos: the pure protocol core (metasync.paxos), then the Consensus driver over
real dir: acceptors (metasync.consensus).

The core is driven by a tiny synchronous in-memory driver (:class:`Cluster`), so
round trips are counted exactly and interleavings are chosen by Hypothesis. The
driver tests use three LocalBackend folders in tmp_path; backoff sleeps are
stubbed out (``sleep=lambda s: None``) and nothing waits on wall-clock time.
"""

from __future__ import annotations

import hashlib
import json
import random
import shutil
import threading
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from itertools import permutations
from pathlib import Path
from typing import Any, TypeVar

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from metasync.backends.faulty import ALWAYS, Faults, FaultyBackend
from metasync.backends.local import LocalBackend
from metasync.codec import Codec
from metasync.consensus import HINT_KEY, Consensus, FloorElsewhere, floor_key, log_key, mark_key
from metasync.errors import BackendError, BackendUnavailable, CorruptObject
from metasync.keys import MasterKey
from metasync.objects import Version
from metasync.paxos import (
    FAST_ROUND,
    MAX_PROPOSER,
    AcceptorState,
    Append,
    Backoff,
    Compacted,
    Contended,
    DropLogs,
    Fetch,
    Message,
    NoQuorum,
    Quorums,
    ReadFloor,
    ReadHint,
    Reply,
    Request,
    Round,
    Run,
    Setup,
    WriteFloor,
    WriteHint,
    choose_value,
    compact,
    decided,
    get_recent,
    past_floor,
    propose,
    read,
    replay,
)

T = TypeVar("T")
CONFIG = "c" * 64
KEY = MasterKey(bytes(range(64, 96)))
V0 = Version(0, None, CONFIG)


def v(n: int, tag: str = "a") -> Version:
    """Version ``n`` with a master commit id derived from ``tag`` (distinct per tag)."""
    return Version(n, hashlib.sha256(tag.encode()).hexdigest(), CONFIG)


def rnd(n: int, who: str = "a") -> Round:
    return FAST_ROUND if n == 0 else Round(n, who)


def prep(n: int, who: str = "a") -> Message:
    return Message("prepare", Round(n, who))


def acc(n: int, value: Version, who: str = "a") -> Message:
    """An accept; round 0 is the fast round."""
    return Message("accept", rnd(n, who), value)


def fast(value: Version) -> Message:
    return Message("accept", FAST_ROUND, value)


# ============================================================================ messages


def test_message_json_round_trip() -> None:
    """Prepares, classic accepts and fast-round accepts survive their JSON."""
    for msg in (prep(3, "c"), acc(4, v(2, "q"), "d"), fast(v(1)), acc(1, V0), prep(1, "x" * MAX_PROPOSER)):
        assert Message.from_json(json.loads(json.dumps(msg.to_json()))) == msg
    assert fast(v(1)).to_json()["round"] == [0, ""]


VALUE = v(1).to_json()


@pytest.mark.parametrize(
    "raw",
    [
        None,
        [],
        "prepare",
        {"type": "promise", "round": [1, "a"]},
        {"type": "prepare"},
        {"type": "prepare", "round": [1]},
        {"type": "prepare", "round": [1, "a", "b"]},
        {"type": "prepare", "round": ["1", "a"]},
        {"type": "prepare", "round": [1, 2]},
        {"type": "prepare", "round": [1.0, "a"]},
        {"type": "prepare", "round": [-1, "a"]},
        {"type": "prepare", "round": [1, "x" * (MAX_PROPOSER + 1)]},
        # bools are not ints
        {"type": "prepare", "round": [True, "a"]},
        {"type": "accept", "round": [True, "a"], "value": VALUE},
        {"type": "accept", "round": [False, ""], "value": VALUE},
        {"type": "accept", "round": [1, "a"], "value": {**VALUE, "version": True}},
        # round 0 is only the fast round's accept
        {"type": "prepare", "round": [0, ""]},
        {"type": "prepare", "round": [0, "a"]},
        {"type": "accept", "round": [0, "a"], "value": VALUE},
        # a classic round needs a proposer
        {"type": "prepare", "round": [1, ""]},
        {"type": "accept", "round": [1, ""], "value": VALUE},
        # extra or missing keys
        {"type": "prepare", "round": [1, "a"], "value": VALUE},
        {"type": "prepare", "round": [1, "a"], "extra": 1},
        {"type": "accept", "round": [1, "a"]},
        {"type": "accept", "round": [1, "a"], "value": None},
        {"type": "accept", "round": [0, ""], "value": VALUE, "extra": 1},
        {"type": "accept", "round": [1, "a"], "value": {"version": 1}},
    ],
)
def test_message_rejects_malformed(raw: Any) -> None:
    """Anything malformed is CorruptObject, never another exception."""
    with pytest.raises(CorruptObject):
        Message.from_json(raw)


def test_round_order() -> None:
    """Rounds order by number, then proposer; the fast round is below every classic one."""
    assert Round(1, "b") > Round(1, "a")
    assert Round(2, "a") > Round(1, "z")
    assert Round(1, "") > FAST_ROUND
    assert Round(1, "a") > FAST_ROUND


# ============================================================================ replay


def test_replay_empty_log() -> None:
    assert replay([]) == AcceptorState()


def test_replay_prepare_granted_only_above_promise() -> None:
    """A repeat, an equal or a lower prepare is not granted; a tie broken by proposer is."""
    state = replay([prep(1, "a"), prep(1, "a"), prep(1, "0"), prep(1, "b"), prep(1, "a")])
    assert set(state.grants) == {Round(1, "a"), Round(1, "b")}
    assert state.promised == Round(1, "b")
    assert state.accepted is None
    assert state.highest_seen == 1


def test_replay_classic_accept_at_or_above_promise() -> None:
    """A classic accept takes effect at or above the promise (even without its own
    prepare), not below; an effective accept raises the promise."""
    state = replay([prep(2), acc(1, v(1, "x")), acc(2, v(1, "y")), acc(3, v(1, "z"), "b"), prep(3, "b")])
    assert state.accepts == {Round(2, "a"): v(1, "y"), Round(3, "b"): v(1, "z")}
    assert state.accepted == (Round(3, "b"), v(1, "z"))
    assert state.promised == Round(3, "b")
    assert Round(3, "b") not in state.grants
    assert state.highest_seen == 3


def test_replay_grant_reports_previously_accepted_value() -> None:
    state = replay([fast(v(1, "f")), prep(1), acc(1, v(1, "x")), prep(2, "b"), prep(5, "c")])
    assert state.grants == {
        Round(1, "a"): (FAST_ROUND, v(1, "f")),
        Round(2, "b"): (Round(1, "a"), v(1, "x")),
        Round(5, "c"): (Round(1, "a"), v(1, "x")),
    }


def test_replay_fast_accept_only_as_first_act() -> None:
    """A fast accept takes effect only as the acceptor's very first act."""
    first = replay([fast(v(1, "x"))])
    assert first.accepts == {FAST_ROUND: v(1, "x")}
    assert first.promised == FAST_ROUND
    # a second fast accept has no effect, even of the same value
    assert replay([fast(v(1, "x")), fast(v(1, "y"))]).accepted == (FAST_ROUND, v(1, "x"))
    assert replay([fast(v(1, "x")), fast(v(1, "x"))]) == first
    # after any prepare (granted or not) a fast accept has no effect
    after_prepare = replay([prep(1), fast(v(1, "x"))])
    assert after_prepare.accepts == {}
    assert after_prepare.accepted is None
    assert after_prepare.promised == Round(1, "a")
    # nor after a classic accept
    assert replay([acc(1, v(1, "y")), fast(v(1, "x"))]).accepts == {Round(1, "a"): v(1, "y")}
    # a classic round still overrides a fast accept
    state = replay([fast(v(1, "x")), prep(1), acc(1, v(1, "y"))])
    assert state.accepted == (Round(1, "a"), v(1, "y"))
    assert state.grants[Round(1, "a")] == (FAST_ROUND, v(1, "x"))


messages = st.lists(
    st.one_of(
        st.builds(prep, st.integers(1, 5), st.sampled_from("abc")),
        st.builds(acc, st.integers(0, 5), st.builds(v, st.just(1), st.sampled_from("xyz")),
                  st.sampled_from("abc")),
    ),
    max_size=12,
)


@settings(max_examples=150, deadline=None)
@given(log=messages)
def test_replay_invariants(log: list[Message]) -> None:
    """For any log: the promise never decreases; a grant reports the value accepted
    just before it; classic accepts take effect iff at or above the promise, fast
    ones iff nothing happened before; the accepted value is the last effective one."""
    for i, msg in enumerate(log):
        before, after = replay(log[:i]), replay(log[: i + 1])
        if before.promised is not None:
            assert after.promised is not None and after.promised >= before.promised
        if msg.type == "prepare":
            granted = before.promised is None or msg.round > before.promised
            assert (msg.round in after.grants and msg.round not in before.grants) == granted
            if granted:
                assert after.grants[msg.round] == before.accepted
            assert after.accepted == before.accepted
            assert after.accepts == before.accepts
        else:
            if msg.round == FAST_ROUND:
                effective = before.promised is None and before.accepted is None
            else:
                effective = before.promised is None or msg.round >= before.promised
            if effective:
                assert after.accepted == (msg.round, msg.value)
                assert after.accepts[msg.round] == msg.value
            else:
                assert after.accepted == before.accepted
                assert after.accepts == before.accepts
            assert after.grants == before.grants
    final = replay(log)
    if FAST_ROUND in final.accepts:  # only ever the very first entry
        assert log[0].round == FAST_ROUND and final.accepts[FAST_ROUND] == log[0].value
    if final.accepts:
        assert final.accepted is not None and final.accepted[1] == final.accepts[final.accepted[0]]
    assert final.highest_seen == max((m.round.number for m in log), default=0)


# ============================================================================ quorums


@pytest.mark.parametrize("n", range(1, 8))
def test_crash_quorums_intersect_and_are_minimal(n: int) -> None:
    q = Quorums.crash(n)
    assert (q.acceptors, q.byzantine) == (n, False)
    assert q.fast is not None
    assert q.classic * 2 > n
    assert q.classic + 2 * q.fast > 2 * n
    assert (q.classic - 1) * 2 <= n  # minimal
    assert q.classic + 2 * (q.fast - 1) <= 2 * n  # minimal
    assert q.fast <= n
    assert q.faults == n - q.classic
    assert q.threshold(FAST_ROUND) == q.fast
    assert q.threshold(Round(1, "a")) == q.classic


def test_crash_needs_an_acceptor() -> None:
    with pytest.raises(ValueError):
        Quorums.crash(0)


@pytest.mark.parametrize("n", range(4, 11))
def test_bft_quorums_intersect_in_an_honest_acceptor(n: int) -> None:
    q = Quorums.bft(n)
    f = (n - 1) // 3
    assert q.byzantine and q.fast is None
    assert 2 * q.classic - n >= f + 1
    assert 2 * (q.classic - 1) - n < f + 1  # minimal
    assert q.classic <= n - f  # live with f acceptors silent
    assert q.threshold(FAST_ROUND) is None


@pytest.mark.parametrize("n", [1, 2, 3])
def test_bft_needs_four(n: int) -> None:
    with pytest.raises(ValueError):
        Quorums.bft(n)


# ============================================================================ decided / choose_value


def states(*logs: list[Message]) -> list[AcceptorState]:
    return [replay(log) for log in logs]


def test_decided_needs_a_quorum_in_one_round() -> None:
    q = Quorums.crash(3)
    x, y = v(1, "x"), v(1, "y")
    assert decided(states([acc(1, x)], [acc(1, x)], []), q) == x
    assert decided(states([acc(1, x)], [acc(2, x, "b")], []), q) is None
    assert decided(states([acc(1, x)], [], []), q) is None
    assert decided([], q) is None
    # the fast round needs a fast quorum (3 of 3)
    assert decided(states([fast(x)], [fast(x)], [fast(y)]), q) is None
    assert decided(states([fast(x)], [fast(x)], []), q) is None
    assert decided(states([fast(x)], [fast(x)], [fast(x)]), q) == x
    # with 5 acceptors, 4 fast accepts decide
    q5 = Quorums.crash(5)
    assert decided(states([fast(x)], [fast(x)], [fast(x)], [fast(y)], []), q5) is None
    assert decided(states([fast(x)], [fast(x)], [fast(x)], [fast(x)], [fast(y)]), q5) == x


def test_decided_byzantine_has_no_fast_decisions() -> None:
    q = Quorums.bft(4)
    x = v(1, "x")
    assert decided(states([fast(x)], [fast(x)], [fast(x)], [fast(x)]), q) is None
    assert decided(states([acc(1, x)], [acc(1, x)], [], []), q) is None
    assert decided(states([acc(1, x)], [acc(1, x)], [acc(1, x)], []), q) == x


def test_choose_value_highest_classic_round_wins() -> None:
    q = Quorums.crash(5)
    x, y, z, own = v(1, "x"), v(1, "y"), v(1, "z"), v(1, "own")
    reports = [(FAST_ROUND, x), (FAST_ROUND, x), (Round(1, "a"), y), (Round(2, "b"), z), None]
    for perm in permutations(reports):
        assert choose_value(list(perm), q, own) == z
        assert choose_value(list(perm), q, None) == z


def test_choose_value_nothing_accepted() -> None:
    q = Quorums.crash(3)
    assert choose_value([None, None], q, v(1, "own")) == v(1, "own")
    assert choose_value([None, None, None], q, None) is None
    assert choose_value([], q, None) is None


def test_choose_value_fast_reports() -> None:
    """Only fast-round reports: a value reported by at least fast - (n - granted)
    must be picked; else the proposer's own; else the most frequent."""
    x, y, z, own = v(1, "x"), v(1, "y"), v(1, "z"), v(1, "own")
    F = FAST_ROUND
    q3 = Quorums.crash(3)  # classic 2, fast 3
    # 2 granted: needed 3 - 1 = 2
    assert choose_value([(F, x), (F, x)], q3, own) == x
    assert choose_value([(F, x), (F, y)], q3, own) == own
    # 3 granted: needed 3; one acceptor did not fast-accept x, so x was not chosen
    assert choose_value([(F, x), (F, x), None], q3, own) == own
    assert choose_value([(F, x), (F, x), (F, x)], q3, own) == x
    q5 = Quorums.crash(5)  # classic 3, fast 4
    # 3 granted: needed 4 - 2 = 2
    assert choose_value([(F, y), (F, x), (F, x)], q5, own) == x
    assert choose_value([(F, x), (F, y), None], q5, own) == own
    # 4 granted: needed 3
    assert choose_value([(F, x), (F, x), (F, y), None], q5, own) == own
    assert choose_value([(F, x), (F, x), (F, x), (F, y)], q5, own) == x
    # nothing reaches the bar and no own value: the most frequent, whatever the order
    for perm in permutations([(F, x), (F, y), (F, y), None, None]):
        assert choose_value(list(perm), q5, None) == y
    # ties are broken deterministically
    tie = {choose_value(list(p), q5, None) for p in permutations([(F, x), (F, y), (F, z), None])}
    assert len(tie) == 1


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_choose_value_keeps_any_fast_decision(data: st.DataObject) -> None:
    """If a fast quorum accepted ``x`` in round 0, every granted classic quorum's
    reports lead choose_value to ``x``, whatever the own value and the other fast votes."""
    n = data.draw(st.integers(1, 7), label="n")
    q = Quorums.crash(n)
    assert q.fast is not None
    x = v(1, "x")
    chosen = data.draw(st.sets(st.integers(0, n - 1), min_size=q.fast, max_size=q.fast), label="R")
    others = data.draw(st.lists(st.sampled_from([None, v(1, "y"), v(1, "z")]), min_size=n, max_size=n))
    votes = [x if i in chosen else others[i] for i in range(n)]
    granted = data.draw(st.sets(st.integers(0, n - 1), min_size=q.classic), label="Q")
    reports = [(FAST_ROUND, votes[i]) if votes[i] is not None else None for i in sorted(granted)]
    reports = data.draw(st.permutations(reports))
    own = data.draw(st.sampled_from([None, v(1, "own"), v(1, "y")]))
    assert choose_value(reports, q, own) == x


# ============================================================================ in-memory driver


@dataclass
class Cluster:
    """Acceptor logs and hints in memory; ``down`` acceptors answer nothing."""

    down: set[str] = field(default_factory=set)
    logs: dict[tuple[str, int], list[Message]] = field(default_factory=lambda: defaultdict(list))
    hints: dict[str, int] = field(default_factory=dict)
    floors: dict[str, int] = field(default_factory=dict)

    def log(self, acceptor: str, instance: int) -> list[Message]:
        return self.logs[(acceptor, instance)]

    def perform(self, req: Request) -> Reply:
        if req.acceptor in self.down:
            return None
        if isinstance(req, Fetch):
            return list(self.log(req.acceptor, req.instance))
        if isinstance(req, Append):
            log = self.log(req.acceptor, req.instance)
            if req.position is not None and req.position != len(log):
                return False
            log.append(req.message)
            return True
        if isinstance(req, ReadHint):
            return self.hints.get(req.acceptor)
        if isinstance(req, ReadFloor):
            return self.floors.get(req.acceptor, 0)
        if isinstance(req, WriteFloor):
            self.floors[req.acceptor] = max(self.floors.get(req.acceptor, 0), req.below)
            return True
        if isinstance(req, DropLogs):
            gone = [key for key in self.logs if key[0] == req.acceptor and key[1] < req.below]
            for key in gone:
                del self.logs[key]
            return len(gone)
        assert isinstance(req, WriteHint)
        self.hints[req.acceptor] = req.number
        return True


def drive(cluster: Cluster, run: Run[Any]) -> tuple[Any, int]:
    """Run a protocol to its end, synchronously; return its result and the number
    of batches (round trips). Backoffs cost nothing."""
    batches = 0
    replies: list[Reply] | None = None
    while True:
        try:
            step = run.send(replies)
        except StopIteration as stop:
            return stop.value, batches
        if isinstance(step, Backoff):
            replies = None
            continue
        batches += 1
        replies = [cluster.perform(r) for r in step]


def names(n: int) -> tuple[str, ...]:
    return tuple(f"a{i}" for i in range(n))


def make_setup(n: int = 3, *, conditional: bool = True, fast_path: bool = True,
               proposer: str = "p", quorums: Quorums | None = None, max_attempts: int = 10) -> Setup:
    acceptors = names(n)
    return Setup(acceptors, frozenset(acceptors) if conditional else frozenset(),
                 quorums or Quorums.crash(n), proposer, max_attempts=max_attempts,
                 fast_path=fast_path)


def rng() -> random.Random:
    return random.Random(7)


EMPTY = {a: [] for a in names(3)}


def test_uncontended_conditional_fast_is_one_round_trip() -> None:
    cluster = Cluster()
    value, batches = drive(cluster, propose(make_setup(), 1, v(1), rng()))
    assert (value, batches) == (v(1), 1)
    assert all(cluster.log(a, 1) == [fast(v(1))] for a in names(3))
    # the same with logs cached by a previous read
    value, batches = drive(cluster, propose(make_setup(), 2, v(2), rng(), dict(EMPTY)))
    assert (value, batches) == (v(2), 1)


def test_plain_logs_with_fast_round_is_two_round_trips() -> None:
    cluster = Cluster()
    value, batches = drive(cluster, propose(make_setup(conditional=False), 1, v(1), rng(), dict(EMPTY)))
    assert (value, batches) == (v(1), 2)
    assert all(cluster.log(a, 1) == [fast(v(1))] for a in names(3))


def test_paper_mode_is_four_round_trips() -> None:
    """Plain logs, no fast round: prepare, fetch, accept, fetch (given cached empty logs)."""
    cluster = Cluster()
    setup = make_setup(conditional=False, fast_path=False)
    value, batches = drive(cluster, propose(setup, 1, v(1), rng(), dict(EMPTY)))
    assert (value, batches) == (v(1), 4)
    assert all(cluster.log(a, 1) == [prep(1, "p"), acc(1, v(1), "p")] for a in names(3))
    # without cached logs it reads them first
    assert drive(cluster, propose(setup, 2, v(2), rng())) == (v(2), 5)


def test_conditional_classic_is_two_round_trips() -> None:
    cluster = Cluster()
    setup = make_setup(fast_path=False)
    assert drive(cluster, propose(setup, 1, v(1), rng(), dict(EMPTY))) == (v(1), 2)
    assert all(cluster.log(a, 1) == [prep(1, "p"), acc(1, v(1), "p")] for a in names(3))


def test_get_recent_then_propose_on_empty_instance() -> None:
    """get_recent of an empty instance is one batch (hints + logs) and hands the logs
    it read to propose, which then decides in one more."""
    cluster = Cluster()
    setup = make_setup()
    (latest, reading), batches = drive(cluster, get_recent(setup, V0, rng()))
    assert (latest, batches) == (V0, 1)
    assert reading is not None and reading.instance == 1 and reading.logs == EMPTY
    assert drive(cluster, propose(setup, 1, v(1), rng(), reading.logs)) == (v(1), 1)
    # behind by one: read 1 (decided), the hints, read 2 (empty)
    (latest, _), batches = drive(cluster, get_recent(setup, V0, rng()))
    assert (latest, batches) == (v(1), 3)
    # up to date: one read, no hints
    (latest, _), batches = drive(cluster, get_recent(setup, v(1), rng()))
    assert (latest, batches) == (v(1), 1)


def test_propose_on_decided_instance_returns_the_decision() -> None:
    cluster = Cluster()
    drive(cluster, propose(make_setup(), 1, v(1, "a"), rng()))
    value, _ = drive(cluster, propose(make_setup(proposer="q"), 1, v(1, "b"), rng()))
    assert value == v(1, "a")
    assert all(cluster.log(a, 1) == [fast(v(1, "a"))] for a in names(3))
    assert drive(cluster, propose(make_setup(proposer="q"), 1, None, rng()))[0] == v(1, "a")


def test_finishing_an_empty_instance_returns_none() -> None:
    cluster = Cluster()
    value, _ = drive(cluster, propose(make_setup(), 1, None, rng()))
    assert value is None
    assert drive(cluster, read(make_setup(), 1, rng()))[0].decided is None


def test_one_acceptor_down_fast_round_fails_and_fallback_decides() -> None:
    """One of three never answers: the fast round (needs 3) fails, the classic
    fallback decides: fast, refresh, prepare, accept."""
    cluster = Cluster(down={"a2"})
    value, batches = drive(cluster, propose(make_setup(), 1, v(1), rng(), dict(EMPTY)))
    assert (value, batches) == (v(1), 4)
    assert cluster.log("a2", 1) == []
    assert drive(cluster, read(make_setup(), 1, rng()))[0].decided == v(1)
    # plain logs and the paper's mode also get there
    for setup in (make_setup(conditional=False), make_setup(conditional=False, fast_path=False)):
        assert drive(cluster, propose(setup, 2 + setup.fast_path, v(2), rng()))[0] == v(2)


def test_two_acceptors_down_read_raises_no_quorum() -> None:
    cluster = Cluster(down={"a1", "a2"})
    setup = make_setup(max_attempts=3)
    with pytest.raises(NoQuorum) as info:
        drive(cluster, read(setup, 1, rng()))
    assert (info.value.answered, info.value.needed, info.value.instance) == (1, 2, 1)
    with pytest.raises(NoQuorum):
        drive(cluster, get_recent(setup, V0, rng()))


def test_two_acceptors_down_propose_raises_no_quorum() -> None:
    cluster = Cluster(down={"a1", "a2"})
    with pytest.raises(NoQuorum):
        drive(cluster, propose(make_setup(max_attempts=3), 1, v(1), rng()))


# ---------------------------------------------------------------- agreement property


@dataclass
class Proc:
    """One proposer being driven step by step."""

    kind: str
    run: Run[Any]
    batch: list[Request] = field(default_factory=list)
    replies: list[Reply] = field(default_factory=list)
    pending: list[int] = field(default_factory=list)
    started: bool = False
    done: bool = False
    result: Any = None
    error: Exception | None = None

    def advance(self) -> None:
        """Send the collected replies; stop at the next batch (or the end)."""
        send: list[Reply] | None = self.replies if self.started else None
        self.started = True
        while True:
            try:
                step = self.run.send(send)
            except StopIteration as stop:
                self.done, self.result = True, stop.value
                return
            except (Contended, NoQuorum) as exc:  # liveness, not safety
                self.done, self.error = True, exc
                return
            if isinstance(step, Backoff):
                send = None
                continue
            self.batch, self.replies = list(step), [None] * len(step)
            self.pending = list(range(len(step)))
            return


QUORUMS = [Quorums.crash(3), Quorums.crash(4), Quorums.crash(5), Quorums.bft(4)]
SCHEDULE = st.lists(st.integers(0, 2**12 - 1), min_size=40, max_size=200)
#: What happens to one request: it runs and answers, runs and its reply is lost,
#: or never runs (a lost request).
FATES = ("deliver", "deliver", "deliver", "lose", "drop")


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_agreement_under_any_interleaving_and_lost_replies(data: st.DataObject) -> None:
    """2-3 proposers (some only finishing, some running get_recent) on one instance;
    every request runs at an arbitrary moment, interleaved with the others', and
    may be dropped (never runs) or run with its reply lost. No two proposers ever
    return different values, and the value the logs show decided never changes."""
    quorums = data.draw(st.sampled_from(QUORUMS), label="quorums")
    acceptors = names(quorums.acceptors)
    conditional = frozenset(data.draw(st.sets(st.sampled_from(acceptors)), label="conditional"))
    count = data.draw(st.integers(2, 3), label="proposers")
    cluster = Cluster()
    procs: list[Proc] = []
    values: set[Version] = set()
    for i in range(count):
        kind = "propose" if i == 0 else data.draw(st.sampled_from(["propose", "finish", "recent"]))
        setup = Setup(acceptors, conditional, quorums, f"p{i}", max_attempts=4,
                      fast_path=data.draw(st.booleans(), label=f"fast{i}"))
        if kind == "propose":
            values.add(v(1, f"p{i}"))
            run: Run[Any] = propose(setup, 1, v(1, f"p{i}"), random.Random(i))
        elif kind == "finish":
            run = propose(setup, 1, None, random.Random(i))
        else:
            run = get_recent(setup, V0, random.Random(i))
        procs.append(Proc(kind, run))

    truth: Version | None = None

    def check() -> None:
        nonlocal truth
        now = decided([replay(cluster.log(a, 1)) for a in acceptors], quorums)
        if truth is not None:
            assert now == truth, f"decided value changed from {truth} to {now}"
        truth = now

    # One number per chaotic step picks the proposer, its request and that request's
    # fate; after the schedule runs out, everything is delivered in order.
    schedule = data.draw(SCHEDULE, label="schedule")
    steps = 0
    while active := [p for p in procs if not p.done]:
        pick = schedule[steps] if steps < len(schedule) else None
        steps += 1
        proc = active[pick % len(active)] if pick is not None else active[0]
        if not proc.started or not proc.pending:
            proc.advance()
            continue
        if pick is None:
            index, fate = proc.pending[0], "deliver"
        else:
            index = proc.pending[(pick >> 2) % len(proc.pending)]
            fate = FATES[(pick >> 6) % len(FATES)]
        proc.pending.remove(index)
        if fate == "drop":
            continue
        reply = cluster.perform(proc.batch[index])
        check()
        if fate == "deliver":
            proc.replies[index] = reply
    check()

    assert truth is None or truth in values
    for proc in procs:
        if proc.error is not None:
            continue
        if proc.kind == "recent":
            latest, _ = proc.result
            assert latest in (V0, truth)
        elif proc.kind == "propose" or proc.result is not None:
            # a proposer returns only what is decided: the one decided value
            assert proc.result is not None and proc.result == truth


# ============================================================================ driver over dir:


Acceptors = dict[str, LocalBackend]
CODEC = Codec(KEY)


def make_acceptors(root: Path) -> Acceptors:
    found: Acceptors = {}
    for i in range(3):
        location = root / f"acceptor{i}"
        location.mkdir(parents=True)
        backend = LocalBackend(f"dir:{location}", "ns")
        backend.create()
        found[f"b{i}"] = backend
    return found


@pytest.fixture
def acceptors(tmp_path: Path) -> Iterator[Acceptors]:
    found = make_acceptors(tmp_path)
    yield found
    for backend in found.values():
        backend.close()


def client(acceptors: Acceptors, name: str = "alice", codec: Codec = CODEC, **kwargs: Any) -> Consensus:
    return Consensus(acceptors, codec, name, sleep=lambda s: None, **kwargs)


def entries(backend: LocalBackend, instance: int) -> list[bytes]:
    return [raw for _, raw in backend.logs.fetch(log_key(instance))]


def log_folder(backend: LocalBackend, instance: int) -> Path:
    return Path(backend.root, *log_key(instance).split("/"))


def encoded(codec: Codec, instance: int, msg: Message) -> bytes:
    """A log entry as the driver stores it (the wire format, built independently)."""
    return codec.encode("log", str(instance), json.dumps(msg.to_json()).encode())


def commit(c: Consensus, n: int, tag: str = "a") -> Version:
    """One commit the way a client does it: get_recent, then propose the next."""
    assert c.get_recent(V0).number == n - 1
    return c.propose(n, v(n, tag))


@pytest.mark.parametrize("codec", [Codec(KEY), Codec(None)], ids=["encrypted", "plain"])
def test_uncontended_commit_is_two_round_trips(acceptors: Acceptors, codec: Codec) -> None:
    """get_recent (1 round trip) + a fast conditional propose (1); each log then
    holds one entry; other clients learn the value."""
    c = client(acceptors, codec=codec)
    assert c.get_recent(V0) == V0
    assert c.round_trips == 1
    assert c.propose(1, v(1)) == v(1)
    assert c.round_trips == 2
    assert all(len(entries(b, 1)) == 1 for b in acceptors.values())
    bob = client(acceptors, "bob", codec=codec)
    assert bob.learn(1) == v(1)
    assert bob.get_recent(V0) == v(1)
    assert bob.learn(2) is None


def test_paper_mode_propose_is_four_round_trips(acceptors: Acceptors) -> None:
    c = client(acceptors, conditional=False, fast_path=False)
    assert c.get_recent(V0) == V0
    before = c.round_trips
    assert c.propose(1, v(1)) == v(1)
    assert c.round_trips - before == 4
    assert all(len(entries(b, 1)) == 2 for b in acceptors.values())
    assert client(acceptors, "bob").get_recent(V0) == v(1)


def test_racing_clients_agree_on_every_instance(acceptors: Acceptors) -> None:
    """Two clients propose different values for the same instances at the same
    moment; each instance decides one value that both get back and both learn."""
    instances = 12
    barrier = threading.Barrier(2)
    results: dict[str, list[Version | None]] = {"alice": [], "bob": []}
    errors: list[BaseException] = []
    clients = {name: client(acceptors, name, max_attempts=20) for name in results}

    def race(name: str) -> None:
        c = clients[name]
        try:
            for n in range(1, instances + 1):
                barrier.wait()
                for _ in range(5):  # a transient "contended" is retried, as a client would
                    try:
                        results[name].append(c.propose(n, v(n, name)))
                        break
                    except BackendError as exc:
                        if not exc.transient:
                            raise
                else:
                    raise AssertionError(f"instance {n} never decided for {name}")
        except BaseException as exc:
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=race, args=(name,)) for name in results]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert results["alice"] == results["bob"]
    for n, value in enumerate(results["alice"], start=1):
        assert value in (v(n, "alice"), v(n, "bob"))
        assert clients["alice"].learn(n) == clients["bob"].learn(n) == value
    assert client(acceptors, "carol").get_recent(V0) == results["alice"][-1]


# ---------------------------------------------------------------- unreachable backends


def move_away(backend: LocalBackend, tmp_path: Path) -> Path:
    """Move the acceptor's folder out of the way (unreachable, not deleted)."""
    location = Path(backend.location)
    moved = tmp_path / f"moved-{location.name}"
    shutil.move(str(location), str(moved))
    return moved


def test_one_of_three_unreachable_commits_succeed(acceptors: Acceptors, tmp_path: Path) -> None:
    c = client(acceptors)
    assert commit(c, 1) == v(1)
    moved = move_away(acceptors["b1"], tmp_path)
    for n in (2, 3):
        assert commit(c, n) == v(n)
    assert client(acceptors, "bob").get_recent(V0) == v(3)
    assert c.learn(1) == v(1)
    # it comes back: everything still agrees, and commits go on
    shutil.move(str(moved), acceptors["b1"].location)
    bob = client(acceptors, "bob")
    assert [bob.learn(n) for n in (1, 2, 3)] == [v(1), v(2), v(3)]
    assert commit(bob, 4, "bob") == v(4, "bob")


def test_two_of_three_unreachable_get_recent_fails_naming_them(acceptors: Acceptors,
                                                             tmp_path: Path) -> None:
    c = client(acceptors)
    assert commit(c, 1) == v(1)
    move_away(acceptors["b0"], tmp_path)
    move_away(acceptors["b2"], tmp_path)
    for call in (lambda: client(acceptors, "bob").get_recent(V0), lambda: c.learn(1)):
        with pytest.raises(BackendUnavailable) as info:
            call()
        message = str(info.value)
        assert acceptors["b0"].name in message and acceptors["b2"].name in message
        assert acceptors["b1"].name not in message
    assert entries(acceptors["b1"], 1) and entries(acceptors["b1"], 2) == []
    assert not log_folder(acceptors["b1"], 2).exists()


def test_two_of_three_unreachable_propose_fails_naming_them(acceptors: Acceptors,
                                                          tmp_path: Path) -> None:
    c = client(acceptors)
    assert commit(c, 1) == v(1)
    move_away(acceptors["b0"], tmp_path)
    move_away(acceptors["b2"], tmp_path)
    with pytest.raises(BackendUnavailable) as info:
        c.propose(2, v(2))
    message = str(info.value)
    assert acceptors["b0"].name in message and acceptors["b2"].name in message


def test_two_of_three_unreachable_propose_error_is_honest(acceptors: Acceptors,
                                                          tmp_path: Path) -> None:
    """A propose that wrote to the one reachable acceptor before finding too few
    answering must not claim nothing changed: that accept may still be completed
    by a later reader. The error says the outcome is unknown."""
    c = client(acceptors)
    assert commit(c, 1) == v(1)
    move_away(acceptors["b0"], tmp_path)
    move_away(acceptors["b2"], tmp_path)
    with pytest.raises(BackendUnavailable) as info:
        c.propose(2, v(2))
    message = str(info.value)
    if entries(acceptors["b1"], 2):
        assert "unknown" in message and "Nothing was changed" not in message
    else:
        assert "Nothing was changed" in message


def test_get_recent_failing_first_means_nothing_written(acceptors: Acceptors,
                                                        tmp_path: Path) -> None:
    """The push order: get_recent fails without a quorum before any append, and says
    nothing was changed -- which is then true."""
    c = client(acceptors)
    assert commit(c, 1) == v(1)
    move_away(acceptors["b0"], tmp_path)
    move_away(acceptors["b2"], tmp_path)
    with pytest.raises(BackendUnavailable, match="Nothing was changed"):
        c.get_recent(v(1))
    assert entries(acceptors["b1"], 2) == []


#: What the failing and hung acceptors below do wrong: every log and hint operation.
LOG_AND_HINT_OPERATIONS = {"fetch", "append", "append_at", "get", "put"}


def failing(backend: LocalBackend) -> FaultyBackend:
    """``backend``, reachable, but every log and hint operation fails (e.g. permission
    denied)."""
    faulty = FaultyBackend(backend)
    faulty.faults.refuse(LOG_AND_HINT_OPERATIONS, times=ALWAYS,
                         message=f"permission denied on {backend.name}")
    return faulty


def test_two_of_three_failing_propose_names_them(tmp_path: Path) -> None:
    good = make_acceptors(tmp_path / "good")
    bad = {name: failing(b) for name, b in make_acceptors(tmp_path / "bad").items()}
    accs = {"b0": good["b0"], "b1": bad["b1"], "b2": bad["b2"]}
    c = client(accs, max_attempts=3)
    with pytest.raises(BackendUnavailable) as info:  # get_recent gets this right
        c.get_recent(V0)
    assert "permission denied" in str(info.value)
    with pytest.raises(BackendUnavailable) as info:
        c.propose(1, v(1))
    assert bad["b1"].name in str(info.value) and bad["b2"].name in str(info.value)


# ---------------------------------------------------------------- hung backends


@pytest.fixture
def hung(tmp_path: Path) -> Iterator[dict[str, FaultyBackend]]:
    """Three acceptors whose every log and hint operation (and listing) blocks until
    teardown releases them."""
    faults = Faults()
    faults.hang(LOG_AND_HINT_OPERATIONS | {"list"}, times=ALWAYS)
    found = {name: FaultyBackend(b, faults)
             for name, b in make_acceptors(tmp_path / "hung").items()}
    yield found
    faults.release_all()


def test_one_hung_acceptor_times_out_and_commit_completes(
        acceptors: Acceptors, hung: dict[str, FaultyBackend]) -> None:
    accs = {"b0": acceptors["b0"], "b1": acceptors["b1"], "b2": hung["b2"]}
    c = client(accs, timeout=0.2)
    assert c.get_recent(V0) == V0
    assert c.propose(1, v(1)) == v(1)
    assert c.learn(1) == v(1)
    assert client(acceptors, "bob").learn(1) == v(1)  # on the two that answer


def test_two_hung_acceptors_fail_with_no_answer(acceptors: Acceptors,
                                                hung: dict[str, FaultyBackend]) -> None:
    accs = {"b0": acceptors["b0"], "b1": hung["b1"], "b2": hung["b2"]}
    c = client(accs, timeout=0.2)
    for call in (lambda: c.get_recent(V0), lambda: c.propose(1, v(1))):
        with pytest.raises(BackendUnavailable) as info:
            call()
        message = str(info.value)
        assert "no answer within" in message
        assert hung["b1"].name in message and hung["b2"].name in message


# ---------------------------------------------------------------- tampering


def garbage_entries(codec: Codec, instance: int) -> list[bytes]:
    """Log entries that must count as never written."""
    def enc(raw: bytes) -> bytes:
        return codec.encode("log", str(instance), raw)

    found = [
        b"",
        b"garbage \xff\xfe",
        enc(b"not json"),
        enc(b"[" * 50_000),
        enc(b"{}"),
        enc(b'{"type": "accept", "round": [99, "mallory"]}'),
        enc(b'{"type": "prepare", "round": [0, ""]}'),
        enc(b'{"type": "prepare", "round": [true, "mallory"]}'),
    ]
    if codec.encrypted:  # the instance is authenticated only with encryption
        found.append(encoded(codec, instance + 1, acc(99, v(instance, "moved"), "mallory")))
    return found


@pytest.mark.parametrize("codec", [Codec(KEY), Codec(None)], ids=["encrypted", "plain"])
def test_flipped_byte_in_an_entry_is_ignored(acceptors: Acceptors, codec: Codec) -> None:
    """A corrupted entry on one acceptor is dropped like one never written: the
    instance is still found decided and commits go on."""
    c = client(acceptors, codec=codec)
    assert commit(c, 1) == v(1)
    entry = next(log_folder(acceptors["b0"], 1).iterdir())
    data = bytearray(entry.read_bytes())
    data[len(data) // 2] ^= 0x01
    entry.write_bytes(bytes(data))
    bob = client(acceptors, "bob", codec=codec)
    assert bob.get_recent(V0) == v(1)
    assert bob.learn(1) == v(1)
    assert commit(bob, 2, "bob") == v(2, "bob")
    assert client(acceptors, "carol", codec=codec).get_recent(V0) == v(2, "bob")


@pytest.mark.parametrize("codec", [Codec(KEY), Codec(None)], ids=["encrypted", "plain"])
def test_garbage_entries_do_not_decide_anything(acceptors: Acceptors, codec: Codec) -> None:
    """Garbage in every log of an instance reads as an empty instance: nothing
    decided, nothing accepted, and get_recent writes nothing there."""
    for backend in acceptors.values():
        for raw in garbage_entries(codec, 1):
            backend.logs.append(log_key(1), raw)
    c = client(acceptors, codec=codec)
    assert c.learn(1) is None
    assert c.get_recent(V0) == V0
    assert all(len(entries(b, 1)) == len(garbage_entries(codec, 1)) for b in acceptors.values())


def test_garbage_on_one_acceptor_propose_still_decides(acceptors: Acceptors) -> None:
    for raw in garbage_entries(CODEC, 1):
        acceptors["b0"].logs.append(log_key(1), raw)
    c = client(acceptors)
    assert commit(c, 1) == v(1)
    assert client(acceptors, "bob").get_recent(V0) == v(1)


def test_garbage_on_every_acceptor_plain_appends_still_decide(acceptors: Acceptors) -> None:
    for backend in acceptors.values():
        for raw in garbage_entries(CODEC, 1):
            backend.logs.append(log_key(1), raw)
    c = client(acceptors, conditional=False)
    assert commit(c, 1) == v(1)
    assert client(acceptors, "bob").get_recent(V0) == v(1)


def test_garbage_on_every_acceptor_conditional_still_decides(acceptors: Acceptors) -> None:
    for backend in acceptors.values():
        backend.logs.append(log_key(1), b"garbage")
    c = client(acceptors)
    assert commit(c, 1) == v(1)


def test_forged_entries_under_another_key_are_ignored(acceptors: Acceptors) -> None:
    """Well-formed messages encoded under a different key (a forged classic
    decision on two acceptors, forged fast accepts on all three) decide nothing."""
    mallory = Codec(MasterKey(bytes(range(32))))
    c = client(acceptors)
    assert commit(c, 1) == v(1)
    for name, backend in acceptors.items():
        if name != "b2":
            backend.logs.append(log_key(2), encoded(mallory, 2, prep(50, "mallory")))
            backend.logs.append(log_key(2), encoded(mallory, 2, acc(50, v(2, "forged"), "mallory")))
        backend.logs.append(log_key(3), encoded(mallory, 3, fast(v(3, "forged"))))
    for backend in acceptors.values():
        backend.put(HINT_KEY, mallory.encode("hint", HINT_KEY, json.dumps({"version": 3}).encode()))
    bob = client(acceptors, "bob")
    assert bob.learn(2) is None
    assert bob.learn(3) is None
    assert bob.get_recent(V0) == v(1)
    # the forged accept binds nothing: a proposer decides its own value
    assert client(acceptors, "carol", conditional=False).propose(2, v(2, "carol")) == v(2, "carol")


# ---------------------------------------------------------------- hints and crashed proposers


def test_hint_lets_get_recent_skip_ahead(acceptors: Acceptors) -> None:
    c = client(acceptors)
    for n in (1, 2, 3, 4):
        assert commit(c, n) == v(n)
    cold = client(acceptors, "cold")
    assert cold.get_recent(V0) == v(4)
    assert cold.round_trips == 6  # 1 (decided), hints (none), then 2, 3, 4 decided, 5 empty
    c.publish(v(3))
    warm = client(acceptors, "warm")
    assert warm.get_recent(V0) == v(4)
    assert warm.round_trips == 5  # 1 (decided), hints, 3 (confirming the hint), 4, 5
    before = warm.round_trips
    assert warm.get_recent(v(4)) == v(4)
    assert warm.round_trips - before == 1  # up to date: no hints read


def test_hint_past_the_real_latest_is_not_trusted(acceptors: Acceptors) -> None:
    c = client(acceptors)
    for n in (1, 2):
        assert commit(c, n) == v(n)
    c.publish(Version(40, "e" * 64, CONFIG))  # claims an instance never decided
    acceptors["b0"].put(HINT_KEY, b"garbage")
    bob = client(acceptors, "bob")
    assert bob.get_recent(V0) == v(2)
    assert bob.propose(3, v(3, "bob")) == v(3, "bob")
    assert client(acceptors, "carol").get_recent(V0) == v(3, "bob")
    assert all(entries(b, 40) == [] for b in acceptors.values())


def test_crashed_fast_proposer_is_finished_by_get_recent(acceptors: Acceptors) -> None:
    """A proposer that crashed after its fast-round accept reached one acceptor:
    another client's get_recent finishes the instance with that value."""
    c = client(acceptors)
    assert commit(c, 1) == v(1)
    crashed = client({"b0": acceptors["b0"]}, "crashed")  # a view of one acceptor
    assert crashed.propose(2, v(2, "x")) == v(2, "x")
    assert [len(entries(b, 2)) for b in acceptors.values()] == [1, 0, 0]
    bob = client(acceptors, "bob")
    assert bob.learn(2) is None
    assert bob.get_recent(V0) == v(2, "x")
    assert client(acceptors, "carol").learn(2) == v(2, "x")
    assert commit(bob, 3, "bob") == v(3, "bob")


def test_crashed_classic_proposer_is_finished_with_its_value(acceptors: Acceptors) -> None:
    """Prepare on all three, accept on one only: the value may have been chosen, so
    the finisher (even one with its own value) must decide it."""
    c = client(acceptors)
    assert commit(c, 1) == v(1)
    for backend in acceptors.values():
        backend.logs.append(log_key(2), encoded(CODEC, 2, prep(1, "crashed")))
    acceptors["b2"].logs.append(log_key(2), encoded(CODEC, 2, acc(1, v(2, "x"), "crashed")))
    bob = client(acceptors, "bob")
    assert bob.propose(2, v(2, "bob")) == v(2, "x")
    assert client(acceptors, "carol").get_recent(V0) == v(2, "x")


def test_wrong_version_number_is_corrupt(acceptors: Acceptors) -> None:
    c = client(acceptors)
    assert c.propose(1, v(5)) == v(5)
    with pytest.raises(CorruptObject):
        c.get_recent(V0)


# ---------------------------------------------------------------- log compaction
def decide_versions(cluster: Cluster, upto: int) -> None:
    for n in range(1, upto + 1):
        assert drive(cluster, propose(make_setup(), n, v(n), rng()))[0] == v(n)


def test_compaction_records_every_floor_before_deleting_anything() -> None:
    cluster = Cluster()
    decide_versions(cluster, 6)
    run = compact(make_setup(), 4)
    assert [type(r) for r in next(run)] == [ReadHint] * 3
    assert [type(r) for r in run.send([None, 6, 2])] == [WriteHint] * 2  # not a1's newer one
    first = run.send([None, None])
    assert [type(r) for r in first] == [WriteFloor] * 3  # all floors, nothing deleted yet
    with pytest.raises(NoQuorum):  # one acceptor did not record it: nothing is deleted
        run.send([True, True, None])
    assert all(cluster.log(a, 1) for a in names(3))
    cluster.hints["a1"] = 6
    removed, batches = drive(cluster, compact(make_setup(), 4))
    assert batches == 4 and removed == 9  # instances 1-3 on 3 acceptors
    assert cluster.floors == {a: 4 for a in names(3)}
    # A client behind the floor finds a hint at or above it, whoever published last.
    assert cluster.hints == {"a0": 4, "a1": 6, "a2": 4}
    assert all(not cluster.log(a, i) and cluster.log(a, 4) for a in names(3) for i in (1, 2, 3))


def test_past_floor_leaves_a_moved_floor_to_its_caller() -> None:
    """A floor that moved on while reading is raised, not followed on the same
    acceptors: the caller checks from the floor's record whose acceptors ran it
    (another configuration's, for a client that slept through a change)."""
    cluster = Cluster()
    decide_versions(cluster, 6)
    drive(cluster, compact(make_setup(), 2))
    drive(cluster, compact(make_setup(), 4))
    with pytest.raises(Compacted) as info:
        drive(cluster, past_floor(make_setup(), 2, rng()))
    assert (info.value.instance, info.value.floor) == (2, 4)


def test_reader_behind_the_floor_jumps_to_it_and_walks_on() -> None:
    cluster = Cluster()
    decide_versions(cluster, 6)
    drive(cluster, compact(make_setup(), 4))
    with pytest.raises(Compacted) as info:  # read 1: compacted
        drive(cluster, get_recent(make_setup(), V0, rng()))
    assert info.value.floor == 4
    floor, batches = drive(cluster, past_floor(make_setup(), 4, rng()))
    assert (floor, batches) == (v(4), 1)
    # then read 5 (decided: behind) -> the hints (none here) -> read 6 -> read 7 (empty)
    (latest, reading), batches = drive(cluster, get_recent(make_setup(), floor, rng()))
    assert latest == v(6) and reading is not None and reading.instance == 7 and batches == 4
    # an up-to-date reader pays nothing extra: still one round trip
    assert drive(cluster, get_recent(make_setup(), v(6), rng()))[1] == 1


def test_proposal_below_the_floor_is_stopped_and_decides_nothing() -> None:
    """A proposer that read instance 2 empty before it was decided and compacted:
    its logs are gone now, but the floor stops the proposal."""
    cluster = Cluster()
    decide_versions(cluster, 6)
    drive(cluster, compact(make_setup(), 4))
    with pytest.raises(Compacted) as info:
        drive(cluster, propose(make_setup(proposer="late"), 2, v(2, "late"), rng(), dict(EMPTY)))
    assert (info.value.instance, info.value.floor) == (2, 4)
    # what it appended in that round trip decides nothing a reader would learn
    with pytest.raises(Compacted):
        drive(cluster, get_recent(make_setup(), v(1), rng()))
    assert drive(cluster, get_recent(make_setup(), v(4), rng()))[0][0] == v(6)


def test_byzantine_floor_needs_an_honest_voucher() -> None:
    """In Byzantine mode one acceptor's floor claim is not enough to act on."""
    setup = make_setup(4, quorums=Quorums.bft(4))
    cluster = Cluster()
    for n in range(1, 4):
        assert drive(cluster, propose(setup, n, v(n), rng()))[0] == v(n)
    cluster.floors["a0"] = 99  # a lie: nothing was compacted
    assert drive(cluster, get_recent(setup, V0, rng()))[0][0] == v(3)


def test_consensus_compacts_logs_on_backends_after_the_grace(acceptors: Acceptors) -> None:
    c = client(acceptors, log_grace=3600.0)
    for n in range(1, 6):
        assert c.propose(n, v(n)) == v(n)
    hour = 3600 * 10**9
    # The first gc leaves a mark: versions up to 4 were decided by (its clock) 1 h.
    assert c.compact_logs(v(4), learned_ns=hour, now_ns=hour) == (0, 0)
    # Later gcs before the grace is over change nothing (nor the mark's time).
    assert c.compact_logs(v(4), learned_ns=2 * hour - 1, now_ns=2 * hour - 1) == (0, 0)
    # Once it is: the floor is the instance after the mark (decided: version 5 exists).
    floor, removed = c.compact_logs(v(5), learned_ns=2 * hour, now_ns=2 * hour)
    assert floor == 5 and removed >= 4 * 3
    for backend in acceptors.values():
        assert [i for i in range(1, 6) if log_folder(backend, i).exists()] == [5]
        assert sorted(backend.list("floor")) == ["floor/000000000005", "floor/mark-000000000005"]
    # a floor names the acceptors that ran its instance; a client of other acceptors
    # is told so instead of jumping on its own
    lone = client({"b0": acceptors["b0"]}, "lone")
    with pytest.raises(FloorElsewhere):
        lone.get_recent(V0)
    bob = client(acceptors, "bob")
    assert bob.get_recent(V0) == v(5)
    assert bob.propose(3, v(3, "bob")) is None  # behind the floor: told to learn
    assert bob.learn(3) is None and bob.learn(5) == v(5)
    assert bob.get_recent(v(1)) == v(5)
    assert bob.propose(6, v(6, "bob")) == v(6, "bob")


class CompactedAfterRun(Consensus):
    """Runs ``after_run`` once, right after the next protocol run finishes: as if a
    compaction happened while the proposer was suspended before looking at it."""

    after_run: Callable[[], None] | None = None

    def run(self, protocol: Run[T]) -> T:
        result = super().run(protocol)
        hook, self.after_run = self.after_run, None
        if hook is not None:
            hook()
        return result


def record_floor(acceptors: Acceptors, below: int) -> None:
    for backend in acceptors.values():
        key = floor_key(below)
        backend.put(key, CODEC.encode("floor", key, json.dumps(
            {"floor": below, "acceptors": sorted(acceptors)}).encode()))


@pytest.mark.parametrize("grace", [0.0, 3600.0])
def test_a_proposal_that_outlived_half_the_grace_rechecks_the_floor(
        tmp_path: Path, grace: float) -> None:
    """A proposal that took longer than half the grace (a laptop suspended mid-push)
    counts only if its instance was not compacted meanwhile; a quick one is not
    second-guessed (its round trips read the floor themselves)."""
    accs = make_acceptors(tmp_path)
    c = CompactedAfterRun(accs, CODEC, "alice", sleep=lambda s: None, log_grace=grace)
    for n in range(1, 4):
        assert c.propose(n, v(n)) == v(n)
    c.after_run = lambda: record_floor(accs, 6)
    assert c.propose(4, v(4)) == (None if grace == 0.0 else v(4))


class CountingBackend(FaultyBackend):
    """A backend that counts the reads of each key (no faults)."""

    def __init__(self, inner: LocalBackend) -> None:
        super().__init__(inner)
        self.reads: defaultdict[str, int] = defaultdict(int)

    def get(self, key: str) -> bytes:
        self.reads[key] += 1
        return super().get(key)


def test_floors_count_once_verified_and_a_forged_one_is_ignored_and_reported(
        tmp_path: Path) -> None:
    """A floor counts only once its record authenticates as the floor its name says;
    a record is read once per acceptor, however many round trips read the floor.
    ``floor/999999999999`` holding a genuine record of another floor (replayed) is
    ignored -- the client learns and proposes on -- and reported once, naming the
    backend and the key (issue 16, scenario 6)."""
    accs = {a: CountingBackend(b) for a, b in make_acceptors(tmp_path).items()}
    gc = client(accs, "gc", log_grace=3600.0)  # type: ignore[arg-type]
    for n in range(1, 6):
        assert gc.propose(n, v(n)) == v(n)
    hour = 3600 * 10**9
    gc.compact_logs(v(4), learned_ns=hour, now_ns=hour)
    assert gc.compact_logs(v(5), learned_ns=2 * hour, now_ns=2 * hour)[0] == 5
    genuine = floor_key(5)
    bogus = floor_key(999_999_999_999)
    accs["b0"].put(bogus, accs["b0"].get(genuine))
    for backend in accs.values():
        backend.reads.clear()

    notes: list[str] = []
    bob = client(accs, "bob", warn=notes.append)  # type: ignore[arg-type]
    assert bob.get_recent(V0) == v(5)
    assert bob.propose(6, v(6, "bob")) == v(6, "bob")
    assert bob.get_recent(v(6, "bob")) == v(6, "bob")
    assert bob.round_trips >= 4
    # One verification per acceptor, plus the jump reading whose acceptors it names.
    assert [b.reads[genuine] for b in accs.values()] == [2, 1, 1]
    assert accs["b0"].reads[bogus] >= 2  # never trusted: read again each time
    assert len(notes) == 1, notes
    assert bogus in notes[0] and accs["b0"].name in notes[0], notes


def test_a_forged_or_replayed_mark_is_ignored_and_reported(acceptors: Acceptors) -> None:
    """Compaction trusts only marks that authenticate as what their names say: an
    old mark's record replayed under another mark's name, or garbage, moves no
    floor, and each is reported once naming the backend and the key."""
    notes: list[str] = []
    c = client(acceptors, log_grace=3600.0, warn=notes.append)
    for n in range(1, 6):
        assert c.propose(n, v(n)) == v(n)
    hour = 3600 * 10**9
    assert c.compact_logs(v(2), learned_ns=hour, now_ns=hour) == (0, 0)
    genuine = acceptors["b0"].get(mark_key(2))
    for backend in acceptors.values():
        backend.delete(mark_key(2))
        backend.put(mark_key(4), genuine)  # the record of mark 2, under mark 4's name
    acceptors["b1"].put(mark_key(3), b"garbage")
    # Three hours later nothing is old enough: the one real mark is gone.
    assert c.compact_logs(v(5), learned_ns=3 * hour, now_ns=3 * hour) == (0, 0)
    assert sorted(n.split(" on ")[0] for n in notes) == sorted(
        [f"ignored {mark_key(4)}"] * 3 + [f"ignored {mark_key(3)}"]), notes
