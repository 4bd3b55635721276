"""Retries with exponential backoff and full jitter for network backends.

Every network backend wraps each service request in :func:`retrying`, so that a
timeout, a dropped connection, a 5xx or a throttling answer costs a short wait
instead of a failed command. Only errors a backend marks ``transient`` are retried;
"not found", "access denied" and bad input fail at once. Each attempt of a request
through an SDK runs in :func:`translated`, which turns what the SDK raises into
those errors with the backend's own mapping.

The schedule is "full jitter" (AWS Architecture Blog, "Exponential Backoff and
Jitter"): attempt *n* waits a uniformly random time in ``[0, min(cap, base·2ⁿ)]``,
so clients that failed together do not retry together. A service's own
``Retry-After`` is honoured when the backend passes it on (``retry_after``).

A request's retries also stop once its policy's ``budget`` (the backend's network
timeout, never more than ``--timeout``: :func:`metasync.timeouts.network_timeout`)
has passed since its first attempt, and a backoff that would end past it is not
waited: a server that accepts connections and then says nothing costs one timeout,
not one per attempt. Once a request has ended with no answer
(:class:`~metasync.errors.NoAnswer`), the backend's next requests fail at once
(:class:`~metasync.errors.PausedBackend`, never sent) for a pause as long as the
silence already seen (twice the budget, 5-60 s; :class:`Silence`, a circuit
breaker); then one request is let through (the probe), and until it answers or
fails (or has been out for three times the budget: answers are coming) the others
still fail at once; a probe that gets no answer starts a pause as long as the whole
silence so far (at most 10 minutes; unless ``METASYNC_SILENCE_PAUSE`` fixes it).
The pause belongs to the backend's URI, not to one object of it: a daemon's next
sync pass, which opens its backends afresh, does not ask a silent backend again
before it is over. A push to a silent backend among answering ones costs one
timeout, not one per request made to it (consensus, uploads, listings, the client
state). An answer of any kind, even "not found", ends the pause; a timeout of a
request sent before the backend's last answer does not start one, and one sent
before the silence began changes nothing.

Tuning, for tests and slow links: ``METASYNC_RETRY_ATTEMPTS`` (default 5),
``METASYNC_RETRY_BASE`` (seconds, default 0.2) and ``METASYNC_SILENCE_PAUSE``
(seconds; default twice the budget, 5-60).
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from metasync.errors import BackendError, NoAnswer, PausedBackend
from metasync.errors import (
    TransientError as TransientError,  # re-exported: backends raise it from here
)

log = logging.getLogger("metasync.backends")

T = TypeVar("T")

#: Waits at least this long are logged at info level (a throttling service).
LONG_WAIT = 5.0


def parse_retry_after(value: str | None, now: float | None = None) -> float | None:
    """Seconds to wait from a ``Retry-After`` header value (delay seconds or an HTTP
    date, RFC 9110 §10.2.3), never negative; None if ``value`` is missing, blank or
    neither. ``now`` (Unix time) is for tests."""
    if value is None or not value.strip():
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    from email.utils import parsedate_to_datetime

    try:
        when = parsedate_to_datetime(value).timestamp()
    except (TypeError, ValueError):
        return None
    return max(0.0, when - (time.time() if now is None else now))


def _env_number(name: str, default: float) -> float:
    try:
        return float(os.environ.get(name, default))
    except ValueError:
        return default


@dataclass
class RetryPolicy:
    """How often and how long to retry one request."""

    attempts: int = field(default_factory=lambda: max(1, int(_env_number("METASYNC_RETRY_ATTEMPTS", 5))))
    base: float = field(default_factory=lambda: _env_number("METASYNC_RETRY_BASE", 0.2))
    cap: float = 20.0
    #: Longest ``Retry-After`` honoured; a longer one fails the request (the caller
    #: records the copy as missing and the daemon or ``fsck --repair`` completes it).
    max_retry_after: float = 120.0
    #: Seconds after a request's first failure past which it is not retried again
    #: (None: only ``attempts`` bounds it): a silent server costs two timeouts, not
    #: ``attempts`` of them. Counted from the failure, not the first attempt, so a
    #: long upload that drops is still retried. A service's own ``Retry-After`` is
    #: bounded by ``max_retry_after`` instead. Backends set it to their network timeout.
    budget: float | None = None
    #: Counts retries made, for tests and progress output (shared by all threads).
    retries: int = 0
    #: The backend's pause after a request got no answer (shared by all threads).
    silence: Silence = field(default_factory=lambda: Silence())  # defined below
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def delay(self, attempt: int, retry_after: float | None) -> float:
        """Seconds to wait before retry number ``attempt`` (0-based)."""
        if retry_after is not None:
            return max(0.0, retry_after)
        return random.uniform(0, min(self.cap, self.base * (2**attempt)))

    def count_retry(self) -> None:
        with self._lock:
            self.retries += 1


class Silence:
    """A backend's pause after one of its requests got no answer: a circuit breaker
    (closed; open for :meth:`pause_for` seconds after a :class:`NoAnswer`; then
    half-open, one request let through). Thread-safe: one per backend."""

    def __init__(self, pause: float | None = None) -> None:
        #: Seconds of a pause (None: :meth:`pause_for` the policy's budget).
        self.pause = pause if pause is not None else _env_pause()
        #: Requests refused while paused (for tests).
        self.skipped = 0
        self._lock = threading.Lock()
        self._until = 0.0  # 0: not paused
        self._length = 0.0  # of the current pause
        # The one request let through after a pause (its number; 0: none out), the
        # thread that sent it (its nested requests go too) and when it was sent.
        self._probe = 0
        self._probes = 0
        self._prober = 0
        self._probe_sent = 0.0
        self._probe_limit = 0.0  # seconds after which the probe counts as answered
        self._began = (0.0, "")  # when the pause began, and the failure that began it
        self._answered_at = float("-inf")

    def pause_for(self, budget: float | None) -> float:
        """How long a first pause lasts: :attr:`pause`, else as long as the silence
        already seen (a request's two attempts: twice ``budget``), at least 5 s and at
        most 60. A probe that gets no answer either starts a longer one
        (:meth:`went_silent`)."""
        if self.pause is not None:
            return self.pause
        return 60.0 if budget is None else min(60.0, max(5.0, 2 * budget))

    def admit(self, what: str, budget: float | None = None) -> tuple[int, PausedBackend | None]:
        """The number of the probe if request ``what`` (whose policy's budget is
        ``budget``) is the one let through after a pause (else 0), and the error it
        fails with at once instead (None: it may be sent)."""
        if not self._until:
            return 0, None
        now = time.monotonic()
        with self._lock:
            if not self._until:
                return 0, None
            if self._probe and now - self._probe_sent > self._probe_limit:
                # Out for longer than a silent backend would keep it (its attempts'
                # timeouts): answers are coming (a big transfer on a slow link).
                self._until, self._probe = 0.0, 0
                return 0, None
            if now >= self._until and not self._probe:
                self._probes += 1
                self._probe, self._prober, self._probe_sent = (
                    self._probes, threading.get_ident(), now)
                self._probe_limit = (PROBE_LIMIT * budget if budget is not None
                                     else self._length)
                return self._probe, None
            if self._probe and self._prober == threading.get_ident():
                return 0, None  # a request the probe makes on its way
            self.skipped += 1
            since, first = self._began
            # When it is asked again: what a user looking at a paused backend wants.
            again = ("is being asked again now" if self._probe
                     else f"is asked again in {max(1.0, self._until - now):.0f}s")
        return 0, PausedBackend(
            f"{what}: not sent, the backend gave no answer {now - since:.0f}s ago and "
            f"{again} ({first})")

    def answered(self) -> None:
        """An answer came: the backend is not silent (ends a pause). Every request
        that gets one comes here: the lock is taken only while paused."""
        self._answered_at = time.monotonic()  # one store: racing answers differ by microseconds
        if self._until:
            self.end()

    def end(self) -> None:
        """End the pause now: an answer came, or the user asked to sync now (a
        backend that is back should not wait out up to ten minutes)."""
        with self._lock:
            self._until, self._probe = 0.0, 0

    def went_silent(self, exc: NoAnswer, sent_at: float, budget: float | None,
                    probe: int = 0) -> None:
        """A request sent at ``sent_at`` (monotonic) ended with ``exc``: pause,
        unless the backend answered another request since it was sent.

        While a silence is under way, a request sent before it began says nothing
        new and changes nothing; the probe's failure (``probe``: its number from
        :meth:`admit`) starts a pause as long as the whole silence so far, up to
        :data:`LONGEST_PAUSE` (a daemon facing a provider gone for hours waits out a
        probe's timeouts once in a long pause, not once a minute); no failure
        shortens a pause."""
        now = time.monotonic()
        with self._lock:
            if self._answered_at >= sent_at:
                return  # a stale failure: the backend answered since
            length = self.pause_for(budget)
            if not self._until:  # a new silence
                self._began = (now, str(exc))
                self._length, self._until, self._probe = length, now + length, 0
                return
            if sent_at < self._began[0]:
                return  # sent before this silence began: nothing new
            if probe and probe == self._probe:
                self._probe = 0
                if self.pause is None:
                    length = min(LONGEST_PAUSE, max(length, now - self._began[0]))
            if now + length > self._until:
                self._length, self._until = length, now + length

    def probe_failed(self, probe: int) -> None:
        """Probe number ``probe`` failed otherwise (refused, dropped): let the next
        request through in its place (unless a newer pause or probe came since)."""
        with self._lock:
            if self._probe == probe:
                self._probe = 0


#: The longest pause (seconds) after probes of a silent backend got no answer.
LONGEST_PAUSE = 600.0
#: A probe out for this many times its budget is getting answers (a silent backend
#: fails it within two timeouts, its one retry included): the others go too.
PROBE_LIMIT = 3

#: Every network backend's pause in this process, by the backend's URI: a service's
#: silence outlives the backend object that met it (the daemon opens its backends
#: afresh for each sync pass; without this each pass waited out the timeout again).
_silences: dict[str, Silence] = {}
_silences_lock = threading.Lock()


def silence_of(uri: str) -> Silence:
    """The pause of the backend at ``uri``: one :class:`Silence` for every object of
    that backend this process opens."""
    with _silences_lock:
        return _silences.setdefault(uri, Silence())


def end_pause(uri: str) -> None:
    """End the pause of the backend at ``uri`` now, if it has one (:meth:`Silence.end`)."""
    with _silences_lock:
        silence = _silences.get(uri)
    if silence is not None:
        silence.end()


def _env_pause() -> float | None:
    value = _env_number("METASYNC_SILENCE_PAUSE", -1.0)
    return value if value >= 0 else None


class RetryMark:
    """An ``on_retry`` hook for :func:`retrying` that marks whether an attempt failed
    in a way that may have taken effect (its answer lost, the connection dropped
    after the request went out): after that, a conflict a later attempt meets may be
    the request's own doing. Failures of the ``applied_nothing`` types say their
    attempt did nothing and leave the mark unset."""

    def __init__(self, *applied_nothing: type[BaseException]) -> None:
        self._applied_nothing = applied_nothing
        #: True once a failed attempt may have taken effect.
        self.marked = False

    def __call__(self, exc: BaseException) -> None:
        if not isinstance(exc, self._applied_nothing):
            self.marked = True


def describe(action: str, key: str | None, where: str) -> str:
    """What a request does, for messages: ``read 'a/b' on dropbox:/x``, or
    ``list dropbox:/x`` for a request about no key."""
    return f"{action} {key!r} on {where}" if key is not None else f"{action} {where}"


def translated(
    slots: threading.Semaphore,
    request: Callable[[], T],
    translate: Callable[[Exception], BaseException],
) -> T:
    """One attempt of ``request()`` holding one of ``slots`` (a backend's limit of
    requests at once). A :class:`BackendError` it raises passes unchanged; any other
    exception ``exc`` is replaced by ``translate(exc)``, raised from ``exc``, unless
    ``translate`` returns ``exc`` itself (not the service's failure: a bug, or the
    caller's own exception passing through), which is then re-raised as it is."""
    with slots:
        try:
            return request()
        except BackendError:
            raise
        except Exception as exc:
            error = translate(exc)
            if error is exc:
                raise
            raise error from exc


def retrying(
    policy: RetryPolicy,
    what: str,
    request: Callable[[], T],
    *,
    on_retry: Callable[[BaseException], None] | None = None,
) -> T:
    """Run ``request()``; on a transient :class:`BackendError` wait and run it again,
    up to ``policy.attempts`` times in all, then re-raise the last error.

    ``request`` must be safe to repeat. Operations whose first attempt may have taken
    effect without the caller learning it (an exclusive create that timed out) handle
    that in ``on_retry`` or after the call (see ``put_if_absent`` in the backends).

    While the backend is paused after a request got no answer (:class:`Silence`),
    ``request`` is not called: :class:`PausedBackend` at once.
    """
    silence = policy.silence
    probe, refused = silence.admit(what, policy.budget)
    if refused is not None:
        raise refused
    sent_at = time.monotonic()
    try:
        result = _attempts(policy, what, request, on_retry)
    except BaseException as exc:
        if isinstance(exc, NoAnswer) and not isinstance(exc, PausedBackend):
            silence.went_silent(exc, sent_at, policy.budget, probe)
        elif isinstance(exc, BackendError) and not exc.transient:
            silence.answered()  # "not found", "denied": an answer all the same
        elif probe:  # no answer either way (dropped, refused within, interrupted)
            silence.probe_failed(probe)
        raise
    silence.answered()
    return result


def _attempts(
    policy: RetryPolicy,
    what: str,
    request: Callable[[], T],
    on_retry: Callable[[BaseException], None] | None,
) -> T:
    """:func:`retrying`'s loop of attempts."""
    attempt = 0
    first_failure: float | None = None
    while True:
        try:
            return request()
        except BackendError as exc:
            if not exc.transient or attempt + 1 >= policy.attempts or isinstance(exc, PausedBackend):
                raise
            retry_after = getattr(exc, "retry_after", None)
            if retry_after is not None and retry_after > policy.max_retry_after:
                raise
            wait = policy.delay(attempt, retry_after)
            now = time.monotonic()
            first_failure = now if first_failure is None else first_failure
            if (retry_after is None and policy.budget is not None
                    and now - first_failure + wait >= policy.budget):
                raise  # the next attempt would begin past the time allowed
            (log.info if wait >= LONG_WAIT else log.debug)(
                "%s failed (%s); retry %d of %d in %.1fs",
                what,
                exc,
                attempt + 1,
                policy.attempts - 1,
                wait,
            )
            policy.count_retry()
            if on_retry is not None:
                on_retry(exc)
            time.sleep(wait)  # backoff between attempts, not synchronization
            attempt += 1
