"""One service, many folders: a :class:`Fleet` runs one :class:`~metasync.daemon.Daemon`
per registered folder, each in its own thread, each with its own watch, settle,
poll and guards (exactly a ``metasync daemon``'s loop, :meth:`Daemon.serve`).

Isolation. Whatever happens to one folder stays there:

- an exception escaping a folder's loop ends only that thread: the folder shows
  ``error`` with the reason, and is started again after a backoff (doubling, from
  ``restart_after`` up to ``MAX_RESTART``);
- a folder whose directory is gone shows ``paused`` (the daemon's own guard while
  it runs; the runner's check before it starts) and is looked at again every poll;
- a folder whose backends are unreachable shows ``offline`` (the daemon's);
- each folder holds its own daemon lock (``.metasync/daemon.lock``), so a
  ``metasync daemon`` there, or a second service, is refused with one line; the
  runner of a folder another process runs shows ``error`` and tries again later.

Process-wide state that could couple folders, and what is done about it:

- :data:`metasync.progress.CANCEL` stops every transfer of the process. A folder
  stopped alone (removed, or the service asked to) is stopped with
  ``Daemon.stop(cancel=False)``: its current sync finishes (every wait is bounded
  by ``--timeout``) and no other folder's transfer is touched. Only
  :meth:`Fleet.stop` with ``cancel=True`` (the service ending on SIGTERM) uses it,
  and clears it once every folder stopped.
- Signal handlers, ``signal.set_wakeup_fd`` and ``daemon.pid`` are the process's:
  only ``Daemon.run`` (``metasync daemon``) sets them; the service sets its own.
- Logging: each daemon logs to its own logger (not propagated) and its folder's
  ``daemon.log``; the handler is closed when its thread ends.
- The repository's thread pools, connections and locks belong to each
  ``Repository`` (opened per sync); the backends' module-level lock guards only the
  creation of a log store (no I/O under it); ``metasync.verification`` remembers
  per backend when it last checked it (shared by folders on the same backend, which
  is correct), and ``metasync.backends.retry`` each backend URI's pause after it
  went silent (shared too, which is correct: a silent server is silent for every
  folder on it; "Sync now" of a folder ends the pauses of its backends). Crash and
  pause points (``metasync.faults``) are test-only.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from metasync.app.registry import RegisteredFolder, Registry
from metasync.context import PID_FILE
from metasync.daemon import Daemon, Settings, close_logging, setup_logging, take_daemon_lock
from metasync.daemon_health import BackendStats, FolderStats
from metasync.errors import MetasyncError, UsageError
from metasync.progress import CANCEL
from metasync.worktree import META_DIR

__all__ = ["BackendStats", "Event", "EventLog", "Fleet", "FolderRunner", "FolderStats"]

#: Seconds between looks at ``folders.json`` for folders added or removed by
#: ``metasync add-folder`` / ``remove-folder`` in another process.
REGISTRY_POLL = 1.0
#: Longest wait before a folder whose loop failed is started again.
MAX_RESTART = 300.0
#: Events kept for ``/rest/events``.
EVENTS_KEPT = 1000

log = logging.getLogger("metasync.app")
#: Seconds the service waits for its folders to finish their step when it stops.
STOP_GRACE = 30.0


@dataclass(frozen=True)
class Event:
    id: int
    time: float
    folder: str
    kind: str
    message: str

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "time": self.time, "folder": self.folder, "kind": self.kind,
                "message": self.message}


class EventLog:
    """The last ``keep`` events, numbered from 1; thread-safe. Subscribers are
    called in the emitting thread (keep them short; an exception in one is logged)."""

    def __init__(self, keep: int = EVENTS_KEPT) -> None:
        self._events: deque[Event] = deque(maxlen=keep)
        self._lock = threading.Lock()
        self._next = 1
        self._subscribers: list[Callable[[Event], None]] = []

    def emit(self, kind: str, folder_id: str, message: str) -> Event:
        with self._lock:
            event = Event(self._next, time.time(), folder_id, kind, message)
            self._next += 1
            self._events.append(event)
            subscribers = list(self._subscribers)
        for callback in subscribers:
            try:
                callback(event)
            except Exception:
                log.exception("an event subscriber failed")
        return event

    def since(self, event_id: int) -> list[Event]:
        """The kept events with an id above ``event_id``, oldest first."""
        with self._lock:
            return [e for e in self._events if e.id > event_id]

    @property
    def last(self) -> int:
        """The id of the newest event (0 if none yet)."""
        with self._lock:
            return self._next - 1

    def subscribe(self, callback: Callable[[Event], None]) -> None:
        with self._lock:
            self._subscribers.append(callback)


class FolderRunner:
    """One registered folder's daemon in its own thread, started again after a
    failure. Methods are safe from any thread."""

    def __init__(self, folder: RegisteredFolder, settings: Settings, events: EventLog,
                 restart_after: float = 5.0) -> None:
        self.id = folder.id
        self.path = folder.path
        self.settings = settings
        self.events = events
        self.restart_after = restart_after
        self._stats = FolderStats()
        self._daemon: Daemon | None = None
        self._last: Daemon | None = None  # the last daemon, for what it knew
        self._state, self._reason = "starting", ""
        self._user_paused = False
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._main, name=f"metasync-folder-{self.id}",
                                        daemon=True)

    # --- control -----------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self, wait: bool = True, timeout: float | None = None) -> None:
        """Stop this folder only: its running sync finishes, no transfer of any
        other folder is stopped (``CANCEL`` is not touched)."""
        self._stopping.set()
        daemon = self._daemon
        if daemon is not None:
            daemon.stop(cancel=False)
        if wait and self._thread.is_alive():
            self._thread.join(timeout)

    def pause(self) -> None:
        self._user_paused = True
        daemon = self._daemon
        if daemon is not None:
            daemon.pause()

    def resume(self) -> None:
        self._user_paused = False
        daemon = self._daemon
        if daemon is not None:
            daemon.resume()

    def sync_now(self) -> None:
        daemon = self._daemon
        if daemon is not None:
            daemon.sync_now()

    def alive(self) -> bool:
        return self._thread.is_alive()

    # --- what it shows -------------------------------------------------------------
    def stats(self) -> FolderStats:
        """A copy of the counters since the service started this folder (taken
        while the folder's thread may be counting: each field is read once)."""
        backends = {name: replace(b) for name, b in dict(self._stats.backends).items()}
        return replace(self._stats, backends=backends)

    def snapshot(self) -> dict[str, Any]:
        """The folder object of docs/api.md."""
        daemon = self._daemon
        seen = daemon or self._last
        status = seen.status if seen is not None else None
        if daemon is not None and daemon.status.state not in ("starting", "stopped"):
            state, reason = daemon.status.state, daemon.status.reason
        else:
            state, reason = self._state, self._reason
        doc: dict[str, Any] = {
            "id": self.id, "path": str(self.path), "label": self.path.name or str(self.path),
            "state": state, "reason": reason,
            "last_sync": status.last_sync if status else None,
            "version": status.version if status else 0,
            "pending_changes": status.pending_changes if status else 0,
            "unpushed": status.unpushed if status else False,
            "progress": daemon.progress() if daemon is not None else None,
            "conflicts": list(status.conflicts) if status else [],
            "would_delete": list(status.would_delete) if status and state == "paused" else [],
            "backends": self._backends(seen),
        }
        return doc

    def _backends(self, daemon: Daemon | None) -> list[dict[str, Any]]:
        if daemon is None:
            return []
        h = daemon.health
        health = dict(h.health)
        health.update(daemon.status.backends)
        usage = dict(h.usage)
        stats = dict(self._stats.backends)
        out = []
        for name in sorted(set(health) | set(usage)):
            b = stats.get(name, BackendStats())
            objects, size, capacity, share = usage.get(name, (None, None, None, None))
            out.append({"name": name, "health": health.get(name, "ok"),
                        "last_error": h.last_error.get(name, ""),
                        "failing_since": b.failing_since, "latency_ms": b.latency_ms,
                        "objects": objects, "bytes": size,
                        # As `backend add --capacity GB` declared it (the mapping uses
                        # only the ratios), and the share of copies that gives it.
                        "capacity": None if capacity is None else int(capacity * 1e9),
                        "share": share})
        return out

    # --- the thread ------------------------------------------------------------------
    def _set(self, state: str, reason: str, event: str | None = None) -> None:
        if event and (state, reason) != (self._state, self._reason):
            self.events.emit(event, self.id, reason)
        self._state, self._reason = state, reason

    def _emit(self, kind: str, message: str) -> None:
        self.events.emit(kind, self.id, message)

    def _main(self) -> None:
        delay = self.restart_after
        while not self._stopping.is_set():
            started = time.monotonic()
            wait = delay
            try:
                if self._run_once():
                    wait = max(self.settings.poll, 0.1)  # gone: look again soon
            except Exception as exc:  # this folder's failure, never the service's
                log.warning("folder %s (%s): %s", self.id, self.path, exc,
                            exc_info=not isinstance(exc, (UsageError, OSError)))
                self._stats.errors += 1
                self._set("error", f"{_one_line(exc)}; started again in {delay:g} s", "error")
            if time.monotonic() - started > MAX_RESTART:
                delay = self.restart_after  # it ran well for a while: a fresh failure
            elif wait == delay:
                delay = min(delay * 2, MAX_RESTART)
            self._stopping.wait(wait)
        self._set("stopped", "")

    def _run_once(self) -> bool:
        """Run the folder's daemon until it stops; True if the folder is not there."""
        if not (self.path / META_DIR / "state.db").is_file():
            self._set("paused", f"{self.path} or its {META_DIR} folder is gone (an unmounted "
                      "disk?); syncing starts when it is back", "paused")
            return True
        try:
            fd = take_daemon_lock(self.path)
        except UsageError as exc:
            raise UsageError(f"another metasync daemon or service runs this folder ({exc})") from exc
        daemon = Daemon(self.path, self.settings, self._emit, self._stats)
        try:
            # A daemon.pid left by a `metasync daemon` that was killed is stale (the
            # lock is ours now): `daemon stop` must not signal that pid.
            (self.path / META_DIR / PID_FILE).unlink(missing_ok=True)
            setup_logging(daemon.log, daemon.meta)
            if self._user_paused:
                daemon.pause()
            self._daemon = self._last = daemon
            self._set("starting", "")
            if self._stopping.is_set():  # stop() came before it could reach the daemon
                return False
            daemon.serve()
            return False
        finally:
            self._daemon = None
            close_logging(daemon.log)
            os.close(fd)


class Fleet:
    """Every folder of ``registry``, each in its own :class:`FolderRunner`; follows
    ``folders.json`` (looked at every ``REGISTRY_POLL`` seconds) so a folder added
    or removed by the CLI in another process starts or stops within a second or two."""

    def __init__(self, registry: Registry, settings: Settings | None = None,
                 restart_after: float = 5.0) -> None:
        self.registry = registry
        self.settings = settings or Settings()
        self.restart_after = restart_after
        self.events = EventLog()
        #: Why the registry could not be read (a damaged folders.json), else "".
        self.problem = ""
        self._runners: dict[str, FolderRunner] = {}
        self._lock = threading.RLock()
        self._stopping = threading.Event()
        self._watcher = threading.Thread(target=self._watch_registry, name="metasync-registry",
                                         daemon=True)

    def start(self) -> None:
        self.reload()
        self._watcher.start()

    def stop(self, cancel: bool = False) -> None:
        """Stop every folder (``cancel``: their transfers too, at their next piece;
        for the end of the process) and wait for them."""
        self._stopping.set()
        with self._lock:
            runners = list(self._runners.values())
            self._runners.clear()
        if cancel:
            CANCEL.request()
        try:
            for r in runners:
                r.stop(wait=False)
            # Bounded: a folder stuck in a call that never returns (a hung network
            # mount) must not keep the service from stopping; it is named instead.
            deadline = time.monotonic() + STOP_GRACE
            for r in runners:
                r.stop(timeout=max(0.0, deadline - time.monotonic()))
            stuck = [str(r.path) for r in runners if r.alive()]
            if stuck:
                log.warning("stopping without waiting longer for %s (still in a step after "
                            "%g s)", ", ".join(stuck), STOP_GRACE)
        finally:
            if cancel:
                CANCEL.clear()
        if self._watcher.is_alive():
            self._watcher.join()

    def runners(self) -> list[FolderRunner]:
        with self._lock:
            return list(self._runners.values())

    def get(self, folder_id: str) -> FolderRunner:
        """The runner of ``folder_id``; KeyError if none."""
        with self._lock:
            return self._runners[folder_id]

    def add(self, path: Path) -> FolderRunner:
        """Register ``path`` (UsageError as :meth:`Registry.add`) and start it."""
        folder = self.registry.add(path)
        self.reload()
        return self.get(folder.id)

    def remove(self, folder_id: str) -> None:
        """Stop syncing ``folder_id`` and forget it (KeyError if unknown); its
        running sync finishes in the background."""
        with self._lock:
            if folder_id not in self._runners:
                raise KeyError(folder_id)
        try:
            self.registry.remove(folder_id)
        except UsageError as exc:
            raise KeyError(folder_id) from exc
        self.reload()

    def reload(self) -> None:
        """Make the runners match ``folders.json``: start the new, stop the removed.
        A damaged file changes nothing (the folders running go on) and is said once."""
        try:
            folders = self.registry.folders()
        except UsageError as exc:
            if str(exc) != self.problem:
                log.error("%s", exc)
                self.events.emit("error", "", str(exc))
            self.problem = str(exc)
            return
        self.problem = ""
        with self._lock:
            if self._stopping.is_set():
                return
            wanted = {f.id: f for f in folders}
            for folder_id in [i for i in self._runners if i not in wanted]:
                self._runners.pop(folder_id).stop(wait=False)
            for f in folders:
                if f.id not in self._runners:
                    runner = FolderRunner(f, self.settings, self.events, self.restart_after)
                    self._runners[f.id] = runner
                    runner.start()

    def _watch_registry(self) -> None:
        path = self.registry.config_dir / "folders.json"
        last = _signature(path)
        while not self._stopping.wait(REGISTRY_POLL):
            now = _signature(path)
            if now != last:
                last = now
                self.reload()


def _signature(path: Path) -> tuple[int, int, int] | None:
    """What changes when ``path`` is replaced or written (the registry's writes rename)."""
    try:
        st = path.stat()
    except OSError:
        return None
    return (st.st_ino, st.st_mtime_ns, st.st_size)


def _one_line(exc: BaseException) -> str:
    """``exc`` in one line: a metasync error's message as it is; any other error
    (a bug) named by its class too."""
    text = " ".join(str(exc).split())
    if isinstance(exc, MetasyncError) and text:
        return text
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
