"""Retries with backoff (backends/retry.py): what is retried, how often, and how long."""

from __future__ import annotations

import threading

import pytest

from metasync.backends import retry
from metasync.backends.retry import RetryPolicy, TransientError, retrying
from metasync.errors import BackendError, BackendUnavailable, ObjectNotFound


class Flaky:
    """Fails with ``errors`` in turn, then returns "ok"."""

    def __init__(self, *errors: BaseException) -> None:
        self.errors = list(errors)
        self.calls = 0

    def __call__(self) -> str:
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)
        return "ok"


@pytest.fixture
def waits(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """Record the backoff waits instead of sleeping them."""
    recorded: list[float] = []
    monkeypatch.setattr(retry.time, "sleep", recorded.append)
    return recorded


def test_transient_errors_are_retried_until_success(waits: list[float]) -> None:
    policy = RetryPolicy(attempts=5, base=0.1)
    flaky = Flaky(TransientError("reset"), BackendUnavailable("refused"), TransientError("503"))
    assert retrying(policy, "get k", flaky) == "ok"
    assert flaky.calls == 4
    assert policy.retries == 3
    # Full jitter: attempt n waits in [0, base * 2**n].
    assert len(waits) == 3
    for n, wait in enumerate(waits):
        assert 0 <= wait <= 0.1 * 2**n


def test_retry_after_is_honoured(waits: list[float]) -> None:
    policy = RetryPolicy(attempts=3, base=0.1)
    assert retrying(policy, "put", Flaky(TransientError("429", retry_after=7.5))) == "ok"
    assert waits == [7.5]


def test_too_long_retry_after_fails_at_once(waits: list[float]) -> None:
    policy = RetryPolicy(attempts=5, max_retry_after=60)
    flaky = Flaky(TransientError("daily cap", retry_after=3600))
    with pytest.raises(TransientError, match="daily cap"):
        retrying(policy, "put", flaky)
    assert flaky.calls == 1 and waits == []


@pytest.mark.parametrize(
    "error", [ObjectNotFound("missing"), BackendError("403 forbidden"), ValueError("bug")]
)
def test_permanent_errors_are_not_retried(waits: list[float], error: BaseException) -> None:
    flaky = Flaky(error)
    with pytest.raises(type(error)):
        retrying(RetryPolicy(attempts=5), "get", flaky)
    assert flaky.calls == 1 and waits == []


def test_attempts_are_bounded_and_the_last_error_surfaces(waits: list[float]) -> None:
    flaky = Flaky(*(TransientError(f"fail {i}") for i in range(10)))
    with pytest.raises(TransientError, match="fail 3"):
        retrying(RetryPolicy(attempts=4, base=0.01), "list", flaky)
    assert flaky.calls == 4 and len(waits) == 3


def test_backoff_is_capped(waits: list[float]) -> None:
    policy = RetryPolicy(attempts=12, base=1.0, cap=2.0)
    flaky = Flaky(*(TransientError("x") for _ in range(11)))
    assert retrying(policy, "get", flaky) == "ok"
    assert max(waits) <= 2.0


def test_environment_tunes_the_default_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("METASYNC_RETRY_ATTEMPTS", "9")
    monkeypatch.setenv("METASYNC_RETRY_BASE", "0.5")
    policy = RetryPolicy()
    assert policy.attempts == 9 and policy.base == 0.5


def test_describe_names_the_key_or_only_the_backend() -> None:
    assert retry.describe("read", "a/b", "s3://bucket") == "read 'a/b' on s3://bucket"
    assert retry.describe("list", None, "s3://bucket") == "list s3://bucket"


def test_translated_holds_a_slot_and_maps_what_the_request_raises() -> None:
    """One attempt holds one slot; a BackendError passes unchanged, another exception
    becomes what ``translate`` makes of it (raised from it), and one ``translate``
    hands back is re-raised as it is."""
    slots = threading.BoundedSemaphore(1)

    def holds_the_slot() -> str:
        assert not slots.acquire(blocking=False)  # the only slot is taken
        return "ok"

    def mapping(exc: Exception) -> BaseException:
        return ObjectNotFound(f"gone: {exc}") if isinstance(exc, KeyError) else exc

    assert retry.translated(slots, holds_the_slot, mapping) == "ok"
    for raised in [TransientError("503"), ValueError("a bug")]:
        with pytest.raises(type(raised)) as passed:
            retry.translated(slots, Flaky(raised), mapping)
        assert passed.value is raised
    with pytest.raises(ObjectNotFound, match="gone: 'k'") as mapped:
        retry.translated(slots, Flaky(KeyError("k")), mapping)
    assert isinstance(mapped.value.__cause__, KeyError)
    assert slots.acquire(blocking=False)  # every attempt gave its slot back


def test_retry_mark_remembers_a_retry_that_may_have_taken_effect(waits: list[float]) -> None:
    """A retry after a failure that says it did nothing leaves the mark unset; one
    after any other failure sets it (the earlier attempt may have been applied)."""

    class Throttled(TransientError):
        pass

    policy = RetryPolicy(attempts=5, base=0.0)
    untouched = retry.RetryMark(Throttled)
    assert retrying(policy, "put k", Flaky(Throttled("429")), on_retry=untouched) == "ok"
    assert not untouched.marked
    maybe_applied = retry.RetryMark(Throttled)
    assert retrying(policy, "put k", Flaky(Throttled("429"), TransientError("reset")),
                    on_retry=maybe_applied) == "ok"
    assert maybe_applied.marked
