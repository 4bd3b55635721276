"""The configuration-following decisions (metasync.follow), driven by hand: which
configuration is asked next, when hints are read, in which order they are tried,
and how a hint is confirmed. No backend is involved: each test plays the world."""

from __future__ import annotations

from typing import Any

import pytest

from metasync import follow
from metasync.errors import (
    BackendError,
    BackendUnavailable,
    FloorElsewhere,
    MetasyncError,
    NoQuorum,
)
from metasync.objects import Version

A, B, C = "a" * 64, "b" * 64, "c" * 64


def v(number: int, config: str, master: str | None = "f" * 64) -> Version:
    return Version(number, master, config)


def drive(walk: follow.Follow[Any], answer: Any) -> tuple[Any, list[follow.Step]]:
    """Run ``walk``, answering each step with ``answer(step)`` (an exception instance
    is thrown in); return its result and the steps it took."""
    steps: list[follow.Step] = []
    reply: Any = None
    error: MetasyncError | None = None
    while True:
        try:
            step = walk.throw(error) if error is not None else walk.send(reply)
        except StopIteration as stop:
            return stop.value, steps
        steps.append(step)
        out = answer(step)
        reply, error = (None, out) if isinstance(out, MetasyncError) else (out, None)


def test_follows_configuration_changes_hop_by_hop() -> None:
    answers = {A: v(3, B), B: v(5, C), C: v(9, C)}
    result, steps = drive(follow.latest(v(1, A), A), lambda s: answers[s.config])
    assert result == v(9, C)
    assert steps == [follow.GetRecent(A, v(1, A)), follow.GetRecent(B, v(3, B)),
                     follow.GetRecent(C, v(5, C))]


def test_no_quorum_follows_the_newest_confirmed_hint() -> None:
    """A's quorum is gone: the hints of A's backends (and A's acceptors) are read;
    the newest is tried first, an unconfirmed one skipped, a confirmed one followed."""

    def answer(step: follow.Step) -> Any:
        if isinstance(step, follow.GetRecent):
            return BackendUnavailable("down") if step.config == A else v(8, C)
        if isinstance(step, follow.ReadHints):
            return [None, (7, C), (6, B), (7, C), (1, A)]
        if isinstance(step, follow.Learn):
            return None if step.number == 7 else v(step.number, step.config)
        assert isinstance(step, follow.Finish)
        return NoQuorum(1, 2, step.number) if step.config == C else None

    result, steps = drive(follow.latest(v(2, A), A), answer)
    assert result == v(8, C)
    assert steps == [follow.GetRecent(A, v(2, A)), follow.ReadHints(A, A),
                     follow.Learn(C, 7), follow.Finish(C, 7), follow.Learn(B, 6),
                     follow.GetRecent(B, v(6, B)), follow.GetRecent(C, v(8, C))]


def test_a_hint_decided_in_part_is_confirmed_by_finishing_its_instance() -> None:
    def answer(step: follow.Step) -> Any:
        return None if isinstance(step, follow.Learn) else v(4, B)

    result, steps = drive(follow.confirm(4, B), answer)
    assert result == v(4, B)
    assert steps == [follow.Learn(B, 4), follow.Finish(B, 4)]
    # Never believed: another number, nothing decided, or an error.
    assert drive(follow.confirm(4, B), lambda s: v(5, B))[0] is None
    assert drive(follow.confirm(4, B), lambda s: None)[0] is None
    assert drive(follow.confirm(4, B), lambda s: BackendError("x"))[0] is None


def test_without_a_confirmed_hint_the_missing_quorum_is_the_error() -> None:
    def answer(step: follow.Step) -> Any:
        if isinstance(step, follow.GetRecent):
            return BackendUnavailable("only 1 of 3 backends answered")
        if isinstance(step, follow.ReadHints):
            return [(1, A), (2, A)]  # none after the known version
        raise AssertionError(step)

    with pytest.raises(BackendUnavailable, match="only 1 of 3"):
        drive(follow.latest(v(2, A), A), answer)


def test_behind_a_floor_elsewhere_restarts_from_any_confirmed_hint() -> None:
    def answer(step: follow.Step) -> Any:
        if isinstance(step, follow.GetRecent):
            return FloorElsewhere(50) if step.config == A else v(60, B)
        if isinstance(step, follow.ReadHints):
            return [(55, B)]
        return v(55, B)

    result, steps = drive(follow.latest(v(3, A), A), answer)
    assert result == v(60, B)
    assert follow.ReadHints(A, A) in steps
    with pytest.raises(BackendError, match="no backend's latest-version hint"):
        drive(follow.latest(v(3, A), A),
              lambda s: FloorElsewhere(50) if isinstance(s, follow.GetRecent) else [])


def test_behind_a_floor_only_hints_past_it_count() -> None:
    """A confirmed hint below the floor leads back to the floor: following it looped
    until MAX_CONFIG_HOPS (the simulator's seed 12072 at --bft-share 0.5, with the
    rebalance after a change made to the configuration it decided)."""
    answers = iter(range(10))

    def answer(step: follow.Step) -> Any:
        next(answers)  # a loop would run out of answers
        if isinstance(step, follow.GetRecent):
            return FloorElsewhere(50)
        if isinstance(step, follow.ReadHints):
            return [(49, B), (7, B), (50, A)]
        return None if step.number == 50 else v(step.number, step.config)

    with pytest.raises(BackendError, match=r"version 50.*no backend's latest-version hint"):
        drive(follow.latest(v(3, A), A), answer)


def test_a_clone_starts_from_its_entry_hint_once_confirmed() -> None:
    assert drive(follow.start(None, v(0, A, None)), lambda s: None)[0] is None
    assert drive(follow.start((1, A), v(0, A, None)), lambda s: None)[1] == []
    result, steps = drive(follow.start((9, B), v(0, A, None)), lambda s: v(9, B))
    assert result == v(9, B) and steps == [follow.Learn(B, 9)]


def test_too_many_changes_is_a_transient_error() -> None:
    configs = iter([B, C] * 10)
    with pytest.raises(BackendError, match="more than 5 times"):
        drive(follow.latest(v(1, A), A, max_hops=5), lambda s: v(2, next(configs)))
