"""What the tests of the four cloud-provider backends share
(tests/test_backend_{dropbox,gdrive,box,onedrive}.py): each runs the conformance suite
against its provider's emulator (tests/emulators/), and the same checks of sharing, of
a whole repository over a throttling provider and of the live service."""

from __future__ import annotations

import contextlib
import io
import itertools
import os
import subprocess
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import METASYNC, run_cli
from metasync.backends import Backend, open_backend
from metasync.backends.cloudfeeds import CURSOR_INTERVAL, CursorFeed, LongPollFeed
from metasync.backends.conformance import BackendConformance, Location
from metasync.backends.feeds import ChangeFeed
from metasync.backends.retry import RetryPolicy
from metasync.errors import BackendError, ObjectNotFound
from tests.emulators.base import UNAVAILABLE, EmulatorService

MiB = 1 << 20
_counter = itertools.count()


def fresh_namespace() -> str:
    """A namespace no other test uses."""
    return f"ns-{next(_counter)}-{uuid.uuid4().hex[:6]}"


def emulator_location(service: EmulatorService, scheme: str, folder: str) -> str:
    """The URI ``scheme:folder`` of a location folder made on the emulator (as a user
    would make it in the provider's app)."""
    service.emulator.make_folder(folder)
    return f"{scheme}:{folder}"


def one_line(exc: BaseException) -> str:
    """The message of ``exc``, asserted to be one line."""
    message = str(exc)
    assert "\n" not in message, message
    return message


def call_delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """The emulator's request counts (``emulator.calls``) that changed from ``before``
    to ``after``, by how much."""
    return {k: after.get(k, 0) - before.get(k, 0) for k in after if after.get(k, 0) != before.get(k, 0)}


class FailingSource(io.BytesIO):
    """A seekable source whose reads fail from ``fail_at`` on (a disk going away)."""

    def __init__(self, data: bytes, fail_at: int) -> None:
        super().__init__(data)
        self.fail_at = fail_at

    def read(self, size: int | None = -1) -> bytes:
        if self.tell() >= self.fail_at:
            raise OSError("the source went away")
        return super().read(size)


class ProviderConformance(BackendConformance):
    """The conformance suite against a provider's emulator. A subclass sets
    ``backend_class`` and overrides the ``service`` fixture with its provider's session
    emulator; locations are folders ``/conformance``, ``/faulty`` and a non-ASCII one."""

    #: Prefix of location folders: ``/`` (a path from the root), ``""`` for Drive.
    folder_root = "/"
    #: A folder whose name needs quoting on the wire.
    unicode_folder = "ünï cødé ☃/with space"

    @pytest.fixture
    def service(self) -> EmulatorService:
        raise NotImplementedError("a provider's test class gives its emulator")

    def _location(self, service: EmulatorService, folder: str) -> str:
        return emulator_location(service, self.backend_class.scheme, self.folder_root + folder)

    @pytest.fixture
    def backend_location(self, service: EmulatorService) -> Location:
        return (self._location(service, "conformance"), fresh_namespace())

    @pytest.fixture
    def unicode_location(self, service: EmulatorService) -> Location:
        return (self._location(service, self.unicode_folder), fresh_namespace())

    @pytest.fixture
    def faulty_location(self, service: EmulatorService) -> Iterator[tuple[str, str, Any]]:
        faults = service.faults_via_proxy()
        try:
            uri = self._location(service, "faulty") + f"?api={faults.base_url}"
            yield (uri, fresh_namespace(), faults)
        finally:
            faults.close()


@contextlib.contextmanager
def specific_backend(service: EmulatorService, location: str) -> Iterator[Backend]:
    """A backend on ``location`` (a URI) in a fresh namespace, created; afterwards the
    emulator's injected faults are cleared and the backend is closed."""
    backend = open_backend(location, fresh_namespace())
    backend.create()
    yield backend
    service.emulator.faults.clear()
    backend.close()


def start_auth(provider: str, args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    """`metasync auth PROVIDER ARGS` running, with pipes for stdin, stdout and stderr."""
    return subprocess.Popen(
        [METASYNC, "auth", provider, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, env=env if env is not None else {**os.environ},
    )


def read_printed_url(proc: subprocess.Popen[str], prefix: str) -> str:
    """The first line starting with ``prefix`` that `metasync auth` (``proc``) prints:
    the address the user is asked to open."""
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.strip().startswith(prefix):
            return line.strip()
    raise AssertionError("no authorization address printed")


def init_repository_to_share(tmp_path: Path, location: str, namespace: str) -> tuple[Path, Path]:
    """``(work tree, dir: store)`` of a new repository over ``location`` (a provider
    URI) and a ``dir:`` store, as `metasync share` is tried on."""
    store = tmp_path / "dir"
    store.mkdir()
    work = tmp_path / "work"
    work.mkdir()
    (work / "f.txt").write_text("x")
    run_cli("init", str(work), "--namespace", namespace, "--backend", location,
            "--backend", f"dir:{store}")
    return work, store


def check_share(work: Path, store: Path, shared: str) -> None:
    """`metasync share friend@example.com` in ``work`` succeeds, saying it shared the
    provider location ``shared`` and that the ``dir:`` store is to share by hand."""
    proc = run_cli("share", "friend@example.com", cwd=work, check=False)
    assert proc.returncode == 0, proc.stderr
    assert f"shared:  {shared}" in proc.stdout
    assert f"by hand: dir:{store}" in proc.stdout


def check_repository_over_throttling(
    service: EmulatorService,
    uri: str,
    tmp_path: Path,
    *,
    rate: float,
    seed: int,
    kinds: tuple[str, ...],
    small_files: int,
    provider: str,
) -> None:
    """init, push, clone (from ``uri``), edit, push, pull over ``uri`` + two ``dir:``
    backends (R=2) while the emulator answers a seeded ``rate`` of requests with faults
    of ``kinds``: every command succeeds, the clones match, fsck passes, and at least
    15 faults were injected (else "``provider`` did not throttle")."""
    from conftest import make_tree, snapshot

    dirs = [tmp_path / "d0", tmp_path / "d1"]
    for d in dirs:
        d.mkdir()
    src = tmp_path / "src"
    make_tree(src, small_files=small_files)
    faults = service.emulator.faults
    before = faults.injected
    faults.schedule(rate, seed=seed, kinds=kinds)
    try:
        run_cli("init", str(src), "--replicas", "2", "--backend", uri,
                "--backend", f"dir:{dirs[0]}", "--backend", f"dir:{dirs[1]}")
        run_cli("push", "-m", "first", cwd=src)
        clone = tmp_path / "clone"
        run_cli("clone", uri, str(clone))
        assert snapshot(clone) == snapshot(src)
        (clone / "edited.txt").write_text("from the clone\n")
        run_cli("push", "-m", "edit", cwd=clone)
        run_cli("pull", cwd=src)
        assert snapshot(src) == snapshot(clone)
    finally:
        faults.clear()
    run_cli("fsck", cwd=src)
    assert faults.injected - before >= 15, f"{provider} did not throttle"


def check_faults_helper(service: EmulatorService, location: str, kinds: list[str]) -> None:
    """EmulatorFaults (faulty_location) injects TCP resets and the provider's HTTP
    faults alike: two rounds of ``break_connections(reset_next=2)`` inject at least
    four faults, the last two HTTP ones of ``kinds``."""
    faults = service.faults_via_proxy()
    try:
        backend = open_backend(location + f"?api={faults.base_url}", fresh_namespace())
        backend.create()
        before = faults.injected
        faults.break_connections(reset_next=2)
        backend.put("k", b"v")
        faults.break_connections(reset_next=2)
        assert backend.get("k") == b"v"
        assert faults.injected >= before + 4
        assert [fault for fault, _, _ in service.emulator.faults.log[-2:]] == kinds
        backend.close()
    finally:
        faults.close()


# --- change feeds ------------------------------------------------------------------------

#: Seconds a test lets an idle feed wait: short (a False answer takes this long), and
#: long enough for several asks or long-poll rounds at the test's shortened pace.
IDLE_WAIT = 1.0
#: Seconds a test lets a feed take to see a change: generous (a True answer returns
#: as soon as the feed fires; only a broken feed waits this long).
CHANGE_WAIT = 30.0


def idle_requests_per_hour(service: EmulatorService, feed: ChangeFeed) -> float:
    """The requests an hour ``feed`` (fresh, its pace shortened by the test) would cost
    an idle namespace at its real pace, from the requests the emulator counted during
    an idle wait: requests per ask times asks an hour (:data:`CURSOR_INTERVAL`), or
    requests per long-poll round (the starting point's included) times rounds an hour
    (``round_seconds``). Closes ``feed``."""
    emulator = service.emulator
    if isinstance(feed, CursorFeed):
        assert feed.wait(0) is False  # the starting point
        before, asks = emulator.requests, feed.checks
        assert feed.wait(IDLE_WAIT) is False
        asks = feed.checks - asks
        assert asks >= 1
        feed.close()
        return (emulator.requests - before) / asks * 3600 / CURSOR_INTERVAL
    assert isinstance(feed, LongPollFeed)
    before = emulator.requests
    assert feed.wait(IDLE_WAIT) is False
    feed.close()
    assert feed.join(CHANGE_WAIT)
    assert feed.rounds >= 1
    return (emulator.requests - before) / feed.rounds * 3600 / feed.round_seconds


def check_change_feed(
    service: EmulatorService,
    location: str,
    *,
    kind: str,
    feed_routes: str,
    hasten: Callable[[ChangeFeed], None] = lambda feed: None,
) -> None:
    """The backend's change feed on ``location`` (a URI), of ``kind``: silent (False)
    on an idle namespace and after a change in another namespace beside it, True once
    another client wrote into the namespace, still working after a transient error of
    one of its requests (paths matching ``feed_routes``: retried) and after errors
    that outlast the retries (raised by one wait), unblocked by close() from another
    thread, and costing an idle namespace at most 120 requests an hour (issue
    19's budget). ``hasten(feed)`` shortens the feed's pace for the test."""
    namespace = fresh_namespace()
    watcher = open_backend(location, namespace)
    watcher.create()
    writer = open_backend(location, namespace)
    # The folders the writes below go into exist before the feed starts: each write
    # is then one change (an object), reported by one firing.
    writer.put("objects/ab/seed", b"before the feed")
    writer.put("logs/seed", b"before the feed")
    outsider = open_backend(location, fresh_namespace())
    outsider.create()
    assert watcher.capabilities.change_feed == kind
    feed = watcher.change_feed()
    assert feed is not None and feed.kind == kind
    hasten(feed)
    try:
        assert feed.wait(0.1) is False  # the starting point; nothing changed yet
        assert feed.wait(IDLE_WAIT) is False
        writer.put("objects/ab/new", b"pushed by another client")
        assert feed.wait(CHANGE_WAIT) is True
        assert feed.wait(IDLE_WAIT) is False  # the change was reported once
        outsider.put("objects/ab/elsewhere", b"another namespace")
        outsider.put("top", b"another namespace")
        assert feed.wait(IDLE_WAIT) is False
        # A transient failure of the feed's own requests is retried (or raised once,
        # and the next wait goes on): the next change is still seen.
        service.emulator.faults.inject(UNAVAILABLE, only=feed_routes)
        writer.put("logs/0", b"after a fault")
        fired: bool | None = None
        for _ in range(3):
            try:
                fired = feed.wait(CHANGE_WAIT)
                break
            except BackendError as exc:
                assert exc.transient, exc
        assert fired is True
        assert service.emulator.faults.pending() == 0
        # A failure that outlasts the retries is raised by a wait (transient: the
        # caller backs off); the next wait goes on from the saved cursor.
        service.emulator.faults.inject(*[UNAVAILABLE] * RetryPolicy().attempts,
                                       only=feed_routes)
        writer.put("logs/1", b"while the service fails")
        with pytest.raises(BackendError) as failed:
            feed.wait(CHANGE_WAIT)
        assert failed.value.transient
        assert service.emulator.faults.pending() == 0
        assert feed.wait(CHANGE_WAIT) is True
        writer.delete("objects/ab/new")
        assert feed.wait(CHANGE_WAIT) is True  # a deletion is a change too
        # close() from another thread ends a long wait at once.
        answers: list[bool] = []
        waiting = threading.Thread(target=lambda: answers.append(feed.wait(3600)))
        waiting.start()
        feed.close()
        waiting.join(CHANGE_WAIT)
        assert not waiting.is_alive() and answers == [False]
        if isinstance(feed, LongPollFeed):
            assert feed.join(CHANGE_WAIT)
        idle = watcher.change_feed()
        assert idle is not None
        hasten(idle)
        assert idle_requests_per_hour(service, idle) <= 120
    finally:
        service.emulator.faults.clear()
        feed.close()
        for backend in (watcher, writer, outsider):
            backend.close()


def open_live_backend(scheme: str, monkeypatch: pytest.MonkeyPatch) -> Backend:
    """A backend on the real service (not the emulator): account ``live``, a fresh
    namespace below ``METASYNC_LIVE_<SCHEME>_PATH``."""
    for name in (f"METASYNC_{scheme.upper()}_API_URL", f"METASYNC_{scheme.upper()}_CA_FILE"):
        monkeypatch.delenv(name, raising=False)
    path = os.environ.get(f"METASYNC_LIVE_{scheme.upper()}_PATH", "")
    return open_backend(f"{scheme}:{path}?account=live", f"live-{uuid.uuid4().hex[:8]}")


def check_live_round_trip(backend: Backend) -> None:
    """Create, put, exclusive create, append, fetch, compare-and-swap and delete on
    ``backend`` work as the conformance suite expects (for the live tests)."""
    backend.create()
    backend.put("k", b"v1")
    assert backend.get("k") == b"v1"
    assert backend.put_if_absent("k", b"v1") is False
    assert backend.logs.append("log", b"a") == 0 and backend.logs.append("log", b"b") == 1
    assert backend.logs.fetch("log") == [(0, b"a"), (1, b"b")]
    token = backend.poll("k")
    assert token is not None and backend.replace_if("k", b"v2", token)
    assert backend.replace_if("k", b"v3", token) is False
    backend.delete("k")
    with pytest.raises(ObjectNotFound):
        backend.get("k")
