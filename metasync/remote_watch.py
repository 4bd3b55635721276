"""How the daemon learns that another client pushed: one change feed per acceptor.

Each acceptor's :meth:`~metasync.backends.base.Backend.change_feed` runs in a thread
of its own (:class:`RemoteWatch`); any fire marks the daemon's remote side pending
and wakes its loop, which then syncs (reading the acceptors' ``latest`` hints and
pulling, as a poll that saw a moved hint does). A feed fires once when it has
started (its starting point set), and again when it works after failing: what
changed before is looked at, whenever the daemon's last look was. The kinds
(docs/daemon.md):

- ``notify`` (``dir:``: inotify on the namespace and log folders), ``longpoll``
  (Dropbox, Box), ``cursor`` (Google Drive, OneDrive): the feed sees every write
  to the namespace, log entries included, so the daemon reads no hint on a timer,
  and its periodic full remote check (for a client that died before writing its
  hint) becomes rare (:data:`RARE_REMOTE_CHECK`);
- ``poll`` (S3, SFTP, WebDAV, rclone): the feed reads the ``latest`` hint on a
  schedule that grows while nothing changes (:class:`~metasync.backends.feeds.PollSchedule`).

An acceptor whose feed failed (or that has none) is polled by the daemon as before,
every ``--poll`` seconds, while its feed backs off (:data:`BACKOFF_START` doubling
to :data:`BACKOFF_CAP`); the failure is said in the log once, and its recovery once.
``METASYNC_CHANGE_FEEDS=0`` turns feeds off (the polling of before: benchmarks
compare the two).

Each feed opens its own backend instance from the acceptor's URI: the daemon's
instances are used by its own thread only.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable

from metasync.backends import Backend, open_backend, public_uri
from metasync.backends.feeds import ChangeFeed
from metasync.errors import BackendUnavailable, MetasyncError
from metasync.faults import feed_failures

#: Feed kinds that see every write to the namespace (a log entry without its hint too).
WHOLE_NAMESPACE = frozenset({"notify", "longpoll", "cursor"})
#: Seconds between full remote checks when every acceptor has such a feed.
RARE_REMOTE_CHECK = 1800.0
#: Longest single :meth:`ChangeFeed.wait`; a feed returns on a change sooner.
WAIT_SLICE = 120.0
#: Seconds before a failed feed is tried again, doubling per failure up to the cap.
BACKOFF_START = 2.0
BACKOFF_CAP = 300.0
#: Seconds :meth:`RemoteWatch.stop` waits for each feed's thread.
STOP_WAIT = 30.0
#: The environment variable that turns feeds off (``0``, ``off``, ``no``, ``false``).
FEEDS_ENV = "METASYNC_CHANGE_FEEDS"

Opener = Callable[[str, str], Backend]
#: ``(backend id, seconds, error or None)`` of one hint read by the daemon.
PollReport = Callable[[str, float, "str | None"], None]


def feeds_enabled() -> bool:
    """Whether feeds run (:data:`FEEDS_ENV` is not set to something false)."""
    return os.environ.get(FEEDS_ENV, "1").strip().lower() not in ("0", "off", "no", "false")


def backoff_delay(failures: int, start: float = BACKOFF_START, cap: float = BACKOFF_CAP) -> float:
    """Seconds to wait after the ``failures``-th failure in a row (1, 2, ...)."""
    return min(cap, start * 2 ** max(0, failures - 1))


class _Feed:
    """One acceptor's feed thread and what the daemon reads of it."""

    def __init__(self, watch: RemoteWatch, backend_id: str, uri: str) -> None:
        self.watch = watch
        self.backend_id = backend_id
        self.uri = uri
        self.name = public_uri(uri)
        #: The running feed's kind while it works, None while it fails or has none.
        self.kind: str | None = None
        #: Failures in a row, and every backoff delay waited (tests read them).
        self.failures = 0
        self.delays: list[float] = []
        self.opened = 0
        #: Set once the feed has fired for its start (tests wait for it).
        self.started = threading.Event()
        self.stopping = threading.Event()
        self._feed: ChangeFeed | None = None
        self._lock = threading.Lock()
        self.thread = threading.Thread(target=self._run, daemon=True,
                                       name=f"metasync-feed-{backend_id}")

    def _run(self) -> None:
        backend: Backend | None = None
        fresh = False  # a feed just made: its first wait only set its starting point
        try:
            while not self.stopping.is_set():
                try:
                    if backend is None:
                        backend = self.watch.opener(self.uri, self.watch.namespace)
                    if self._feed is None:
                        self.opened += 1
                        if self.opened <= feed_failures():
                            raise BackendUnavailable(f"{self.name} is unreachable "
                                                     "(injected: METASYNC_FAIL_FEEDS)")
                        feed = backend.change_feed(self.watch.watch_key)
                        if feed is None:
                            return  # none: the daemon polls this acceptor's hint
                        with self._lock:
                            if self.stopping.is_set():
                                feed.close()
                                return
                            self._feed = feed
                        if not self.failures:
                            self.kind = feed.kind
                        fresh = True
                    fired = self._feed.wait(WAIT_SLICE)
                except Exception as exc:  # any failure: back off, never end the daemon
                    self._failed(exc)
                    continue
                if self.failures:
                    self.watch.log.info("change feed of %s works again", self.name)
                    self.failures = 0
                    fired = True  # what changed while it failed is looked at now
                start, fresh = fresh, False
                if start:
                    # The starting point is set: what changed between the daemon's
                    # last look and it is looked at now (the feeds start after the
                    # daemon's first look, a new configuration's after the sync
                    # that found it; a push in between fired no feed).
                    fired = True
                self.kind = self._feed.kind
                if fired and not self.stopping.is_set():
                    self.watch.fire()
                if start:
                    self.started.set()
        finally:
            self.kind = None
            self._close_feed()
            if backend is not None:
                backend.close()

    def _failed(self, exc: Exception) -> None:
        self.kind = None
        self._close_feed()
        self.failures += 1
        if self.failures == 1:
            self.watch.log.warning(
                "change feed of %s failed (%s); its hint is polled meanwhile and the "
                "feed is tried again with backoff", self.name, _one_line(exc))
        delay = backoff_delay(self.failures, self.watch.backoff_start, BACKOFF_CAP)
        self.delays.append(delay)
        self.stopping.wait(delay)

    def _close_feed(self) -> None:
        with self._lock:
            feed, self._feed = self._feed, None
        if feed is not None:
            feed.close()

    def stop(self) -> None:
        with self._lock:
            self.stopping.set()
            feed = self._feed
        if feed is not None:
            feed.close()  # unblocks its wait; the thread closes it again (idempotent)


class RemoteWatch:
    """The change feeds of one daemon's acceptors: :meth:`restart` on each
    configuration, :meth:`take_fired` in the loop, :meth:`stop` at the end."""

    def __init__(self, wake: threading.Event, log: logging.Logger, watch_key: str, *,
                 opener: Opener = open_backend, enabled: bool | None = None,
                 backoff_start: float = BACKOFF_START) -> None:
        self.wake = wake
        self.log = log
        self.watch_key = watch_key
        self.opener = opener
        self.enabled = feeds_enabled() if enabled is None else enabled
        self.backoff_start = backoff_start
        self.namespace = ""
        self.feeds: dict[str, _Feed] = {}
        self._uris: dict[str, str] = {}
        self._fired = threading.Event()
        self._tokens: dict[str, str | None] = {}
        self._last_full = time.monotonic()

    def restart(self, uris: dict[str, str], namespace: str) -> None:
        """Watch the acceptors ``uris`` (backend id -> URI) of ``namespace``; the
        running feeds are stopped first unless they watch exactly these."""
        if not self.enabled or (uris == self._uris and namespace == self.namespace):
            return
        self.stop()
        self._uris, self.namespace = dict(uris), namespace
        self.feeds = {b: _Feed(self, b, uri) for b, uri in uris.items()}
        self.log.info("watching %s for changes", ", ".join(f.name for f in self.feeds.values()))
        for feed in self.feeds.values():
            feed.thread.start()

    def fire(self) -> None:
        self._fired.set()
        self.wake.set()

    def take_fired(self) -> bool:
        """Whether some feed fired since the last call."""
        if not self._fired.is_set():
            return False
        self._fired.clear()
        return True

    def unwatched(self, acceptors: dict[str, Backend]) -> dict[str, Backend]:
        """Those of ``acceptors`` whose hint the daemon still polls: no working feed."""
        return {b: backend for b, backend in acceptors.items()
                if b not in self.feeds or self.feeds[b].kind is None}

    def hints_moved(self, acceptors: dict[str, Backend],
                    on_poll: PollReport | None = None) -> bool:
        """Read the ``latest`` hint of each of ``acceptors`` (the daemon's own instances,
        used from its thread) that has no working feed; True if one changed since the
        last look (or was never looked at). An unreachable one is skipped.
        ``on_poll(backend_id, seconds, error or None)`` hears of each read."""
        moved = False
        # A new configuration's acceptors are looked at afresh.
        self._tokens = {b: t for b, t in self._tokens.items() if b in acceptors}
        for backend_id, backend in self.unwatched(acceptors).items():
            started = time.monotonic()
            try:
                token = backend.poll(self.watch_key)
            except MetasyncError as exc:
                if on_poll is not None:
                    on_poll(backend_id, 0.0, str(exc))
                continue
            if on_poll is not None:
                on_poll(backend_id, time.monotonic() - started, None)
            if self._tokens.get(backend_id, "unseen") != token:
                moved = True
            self._tokens[backend_id] = token
        return moved

    def full_check_due(self) -> bool:
        """Whether the periodic full check includes the backends: always unless every
        acceptor's feed sees the whole namespace, and then every
        :data:`RARE_REMOTE_CHECK` seconds."""
        now = time.monotonic()
        whole = bool(self.feeds) and all(f.kind in WHOLE_NAMESPACE for f in self.feeds.values())
        if whole and now - self._last_full < RARE_REMOTE_CHECK:
            return False
        self._last_full = now
        return True

    def stop(self) -> None:
        """Stop every feed and wait for its thread (a request in progress ends within
        the backend's ``--timeout``)."""
        feeds, self.feeds, self._uris = self.feeds, {}, {}
        for feed in feeds.values():
            feed.stop()
        for feed in feeds.values():
            if feed.thread.is_alive() and feed.thread is not threading.current_thread():
                feed.thread.join(STOP_WAIT)
                if feed.thread.is_alive():
                    self.log.warning("change feed of %s did not stop within %gs; left behind",
                                     feed.name, STOP_WAIT)


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
