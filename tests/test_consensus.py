"""pPaxos: the pure decision core, then the Consensus driver over real dir: acceptors.

The driver runs against three LocalBackend folders in tmp_path. Backoff sleeps are
stubbed out (``sleep=lambda s: None``) so no test ever waits.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from metasync.backends.local import LocalBackend
from metasync.codec import Codec
from metasync.consensus import (
    HINT_KEY,
    AcceptorState,
    Consensus,
    Message,
    Round,
    decided,
    log_key,
    prepare_outcome,
    quorum,
    replay,
)
from metasync.errors import BackendError, CorruptObject
from metasync.keys import MasterKey
from metasync.objects import Version

CONFIG = "c" * 64
KEY = MasterKey(bytes(range(64, 96)))


def v(n: int, tag: str = "a") -> Version:
    """Version ``n`` with a master commit id derived from ``tag`` (distinct per tag)."""
    return Version(n, hashlib.sha256(tag.encode()).hexdigest(), CONFIG)


V0 = Version(0, None, CONFIG)


def prep(n: int, client: str = "a") -> Message:
    return Message("prepare", Round(n, client))


def acc(n: int, value: Version, client: str = "a") -> Message:
    return Message("accept", Round(n, client), value)


# ============================================================================ pure core


def test_quorum_sizes() -> None:
    """A quorum is a strict majority."""
    assert [quorum(n) for n in (1, 2, 3, 4, 5)] == [1, 2, 2, 3, 3]


def test_round_order_breaks_ties_by_client() -> None:
    """Rounds order by number first, then client id, so two clients never share one."""
    assert Round(1, "b") > Round(1, "a")
    assert Round(2, "a") > Round(1, "z")


def test_replay_prepare_granted_only_above_promise() -> None:
    """A prepare is granted only if its round exceeds every earlier promise: a
    repeat, an equal or a lower round is not granted; a tie broken by client is."""
    state = replay([prep(1, "a"), prep(1, "a"), prep(0, "z"), prep(1, "b"), prep(1, "a")])
    assert set(state.grants) == {Round(1, "a"), Round(1, "b")}
    assert state.promised == Round(1, "b")
    assert state.accepted is None
    assert state.highest_seen == 1


def test_replay_accept_effective_at_or_above_promise() -> None:
    """An accept takes effect if its round is >= the promise (equal included, higher
    too, even without its own prepare); a lower one is ignored. An effective accept
    raises the promise, so a later prepare of the same round is not granted."""
    state = replay([prep(2), acc(1, v(1, "x")), acc(2, v(1, "y")), acc(3, v(1, "z"), "b"), prep(3, "b")])
    assert state.accepts == {Round(2, "a"): v(1, "y"), Round(3, "b"): v(1, "z")}
    assert state.accepted == (Round(3, "b"), v(1, "z"))
    assert state.promised == Round(3, "b")
    assert Round(3, "b") not in state.grants
    assert state.highest_seen == 3


def test_replay_grant_reports_previously_accepted_value() -> None:
    """Each granted prepare records the value accepted before it (None if none)."""
    state = replay([prep(1), acc(1, v(1, "x")), prep(2, "b"), acc(2, v(1, "y"), "b"), prep(5, "c")])
    assert state.grants == {
        Round(1, "a"): None,
        Round(2, "b"): (Round(1, "a"), v(1, "x")),
        Round(5, "c"): (Round(2, "b"), v(1, "y")),
    }


def test_replay_empty_log() -> None:
    """An empty log is an acceptor that promised and accepted nothing."""
    assert replay([]) == AcceptorState()


messages = st.lists(
    st.one_of(
        st.builds(prep, st.integers(0, 5), st.sampled_from("abc")),
        st.builds(acc, st.integers(0, 5), st.builds(v, st.just(1), st.sampled_from("xyz")), st.sampled_from("abc")),
    ),
    max_size=12,
)


@settings(max_examples=150, deadline=None)
@given(log=messages)
def test_replay_invariants(log: list[Message]) -> None:
    """For any log: the promise never decreases; every grant's reported value is
    what was accepted just before that prepare; the accepted value is the last
    effective accept; no effective accept is below an earlier promise."""
    previous: Round | None = None
    for i in range(len(log) + 1):
        state = replay(log[:i])
        if previous is not None:
            assert state.promised is not None and state.promised >= previous
        previous = state.promised
    final = replay(log)
    for i, msg in enumerate(log):
        before, after = replay(log[:i]), replay(log[: i + 1])
        if msg.type == "prepare":
            granted = before.promised is None or msg.round > before.promised
            assert (msg.round in after.grants and msg.round not in before.grants) == granted
            if granted:
                assert after.grants[msg.round] == before.accepted
                assert final.grants[msg.round] == before.accepted
            assert after.accepted == before.accepted
        else:
            effective = before.promised is None or msg.round >= before.promised
            if effective:
                assert after.accepted == (msg.round, msg.value)
                assert after.accepts[msg.round] == msg.value
            else:
                assert after.accepted == before.accepted
                assert after.accepts == before.accepts
            assert after.grants == before.grants
    if final.accepts:
        last_round = max(final.accepts)
        assert final.accepted == (last_round, final.accepts[last_round])
    assert final.highest_seen == max((m.round.number for m in log), default=0)


def _state(accepts: dict[Round, Version]) -> AcceptorState:
    return AcceptorState(accepts=dict(accepts))


def test_decided_needs_quorum_in_one_round() -> None:
    """A value is decided only when `needed` acceptors accepted it in the same
    round; the same value accepted in different rounds does not add up."""
    r1, r2 = Round(1, "a"), Round(2, "b")
    assert decided([_state({r1: v(1)}), _state({r1: v(1)}), _state({})], 2) == v(1)
    assert decided([_state({r1: v(1)}), _state({r2: v(1)}), _state({})], 2) is None
    assert decided([_state({r1: v(1)}), _state({r1: v(1)}), _state({})], 3) is None
    assert decided([_state({r1: v(1)}), _state({}), _state({})], 2) is None
    assert decided([], 2) is None
    # an acceptor that accepted in two rounds counts in each
    both = _state({r1: v(1), r2: v(1, "b")})
    assert decided([both, _state({r2: v(1, "b")}), _state({})], 2) == v(1, "b")


def test_prepare_outcome() -> None:
    """Granted needs `needed` grants of this very round; the proposed value is the
    highest-round value any granting acceptor had accepted, else our own (None
    when only completing)."""
    rnd = Round(9, "me")
    none_accepted = AcceptorState(grants={rnd: None})
    low = AcceptorState(grants={rnd: (Round(3, "x"), v(1, "l"))})
    high = AcceptorState(grants={rnd: (Round(5, "y"), v(1, "h"))})
    other_round = AcceptorState(grants={Round(8, "z"): None})
    assert prepare_outcome([none_accepted, none_accepted, other_round], rnd, 2, v(1, "o")) == (True, v(1, "o"))
    assert prepare_outcome([none_accepted, other_round, other_round], rnd, 2, v(1, "o")) == (False, None)
    assert prepare_outcome([low, high, none_accepted], rnd, 2, v(1, "o")) == (True, v(1, "h"))
    assert prepare_outcome([high, low], rnd, 2, v(1, "o")) == (True, v(1, "h"))
    assert prepare_outcome([none_accepted, low], rnd, 2, None) == (True, v(1, "l"))
    assert prepare_outcome([none_accepted, none_accepted], rnd, 2, None) == (True, None)


def test_message_json_round_trip_and_rejects() -> None:
    """Messages survive their JSON; malformed ones raise CorruptObject, including
    an accept without a value."""
    for msg in (prep(3, "c"), acc(4, v(2, "q"), "d"), acc(1, V0)):
        assert Message.from_json(json.loads(json.dumps(msg.to_json()))) == msg
    for raw in (
        None,
        [],
        {"type": "promise", "round": [1, "a"]},
        {"type": "prepare"},
        {"type": "prepare", "round": [1]},
        {"type": "prepare", "round": ["1", "a"]},
        {"type": "prepare", "round": [1, 2]},
        {"type": "accept", "round": [1, "a"]},
        {"type": "accept", "round": [1, "a"], "value": None},
        {"type": "accept", "round": [1, "a"], "value": {"version": 1}},
    ):
        with pytest.raises(CorruptObject):
            Message.from_json(raw)


# ============================================================================ driver

Acceptors = dict[str, LocalBackend]


@pytest.fixture(scope="module")
def executor() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(max_workers=8) as pool:
        yield pool


@pytest.fixture(params=["encrypted", "plain"])
def codec(request: pytest.FixtureRequest) -> Codec:
    return Codec(KEY) if request.param == "encrypted" else Codec(None)


@pytest.fixture
def acceptors(tmp_path: Path) -> Iterator[Acceptors]:
    found: Acceptors = {}
    for i in range(3):
        location = tmp_path / f"acceptor{i}"
        location.mkdir()
        backend = LocalBackend(f"dir:{location}", "ns")
        backend.create()
        found[f"b{i}"] = backend
    yield found
    for backend in found.values():
        backend.close()


def driver(acceptors: Acceptors, codec: Codec, executor: ThreadPoolExecutor, client: str = "alice",
           **kwargs: int) -> Consensus:
    return Consensus(acceptors, codec, client, executor, sleep=lambda s: None, **kwargs)


def remove(backend: LocalBackend) -> None:
    shutil.rmtree(backend.root)


def test_single_proposer_decides_its_value(acceptors: Acceptors, codec: Codec,
                                           executor: ThreadPoolExecutor) -> None:
    """An uncontended proposer decides its own value; every acceptor's log then
    holds one prepare and one accept; learn() reports the value."""
    c = driver(acceptors, codec, executor)
    assert c.propose(1, v(1)) == v(1)
    assert c.learn(1) == v(1)
    for backend in acceptors.values():
        assert len(backend.fetch(log_key(1))) == 2
    assert driver(acceptors, codec, executor, "bob").learn(1) == v(1)
    assert c.learn(2) is None


def test_round_trips_of_uncontended_propose(acceptors: Acceptors, codec: Codec,
                                            executor: ThreadPoolExecutor) -> None:
    """An uncontended propose costs exactly 5 round trips: fetch, prepare, fetch,
    accept, fetch. A second propose of a decided instance costs 1 (the fetch that
    sees the decision), as does learn."""
    c = driver(acceptors, codec, executor)
    assert c.round_trips == 0
    c.propose(1, v(1))
    assert c.round_trips == 5
    c.propose(1, v(1, "b"))
    assert c.round_trips == 6
    c.learn(1)
    assert c.round_trips == 7


def test_second_proposer_learns_first_value(acceptors: Acceptors, codec: Codec,
                                            executor: ThreadPoolExecutor) -> None:
    """Once an instance is decided, another proposer of that instance gets the
    decided value back, never its own, and writes nothing."""
    alice, bob = driver(acceptors, codec, executor, "alice"), driver(acceptors, codec, executor, "bob")
    assert alice.propose(1, v(1, "a")) == v(1, "a")
    assert bob.propose(1, v(1, "b")) == v(1, "a")
    assert bob.propose(1, None) == v(1, "a")
    assert all(len(b.fetch(log_key(1))) == 2 for b in acceptors.values())


def test_proposer_after_unfinished_prepare_decides_own_value(
    acceptors: Acceptors, codec: Codec, executor: ThreadPoolExecutor
) -> None:
    """A prepare that was never followed by an accept binds no value: the next
    proposer decides its own, in a higher round."""
    alice, bob = driver(acceptors, codec, executor, "alice"), driver(acceptors, codec, executor, "bob")
    alice._append_all(1, prep(7, "alice"))
    assert bob.propose(1, v(1, "b")) == v(1, "b")
    state = replay([m for _, raw in acceptors["b0"].fetch(log_key(1)) if (m := bob._decode(1, raw))])
    assert state.accepted is not None and state.accepted[0] == Round(8, "bob")


def half_done(acceptors: Acceptors, codec: Codec, executor: ThreadPoolExecutor, instance: int,
              value: Version, on: tuple[str, ...] = ("b0",), rnd: int = 1) -> None:
    """A proposer that crashed after its prepare reached every acceptor and its
    accept reached only ``on``."""
    crashed = driver(acceptors, codec, executor, "crashed")
    crashed._append_all(instance, prep(rnd, "crashed"))
    subset = driver({k: acceptors[k] for k in on}, codec, executor, "crashed")
    assert subset._append_all(instance, acc(rnd, value, "crashed")) == len(on)


def test_half_done_instance_is_completed_with_its_value(
    acceptors: Acceptors, codec: Codec, executor: ThreadPoolExecutor
) -> None:
    """An instance whose accept reached only 1 of 3 acceptors is undecided, and
    propose(n, None) completes it with that value (Paxos: a value possibly chosen
    must be kept), as does a proposer with a different value of its own."""
    half_done(acceptors, codec, executor, 1, v(1, "x"))
    c = driver(acceptors, codec, executor)
    assert c.learn(1) is None
    assert c.propose(1, None) == v(1, "x")
    assert c.learn(1) == v(1, "x")

    half_done(acceptors, codec, executor, 2, v(2, "y"), on=("b2",))
    assert driver(acceptors, codec, executor, "bob").propose(2, v(2, "bob")) == v(2, "y")


def test_completion_adopts_highest_round_value(acceptors: Acceptors, codec: Codec,
                                               executor: ThreadPoolExecutor) -> None:
    """With different values partially accepted in different rounds, completion
    adopts the one accepted in the highest round."""
    half_done(acceptors, codec, executor, 1, v(1, "low"), on=("b0",), rnd=1)
    half_done(acceptors, codec, executor, 1, v(1, "high"), on=("b1",), rnd=2)
    assert driver(acceptors, codec, executor).propose(1, None) == v(1, "high")


def test_propose_none_on_empty_instance(acceptors: Acceptors, codec: Codec,
                                        executor: ThreadPoolExecutor) -> None:
    """propose(n, None) where nothing was ever accepted returns None and decides
    nothing (it only wrote prepares)."""
    c = driver(acceptors, codec, executor)
    assert c.propose(1, None) is None
    assert c.learn(1) is None
    assert c.propose(1, v(1)) == v(1)


def test_latest_walks_forward(acceptors: Acceptors, codec: Codec, executor: ThreadPoolExecutor) -> None:
    """latest(known) returns the last decided version reachable from ``known``,
    walking forward instance by instance; with nothing newer it returns ``known``
    after one fetch and without writing."""
    c = driver(acceptors, codec, executor)
    assert c.latest(V0) == V0
    assert c.round_trips == 1
    for n in (1, 2, 3):
        assert c.propose(n, v(n)) == v(n)
    other = driver(acceptors, codec, executor, "bob")
    assert other.latest(V0) == v(3)
    assert other.round_trips == 4  # instances 1, 2, 3 decided, 4 empty
    assert other.latest(v(2)) == v(3)
    assert other.latest(v(3)) == v(3)


def test_latest_uses_hint_and_ignores_false_hints(acceptors: Acceptors, codec: Codec,
                                                  executor: ThreadPoolExecutor) -> None:
    """A hint lets latest() start near the end; a hint pointing at an undecided
    instance, or garbage in the hint object, is ignored."""
    c = driver(acceptors, codec, executor)
    for n in (1, 2, 3, 4):
        c.propose(n, v(n))
    c.write_hint(v(3))
    reader = driver(acceptors, codec, executor, "bob")
    assert reader.latest(V0) == v(4)
    assert reader.round_trips == 3  # learn(3), then instances 4 and 5
    c.write_hint(Version(40, "e" * 64, CONFIG))  # claims an instance never decided
    acceptors["b0"].put(HINT_KEY, b"garbage")
    acceptors["b1"].put(HINT_KEY, codec.encode("hint", HINT_KEY, b"[" * 50_000))
    assert driver(acceptors, codec, executor, "carol").latest(V0) == v(4)


def test_latest_completes_half_done_instance(acceptors: Acceptors, codec: Codec,
                                             executor: ThreadPoolExecutor) -> None:
    """latest() completes an instance left half-done (accept on 1 of 3) with that
    value and continues from it; afterwards a quorum holds it."""
    c = driver(acceptors, codec, executor)
    c.propose(1, v(1))
    half_done(acceptors, codec, executor, 2, v(2, "x"))
    assert c.latest(V0) == v(2, "x")
    assert c.learn(2) == v(2, "x")


def test_latest_refuses_wrong_version_number(acceptors: Acceptors, codec: Codec,
                                             executor: ThreadPoolExecutor) -> None:
    """An instance that decided a version with another number is CorruptObject."""
    c = driver(acceptors, codec, executor)
    c.propose(1, v(5))
    with pytest.raises(CorruptObject):
        c.latest(V0)


def test_works_with_one_acceptor_gone(acceptors: Acceptors, codec: Codec,
                                      executor: ThreadPoolExecutor) -> None:
    """With 1 of 3 acceptor folders deleted, a quorum of 2 still decides, learns
    and walks forward."""
    c = driver(acceptors, codec, executor)
    c.propose(1, v(1))
    remove(acceptors["b1"])
    assert c.propose(2, v(2)) == v(2)
    assert c.learn(1) == v(1)
    assert driver(acceptors, codec, executor, "bob").latest(V0) == v(2)
    assert c.propose(2, v(2, "z")) == v(2)


def test_fails_with_two_acceptors_gone(acceptors: Acceptors, codec: Codec,
                                       executor: ThreadPoolExecutor) -> None:
    """With 2 of 3 acceptors gone there is no quorum: propose, learn and latest
    raise BackendError (transient) instead of deciding on one log."""
    c = driver(acceptors, codec, executor)
    c.propose(1, v(1))
    remove(acceptors["b0"])
    remove(acceptors["b2"])
    for call in (lambda: c.propose(2, v(2)), lambda: c.learn(1), lambda: c.latest(V0)):
        with pytest.raises(BackendError) as info:
            call()
        assert info.value.transient


def garbage_entries(codec: Codec, instance: int) -> list[bytes]:
    """Log entries that must count as never written."""
    def enc(raw: bytes) -> bytes:
        return codec.encode("log", str(instance), raw)

    return [
        b"",
        b"\x00",
        b"garbage \xff\xfe",
        b"\x01not zstd",
        enc(b"not json"),
        enc(b"[" * 50_000),
        enc(b"{}"),
        enc(b'{"type": "accept", "round": [99, "mallory"]}'),  # accept without value
        enc(b'{"type": "accept", "round": [99, "mallory"], "value": {"version": 1}}'),
        enc(b'{"type": "prepare", "round": ["99", "mallory"]}'),
        enc(b'{"type": "vote", "round": [99, "mallory"]}'),
    ]


def test_garbage_log_entries_are_ignored(acceptors: Acceptors, codec: Codec,
                                         executor: ThreadPoolExecutor) -> None:
    """Undecodable or malformed log entries on every acceptor are ignored exactly
    like entries never written: the instance still decides the proposed value."""
    for backend in acceptors.values():
        for entry in garbage_entries(codec, 1):
            backend.append(log_key(1), entry)
    c = driver(acceptors, codec, executor)
    assert c.learn(1) is None
    assert c.propose(1, v(1)) == v(1)
    assert c.latest(V0) == v(1)


def test_forged_and_moved_messages_are_ignored(acceptors: Acceptors, executor: ThreadPoolExecutor) -> None:
    """With encryption, a backend can neither forge a message (no key) nor replay
    a genuine message from another instance: both are ignored, so a forged
    'decision' on two acceptors decides nothing."""
    codec = Codec(KEY)
    mallory = Codec(MasterKey.generate())
    c = driver(acceptors, codec, executor)
    c.propose(1, v(2, "m"))  # a genuine accept for instance 1...
    moved = [raw for _, raw in acceptors["b0"].fetch(log_key(1))]
    forged = mallory.encode("log", "2", json.dumps(acc(50, v(2, "f"), "mallory").to_json()).encode())
    plain = Codec(None).encode("log", "2", json.dumps(acc(50, v(2, "f"), "mallory").to_json()).encode())
    for name in ("b0", "b1"):
        for entry in (*moved, forged, plain):
            acceptors[name].append(log_key(2), entry)  # ...replayed into instance 2
    assert c.learn(2) is None
    assert c.propose(2, v(2)) == v(2)


def test_concurrent_proposers_agree(tmp_path: Path, executor: ThreadPoolExecutor) -> None:
    """Proposers racing on the same instances never decide two values: every
    proposer that returns reports the same value per instance, which is one of
    the proposed values (a proposer may give up with BackendError: liveness is
    not guaranteed, safety is)."""
    codec = Codec(None)
    for trial in range(3):
        accs = {}
        for i in range(3):
            loc = tmp_path / f"t{trial}-{i}"
            loc.mkdir()
            accs[f"b{i}"] = LocalBackend(f"dir:{loc}", "ns")
            accs[f"b{i}"].create()
        results: dict[str, Version | None] = {}
        barrier = threading.Barrier(3)

        def run(client: str, accs: Acceptors = accs, results: dict[str, Version | None] = results,
                barrier: threading.Barrier = barrier) -> None:
            barrier.wait()
            try:
                results[client] = driver(accs, codec, executor, client, max_attempts=30).propose(1, v(1, client[0]))
            except BackendError:
                pass

        threads = [threading.Thread(target=run, args=(name,)) for name in ("xavier", "yolanda", "zoe")]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        outcomes = set(results.values())
        assert len(outcomes) <= 1
        final = driver(accs, codec, executor, "judge").propose(1, None)
        assert final in {v(1, "x"), v(1, "y"), v(1, "z")}
        assert outcomes <= {final}
