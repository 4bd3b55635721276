"""The change feeds of the cloud-provider backends: the two shapes their APIs take.

:class:`LongPollFeed` (Dropbox ``files/list_folder/longpoll``, Box's realtime
server): the service holds a request open until something changes. One long-poll is
kept in flight by a worker thread of the feed, across :meth:`~LongPollFeed.wait`
calls: a wait that times out leaves it open (no request is wasted), a change it
reports is kept until the next wait, and a failure is raised by the next wait (the
caller backs off and calls again, which starts a new worker). Because no wait hangs
on the request, each long-poll asks for the provider's longest sensible wait whatever
the caller's timeout: an idle namespace costs the requests of one round per
:attr:`LongPollFeed.round_seconds`. The starting point (cursor, stream position) is
taken by the first wait itself, before it returns, so nothing written after that
first call is missed. Long-polls hold no transfer slot of the backend: a wait of
minutes must not stall uploads.

:class:`CursorFeed` (Google Drive ``changes.list``, OneDrive ``delta``): a saved
cursor asked "what changed since?" every :data:`CURSOR_INTERVAL` seconds -- an idle
backend costs ``3600 / CURSOR_INTERVAL`` requests an hour -- and, for
:data:`CURSOR_ACTIVE_SPAN` seconds after a change, every
:data:`CURSOR_ACTIVE_INTERVAL` seconds: changes come in bursts (a push, then the
others' answers), and the next ones are then seen within seconds.

Both honour the caller's timeout (no request is started past it, and none is waited
for past it by a long-poll feed) and return promptly after :meth:`close` from any
thread: their waits are on an event that :meth:`close` sets. What a service answers
is trusted only as "look again": a feed may fire on a change outside the namespace it
could not rule out, never stay silent after one inside it.
"""

from __future__ import annotations

import abc
import logging
import threading
import time
from dataclasses import dataclass

from metasync.backends.feeds import ChangeFeed

log = logging.getLogger("metasync.backends")

#: Seconds between two asks of an idle cursor feed: ``3600 / 30 = 120`` requests an
#: hour per idle backend at most (issue 19's budget).
CURSOR_INTERVAL = 32.0
#: After a change, a cursor feed asks every this many seconds, for this long.
CURSOR_ACTIVE_INTERVAL = 2.0
CURSOR_ACTIVE_SPAN = 60.0
#: Longest ``backoff``/``retry`` wait a service may impose on a feed, seconds (a
#: longer one is cut to this: a broken answer must not silence a feed for a day).
MAX_BACKOFF = 900.0


@dataclass(frozen=True)
class PollAnswer:
    """What one long-poll round learnt."""

    #: Something may have changed in the namespace.
    changed: bool
    #: Seconds the service asked to wait before the next long-poll (0: none).
    backoff: float = 0.0


class LongPollFeed(ChangeFeed):
    """A feed over a long-poll (see the module docstring). A subclass gives
    :meth:`_begin`, :meth:`_poll_round` and :attr:`round_seconds`; the first two may
    raise :class:`BackendError`."""

    kind = "longpoll"

    def __init__(self, name: str) -> None:
        #: For messages and the worker thread's name.
        self.name = name
        self._cond = threading.Condition()
        self._closing = threading.Event()
        self._begun = False
        self._changed = False
        self._error: BaseException | None = None
        self._worker: threading.Thread | None = None
        #: Long-poll rounds finished (each is the requests of one :meth:`_poll_round`).
        self.rounds = 0

    @property
    @abc.abstractmethod
    def round_seconds(self) -> float:
        """Seconds one long-poll round lasts at the provider when nothing changes: an
        idle feed costs the requests of one round per this long."""

    @abc.abstractmethod
    def _begin(self) -> None:
        """Take the starting point: changes after it are reported."""

    @abc.abstractmethod
    def _poll_round(self) -> PollAnswer:
        """One long-poll (the provider's longest sensible wait), and if it reports a
        change, whatever moves the starting point past that change (so the next round
        waits for a new one)."""

    def wait(self, timeout: float) -> bool:
        deadline = time.monotonic() + max(0.0, timeout)
        if self._closing.is_set():
            return False
        if not self._begun:
            self._begin()
            self._begun = True
        with self._cond:
            if self._worker is None and self._error is None and not self._changed:
                self._worker = threading.Thread(
                    target=self._run, name=f"change feed {self.name}", daemon=True
                )
                self._worker.start()
            while True:
                if self._closing.is_set():
                    return False
                if self._error is not None:
                    error, self._error = self._error, None
                    raise error
                if self._changed:
                    self._changed = False
                    return True
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)

    def _run(self) -> None:
        """The worker: long-poll rounds until closed or failed (then the next wait
        raises the failure and starts another worker)."""
        try:
            while not self._closing.is_set():
                answer = self._poll_round()
                with self._cond:
                    self.rounds += 1
                    if answer.changed:
                        self._changed = True
                        self._cond.notify_all()
                if answer.backoff > 0:
                    # The service asked for a pause; close() ends it at once.
                    self._closing.wait(min(answer.backoff, MAX_BACKOFF))
        except BaseException as exc:  # handed to the waiting thread, raised there
            with self._cond:
                if not self._closing.is_set():
                    self._error = exc
                self._worker = None
                self._cond.notify_all()
            return
        with self._cond:
            self._worker = None

    def close(self) -> None:
        self._closing.set()
        with self._cond:
            self._cond.notify_all()

    def join(self, timeout: float) -> bool:
        """After :meth:`close`: wait up to ``timeout`` seconds for the long-poll in
        flight to end (it is not cut short; its answer is dropped). True if no worker
        is left. For an orderly shutdown, and for tests that count requests."""
        with self._cond:
            worker = self._worker
        if worker is None:
            return True
        worker.join(timeout)
        return not worker.is_alive()


class CursorFeed(ChangeFeed):
    """A feed over a saved cursor asked at an interval (see the module docstring).
    A subclass gives :meth:`_begin` and :meth:`_changed_since`."""

    kind = "cursor"

    def __init__(self, name: str) -> None:
        self.name = name
        #: Seconds between two asks while idle (the idle cost is ``3600 / interval``
        #: asks an hour), and after a change (for ``active_span`` seconds after it).
        #: Tests shorten them on the instance.
        self.interval = CURSOR_INTERVAL
        self.active_interval = CURSOR_ACTIVE_INTERVAL
        self.active_span = CURSOR_ACTIVE_SPAN
        self._closing = threading.Event()
        self._begun = False
        self._next = 0.0
        self._active_until = float("-inf")
        #: Asks made (each is the requests of one :meth:`_changed_since`).
        self.checks = 0

    @abc.abstractmethod
    def _begin(self) -> None:
        """Save the cursor of "now": changes after it are reported."""

    @abc.abstractmethod
    def _changed_since(self) -> bool:
        """Ask what changed since the saved cursor and save the new one; True if a
        change may concern the namespace."""

    def wait(self, timeout: float) -> bool:
        deadline = time.monotonic() + max(0.0, timeout)
        if self._closing.is_set():
            return False
        if not self._begun:
            self._begin()
            self._begun = True
            self._next = time.monotonic() + self.interval
        while not self._closing.is_set():
            now = time.monotonic()
            if now >= self._next:
                # The next ask is due an interval after this one started, whatever it
                # answers or raises: a failing service is not asked more often.
                active = now < self._active_until
                self._next = now + (self.active_interval if active else self.interval)
                self.checks += 1
                if self._changed_since():
                    self._active_until = now + self.active_span
                    self._next = now + self.active_interval
                    return True
                continue
            if now >= deadline:
                return False
            self._closing.wait(min(self._next, deadline) - now)
        return False

    def close(self) -> None:
        self._closing.set()
