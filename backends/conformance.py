"""The conformance suite every storage backend must pass (cf. rclone's fstests).

A backend's test module subclasses :class:`BackendConformance` and provides where
a fresh namespace lives; every test then runs against that backend::

    import pytest
    from metasync.backends.conformance import BackendConformance

    class TestLocalBackend(BackendConformance):
        @pytest.fixture
        def backend_location(self, tmp_path):
            (tmp_path / "store").mkdir()
            return (f"dir:{tmp_path / 'store'}", "ns")

Fixtures (override any of them in the subclass):

``backend_location``
    ``(uri, namespace)`` of a namespace that does not exist yet, at a location
    that does, unique to the test. A plain picklable pair, so that child
    processes can open the same namespace (``open_backend(uri, namespace)``).
    The default skips the test: multi-process tests need it.
``backend``
    A fresh, created, empty :class:`Backend`. The default opens
    ``backend_location`` and calls ``create()``; override it for a backend that
    cannot be opened from a URI (an in-process fake), which then skips only the
    multi-process tests.
``backend_factory``
    A callable returning another, independent instance bound to the same
    namespace (a second client). Instances are closed after the test.

``unicode_location``
    Like ``backend_location``, but the location's path (folder, bucket prefix,
    server path) contains spaces and non-ASCII characters.
``faulty_location``
    ``(uri, namespace, proxy)``: a fresh namespace reached through a
    ``FaultProxy`` (tests/servers/faultproxy.py) that can reset connections.

Class attributes say which tests apply: ``backend_class`` (whose
``capabilities`` decide the capability tests), ``transient_faults`` (False
for a backend without a network connection to break) and ``clients_are_threads``
(True for a backend whose store lives in the test process, such as ``memory:``:
the concurrent clients of the multi-client tests are then threads of this
process instead of spawned processes). Tests that do not apply
are *deselected* at collection time by :func:`deselect_inapplicable`, with the
reason printed in the test summary; they are never silently skipped, so in CI
"0 skipped" means every applicable backend test ran. ``require_capability``
inside a test remains as a guard. Logs are reached as ``backend.logs``. No test
sleeps or asserts on timing; multi-client tests use a barrier so that the contended
part starts together.
The 100 MB streaming test is marked ``slow``.
"""

from __future__ import annotations

import hashlib
import io
import multiprocessing
import random
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import wait
from multiprocessing.synchronize import Barrier as ProcessBarrier
from typing import Any, BinaryIO, cast

import pytest

from metasync.backends import Backend, open_backend
from metasync.backends.base import TempFile
from metasync.backends.capabilities import Capabilities
from metasync.backends.logs import LogStore
from metasync.errors import BackendError, InvalidKey, ObjectNotFound
from metasync.portable import KILLED_EXITCODE, kill_self, peak_rss_bytes

if sys.platform == "win32":
    from multiprocessing.connection import PipeConnection as Conn
else:
    from multiprocessing.connection import Connection as Conn

#: ``(uri, namespace)``: everything a child process needs to open a backend.
Location = tuple[str, str]
#: What the clients of a multi-client test wait on: a process barrier, or a thread
#: barrier when the clients are threads (both have ``wait(timeout)`` and ``abort()``).
Barrier = ProcessBarrier | threading.Barrier

#: Seconds a test waits for its child processes before failing (a hang guard, not a
#: timing assertion: generous enough for slow remote services).
CHILD_TIMEOUT = 900.0

MiB = 1 << 20
#: Size of the large-object test's object (100 MB).
LARGE_OBJECT_SIZE = 100 * 1000 * 1000

#: Keys that must be rejected everywhere a key is accepted.
INVALID_KEYS: tuple[str, ...] = (
    "",
    "..",
    ".",
    "/abs",
    "a//b",
    "a/./b",
    "a/../b",
    "../escape",
    "a/",
    "a b",
    "a\\b",
    "a:b",
    "é",
    "日本/x",
    "a\x00b",
)
#: Prefixes ``list`` must reject (``""`` and a trailing ``/`` are fine there).
INVALID_PREFIXES: tuple[str, ...] = ("..", "/abs", "a//b", "a/./b", "a/../b", "é")
#: Unusual keys every backend must store, list and read back unchanged.
ODD_VALID_KEYS: tuple[str, ...] = (
    "a-b_c.d/E.f",
    "...",
    "a..b",
    ".hidden",
    "-dash",
    "_under",
    "trailing.",
    "0",
    "UPPER/lower/MiXeD",
    "x" * 200,
    "/".join(f"d{i}" for i in range(16)) + "/leaf",
)


# --- helpers usable by backend test modules -------------------------------------------


def require_capability(backend: Backend, name: str) -> None:
    """Skip the running test unless ``backend`` declares capability ``name``."""
    if not getattr(backend.capabilities, name):
        pytest.skip(f"{type(backend).__name__} lacks capability {name!r}")


def needs_capability(name: str) -> pytest.MarkDecorator:
    """Mark a conformance test as applying only to backends declaring ``name``."""
    return pytest.mark.needs_capability(name)


def inapplicable_reason(item: pytest.Item) -> str | None:
    """Why the conformance test ``item`` does not apply to its backend, or None."""
    cls = getattr(item, "cls", None)
    if cls is None or not issubclass(cls, BackendConformance):
        return None
    backend_class = cls.backend_class
    for mark in item.iter_markers("needs_capability"):
        name = mark.args[0]
        if cls.capabilities is not None:
            if not getattr(cls.capabilities, name):
                return (f"{cls.__name__}: {getattr(backend_class, '__name__', 'the backend')}"
                        f" lacks capability {name!r} there")
            continue
        if backend_class is None:
            return f"{cls.__name__} names no backend_class to read capability {name!r} from"
        if not getattr(backend_class.capabilities, name):
            return f"{backend_class.__name__} lacks capability {name!r}"
    if item.get_closest_marker("needs_transient_faults") and not cls.transient_faults:
        return f"{cls.__name__}: the backend has no network connection to break"
    if item.get_closest_marker("needs_separate_process") and cls.clients_are_threads:
        return (f"{cls.__name__}: the backend's store lives in the test process, so the "
                "measurement cannot run in a fresh one")
    if item.get_closest_marker("needs_large_objects") and backend_class is not None:
        limit = backend_class.capabilities.max_object_size
        if limit is not None and limit < LARGE_OBJECT_SIZE:
            return f"{backend_class.__name__} max_object_size={limit} < {LARGE_OBJECT_SIZE}"
    return None


def deselect_inapplicable(config: pytest.Config, items: list[pytest.Item]) -> list[str]:
    """Deselect conformance tests that do not apply (call from
    ``pytest_collection_modifyitems``); return one line per deselected test."""
    keep: list[pytest.Item] = []
    dropped: list[pytest.Item] = []
    lines: list[str] = []
    for item in items:
        reason = inapplicable_reason(item)
        if reason is None:
            keep.append(item)
        else:
            dropped.append(item)
            lines.append(f"{item.nodeid}: {reason}")
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep
    return lines


def pattern_block(seed: int, index: int) -> bytes:
    """Block ``index`` (1 MiB) of the deterministic pseudo-random stream ``seed``."""
    return random.Random(f"{seed}:{index}").randbytes(MiB)


def pattern_bytes(seed: int, offset: int, length: int) -> bytes:
    """``length`` bytes at ``offset`` of the stream :func:`pattern_block` defines."""
    out = bytearray()
    while len(out) < length:
        index, within = divmod(offset + len(out), MiB)
        out += pattern_block(seed, index)[within : within + length - len(out)]
    return bytes(out)


class PatternStream(io.RawIOBase):
    """A readable stream of ``size`` generated bytes, held 1 MiB at a time.

    Reads stop at block boundaries, so a backend that assumes ``read(n)`` returns
    ``n`` bytes is caught. ``sha256`` covers everything read so far.
    """

    def __init__(self, size: int, seed: int) -> None:
        super().__init__()
        self.size = size
        self.seed = seed
        self.pos = 0
        self.sha256 = hashlib.sha256()
        self._block_index = -1
        self._block = b""

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        if self.pos >= self.size or not len(view):
            return 0
        index, within = divmod(self.pos, MiB)
        if index != self._block_index:
            self._block_index, self._block = index, pattern_block(self.seed, index)
        n = min(len(view), MiB - within, self.size - self.pos)
        piece = self._block[within : within + n]
        view[:n] = piece
        self.sha256.update(piece)
        self.pos += n
        return n


def versioned_payload(version: int) -> bytes:
    """A self-checking object body for ``version``: 8-byte length, sha256, then data.

    Sizes vary (some above 1 MiB, some tiny) so that a torn or mixed write shows.
    """
    size = (version * 700_001) % (3 * MiB) + 13
    body = random.Random(version).randbytes(size)
    return size.to_bytes(8, "big") + hashlib.sha256(body).digest() + body


def check_versioned_payload(data: bytes) -> None:
    """Assert ``data`` is one complete :func:`versioned_payload`."""
    assert len(data) >= 40, f"object has {len(data)} bytes: torn write"
    size = int.from_bytes(data[:8], "big")
    body = data[40:]
    assert len(body) == size, f"object body has {len(body)} bytes, header says {size}: torn"
    assert hashlib.sha256(body).digest() == data[8:40], "object body does not match its hash"


def append_message(worker: int, index: int) -> bytes:
    """The message appender ``worker`` writes as its ``index``-th entry."""
    head = f"worker={worker} index={index};".encode()
    return head + hashlib.sha256(head).hexdigest().encode() * 8


# --- child processes ---------------------------------------------------------------------


def _child_main(
    target: Callable[..., Any], barrier: Barrier, conn: Conn, args: tuple[Any, ...]
) -> None:
    """Run ``target(barrier, *args)`` and send ``("ok", result)`` or ``("error", text)``."""
    try:
        result = target(barrier, *args)
    except BaseException:
        barrier.abort()  # siblings waiting for us fail fast instead of hanging
        conn.send(("error", traceback.format_exc()))
    else:
        conn.send(("ok", result))
    finally:
        conn.close()


def _outcomes(results: dict[int, tuple[str, Any]], count: int, what: str) -> list[Any]:
    """The ``count`` clients' return values in order, from their ``(status, value)``
    reports; AssertionError with every failed client's traceback if any failed."""
    errors = [text for status, text in results.values() if status != "ok"]
    if errors:
        raise AssertionError(f"{what} failed:\n" + "\n".join(errors))
    return [results[i][1] for i in range(count)]


class ChildProcesses:
    """Spawned processes each running ``target(barrier, *args)`` from ``arg_list``.

    ``target`` must be a module-level function (spawned children import it by
    name) and should call ``barrier.wait(...)`` right before its contended part.
    With ``parent_in_barrier`` the parent is one more party and calls
    ``self.barrier.wait()`` itself.
    """

    def __init__(
        self,
        target: Callable[..., Any],
        arg_list: Sequence[tuple[Any, ...]],
        *,
        parent_in_barrier: bool = False,
    ) -> None:
        # spawn: a clean interpreter, as a separate client would be (fork would
        # share the parent's open connections and memory history).
        ctx = multiprocessing.get_context("spawn")
        self.barrier = ctx.Barrier(len(arg_list) + int(parent_in_barrier))
        self._conns: list[Conn] = []
        self._procs: list[Any] = []
        self._results: dict[int, tuple[str, Any]] = {}
        for args in arg_list:
            receiver, sender = ctx.Pipe(duplex=False)
            proc = ctx.Process(
                target=_child_main, args=(target, self.barrier, sender, args), daemon=True
            )
            proc.start()
            sender.close()  # so that a crashed child shows as EOF on receiver
            self._conns.append(receiver)
            self._procs.append(proc)

    def __enter__(self) -> ChildProcesses:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _collect(self, timeout: float | None) -> None:
        pending = [c for i, c in enumerate(self._conns) if i not in self._results]
        for ready in wait(pending, timeout):
            index = next(i for i, c in enumerate(self._conns) if c is ready)
            try:
                self._results[index] = self._conns[index].recv()
            except EOFError:
                self._procs[index].join()
                self._results[index] = (
                    "error",
                    f"child exited with code {self._procs[index].exitcode} without a result",
                )

    def done(self) -> bool:
        """True once every child has reported (never blocks)."""
        self._collect(0)
        return len(self._results) == len(self._conns)

    def results(self, timeout: float = CHILD_TIMEOUT) -> list[Any]:
        """Each child's return value, in ``arg_list`` order; AssertionError if any failed."""
        deadline = time.monotonic() + timeout
        try:
            while len(self._results) < len(self._conns):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise AssertionError(f"child processes did not finish within {timeout}s")
                self._collect(remaining)
        finally:
            self.close()
        return _outcomes(self._results, len(self._conns), "child process")

    def close(self) -> None:
        """Reap the children (killing any still running)."""
        for proc in self._procs:
            # Children that reported are finishing; any other one is stuck or abandoned.
            proc.join(timeout=CHILD_TIMEOUT if len(self._results) == len(self._conns) else 0)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self._conns:
            conn.close()


class ChildThreads:
    """:class:`ChildProcesses` for a backend whose store lives in this process: each
    ``target(barrier, *args)`` of ``arg_list`` runs in a thread of its own (the same
    interface, the same barrier protocol)."""

    def __init__(
        self,
        target: Callable[..., Any],
        arg_list: Sequence[tuple[Any, ...]],
        *,
        parent_in_barrier: bool = False,
    ) -> None:
        self.barrier = threading.Barrier(len(arg_list) + int(parent_in_barrier))
        self._results: dict[int, tuple[str, Any]] = {}
        self._lock = threading.Lock()
        self._threads = [
            # Daemon threads: one stuck on a broken backend must not keep pytest alive.
            threading.Thread(target=self._run, args=(index, target, args), daemon=True)
            for index, args in enumerate(arg_list)
        ]
        for thread in self._threads:
            thread.start()

    def _run(self, index: int, target: Callable[..., Any], args: tuple[Any, ...]) -> None:
        try:
            outcome: tuple[str, Any] = ("ok", target(self.barrier, *args))
        except BaseException:
            self.barrier.abort()  # siblings waiting for us fail fast instead of hanging
            outcome = ("error", traceback.format_exc())
        with self._lock:
            self._results[index] = outcome

    def __enter__(self) -> ChildThreads:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def done(self) -> bool:
        """True once every thread has reported (never blocks)."""
        return not any(thread.is_alive() for thread in self._threads)

    def results(self, timeout: float = CHILD_TIMEOUT) -> list[Any]:
        """Each thread's return value, in ``arg_list`` order; AssertionError if any
        failed or did not finish within ``timeout``."""
        deadline = time.monotonic() + timeout
        try:
            for thread in self._threads:
                thread.join(max(0.0, deadline - time.monotonic()))
            if not self.done():
                raise AssertionError(f"client threads did not finish within {timeout}s")
        finally:
            self.close()
        return _outcomes(self._results, len(self._threads), "client thread")

    def close(self) -> None:
        """Break the barrier for threads still waiting on it (a test that failed
        before releasing them), so that they end instead of waiting forever."""
        if not self.done():
            self.barrier.abort()


def _barrier_wait(barrier: Barrier) -> None:
    barrier.wait(timeout=CHILD_TIMEOUT)


def _append_worker(
    barrier: Barrier, location: Location, log: str, worker: int, count: int
) -> list[int]:
    backend = open_backend(*location)
    try:
        _barrier_wait(barrier)
        return [backend.logs.append(log, append_message(worker, i)) for i in range(count)]
    finally:
        backend.close()


def _put_if_absent_worker(barrier: Barrier, location: Location, key: str, worker: int) -> bool:
    backend = open_backend(*location)
    try:
        _barrier_wait(barrier)
        return backend.put_if_absent(key, f"winner={worker}".encode())
    finally:
        backend.close()


def _append_at_worker(barrier: Barrier, location: Location, log: str, worker: int) -> bool:
    backend = open_backend(*location)
    try:
        _barrier_wait(barrier)
        return backend.logs.append_at(log, 1, f"racer={worker}".encode())
    finally:
        backend.close()


def overwrite_worker(barrier: Barrier, location: Location, key: str, versions: int) -> int:
    """Child: overwrite ``key`` with :func:`versioned_payload` 1..``versions``.

    Odd versions are streamed from a file-like, even ones passed as bytes.
    """
    backend = open_backend(*location)
    try:
        _barrier_wait(barrier)
        for version in range(1, versions + 1):
            payload = versioned_payload(version)
            backend.put(key, io.BytesIO(payload) if version % 2 else payload)
        return versions
    finally:
        backend.close()


def _max_rss_bytes() -> int:
    return peak_rss_bytes()


def _large_object_worker(
    barrier: Barrier, location: Location, key: str, size: int, seed: int
) -> dict[str, Any]:
    backend = open_backend(*location)
    try:
        _barrier_wait(barrier)
        stream = PatternStream(size, seed)
        # Warm up everything the measured part uses, so the baseline includes it.
        pattern_block(seed, 0)
        hashlib.sha256(b"")
        before = _max_rss_bytes()
        backend.put(key, cast(BinaryIO, stream))
        read_hash = hashlib.sha256()
        read_size = 0
        with backend.open(key) as f:
            while True:
                piece = f.read(MiB)
                if not piece:
                    break
                read_hash.update(piece)
                read_size += len(piece)
        return {
            "consumed": stream.pos,
            "written_sha256": stream.sha256.hexdigest(),
            "read_sha256": read_hash.hexdigest(),
            "read_size": read_size,
            "rss_growth": _max_rss_bytes() - before,
        }
    finally:
        backend.close()


class KillingStream(PatternStream):
    """A seekable :class:`PatternStream` that ends its own process like ``kill -9``
    once ``kill_at`` bytes were read: a writer killed mid-upload, at a point that
    does not depend on timing."""

    def __init__(self, size: int, seed: int, kill_at: int) -> None:
        super().__init__(size, seed)
        self.kill_at = kill_at

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.size}[whence]
        self.pos = base + offset
        self.sha256 = hashlib.sha256()
        return self.pos

    def readinto(self, buffer: Any) -> int:
        if self.pos >= self.kill_at:
            kill_self()
        return super().readinto(buffer)


def _killed_put_worker(location: Location, key: str, size: int, kill_at: int,
                       kill_before: str | None) -> None:
    """Put ``size`` bytes at ``key`` and die (SIGKILL) once ``kill_at`` were read, or
    with ``kill_before`` on entering that method of the backend (all bytes sent)."""
    backend = open_backend(*location)
    if kill_before is not None:
        def die(*_: object, **__: object) -> None:
            kill_self()

        setattr(type(backend), kill_before, die)
        kill_at = size + 1
    backend.put(key, cast(BinaryIO, io.BufferedReader(KillingStream(size, 9, kill_at), MiB)))


# --- the suite ---------------------------------------------------------------------------


class BackendConformance:
    """Tests every :class:`Backend` must pass. Subclass it as ``Test<Name>``."""

    #: The backend under test; its ``capabilities`` select the capability tests.
    backend_class: type[Backend] | None = None
    #: What the backend declares at this class's location, where that differs from
    #: ``backend_class.capabilities`` (a ``dir:`` folder on exFAT: no exclusive create,
    #: case-insensitive); it then selects the capability tests. A test module should
    #: check that an instance there declares exactly this.
    capabilities: Capabilities | None = None
    #: The backend talks over a network connection that ``faulty_location`` can break.
    transient_faults: bool = True
    #: New connections reset as they open, after each operation's open ones, in the
    #: transient-errors test. A backend that paces its own reconnects (rclone's sftp)
    #: may lower it: its backoff doubles with each failed connect.
    failed_reconnects: int = 2
    #: Appends by each of the 6 processes in the concurrent-append test. A backend
    #: whose appends cost many requests (Disk Paxos logs) may lower it; the test
    #: still runs 6 processes contending for every position.
    appends_per_worker: int = 25
    #: Keys of the listing test: beyond every service's page size (1,000 for S3). A
    #: backend with no pages (a folder on a slow FUSE filesystem) may lower it.
    many_keys: int = 1537
    #: The backend's store lives in this process (``memory:``), out of reach of other
    #: processes: the multi-client tests run their clients as threads.
    clients_are_threads: bool = False
    #: Where a put is killed in the temporary-file test: None, mid-upload; else the
    #: name of the backend method that publishes a completed upload, for a service
    #: that discards a partial upload (rclone's ``_move``): the put dies on entering it.
    kill_put_before: str | None = None

    def clients(
        self,
        target: Callable[..., Any],
        arg_list: Sequence[tuple[Any, ...]],
        *,
        parent_in_barrier: bool = False,
    ) -> ChildProcesses | ChildThreads:
        """Concurrent clients each running ``target(barrier, *args)``: spawned
        processes (:class:`ChildProcesses`), or threads where ``clients_are_threads``."""
        kind = ChildThreads if self.clients_are_threads else ChildProcesses
        return kind(target, arg_list, parent_in_barrier=parent_in_barrier)

    @pytest.fixture
    def unicode_location(self) -> Location:
        """A fresh namespace at a location whose path has spaces and non-ASCII."""
        pytest.fail(f"{type(self).__name__} provides no unicode_location fixture")

    @pytest.fixture
    def faulty_location(self) -> tuple[str, str, Any]:
        """``(uri, namespace, FaultProxy)`` of a fresh namespace behind a fault proxy."""
        pytest.fail(f"{type(self).__name__} provides no faulty_location fixture")

    @pytest.fixture
    def backend_location(self) -> Location:
        """``(uri, namespace)`` of a fresh namespace; subclasses provide it."""
        pytest.skip("the backend test module provides no backend_location fixture")

    @pytest.fixture
    def backend(self, backend_location: Location) -> Iterator[Backend]:
        """A fresh, created, empty backend."""
        backend = open_backend(*backend_location)
        backend.create()
        yield backend
        backend.close()

    @pytest.fixture
    def backend_factory(self, backend_location: Location) -> Iterator[Callable[[], Backend]]:
        """Open further clients of the same namespace."""
        opened: list[Backend] = []

        def factory() -> Backend:
            other = open_backend(*backend_location)
            opened.append(other)
            return other

        yield factory
        for other in opened:
            other.close()

    # --- lifecycle ---------------------------------------------------------------------
    def test_fresh_backend_exists_and_is_empty(self, backend: Backend) -> None:
        """After create(), exists() is true and the namespace holds no keys."""
        assert backend.exists()
        assert list(backend.list()) == []
        assert list(backend.list("")) == []

    def test_create_is_idempotent(self, backend: Backend) -> None:
        """create() on an existing namespace succeeds and keeps its data."""
        backend.put("k", b"v")
        backend.create()
        assert backend.get("k") == b"v"

    def test_uncreated_namespace_does_not_exist(self, backend_location: Location) -> None:
        """Opening a namespace touches nothing: exists() is false until create()."""
        uri, namespace = backend_location
        other = open_backend(uri, namespace + "-never-created")
        try:
            assert not other.exists()
        finally:
            other.close()

    def test_namespaces_are_isolated(self, backend: Backend, backend_location: Location) -> None:
        """Keys of one namespace are invisible in another at the same location."""
        uri, namespace = backend_location
        other = open_backend(uri, namespace + "-other")
        try:
            other.create()
            other.put("only-there", b"x")
            backend.put("only-here", b"y")
            assert list(backend.list()) == ["only-here"]
            assert list(other.list()) == ["only-there"]
            with pytest.raises(ObjectNotFound):
                backend.get("only-there")
        finally:
            other.close()

    # --- put / get -----------------------------------------------------------------------
    def test_put_get_round_trip(self, backend: Backend) -> None:
        """get returns exactly the bytes put, including every byte value and b''."""
        data = bytes(range(256)) * 17
        backend.put("blob", data)
        backend.put("empty", b"")
        assert backend.get("blob") == data
        assert backend.get("empty") == b""
        assert backend.size("blob") == len(data)
        assert backend.size("empty") == 0

    def test_put_from_file_like(self, backend: Backend) -> None:
        """put accepts a binary file-like and stores all of it (more than one chunk)."""
        data = pattern_bytes(7, 0, 3 * MiB + 5)
        backend.put("streamed", io.BytesIO(data))
        assert backend.size("streamed") == len(data)
        assert backend.get("streamed") == data

    def test_put_from_short_reading_stream(self, backend: Backend) -> None:
        """put keeps reading until EOF even when read(n) returns fewer than n bytes."""
        stream = PatternStream(2 * MiB + 123, seed=3)
        backend.put("short-reads", cast(BinaryIO, stream))
        assert backend.get("short-reads") == pattern_bytes(3, 0, 2 * MiB + 123)

    def test_overwrite_replaces(self, backend: Backend) -> None:
        """A second put replaces the whole object, longer or shorter (no stale tail)."""
        backend.put("k", b"first")
        backend.put("k", b"second, longer value")
        assert backend.get("k") == b"second, longer value"
        backend.put("k", b"3")
        assert backend.get("k") == b"3"
        assert backend.size("k") == 1
        assert list(backend.list()) == ["k"]

    def test_nested_keys(self, backend: Backend) -> None:
        """Keys with several parts are stored and read back independently."""
        backend.put("a/b/c", b"abc")
        backend.put("a/b/d", b"abd")
        backend.put("a/e", b"ae")
        assert backend.get("a/b/c") == b"abc"
        assert backend.get("a/b/d") == b"abd"
        assert backend.get("a/e") == b"ae"

    def test_open_streams_the_object(self, backend: Backend) -> None:
        """open returns a readable stream of the whole object, readable in pieces."""
        data = pattern_bytes(11, 0, 2 * MiB + 7)
        backend.put("k", data)
        pieces = []
        with backend.open("k") as f:
            while True:
                piece = f.read(100_000)
                if not piece:
                    break
                pieces.append(piece)
        assert b"".join(pieces) == data

    # --- missing keys --------------------------------------------------------------------
    def test_missing_key_raises_object_not_found(self, backend: Backend) -> None:
        """get, open, size, get_range and delete of a missing key raise ObjectNotFound."""
        backend.put("present", b"x")
        for key in ("missing", "nested/missing", "present/below-an-object"):
            with pytest.raises(ObjectNotFound):
                backend.get(key)
            with pytest.raises(ObjectNotFound):
                backend.open(key).close()
            with pytest.raises(ObjectNotFound):
                backend.size(key)
            with pytest.raises(ObjectNotFound):
                backend.get_range(key, 0, 0)
            with pytest.raises(ObjectNotFound):
                backend.delete(key)
            assert backend.poll(key) is None

    def test_delete_removes(self, backend: Backend) -> None:
        """After delete the key is gone from get and list; a second delete raises."""
        backend.put("d/k", b"x")
        backend.put("d/keep", b"y")
        backend.delete("d/k")
        with pytest.raises(ObjectNotFound):
            backend.get("d/k")
        assert list(backend.list()) == ["d/keep"]
        with pytest.raises(ObjectNotFound):
            backend.delete("d/k")

    def test_deleted_key_can_be_written_again(self, backend: Backend) -> None:
        """A deleted key can be put again."""
        backend.put("k", b"one")
        backend.delete("k")
        backend.put("k", b"two")
        assert backend.get("k") == b"two"

    # --- ranges --------------------------------------------------------------------------
    def test_get_range_bounds(self, backend: Backend) -> None:
        """get_range returns exactly [offset, offset+length), including empty ranges."""
        data = bytes(range(256)) * 4  # 1024 bytes
        backend.put("r", data)
        assert backend.get_range("r", 0, 0) == b""
        assert backend.get_range("r", 0, 1024) == data
        assert backend.get_range("r", 10, 20) == data[10:30]
        assert backend.get_range("r", 1023, 1) == data[1023:]
        assert backend.get_range("r", 1024, 0) == b""
        assert backend.get_range("r", 1000, 24) == data[1000:]

    def test_get_range_past_end_raises_backend_error(self, backend: Backend) -> None:
        """A range beyond the object's end is a truncated copy: BackendError, not a
        short read and not ObjectNotFound."""
        backend.put("r", b"0123456789")
        for offset, length in ((5, 6), (0, 11), (10, 1), (11, 0), (100, 5)):
            with pytest.raises(BackendError) as info:
                backend.get_range("r", offset, length)
            assert not isinstance(info.value, ObjectNotFound), (offset, length)

    # --- listing -------------------------------------------------------------------------
    def test_list_prefixes(self, backend: Backend) -> None:
        """list(prefix) yields every key below the folder ``prefix``, recursively, and
        nothing else: not keys merely starting with the same letters."""
        keys = {"a/1", "a/2", "a/b/3", "a/b/c/4", "ab/5", "c", "d/6"}
        for key in keys:
            backend.put(key, key.encode())
        assert sorted(backend.list()) == sorted(keys)
        assert sorted(backend.list("")) == sorted(keys)
        assert sorted(backend.list("a")) == ["a/1", "a/2", "a/b/3", "a/b/c/4"]
        assert sorted(backend.list("a/")) == ["a/1", "a/2", "a/b/3", "a/b/c/4"]
        assert sorted(backend.list("a/b")) == ["a/b/3", "a/b/c/4"]
        assert sorted(backend.list("ab")) == ["ab/5"]
        assert list(backend.list("zz")) == []
        assert list(backend.list("a/zz")) == []
        assert list(backend.list("c")) == []  # an object, not a folder

    def test_list_sizes(self, backend: Backend) -> None:
        """list_sizes(prefix) yields exactly the keys of list(prefix), each with the
        size of its object (as size() gives it)."""
        objects = {"s/a": b"", "s/b": b"x" * 1000, "s/c/d": b"y" * 70_001, "t": b"zz"}
        for key, data in objects.items():
            backend.put(key, data)
        assert dict(backend.list_sizes("s")) == {k: len(v) for k, v in objects.items() if k != "t"}
        assert dict(backend.list_sizes()) == {k: len(v) for k, v in objects.items()}
        assert list(backend.list_sizes("nothing")) == []

    def test_list_many_keys(self, backend: Backend) -> None:
        """Listing is complete beyond any page size: ``many_keys`` (1,537) keys, each
        exactly once."""
        keys = {f"many/{i:05d}" for i in range(self.many_keys)}
        # Written by 8 threads at once (backends are used so by the object store).
        with ThreadPoolExecutor(8) as pool:
            for future in [pool.submit(backend.put, key, b"") for key in keys]:
                future.result()
        backend.put("other/x", b"")
        listed = list(backend.list("many"))
        assert len(listed) == len(keys)
        assert set(listed) == keys
        assert len(list(backend.list())) == len(keys) + 1

    # --- keys ----------------------------------------------------------------------------
    def test_invalid_keys_rejected(self, backend: Backend) -> None:
        """Every operation rejects an unsafe key ('..', absolute, empty part, '.', non-
        ASCII...) with InvalidKey before touching the service."""
        operations: dict[str, Callable[[str], object]] = {
            "put": lambda k: backend.put(k, b"x"),
            "put stream": lambda k: backend.put(k, io.BytesIO(b"x")),
            "put_if_absent": lambda k: backend.put_if_absent(k, b"x"),
            "get": backend.get,
            "open": backend.open,
            "get_range": lambda k: backend.get_range(k, 0, 0),
            "size": backend.size,
            "delete": backend.delete,
            "poll": backend.poll,
            "append": lambda k: backend.logs.append(k, b"x"),
            "fetch": backend.logs.fetch,
        }
        for key in INVALID_KEYS:
            for name, operation in operations.items():
                try:
                    operation(key)
                except InvalidKey:
                    continue
                except Exception as exc:
                    pytest.fail(f"{name}({key!r}) raised {exc!r} instead of InvalidKey")
                pytest.fail(f"{name}({key!r}) was accepted")
        for prefix in INVALID_PREFIXES:
            with pytest.raises(InvalidKey):
                list(backend.list(prefix))
        assert list(backend.list()) == []

    def test_odd_but_valid_keys(self, backend: Backend) -> None:
        """Keys using only the allowed characters in unusual ways round-trip exactly."""
        for key in ODD_VALID_KEYS:
            backend.put(key, key.encode())
        assert sorted(backend.list()) == sorted(ODD_VALID_KEYS)
        for key in ODD_VALID_KEYS:
            assert backend.get(key) == key.encode()

    @needs_capability("case_sensitive")
    def test_case_sensitive_keys(self, backend: Backend) -> None:
        """With ``case_sensitive``, keys differing only in case are distinct objects."""
        require_capability(backend, "case_sensitive")
        backend.put("Case", b"upper")
        backend.put("case", b"lower")
        assert backend.get("Case") == b"upper"
        assert backend.get("case") == b"lower"
        assert sorted(backend.list()) == ["Case", "case"]

    # --- put_if_absent -------------------------------------------------------------------
    def test_put_if_absent(self, backend: Backend) -> None:
        """put_if_absent creates a missing key (True) and leaves an existing one
        untouched (False); after delete it creates again."""
        assert backend.put_if_absent("p/k", b"first") is True
        assert backend.put_if_absent("p/k", b"second") is False
        assert backend.get("p/k") == b"first"
        backend.put("p/k", b"overwritten")
        assert backend.put_if_absent("p/k", b"third") is False
        assert backend.get("p/k") == b"overwritten"
        backend.delete("p/k")
        assert backend.put_if_absent("p/k", b"fourth") is True
        assert backend.get("p/k") == b"fourth"
        assert backend.put_if_absent("p/empty", b"") is True
        assert backend.get("p/empty") == b""

    @needs_capability("conditional_create")
    def test_put_if_absent_race_has_one_winner(
        self, backend: Backend, backend_location: Location
    ) -> None:
        """With ``conditional_create``, of 6 processes racing to create one key exactly
        one succeeds and the object holds the winner's data."""
        require_capability(backend, "conditional_create")
        workers = 6
        children = self.clients(
            _put_if_absent_worker, [(backend_location, "race", w) for w in range(workers)]
        )
        won = children.results()
        assert won.count(True) == 1, won
        assert backend.get("race") == f"winner={won.index(True)}".encode()

    # --- poll ----------------------------------------------------------------------------
    def test_poll(self, backend: Backend) -> None:
        """poll is None for a missing key, stable while the object is unchanged, changes
        on every overwrite (even with same-size data), and is None after delete."""
        assert backend.poll("k") is None
        backend.put("k", b"aaaa")
        first = backend.poll("k")
        assert isinstance(first, str)
        assert backend.poll("k") == first
        backend.put("k", b"bbbb")
        second = backend.poll("k")
        assert second is not None and second != first
        backend.put("k", b"cccc")
        third = backend.poll("k")
        assert third is not None and third not in (first, second)
        backend.delete("k")
        assert backend.poll("k") is None

    def test_poll_sees_other_clients_writes(
        self, backend: Backend, backend_factory: Callable[[], Backend]
    ) -> None:
        """A second client's poll token changes when the first client overwrites."""
        other = backend_factory()
        backend.put("k", b"one")
        before = other.poll("k")
        assert before is not None
        backend.put("k", b"two")
        after = other.poll("k")
        assert after is not None and after != before

    # --- append / fetch ------------------------------------------------------------------
    def test_logs_are_one_component_per_backend(
        self, backend: Backend, backend_factory: Callable[[], Backend]
    ) -> None:
        """backend.logs is a LogStore, the same object on every use (decided entries it
        caches stay with it), and another client has its own."""
        logs = backend.logs
        assert isinstance(logs, LogStore)
        assert backend.logs is logs
        other = backend_factory()
        assert isinstance(other.logs, LogStore) and other.logs is not logs

    def test_append_fetch_order(self, backend: Backend) -> None:
        """append returns positions 0, 1, 2, ...; fetch returns (position, message) in
        that order, messages byte-exact (including b'' and every byte value)."""
        messages = [b"zero", b"", bytes(range(256)), b"three" * 1000]
        positions = [backend.logs.append("log", m) for m in messages]
        assert positions == [0, 1, 2, 3]
        assert backend.logs.fetch("log") == list(enumerate(messages))

    def test_fetch_start(self, backend: Backend) -> None:
        """fetch(start) returns exactly the entries at positions >= start."""
        for i in range(5):
            backend.logs.append("log", f"m{i}".encode())
        assert backend.logs.fetch("log", 0) == [(i, f"m{i}".encode()) for i in range(5)]
        assert backend.logs.fetch("log", 3) == [(3, b"m3"), (4, b"m4")]
        assert backend.logs.fetch("log", 4) == [(4, b"m4")]
        assert backend.logs.fetch("log", 5) == []
        assert backend.logs.fetch("log", 100) == []

    def test_fetch_missing_log_is_empty(self, backend: Backend) -> None:
        """fetch of a log never appended to is [], not an error."""
        assert backend.logs.fetch("never") == []
        assert backend.logs.fetch("nested/never", 3) == []

    def test_logs_are_independent(self, backend: Backend) -> None:
        """Each log has its own positions starting at 0."""
        assert backend.logs.append("logs/one", b"a") == 0
        assert backend.logs.append("logs/two", b"b") == 0
        assert backend.logs.append("logs/one", b"c") == 1
        assert backend.logs.fetch("logs/one") == [(0, b"a"), (1, b"c")]
        assert backend.logs.fetch("logs/two") == [(0, b"b")]

    @needs_capability("log_deletion")
    def test_delete_log_removes_only_that_log(
        self, backend: Backend, backend_factory: Callable[[], Backend]
    ) -> None:
        """delete_log removes every entry of one log (another client then fetches []
        and can write position 0 again), leaves other logs and objects alone, and
        removes nothing for a missing log."""
        require_capability(backend, "log_deletion")
        for i in range(3):
            backend.logs.append("log/000000000001", f"m{i}".encode())
        backend.logs.append("log/000000000002", b"kept")
        backend.put("log-neighbour", b"object")
        assert backend.logs.fetch("log/000000000001") != []  # and it may now be cached
        assert backend.logs.delete_log("log/000000000001") >= 3
        other = backend_factory()
        assert backend.logs.fetch("log/000000000001") == other.logs.fetch("log/000000000001") == []
        assert backend.logs.fetch("log/000000000002") == [(0, b"kept")]
        assert backend.get("log-neighbour") == b"object"
        assert backend.logs.delete_log("log/000000000001") == 0
        assert backend.logs.delete_log("log/000000000099") == 0
        assert backend.logs.append("log/000000000001", b"again") == 0
        assert other.logs.fetch("log/000000000001") == [(0, b"again")]

    def test_appends_of_two_clients_share_one_order(
        self, backend: Backend, backend_factory: Callable[[], Backend]
    ) -> None:
        """Appends by two clients interleave into one log both fetch identically."""
        other = backend_factory()
        assert backend.logs.append("log", b"a") == 0
        assert other.logs.append("log", b"b") == 1
        assert backend.logs.append("log", b"c") == 2
        assert backend.logs.fetch("log") == other.logs.fetch("log") == [(0, b"a"), (1, b"b"), (2, b"c")]

    @needs_capability("conditional_append")
    def test_append_at_writes_only_at_the_end(self, backend: Backend) -> None:
        """append_at succeeds exactly when the log has ``position`` entries: at the
        end it writes; at a taken position or past the end it writes nothing."""
        require_capability(backend, "conditional_append")
        assert backend.logs.append_at("log", 0, b"a") is True
        assert backend.logs.append_at("log", 0, b"x") is False  # taken
        assert backend.logs.append_at("log", 2, b"x") is False  # past the end
        assert backend.logs.append("log", b"b") == 1  # plain appends share the positions
        assert backend.logs.append_at("log", 1, b"x") is False
        assert backend.logs.append_at("log", 2, b"c") is True
        assert backend.logs.fetch("log") == [(0, b"a"), (1, b"b"), (2, b"c")]
        assert backend.logs.append_at("other", 0, b"") is True
        assert backend.logs.fetch("other") == [(0, b"")]

    @needs_capability("conditional_append")
    def test_append_at_race_has_one_winner(
        self, backend: Backend, backend_location: Location
    ) -> None:
        """6 processes append_at the same position at once: exactly one succeeds and
        the log then holds that one's message there, once."""
        require_capability(backend, "conditional_append")
        backend.logs.append("race", b"first")
        children = self.clients(
            _append_at_worker, [(backend_location, "race", w) for w in range(6)]
        )
        results = children.results()
        assert sorted(results) == [False] * 5 + [True], results
        entries = backend.logs.fetch("race")
        assert [p for p, _ in entries] == [0, 1]
        assert entries[1][1] == f"racer={results.index(True)}".encode()

    def test_concurrent_appends_from_processes(
        self, backend: Backend, backend_location: Location, backend_factory: Callable[[], Backend]
    ) -> None:
        """6 processes x ``appends_per_worker`` (25) appends at once: no entry lost, duplicated or torn; positions
        are 0..N-1, each append returned its entry's position, each process's entries
        keep its order, and two clients fetch the same sequence. A reader fetching
        meanwhile only ever sees complete entries at contiguous positions 0..k-1, and
        each fetch extends the previous one (entries never change or move)."""
        workers, count = 6, self.appends_per_worker
        expected_set = {append_message(w, i) for w in range(workers) for i in range(count)}
        with self.clients(
            _append_worker,
            [(backend_location, "sync/log", w, count) for w in range(workers)],
            parent_in_barrier=True,
        ) as children:
            children.barrier.wait(timeout=CHILD_TIMEOUT)
            seen: list[tuple[int, bytes]] = []
            while not children.done():
                now = backend.logs.fetch("sync/log")
                assert [p for p, _ in now] == list(range(len(now))), "gap in positions"
                assert all(m in expected_set for _, m in now), "torn or foreign entry"
                assert now[: len(seen)] == seen, "an entry changed or moved"
                seen = now
            returned = children.results()
        total = workers * count
        entries = backend.logs.fetch("sync/log")
        assert [position for position, _ in entries] == list(range(total))
        messages = [message for _, message in entries]
        expected = sorted(expected_set)
        assert sorted(messages) == expected, "entries lost, duplicated or torn"
        all_positions = [p for positions in returned for p in positions]
        assert sorted(all_positions) == list(range(total))
        for worker, positions in enumerate(returned):
            assert positions == sorted(positions), f"worker {worker} saw its order change"
            for index, position in enumerate(positions):
                assert messages[position] == append_message(worker, index)
        assert backend_factory().logs.fetch("sync/log") == entries

    # --- atomicity -----------------------------------------------------------------------
    def test_put_is_atomic_for_readers(self, backend: Backend, backend_location: Location) -> None:
        """While another process overwrites a key repeatedly, every get returns one
        complete version (never a mix or a prefix) and the key never disappears --
        except, where the backend declares no ``atomic_replace``, for a moment."""
        backend.put("atomic", versioned_payload(0))
        vanishes = not backend.capabilities.atomic_replace
        with self.clients(
            overwrite_worker, [(backend_location, "atomic", 30)], parent_in_barrier=True
        ) as children:
            children.barrier.wait(timeout=CHILD_TIMEOUT)
            while not children.done():
                try:
                    check_versioned_payload(backend.get("atomic"))
                except ObjectNotFound:
                    if not vanishes:
                        raise
            assert children.results() == [30]
        assert backend.get("atomic") == versioned_payload(30)

    # --- large objects -------------------------------------------------------------------
    @pytest.mark.slow
    @pytest.mark.needs_large_objects
    @pytest.mark.needs_separate_process
    def test_large_object_streams_in_flat_memory(
        self, backend: Backend, backend_location: Location
    ) -> None:
        """A 100 MB object put from a generated stream and read back via open() in 1 MiB
        pieces is byte-exact, and the client's peak memory grows by under 64 MB
        (measured in a fresh spawned process)."""
        size, seed = LARGE_OBJECT_SIZE, 42
        limit = backend.capabilities.max_object_size
        if limit is not None and limit < size:
            pytest.skip(f"capability max_object_size={limit} is below {size} bytes")
        children = ChildProcesses(_large_object_worker, [(backend_location, "big/obj", size, seed)])
        (report,) = children.results()
        try:
            assert report["consumed"] == size
            assert report["read_size"] == size
            assert report["read_sha256"] == report["written_sha256"]
            assert report["rss_growth"] < 64 * MiB, f"peak RSS grew by {report['rss_growth']} bytes"
            assert backend.size("big/obj") == size
            for offset, length in (
                (0, 100),
                (MiB - 50, 100),
                (57 * MiB + 3, 4096),
                (size - 10, 10),
            ):
                assert backend.get_range("big/obj", offset, length) == pattern_bytes(
                    seed, offset, length
                )
            with pytest.raises(BackendError):
                backend.get_range("big/obj", size - 10, 11)
        finally:
            backend.delete("big/obj")  # do not leave 100 MB behind

    # --- compare-and-swap ----------------------------------------------------------------
    @needs_capability("compare_and_swap")
    def test_replace_if(self, backend: Backend, backend_factory: Callable[[], Backend]) -> None:
        """replace_if writes only while the poll token is unchanged: a second client
        holding the old token loses, and a deleted key is not recreated."""
        require_capability(backend, "compare_and_swap")
        backend.put("cas", b"v1")
        token = backend.poll("cas")
        assert token is not None
        other = backend_factory()
        assert other.replace_if("cas", b"v2", token) is True
        assert backend.get("cas") == b"v2"
        assert backend.replace_if("cas", b"stale", token) is False
        assert backend.get("cas") == b"v2"
        fresh = backend.poll("cas")
        assert fresh is not None and fresh != token
        assert backend.replace_if("cas", b"v3", fresh) is True
        assert backend.get("cas") == b"v3"
        final = backend.poll("cas")
        assert final is not None
        backend.delete("cas")
        assert backend.replace_if("cas", b"v4", final) is False
        with pytest.raises(ObjectNotFound):
            backend.get("cas")

    # --- locations -----------------------------------------------------------------------
    def test_unicode_location(self, unicode_location: Location) -> None:
        """A location path with spaces and non-ASCII characters works for every kind of
        operation, and a second client opened from the same URI sees the same data."""
        backend = open_backend(*unicode_location)
        other = open_backend(*unicode_location)
        try:
            assert not backend.exists()
            backend.create()
            assert backend.exists() and other.exists()
            backend.put("a/b", b"data")
            backend.put("a/c", io.BytesIO(b"streamed"))
            assert other.get("a/b") == b"data"
            assert sorted(other.list("a")) == ["a/b", "a/c"]
            assert backend.logs.append("log/x", b"m0") == 0
            assert other.logs.append("log/x", b"m1") == 1
            assert backend.logs.fetch("log/x") == [(0, b"m0"), (1, b"m1")]
            other.delete("a/c")
            assert sorted(backend.list("a")) == ["a/b"]
        finally:
            backend.close()
            other.close()

    # --- transient failures --------------------------------------------------------------
    @pytest.mark.needs_transient_faults
    def test_transient_errors_are_retried(self, faulty_location: tuple[str, str, Any]) -> None:
        """With every open connection reset and the next two (``failed_reconnects``)
        new connections reset as soon as they open, each operation still succeeds
        (the backend reconnects and retries with backoff) and returns exactly the
        right result."""
        uri, namespace, proxy = faulty_location
        backend = open_backend(uri, namespace)
        try:
            backend.create()
            payload = pattern_bytes(5, 0, 2 * MiB + 1)
            backend.put("k", b"first")
            operations: list[tuple[str, Callable[[], object], object]] = [
                ("put", lambda: backend.put("big", io.BytesIO(payload)), None),
                ("get", lambda: backend.get("big") == payload, True),
                ("size", lambda: backend.size("big"), len(payload)),
                ("get_range", lambda: backend.get_range("big", MiB, 10), payload[MiB : MiB + 10]),
                ("list", lambda: sorted(backend.list()), ["big", "k"]),
                ("put_if_absent new", lambda: backend.put_if_absent("p", b"x"), True),
                ("put_if_absent taken", lambda: backend.put_if_absent("k", b"x"), False),
                ("append", lambda: backend.logs.append("log", b"e0"), 0),
                ("append again", lambda: backend.logs.append("log", b"e1"), 1),
                ("fetch", lambda: backend.logs.fetch("log"), [(0, b"e0"), (1, b"e1")]),
                ("poll", lambda: backend.poll("k") is not None, True),
                ("delete", lambda: backend.delete("p"), None),
            ]
            before = proxy.injected
            for name, operation, expected in operations:
                proxy.break_connections(reset_next=self.failed_reconnects)
                assert operation() == expected, name
            assert proxy.injected >= before + self.failed_reconnects * len(operations), (
                "faults did not happen")
            proxy.break_connections()
            assert backend.get("k") == b"first"
            assert backend.logs.fetch("log") == [(0, b"e0"), (1, b"e1")]
            with pytest.raises(ObjectNotFound):
                backend.get("p")
        finally:
            backend.close()

    # --- leftovers of killed writers ---------------------------------------------------
    @needs_capability("temp_files")
    @pytest.mark.needs_separate_process
    def test_temp_files_of_a_killed_put_are_swept(
        self, backend: Backend, backend_location: Location
    ) -> None:
        """A put killed mid-upload (SIGKILL; or before it publishes the upload:
        ``kill_put_before``) leaves a temporary file, never listed as a key. ``sweep_temp_files`` with a cutoff before it was written leaves it alone
        (it could be an upload in progress); with a later cutoff it reports its size
        and, with ``delete``, removes it; keys stay."""
        backend.put("keep/x", b"kept")
        started = time.time()
        ctx = multiprocessing.get_context("spawn")
        child = ctx.Process(target=_killed_put_worker,
                            # Past 17 MiB an S3 multipart upload has sent two parts.
                            args=(backend_location, "keep/killed", 24 * MiB, 17 * MiB,
                                  self.kill_put_before))
        child.start()
        child.join(CHILD_TIMEOUT)
        assert child.exitcode == KILLED_EXITCODE, child.exitcode
        assert sorted(backend.list()) == ["keep/x"]
        # Clocks: the service's may differ a little from this one; an hour is plenty.
        assert backend.sweep_temp_files(started - 3600, delete=True) == []
        later = time.time() + 3600
        left = backend.sweep_temp_files(later, delete=False)
        assert left, "the killed put left no temporary file to find"
        assert all(t.path.startswith("keep/") and t.size >= 0 for t in left), left
        assert sorted(backend.list()) == ["keep/x"]
        # Compared by path: a server may still be applying the writes the killed
        # client had in flight (SFTP pipelines them), so the size can still grow.
        def paths(found: list[TempFile]) -> list[str]:
            return sorted(t.path for t in found)

        assert paths(backend.sweep_temp_files(later, delete=False)) == paths(left)  # nothing removed
        assert paths(backend.sweep_temp_files(later, delete=True)) == paths(left)
        assert backend.sweep_temp_files(later, delete=False) == []
        assert backend.get("keep/x") == b"kept"
        assert sorted(backend.list()) == ["keep/x"]
