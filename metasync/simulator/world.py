"""The world the simulated clients run in: virtual time and its event queue, the
backends (each an acceptor, honest or Byzantine, and a store of object copies),
the configurations, the network between clients and backends, the storage's
commit objects, and the faults injected into backends and network, down to
losing a backend for good.

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

from metasync.mapping import StableMapping
from metasync.objects import Version
from metasync.paxos import (
    Append,
    DropLogs,
    Fetch,
    Message,
    ReadFloor,
    ReadHint,
    Reply,
    Request,
    WriteFloor,
)
from metasync.simulator.byzantine import Liar
from metasync.simulator.model import (
    CONFIG,
    V0,
    Acceptor,
    ReadRawHint,
    SimConfig,
    show_reply,
    show_request,
)
from metasync.simulator.params import DEFAULT_BFT_SHARE, draw_params, draw_plan
from metasync.simulator.storage import Storage

#: Events a schedule may process before it counts as not terminating.
EVENT_LIMIT = 200_000

# Event kinds (ints: cheap to compare, and the heap never compares payloads). The
# world handles DELIVER and the faults (DOWN, UP, CUT, MEND, HEAL); the simulation
# its clients' events (REPLY, TIMEOUT, WAKE, CRASH, RESTART, COMPACTOR) and the
# plan's (CHANGE, LOSE, SLEEP, ARISE, JOIN).
(DELIVER, REPLY, TIMEOUT, WAKE, CRASH, RESTART, DOWN, UP, CUT, MEND, HEAL,
 COMPACTOR, CHANGE, LOSE, SLEEP, ARISE, JOIN) = range(17)


class World:
    """The schedule of ``seed``'s world. Every random decision comes from ``self.rng``
    (``random.Random(seed)``), drawn in the order events happen, so a seed replays
    bit for bit; the plan of configuration changes and losses from ``self.plan_rng``,
    and storage faults from ``self.store_rng``."""

    def __init__(self, seed: int, bft_share: float = DEFAULT_BFT_SHARE, trace: bool = False) -> None:
        self.seed = seed
        self.rng = random.Random(seed)
        self.p = draw_params(self.rng, bft_share)
        self.plan_rng = random.Random(f"plan/{seed}")
        self.store_rng = random.Random(f"store/{seed}")
        self.plan = draw_plan(self.plan_rng, self.p)
        self.names = tuple(f"a{i}" for i in range(self.p.acceptors))
        self.acceptors = {a: Acceptor(a, a in self.p.byzantine) for a in self.names}
        #: Every configuration any client proposed, by id; version 0's is ``CONFIG``.
        self.configs = {CONFIG: SimConfig(CONFIG, self.names, self.plan.replicas, self.p.bft)}
        self._mappings: dict[str, StableMapping] = {}
        #: The newest version some client saw decided (its configuration is current).
        self.newest: Version = V0
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
        self.hints_written: list[tuple[int, str]] = []
        self.liar = Liar(self.rng, self.sent, self.hints_written)
        #: The side table: master id -> (parent master, changes): the commit objects.
        self.commits: dict[str, tuple[str | None, frozenset[str]]] = {}
        self.storage = Storage(self.acceptors, self.store_ok, self.stats, self.log)

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

    # --------------------------------------------------------------- configurations
    def current(self) -> SimConfig:
        """The configuration of the newest version some client saw decided."""
        return self.configs[self.newest.config]

    def mapping(self, config: str) -> StableMapping:
        """The production placement of configuration ``config`` (every capacity 1)."""
        found = self._mappings.get(config)
        if found is None:
            conf = self.configs[config]
            found = StableMapping([(b, 1) for b in conf.backends], conf.replicas)
            self._mappings[config] = found
        return found

    def new_backend(self) -> str:
        """A fresh, empty, honest backend (never part of any configuration yet)."""
        name = f"a{len(self.acceptors)}"
        self.acceptors[name] = Acceptor(name, False)
        if self.p.conditional and self.plan_rng.random() < 0.5:
            self.p.conditional = self.p.conditional | {name}
        return name

    def store_ok(self, index: int, backend: str) -> bool:
        """Whether one storage operation of client ``index`` on ``backend`` works now."""
        acc = self.acceptors[backend]
        if acc.lost or acc.down or (index, backend) in self.cuts:
            return False
        if self.faulty and self.store_rng.random() < self.p.p_fail:
            self.stats["storage requests failed"] += 1
            return False
        return True

    def unavailable(self, config: SimConfig, index: int | None = None) -> int:
        """Acceptors of ``config`` that are down, lost, Byzantine (or cut off from client
        ``index``)."""
        return sum(1 for b in config.acceptors
                   if (acc := self.acceptors[b]).down or acc.lost or acc.byzantine
                   or (index is not None and (index, b) in self.cuts))

    def handle(self, kind: int, data: Any) -> None:
        """Act on one event of the world (a subclass handles its clients' events)."""
        if kind == DELIVER:
            self.deliver(*data)
        elif kind == DOWN:
            name, duration = data
            acc = self.acceptors[name]
            if not self.faulty or acc.down or acc.lost:
                return
            config = self.current()
            beyond = False
            if name in config.acceptors:
                beyond = self.unavailable(config) >= config.quorums.faults
                if beyond and self.rng.random() >= self.p.p_exceed:
                    return
            acc.down = True
            self.stats["acceptor outages"] += 1
            if beyond:
                self.stats["outages beyond the tolerated faults"] += 1
            self.log(f"acceptor {name} DOWN for {duration:.2f}"
                     + (" (more than the quorums tolerate)" if beyond else ""))
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
            config = self.current()
            if (name in config.acceptors
                    and self.unavailable(config, index) >= config.quorums.faults
                    and self.rng.random() >= self.p.p_exceed):
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

    def schedule_outages_of(self, name: str) -> None:
        """A backend added during the fault phase has outages of its own."""
        for _ in range(self.plan_rng.choice((0, 1, 2)) if self.p.acceptor_crashes else 0):
            start = self.plan_rng.uniform(self.now, max(self.now, self.p.fault_time))
            self.at(start, DOWN, (name, self.plan_rng.uniform(0.2, self.p.fault_time / 2)))

    def heal(self) -> None:
        """The end of the fault phase: every acceptor up (those lost for good stay
        lost), every link mended, no more network faults."""
        self.faulty = False
        self.log("HEAL: all acceptors up, no more network faults or client crashes")
        for acc in self.acceptors.values():
            acc.down = False
        self.cuts.clear()

    # --------------------------------------------------------------- the network
    def delay(self, acceptor: str) -> float:
        d = self.rng.expovariate(1.0 / self.p.delay.get(acceptor, 0.02))
        if self.faulty and self.rng.random() < self.p.p_tail:
            self.stats["long delays"] += 1
            # The long tail: often past the timeout, sometimes past several instances.
            d += self.p.timeout * (self.rng.uniform(0.5, 4.0) if self.rng.random() < 0.8
                                   else self.rng.uniform(4.0, 40.0))
        return d

    def send(self, index: int, epoch: int, batch: int, i: int, req: Request | ReadRawHint,
             issued: float | None, config: str) -> None:
        """Client ``index`` (in ``epoch``) sends ``req``, request ``i`` of its round trip
        ``batch``, as a client of configuration ``config``. ``issued`` is the send
        time, which holds compaction back until the request lands (see
        ``undelivered``); None for the compactor's own requests."""
        if isinstance(req, Append):
            key = (req.instance, req.message)
            if key not in self._sent_set:
                self._sent_set.add(key)
                self.sent.setdefault(req.instance, []).append(req.message)
        if issued is not None:
            self.undelivered[issued] += 1
        self.at(self.now + self.delay(req.acceptor), DELIVER,
                (index, epoch, batch, i, req, issued, config))

    def sender(self, index: int, epoch: int) -> str:
        """How the trace names client ``index`` sending in ``epoch``."""
        return f"c{index}"

    def deliver(self, index: int, epoch: int, batch: int, i: int, req: Request | ReadRawHint,
                issued: float | None, config: str) -> None:
        """A request reaches its acceptor: apply it (maybe), send a reply (maybe)."""
        if issued is not None:
            self.undelivered[issued] -= 1
            if not self.undelivered[issued]:
                del self.undelivered[issued]
        acc = self.acceptors[req.acceptor]
        cut = (index, acc.name) in self.cuts
        if acc.lost or acc.down or cut or (self.faulty and self.rng.random() < self.p.p_fail):
            why = "lost" if acc.lost else "down" if acc.down else "partitioned" if cut else "failed"
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
        reply = self.byzantine_apply(acc, req, config) if acc.byzantine else self.apply(acc, req, config)
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
    def apply(self, acc: Acceptor, req: Request | ReadRawHint, config: str) -> Reply | tuple[int, str]:
        """An honest acceptor's answer to ``req`` from a client of configuration
        ``config`` (hints and floor records name configurations)."""
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
            # consensus.read_hint: a hint of another acceptor set cannot be confirmed here.
            return acc.hint[0] if acc.hint is not None and acc.hint[1] == config else None
        if isinstance(req, ReadRawHint):
            return acc.hint if acc.hint is not None else False
        if isinstance(req, ReadFloor):
            return acc.floor
        if isinstance(req, WriteFloor):
            self.write_floor(acc, req.below, config)
            return True
        if isinstance(req, DropLogs):
            return self.drop_logs(acc, req.below)
        acc.hint = (req.number, config)
        self.hints_written.append(acc.hint)
        return True

    def byzantine_apply(self, acc: Acceptor, req: Request | ReadRawHint,
                        config: str) -> Reply | tuple[int, str]:
        """A Byzantine acceptor's answer (:class:`~metasync.simulator.byzantine.Liar`)."""
        if isinstance(req, WriteFloor):
            if self.rng.random() < 0.7:
                self.write_floor(acc, req.below, config)
            return True
        if isinstance(req, DropLogs):
            return self.drop_logs(acc, req.below) if self.rng.random() < 0.7 else self.rng.randint(0, 9)
        return self.liar.apply(acc, req, config)

    def write_floor(self, acc: Acceptor, below: int, config: str) -> None:
        """Record floor ``below``, naming the acceptors of ``config`` (those compacting,
        which ran instance ``below``), unless a floor as high is recorded."""
        if acc.floor < below:
            acc.floor = below
            acc.floor_records[below] = self.configs[config].acceptors

    def drop_logs(self, acc: Acceptor, below: int) -> int:
        removed = 0
        for instance in [i for i in acc.logs if i < below]:
            acc.archive.setdefault(instance, acc.logs[instance])
            removed += len(acc.logs.pop(instance))
        for floor in [f for f in acc.floor_records if f < below]:
            del acc.floor_records[floor]
        return removed

    # --------------------------------------------------------------- the storage
    def changes_of(self, master: str | None) -> frozenset[str]:
        if master is None:
            return frozenset()
        return self.commits[master][1]
