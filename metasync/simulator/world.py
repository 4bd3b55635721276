"""The world the simulated clients run in: virtual time and its event queue, the
acceptors (honest and Byzantine), the network between clients and acceptors, the
storage's commit objects, and the faults injected into acceptors and network.

Clients are not part of it: :class:`metasync.simulator.simulation.Simulation`
extends the world with them. The world addresses a client only by its index and
epoch (a client's epoch changes when it crashes or its session ends, so replies
to an older epoch are dropped).
"""

from __future__ import annotations

import heapq
import random
from collections import Counter
from collections.abc import Callable
from typing import Any

from metasync.paxos import (
    Append,
    DropLogs,
    Fetch,
    Message,
    Quorums,
    ReadFloor,
    ReadHint,
    Reply,
    Request,
    Round,
    WriteFloor,
)
from metasync.simulator.model import Acceptor, show_reply, show_request
from metasync.simulator.params import DEFAULT_BFT_SHARE, draw_params

#: Events a schedule may process before it counts as not terminating.
EVENT_LIMIT = 200_000

# Event kinds (ints: cheap to compare, and the heap never compares payloads). The
# world handles DELIVER and the faults (DOWN, UP, CUT, MEND, HEAL); the simulation
# its clients' events (REPLY, TIMEOUT, WAKE, CRASH, RESTART, COMPACTOR).
(DELIVER, REPLY, TIMEOUT, WAKE, CRASH, RESTART, DOWN, UP, CUT, MEND, HEAL,
 COMPACTOR) = range(12)


def _by_round(msg: Message) -> Round:
    return msg.round


class World:
    """The schedule of ``seed``'s world. Every random decision comes from ``self.rng``
    (``random.Random(seed)``), drawn in the order events happen, so a seed replays
    bit for bit."""

    def __init__(self, seed: int, bft_share: float = DEFAULT_BFT_SHARE, trace: bool = False) -> None:
        self.seed = seed
        self.rng = random.Random(seed)
        self.p = draw_params(self.rng, bft_share)
        self.names = tuple(f"a{i}" for i in range(self.p.acceptors))
        self.quorums = Quorums.bft(self.p.acceptors) if self.p.bft else Quorums.crash(self.p.acceptors)
        self.acceptors = {a: Acceptor(a, a in self.p.byzantine) for a in self.names}
        self.tracing = trace
        self.trace: list[str] = []
        self.violations: list[str] = []
        #: What happened, for the --stats summary.
        self.stats: Counter[str] = Counter()
        self.now = 0.0
        self.heap: list[tuple[float, int, int, Any]] = []
        self.seq = 0
        self.events = 0
        #: Until the heal: network faults, outages, partitions and client crashes happen.
        self.faulty = True
        #: (client, acceptor) links partitioned for now.
        self.cuts: set[tuple[int, str]] = set()
        #: Issue times of the pushing clients' requests not yet delivered.
        self.undelivered: Counter[float] = Counter()
        #: Every message some proposer sent, per instance (what a Byzantine may return).
        self.sent: dict[int, list[Message]] = {}
        self._sent_set: set[tuple[int, Message]] = set()
        self.hints_written: list[int] = []
        #: The side table: master id -> (parent master, changes): the commit objects.
        self.commits: dict[str, tuple[str | None, frozenset[str]]] = {}

    # --------------------------------------------------------------- time and trace
    def log(self, text: str) -> None:
        if self.tracing:
            self.trace.append(f"{self.now:10.4f}  {text}")

    def at(self, when: float, kind: int, data: Any) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (when, self.seq, kind, data))

    def violation(self, text: str) -> None:
        self.violations.append(text)
        self.log(f"VIOLATION {text}")

    def loop(self, until: float, done: Callable[..., bool]) -> bool:
        """Process events until ``done()`` or virtual time ``until``; False on overrun."""
        while self.heap and not done():
            when, _, kind, data = self.heap[0]
            if when > until or self.events >= EVENT_LIMIT:
                return False
            heapq.heappop(self.heap)
            self.now = max(self.now, when)
            self.events += 1
            self.handle(kind, data)
        return bool(done())

    def drain(self) -> None:
        """Deliver everything still in flight (late requests still land)."""
        while self.heap and self.events < EVENT_LIMIT:
            when, _, kind, data = heapq.heappop(self.heap)
            self.now = max(self.now, when)
            self.events += 1
            self.handle(kind, data)

    def handle(self, kind: int, data: Any) -> None:
        """Act on one event of the world (a subclass handles its clients' events)."""
        if kind == DELIVER:
            self.deliver(*data)
        elif kind == DOWN:
            name, duration = data
            acc = self.acceptors[name]
            if not self.faulty or acc.down:
                return
            unavailable = sum(1 for a in self.acceptors.values() if a.down or a.byzantine)
            if unavailable >= self.quorums.faults and self.rng.random() >= self.p.p_exceed:
                return
            acc.down = True
            self.stats["acceptor outages"] += 1
            if unavailable >= self.quorums.faults:
                self.stats["outages beyond the tolerated faults"] += 1
            self.log(f"acceptor {name} DOWN for {duration:.2f}"
                     + (" (more than the quorums tolerate)" if unavailable >= self.quorums.faults else ""))
            self.at(self.now + duration, UP, name)
        elif kind == UP:
            acc = self.acceptors[data]
            if acc.down:
                acc.down = False
                self.log(f"acceptor {data} up")
        elif kind == CUT:
            index, name, duration = data
            if not self.faulty or (index, name) in self.cuts:
                return
            unavailable = sum(1 for a in self.acceptors.values()
                              if a.down or a.byzantine or (index, a.name) in self.cuts)
            if unavailable >= self.quorums.faults and self.rng.random() >= self.p.p_exceed:
                return
            self.cuts.add((index, name))
            self.stats["partitions"] += 1
            self.log(f"c{index} cannot reach {name} for {duration:.2f}")
            self.at(self.now + duration, MEND, (index, name))
        elif kind == MEND:
            if data in self.cuts:
                self.cuts.discard(data)
                self.log(f"c{data[0]} reaches {data[1]} again")
        elif kind == HEAL:
            self.heal()

    # --------------------------------------------------------------- faults
    def schedule_faults(self, clients: int) -> None:
        """Draw the acceptor outages and the partitions of ``clients`` clients' links
        in the fault phase, and the heal that ends it."""
        p = self.p
        for _ in range(p.acceptor_crashes):
            start = self.rng.uniform(0, p.fault_time)
            self.at(start, DOWN, (self.rng.choice(self.names), self.rng.uniform(0.2, p.fault_time / 2)))
        for _ in range(p.partitions):
            start = self.rng.uniform(0, p.fault_time)
            self.at(start, CUT, (self.rng.randrange(clients), self.rng.choice(self.names),
                                 self.rng.uniform(0.2, p.fault_time / 2)))
        self.at(p.fault_time, HEAL, None)

    def heal(self) -> None:
        """The end of the fault phase: every acceptor up, every link mended, no more
        network faults."""
        self.faulty = False
        self.log("HEAL: all acceptors up, no more network faults or client crashes")
        for acc in self.acceptors.values():
            acc.down = False
        self.cuts.clear()

    # --------------------------------------------------------------- the network
    def delay(self, acceptor: str) -> float:
        d = self.rng.expovariate(1.0 / self.p.delay[acceptor])
        if self.faulty and self.rng.random() < self.p.p_tail:
            self.stats["long delays"] += 1
            # The long tail: often past the timeout, sometimes past several instances.
            d += self.p.timeout * (self.rng.uniform(0.5, 4.0) if self.rng.random() < 0.8
                                   else self.rng.uniform(4.0, 40.0))
        return d

    def send(
        self, index: int, epoch: int, batch: int, i: int, req: Request, issued: float | None
    ) -> None:
        """Client ``index`` (in ``epoch``) sends ``req``, request ``i`` of its round trip
        ``batch``. ``issued`` is the send time, which holds compaction back until the
        request lands (see ``undelivered``); None for the compactor's own requests."""
        if isinstance(req, Append):
            key = (req.instance, req.message)
            if key not in self._sent_set:
                self._sent_set.add(key)
                self.sent.setdefault(req.instance, []).append(req.message)
        if issued is not None:
            self.undelivered[issued] += 1
        self.at(self.now + self.delay(req.acceptor), DELIVER, (index, epoch, batch, i, req, issued))

    def sender(self, index: int, epoch: int) -> str:
        """How the trace names client ``index`` sending in ``epoch``."""
        return f"c{index}"

    def deliver(
        self, index: int, epoch: int, batch: int, i: int, req: Request, issued: float | None
    ) -> None:
        """A request reaches its acceptor: apply it (maybe), send a reply (maybe)."""
        if issued is not None:
            self.undelivered[issued] -= 1
            if not self.undelivered[issued]:
                del self.undelivered[issued]
        acc = self.acceptors[req.acceptor]
        cut = (index, acc.name) in self.cuts
        if acc.down or cut or (self.faulty and self.rng.random() < self.p.p_fail):
            why = "down" if acc.down else "partitioned" if cut else "failed"
            if why == "failed" and isinstance(req, Append) and self.rng.random() < self.p.p_torn:
                # A torn write: the append failed but left an entry that does not decode.
                log = acc.logs.setdefault(req.instance, [])
                if req.position is None or len(log) == req.position:
                    log.append(None)
                    why = "torn"
            self.stats[f"requests {why}"] += 1
            if self.tracing:
                self.log(f"{self.sender(index, epoch)} -> {acc.name} {show_request(req)}: {why}")
            self.at(self.now + self.delay(req.acceptor), REPLY, (index, epoch, batch, i, None))
            return
        reply = self.byzantine_apply(acc, req) if acc.byzantine else self.apply(acc, req)
        lost = self.faulty and self.rng.random() < self.p.p_lost
        if self.tracing:
            self.log(f"{self.sender(index, epoch)} -> {acc.name} {show_request(req)} => "
                     f"{show_reply(reply)}" + (" (reply lost)" if lost else ""))
        if lost:
            self.stats["replies lost"] += 1
            if self.rng.random() < 0.5:
                return  # no answer at all: the client times out
            reply = None
        self.at(self.now + self.delay(req.acceptor), REPLY, (index, epoch, batch, i, reply))

    # --------------------------------------------------------------- the acceptors
    def apply(self, acc: Acceptor, req: Request) -> Reply:
        if isinstance(req, Fetch):
            return list(acc.logs.get(req.instance, ()))
        if isinstance(req, Append):
            log = acc.logs.setdefault(req.instance, [])
            if req.position is not None:
                if acc.name not in self.p.conditional:
                    self.violation(f"conditional append on {acc.name}, which has none: {req}")
                    return None
                if len(log) != req.position:
                    return False
            log.append(req.message)
            if req.position is None and self.faulty and self.rng.random() < self.p.p_dup:
                # A backend client library retried a plain append that had worked.
                self.stats["plain appends duplicated"] += 1
                log.append(req.message)
            return True
        if isinstance(req, ReadHint):
            return acc.hint
        if isinstance(req, ReadFloor):
            return acc.floor
        if isinstance(req, WriteFloor):
            acc.floor = max(acc.floor, req.below)
            return True
        if isinstance(req, DropLogs):
            return self.drop_logs(acc, req.below)
        acc.hint = req.number
        self.hints_written.append(req.number)
        return True

    def drop_logs(self, acc: Acceptor, below: int) -> int:
        removed = 0
        for instance in [i for i in acc.logs if i < below]:
            acc.archive.setdefault(instance, acc.logs[instance])
            removed += len(acc.logs.pop(instance))
        return removed

    def byzantine_apply(self, acc: Acceptor, req: Request) -> Reply:
        """A Byzantine acceptor: anything the MAC lets it get away with."""
        rng = self.rng
        if isinstance(req, Fetch):
            reply = self.byzantine_log(acc, req.instance)
            if reply and rng.random() < 0.15:
                # Garbage that fails its MAC: the reader sees an undecodable entry.
                reply.insert(rng.randrange(len(reply) + 1), None)
            return reply
        if isinstance(req, Append):
            log = acc.logs.setdefault(req.instance, [])
            fits = req.position is None or len(log) == req.position
            if fits and rng.random() < 0.8:
                log.append(req.message if rng.random() < 0.9 else None)
            if req.position is None:
                return True
            return fits if rng.random() < 0.6 else rng.random() < 0.5
        if isinstance(req, ReadHint):
            if self.hints_written and rng.random() < 0.7:
                return rng.choice(self.hints_written)
            return acc.hint if rng.random() < 0.5 else None
        if isinstance(req, ReadFloor):
            # Hide the floor, tell it, or claim a higher one.
            how = rng.random()
            return 0 if how < 0.3 else acc.floor if how < 0.7 else acc.floor + rng.randint(1, 6)
        if isinstance(req, WriteFloor):
            if rng.random() < 0.7:
                acc.floor = max(acc.floor, req.below)
            return True
        if isinstance(req, DropLogs):
            return self.drop_logs(acc, req.below) if rng.random() < 0.7 else rng.randint(0, 9)
        acc.hint = req.number
        self.hints_written.append(req.number)
        return True

    def byzantine_log(self, acc: Acceptor, instance: int) -> list[Message | None]:
        """What a Byzantine acceptor claims its log is: reordered, cut and spliced real
        messages (of this instance only: the MAC binds the instance)."""
        rng = self.rng
        own = list(acc.logs.get(instance, ()))
        sent: list[Message] = self.sent.get(instance, [])
        claim: list[Message | None]
        how = rng.random()
        if how < 0.2:
            claim = own
        elif how < 0.35:
            claim = [m for m in own if rng.random() < 0.6]
        elif how < 0.5:
            claim = own
            rng.shuffle(claim)
        elif how < 0.7:
            claim = [m for m in own + [m for m in sent if rng.random() < 0.5] if rng.random() < 0.7]
            if rng.random() < 0.5:
                rng.shuffle(claim)
        elif how < 0.8:
            # Claim to have accepted everything ever sent, promising nothing first.
            accepted = sorted((m for m in sent if m.type == "accept"), key=_by_round)
            claim = list(accepted)
        elif how < 0.87:
            # Claim the highest promise seen, to pre-empt everyone.
            everything = sorted(sent, key=_by_round)
            claim = list(everything)
        elif how < 0.95:
            # Grant the newest prepare while reporting the oldest accepted value.
            accepts = [m for m in sent if m.type == "accept"]
            prepares = [m for m in sent if m.type == "prepare"]
            claim = []
            if accepts:
                claim.append(min(accepts, key=_by_round))
            if prepares:
                claim.append(max(prepares, key=_by_round))
        else:
            claim = []
        return claim

    # --------------------------------------------------------------- the storage
    def changes_of(self, master: str | None) -> frozenset[str]:
        if master is None:
            return frozenset()
        return self.commits[master][1]
