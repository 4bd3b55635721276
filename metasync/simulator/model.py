"""The simulation's data: versions and commits, configurations, backends (acceptor
logs and object copies), clients, their round trips and a schedule's result, and
how the trace shows them."""

from __future__ import annotations

import hashlib
from collections.abc import Generator, Sequence
from dataclasses import dataclass, field
from typing import Any

from metasync.objects import Version
from metasync.paxos import (
    FAST_ROUND,
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
    Round,
    WriteFloor,
)

#: The id of every schedule's first configuration (version 0's).
CONFIG = hashlib.sha256(b"metasync simulator config").hexdigest()
V0 = Version(0, None, CONFIG)


@dataclass(frozen=True)
class SimConfig:
    """A configuration: its backends (every one an acceptor, as ``backend add`` and
    ``backend remove`` keep them), R, and the fault model of the schedule."""

    id: str
    backends: tuple[str, ...]
    replicas: int
    bft: bool
    #: How many changes led to it (0: version 0's), for the trace.
    serial: int = 0

    @property
    def acceptors(self) -> tuple[str, ...]:
        return self.backends

    @property
    def quorums(self) -> Quorums:
        n = len(self.backends)
        return Quorums.bft(n) if self.bft else Quorums.crash(n)

    def describe(self) -> str:
        return f"C{self.serial}{{{','.join(self.backends)}}} R={self.replicas}"


def config_id(serial: int, backends: tuple[str, ...], replicas: int) -> str:
    text = f"config|{serial}|{','.join(backends)}|{replicas}"
    return hashlib.sha256(text.encode()).hexdigest()


def blob_id(change: str) -> str:
    """The object id of the content change ``change`` adds (uploaded by its maker)."""
    return hashlib.sha256(f"blob|{change}".encode()).hexdigest()


@dataclass(frozen=True)
class ReadRawHint:
    """Read ``acceptor``'s ``latest`` hint as stored: ``(version, config id)``;
    ``False`` if it has none, ``None`` if it did not answer (what
    ``consensus.read_hint`` reads for :mod:`metasync.follow`)."""

    acceptor: str


#: What a simulated session yields: a round trip of requests (the protocol's, or a
#: raw hint read) or a backoff; it is sent the replies.
Out = Sequence[Request | ReadRawHint] | Backoff
Session = Generator[Out, Any, None]


@dataclass(frozen=True)
class Change:
    """A configuration change a client was asked to make (resolved against the
    latest configuration when it runs, like ``metasync backend add/remove`` or
    ``config replicas``): ``add`` a fresh backend, ``remove`` a backend (``dead``:
    one lost for good; else a live one, chosen then), or set ``replicas``; or
    ``rebalance`` after a change (``sources``: the old configuration's backends,
    read from too, as ``reconfigure``'s second rebalance does)."""

    kind: str
    backend: str = ""
    dead: bool = False
    replicas: int = 0
    sources: tuple[str, ...] = ()

    def describe(self) -> str:
        if self.kind == "add":
            return f"add {self.backend}"
        if self.kind == "remove":
            return f"remove {'dead ' + self.backend if self.dead else 'a live backend'}"
        if self.kind == "rebalance":
            return "rebalance" + (f" (after removing dead {self.backend})" if self.dead else "")
        return f"replicas {self.replicas}"


def commit_id(parent: str | None, changes: frozenset[str] | set[str]) -> str:
    """The master id of the commit with ``parent`` holding exactly ``changes``."""
    text = f"{parent or '-'}|{','.join(sorted(changes))}"
    return hashlib.sha256(text.encode()).hexdigest()


def short(value: Version | None) -> str:
    if value is None:
        return "-"
    return f"v{value.number}:{(value.master or 'none')[:6]}"


def show_round(rnd: Round) -> str:
    return "fast" if rnd == FAST_ROUND else f"{rnd.number}/{rnd.proposer}"


def show_message(msg: Message | None) -> str:
    if msg is None:
        return "junk"
    if msg.type == "prepare":
        return f"prepare({show_round(msg.round)})"
    return f"accept({show_round(msg.round)}, {short(msg.value)})"


def show_request(req: Request | ReadRawHint) -> str:
    if isinstance(req, ReadRawHint):
        return "read-hint (raw)"
    if isinstance(req, Fetch):
        return f"fetch #{req.instance}"
    if isinstance(req, Append):
        pos = "" if req.position is None else f" @{req.position}"
        return f"append #{req.instance} {show_message(req.message)}{pos}"
    if isinstance(req, ReadHint):
        return "read-hint"
    if isinstance(req, ReadFloor):
        return "read-floor"
    if isinstance(req, WriteFloor):
        return f"write-floor {req.below}"
    if isinstance(req, DropLogs):
        return f"drop-logs below {req.below}"
    return f"write-hint {req.number}"


def show_reply(reply: Reply | tuple[int, str]) -> str:
    if isinstance(reply, list):
        return "[" + ", ".join(show_message(m) for m in reply) + "]"
    if isinstance(reply, tuple):
        return f"({reply[0]}, {reply[1][:6]})"
    return repr(reply)


# ====================================================================== the state
@dataclass
class Acceptor:
    """One simulated storage backend: its logs, its hint and its floor, and the
    object copies and spill records it stores."""

    name: str
    byzantine: bool
    #: Per instance, the log; ``None`` is an entry that does not decode (a torn write,
    #: garbage): it takes a position but is no message.
    logs: dict[int, list[Message | None]] = field(default_factory=dict)
    #: The ``latest`` hint: (version, id of the configuration that decided it).
    hint: tuple[int, str] | None = None
    down: bool = False
    #: Lost for good: it never answers again, and what it stored is gone.
    lost: bool = False
    #: The compaction floor: logs of instances below it may have been deleted; and
    #: per floor the acceptors its record names (those that ran that instance).
    floor: int = 0
    floor_records: dict[int, tuple[str, ...]] = field(default_factory=dict)
    #: Each deleted log as it was (for the checker only; no client reads it).
    archive: dict[int, list[Message | None]] = field(default_factory=dict)
    #: Object ids of the copies stored here (``objects/``).
    objects: set[str] = field(default_factory=set)
    #: ``spills/<id>`` records: object id -> the backends the writer recorded.
    spills: dict[str, tuple[str, ...]] = field(default_factory=dict)


@dataclass
class Batch:
    """One round trip of a client: the requests it sent and the replies so far."""

    id: int
    requests: Sequence[Request | ReadRawHint]
    replies: list[Any]
    waiting: int


@dataclass
class Client:
    """One client (or the compactor): durable state that survives a crash, and the
    running session."""

    index: int
    pushes: int
    #: Durable state (survives a crash): the changes in the local copy, the newest
    #: version learned (the base: its configuration places and decides), changes
    #: made so far, and the changes not yet known pushed.
    changes: set[str] = field(default_factory=set)
    known: Version = V0
    created: int = 0
    pending: list[str] = field(default_factory=list)
    #: Configuration changes asked of it, not done yet.
    tasks: list[Change] = field(default_factory=list)
    #: Objects made but on no backend yet (the outbox), and copies its uploads
    #: missed (missing-copy rows: object id, holder).
    outbox: list[str] = field(default_factory=list)
    missing: set[tuple[str, str]] = field(default_factory=set)
    #: Objects it uploaded with fewer than R copies, not yet repaired.
    short_objects: set[str] = field(default_factory=set)
    #: A fresh clone: it joins at ``joins_at`` from backend ``entry``'s hint.
    clone: bool = False
    joins_at: float = 0.0
    entry: str = ""
    started: bool = False
    #: Asleep (its session dropped) until ``wakes_at``.
    wakes_at: float = 0.0
    asleep: bool = False
    #: Publish the hint after every push it wins (else with probability ``p_hint``).
    publish: bool = False
    #: Volatile: the running session (None while crashed or done).
    session: int = 0
    gen: Session | None = None
    epoch: int = 0
    batch: Batch | None = None
    crashed: bool = False
    finished: bool = False
    final: Version | None = None
    #: The running session's proposer id (what the trace calls the client).
    label: str = ""
    #: When the running get_recent or propose began (compaction's grace, see
    #: Simulation.compactable).
    op_started: float = 0.0
    #: Whether a get_recent or propose is running.
    in_op: bool = False
    #: The configuration whose acceptors the running protocol generator talks to.
    using: str = CONFIG
    #: The reading of the next instance the last get_recent left (on ``cached_on``).
    cached: Reading | None = None
    cached_on: str = ""
    #: Whether an upload of the running push got fewer than R copies.
    short: bool = False


@dataclass
class Result:
    """What one schedule did: its violations (none: ``ok``), trace and statistics."""

    seed: int
    params: str
    violations: list[str]
    trace: list[str]
    events: int
    versions: int
    stats: dict[str, int] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.violations
