"""pPaxos, the protocol core: a pure state machine with no I/O (sans-IO).

Each acceptor is a passive append-only log per instance on one backend (paper
3.3, Figure 5); one single-decree Paxos instance decides each version. This
module decides everything and touches nothing: the protocol functions are
generators that *yield* what to do next (a batch of requests, or a backoff) and
are *sent* what came back. :class:`metasync.consensus.Consensus` drives them
against real backends; :mod:`metasync.simulator` drives the very same
generators against simulated ones, so the simulator tests production code.

Beyond the paper (CRIC's CPaxos, Fast Paxos):

- **Conditional appends.** On an acceptor whose backend can append *at a given
  position* atomically (exclusive create), a proposer that knows the log appends
  at exactly its end. Success means it knows the acceptor's new state without
  reading it back, so a phase costs one round trip instead of append-then-fetch.
  A failed conditional append writes nothing; the proposer re-reads that log.
- **Fast round.** Round ``FAST_ROUND`` (number 0, owned by nobody) skips the
  prepare phase: a proposer sends its value straight to every acceptor, each of
  which accepts only the first round-0 value it gets and only if it promised
  nothing before. The value is chosen once a *fast quorum* accepted it. Fast and
  classic quorums satisfy ``classic + 2 * fast > 2 * n``, so at most one value
  can have been chosen in round 0 and every classic quorum sees it
  (:func:`choose_value`). An uncontended commit is one conditional round trip.
- **Byzantine mode** (paper 3.6): messages are authenticated by the caller (the
  codec MACs each one with the repository key), ``n >= 3f + 1`` acceptors,
  quorums of ``ceil((n + f + 1) / 2)`` and no fast round; see docs/protocol.md.

Safety never depends on timing, on the order replies arrive, or on an acceptor
being honest about anything the MAC does not cover; liveness needs a quorum
that answers and contention that backs off (randomized exponential backoff).
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Generator, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from metasync.errors import Compacted, Contended, CorruptObject, NoQuorum
from metasync.objects import Version

T = TypeVar("T")


# ================================================================ messages
@dataclass(frozen=True, order=True)
class Round:
    """A proposal number. Unique per proposer because the proposer id breaks ties;
    every proposer id is fresh per session, so a round is never reused."""

    number: int
    proposer: str


#: The fast round: lower than every classic round, and shared by all proposers.
FAST_ROUND = Round(0, "")
#: Longest proposer id a message may carry (a client id plus a session token).
MAX_PROPOSER = 64


@dataclass(frozen=True)
class Message:
    """One log entry: ``prepare(round)`` or ``accept(round, value)``."""

    type: str  # "prepare" or "accept"
    round: Round
    value: Version | None = None

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"type": self.type, "round": [self.round.number, self.round.proposer]}
        if self.value is not None:
            doc["value"] = self.value.to_json()
        return doc

    @classmethod
    def from_json(cls, raw: Any) -> Message:
        """Parse and validate; :class:`CorruptObject` for anything malformed."""
        if not isinstance(raw, dict) or raw.get("type") not in ("prepare", "accept"):
            raise CorruptObject("bad pPaxos message")
        rnd = raw.get("round")
        if not (isinstance(rnd, list) and len(rnd) == 2 and type(rnd[0]) is int
                and isinstance(rnd[1], str) and len(rnd[1]) <= MAX_PROPOSER and rnd[0] >= 0):
            raise CorruptObject("bad pPaxos round")
        round_ = Round(rnd[0], rnd[1])
        is_fast = round_.number == 0
        if is_fast and (round_ != FAST_ROUND or raw["type"] == "prepare"):
            raise CorruptObject("round 0 is the fast round: accepts only, no proposer")
        if not is_fast and not round_.proposer:
            raise CorruptObject("a classic round needs a proposer")
        if raw["type"] == "prepare":
            if set(raw) != {"type", "round"}:
                raise CorruptObject("bad prepare message")
            return cls("prepare", round_)
        if set(raw) != {"type", "round", "value"}:
            raise CorruptObject("bad accept message")
        return cls("accept", round_, Version.from_json(raw["value"]))


# ================================================================ acceptors
@dataclass
class AcceptorState:
    """What an acceptor 'decided', reconstructed from its log (Figure 5 UPDATE)."""

    promised: Round | None = None
    accepted: tuple[Round, Version] | None = None
    #: For each granted prepare: the value accepted before it (what the promise reports).
    grants: dict[Round, tuple[Round, Version] | None] = field(default_factory=dict)
    #: Accepts that took effect, by round.
    accepts: dict[Round, Version] = field(default_factory=dict)
    highest_seen: int = 0


def replay(messages: Iterable[Message | None]) -> AcceptorState:
    """Run the acceptor's logic over its log, in log order (``None``: an entry that
    did not decode, which counts as never written).

    - ``prepare(r)`` is granted if ``r`` exceeds every earlier promise;
    - ``accept(r, v)`` of a classic round takes effect if ``r`` is at least the promise;
    - ``accept(FAST_ROUND, v)`` takes effect only as the acceptor's very first act:
      no promise and no accepted value before it (one fast vote per acceptor).
    """
    state = AcceptorState()
    for msg in messages:
        if msg is None:
            continue
        state.highest_seen = max(state.highest_seen, msg.round.number)
        if msg.type == "prepare":
            if state.promised is None or msg.round > state.promised:
                state.promised = msg.round
                state.grants[msg.round] = state.accepted
            continue
        assert msg.value is not None
        if msg.round == FAST_ROUND:
            takes_effect = state.promised is None and state.accepted is None
        else:
            takes_effect = state.promised is None or msg.round >= state.promised
        if takes_effect:
            state.promised = msg.round
            state.accepted = (msg.round, msg.value)
            state.accepts[msg.round] = msg.value
    return state


# ================================================================ quorums
@dataclass(frozen=True)
class Quorums:
    """Quorum sizes for ``acceptors`` acceptors.

    ``classic`` quorums pairwise intersect (in ``byzantine`` mode: in at least
    ``f + 1`` acceptors, so in an honest one). ``fast`` (``None``: no fast round)
    satisfies ``classic + 2 * fast > 2 * acceptors``.
    """

    acceptors: int
    classic: int
    fast: int | None
    byzantine: bool = False

    @classmethod
    def crash(cls, n: int) -> Quorums:
        """Crash faults: majority quorums, tolerating ``n - classic`` unreachable."""
        if n < 1:
            raise ValueError("pPaxos needs at least one acceptor")
        classic = n // 2 + 1
        return cls(n, classic, (2 * n - classic) // 2 + 1)

    @classmethod
    def bft(cls, n: int) -> Quorums:
        """Byzantine acceptors: ``f = (n - 1) // 3`` of them may lie or omit."""
        if n < 4:
            raise ValueError("Byzantine mode needs at least 4 acceptors (3f + 1 with f = 1)")
        f = (n - 1) // 3
        return cls(n, (n + f) // 2 + 1, None, byzantine=True)

    @property
    def faults(self) -> int:
        """Acceptors that may be down (or, in Byzantine mode, faulty) with progress."""
        return self.acceptors - self.classic

    def threshold(self, rnd: Round) -> int | None:
        """Acceptances that choose a value in ``rnd`` (``None``: it cannot be chosen there)."""
        return self.fast if rnd == FAST_ROUND else self.classic


def announcement_quorum(backends: int, byzantine: bool) -> int:
    """Backends a push's announcement of its uploads must reach before it uploads,
    and that gc must read before it deletes (docs/FORMAT.md §9.1, "Client state").

    Crash faults: a simple majority; two majorities share a backend, which holds
    the announcement. Byzantine (``f = (backends - 1) // 3`` may lie, e.g. replay
    a client's older record): the Byzantine quorum ``(backends + f) // 2 + 1``,
    so a write set and a read set share at least ``f + 1`` backends, one of them
    honest (docs/protocol.md, "Garbage collection and Byzantine backends")."""
    if byzantine and backends >= 4:
        return Quorums.bft(backends).classic
    return backends // 2 + 1


def decided(states: Iterable[AcceptorState], quorums: Quorums) -> Version | None:
    """The value some round's quorum accepted, if the given states show one."""
    counts: Counter[tuple[Round, Version]] = Counter()
    for s in states:
        for rnd, value in s.accepts.items():
            counts[(rnd, value)] += 1
    for (rnd, value), count in sorted(counts.items(), key=lambda kv: kv[0][0], reverse=True):
        needed = quorums.threshold(rnd)
        if needed is not None and count >= needed:
            return value
    return None


def choose_value(
    reports: Sequence[tuple[Round, Version] | None], quorums: Quorums, own: Version | None
) -> Version | None:
    """The value a proposer must propose after ``reports``, one per granted promise.

    - Some classic round accepted a value: the highest such round's value (Paxos).
    - Only fast-round values: one of them may have been chosen by a fast quorum
      ``R``; then every acceptor of ``R`` among the granted ones reports it, at least
      ``fast - (n - granted)`` of them, and at most one value can reach that. Such a
      value must be proposed; if none reaches it, nothing was chosen and any value
      is safe: ``own`` if given, else the most frequent (to finish someone's work).
    - Nothing accepted: ``own`` (``None`` when only finishing an instance).
    """
    prior = [r for r in reports if r is not None]
    if not prior:
        return own
    top = max(rnd for rnd, _ in prior)
    if top != FAST_ROUND:
        return next(value for rnd, value in prior if rnd == top)
    counts = Counter(value for _, value in prior)
    if quorums.fast is not None:
        needed = quorums.fast - (quorums.acceptors - len(reports))
        for value, count in counts.items():
            if count >= needed:
                return value
    if own is not None:
        return own
    # Deterministic among equals, so every finisher picks the same.
    return max(counts, key=lambda value: (counts[value], value.master or "", value.number))


# ================================================================ requests
@dataclass(frozen=True)
class Fetch:
    """Read the whole log of ``instance`` on ``acceptor``. Reply: one item per log
    position in order -- the message, or ``None`` for an entry that does not decode
    (so the list's length is the log's, which conditional appends need) -- or
    ``None`` if the acceptor did not answer."""

    acceptor: str
    instance: int


@dataclass(frozen=True)
class Append:
    """Append ``message`` to the log of ``instance`` on ``acceptor``.

    With ``position`` (a conditional append, only on acceptors that support it):
    written only as entry number ``position``; reply ``True`` if written, ``False``
    if that position was taken. Without: reply ``True`` once written. ``None``: no
    answer (down, timed out, or the outcome is unknown).
    """

    acceptor: str
    instance: int
    message: Message
    position: int | None = None


@dataclass(frozen=True)
class ReadHint:
    """Read the 'latest version' hint on ``acceptor``. Reply: a number or ``None``."""

    acceptor: str


@dataclass(frozen=True)
class WriteHint:
    """Record ``number`` as the latest version on ``acceptor`` (best effort)."""

    acceptor: str
    number: int


@dataclass(frozen=True)
class ReadFloor:
    """Read the compaction floor of ``acceptor``: every instance below it may have
    had its log deleted (docs/FORMAT.md §9.1). Reply: the floor (0: never
    compacted), or ``None`` if the acceptor did not answer."""

    acceptor: str


@dataclass(frozen=True)
class WriteFloor:
    """Record ``below`` as ``acceptor``'s compaction floor (a higher floor is kept).
    Reply ``True`` once recorded, ``None`` if not."""

    acceptor: str
    below: int


@dataclass(frozen=True)
class DropLogs:
    """Delete ``acceptor``'s logs of every instance below ``below`` (only after its
    floor says so). Reply: the number of log objects removed, or ``None``."""

    acceptor: str
    below: int


@dataclass(frozen=True)
class Backoff:
    """Wait ``seconds`` before the next batch (contention or a missing quorum)."""

    seconds: float


Request = Fetch | Append | ReadHint | WriteHint | ReadFloor | WriteFloor | DropLogs
Reply = list[Message | None] | bool | int | None
#: What a protocol generator yields: a batch of requests to run concurrently (one
#: round trip), or a backoff. It is sent the replies, aligned with the batch.
Step = list[Request] | Backoff
Run = Generator[Step, list[Reply] | None, T]


@dataclass(frozen=True)
class Setup:
    """Everything a proposer needs to know besides the instance."""

    #: Acceptor ids, in config order.
    acceptors: tuple[str, ...]
    #: Acceptors whose backend supports conditional appends.
    conditional: frozenset[str]
    quorums: Quorums
    #: This proposer's id: unique per client *and* session (see :class:`Round`).
    proposer: str
    max_attempts: int = 10
    #: Base of the randomized exponential backoff, in seconds.
    backoff: float = 0.05
    #: Try the fast round first (the quorums must allow one). Off, a proposer runs
    #: the paper's classic rounds only; it still recognizes fast-round decisions.
    fast_path: bool = True


#: What a proposer knows of each acceptor's log of one instance: the exact log
#: (a prefix it saw plus what it appended at known positions), or ``None``.
Logs = dict[str, list[Message | None] | None]


@dataclass
class Reading:
    """The result of reading one instance from the acceptors."""

    instance: int
    decided: Version | None
    #: True if any acceptor that answered has accepted some value.
    anything_accepted: bool
    logs: Logs
    #: The compaction floor the same round trip read (0 if it did not read one).
    floor: int = 0


# ================================================================ protocols
def read(setup: Setup, instance: int, rng: random.Random, *, floor: bool = False) -> Run[Reading]:
    """Read ``instance`` from every acceptor (one round trip when a quorum answers).

    With ``floor``, the same round trip reads each acceptor's compaction floor, and
    an acceptor's log counts only if its floor arrived too (see :func:`_floor_of`)."""
    for attempt in range(setup.max_attempts):
        if attempt:
            yield Backoff(_backoff(setup, attempt, rng))
        fetches: list[Request] = [Fetch(a, instance) for a in setup.acceptors]
        replies = yield fetches + _floor_requests(setup) if floor else fetches
        n = len(setup.acceptors)
        logs = _fetched(setup.acceptors, replies[:n] if replies is not None else None)
        seen = 0
        if floor:
            logs, seen = _with_floor(setup, logs, replies[n:] if replies is not None else None)
        states = [replay(log) for log in logs.values() if log is not None]
        if len(states) >= setup.quorums.classic:
            return Reading(instance, decided(states, setup.quorums),
                           any(s.accepts for s in states), logs, seen)
    raise NoQuorum(len(states), setup.quorums.classic, instance)


def propose(
    setup: Setup, instance: int, value: Version | None, rng: random.Random,
    logs: Logs | None = None,
) -> Run[Version | None]:
    """Run one instance until it decides; return the decided value (which may be
    another proposer's). ``value=None`` only finishes what others started: it
    returns ``None`` if nothing was ever accepted. ``logs`` are views from a
    recent :func:`read` (CRIC's cached acceptor state); they may be stale, which
    costs a round trip but is never unsafe."""
    known: Logs = {a: None for a in setup.acceptors}
    if logs:
        known.update({a: list(log) for a, log in logs.items() if a in known and log is not None})
    quorums = setup.quorums
    last_round = 0
    short = False
    states: dict[str, AcceptorState] = {}

    # Every round trip also reads the compaction floors: a log that looks empty may
    # have been compacted (see _FloorCheck).
    check = _FloorCheck(setup, instance)
    use_fast = setup.fast_path and quorums.fast is not None
    if logs:  # a recent read: acceptors that did not answer it are likely down
        reachable = sum(1 for log in known.values() if log is not None)
        use_fast = use_fast and quorums.fast is not None and reachable >= quorums.fast
    if value is not None and use_fast and all(not log for log in known.values()):
        # The fast round: every log we know is empty, so try round 0 at position 0.
        yield from _append_all(setup, instance, known, Message("accept", FAST_ROUND, value),
                               setup.acceptors, check, assume_empty=True)
        done = decided(_states(known).values(), quorums)
        if done is not None:
            return done

    for attempt in range(setup.max_attempts):
        if attempt:
            # What the failed attempt read back may already show a decision.
            done = decided(_states(known).values(), quorums)
            if done is not None:
                return done
            yield Backoff(_backoff(setup, attempt, rng))
        yield from _refresh(setup, instance, known, check)
        states = _states(known)
        short = len(states) < quorums.classic
        if short:
            continue
        done = decided(states.values(), quorums)
        if done is not None:
            return done
        if value is None and not any(s.accepts for s in states.values()):
            return None

        # Phase 1: prepare a round above everything seen (and above our own last).
        last_round = max(last_round, *(s.highest_seen for s in states.values())) + 1
        rnd = Round(last_round, setup.proposer)
        yield from _append_all(setup, instance, known, Message("prepare", rnd), setup.acceptors,
                               check)
        granting = _granting(known, rnd)
        if len(granting) < quorums.classic and _unknown(known):
            yield from _refresh(setup, instance, known, check)
            granting = _granting(known, rnd)
        if len(granting) < quorums.classic:
            continue
        chosen = choose_value([g for g in granting.values()], quorums, value)
        if chosen is None:
            return None

        # Phase 2: accept, on every acceptor not known to have promised higher.
        targets = [a for a in setup.acceptors if _may_accept(known[a], rnd)]
        yield from _append_all(setup, instance, known, Message("accept", rnd, chosen), targets,
                               check)
        done = decided(_states(known).values(), quorums)
        if done is None and _unknown(known):
            yield from _refresh(setup, instance, known, check)
            done = decided(_states(known).values(), quorums)
        if done is not None:
            return done
    if short:
        raise NoQuorum(len(states), quorums.classic, instance)
    raise Contended(instance, setup.max_attempts)


def get_recent(
    setup: Setup, known: Version, rng: random.Random
) -> Run[tuple[Version, Reading | None]]:
    """The newest decided version at or after ``known`` (Table 1 ``get_recent``).

    Reads the next instance (one round trip when up to date). If it is decided,
    reads the acceptors' hints; a hint is trusted only once a quorum's logs
    confirm its instance. Then walks forward until an instance is undecided,
    finishing any a crashed proposer left half-done. It stops early at a version
    whose configuration differs from ``known``'s: the acceptors of that
    configuration decide what follows. Returns the version and the reading of the
    next instance (views a following :func:`propose` can start from), or ``None``
    if it wrote there.

    Every read also reads the compaction floors. An instance below the floor is
    never read or proposed: the walk raises :class:`Compacted`, and the caller
    jumps with :func:`past_floor`. A value learned from one round trip is kept only
    if a later round trip's floor does not cover it (compaction could have emptied
    its log just before it was read; the floor was recorded before that).
    """
    current = known
    learned = False  # current came from this call's reads, not from the caller
    reading = yield from read(setup, current.number + 1, rng, floor=True)
    if reading.decided is not None and reading.floor <= reading.instance:
        # Behind: jump ahead by the hints (one more round trip) instead of walking
        # every version. Up to date -- the usual case before a push -- costs none.
        replies = yield [ReadHint(a) for a in setup.acceptors]
        hint = max((h for h in replies or [] if type(h) is int), default=None)
        if hint is not None and hint > current.number + 1:
            confirmed = yield from read(setup, hint, rng, floor=True)
            if (confirmed.floor <= hint and confirmed.decided is not None
                    and confirmed.decided.number == hint):
                current, learned = confirmed.decided, True
                if current.config != known.config:
                    # The next instance runs on other acceptors.
                    return (yield from _checked(setup, current)), None
                reading = yield from read(setup, current.number + 1, rng, floor=True)
    while True:
        if reading.floor > reading.instance or (
                learned and reading.floor > current.number and reading.decided is None):
            # Behind the floor: the caller jumps there (past_floor), on the acceptors
            # that decided that instance -- which only it can tell.
            raise Compacted(reading.instance, reading.floor)
        nxt = reading.decided
        if nxt is None:
            if not reading.anything_accepted:
                return current, reading
            nxt = yield from propose(setup, current.number + 1, None, rng, reading.logs)
            if nxt is None:
                return current, None
        if nxt.number != current.number + 1:
            raise CorruptObject(f"instance {current.number + 1} decided version {nxt.number}")
        current, learned = nxt, True
        if current.config != known.config:
            # A new configuration: the instances after it run on its acceptors, which
            # the caller must switch to (docs/FORMAT.md §9, "Configuration changes").
            return (yield from _checked(setup, current)), None
        reading = yield from read(setup, current.number + 1, rng, floor=True)


def past_floor(setup: Setup, floor: int, rng: random.Random) -> Run[Version]:
    """The version decided in instance ``floor``, for a caller whose
    :func:`get_recent` raised :class:`Compacted`: compaction keeps that instance's
    logs and records a floor only once it is decided. ``setup`` must be the
    acceptors that ran that instance (the floor record names them). The caller
    then runs :func:`get_recent` from the result, which validates it.

    Raises :class:`Compacted` if the floor moves on meanwhile: whose the new floor
    is -- these acceptors' or another configuration's -- is for the caller to check
    from its record before jumping there. (Following it here, on these acceptors,
    read a floor other acceptors had set as if these ran it: a sleeper decided a
    second value in an instance a newer configuration had decided; simulator seed
    18872.)"""
    attempt = 0
    while attempt < setup.max_attempts:
        reading = yield from read(setup, floor, rng, floor=True)
        if reading.floor > floor:
            raise Compacted(floor, reading.floor)
        attempt += 1
        found = reading.decided
        if found is None and reading.anything_accepted:
            # Decided, but this quorum shows too few of the deciding votes (a fast
            # quorum seen in part): finishing the instance re-proposes that value
            # (a Compacted from it goes to the caller, as above).
            found = yield from propose(setup, floor, None, rng, reading.logs)
        if found is not None:
            if found.number != floor:
                raise CorruptObject(f"instance {floor} decided version {found.number}")
            return found
        yield Backoff(_backoff(setup, attempt, rng))
    raise CorruptObject(
        f"the acceptors say the logs below instance {floor} were compacted, but instance "
        f"{floor} is not decided on a quorum of them"
    )


def _checked(setup: Setup, current: Version) -> Run[Version]:
    """``current`` (learned from the last round trip) once one more floor read shows
    its instance was not compacted before that read; else :class:`Compacted`."""
    floor = yield from read_floor(setup)
    if floor > current.number:
        raise Compacted(current.number, floor)
    return current


def publish_hint(setup: Setup, version: Version) -> Run[None]:
    """Record ``version`` as the latest on every acceptor (best effort, one round trip)."""
    yield [WriteHint(a, version.number) for a in setup.acceptors]
    return None


# ================================================================ helpers
def _backoff(setup: Setup, attempt: int, rng: random.Random) -> float:
    return rng.uniform(0, setup.backoff * 2 ** min(attempt, 6))


def _fetched(acceptors: Sequence[str], replies: list[Reply] | None) -> Logs:
    replies = replies if replies is not None else [None] * len(acceptors)
    return {a: (list(r) if isinstance(r, list) else None)
            for a, r in zip(acceptors, replies, strict=True)}


def _states(known: Logs) -> dict[str, AcceptorState]:
    return {a: replay(log) for a, log in known.items() if log is not None}


def _unknown(known: Logs) -> list[str]:
    return [a for a, log in known.items() if log is None]


def _granting(known: Logs, rnd: Round) -> dict[str, tuple[Round, Version] | None]:
    out: dict[str, tuple[Round, Version] | None] = {}
    for a, log in known.items():
        if log is not None:
            state = replay(log)
            if rnd in state.grants:
                out[a] = state.grants[rnd]
    return out


def _may_accept(log: list[Message | None] | None, rnd: Round) -> bool:
    if log is None:
        return True
    promised = replay(log).promised
    return promised is None or promised <= rnd


def _refresh(
    setup: Setup, instance: int, known: Logs, check: _FloorCheck
) -> Generator[Step, Any, None]:
    """Fetch every log we do not know exactly (no round trip if we know them all)."""
    stale = _unknown(known)
    if not stale:
        return
    replies = yield check.extend([Fetch(a, instance) for a in stale])
    replies, usable = check.split(len(stale), replies)
    known.update({a: log if a in usable else None
                  for a, log in _fetched(stale, replies).items()})


def _append_all(
    setup: Setup, instance: int, known: Logs, message: Message, targets: Sequence[str],
    check: _FloorCheck, *, assume_empty: bool = False,
) -> Generator[Step, Any, None]:
    """Append ``message`` on ``targets`` in one round trip, conditionally where the
    acceptor supports it and we know (or, in the fast round, assume) its length."""
    batch: list[Request] = []
    for a in targets:
        log = known[a]
        if a in setup.conditional and (log is not None or assume_empty):
            batch.append(Append(a, instance, message, len(log) if log is not None else 0))
        else:
            batch.append(Append(a, instance, message))
    replies = yield check.extend(batch)
    replies, usable = check.split(len(batch), replies)
    replies = replies if replies is not None else [None] * len(batch)
    for request, reply in zip(batch, replies, strict=True):
        assert isinstance(request, Append)
        log = known[request.acceptor]
        if request.position is not None and reply is True and request.acceptor in usable:
            base = log if log is not None else []
            known[request.acceptor] = [*base, message]
        else:
            # Plain appends, lost replies and taken positions: read it back if needed.
            known[request.acceptor] = None


# ================================================================ compaction
def _floor_requests(setup: Setup) -> list[Request]:
    return [ReadFloor(a) for a in setup.acceptors]


def _floor_of(setup: Setup, replies: Sequence[Reply]) -> int | None:
    """The floor that ``ReadFloor`` replies establish, or ``None`` if too few came.

    Crash faults: the highest (compaction records a floor on every acceptor before
    deleting anywhere, so any one that answers knows it). Byzantine: the
    ``f + 1``-th highest, which at least one honest acceptor vouches for."""
    floors = sorted((r for r in replies if type(r) is int and r >= 0), reverse=True)
    trusted = (setup.quorums.acceptors - 1) // 3 if setup.quorums.byzantine else 0
    return floors[trusted] if len(floors) > trusted else None


def _floors(setup: Setup, replies: Sequence[Reply] | None) -> tuple[int | None, set[str]]:
    """The floor a round trip's ``ReadFloor`` replies (one per acceptor, in order)
    establish, and the acceptors whose floor arrived: only their other replies of
    that round trip count."""
    replies = list(replies) if replies is not None else [None] * len(setup.acceptors)
    answered = {a for a, r in zip(setup.acceptors, replies, strict=True) if type(r) is int}
    return _floor_of(setup, replies), answered


def _with_floor(setup: Setup, logs: Logs, replies: Sequence[Reply] | None) -> tuple[Logs, int]:
    """Keep the logs of acceptors whose floor arrived in the same round trip; return
    them with the floor (0 if none could be established)."""
    floor, answered = _floors(setup, replies)
    return {a: (log if a in answered else None) for a, log in logs.items()}, floor or 0


class _FloorCheck:
    """Adds a ``ReadFloor`` per acceptor to each of a proposal's round trips.

    Why it is enough (docs/protocol.md, "Log compaction"): compaction writes the
    floor on every acceptor before deleting any log. If a request of one round trip
    met a log that compaction had emptied, the floors were all written before it,
    so the next round trip's floor reads see them and the proposal stops with
    :class:`Compacted` before concluding anything from that round trip. (That a
    conclusion drawn *in* such a round trip is sound too takes the grace period:
    see :func:`compact`.) A reply counts only from an acceptor whose floor arrived
    in the same round trip."""

    def __init__(self, setup: Setup, instance: int) -> None:
        self.setup = setup
        self.instance = instance

    def extend(self, batch: list[Request]) -> list[Request]:
        return batch + _floor_requests(self.setup)

    def split(self, size: int, replies: list[Reply] | None) -> tuple[list[Reply] | None, set[str]]:
        """The batch's own replies, and the acceptors whose replies may be used."""
        if replies is None:
            return None, set()
        floor, answered = _floors(self.setup, replies[size:])
        if floor is None:
            return replies[:size], set()
        if floor > self.instance:
            raise Compacted(self.instance, floor)
        return replies[:size], answered


def read_floor(setup: Setup) -> Run[int]:
    """The acceptors' compaction floor (one round trip)."""
    replies = yield _floor_requests(setup)
    floor = _floor_of(setup, replies or [])
    if floor is None:
        raise NoQuorum(0, 1, 0)
    return floor


def compact(setup: Setup, below: int) -> Run[int]:
    """Delete every acceptor's logs of the instances below ``below``, which must be
    a decided instance that every proposal still running began after (the caller's
    grace period ensures it; see docs/protocol.md). First the hints: an acceptor
    whose ``latest`` hint (for these acceptors) is below ``below`` gets ``below``,
    a version these acceptors decided and whose log stays, so a client behind the
    floor always finds a hint it can confirm at or above it -- without this, a
    version whose publisher crashed before writing its hint (a configuration
    change's seal, which no client takes as its base) could leave none, and every
    client behind would be stranded. Then the floor on *every* acceptor, then the
    deletions. Returns the log objects removed; raises
    :class:`NoQuorum` (having deleted nothing) if some acceptor did not record the
    floor. Interrupted deletions are finished by the next compaction."""
    hints = yield [ReadHint(a) for a in setup.acceptors]
    hints = hints if hints is not None else [None] * len(setup.acceptors)
    stale = [a for a, h in zip(setup.acceptors, hints, strict=True)
             if not (type(h) is int and h >= below)]
    if stale:
        yield [WriteHint(a, below) for a in stale]
    replies = yield [WriteFloor(a, below) for a in setup.acceptors]
    recorded = sum(1 for r in replies or [] if r is True)
    if recorded < len(setup.acceptors):
        raise NoQuorum(recorded, len(setup.acceptors), below)
    removed = yield [DropLogs(a, below) for a in setup.acceptors]
    return sum(r for r in removed or [] if type(r) is int)
