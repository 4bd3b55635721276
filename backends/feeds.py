"""Change feeds: how a client learns, cheaply and at once, that a backend changed.

The MetaSync paper's backend abstraction has ``poll(path)``, built on the
provider's own change notification. A :class:`ChangeFeed` is that: the watch
daemon blocks in :meth:`ChangeFeed.wait` on each acceptor (one thread each) and
reads the acceptors' ``latest`` hints only when some feed fired. Each backend
kind returns its own feed from :meth:`Backend.change_feed` and declares its
kind in ``Capabilities.change_feed``:

- ``longpoll``: the service holds a request open until something changes
  (Dropbox ``list_folder/longpoll``, Box's event long-poll);
- ``cursor``: a saved cursor/page token asked "what changed since?" at an
  interval (Google Drive ``changes.list``, OneDrive ``delta``): one cheap
  request per interval;
- ``notify``: the operating system tells (``dir:``, inotify on the log folder);
- ``poll``: nothing better than reading the hint, at an interval that grows
  while nothing changes and is short right after a change (S3, SFTP, WebDAV).

A feed may fire when nothing relevant changed (a false alarm costs one hint
read per acceptor); it must not stay silent after a change for longer than its
interval. Nothing a feed returns is trusted beyond "look again".
"""

from __future__ import annotations

import abc
import threading
import time
from typing import Any

#: The kinds ``Capabilities.change_feed`` names, best first.
FEED_KINDS = ("notify", "longpoll", "cursor", "poll")


class ChangeFeed(abc.ABC):
    """One backend's change notification for one namespace. Not shared between
    threads except for :meth:`close`, which any thread may call."""

    #: One of :data:`FEED_KINDS`.
    kind: str = "poll"

    @abc.abstractmethod
    def wait(self, timeout: float) -> bool:
        """Block for at most ``timeout`` seconds (also bounded by the backend's own
        ``--timeout`` per request); return True if the namespace may have changed
        since the previous call (the first call only establishes the starting
        point and may return False at once), False if the time ran out with no
        change seen. A network failure raises the usual :class:`BackendError`;
        the caller backs off and calls again. Returns promptly after :meth:`close`."""

    @abc.abstractmethod
    def close(self) -> None:
        """Unblock a :meth:`wait` in progress and release what the feed holds.
        Idempotent."""


class PollSchedule:
    """The interval of a :class:`PollingFeed`, with no clock of its own (tests drive it):
    ``short`` seconds right after a change and for ``hot`` looks more (changes come
    in bursts: a user saving files, another machine syncing a batch), then
    multiplied by ``factor`` after each look that saw nothing, up to ``cap``. The
    defaults notice a change within 2 s during the minute after the last one, and
    cost at most 60 + a few dozen looks in an idle hour."""

    def __init__(self, short: float = 2.0, cap: float = 60.0, factor: float = 2.0,
                 hot: int = 30) -> None:
        if not 0 < short <= cap or factor < 1 or hot < 0:
            raise ValueError(f"poll schedule needs 0 < short <= cap, factor >= 1 and hot >= 0, "
                             f"got short={short} cap={cap} factor={factor} hot={hot}")
        self.short, self.cap, self.factor, self.hot = short, cap, factor, hot
        self.interval = short
        self._quiet = 0  # looks that saw nothing since the last change

    def saw_change(self) -> float:
        """A look found a change: the next looks come after ``short`` seconds (others
        often follow a change: a push writes log entries, then the hint)."""
        self.interval = self.short
        self._quiet = 0
        return self.interval

    def saw_nothing(self) -> float:
        """A look found nothing: after ``hot`` such looks, each waits longer, up to
        ``cap``."""
        self._quiet += 1
        if self._quiet > self.hot:
            self.interval = min(self.cap, self.interval * self.factor)
        return self.interval


class PollingFeed(ChangeFeed):
    """The feed of a backend with no change notification (S3, SFTP, WebDAV, rclone):
    reads the poll token of one key -- the repository's ``latest`` hint, which every
    push rewrites -- on a :class:`PollSchedule`. One request per look; a change is
    seen at the next look, at most ``cap`` seconds later."""

    kind = "poll"

    def __init__(self, backend: Any, key: str, schedule: PollSchedule | None = None) -> None:
        self.backend = backend
        self.key = key
        self.schedule = schedule or PollSchedule()
        self._token: str | None = None
        self._started = False
        self._next = 0.0
        self._closed = threading.Event()

    def wait(self, timeout: float) -> bool:
        if not self._started:
            self._token = self.backend.poll(self.key)
            self._started = True
            self._next = time.monotonic() + self.schedule.interval
            return False
        deadline = time.monotonic() + timeout
        while not self._closed.is_set():
            now = time.monotonic()
            if now < self._next:
                if now >= deadline:
                    return False
                self._closed.wait(min(self._next, deadline) - now)
                continue
            token = self.backend.poll(self.key)  # BackendError: the caller backs off
            changed = token != self._token
            self._token = token
            step = self.schedule.saw_change() if changed else self.schedule.saw_nothing()
            self._next = time.monotonic() + step
            if changed:
                return True
        return False

    def close(self) -> None:
        self._closed.set()
