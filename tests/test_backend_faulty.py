"""The fault-injecting wrapper (metasync.backends.faulty) over the memory backend:
without rules it is the inner backend (the whole conformance suite), and each kind of
rule (refuse, corrupt, lose_answer, hang) does exactly what it says, to object and
log operations alike, for the calls it matches and no others."""

from __future__ import annotations

import io
import threading
import uuid
from collections.abc import Callable, Iterator

import pytest

from metasync.backends import Backend
from metasync.backends.conformance import BackendConformance, Location
from metasync.backends.faulty import (
    ALWAYS,
    LOG_OPERATIONS,
    Corruption,
    Faults,
    FaultyBackend,
    FaultyLogs,
    corrupted,
)
from metasync.backends.memory import MemoryBackend, drop_store
from metasync.errors import BackendError, BackendUnavailable, ObjectNotFound

#: A bound on waits for a thread the test itself released (a hang guard, not timing).
THREAD_WAIT = 30.0


class TestFaultyBackendWithoutRules(BackendConformance):
    """The conformance suite through a wrapper that has no rules: it passes every call
    through unchanged (the suite's other clients open the memory store directly)."""

    backend_class = MemoryBackend
    transient_faults = False
    clients_are_threads = True

    @pytest.fixture
    def backend_location(self) -> Iterator[Location]:
        name = f"faulty-{uuid.uuid4().hex}"
        yield (f"memory:{name}", "ns")
        drop_store(name)

    @pytest.fixture
    def unicode_location(self) -> Iterator[Location]:
        name = f"fäulty störe ☃ {uuid.uuid4().hex}"
        yield (f"memory:{name}", "ns")
        drop_store(name)

    @pytest.fixture
    def backend(self, backend_location: Location) -> Iterator[Backend]:
        wrapped = FaultyBackend(MemoryBackend(*backend_location))
        wrapped.create()
        yield wrapped
        wrapped.close()

    @pytest.fixture
    def backend_factory(self, backend_location: Location) -> Callable[[], Backend]:
        return lambda: FaultyBackend(MemoryBackend(*backend_location))


@pytest.fixture
def inner() -> Iterator[MemoryBackend]:
    name = f"faulty-{uuid.uuid4().hex}"
    backend = MemoryBackend(f"memory:{name}", "ns")
    backend.create()
    yield backend
    drop_store(name)


@pytest.fixture
def faulty(inner: MemoryBackend) -> FaultyBackend:
    return FaultyBackend(inner)


def test_declares_the_inner_backends_capabilities_name_and_log_store(
        inner: MemoryBackend, faulty: FaultyBackend) -> None:
    assert faulty.capabilities is inner.capabilities
    assert faulty.name == inner.name and faulty.label == inner.name
    assert (faulty.uri, faulty.namespace) == (inner.uri, inner.namespace)
    assert isinstance(faulty.logs, FaultyLogs)


def test_corrupted_bytes() -> None:
    assert corrupted(b"abcde", "flip") == b"abbde"  # 'c' ^ 1
    assert corrupted(b"abcde", "zero") == bytes(5)
    assert corrupted(b"abcde", "truncate") == b"ab"
    assert corrupted(b"", "flip") == corrupted(b"", "zero") == corrupted(b"", "truncate") == b""


# --- refusals ------------------------------------------------------------------------------


def test_refusal_does_nothing_and_fires_the_given_number_of_times(
        inner: MemoryBackend, faulty: FaultyBackend) -> None:
    """A refused put raises and stores nothing; after ``times`` refusals calls pass."""
    rule = faulty.faults.refuse("put", times=2)
    for _ in range(2):
        with pytest.raises(BackendError, match=r"put 'k' refused \(injected fault\)") as info:
            faulty.put("k", b"v")
        assert not info.value.transient
        assert inner.poll("k") is None
    faulty.put("k", b"v")
    assert inner.get("k") == b"v"
    assert rule.fired == 2 and not rule.live


def test_refusal_always_with_a_chosen_error_and_message(faulty: FaultyBackend) -> None:
    faulty.faults.refuse({"get", "list"}, times=ALWAYS, error=BackendUnavailable,
                         message="the disk is gone")
    for _ in range(3):
        with pytest.raises(BackendUnavailable, match="the disk is gone"):
            faulty.get("k")
        with pytest.raises(BackendUnavailable):
            faulty.list()
    faulty.put("k", b"v")  # operations not named pass
    assert faulty.poll("k") is not None


def test_rules_match_by_key_prefix(inner: MemoryBackend, faulty: FaultyBackend) -> None:
    """A prefix rule fires only for keys starting with it; the first live rule that
    matches a call fires (here: the prefix rule before the catch-all)."""
    inner.put("objects/a", b"a")
    inner.put("other", b"o")
    faulty.faults.refuse("get", "objects/", times=ALWAYS, message="objects refused")
    catch_all = faulty.faults.refuse("get", message="anything refused")
    with pytest.raises(BackendError, match="objects refused"):
        faulty.get("objects/a")
    assert catch_all.fired == 0
    with pytest.raises(BackendError, match="anything refused"):
        faulty.get("other")
    assert faulty.get("other") == b"o"  # the catch-all fired once: used up


def test_rules_match_by_backend_label(inner: MemoryBackend) -> None:
    """One Faults shared by two wrappers: a rule naming one label leaves the other be."""
    faults = Faults()
    first = FaultyBackend(inner, faults, label="b0")
    second = FaultyBackend(inner, faults, label="b1")
    rule = faults.refuse("put", times=ALWAYS, backend="b1")
    first.put("k", b"from b0")
    with pytest.raises(BackendError, match="b1: put 'k' refused"):
        second.put("k", b"from b1")
    assert inner.get("k") == b"from b0"
    assert rule.fired == 1


def test_bad_rules_are_rejected(faulty: FaultyBackend) -> None:
    with pytest.raises(ValueError, match="unknown operations"):
        faulty.faults.refuse("gett")
    with pytest.raises(ValueError, match="unknown operations"):
        faulty.faults.refuse([])
    with pytest.raises(ValueError, match="only reads and writes"):
        faulty.faults.corrupt({"get", "delete"})
    with pytest.raises(ValueError, match="times must be at least 1"):
        faulty.faults.hang("get", times=0)


# --- corruption ----------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["flip", "zero", "truncate"])
def test_corrupt_reads_alter_the_answer_not_the_stored_bytes(
        inner: MemoryBackend, faulty: FaultyBackend, how: Corruption) -> None:
    data = bytes(range(100))
    inner.put("k", data)
    faulty.faults.corrupt({"get", "get_range", "open"}, how=how, times=3)
    assert faulty.get("k") == corrupted(data, how)
    assert faulty.get_range("k", 10, 20) == corrupted(data[10:30], how)
    with faulty.open("k") as stream:
        assert stream.read() == corrupted(data, how)
    assert faulty.get("k") == inner.get("k") == data


def test_corrupt_writes_store_altered_bytes(inner: MemoryBackend, faulty: FaultyBackend) -> None:
    """put (bytes or stream), put_if_absent and replace_if store the altered bytes."""
    faulty.faults.corrupt({"put", "put_if_absent", "replace_if"}, how="zero", times=ALWAYS)
    faulty.put("a", b"abc")
    faulty.put("b", io.BytesIO(b"stream"))
    assert faulty.put_if_absent("c", b"xy") is True
    token = inner.poll("a")
    assert token is not None and faulty.replace_if("a", b"wxyz", token) is True
    assert [inner.get(k) for k in "abc"] == [bytes(4), bytes(6), bytes(2)]


def test_corrupt_log_entries_on_fetch_and_on_append(
        inner: MemoryBackend, faulty: FaultyBackend) -> None:
    """A corrupt fetch alters every returned message (the stored log is intact); a
    corrupt append or append_at stores the altered message."""
    inner.logs.append("log/1", b"first")
    inner.logs.append("log/1", b"second")
    faulty.faults.corrupt("fetch", "log/1", how="truncate")
    assert faulty.logs.fetch("log/1") == [(0, b"fi"), (1, b"sec")]
    assert faulty.logs.fetch("log/1") == inner.logs.fetch("log/1") == [(0, b"first"),
                                                                       (1, b"second")]
    faulty.faults.corrupt({"append", "append_at"}, "log/2", how="flip", times=2)
    assert faulty.logs.append("log/2", b"aaa") == 0
    assert faulty.logs.append_at("log/2", 1, b"bbb") is True
    assert inner.logs.fetch("log/2") == [(0, b"a`a"), (1, b"bcb")]  # a^1 = `, b^1 = c


# --- lost answers --------------------------------------------------------------------------


def test_lost_answer_does_the_write_then_raises(inner: MemoryBackend,
                                                faulty: FaultyBackend) -> None:
    faulty.faults.lose_answer({"put", "delete"}, times=ALWAYS)
    with pytest.raises(BackendError, match="answer was lost") as info:
        faulty.put("k", b"v")
    assert info.value.transient
    assert inner.get("k") == b"v"
    with pytest.raises(BackendError):
        faulty.delete("k")
    with pytest.raises(ObjectNotFound):
        inner.get("k")


def test_lost_answer_of_log_appends(inner: MemoryBackend, faulty: FaultyBackend) -> None:
    """An append whose answer is lost is in the log all the same (a retry would add a
    second entry: exactly what pPaxos must tolerate)."""
    faulty.faults.lose_answer({"append", "append_at"}, "log/", times=2,
                              error=BackendUnavailable)
    with pytest.raises(BackendUnavailable):
        faulty.logs.append("log/1", b"a")
    with pytest.raises(BackendUnavailable):
        faulty.logs.append_at("log/1", 1, b"b")
    assert faulty.logs.append("log/1", b"c") == 2
    assert inner.logs.fetch("log/1") == [(0, b"a"), (1, b"b"), (2, b"c")]


def test_log_operations_are_refused_by_their_own_names(
        inner: MemoryBackend, faulty: FaultyBackend) -> None:
    """Log rules name append/append_at/fetch/delete_log with the log as key; object
    rules do not reach the inner log store's own requests."""
    faulty.faults.refuse("put_if_absent", times=ALWAYS)  # what ObjectStoreLogs uses inside
    assert faulty.logs.append("log/1", b"a") == 0
    faulty.faults.refuse(LOG_OPERATIONS, "log/1", times=ALWAYS, message="log refused")
    for operation in (lambda: faulty.logs.append("log/1", b"x"),
                      lambda: faulty.logs.append_at("log/1", 1, b"x"),
                      lambda: faulty.logs.fetch("log/1"),
                      lambda: faulty.logs.delete_log("log/1")):
        with pytest.raises(BackendError, match="log refused"):
            operation()
    assert inner.logs.fetch("log/1") == [(0, b"a")]
    assert faulty.logs.append("log/2", b"b") == 0
    assert faulty.logs.delete_log("log/2") == 1


# --- hangs ---------------------------------------------------------------------------------


def test_hang_blocks_until_released_then_does_the_operation(
        inner: MemoryBackend, faulty: FaultyBackend) -> None:
    """A call blocks before doing anything until the hang is released; then it is
    done, and the released rule fires for no later call (the append)."""
    rule = faulty.faults.hang({"put", "append"}, times=ALWAYS)
    outcome: dict[str, object] = {}

    def writer() -> None:
        faulty.put("k", b"v")
        outcome["position"] = faulty.logs.append("log", b"e")

    thread = threading.Thread(target=writer, daemon=True)
    thread.start()
    assert rule.entered.wait(THREAD_WAIT)
    # Blocked before doing anything: nothing is stored yet.
    assert thread.is_alive() and inner.poll("k") is None and outcome == {}
    rule.release()
    thread.join(THREAD_WAIT)
    assert not thread.is_alive()
    assert inner.get("k") == b"v" and outcome == {"position": 0}
    assert rule.fired == 1 and not rule.live


def test_release_all_frees_every_hang_of_shared_faults(inner: MemoryBackend) -> None:
    """Hangs on two wrappers sharing one Faults (each rule naming its wrapper) block
    both calls; release_all lets both finish."""
    faults = Faults()
    hangs = [faults.hang("fetch", backend="b0"), faults.hang("get", backend="b1")]
    b0, b1 = (FaultyBackend(inner, faults, label=label) for label in ("b0", "b1"))
    inner.put("k", b"v")
    results: dict[str, object] = {}
    threads = [
        threading.Thread(target=lambda: results.update(b0=b0.logs.fetch("log")), daemon=True),
        threading.Thread(target=lambda: results.update(b1=b1.get("k")), daemon=True),
    ]
    for thread in threads:
        thread.start()
    for rule in hangs:
        assert rule.entered.wait(THREAD_WAIT)
    assert results == {}
    faults.release_all()
    for thread in threads:
        thread.join(THREAD_WAIT)
        assert not thread.is_alive()
    assert results == {"b0": [], "b1": b"v"}
