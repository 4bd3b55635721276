"""The simulation's data: versions and commits, acceptors, clients, their round
trips and a schedule's result, and how the trace shows them."""

from __future__ import annotations

import hashlib
from collections.abc import Generator
from dataclasses import dataclass, field
from typing import Any

from metasync.objects import Version
from metasync.paxos import (
    FAST_ROUND,
    Append,
    DropLogs,
    Fetch,
    Message,
    ReadFloor,
    ReadHint,
    Reply,
    Request,
    Round,
    Step,
    WriteFloor,
)

#: The configuration id every version carries (the simulation never reconfigures).
CONFIG = hashlib.sha256(b"metasync simulator config").hexdigest()
V0 = Version(0, None, CONFIG)

Session = Generator[Step, Any, None]


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


def show_request(req: Request) -> str:
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


def show_reply(reply: Reply) -> str:
    if isinstance(reply, list):
        return "[" + ", ".join(show_message(m) for m in reply) + "]"
    return repr(reply)


# ====================================================================== the state
@dataclass
class Acceptor:
    """One simulated storage backend: its logs, its hint and its floor."""

    name: str
    byzantine: bool
    #: Per instance, the log; ``None`` is an entry that does not decode (a torn write,
    #: garbage): it takes a position but is no message.
    logs: dict[int, list[Message | None]] = field(default_factory=dict)
    hint: int | None = None
    down: bool = False
    #: The compaction floor: logs of instances below it may have been deleted.
    floor: int = 0
    #: Each deleted log as it was (for the checker only; no client reads it).
    archive: dict[int, list[Message | None]] = field(default_factory=dict)


@dataclass
class Batch:
    """One round trip of a client: the requests it sent and the replies so far."""

    id: int
    requests: list[Request]
    replies: list[Reply]
    waiting: int


@dataclass
class Client:
    """One client (or the compactor): durable state that survives a crash, and the
    running session."""

    index: int
    pushes: int
    #: Durable state (survives a crash): the changes in the local copy, the newest
    #: version learned, changes made so far, and the changes not yet known pushed.
    changes: set[str] = field(default_factory=set)
    known: Version = V0
    created: int = 0
    pending: list[str] = field(default_factory=list)
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
