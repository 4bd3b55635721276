"""One schedule of the pPaxos simulator: clients pushing through the real protocol
generators in the world of :mod:`metasync.simulator.world`, a compactor, and the
final checks (the package docstring, :mod:`metasync.simulator`, has the overview).

A client's session is a generator like the protocol's own: it yields the protocol's
requests and backoffs, and :class:`Simulation` sends each round trip into the world,
collects the replies (or a timeout) and resumes the session with them.
"""

from __future__ import annotations

import random
from collections.abc import Generator
from typing import Any

from metasync.objects import Version
from metasync.paxos import (
    Backoff,
    Compacted,
    Contended,
    NoQuorum,
    Reading,
    Reply,
    Request,
    Setup,
    Step,
    compact,
    get_recent,
    past_floor,
    propose,
    publish_hint,
)
from metasync.simulator.checker import Checker
from metasync.simulator.model import (
    CONFIG,
    Batch,
    Client,
    Result,
    Session,
    commit_id,
    short,
)
from metasync.simulator.params import DEFAULT_BFT_SHARE
from metasync.simulator.world import COMPACTOR, CRASH, REPLY, RESTART, TIMEOUT, WAKE, World

#: Propose attempts (one per instance) in one push before starting over with get_recent.
PUSH_ATTEMPTS = 8
#: After healing, how long (virtual seconds) clients get to finish their pushes.
HEAL_LIMIT = 600.0
#: Passes of get_recent over all clients to reach quiescence at the end.
FINAL_PASSES = 4


def recent(setup: Setup, known: Version, rng: random.Random
           ) -> Generator[Step, Any, tuple[Version, Reading | None]]:
    """``get_recent``, jumping over compacted instances as the driver does when the
    floor's acceptors are its own (always, here: the simulation never reconfigures)."""
    while True:
        try:
            return (yield from get_recent(setup, known, rng))
        except Compacted as exc:
            known = yield from past_floor(setup, exc.floor, rng)


# ====================================================================== simulation
class Simulation(World):
    """One schedule: the world of ``seed`` with its clients, each running sessions
    of pushes through the real protocol generators, and the compactor; then the
    checker (:meth:`run`)."""

    def __init__(self, seed: int, bft_share: float = DEFAULT_BFT_SHARE, trace: bool = False) -> None:
        super().__init__(seed, bft_share, trace)
        self.clients = [Client(i, k) for i, k in enumerate(self.p.pushes)]
        #: Deletes old logs now and then (``gc``'s log compaction); never crashes.
        self.compactor = Client(len(self.clients), 0, finished=True)
        self.all_clients = [*self.clients, self.compactor]
        #: Per instance, when some client first reported it decided.
        self.observed_at: dict[int, float] = {}
        self.compacted_below = 0
        self.batches = 0
        #: Every value a client's protocol run returned as decided, per instance.
        self.observed: dict[int, list[tuple[Version, str]]] = {}
        #: Successful pushes: (change, client session, version that made it known).
        self.successes: list[tuple[str, str, Version]] = []
        self.unfinished = 0

    # --------------------------------------------------------------- the client
    def learned(self, c: Client, value: Version, how: str) -> None:
        """``c``'s protocol run reported ``value`` decided: record it, merge it in."""
        if value.number == 0:
            return
        self.observed.setdefault(value.number, []).append((value, f"{c.label} ({how})"))
        self.observed_at.setdefault(value.number, self.now)
        if value.master is None or value.master not in self.commits:
            self.violation(f"{c.label} learned {value} whose master names no commit ({how})")
            return
        if value.number > c.known.number:
            c.changes |= self.changes_of(value.master)
            c.known = value

    def setup(self, c: Client, proposer: str, max_attempts: int) -> Setup:
        conditional = self.p.conditional if self.p.use_conditional[c.index] else frozenset()
        return Setup(self.names, conditional, self.quorums, proposer, max_attempts=max_attempts,
                     backoff=0.05, fast_path=self.p.fast_path[c.index])

    def session(self, c: Client, proposer: str) -> Session:
        """One client session: push the client's remaining changes, one at a time."""
        setup = self.setup(c, proposer, self.p.max_attempts)
        rng = random.Random(self.rng.getrandbits(64))
        failures = 0
        while True:
            if not c.pending:
                if c.created >= c.pushes:
                    return
                if self.p.think:
                    yield Backoff(rng.uniform(0, self.p.think))
                change = f"c{c.index}-{c.created}"
                c.created += 1
                c.changes.add(change)
                c.pending.append(change)
                self.log(f"{c.label} makes change {change}")
            if (yield from self.push(c, setup, rng)):
                failures = 0
            else:
                failures += 1
                yield Backoff(rng.uniform(0.05, 0.5) * 2 ** min(failures, 5))

    def push(self, c: Client, setup: Setup, rng: random.Random) -> Generator[Step, Any, bool]:
        ok, cached = yield from self.learn(c, setup, rng)
        if not ok:
            return False
        for _ in range(PUSH_ATTEMPTS):
            base = c.known
            if all(ch in self.changes_of(base.master) for ch in c.pending):
                self.succeeded(c, base, "already in master")
                return True
            changes = frozenset(c.changes)
            master = commit_id(base.master, changes)
            # The commit objects are uploaded before proposing.
            self.commits.setdefault(master, (base.master, changes))
            value = Version(base.number + 1, master, CONFIG)
            logs = cached.logs if cached is not None and cached.instance == value.number else None
            cached = None
            self.log(f"{c.label} proposes {short(value)} = {sorted(changes)}")
            try:
                c.in_op, c.op_started = True, self.now
                outcome = yield from propose(setup, value.number, value, rng, logs)
            except (NoQuorum, Contended) as exc:
                self.stats[f"propose raised {type(exc).__name__}"] += 1
                self.log(f"{c.label} propose failed: {exc}")
                return False
            except Compacted as exc:
                # Behind the compaction floor: learn past it, like after losing.
                self.stats["proposals stopped at the compaction floor"] += 1
                self.log(f"{c.label} propose stopped: {exc}")
                ok, cached = yield from self.learn(c, setup, rng)
                if not ok:
                    return False
                continue
            finally:
                c.in_op = False
            self.log(f"{c.label} propose #{value.number} -> {short(outcome)}")
            if outcome is None:
                self.violation(f"{c.label}: propose of {value} returned None")
                return False
            self.learned(c, outcome, "propose")
            if outcome == value:
                self.succeeded(c, value, "won")
                if rng.random() < self.p.p_hint:
                    yield from publish_hint(setup, value)
                return True
            if rng.random() < 0.5:
                # Learn again (else: propose straight at the instance after the one lost).
                ok, cached = yield from self.learn(c, setup, rng)
                if not ok:
                    return False
        return False

    def learn(
        self, c: Client, setup: Setup, rng: random.Random
    ) -> Generator[Step, Any, tuple[bool, Reading | None]]:
        """Run get_recent for ``c``: (False, None) if it gave up, else (True, the
        reading of the next instance, if any)."""
        try:
            c.in_op, c.op_started = True, self.now
            head, reading = yield from recent(setup, c.known, rng)
        except (NoQuorum, Contended) as exc:
            self.stats[f"get_recent raised {type(exc).__name__}"] += 1
            self.log(f"{c.label} get_recent failed: {exc}")
            return False, None
        finally:
            c.in_op = False
        if head.number > c.known.number + 1 and c.known.number + 1 < self.compacted_below:
            self.stats["get_recent jumped over compacted instances"] += 1
        self.log(f"{c.label} get_recent -> {short(head)}")
        self.learned(c, head, "get_recent")
        return True, reading

    def succeeded(self, c: Client, version: Version, how: str) -> None:
        self.stats[f"pushes {how}"] += len(c.pending)
        for change in c.pending:
            self.successes.append((change, c.label, version))
            self.log(f"{c.label} push of {change} succeeded in {short(version)} ({how})")
        c.pending.clear()

    def final_session(self, c: Client, proposer: str) -> Session:
        """The quiescent check: a fresh session runs get_recent (retrying a few times)."""
        setup = self.setup(c, proposer, 10)
        rng = random.Random(self.rng.getrandbits(64))
        for tries in range(6):
            try:
                c.in_op, c.op_started = True, self.now
                head, _ = yield from recent(setup, c.known, rng)
            except (NoQuorum, Contended) as exc:
                self.log(f"{setup.proposer} final get_recent failed: {exc}")
                yield Backoff(rng.uniform(0.5, 1.0) * 2 ** tries)
                continue
            c.in_op = False
            self.learned(c, head, "final get_recent")
            c.final = head
            self.log(f"{setup.proposer} final get_recent -> {short(head)}")
            return
        self.violation(f"liveness: c{c.index}'s get_recent kept failing after all faults healed")

    def compactable(self) -> int:
        """The highest instance compaction may keep as its floor: one some client saw
        decided before every running get_recent or propose began and before every
        request still in flight was sent. This is what the real system's grace
        period provides (docs/protocol.md, "Log compaction"): a mark waits a day
        before it is used, and a proposal that ran for half of that re-reads the
        floor before its outcome counts."""
        horizon = min([c.op_started for c in self.clients if c.in_op and c.gen is not None]
                      + [t for t, n in self.undelivered.items() if n > 0], default=self.now)
        return max((i for i, t in self.observed_at.items() if t < horizon), default=0)

    def compactor_session(self, c: Client, proposer: str) -> Session:
        """Now and then: compact the logs below the highest instance allowed."""
        setup = Setup(self.names, frozenset(), self.quorums, proposer, max_attempts=4)
        rng = random.Random(self.rng.getrandbits(64))
        while self.faulty or self.unfinished > 0:
            yield Backoff(rng.expovariate(1.0 / self.p.compaction_every))
            below = self.compactable()
            if below <= self.compacted_below:
                continue
            self.log(f"{c.label} compacts the logs below {below}")
            try:
                removed = yield from compact(setup, below)
            except NoQuorum as exc:
                self.stats["compactions postponed (a floor not recorded)"] += 1
                self.log(f"{c.label} compaction postponed: {exc}")
                continue
            self.compacted_below = max(self.compacted_below, below)
            self.stats["compactions"] += 1
            self.stats["logs compacted"] += removed

    # --------------------------------------------------------------- driving
    def start(self, c: Client, label: str, gen: Session) -> None:
        c.label = label
        c.gen = gen
        if c.finished and c is not self.compactor:
            c.finished = False
            self.unfinished += 1
        self.advance(c, None)

    def advance(self, c: Client, replies: list[Reply] | None) -> None:
        """Send ``replies`` into the client's session and act on what it yields next."""
        while c.gen is not None:
            try:
                step = c.gen.send(replies)
            except StopIteration:
                self.finish(c)
                self.log(f"{c.label} session done")
                return
            except Exception as exc:  # a protocol error is a finding, not a crash of the simulator
                self.finish(c)
                self.violation(f"{c.label} raised {type(exc).__name__}: {exc}")
                return
            if isinstance(step, Backoff):
                self.at(self.now + step.seconds, WAKE, (c.index, c.epoch))
                return
            if not step:
                replies = []
                continue
            self.issue(c, step)
            return

    def finish(self, c: Client) -> None:
        c.gen = None
        if c is self.compactor:
            return
        if not c.finished:
            c.finished = True
            self.unfinished -= 1

    def issue(self, c: Client, requests: list[Request]) -> None:
        """Send a round trip of ``c``'s session; it ends with every reply or its timeout."""
        self.batches += 1
        batch = Batch(self.batches, list(requests), [None] * len(requests), len(requests))
        c.batch = batch
        for i, req in enumerate(requests):
            issued = self.now if c is not self.compactor else None
            self.send(c.index, c.epoch, batch.id, i, req, issued)
        self.at(self.now + self.p.timeout, TIMEOUT, (c.index, c.epoch, batch.id))
        if c is not self.compactor and self.faulty and self.rng.random() < self.p.p_client_crash:
            self.at(self.now + self.rng.uniform(0, self.p.timeout), CRASH, (c.index, c.epoch))

    def sender(self, index: int, epoch: int) -> str:
        c = self.all_clients[index]
        return c.label if c.epoch == epoch else f"c{index}(gone)"

    def complete(self, c: Client) -> None:
        batch = c.batch
        assert batch is not None
        c.batch = None
        self.advance(c, batch.replies)

    def handle(self, kind: int, data: Any) -> None:
        if kind == REPLY:
            index, epoch, batch_id, i, reply = data
            c = self.all_clients[index]
            if c.epoch == epoch and c.batch is not None and c.batch.id == batch_id:
                c.batch.replies[i] = reply
                c.batch.waiting -= 1
                if c.batch.waiting == 0:
                    self.complete(c)
        elif kind == TIMEOUT:
            index, epoch, batch_id = data
            c = self.all_clients[index]
            if c.epoch == epoch and c.batch is not None and c.batch.id == batch_id:
                self.stats["round trips timed out"] += 1
                self.log(f"{c.label} timeout: {c.batch.waiting} replies missing")
                self.complete(c)
        elif kind == WAKE:
            index, epoch = data
            c = self.all_clients[index]
            if c.epoch == epoch and c.batch is None:
                self.advance(c, None)
        elif kind == CRASH:
            index, epoch = data
            c = self.all_clients[index]
            if c.epoch == epoch and c.gen is not None and self.faulty:
                self.stats["client crashes"] += 1
                self.log(f"{c.label} CRASHES")
                c.gen.close()
                c.gen = None
                c.batch = None
                c.epoch += 1
                c.crashed = True
                self.at(self.now + self.rng.uniform(0.2, 3.0), RESTART, index)
        elif kind == RESTART:
            c = self.clients[data]
            if c.crashed:
                c.crashed = False
                c.session += 1
                label = f"c{c.index}.s{c.session}"
                self.log(f"{label} restarts (durable: known {short(c.known)}, pending {c.pending})")
                self.start(c, label, self.session(c, label))
        elif kind == COMPACTOR:
            self.start(self.compactor, "compactor", self.compactor_session(self.compactor, "compactor"))
        else:
            super().handle(kind, data)

    def heal(self) -> None:
        """The world heals, and crashed clients restart."""
        super().heal()
        for c in self.clients:
            if c.crashed:
                self.at(self.now, RESTART, c.index)

    # --------------------------------------------------------------- the schedule
    def run(self) -> Result:
        """Run the schedule: the fault phase, the heal, the clients finishing their
        pushes, everything in flight delivered, the final get_recent passes; then
        check the outcome."""
        p = self.p
        self.log(f"seed {self.seed}: {p.describe()}")
        self.schedule_faults(len(self.clients))
        together = self.rng.random() < 0.3  # everyone starts at once: fast-round collisions
        for c in self.clients:
            self.at(0.0 if together else self.rng.uniform(0, 1.0), RESTART, c.index)
            c.crashed = True  # "restart" into session 0
            c.session = -1
        self.unfinished = len(self.clients)
        if p.compaction_every:
            self.at(0.0, COMPACTOR, None)

        finished = self.loop(p.fault_time + HEAL_LIMIT,
                             lambda: self.unfinished == 0 and not self.faulty)
        if not finished:
            for c in self.clients:
                if not c.finished:
                    self.violation(
                        f"liveness: {c.label} did not finish its pushes within {HEAL_LIMIT:g} s "
                        f"after all faults healed (pending {c.pending}, made {c.created} of {c.pushes})")
        for c in self.all_clients:
            if c.gen is not None:
                c.gen.close()
            self.finish(c)
            c.epoch += 1
            c.batch = None
        self.drain()

        # Quiescence: get_recent on every client, one at a time, until nothing changes.
        previous: list[Version | None] | None = None
        for attempt in range(FINAL_PASSES):
            for c in self.clients:
                c.final = None
                label = f"c{c.index}.f{attempt}"
                self.start(c, label, self.final_session(c, label))
                if not self.loop(float("inf"), lambda c=c: c.finished):
                    self.violation(f"liveness: c{c.index}'s final get_recent did not finish")
                    self.finish(c)
                c.epoch += 1
                c.batch = None
                self.drain()
            finals = [c.final for c in self.clients]
            if previous == finals and len(set(finals)) == 1:
                break
            previous = finals
        self.check()
        self.stats["schedules in Byzantine mode" if p.bft else "schedules in crash mode"] += 1
        self.stats["events"] += self.events
        return Result(self.seed, p.describe(), self.violations, self.trace, self.events,
                      max((c.known.number for c in self.clients), default=0), dict(self.stats))

    # --------------------------------------------------------------- the checker
    def check(self) -> None:
        """Check the invariants on the outcome as it stands (:class:`Checker`)."""
        Checker(self, self.clients, self.observed, self.successes).check()


def run(seed: int, bft_share: float = DEFAULT_BFT_SHARE, trace: bool = False) -> Result:
    """Simulate the schedule of ``seed`` and check it."""
    return Simulation(seed, bft_share, trace).run()
