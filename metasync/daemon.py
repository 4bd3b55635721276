"""The background daemon: a Dropbox-like folder across many storage services.

One loop, one folder. Local changes arrive as watchdog events; once the folder
has been quiet for ``settle`` seconds the daemon commits and pushes once (a
push merges with whatever others pushed). Remote changes are noticed by the
acceptors' change feeds (:mod:`metasync.remote_watch`), or by polling the
``latest`` hint every ``poll`` seconds of an acceptor without one (and by a full
check every ``rescan`` seconds in case a hint was never written, rare where the
feeds see every write), then pulled. Everything else -- merging, conflict copies,
crash safety -- is the repository's.

The daemon holds the repository only while it syncs, so CLI commands run in
between. It refuses to propagate what looks like an accident: a folder that is
gone (an unmounted disk), or one sync that would delete more than
``delete_share`` of the files (either direction), pauses it until
``metasync daemon resume``.

State for ``metasync daemon status`` is written atomically to
``.metasync/daemon.json``; the log goes to ``.metasync/daemon.log``.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import logging.handlers
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from metasync.backends import Backend, open_backend, public_uri
from metasync.backends.retry import end_pause
from metasync.committer import Change
from metasync.context import DAEMON_LOCK, PID_FILE, daemon_running
from metasync.daemon_health import EventSink, FolderStats, Health, LogNotes, Settings
from metasync.errors import BackendError, FolderBusy, Interrupted, MetasyncError, UsageError
from metasync.faults import pause_point, watch_failure
from metasync.layout import HINT_KEY
from metasync.names import display_path
from metasync.portable import process_alive, try_lock
from metasync.progress import CANCEL
from metasync.remote_watch import RemoteWatch
from metasync.repository import Repository
from metasync.watch_status import answer_status
from metasync.worktree import IGNORE_FILE, META_DIR, TEMP_PREFIX, IgnoreRules, ScanProblems

STATUS_FILE = "daemon.json"
LOG_FILE = "daemon.log"
RESUME_FILE = "daemon.resume"
#: The deletion guard applies only to folders with at least this many files.
GUARD_MIN_FILES = 10
#: Seconds before an unfinished rebalance of a configuration change is tried again.
REBALANCE_RETRY = 3600.0
#: Paths a daemon commit's message names; more are counted ("and 4 more").
MESSAGE_PATHS = 5
#: Paths ``would_delete`` keeps (the count is in the reason).
WOULD_DELETE_MAX = 1000


def change_message(changes: list[Change], device: str) -> str:
    """The message of a commit the daemon makes: how many paths changed on which
    device, naming the first few (``3 files changed on laptop: a.txt, b.txt,
    c.txt``); empty without changes. Folders count only when no file changed. Names
    are in display form: a message is text, and a name that is not UTF-8 must not make
    the commit, the log or an event unwritable."""
    paths = [display_path(c.path) for c in changes if c.type != "dir"]
    what = "file"
    if not paths:
        paths, what = [display_path(c.path) + "/" for c in changes], "folder"
    if not paths:
        return ""
    named = ", ".join(paths[:MESSAGE_PATHS])
    more = f" and {len(paths) - MESSAGE_PATHS} more" if len(paths) > MESSAGE_PATHS else ""
    return f"{len(paths)} {what}{'s' if len(paths) != 1 else ''} changed on {device}: {named}{more}"


@dataclass
class DaemonStatus:
    """What ``metasync daemon status`` shows (``.metasync/daemon.json``)."""

    pid: int
    state: str = "starting"  # idle, syncing, offline, error, paused, stopped
    reason: str = ""
    last_sync: float | None = None
    pending_changes: int = 0
    unpushed: bool = False
    conflicts: list[str] = field(default_factory=list)
    backends: dict[str, str] = field(default_factory=dict)
    watching: str = "events"  # or "scanning" when the OS has no watches left
    #: Paths the last scan could not read ("PATH (reason)"), and special files it
    #: skipped ("PATH (a FIFO)"): not synced, the rest is.
    unreadable: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    version: int = 0
    updated: float = 0.0
    #: While the deletion guard holds a sync back: the paths it would delete.
    would_delete: list[str] = field(default_factory=list)



class _Paused(Exception):
    """A sync stopped itself to ask the user first."""


__all__ = ["Daemon", "DaemonStatus", "EventSink", "FolderStats", "Health", "LocalWatch", "Settings",
           "close_logging", "read_status", "running_pid", "setup_logging", "take_daemon_lock"]


class Daemon:
    """Runs until :meth:`stop` (or SIGTERM/SIGINT in :meth:`run`)."""

    def __init__(self, root: Path, settings: Settings | None = None, events: EventSink | None = None,
                 stats: FolderStats | None = None) -> None:
        self.root = root.absolute()
        self.meta = self.root / META_DIR
        self.settings = settings or Settings()
        self.status = DaemonStatus(pid=os.getpid())
        self.log = logging.getLogger(f"metasync.daemon.{id(self)}")
        self.health = Health(self.settings, self.log, events, stats)
        self._notes = LogNotes(self.log, self.health.stats)
        self._resume_asked = self._user_paused = False
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._dirty = True  # the folder may have changed while no daemon ran
        self._last_event = 0.0
        self._acceptors: dict[str, Backend] = {}
        self._acceptors_config = ""
        self._names: dict[str, str] = {}
        # The deletion guard's; "another command is using" the folder, said.
        self._allow_deletes = self._guard_held = self._busy_said = False
        self._conflicts: list[str] = []  # conflict copies made here, as paths
        self._remote_pending = True  # others may have pushed while no daemon ran
        self._rebalance_after = 0.0
        self._remote = RemoteWatch(self._wake, self.log, HINT_KEY)

    # --- lifecycle ---------------------------------------------------------------
    def stop(self, cancel: bool = False) -> None:
        """Finish the current step (``cancel``: stop its transfers), then leave the loop."""
        if cancel:
            CANCEL.request()
        self._stopping.set()
        self._wake.set()

    def pause(self) -> None:
        """Stop syncing until :meth:`resume` (a sync running now finishes first)."""
        self._user_paused = True
        self._wake.set()

    def resume(self) -> None:
        """Leave a pause; a sync the deletion guard held back runs (as the
        ``daemon.resume`` file does). Nothing if not paused."""
        self._user_paused = False
        if self.status.state == "paused":
            self._resume_asked = True
        self._wake.set()

    def sync_now(self) -> None:
        """Sync at once: a full check of the folder and every backend (paused ones too)."""
        for backend in list(self._acceptors.values()):
            end_pause(backend.uri)
        self._remote_pending = True
        self._dirty = True
        self._last_event = 0.0
        self._wake.set()

    def progress(self) -> dict[str, int] | None:
        """The transfer of the sync running now (bytes done of total), else None."""
        return self._notes.progress() if self.status.state == "syncing" else None

    def run(self) -> int:
        """The daemon as a process: its log, signals and pid file around :meth:`serve`;
        returns an exit status."""
        setup_logging(self.log, self.meta)
        # Off first: the CLI's signal watcher (a second signal quits at once) is for
        # commands a user runs; the daemon stops at its own pace, saying so.
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGTERM, signal.SIGINT):
            # Stop the transfers of a sync in progress too (each at its next piece):
            # what was uploaded is kept and the next sync continues.
            signal.signal(sig, lambda *_: self.stop(cancel=True))
        pid_fd = self._take_pid_file()
        try:
            self.serve()
        finally:
            with contextlib.suppress(OSError):
                (self.meta / PID_FILE).unlink(missing_ok=True)
            os.close(pid_fd)
        return 0

    def serve(self) -> None:
        """The loop, until :meth:`stop`: what :meth:`run` runs, and each folder's
        thread in the service. The caller holds the folder's daemon lock
        (:func:`take_daemon_lock`) and has set up the log; nothing here touches
        process-wide state (signals, the pid file, :data:`CANCEL`)."""
        observer = answer_status(self._watch(), self.root,
                                 LocalWatch(self.root, lambda: None).relevant, self.log)
        self._write_status()
        self.log.info("watching %s (settle %gs, poll %gs)", self.root,
                      self.settings.settle, self.settings.poll)
        try:
            self._open_acceptors()
            self._loop()
        except Exception as exc:
            # Whatever stops the daemon is said where `daemon status` looks: a
            # daemon that stopped must never show an empty reason.
            self.log.exception("stopped on an error")
            self.status.reason = f"stopped on an error: {_describe(exc)}"
            raise
        finally:
            self._remote.stop()
            if observer is not None:
                observer.stop()
                observer.join(timeout=5)
            self.status.state = "stopped"
            self._write_status()
            self.log.info("stopped")
            for b in self._acceptors.values():
                b.close()

    def _loop(self) -> None:
        next_poll = 0.0
        next_rescan = time.monotonic() + self.settings.rescan
        while not self._stopping.is_set():
            now = time.monotonic()
            self.health.check_failing()
            if self._user_paused and self.status.state != "paused":
                self._pause("paused by the user")
            if self.status.state == "paused":
                self._check_paused()
                self._wake.wait(1.0)
                self._wake.clear()
                continue
            local_due = self._dirty and now - self._last_event >= self.settings.settle
            # A change feed fired (metasync/remote_watch.py): others pushed.
            remote_due = self._remote.take_fired() or self._remote_pending
            if now >= next_poll:
                next_poll = now + self.settings.poll
                remote_due = self._remote.hints_moved(self._acceptors, on_poll=lambda b, secs, err: (
                    self.health.polled(self._names[b], secs, err))) or remote_due
                # Without watches, or after a failure, every poll is a full attempt.
                if self.status.watching == "scanning" or self.status.state in ("offline", "error"):
                    local_due = True
                    remote_due = remote_due or self.status.state != "idle"
            if now >= next_rescan:
                next_rescan = now + self.settings.rescan
                # The backends' part is rare where feeds see every write to them.
                local_due = True
                remote_due = self._remote.full_check_due() or remote_due
            settling = self._dirty and now - self._last_event < self.settings.settle
            self._remote_pending = remote_due  # until a sync looked (a feed fires once)
            if (local_due or remote_due) and not settling:
                # Never while files are still being written: a sync would commit them
                # half-written (the settle wait is what makes a slow writer safe).
                self._sync(remote=remote_due)
            timeout = next_poll - time.monotonic()
            if self._dirty:
                timeout = min(timeout, self._last_event + self.settings.settle - time.monotonic())
            self._wake.wait(max(0.05, timeout))
            self._wake.clear()

    # --- one sync ------------------------------------------------------------------
    def _sync(self, remote: bool = True) -> None:
        if not (self.meta / "state.db").is_file():
            self._pause(f"{self.root} or its {META_DIR} folder is gone (an unmounted disk?); "
                        "syncing stops until it is back")
            return
        self._dirty = False
        self.status.state = "syncing"
        self._write_status()
        started = time.monotonic()
        try:
            with Repository.open(self.root, self._notes, wait=0) as repo:
                self._busy_said = False
                try:
                    self._sync_repo(repo, remote)
                finally:
                    self._record_backends(repo)
                self.health.stats.syncs += 1
                self.health.stats.sync_seconds += time.monotonic() - started
                self.health.stats.last_success = self.status.last_sync
                self.health.refresh_usage(repo)
        except _Paused:
            return
        except FolderBusy:
            self._dirty = True  # a CLI command has the folder: try again soon
            self._last_event = time.monotonic()
            if not self._busy_said:  # once until a sync gets the folder
                self.log.info("another command is using %s; syncing once it is done", self.root)
                self._busy_said = True
            self.status.state = "idle"
            return
        except Interrupted as exc:
            self.log.info("stopped during a sync: %s", exc)
        except UsageError as exc:
            self._fail(exc)
        except BackendError as exc:
            self.status.state = "offline"
            self.status.reason = str(exc)
            self.health.stats.errors += 1
            self.log.warning("offline: %s", exc)
            self._commit_offline()
        except MetasyncError as exc:
            self._fail(exc)
        except OSError as exc:
            if exc.errno not in (errno.ENOENT, errno.ENOTDIR):
                self._fail(exc)
            elif not (self.root / META_DIR).is_dir():
                self._pause(f"{self.root} vanished during a sync; syncing stops until it is back")
            else:
                # Only something inside the folder moved while it was read (the user
                # renamed a folder mid-scan): nothing is lost, sync again shortly.
                self.log.info("%s changed during the sync (%s); syncing again", self.root, exc)
                self._dirty = True
                self._last_event = time.monotonic()
                self.status.state = "idle"
        except Exception as exc:
            # A bug must not end the watch: say it (with the traceback in the log),
            # and try again on the next poll, as after any failed sync.
            self.log.exception("sync failed on an internal error")
            self._fail(RuntimeError(f"internal error: {_describe(exc)} "
                                    f"(traceback in {META_DIR}/daemon.log)"))
        self._write_status()

    def _sync_repo(self, repo: Repository, remote: bool = True) -> None:
        pause_point("daemon:sync")
        allow = self._allow_deletes
        self._allow_deletes = False
        st = repo.status()
        record_unsynced(self.status, st.problems, self.log)
        share = None if allow else self.settings.delete_share
        held = local_deletions_held(repo, st.changes, share)
        if held is not None:
            self._pause(*held)
            raise _Paused
        if not (remote or st.changes or st.unpushed or repo.missing_copies()):
            # A local check that found nothing asks no backend (the feeds say when to);
            # the folder is as synced as the feeds know.
            self.status.state, self.status.reason, self.status.pending_changes = "idle", "", 0
            self.status.last_sync = time.time()
            return
        latest = repo.learn_latest()
        held = remote_deletions_held(repo, latest, share)
        if held is not None:
            self._pause(*held)
            raise _Paused
        self._remote_pending = False  # looked (what fires from now on is seen anew)
        # Copies a backend missed while away are rewritten by a push, so one runs
        # for them too, even with nothing new.
        missed = bool(repo.missing_copies())
        if st.changes or st.unpushed or latest.number > repo.prev.number or missed:
            message = change_message(st.changes, repo.device)
            result = repo.push(message)
            if result.fork:
                self.log.warning("%s", result.fork)
            if result.conflicts:
                shown = [display_path(c) for c in result.conflicts]
                self.log.info("conflicts: %s", ", ".join(shown))
                self._conflicts += result.conflicts
                self.health.stats.conflicts += len(shown)
                self.health.emit("conflict", f"{len(shown)} conflict copy(ies): {', '.join(shown[:5])}")
            if not result.up_to_date and result.version is not None:
                self.log.info("synced version %d: %s", result.version.number,
                              message or "changes from other clients")
                self.health.emit("synced", f"version {result.version.number}: "
                                           f"{message or 'changes from other clients'}")
            if result.short:
                self.log.warning(
                    "version %d has fewer copies than the configuration asks for of %d "
                    "object(s): too few backends take writes; the next cycle adds them "
                    "when they answer", repo.prev.number, len(result.short))
        else:
            # Copies any client spilled while a backend was away go home once it is
            # back, whoever wrote them (a push does this too).
            repo.repair_copies()
        self._rebalance_after = finish_rebalance(repo, self.log, self._rebalance_after)
        self._watch_acceptors(repo)
        self.status.version = repo.prev.number
        # The conflict copies this daemon made that are still here: one resolved
        # (removed or renamed, here or elsewhere) is no longer listed.
        self._conflicts = [c for c in self._conflicts if os.path.lexists(self.root / c)]
        self.status.conflicts = [display_path(c) for c in self._conflicts]
        self.status.state = "idle"
        self.status.reason = ""
        self.status.last_sync = time.time()
        self.status.pending_changes = self.health.stats.pending_changes = 0
        self.status.unpushed = False

    def _commit_offline(self) -> None:
        """Backends unreachable: keep local changes as a local commit, pushed later."""
        try:
            with Repository.open(self.root, wait=0) as repo:
                message = change_message(repo.status().changes, repo.device)
                if repo.commit(f"{message} (offline)" if message else "offline") is not None:
                    self.log.info("committed locally while offline: %s", message)
                st = repo.status()
                record_unsynced(self.status, st.problems, self.log)
                self.status.pending_changes = self.health.stats.pending_changes = len(st.changes)
                self.status.unpushed = st.unpushed
        except MetasyncError as exc:
            self.log.warning("could not commit locally: %s", exc)

    def _pause(self, reason: str, would_delete: list[str] | None = None) -> None:
        """Pause for ``reason``; ``would_delete``: what the held-back sync deletes."""
        if self.status.state != "paused":
            self.log.warning("paused: %s", reason)
            self.health.emit("paused", reason)
        # Only a resume of the deletion guard's own pause lets its deletions through:
        # resuming a pause the user asked for, or one for a missing folder, must not
        # switch the guard off for whatever the next sync finds.
        self._allow_deletes = False
        self._guard_held = would_delete is not None
        self.status.state = "paused"
        self.status.reason = reason
        self.status.would_delete = [display_path(p) for p in (would_delete or [])[:WOULD_DELETE_MAX]]
        self._write_status()

    def _check_paused(self) -> None:
        """Leave the pause when the user resumes, or when a missing folder is back."""
        resume = self.meta / RESUME_FILE
        if resume.exists() or self._resume_asked:
            resume.unlink(missing_ok=True)
            self._resume_asked = False
            self.log.info("resumed by the user")
            self._allow_deletes = self._guard_held
        elif self._user_paused:
            return
        elif "is gone" in self.status.reason and (self.meta / "state.db").is_file():
            self.log.info("%s is back", self.root)
        else:
            return
        self.status.state = "idle"
        self.status.reason = ""
        self.status.would_delete = []
        self._dirty = True
        self._last_event = 0.0

    def _fail(self, exc: BaseException) -> None:
        if self.status.state != "error" or self.status.reason != str(exc):
            self.health.emit("error", str(exc))
        self.status.state = "error"
        self.status.reason = str(exc)
        self.health.stats.errors += 1
        self.log.error("sync failed: %s", exc)

    # --- remote changes --------------------------------------------------------------
    def _open_acceptors(self) -> None:
        with Repository.open(self.root, wait=0) as repo:
            self._watch_acceptors(repo)
            self.status.version = repo.prev.number

    def _watch_acceptors(self, repo: Repository) -> None:
        """Poll the hints of ``repo``'s acceptors from now on (again after the
        configuration changed)."""
        if repo.config_id == self._acceptors_config:
            return
        for backend in self._acceptors.values():
            backend.close()
        self._acceptors = {}
        uris = repo.acceptor_uris()
        for backend_id, uri in uris.items():
            self._acceptors[backend_id] = open_backend(uri, repo.config.namespace)
            self._names[backend_id] = public_uri(uri)
        self._acceptors_config = repo.config_id
        self._remote.restart(uris, repo.config.namespace)

    def _record_backends(self, repo: Repository) -> None:
        self.status.backends = self.health.record(
            repo.config.acceptors, repo.health(), repo.backend_requests(), self._names,
            repo.backend_latencies())

    # --- local changes -------------------------------------------------------------------
    def _watch(self) -> Any:
        """Watch the folder (None, and ``watching`` "scanning", if the OS cannot)."""
        def changed() -> None:
            self._dirty = True
            self._last_event = time.monotonic()
            self._wake.set()

        try:
            return LocalWatch(self.root, changed).start()
        except OSError as exc:
            # ENOSPC from inotify: the user's watch limit is used up.
            self.log.warning("cannot watch %s (%s); scanning every %gs instead",
                             self.root, exc, self.settings.poll)
            self.status.watching = "scanning"
            return None

    # --- files -------------------------------------------------------------------------
    def _take_pid_file(self) -> int:
        """One daemon per folder: the daemon lock (:func:`take_daemon_lock`; the
        returned descriptor holds it), and its pid in ``daemon.pid`` for ``daemon stop``."""
        fd = take_daemon_lock(self.root)
        try:
            _write_pid(self.meta)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _write_status(self) -> None:
        self.status.updated = time.time()
        path = self.meta / STATUS_FILE
        tmp = path.with_name(f".{STATUS_FILE}.tmp")
        try:
            tmp.write_text(json.dumps(asdict(self.status), indent=2))
            os.replace(tmp, path)
        except OSError:
            pass  # the folder is gone: the log says why


class LocalWatch:
    """The watchdog observer of one folder: calls ``changed`` for each event on a
    path that syncs (not ``.metasync/``, not a checkout's temporary files, not an
    ignored path)."""

    def __init__(self, root: Path, changed: Callable[[], None]) -> None:
        self.root = root
        self.changed = changed
        self._ignore: IgnoreRules | None = None

    def start(self) -> Any:
        """The started observer; OSError if the OS cannot watch (no inotify left)."""
        from watchdog.events import FileSystemEvent, FileSystemEventHandler
        from watchdog.observers import Observer

        watch = self

        class Handler(FileSystemEventHandler):
            def on_any_event(self, event: FileSystemEvent) -> None:
                if event.event_type in ("opened", "closed_no_write"):
                    return
                paths = [event.src_path, getattr(event, "dest_path", "")]
                if any(watch.relevant(os.fsdecode(p)) for p in paths if p):
                    watch.changed()

        observer = Observer()
        observer.schedule(Handler(), str(self.root), recursive=True)
        injected = watch_failure()
        if injected is not None:
            raise injected
        observer.start()
        return observer

    def relevant(self, path: str) -> bool:
        try:
            rel = os.path.relpath(path, self.root)
        except ValueError:
            return False
        if rel == "." or rel == ".." or rel.startswith(".." + os.sep):
            return rel == "."
        parts = rel.split(os.sep)
        if parts[0] == META_DIR or parts[-1].startswith(TEMP_PREFIX):
            return False
        if rel == IGNORE_FILE:
            self._ignore = None
            return True
        if self._ignore is None:
            self._ignore = IgnoreRules.load(self.root) or IgnoreRules([])
        return not self._ignore.ignores("/".join(parts), is_dir=os.path.isdir(path))


def _too_many(count: int, total: int, share: float | None) -> bool:
    return share is not None and total >= GUARD_MIN_FILES and count > share * total


def local_deletions_held(repo: Repository, changes: list[Change],
                         share: float | None) -> tuple[str, list[str]] | None:
    """The deletion guard on this folder: ``(why, the paths)`` if ``changes`` delete
    more than ``share`` of the files here, else None. ``share`` None: the user said
    to go on."""
    deleted = [c.path for c in changes if c.kind == "deleted" and c.type != "dir"]
    tracked = repo.tracked_files()
    if not _too_many(len(deleted), tracked, share):
        return None
    return (f"{len(deleted)} of {tracked} files were deleted here at once; resume "
            "(`metasync daemon resume`, or Resume on the service's page) to sync that, "
            "or restore them", deleted)


def remote_deletions_held(repo: Repository, latest: Any,
                          share: float | None) -> tuple[str, list[str]] | None:
    """The deletion guard on others' versions: ``(why, the paths)`` if taking
    ``latest`` deletes more than ``share`` of the files of this folder's version."""
    if not (latest.number > repo.prev.number and latest.master and repo.prev.master):
        return None
    before_tree = repo.tree_at(repo.prev.master)
    after_tree = repo.tree_at(latest.master)
    before = _file_count(before_tree)
    gone = [p for p, e in before_tree.items() if e.type != "dir" and p not in after_tree]
    if not _too_many(len(gone), before, share):
        return None
    return (f"version {latest.number} deletes {len(gone)} of {before} files; resume "
            "(`metasync daemon resume`, or Resume on the service's page) to take it", gone)


def setup_logging(log: logging.Logger, meta: Path) -> None:
    """A daemon's log goes to ``meta/daemon.log`` (rotated), else to stderr."""
    log.setLevel(logging.INFO)
    log.propagate = False
    fmt = logging.Formatter("%(asctime)s %(levelname)s %(message)s")
    try:
        handler: logging.Handler = logging.handlers.RotatingFileHandler(
            meta / LOG_FILE, maxBytes=1_000_000, backupCount=3, encoding="utf-8",
            errors="backslashreplace")
    except OSError:
        handler = logging.StreamHandler()
    handler.setFormatter(fmt)
    log.addHandler(handler)


def close_logging(log: logging.Logger) -> None:
    """Close and drop ``log``'s handlers (a daemon that ends inside a bigger process)."""
    for handler in list(log.handlers):
        log.removeHandler(handler)
        handler.close()


def take_daemon_lock(root: Path) -> int:
    """One daemon per folder, in any process (a ``metasync daemon`` or a service):
    an exclusive lock on ``daemon.lock``, held while the returned descriptor is
    open. UsageError if another holds it; OSError if the folder is not there."""
    fd = os.open(root / META_DIR / DAEMON_LOCK, os.O_RDWR | os.O_CREAT, 0o600)
    if not try_lock(fd):
        os.close(fd)
        raise UsageError(f"a metasync daemon already runs for {root} (or the service "
                         "runs it); see `metasync daemon status`")
    return fd


def finish_rebalance(repo: Repository, log: logging.Logger, after: float) -> float:
    """Finish the rebalance a configuration change made here left undone (a crash
    right after its decision, or a backend that did not answer): copies left on
    a removed backend or by the old placement are moved and dropped, as
    ``metasync rebalance`` does. It reads every backend's listing, so one that
    stays unclean is tried again after REBALANCE_RETRY seconds, not every cycle: the
    monotonic time before which it is not tried (``after``) is returned."""
    if time.monotonic() < after or not repo.rebalance_pending():
        return after
    report = repo.rebalance()
    log.info("finished the rebalance of a configuration change: %d copies written, "
             "%d dropped", report.copied, report.dropped)
    if repo.rebalance_pending():
        after = time.monotonic() + REBALANCE_RETRY
        log.warning("the rebalance of a configuration change is not complete yet "
                    "(%d copies kept, unreachable: %s); it is tried again later",
                    report.kept, ", ".join(sorted(report.unreachable)) or "none")
    return after


def _write_pid(meta: Path) -> None:
    """This process's pid in ``daemon.pid``, written atomically (``daemon stop`` reads it)."""
    tmp = meta / f".{PID_FILE}.tmp"
    tmp.write_text(f"{os.getpid()}\n")
    os.replace(tmp, meta / PID_FILE)


def _describe(exc: BaseException) -> str:
    """One line naming ``exc`` (never empty, and printable: a message may quote a
    file name that is not UTF-8)."""
    text = str(exc).splitlines()[0] if str(exc).strip() else ""
    text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def record_unsynced(status: DaemonStatus, problems: ScanProblems, log: logging.Logger) -> None:
    """Show what the scan could not sync in ``status``; log it when it changes."""
    # Quoted display form: a name that is not UTF-8 never reaches daemon.json raw.
    unreadable = [f"{display_path(u.display())} ({u.reason})" for u in problems.unreadable]
    if unreadable != status.unreadable and unreadable:
        log.warning("cannot read (not synced): %s", ", ".join(unreadable))
    status.unreadable = unreadable
    status.skipped = [f"{display_path(u.display())} ({u.reason})" for u in problems.special]


def _file_count(tree: dict[str, Any]) -> int:
    return sum(1 for e in tree.values() if e.type != "dir")


def read_status(root: Path) -> dict[str, Any]:
    """The daemon's last written status, with ``state`` ``stopped`` if it is not running."""
    meta = root / META_DIR
    try:
        doc: dict[str, Any] = json.loads((meta / STATUS_FILE).read_text())
    except (OSError, ValueError):
        doc = {"state": "stopped", "pid": None}
    pid = doc.get("pid")
    if not isinstance(pid, int) or not process_alive(pid) or not daemon_running(root):
        doc["state"] = "stopped"
    return doc


def running_pid(root: Path) -> int | None:
    if not daemon_running(root):
        return None
    try:
        return int((root / META_DIR / PID_FILE).read_text().strip())
    except (OSError, ValueError):
        return None

