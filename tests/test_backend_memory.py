"""The ``memory:`` backend: the shared conformance suite (its other clients are threads
of this process), plus what is particular to it: stores shared by name, dropped on
request, and logs from exclusive creates."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from dataclasses import replace

import pytest

from metasync.backends import open_backend
from metasync.backends.base import LATENCY_PAYLOAD
from metasync.backends.conformance import BackendConformance, Location
from metasync.backends.logs import ObjectStoreLogs, RegisterLogs, log_store_for
from metasync.backends.memory import MemoryBackend, drop_store
from metasync.errors import BackendError, BackendUnavailable, ObjectNotFound, UsageError


def fresh_name(hint: str = "test") -> str:
    """A store name no other test uses."""
    return f"{hint}-{uuid.uuid4().hex}"


class TestMemoryBackend(BackendConformance):
    """The conformance suite against a fresh ``memory:`` store."""

    backend_class = MemoryBackend
    transient_faults = False  # no connection to break
    clients_are_threads = True  # the store lives in this process

    @pytest.fixture
    def backend_location(self) -> Iterator[Location]:
        name = fresh_name()
        yield (f"memory:{name}", "ns")
        drop_store(name)

    @pytest.fixture
    def unicode_location(self) -> Iterator[Location]:
        name = fresh_name("ünïcødé store ☃ 名前")
        yield (f"memory:{name}", "ns")
        drop_store(name)


@pytest.fixture
def name() -> Iterator[str]:
    store = fresh_name()
    yield store
    drop_store(store)


def test_instances_of_one_name_share_a_store_and_others_do_not(name: str) -> None:
    """Two instances opened with the same name are two clients of one store: each sees
    the other's objects and log entries. Another name is another, empty store."""
    first = open_backend(f"memory:{name}", "ns")
    second = open_backend(f"memory:{name}", "ns")
    assert isinstance(first, MemoryBackend) and first is not second
    first.create()
    assert second.exists()
    first.put("k", b"v")
    assert second.logs.append("log", b"e") == 0
    assert second.get("k") == b"v"
    assert first.logs.fetch("log") == [(0, b"e")]
    elsewhere = open_backend(f"memory:{name}-other", "ns")
    try:
        assert not elsewhere.exists()
    finally:
        drop_store(f"{name}-other")


def test_dropped_store_starts_empty_for_new_instances(name: str) -> None:
    """drop_store forgets the store: an instance opened afterwards finds no namespace,
    while one already open keeps the forgotten store's data."""
    before = MemoryBackend(f"memory:{name}", "ns")
    before.create()
    before.put("k", b"v")
    drop_store(name)
    after = MemoryBackend(f"memory:{name}", "ns")
    assert not after.exists()
    after.create()
    assert list(after.list()) == []
    assert before.get("k") == b"v"
    drop_store(name)  # dropping again (or a name never used) is fine
    drop_store(fresh_name())


def test_uncreated_namespace_is_unavailable_not_empty(name: str) -> None:
    """Before create() every operation fails with BackendUnavailable: a namespace that
    was never made is not mistaken for an empty repository."""
    backend = MemoryBackend(f"memory:{name}", "ns")
    for operation in (lambda: backend.get("k"), lambda: backend.put("k", b"v"),
                      lambda: list(backend.list()), lambda: backend.logs.fetch("log")):
        with pytest.raises(BackendUnavailable, match="create it first"):
            operation()


@pytest.mark.parametrize("uri", ["memory:", "memorynope:x"])
def test_uri_needs_a_name(uri: str) -> None:
    with pytest.raises(UsageError, match="memory:NAME"):
        MemoryBackend(uri, "ns")


def test_logs_are_the_generic_exclusive_create_logs(name: str) -> None:
    """Appends are exclusive creates of ``log/<p:010d>`` objects (ObjectStoreLogs, the
    layout of docs/FORMAT.md §11.2), visible as plain objects."""
    backend = MemoryBackend(f"memory:{name}", "ns")
    backend.create()
    assert type(backend.logs) is ObjectStoreLogs
    backend.logs.append("log/000000000001", b"first")
    backend.logs.append("log/000000000001", b"second")
    assert sorted(backend.list("log")) == ["log/000000000001/0000000000",
                                           "log/000000000001/0000000001"]
    assert backend.get("log/000000000001/0000000001") == b"second"


def test_open_is_a_snapshot_and_ranges_are_checked(name: str) -> None:
    """A stream from open() keeps the object as it was; a range past the end is a
    BackendError (a truncated copy), a missing key ObjectNotFound."""
    backend = MemoryBackend(f"memory:{name}", "ns")
    backend.create()
    backend.put("k", b"0123456789")
    with backend.open("k") as stream:
        backend.put("k", b"changed")
        assert stream.read() == b"0123456789"
    with pytest.raises(BackendError, match="shorter than the 8 bytes"):
        backend.get_range("k", 0, 8)
    with pytest.raises(ObjectNotFound):
        backend.get_range("missing", 0, 0)
    with pytest.raises(ValueError):
        backend.get_range("k", -1, 1)


class WithoutExclusiveCreate(MemoryBackend):
    """A memory store declaring no atomic put_if_absent (as a WebDAV server)."""

    capabilities = replace(MemoryBackend.capabilities, conditional_create=False)


def test_log_store_is_chosen_by_capabilities(name: str) -> None:
    """Without conditional_create the logs are Disk Paxos registers (RegisterLogs),
    which work over the same objects; backend.logs is made once and kept."""
    backend = WithoutExclusiveCreate(f"memory:{name}", "ns")
    backend.create()
    logs = backend.logs
    assert type(logs) is RegisterLogs and type(log_store_for(backend)) is RegisterLogs
    assert backend.logs is logs and log_store_for(backend) is not logs
    assert logs.append("log", b"a") == 0
    assert logs.append_at("log", 1, b"b") is True
    assert logs.append_at("log", 1, b"x") is False
    assert logs.fetch("log") == [(0, b"a"), (1, b"b")]
    assert logs.delete_log("log") >= 2
    assert logs.fetch("log") == []


def test_each_request_counts_once_whatever_calls_it_inside() -> None:
    """``Backend.requests`` (the service's ``metasync_backend_requests_total``) counts
    each call of the backend interface once: ``list_sizes`` is one request even where
    it asks ``size`` per key, and a stream's reads count as they happen."""
    backend = open_backend(f"memory:{fresh_name()}", "ns")
    backend.create()
    before = backend.requests
    backend.put("a", b"x" * 10)
    backend.put("b", b"y")
    assert backend.get("a") == b"x" * 10
    assert sorted(backend.list_sizes()) == [("a", 10), ("b", 1)]
    assert backend.requests - before == 4
    with pytest.raises(ObjectNotFound):
        backend.get("missing")
    assert backend.requests - before == 5  # a failed request is a request too


def test_small_requests_measure_the_latency_and_transfers_and_listings_do_not() -> None:
    """``Backend.latency`` (the service's ``latency_ms``, measured by every sync, so a
    backend whose change feed works and whose hint is never polled has one too) is
    the time of the last successful request that moved at most ``LATENCY_PAYLOAD``
    bytes; a big transfer, a listing or a failed request leaves it as it was."""
    backend = open_backend(f"memory:{fresh_name()}", "ns")
    assert backend.latency is None
    backend.create()
    assert backend.latency is not None

    def measured(request: Callable[[], object]) -> bool:
        backend.latency = -1.0  # no request takes negative time: a measurement replaces it
        request()
        return backend.latency != -1.0

    assert not measured(lambda: backend.put("big", b"x" * (LATENCY_PAYLOAD + 1)))
    assert not measured(lambda: backend.get("big"))
    assert not measured(lambda: sorted(backend.list_sizes()))
    with pytest.raises(ObjectNotFound):
        measured(lambda: backend.get("missing"))
    assert backend.latency == -1.0
    assert measured(lambda: backend.put("small", b"y" * LATENCY_PAYLOAD))
    assert measured(lambda: backend.get("small"))
    assert measured(lambda: backend.size("small"))
    assert measured(lambda: backend.poll("small"))


def test_a_register_append_that_finds_another_entry_in_place_moves_on() -> None:
    """Register logs: an attempt that passes phase 2 but finds another value's entry
    already at its position (a listing that ran while that entry was created and its
    blocks removed can miss both: 6 processes racing on one folder did this about
    once in ten runs) returns that entry's value, so its append takes the next
    position. Before, it returned its own position, whose entry held the other
    value: two appends returned one position and one message was lost."""
    backend = open_backend(f"memory:{fresh_name('registers')}", "ns")
    backend.create()
    other = RegisterLogs(backend)
    assert other.append("log", b"first") == 0
    hidden = {"log/0000000000"}
    listed = backend.list

    def listing_that_missed_it(prefix: str = "") -> Iterator[str]:
        return (key for key in listed(prefix) if key not in hidden)

    backend.list = listing_that_missed_it  # type: ignore[method-assign]
    late = RegisterLogs(backend)
    assert late.append("log", b"second") == 1
    hidden.clear()
    assert RegisterLogs(backend).fetch("log") == [(0, b"first"), (1, b"second")]
