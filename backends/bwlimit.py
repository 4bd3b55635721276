"""Bandwidth limits (``--bwlimit``, ``METASYNC_BWLIMIT``): one limiter per process.

Every byte of an object's payload that goes to or comes from a backend passes
through :data:`LIMITER`: :class:`~metasync.backends.base.Backend` charges it in
its request wrapper (``put``, ``put_if_absent`` and ``replace_if`` upload their
data; ``get``, ``get_range`` and the stream of ``open`` download), whatever the
service, so all transfers of the process (every backend, every worker thread,
every folder of the service) share one token bucket per direction. A streamed
upload or download stays streamed: it is charged piece by piece (at most
:data:`PIECE` bytes) as it is read, and waiting threads are served in the order
they asked, so parallel transfers share the rate fairly.

Payloads of at most :data:`EXEMPT` bytes (consensus messages, hints, log
entries, configuration) never wait: they are counted in the bucket (later
transfers wait for them), but a tiny metadata request is not queued behind
megabytes of uploads. Requests without a payload (listings, sizes, polls,
deletes) are not counted at all.

A wait re-checks at least every :data:`MAX_WAIT` seconds whether the user asked
to stop (:data:`metasync.progress.CANCEL`: it then raises
:class:`~metasync.errors.Interrupted`) and what the timetable says now (a switch
to ``off`` releases every waiter).

Syntax (rclone's): ``RATE`` for both directions, ``UP:DOWN`` for each, where a
rate is a number of bytes per second with an optional unit ``B``, ``K``, ``M``,
``G`` or ``T`` (binary multiples: ``1M`` is 1 MiB/s; a bare number is KiB/s, as
in rclone) or ``off``; or a timetable of ``[DAY-]HH:MM,RATE`` entries separated
by spaces (see :func:`parse_bwlimit`).
"""

from __future__ import annotations

import bisect
import os
import re
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any, BinaryIO, Literal

from metasync.errors import UsageError
from metasync.progress import CANCEL, Cancellation

#: The environment variable that sets the limit when ``--bwlimit`` is not given.
ENV = "METASYNC_BWLIMIT"
#: The largest piece charged at once: a thread never holds more of the rate than this.
PIECE = 64 * 1024
#: Payloads of at most this many bytes are counted but never wait (metadata).
EXEMPT = 16 * 1024
#: The longest a waiter sleeps before it re-checks the stop request and the timetable.
MAX_WAIT = 0.1
#: How much unused rate a bucket saves, in seconds of the rate (and at least a piece).
BURST_SECONDS = 0.5

Direction = Literal["up", "down"]
UP: Direction = "up"
DOWN: Direction = "down"

_UNITS = {"": 1024, "b": 1, "k": 1024, "m": 1024 ** 2, "g": 1024 ** 3, "t": 1024 ** 4}
_DAYS = ("mon", "tue", "wed", "thu", "fri", "sat", "sun")
_RATE = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*([bkmgt]?)(?:i?b)?", re.IGNORECASE)
_WHEN = re.compile(r"(?:([A-Za-z]{3})-)?(\d{1,2}):(\d{2})")
_HELP = ('use a rate like 10M (bytes per second, binary units B/K/M/G: 1M = 1 MiB/s), '
         '"UP:DOWN" like 10M:2M, "off", or a timetable like "08:00,512k 19:00,10M:2M 23:00,off"')
_MINUTES_PER_WEEK = 7 * 24 * 60


@dataclass(frozen=True)
class Rates:
    """Bytes per second allowed up (to backends) and down; None: unlimited."""

    up: float | None
    down: float | None

    def of(self, direction: Direction) -> float | None:
        return self.up if direction == UP else self.down


@dataclass(frozen=True)
class Schedule:
    """The rates over the week: ``(minute of the week, rates)`` pairs, sorted, the
    first minute of a week being Monday 00:00. A plain rate is one entry at minute 0.
    The rates at a moment are the last entry's at or before it, or else (wrapping
    round the week) the week's last entry's."""

    entries: tuple[tuple[int, Rates], ...]
    text: str

    def at(self, when: datetime) -> Rates:
        """The rates in force at the local time ``when``."""
        minute = when.weekday() * 24 * 60 + when.hour * 60 + when.minute
        index = bisect.bisect_right([m for m, _ in self.entries], minute) - 1
        return self.entries[index][1]  # index -1 (before the first entry): the last

    @property
    def unlimited(self) -> bool:
        """True if every entry is ``off`` in both directions."""
        return all(r.up is None and r.down is None for _, r in self.entries)


def _bad(text: str, problem: str) -> UsageError:
    return UsageError(f"bad --bwlimit {text!r}: {problem}; {_HELP}")


def parse_rate(text: str, whole: str | None = None) -> float | None:
    """One rate (``512k``, ``10M``, ``1.5G``, ``300B``, ``off``) in bytes per second,
    None for ``off``. A bare number is KiB/s (as in rclone)."""
    whole = whole if whole is not None else text
    word = text.strip()
    if word.lower() == "off":
        return None
    match = _RATE.fullmatch(word)
    if not match:
        raise _bad(whole, f"{word!r} is not a rate" if word else "a rate is missing")
    value = float(match.group(1)) * _UNITS[match.group(2).lower()]
    if value < 1:
        raise _bad(whole, f"{word!r} is less than one byte per second (use off for no limit)")
    return value


def parse_rates(text: str, whole: str | None = None) -> Rates:
    """``RATE`` (both directions) or ``UP:DOWN``."""
    whole = whole if whole is not None else text
    parts = text.split(":")
    if len(parts) > 2:
        raise _bad(whole, f"{text!r} has more than one ':' (UP:DOWN)")
    if len(parts) == 1:
        rate = parse_rate(parts[0], whole)
        return Rates(rate, rate)
    return Rates(parse_rate(parts[0], whole), parse_rate(parts[1], whole))


def _minutes(when: str, whole: str) -> list[int]:
    """The minutes of the week a timetable entry's ``[DAY-]HH:MM`` starts at: one, or
    one a day without a day."""
    match = _WHEN.fullmatch(when)
    if not match:
        raise _bad(whole, f"{when!r} is not a time (HH:MM or Mon-HH:MM)")
    day, hour, minute = match.group(1), int(match.group(2)), int(match.group(3))
    if hour > 23 or minute > 59:
        raise _bad(whole, f"{when!r} is not a time of day (00:00 to 23:59)")
    of_day = hour * 60 + minute
    if day is None:
        return [d * 24 * 60 + of_day for d in range(7)]
    if day.lower() not in _DAYS:
        raise _bad(whole, f"{day!r} is not a day (Mon, Tue, Wed, Thu, Fri, Sat or Sun)")
    return [_DAYS.index(day.lower()) * 24 * 60 + of_day]


def parse_bwlimit(text: str, source: str = "--bwlimit") -> Schedule | None:
    """:func:`parse_schedule`, its error naming ``source`` (the option, or
    :data:`ENV`)."""
    try:
        return parse_schedule(text)
    except UsageError as exc:
        raise UsageError(str(exc).replace("bad --bwlimit", f"bad {source}", 1)) from None


def parse_schedule(text: str) -> Schedule | None:
    """The schedule ``text`` describes, or None for no limit (``off`` or empty).

    ``text`` is ``RATE``, ``UP:DOWN``, or a timetable: entries ``[DAY-]HH:MM,RATES``
    separated by spaces, e.g. ``"08:00,512k 19:00,10M:2M 23:00,off"`` or
    ``"Mon-08:00,512k Sat-00:00,off"``. An entry without a day applies every day; an
    entry with one applies from that day's time until the next entry of the week.
    Raises :class:`UsageError` (one line naming the problem and the syntax)."""
    words = text.split()
    if not words:
        return None
    if len(words) == 1 and _WHEN.fullmatch(words[0]):
        raise _bad(text, f"timetable entry {words[0]!r} has no rate (TIME,RATE)")
    if len(words) == 1 and "," not in words[0]:
        rates = parse_rates(words[0], text)
        if rates.up is None and rates.down is None:
            return None
        return Schedule(((0, rates),), text.strip())
    by_minute: dict[int, Rates] = {}
    for word in words:
        when, comma, rates_text = word.partition(",")
        if not comma:
            raise _bad(text, f"timetable entry {word!r} is not TIME,RATE")
        rates = parse_rates(rates_text, text)
        for minute in _minutes(when, text):
            by_minute[minute] = rates  # a later entry of the same minute wins
    return Schedule(tuple(sorted(by_minute.items())), text.strip())


class TokenBucket:
    """Tokens (bytes) refilled at a rate, pure: the caller passes the time and the
    rate each call (the rate may change between calls: a timetable)."""

    def __init__(self) -> None:
        #: Bytes that may go now; negative: the debt the last grant left.
        self.tokens = 0.0
        self._stamp: float | None = None

    def grant(self, size: int, rate: float | None, now: float) -> float:
        """Take ``size`` bytes at ``now`` if the bucket is not in debt and return 0.0;
        else take nothing and return the seconds until it is out of debt. A grant
        may take the bucket into debt by up to ``size``: over any stretch of time
        the bytes granted are at most the rate times its length plus the saved
        burst (:data:`BURST_SECONDS` of the rate, at least :data:`PIECE`) plus one
        piece. An unlimited rate (None) grants everything at once."""
        self._refill(rate, now)
        if rate is None:
            return 0.0
        if self.tokens < 0:
            return -self.tokens / rate
        self.tokens -= size
        return 0.0

    def take(self, size: int, rate: float | None, now: float) -> None:
        """Take ``size`` bytes at once, whatever the debt (an exempt payload)."""
        self._refill(rate, now)
        if rate is not None:
            self.tokens -= size

    def _refill(self, rate: float | None, now: float) -> None:
        if rate is None:
            self.tokens, self._stamp = 0.0, now
            return
        # The first use starts from an empty bucket: no burst at start-up.
        elapsed = 0.0 if self._stamp is None else max(0.0, now - self._stamp)
        cap = max(float(PIECE), rate * BURST_SECONDS)
        self.tokens = min(cap, self.tokens + elapsed * rate)
        self._stamp = now


class Limiter:
    """The process's bandwidth limit: a schedule and one :class:`TokenBucket` per
    direction, shared by every thread. Waiters of a direction are served first come
    first served; a wait re-checks the stop request and the schedule at least every
    :data:`MAX_WAIT` seconds.

    ``clock`` (monotonic seconds) drives the buckets and ``wallclock`` (local time)
    picks the timetable's entry; tests pass their own. Until :meth:`configure` is
    called, the schedule comes from :data:`ENV` (read on first use)."""

    def __init__(self, *, clock: Callable[[], float] = time.monotonic,
                 wallclock: Callable[[], datetime] = datetime.now,
                 cancel: Cancellation = CANCEL) -> None:
        self._clock = clock
        self._wallclock = wallclock
        self._cancel = cancel
        self._cond = threading.Condition()
        self._schedule: Schedule | None = None
        self._loaded = False
        self._buckets = {UP: TokenBucket(), DOWN: TokenBucket()}
        self._queues: dict[Direction, deque[object]] = {UP: deque(), DOWN: deque()}
        #: Payload bytes charged in each direction while a limit was set (never reset).
        self.charged: dict[Direction, int] = {UP: 0, DOWN: 0}

    def configure(self, schedule: Schedule | None) -> None:
        """Use ``schedule`` (None: no limit) from now on; releases or re-times waiters."""
        with self._cond:
            self._schedule = None if schedule is None or schedule.unlimited else schedule
            self._loaded = True
            self._cond.notify_all()

    def reset(self) -> None:
        """Forget the configured schedule: the next use reads :data:`ENV` again."""
        with self._cond:
            self._schedule, self._loaded = None, False
            self._cond.notify_all()

    @property
    def schedule(self) -> Schedule | None:
        """The schedule in force (the environment's until configured)."""
        if not self._loaded:
            raw = os.environ.get(ENV, "")
            with self._cond:
                if not self._loaded:
                    parsed = parse_bwlimit(raw, ENV)
                    self._schedule = None if parsed is None or parsed.unlimited else parsed
                    self._loaded = True
        return self._schedule

    @property
    def active(self) -> bool:
        """Whether any limit is set (the cheap test every backend request makes)."""
        return self.schedule is not None

    def rates(self) -> Rates:
        """The rates in force now."""
        schedule = self.schedule
        return Rates(None, None) if schedule is None else schedule.at(self._wallclock())

    def waiting(self, direction: Direction) -> int:
        """How many threads wait to send or receive in ``direction``."""
        with self._cond:
            return len(self._queues[direction])

    def charge(self, direction: Direction, size: int, *, whole: bool = True) -> None:
        """Account ``size`` payload bytes in ``direction``: a ``whole`` request's
        payload of at most :data:`EXEMPT` bytes never waits; anything else waits its
        turn, :data:`PIECE` bytes at a time (a piece of a stream is never exempt,
        however small: a stream read in small pieces is limited too). Raises
        :class:`~metasync.errors.Interrupted` once the user asked to stop."""
        if size <= 0 or self.schedule is None:
            return
        with self._cond:
            self.charged[direction] += size
        if whole and size <= EXEMPT:
            with self._cond:
                self._buckets[direction].take(size, self._rate(direction), self._clock())
            return
        while size > 0:
            piece = min(size, PIECE)
            self._wait_turn(direction, piece)
            size -= piece

    def _rate(self, direction: Direction) -> float | None:
        schedule = self._schedule
        return None if schedule is None else schedule.at(self._wallclock()).of(direction)

    def _wait_turn(self, direction: Direction, piece: int) -> None:
        ticket = object()
        queue, bucket = self._queues[direction], self._buckets[direction]
        with self._cond:
            queue.append(ticket)
            try:
                while True:
                    self._cancel.check()
                    delay = MAX_WAIT
                    if queue[0] is ticket:
                        delay = bucket.grant(piece, self._rate(direction), self._clock())
                        if delay == 0.0:
                            return
                    self._cond.wait(min(delay, MAX_WAIT))
            finally:
                queue.remove(ticket)
                self._cond.notify_all()

    def reader(self, stream: Any, direction: Direction) -> Any:
        """``stream`` with every piece read from it charged in ``direction``."""
        return _Metered(stream, self, direction)


class _Metered:
    """A readable (and, if the inner one is, seekable) stream whose reads are charged
    to a :class:`Limiter` after they return: an upload's source (the backend sends
    what it read) or a download's stream."""

    def __init__(self, inner: Any, limiter: Limiter, direction: Direction) -> None:
        self._inner = inner
        self._limiter = limiter
        self._direction = direction

    def read(self, size: int | None = -1) -> bytes:
        data: bytes = self._inner.read(size)
        self._limiter.charge(self._direction, len(data), whole=False)
        return data

    def read1(self, size: int = -1) -> bytes:
        data: bytes = self._inner.read1(size)
        self._limiter.charge(self._direction, len(data), whole=False)
        return data

    def readinto(self, buffer: Any) -> int:
        n: int = self._inner.readinto(buffer)
        self._limiter.charge(self._direction, n or 0, whole=False)
        return n

    def readable(self) -> bool:
        return True

    def __iter__(self) -> Any:
        return iter(self.read, b"")

    def __enter__(self) -> _Metered:
        return self

    def __exit__(self, *exc: object) -> None:
        self._inner.close()

    def __getattr__(self, name: str) -> Any:
        # seek, tell, seekable, close, closed, name...: the inner stream's.
        return getattr(self._inner, name)


#: The process's one limiter: every backend request goes through it.
LIMITER = Limiter()


def metered_upload(data: bytes | BinaryIO) -> bytes | BinaryIO:
    """``data`` as a backend's ``put`` takes it, charged as an upload: bytes now
    (before they are sent), a stream as it is read."""
    if isinstance(data, bytes | bytearray | memoryview):
        LIMITER.charge(UP, memoryview(data).nbytes)
        return data
    return LIMITER.reader(data, UP)

