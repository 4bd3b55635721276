"""What a service shows of one folder's daemon beyond ``daemon.json``: its
settings, counters (``FolderStats``, the service's ``/metrics``), each backend's
health, latency and usage (``Health``), and the events worth a notice."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from metasync.backends import public_uri
from metasync.errors import MetasyncError
from metasync.progress import NullReporter
from metasync.repository import Repository


@dataclass
class Settings:
    """How a daemon paces itself (``metasync daemon`` and ``service`` options)."""

    #: Quiet seconds after the last local change before committing.
    settle: float = 3.0
    #: Seconds between checks of the backends for others' changes.
    poll: float = 10.0
    #: Seconds between full checks (local scan and remote version) whatever happens.
    rescan: float = 60.0
    #: Largest share of the folder's files one sync may delete without confirmation.
    delete_share: float = 0.5
    #: Seconds a backend fails before a ``backend-failing`` event (the service's notice).
    failing_after: float = 300.0
    #: Least seconds between two reads of what each backend stores (a listing of each).
    usage_every: float = 600.0


#: A daemon's events: ``(kind, one line)``; kinds ``conflict``, ``paused``,
#: ``backend-failing``, ``backend-ok``, ``synced``, ``error`` (docs/api.md).
EventSink = Callable[[str, str], None]


@dataclass
class BackendStats:
    """One backend as this folder's daemon saw it: the requests made to it (its
    syncs' and its hint polls), the hint polls that failed (``errors``), the
    latency of the last small request (a hint poll's, or the last sync's: a
    backend whose change feed works is never polled), and since when it fails
    (Unix time)."""

    requests: int = 0
    errors: int = 0
    latency_ms: float | None = None
    failing_since: float | None = None


@dataclass
class FolderStats:
    """Counters of one folder's daemon since it started (the service's ``/metrics``)."""

    syncs: int = 0
    sync_seconds: float = 0.0
    errors: int = 0
    bytes_up: int = 0
    bytes_down: int = 0
    conflicts: int = 0
    pending_changes: int = 0
    last_success: float | None = None
    backends: dict[str, BackendStats] = field(default_factory=dict)


class LogNotes(NullReporter):
    """The daemon's reporter: what a command would print as a note (a path it
    could not write, a conflict copy) goes to the daemon's log; bytes uploaded and
    downloaded are counted in ``stats``, and the running transfer is ``progress``."""

    def __init__(self, log: logging.Logger, stats: FolderStats) -> None:
        super().__init__()
        self.log = log
        self.stats = stats
        self._lock = threading.Lock()  # transfer threads advance concurrently
        self._label = ""
        self._done = self._total = 0

    def start(self, label: str, total: int) -> None:
        with self._lock:
            self._label, self._done, self._total = label, 0, total

    def advance(self, amount: int) -> None:
        with self._lock:
            self._done += amount
            if self._label == "upload":
                self.stats.bytes_up += amount
            elif self._label == "download":
                self.stats.bytes_down += amount

    def finish(self) -> None:
        with self._lock:
            self._label = ""

    def progress(self) -> dict[str, int] | None:
        """``{"done", "total"}`` bytes of the transfer running now, else None."""
        with self._lock:
            if self._label not in ("upload", "download"):
                return None
            return {"done": self._done, "total": self._total}

    def note(self, message: str) -> None:
        self.log.warning("%s", message)


class Health:
    """What a service shows of a folder beyond ``daemon.json``: the counters, each
    backend's health, last error and latency, what each stores; and the events of
    changes worth a notice. Written by the daemon's thread; read by others."""

    def __init__(self, settings: Settings, log: logging.Logger, sink: EventSink | None,
                 stats: FolderStats | None = None) -> None:
        self.settings = settings
        self.log = log
        #: Counters; a caller that restarts daemons passes the same one to each.
        self.stats = stats if stats is not None else FolderStats()
        #: Backend name -> "ok" or why it fails; the last reason each failed for.
        self.health: dict[str, str] = {}
        self.last_error: dict[str, str] = {}
        #: Backend name -> (objects, bytes) it stores for this repository.
        #: Per backend: objects, bytes, declared capacity (GB), the mapping's share.
        self.usage: dict[str, tuple[int, int, float, float]] = {}
        self._usage_at = float("-inf")
        self._told_failing: set[str] = set()
        self._sink = sink

    def emit(self, kind: str, message: str) -> None:
        self.log.info("event %s: %s", kind, message)
        if self._sink is not None:
            try:
                self._sink(kind, message)
            except Exception:  # a listener's bug must not stop the sync
                self.log.exception("an event listener failed")

    def _backend(self, name: str) -> BackendStats:
        return self.stats.backends.setdefault(name, BackendStats())

    def polled(self, name: str, seconds: float, error: str | None) -> None:
        """One hint poll of backend ``name``: how long it took, or why it failed."""
        b = self._backend(name)
        b.requests += 1
        if error is None:
            b.latency_ms = round(seconds * 1000, 3)
            if self.health.get(name, "ok").startswith("unreachable"):
                self.observe(name, "ok")
        else:
            b.errors += 1
            self.observe(name, f"unreachable: {error}")

    def record(self, acceptors: Iterable[str], failing: dict[str, str],
               requests: dict[str, int], names: dict[str, str],
               latencies: dict[str, float] | None = None) -> dict[str, str]:
        """After a sync: the acceptors are "ok" unless ``failing`` (backend id ->
        why, :meth:`Repository.health`) says otherwise; ``requests`` (backend id ->
        count) were made, the last small one to each taking ``latencies`` (backend
        id -> seconds). Returns each backend's health by name (``names``: id ->
        name, else the id)."""
        health = {names.get(b, b): "ok" for b in acceptors}
        for backend_id, why in failing.items():
            health[names.get(backend_id, backend_id)] = why
        for name, why in health.items():
            self.observe(name, why)
        for backend_id, count in requests.items():
            self._backend(names.get(backend_id, backend_id)).requests += count
        for backend_id, seconds in (latencies or {}).items():
            self._backend(names.get(backend_id, backend_id)).latency_ms = round(seconds * 1000, 3)
        return health

    def observe(self, name: str, health: str) -> None:
        """Backend ``name`` is ``health`` ("ok" or a reason) now. A full backend is
        not failing (it answers); any other reason starts its failing time."""
        b = self._backend(name)
        self.health[name] = health
        if health != "ok" and not health.startswith("full"):
            self.last_error[name] = health
            if b.failing_since is None:
                b.failing_since = time.time()
        else:
            b.failing_since = None
            if name in self._told_failing:
                self._told_failing.discard(name)
                self.emit("backend-ok", f"{name} works again")
        self.check_failing()

    def check_failing(self) -> None:
        """Tell of each backend failing for ``failing_after`` seconds, once."""
        now = time.time()
        for name, b in list(self.stats.backends.items()):
            if (b.failing_since is not None and name not in self._told_failing
                    and now - b.failing_since >= self.settings.failing_after):
                self._told_failing.add(name)
                self.emit("backend-failing", f"{name} has failed for {now - b.failing_since:.0f} s: "
                                             f"{self.health.get(name, '')}")

    def refresh_usage(self, repo: Repository) -> None:
        """What each backend stores, read at most every ``usage_every`` seconds
        (one listing of each backend)."""
        now = time.monotonic()
        if now < self._usage_at + self.settings.usage_every:
            return
        self._usage_at = now
        try:
            listing = repo.backend_list()
        except MetasyncError as exc:
            self.log.info("could not read what the backends store: %s", exc)
            return
        self.usage = {public_uri(b.uri): (b.objects, b.bytes, b.capacity, b.share)
                      for b in listing.backends}
