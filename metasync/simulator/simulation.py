"""One schedule of the pPaxos simulator: clients pushing and changing the
configuration through the real protocol generators in the world of
:mod:`metasync.simulator.world`, a compactor, the plan's losses, sleepers and
clones, and the final checks (the package docstring, :mod:`metasync.simulator`,
has the overview).

A client's session is a generator like the protocol's own: it yields the protocol's
requests and backoffs, and :class:`Simulation` sends each round trip into the world,
collects the replies (or a timeout) and resumes the session with them.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from metasync.objects import Version
from metasync.paxos import Backoff, NoQuorum, Request, Setup, compact
from metasync.simulator.checker import Checker
from metasync.simulator.model import (
    CONFIG,
    Batch,
    Change,
    Client,
    ReadRawHint,
    Result,
    Session,
    short,
)
from metasync.simulator.params import DEFAULT_BFT_SHARE
from metasync.simulator.sessions import CHANGE_ATTEMPTS, PUSH_ATTEMPTS, Sessions
from metasync.simulator.world import (
    ARISE,
    CHANGE,
    COMPACTOR,
    CRASH,
    JOIN,
    LOSE,
    REPLY,
    RESTART,
    SLEEP,
    TIMEOUT,
    WAKE,
)

__all__ = ["CHANGE_ATTEMPTS", "FINAL_PASSES", "HEAL_LIMIT", "PUSH_ATTEMPTS", "Simulation", "run"]

#: After healing, how long (virtual seconds) clients get to finish their pushes.
HEAL_LIMIT = 600.0
#: Passes of get_recent over all clients to reach quiescence at the end.
FINAL_PASSES = 4
#: The final writer pushes when every client is done, or this long after the heal.
WRITER_AFTER = 30.0


# ====================================================================== simulation
class Simulation(Sessions):
    """One schedule: the world of ``seed`` with its clients, each running sessions
    of pushes and configuration changes through the real protocol generators, the
    compactor and the plan; then the checker (:meth:`run`)."""

    def __init__(self, seed: int, bft_share: float = DEFAULT_BFT_SHARE, trace: bool = False) -> None:
        super().__init__(seed, bft_share, trace)
        self.clients = [Client(i, k) for i, k in enumerate(self.p.pushes)]
        first = len(self.clients)
        self.clients += [Client(first + j, k, clone=True) for j, k in enumerate(self.plan.clones)]
        #: Deletes old logs now and then (``gc``'s log compaction); never crashes.
        self.compactor = Client(len(self.clients), 0, finished=True)
        self.all_clients = [*self.clients, self.compactor]
        self.batches = 0
        self.unfinished = 0
        #: The final writer has started (compaction stops then: see :meth:`final_writer`).
        self.writing = False

    # --------------------------------------------------------------- compaction
    def compactable(self, config: str) -> int:
        """The highest instance compaction on the acceptors of ``config`` may keep as
        its floor: one that these acceptors ran (version ``floor - 1`` is of
        ``config``) and that some client saw decided before every running get_recent
        or propose began and before every request still in flight was sent. This is
        what the real system's grace period provides (docs/protocol.md, "Log
        compaction"): a mark waits a day before it is used, and a proposal that ran
        for half of that re-reads the floor before its outcome counts."""
        horizon = min([c.op_started for c in self.clients if c.in_op and c.gen is not None]
                      + [t for t, n in self.undelivered.items() if n > 0], default=self.now)
        return max((i for i, t in self.observed_at.items()
                    if t < horizon and self.decided_by(i) == config), default=0)

    def decided_by(self, instance: int) -> str | None:
        """The configuration whose acceptors ran ``instance``, i.e. version
        ``instance - 1``'s, as clients saw it: that version's, or the one of the
        versions seen on both sides of it if they agree (a configuration never
        comes back); None if that cannot be told."""
        k = instance - 1
        if k == 0 or k in self.observed:
            return self.config_seen(k)
        before = max((n for n in self.observed if n < k), default=0)
        after = min((n for n in self.observed if n > k), default=None)
        if after is None or self.config_seen(before) != self.config_seen(after):
            return None
        return self.config_seen(after)

    def config_seen(self, number: int) -> str:
        return CONFIG if number == 0 else self.observed[number][0][0].config

    def compactor_session(self, c: Client, proposer: str) -> Session:
        """Now and then: compact the logs below the highest instance allowed, on the
        acceptors of the current configuration."""
        rng = random.Random(self.rng.getrandbits(64))
        while (self.faulty or self.unfinished > 0) and not self.writing:
            yield Backoff(rng.expovariate(1.0 / self.p.compaction_every))
            if self.writing:
                break
            config = self.current()
            below = self.compactable(config.id)
            if below <= self.compacted_below:
                continue
            self.log(f"{c.label} compacts the logs below {below}")
            setup = Setup(config.acceptors, frozenset(), config.quorums, proposer, max_attempts=4)
            c.using = config.id
            try:
                removed = yield from compact(setup, below)
            except NoQuorum as exc:
                self.stats["compactions postponed (a floor not recorded)"] += 1
                self.log(f"{c.label} compaction postponed: {exc}")
                continue
            self.compacted_below = max(self.compacted_below, below)
            self.stats["compactions"] += 1
            self.stats["logs compacted"] += removed

    # --------------------------------------------------------------- the plan
    def schedule_plan(self) -> None:
        """The plan's configuration changes, losses, sleeps and clones, in the fault phase."""
        plan, rng, end = self.plan, self.plan_rng, self.p.fault_time
        for _ in range(plan.changes):
            self.at(rng.uniform(0.3, end), CHANGE, None)
        for _ in range(plan.losses):
            self.at(rng.uniform(0.3, end), LOSE, None)
        for index in plan.sleepers:
            self.clients[index].wakes_at = end + rng.uniform(0.5, 5.0)
            self.at(rng.uniform(0.0, end / 3), SLEEP, index)
        for c in self.clients:
            if c.clone:
                self.at(rng.uniform(end / 2, end + 5.0), JOIN, c.index)

    def ask_change(self, task: Change | None) -> None:
        """Give a configuration change to a client that is awake (drawn now if None)."""
        rng, config = self.plan_rng, self.current()
        if task is None:
            kind = rng.choice(("add", "add", "remove", "replicas"))
            if kind == "add":
                task = Change("add", self.new_backend())
                self.p.delay[task.backend] = rng.choice((0.005, 0.02, 0.05, 0.1))
                self.schedule_outages_of(task.backend)
            elif kind == "remove":
                task = Change("remove")
            else:
                choices = [r for r in (config.replicas - 1, config.replicas + 1)
                           if 1 <= r <= min(3, len(config.backends))]
                if not choices:
                    return
                task = Change("replicas", replicas=rng.choice(choices))
        joined = [c for c in self.clients if not c.clone or c.entry]
        c = rng.choice([c for c in joined if not c.asleep] or joined)
        c.tasks.append(task)
        self.stats["configuration changes asked"] += 1
        self.log(f"c{c.index} is asked to: {task.describe()}")
        if c.gen is None and not c.crashed:
            c.session += 1
            self.start(c, f"c{c.index}.s{c.session}", self.session(c, f"c{c.index}.s{c.session}"))

    #: Losses also keep a majority of the configuration that decided the newest
    #: version: until a version is decided on a new configuration, learning the
    #: change needs the old one's quorum (docs/simulator.md, "Findings").
    guard_decider = True

    def lose(self) -> None:
        """Lose a backend of the current configuration for good, if what is lost stays
        within what it tolerates: a minority of its acceptors (counting the
        Byzantine), and fewer than R backends not yet repaired -- in the current
        configuration, in any change proposed beyond it and in the configuration
        that decided the newest version."""
        config = self.current()
        involved = [config, *(c for n, c in self.proposals if n > self.newest.number)]
        decider = self.decided_by(self.newest.number)
        if self.newest.number and decider is not None and self.guard_decider:
            involved.append(self.configs[decider])
        candidates = [b for b in config.backends if not self.acceptors[b].lost
                      and all(self.tolerates_losing(b, c) for c in involved)
                      and not (self.guard_decider and strands_clients_behind(self, b))]
        if not candidates:
            self.stats["losses skipped (not tolerated)"] += 1
            return
        name = self.plan_rng.choice(candidates)
        acc = self.acceptors[name]
        acc.lost = True
        self.stats["backends lost for good"] += 1
        self.log(f"backend {name} LOST for good (configuration {config.describe()})")
        if self.plan_rng.random() < self.plan.p_remove_dead:
            self.at(self.now + self.plan_rng.uniform(0.2, 4.0), CHANGE, Change("remove", name, dead=True))

    def tolerates_losing(self, backend: str, config: Any) -> bool:
        lost = sum(1 for b in config.backends if self.acceptors[b].lost or b == backend)
        byzantine = sum(1 for b in config.backends if self.acceptors[b].byzantine)
        if backend in config.backends and lost + byzantine > config.quorums.faults:
            return False
        return bool(self.unrepaired() + 1 <= min(config.replicas, self.assured) - 1)

    # --------------------------------------------------------------- driving
    def start(self, c: Client, label: str, gen: Session) -> None:
        c.label = label
        c.gen = gen
        if c.finished and c is not self.compactor:
            c.finished = False
            self.unfinished += 1
        self.advance(c, None)

    def advance(self, c: Client, replies: list[Any] | None) -> None:
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

    def issue(self, c: Client, requests: Sequence[Request | ReadRawHint]) -> None:
        """Send a round trip of ``c``'s session; it ends with every reply or its timeout."""
        self.batches += 1
        batch = Batch(self.batches, list(requests), [None] * len(requests), len(requests))
        c.batch = batch
        for i, req in enumerate(requests):
            issued = self.now if c is not self.compactor else None
            self.send(c.index, c.epoch, batch.id, i, req, issued, c.using)
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

    def drop_session(self, c: Client) -> None:
        """``c``'s running session stops where it is (its durable state stays)."""
        if c.gen is not None:
            c.gen.close()
        c.gen = None
        c.batch = None
        c.epoch += 1

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
                self.drop_session(c)
                c.crashed = True
                self.at(self.now + self.rng.uniform(0.2, 3.0), RESTART, index)
        elif kind == RESTART:
            c = self.clients[data]
            if c.crashed and not c.asleep:
                c.crashed = False
                c.session += 1
                label = f"c{c.index}.s{c.session}"
                self.log(f"{label} restarts (durable: known {short(c.known)}, pending {c.pending})")
                self.start(c, label, self.session(c, label))
        elif kind == COMPACTOR:
            self.start(self.compactor, "compactor", self.compactor_session(self.compactor, "compactor"))
        elif kind == CHANGE:
            self.ask_change(data)
        elif kind == LOSE:
            self.lose()
        elif kind == SLEEP:
            c = self.clients[data]
            self.stats["clients asleep through the changes"] += 1
            self.log(f"c{c.index} falls asleep until {c.wakes_at:.2f}")
            self.drop_session(c)
            c.asleep, c.crashed = True, False
            self.at(c.wakes_at, ARISE, data)
        elif kind in (ARISE, JOIN):
            c = self.clients[data]
            c.asleep = False
            if kind == JOIN:
                config = self.current()
                c.entry = self.plan_rng.choice(self.live(config))
                self.stats["clones joining"] += 1
            c.session += 1
            label = f"c{c.index}.s{c.session}"
            self.log(f"{label} {'wakes up' if kind == ARISE else 'joins, cloning from ' + c.entry}")
            self.start(c, label, self.session(c, label))
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
        pushes (a final writer publishing the newest hint), everything in flight
        delivered, the final passes; then check the outcome."""
        p = self.p
        self.log(f"seed {self.seed}: {p.describe()} {self.plan.describe()}")
        self.schedule_faults(len(p.pushes))
        together = self.rng.random() < 0.3  # everyone starts at once: fast-round collisions
        for c in self.clients:
            if not c.clone:
                self.at(0.0 if together else self.rng.uniform(0, 1.0), RESTART, c.index)
                c.crashed = True  # "restart" into session 0
            c.session = -1
        self.unfinished = len(self.clients)
        if p.compaction_every:
            self.at(0.0, COMPACTOR, None)
        self.schedule_plan()

        until = p.fault_time + HEAL_LIMIT
        writer_at = p.fault_time + WRITER_AFTER
        self.loop(until, lambda: not self.faulty and (self.unfinished == 0 or self.now >= writer_at))
        # A writer that is up to date pushes once more and publishes the newest hint,
        # as every push does in production (a client behind, whose configuration lost
        # its quorum or whose logs were compacted by other acceptors, follows it).
        self.final_writer()
        finished = self.loop(until + HEAL_LIMIT, lambda: self.unfinished == 0)
        if not finished:
            for c in self.clients:
                if not c.finished:
                    if self.knows_current(c):
                        self.violation(
                            f"liveness: {c.label} did not finish its pushes within {HEAL_LIMIT:g} s "
                            f"after all faults healed (pending {c.pending}, made {c.created} of "
                            f"{c.pushes}, tasks {[t.describe() for t in c.tasks]})")
                    else:
                        self.stats["clients that could not reach the current configuration"] += 1
        for c in self.all_clients:
            self.drop_session(c)
            self.finish(c)
        self.drain()

        # Quiescence: learn on every client, one at a time, until nothing changes.
        previous: list[Version | None] | None = None
        for attempt in range(FINAL_PASSES):
            for c in self.clients:
                c.final = None
                label = f"c{c.index}.f{attempt}"
                self.start(c, label, self.final_session(c, label))
                if not self.loop(float("inf"), lambda c=c: c.finished):
                    self.violation(f"liveness: c{c.index}'s final get_recent did not finish")
                    self.finish(c)
                self.drop_session(c)
                self.drain()
            finals = [c.final for c in self.clients]
            if previous == finals and len(set(finals)) == 1:
                break
            previous = finals
        self.check()
        self.stats["schedules in Byzantine mode" if p.bft else "schedules in crash mode"] += 1
        self.stats["events"] += self.events
        return Result(self.seed, f"{p.describe()} {self.plan.describe()}", self.violations,
                      self.trace, self.events,
                      max((c.known.number for c in self.clients), default=0), dict(self.stats))

    def final_writer(self) -> None:
        """The most up-to-date client that can reach the current configuration pushes
        one more change and publishes its hint. Compaction stops then: in production
        it trails the decisions by a day (the grace period), in which every later
        push publishes a newer hint; here the writer's hint must stay above every
        floor, and a hint can go back (a slow publisher's older version lands last)."""
        self.writing = True
        ready = [c for c in self.clients if not c.asleep and not c.crashed and self.knows_current(c)]
        ready.sort(key=lambda c: (not c.finished, -c.known.number, c.index))
        for c in ready[:1]:
            c.pushes += 1
            c.publish = True
            self.log(f"c{c.index} is the final writer")
            if c.gen is None:
                c.session += 1
                label = f"c{c.index}.s{c.session}"
                self.start(c, label, self.session(c, label))

    # --------------------------------------------------------------- the checker
    def check(self) -> None:
        """Check the invariants on the outcome as it stands (:class:`Checker`)."""
        Checker(self, self.clients, self.observed, self.successes).check()


def run(seed: int, bft_share: float = DEFAULT_BFT_SHARE, trace: bool = False) -> Result:
    """Simulate the schedule of ``seed`` and check it."""
    return Simulation(seed, bft_share, trace).run()


def strands_clients_behind(sim: Simulation, backend: str) -> bool:
    """Whether losing ``backend`` (in ``sim``) takes the quorum of a configuration some client
    is still based on while none of that configuration's other live honest
    backends holds a hint naming a later configuration. Such a client reads
    hints only there (and production tells it to clone again): a backend that
    was down when the seal's or a later push's hint was published keeps an old
    one until the next push on the new configuration."""
    current = sim.current().id
    based = {c.known.config for c in sim.clients if c.started or not c.clone}
    for config_id in sorted(based - {current}):
        config = sim.configs[config_id]
        if backend not in config.backends:
            continue
        lost = sum(1 for b in config.backends if sim.acceptors[b].lost or b == backend)
        byzantine = sum(1 for b in config.backends if sim.acceptors[b].byzantine)
        if lost + byzantine <= config.quorums.faults:
            continue
        hints = [sim.acceptors[b].hint for b in config.backends
                 if b != backend and not sim.acceptors[b].lost
                 and not sim.acceptors[b].byzantine]
        if not any(h is not None and h[1] != config_id for h in hints):
            sim.stats["losses skipped (would strand a client behind)"] += 1
            return True
    return False
