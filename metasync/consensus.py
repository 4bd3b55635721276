"""The pPaxos I/O driver: runs the pure protocol of :mod:`metasync.paxos` on backends.

The driver only appends, fetches and reads or writes the hint, concurrently
across acceptors (one round trip per batch), each request bounded by the
configured wait. Everything it decides comes from the protocol generators.

Messages are JSON, passed through the translator chain with the instance as
associated data: with encryption on (always, in Byzantine mode) each one is
authenticated under the repository key, so a backend can neither read nor forge
nor move a message between instances. A message that fails to decode is
dropped, exactly like one never written.
"""

from __future__ import annotations

import builtins
import json
import random
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from metasync.backends import Backend
from metasync.codec import Codec
from metasync.errors import (
    BackendError,
    BackendUnavailable,
    Compacted,
    Contended,
    CorruptObject,
    FloorElsewhere,
    MetasyncError,
    NoQuorum,
    ObjectNotFound,
    Retired,
)
from metasync.faults import crash_point
from metasync.layout import (
    FLOOR_PREFIX,
    HINT_KEY,
    LOG_PREFIX,
    floor_key,
    floor_of_key,
    instance_of_log,
    log_key,
    mark_key,
    retired_key,
)
from metasync.objects import Version
from metasync.paxos import (
    Append,
    Backoff,
    DropLogs,
    Fetch,
    Message,
    Quorums,
    ReadFloor,
    ReadHint,
    Reading,
    Reply,
    Request,
    Run,
    Setup,
    WriteFloor,
    WriteHint,
    compact,
    get_recent,
    past_floor,
    propose,
    publish_hint,
    read,
    read_floor,
)
from metasync.timeouts import DEFAULT_TIMEOUT

#: Longest log a reader accepts (a hostile backend could claim any position).
MAX_LOG = 100_000

T = TypeVar("T")


#: Jumps over compaction floors one get_recent makes before giving up (a floor that
#: keeps moving); each jump is progress.
MAX_FLOOR_JUMPS = 20
#: A proposal that took longer than this (wall clock, suspend included) checks the
#: floor once more before its outcome counts: compaction waits twice as long.
DEFAULT_LOG_GRACE_S = 24 * 3600.0


@dataclass(frozen=True)
class Mark:
    """A gc's note that every instance up to ``number`` was decided by ``time_ns``
    (its clock), and that ``acceptors`` ran the instances after it: compaction may
    remove their logs a grace period later."""

    number: int
    time_ns: int
    acceptors: tuple[str, ...]


def encode_hint(codec: Codec, number: int, config_id: str) -> bytes:
    """The stored ``latest`` hint: version ``number`` was decided by the acceptors of
    configuration ``config_id``."""
    return codec.encode("hint", HINT_KEY, json.dumps({"version": number, "config": config_id}).encode())


def read_hint(codec: Codec, backend: Backend) -> tuple[int, str] | None:
    """``(version, config id)`` of ``backend``'s ``latest`` hint; ``None`` if it is
    missing or unreadable (a hint is only ever a shortcut)."""
    try:
        data = backend.get(HINT_KEY)
    except (ObjectNotFound, CorruptObject):
        return None
    return _parse_hint(codec, data)


def _parse_hint(codec: Codec, data: bytes) -> tuple[int, str] | None:
    """A stored hint's ``(version, config id)``; ``None`` if it does not decode
    under the repository's chain (with encryption: authenticate) or is malformed."""
    try:
        raw = json.loads(codec.decode("hint", HINT_KEY, data))
        number, config_id = raw["version"], raw["config"]
    except (CorruptObject, ValueError, KeyError, TypeError, RecursionError):
        return None
    if type(number) is not int or number < 0 or not isinstance(config_id, str):
        return None
    return number, config_id


def _acceptor_ids(ids: object) -> tuple[str, ...] | None:
    if isinstance(ids, list) and ids and all(isinstance(i, str) and i for i in ids):
        return tuple(ids)
    return None


#: Why a record under ``floor/`` (or a hint) that does not decode is ignored.
UNDECODABLE = "it does not decode as a record of this repository"


def _decoded(codec: Codec, kind: str, key: str, data: bytes) -> Any:
    """The JSON of the record stored under ``key``, decoded with context ``(kind,
    key)`` (with encryption: authenticated under the repository key and bound to
    its name); else :class:`CorruptObject`."""
    try:
        return json.loads(codec.decode(kind, key, data))
    except (CorruptObject, ValueError, RecursionError):
        raise CorruptObject(UNDECODABLE) from None


def parse_floor(codec: Codec, key: str, data: bytes) -> tuple[str, ...]:
    """The acceptors that floor record ``floor/<below>`` names, once it decodes
    under the repository's chain with its own key as context (with encryption:
    authenticated) and says the ``below`` its name says; else
    :class:`CorruptObject` saying why (a forged, damaged or replayed record, never
    obeyed)."""
    below = floor_of_key(key)
    doc = _decoded(codec, "floor", key, data)
    if below is None or not isinstance(doc, dict) or type(doc.get("floor")) is not int:
        raise CorruptObject("it is not a floor record")
    if doc["floor"] != below:
        raise CorruptObject(f"it holds the record of floor {doc['floor']}")
    ids = _acceptor_ids(doc.get("acceptors"))
    if ids is None:
        raise CorruptObject("it names no acceptors")
    return ids


def parse_mark(codec: Codec, key: str, data: bytes) -> Mark:
    """The compaction mark stored under ``key`` (``floor/mark-<n>``), checked as
    :func:`parse_floor` checks a floor; else :class:`CorruptObject`."""
    doc = _decoded(codec, "floor", key, data)
    try:
        mark = Mark(doc["mark"], doc["time_ns"], _acceptor_ids(doc["acceptors"]) or ())
    except (KeyError, TypeError):
        raise CorruptObject("it is not a compaction mark") from None
    if (type(mark.number) is not int or type(mark.time_ns) is not int or not mark.acceptors
            or key != mark_key(mark.number)):
        raise CorruptObject("it is not the compaction mark its name says")
    return mark


def parse_retired(codec: Codec, key: str, data: bytes) -> tuple[int, str]:
    """``(version, date)`` of the recovery mark stored under ``key``
    (``floor/retired-<config id>``, docs/FORMAT.md §9.2); else :class:`CorruptObject`."""
    doc = _decoded(codec, "retired", key, data)
    try:
        return int(doc["version"]), str(doc["date"])
    except (KeyError, TypeError, ValueError):
        raise CorruptObject("it is not a recovery mark") from None


def untrusted_keys(codec: Codec, backend: Backend) -> dict[str, str]:
    """Every floor, mark and recovery mark of ``backend`` (and its ``latest``
    hint) that readers ignore because it does not authenticate as what its name
    says: key -> why. What ``metasync fsck`` lists and ``--repair`` removes.
    Raises what the backend raises."""
    out: dict[str, str] = {}
    for key in builtins.list(backend.list(FLOOR_PREFIX)):
        if floor_of_key(key) is not None:
            parse: Callable[[Codec, str, bytes], object] = parse_floor
        elif floor_of_key(key, "mark-") is not None:
            parse = parse_mark
        elif key.startswith(retired_key("")) and key != retired_key(""):
            parse = parse_retired
        else:
            continue  # no name metasync writes: readers never look at it
        try:
            parse(codec, key, backend.get(key))
        except ObjectNotFound:
            continue  # removed meanwhile (a compaction)
        except CorruptObject as exc:
            out[key] = str(exc)
    try:
        data = backend.get(HINT_KEY)
    except ObjectNotFound:
        return out
    if _parse_hint(codec, data) is None:
        out[HINT_KEY] = UNDECODABLE
    return out


class FloorRecords:
    """What the acceptors' ``floor/`` keys say, trusting only records that
    authenticate as what their names say (docs/FORMAT.md §9.1): floors, marks,
    and the recovery mark of configuration ``config_id``. Anything else is
    ignored and reported to ``warn`` (once per backend and key). Thread-safe:
    the driver reads every acceptor's floor at once."""

    def __init__(self, acceptors: dict[str, Backend], codec: Codec, config_id: str,
                 warn: Callable[[str], None] | None = None,
                 verified: dict[str, list[str]] | None = None) -> None:
        self.acceptors = acceptors
        self.codec = codec
        self.config_id = config_id
        self.warn = warn or (lambda message: None)
        self._reported: set[tuple[str, str]] = set()
        #: Floor keys whose record was verified, per acceptor (seeded from
        #: ``verified``, what this client verified before). A floor key is written
        #: once and means the same for good -- its floor was really recorded -- so
        #: once verified its name is enough: a round trip's floor read costs a
        #: listing, plus a read per floor key not seen before.
        self._verified: dict[str, set[str]] = {
            a: {k for k in (verified or {}).get(a, []) if floor_of_key(k) is not None}
            for a in acceptors}
        self._lock = threading.Lock()

    def verified(self, keep: int = 4) -> dict[str, list[str]]:
        """The floor keys verified so far per acceptor, the ``keep`` highest of each
        (what to remember for the next session)."""
        with self._lock:
            return {a: sorted(keys)[-keep:] for a, keys in self._verified.items() if keys}

    def floor(self, acceptor: str) -> int:
        """``acceptor``'s floor: the highest ``floor/<below>`` whose record
        authenticates as that floor (:func:`parse_floor`; 0: never compacted). A
        name alone is not enough: one backend could stop every client with an
        empty ``floor/999999999999`` (a reader must follow a floor to its instance
        and finds it undecided). A key that does not verify is ignored and reported
        (once), and read again next time -- a genuine record may replace it. Keys
        are tried from the highest down, so only floors above the highest verified
        one cost a read.

        The same listing shows whether ``metasync recover`` retired this
        configuration: then (once the mark decodes under the repository key) it
        raises :class:`Retired`, which ends the operation however many other
        acceptors answer."""
        backend = self.acceptors[acceptor]
        keys = builtins.list(backend.list(FLOOR_PREFIX))
        mark = retired_key(self.config_id)
        if self.config_id and mark in keys:
            self._check_retired(backend, mark)
        verified = self._verified[acceptor]
        named = sorted(((f, k) for k in keys if (f := floor_of_key(k)) is not None), reverse=True)
        for number, key in named:
            with self._lock:
                if key in verified:
                    return number
            try:
                parse_floor(self.codec, key, backend.get(key))
            except ObjectNotFound:
                continue  # removed meanwhile (a later compaction's clean-up)
            except CorruptObject as exc:
                self.report(backend, key, exc)
                continue
            with self._lock:
                verified.add(key)
            return number
        return 0

    def report(self, backend: Backend, key: str, why: MetasyncError) -> None:
        """Tell the user (once per backend and key) of a record that was ignored."""
        with self._lock:
            if (backend.name, key) in self._reported:
                return
            self._reported.add((backend.name, key))
        self.warn(f"ignored {key} on {backend.name}: {why}, so it is not trusted (the backend "
                  f"may be tampering with it); `metasync fsck --repair` removes it")

    def _check_retired(self, backend: Backend, key: str) -> None:
        try:
            data = backend.get(key)
        except MetasyncError:
            return  # gone meanwhile, or unreachable: the next listing tells
        try:
            version, when = parse_retired(self.codec, key, data)
        except CorruptObject as exc:
            self.report(backend, key, exc)
            return  # damaged or forged: as if absent
        raise Retired(
            f"this repository was recovered on {when} from the backends that survived "
            f"(`metasync recover`, version {version}); this folder still uses the "
            "configuration that lost them, so it can no longer push or pull: clone the "
            "repository again into a new folder and copy over your changes, which are "
            "still here")

    def acceptors_of(self, floor: int) -> set[str] | None:
        """The acceptor ids a floor record names (those that ran its instance), from
        the first acceptor that has it readable; None if none has (superseded)."""
        key = floor_key(floor)
        for backend in self.acceptors.values():
            try:
                return set(parse_floor(self.codec, key, backend.get(key)))
            except MetasyncError:
                continue
        return None

    def marks(self, backend: Backend) -> list[Mark]:
        """``backend``'s compaction marks that authenticate (:func:`parse_mark`)."""
        out = []
        for key in backend.list(FLOOR_PREFIX):
            if floor_of_key(key, "mark-") is None:
                continue
            try:
                out.append(parse_mark(self.codec, key, backend.get(key)))
            except ObjectNotFound:
                continue  # removed meanwhile
            except CorruptObject as exc:
                self.report(backend, key, exc)  # forged or damaged: as if absent
        return out


@dataclass
class _Outcome:
    reply: Reply = None
    error: BaseException | None = None


class Consensus:
    """pPaxos over the acceptor backends (paper Table 1: ``propose``, ``get_recent``).

    ``timeout`` bounds every wait: a request that has not answered by then counts
    as failed, and an operation that goes that long without a quorum answering
    fails with :class:`BackendUnavailable`. It also fails at once when more
    acceptors report themselves unreachable than the quorums tolerate.
    """

    def __init__(
        self,
        acceptors: dict[str, Backend],
        codec: Codec,
        client_id: str,
        *,
        quorums: Quorums | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        sleep: Callable[[float], None] = time.sleep,
        rng: random.Random | None = None,
        max_attempts: int = 10,
        backoff: float = 0.05,
        fast_path: bool = True,
        conditional: bool = True,
        names: dict[str, str] | None = None,
        config_id: str = "",
        log_grace: float = DEFAULT_LOG_GRACE_S,
        warn: Callable[[str], None] | None = None,
        verified_floors: dict[str, list[str]] | None = None,
    ) -> None:
        self.acceptors = acceptors
        #: The configuration whose acceptors these are. Hints name it, so a reader
        #: jumps only to versions this very acceptor set decided (docs/FORMAT.md §9).
        self.config_id = config_id
        self.codec = codec
        self.quorums = quorums or Quorums.crash(len(acceptors))
        # ``conditional=False`` ignores conditional appends (the paper's plain logs).
        with_position = frozenset(
            a for a, b in acceptors.items() if conditional and b.capabilities.conditional_append
        )
        # A fresh proposer id per session: a round is never reused, even by a
        # client that crashed and restarted while one of its requests was in flight.
        self.setup = Setup(
            tuple(acceptors), with_position, self.quorums, f"{client_id}.{secrets.token_hex(4)}",
            max_attempts=max_attempts, backoff=backoff, fast_path=fast_path,
        )
        self.timeout = timeout
        self.sleep = sleep
        self.rng = rng or random.Random()
        self.names = names or {a: b.name for a, b in acceptors.items()}
        #: Round trips (batches of concurrent requests) and requests made so far.
        self.round_trips = 0
        self.requests = 0
        self._next: Reading | None = None
        self._errors: dict[str, str] = {}
        # Acceptor id -> why its latest log append failed; kept across operations
        # until one of its appends succeeds (a backend whose appends keep failing is
        # outvoted silently otherwise, while its reads and hints still work).
        self._append_errors: dict[str, str] = {}
        self._wrote = False
        #: Seconds a compaction waits after a mark (see :meth:`compact_logs`).
        self.log_grace = log_grace
        #: The acceptors' floors, marks and recovery marks, trusted once verified.
        self.floors = FloorRecords(acceptors, codec, config_id, warn, verified_floors)

    # --- the API ---------------------------------------------------------------------
    def get_recent(self, known: Version) -> Version:
        """The newest decided version at or after ``known``. Behind a log compaction,
        it jumps to the floor's instance if this configuration's acceptors decided
        it (the floor record names them), else raises :class:`FloorElsewhere`."""
        for _ in range(MAX_FLOOR_JUMPS):
            try:
                version, reading = self.run(get_recent(self.setup, known, self.rng))
            except Compacted as exc:
                ran_by = self.floors.acceptors_of(exc.floor)
                if ran_by is None:
                    continue  # superseded by a newer floor meanwhile: read again
                if ran_by != set(self.acceptors):
                    raise FloorElsewhere(exc.floor) from None
                try:
                    known = self.run(past_floor(self.setup, exc.floor, self.rng))
                except Compacted:
                    continue  # the floor moved on: whose it is is checked from the top
                if known.config != self.config_id:
                    return known  # the caller continues on that configuration's acceptors
                continue
            self._next = reading
            return version
        raise BackendError("the log compaction floor kept moving while reading; retry",
                           transient=True)

    def propose(self, instance: int, value: Version | None) -> Version | None:
        """Run ``instance`` to a decision; return the decided value (maybe another's).
        Starts from the logs the last :meth:`get_recent` read, if of this instance."""
        cached = self._next if self._next is not None and self._next.instance == instance else None
        self._next = None
        started = (time.monotonic(), time.time())
        try:
            chosen = self.run(
                propose(self.setup, instance, value, self.rng, cached.logs if cached else None)
            )
        except Compacted:
            return None  # the caller is behind: it learns past the floor and retries
        took = max(time.monotonic() - started[0], time.time() - started[1])
        if took > self.log_grace / 2 and self.run(read_floor(self.setup)) > instance:
            # Stalled (a suspended laptop) long enough for a compaction to have emptied
            # this instance's logs under the proposal: its outcome cannot be trusted.
            return None
        return chosen

    def compact_logs(self, latest: Version, learned_ns: int, now_ns: int,
                     grace_s: float | None = None) -> tuple[int, int]:
        """Log compaction, run by gc: remove the logs of every instance below the
        newest mark older than the grace period (``grace_s``, default
        :attr:`log_grace`; a mark says all instances up to it were decided by then),
        then leave a mark for ``latest`` (learned at ``learned_ns``). Returns
        ``(floor, log objects removed)``; the floor is 0 if nothing was old enough.
        Raises :class:`BackendUnavailable` (nothing deleted) if an acceptor cannot
        record the floor."""
        marks: dict[Mark, int] = {}
        marked: set[str] = set()  # acceptors that already hold a mark for ``latest``
        with ThreadPoolExecutor(len(self.acceptors), "metasync-marks") as pool:
            for acceptor, found in zip(self.acceptors,
                                       pool.map(self.floors.marks, self.acceptors.values()), strict=True):
                for mark in found:
                    marks[mark] = marks.get(mark, 0) + 1
                    if mark.number == latest.number:
                        marked.add(acceptor)
        trusted = (len(self.acceptors) - 1) // 3 + 1 if self.quorums.byzantine else 1
        grace_ns = int((self.log_grace if grace_s is None else grace_s) * 1e9)
        ours = tuple(sorted(self.acceptors))
        # The floor is the instance after a mark: it ran on the mark's acceptors,
        # which must be these (a reader jumps there on the acceptors it names), and
        # it is decided (a later version exists).
        below = max((m.number + 1 for m, count in marks.items()
                     if count >= trusted and now_ns - m.time_ns >= grace_ns
                     and m.acceptors == ours and 0 < m.number < latest.number), default=0)
        removed = 0
        if below:
            removed = self.run(compact(self.setup, below))
            crash_point("gc:compacted")  # logs removed, no new mark yet
        key = mark_key(latest.number)
        data = self.codec.encode("floor", key, json.dumps(
            {"mark": latest.number, "time_ns": learned_ns, "acceptors": list(ours)}).encode())
        # An existing mark for the same version stays: its older time ages first.
        unmarked = [b for a, b in self.acceptors.items() if a not in marked]
        if unmarked:
            with ThreadPoolExecutor(len(unmarked), "metasync-marks") as pool:
                builtins.list(pool.map(lambda b: b.put(key, data), unmarked))
        return below, removed

    def learn(self, instance: int) -> Version | None:
        """The value decided in ``instance``, if a quorum's logs show one (``None``
        also when the instance's logs were compacted)."""
        reading = self.run(read(self.setup, instance, self.rng, floor=True))
        return None if reading.floor > instance else reading.decided

    def publish(self, version: Version) -> None:
        """Record ``version`` as the latest on every acceptor (best effort)."""
        self.run(publish_hint(self.setup, version))

    @property
    def last_errors(self) -> dict[str, str]:
        """Acceptor id -> why it failed, for the last operation's failed requests."""
        return dict(self._errors)

    @property
    def failing_appends(self) -> dict[str, str]:
        """Acceptor id -> why, for each acceptor whose latest log append (in any
        operation of this object) failed."""
        return dict(self._append_errors)

    # --- driving -----------------------------------------------------------------------
    def run(self, protocol: Run[T]) -> T:
        """Drive a protocol generator to its result, doing its I/O."""
        self._errors = {}
        self._wrote = False
        progress = time.monotonic()
        replies: list[Reply] | None = None
        try:
            while True:
                step = protocol.send(replies)
                if isinstance(step, Backoff):
                    self._check_stall(progress)
                    self.sleep(min(step.seconds, max(0.0, progress + self.timeout - time.monotonic())))
                    replies = None
                    continue
                self._wrote = self._wrote or any(isinstance(r, Append) for r in step)
                replies = self._execute(step)
                crash_point("paxos:batch")
                answered = {r.acceptor for r, reply in zip(step, replies, strict=True)
                            if reply is not None}
                if len(answered) >= self.quorums.classic or len(answered) == len(
                        {r.acceptor for r in step}):
                    progress = time.monotonic()
                self._check_down()
        except StopIteration as stop:
            result: T = stop.value
            return result
        except NoQuorum as exc:
            raise self._unavailable(exc.answered) from None
        except Contended as exc:
            raise BackendError(
                f"could not agree on version {exc.instance}: other clients kept "
                f"committing at the same time; retry",
                transient=True,
            ) from None

    def _check_stall(self, progress: float) -> None:
        if time.monotonic() - progress > self.timeout:
            answered = len(self.acceptors) - len(self._errors)
            raise self._unavailable(answered)

    def _check_down(self) -> None:
        """Fail at once when more acceptors are unreachable than the quorums tolerate."""
        if len(self._errors) > self.quorums.faults and all(
            e.startswith("unreachable") for e in self._errors.values()
        ):
            raise self._unavailable(len(self.acceptors) - len(self._errors))

    def _unavailable(self, answered: int) -> BackendUnavailable:
        failing = sorted(self._errors.items())
        names = ", ".join(self.names[a] for a, _ in failing)
        first = f" ({failing[0][1]})" if failing else ""
        outcome = (
            "Whether this version was made is unknown until they are back; the next "
            "push or pull settles it" if self._wrote
            else "Nothing was changed; retry when they are reachable"
        ) + (" (if they are gone for good: clone again from a backend still in use, which"
             " follows any newer configuration, or `metasync recover` rebuilds the"
             " repository from the rest)")
        return BackendUnavailable(
            f"only {max(answered, 0)} of {len(self.acceptors)} backends answered and "
            f"{self.quorums.classic} are needed to agree on a version; not answering: "
            f"{names}{first}. {outcome}"
        )

    def _execute(self, batch: Sequence[Request]) -> list[Reply]:
        """Run one batch concurrently (one round trip); ``None`` for each request that
        failed or did not answer within the timeout."""
        self.round_trips += 1
        self.requests += len(batch)
        outcomes = [_Outcome() for _ in batch]
        threads = [
            # Daemon threads: a backend that never answers must not keep the process alive.
            threading.Thread(target=self._one, args=(req, out), daemon=True)
            for req, out in zip(batch, outcomes, strict=True)
        ]
        for t in threads:
            t.start()
        deadline = time.monotonic() + self.timeout
        replies: list[Reply] = []
        failed: set[str] = set()
        answered: set[str] = set()
        for req, out, t in zip(batch, outcomes, threads, strict=True):
            t.join(max(0.0, deadline - time.monotonic()))
            if t.is_alive():
                self._errors[req.acceptor] = f"no answer within {self.timeout:g} s"
                failed.add(req.acceptor)
                replies.append(None)
            elif out.error is not None:
                err = out.error
                why = "unreachable" if isinstance(err, BackendUnavailable) else "failed"
                self._errors[req.acceptor] = f"{why}: {err}"
                if isinstance(req, Append) and why == "failed":  # not merely down
                    self._append_errors[req.acceptor] = f"log appends fail: {err}"
                failed.add(req.acceptor)
                replies.append(None)
            else:
                if isinstance(req, Append):
                    self._append_errors.pop(req.acceptor, None)
                answered.add(req.acceptor)
                replies.append(out.reply)
        for acceptor in answered - failed:
            self._errors.pop(acceptor, None)
        for out in outcomes:
            if isinstance(out.error, Retired):
                raise out.error  # a recovery retired this configuration: nothing goes on
        return replies

    def _one(self, request: Request, out: _Outcome) -> None:
        try:
            out.reply = self._perform(request)
        except BaseException as exc:  # reported per request, never raised in a thread
            out.error = exc

    def _perform(self, request: Request) -> Reply:
        backend = self.acceptors[request.acceptor]
        if isinstance(request, Fetch):
            entries = backend.logs.fetch(log_key(request.instance))
            # One slot per position, None where nothing decodes (or nothing is):
            # conditional appends go at the log's real length.
            length = max((pos + 1 for pos, _ in entries if 0 <= pos < MAX_LOG), default=0)
            messages: list[Message | None] = [None] * length
            for pos, raw in entries:
                if 0 <= pos < MAX_LOG and messages[pos] is None:
                    messages[pos] = self._decode(request.instance, raw)
            return messages
        if isinstance(request, Append):
            data = self._encode(request.instance, request.message)
            if request.position is None:
                backend.logs.append(log_key(request.instance), data)
                return True
            return backend.logs.append_at(log_key(request.instance), request.position, data)
        if isinstance(request, ReadHint):
            try:
                data = backend.get(HINT_KEY)
            except ObjectNotFound:
                return None
            hint = _parse_hint(self.codec, data)
            if hint is None:  # forged or damaged: ignored (it is only a shortcut), told
                self.floors.report(backend, HINT_KEY, CorruptObject(UNDECODABLE))
                return None
            # A hint of another acceptor set cannot be confirmed on this one.
            return hint[0] if hint[1] == self.config_id else None
        if isinstance(request, WriteHint):
            backend.put(HINT_KEY, encode_hint(self.codec, request.number, self.config_id))
            return True
        if isinstance(request, ReadFloor):
            return self.floors.floor(request.acceptor)
        if isinstance(request, WriteFloor):
            if self.floors.floor(request.acceptor) < request.below:
                # Compaction runs on the acceptors that ran the floor's instance.
                key = floor_key(request.below)
                backend.put(key, self.codec.encode("floor", key, json.dumps(
                    {"floor": request.below, "acceptors": sorted(self.acceptors)}).encode()))
            return True
        if isinstance(request, DropLogs):
            return self._drop_logs(backend, request.below)
        raise TypeError(f"unknown request {request!r}")

    @staticmethod
    def _drop_logs(backend: Backend, below: int) -> int:
        """Delete the logs of instances below ``below`` on a backend whose floor says
        so, then the floors and marks it makes redundant. Returns objects removed."""
        removed = 0
        if backend.capabilities.log_deletion:
            instances = {i for i in map(instance_of_log, backend.list(LOG_PREFIX))
                         if i is not None and i < below}
            for instance in sorted(instances):
                removed += backend.logs.delete_log(log_key(instance))
        for key in builtins.list(backend.list(FLOOR_PREFIX)):
            number = floor_of_key(key)
            if number is None:
                number = floor_of_key(key, "mark-")
            if number is not None and number < below:
                try:
                    backend.delete(key)
                    removed += 1
                except ObjectNotFound:
                    pass
        return removed

    def _encode(self, instance: int, msg: Message) -> bytes:
        return self.codec.encode("log", str(instance), json.dumps(msg.to_json()).encode())

    def _decode(self, instance: int, data: bytes) -> Message | None:
        try:
            return Message.from_json(json.loads(self.codec.decode("log", str(instance), data)))
        except (CorruptObject, ValueError, RecursionError, MetasyncError):
            return None

