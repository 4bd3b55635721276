"""What a simulated client does in a session, modelled on the CLI: ``push`` (learn,
upload the change's objects by the production placement, repair and hand off
copies, propose, merge and retry), configuration changes (``backend add`` /
``remove``, ``config replicas``: learn, copy first, decide on the old
configuration's acceptors, publish, rebalance), a fresh clone's start from its
entry backend's hint, and the final quiescent learning.

Every session is a generator like the protocol's own: it yields the protocol's
requests and backoffs (:class:`metasync.simulator.simulation.Simulation` sends
them into the world and resumes it with the replies).
"""

from __future__ import annotations

import random
from collections.abc import Generator
from typing import Any

from metasync import follow
from metasync.errors import BackendError, Compacted, Contended, NoQuorum
from metasync.objects import Version
from metasync.paxos import Backoff, WriteHint, propose, publish_hint
from metasync.simulator.following import Following
from metasync.simulator.model import (
    V0,
    Change,
    Client,
    Out,
    ReadRawHint,
    Session,
    SimConfig,
    blob_id,
    commit_id,
    config_id,
    short,
)
from metasync.simulator.params import DEFAULT_BFT_SHARE

#: Propose attempts (one per instance) in one push before starting over with get_recent.
PUSH_ATTEMPTS = 8
#: Attempts of one configuration change (each learns and proposes again) per session try.
CHANGE_ATTEMPTS = 8


class Sessions(Following):
    """The clients' sessions, over the world and its following clients."""

    #: A configuration change is proposed only once every object is on the holders
    #: the new configuration names (production's ``reconfigure`` proposes whatever
    #: its first rebalance placed: see docs/simulator.md, "Findings").
    copy_first_completely = True
    #: The rebalance after a change is recorded before proposing, with the old
    #: configuration's backends as sources, so a crash after the decision does not
    #: skip it (production records ``rebalance_pending`` after the decision, and
    #: ``finish_rebalance`` reads the new configuration's backends only).
    rebalance_pending_first = True
    #: A push is acknowledged with R copies only if the content of its changes has R
    #: copies, also when an earlier push of it (interrupted, or failed) uploaded it
    #: (production's push looks at what it uploaded itself only).
    ack_counts_earlier_short = True
    #: The rebalance after a change (with drops) is to the newest configuration,
    #: learned just before: another client may have changed it meanwhile, and drops
    #: by a configuration already replaced lose the copies the newer one placed
    #: (production rebalances to the configuration it decided).
    rebalance_to_latest = True
    #: A change of the acceptors is followed at once by a version decided on the new
    #: configuration (same master and configuration: a seal), so learning the change
    #: no longer needs the old configuration's quorum (production before this
    #: proposed nothing more: see docs/simulator.md, "Findings", F5).
    seal_on_new = True

    def __init__(self, seed: int, bft_share: float = DEFAULT_BFT_SHARE, trace: bool = False) -> None:
        super().__init__(seed, bft_share, trace)
        #: Successful pushes: (change, client session, version that made it known).
        self.successes: list[tuple[str, str, Version]] = []
        #: Pushes acknowledged with R copies of everything they uploaded: the version,
        #: who pushed, and the changes it pushed (its objects: the commit, their content).
        self.acknowledged: list[tuple[Version, str, tuple[str, ...]]] = []
        #: Configuration changes proposed: (instance, configuration).
        self.proposals: list[tuple[int, SimConfig]] = []
        #: Backends lost for good whose removal a clean rebalance completed.
        self.repaired: set[str] = set()
        #: The R every object is known to have: lowered when a change to a smaller R is
        #: proposed, raised by a clean rebalance to the current configuration.
        self.assured = self.plan.replicas

    # --------------------------------------------------------------- a client's session
    def session(self, c: Client, proposer: str) -> Session:
        """One client session: a clone's start, then the configuration changes asked
        of it and its remaining pushes, one at a time."""
        rng = random.Random(self.rng.getrandbits(64))
        if c.clone and not c.started:
            yield from self.clone_start(c, rng)
        failures = 0
        while True:
            if c.tasks:
                task = c.tasks[0]
                ok = yield from self.change(c, task, rng)
                c.tasks.remove(task)
                if not ok:
                    c.tasks.append(task)  # the others first
            else:
                if not c.pending:
                    if c.created >= c.pushes:
                        return
                    if self.p.think:
                        yield Backoff(rng.uniform(0, self.p.think))
                    change = f"c{c.index}-{c.created}"
                    c.created += 1
                    c.changes.add(change)
                    c.pending.append(change)
                    c.outbox.append(blob_id(change))
                    self.log(f"{c.label} makes change {change}")
                ok = yield from self.push(c, rng)
            if ok:
                failures = 0
            else:
                failures += 1
                yield Backoff(rng.uniform(0.05, 0.5) * 2 ** min(failures, 5))

    def learn(self, c: Client, rng: random.Random, max_attempts: int = 0) -> Generator[Out, Any, bool]:
        """Learn the newest version (following configurations) and make it ``c``'s
        base; False if that failed."""
        walk = follow.latest(c.known, c.known.config)
        try:
            head = yield from self.walk(c, walk, rng, max_attempts or self.p.max_attempts)
        except (NoQuorum, Contended, BackendError) as exc:
            self.stats[f"get_recent raised {type(exc).__name__}"] += 1
            self.log(f"{c.label} get_recent failed: {exc}")
            return False
        self.adopt(c, head)
        return True

    # --------------------------------------------------------------- push
    def push(self, c: Client, rng: random.Random) -> Generator[Out, Any, bool]:
        """``metasync push``: learn, upload, repair, propose; on losing, merge and retry."""
        if not (yield from self.learn(c, rng)):
            return False
        c.short = False
        if not self.upload(c, list(c.outbox)):
            return False
        c.missing, settled = self.storage.repair(c.index, c.missing, self.mapping(c.known.config))
        # An object uploaded short has R copies once its missing copies are written.
        c.short_objects &= {oid for oid, _ in c.missing} | settled
        for _ in range(PUSH_ATTEMPTS):
            base = c.known
            if all(ch in self.changes_of(base.master) for ch in c.pending):
                self.succeeded(c, base, "already in master")
                return True
            changes = frozenset(c.changes)
            master = commit_id(base.master, changes)
            # The commit objects are uploaded before proposing.
            self.commits.setdefault(master, (base.master, changes))
            if not self.upload(c, [master]):
                return False
            value = Version(base.number + 1, master, base.config)
            cached, c.cached = c.cached, None
            logs = (cached.logs if cached is not None and c.cached_on == base.config
                    and cached.instance == value.number else None)
            setup = self.setup(c, base.config, c.label, self.p.max_attempts)
            self.log(f"{c.label} proposes {short(value)} = {sorted(changes)}")
            try:
                outcome = yield from self.on(c, base.config, propose(setup, value.number, value, rng, logs))
            except (NoQuorum, Contended) as exc:
                self.stats[f"propose raised {type(exc).__name__}"] += 1
                self.log(f"{c.label} propose failed: {exc}")
                return False
            except Compacted as exc:
                # Behind the compaction floor: learn past it, like after losing.
                self.stats["proposals stopped at the compaction floor"] += 1
                self.log(f"{c.label} propose stopped: {exc}")
                if not (yield from self.learn(c, rng)):
                    return False
                continue
            self.log(f"{c.label} propose #{value.number} -> {short(outcome)}")
            if outcome is None:
                self.violation(f"{c.label}: propose of {value} returned None")
                return False
            self.observe(c, outcome, "propose")
            self.adopt(c, outcome)
            if outcome == value:
                self.succeeded(c, value, "won")
                # Every push publishes its hint; during the fault phase only with
                # probability p_hint (the rest: publications lost altogether).
                published = rng.random() < self.p.p_hint
                if published or c.publish or not self.faulty:
                    yield from self.on(c, base.config, publish_hint(setup, value))
                return True
            # Learn again (else: propose straight at the instance after the one lost).
            if rng.random() < 0.5 and not (yield from self.learn(c, rng)):
                return False
        return False

    def upload(self, c: Client, objects: list[str]) -> bool:
        """Upload ``objects`` by the mapping of ``c``'s base configuration; False if one
        reached no backend (it stays in the outbox, and the push fails)."""
        mapping = self.mapping(c.known.config)
        placed = True
        for oid in objects:
            up = self.storage.upload(c.index, oid, mapping)
            if self.tracing:
                spill = f", spilled to {up.spilled} for {up.missed}" if up.spilled else ""
                self.log(f"{c.label} uploads {oid[:6]}: copies on {up.copies}{spill}"
                         + (" (fewer than R)" if up.short else ""))
            if not up.copies:
                placed = False
                continue
            if oid in c.outbox:
                c.outbox.remove(oid)
            c.missing |= {(oid, b) for b in up.missed}
            c.short = c.short or up.short
            if up.short:
                c.short_objects.add(oid)
        return placed

    def succeeded(self, c: Client, version: Version, how: str) -> None:
        self.stats[f"pushes {how}"] += len(c.pending)
        for change in c.pending:
            self.successes.append((change, c.label, version))
            self.log(f"{c.label} push of {change} succeeded in {short(version)} ({how})")
        earlier = ({version.master or ""} | {blob_id(ch) for ch in c.pending}) & c.short_objects
        if c.pending:
            if c.short or (earlier and self.ack_counts_earlier_short):
                self.stats["pushes acknowledged with fewer than R copies"] += 1
            else:
                self.stats["pushes acknowledged with R copies"] += 1
                self.acknowledged.append((version, c.label, tuple(c.pending)))
        c.pending.clear()

    # --------------------------------------------------------------- configuration changes
    def change(self, c: Client, task: Change, rng: random.Random) -> Generator[Out, Any, bool]:
        """A configuration change (``Reconfiguration.reconfigure``): learn, derive the
        new configuration from the latest one, copy first, propose on the old
        configuration's acceptors, publish the hint (to new acceptors too), then
        rebalance with drops. True once done or not applicable; False: retry later."""
        if task.kind == "rebalance":
            return (yield from self.finish_rebalance(c, task, rng))
        for _ in range(CHANGE_ATTEMPTS):
            try:
                latest = yield from self.walk(c, follow.latest(c.known, c.known.config), rng,
                                              self.p.max_attempts)
            except (NoQuorum, Contended, BackendError) as exc:
                self.log(f"{c.label} cannot learn for {task.describe()}: {exc}")
                return False
            old = self.configs[latest.config]
            new = self.resolve(task, old)
            if new is None:
                self.stats["configuration changes not applicable when made"] += 1
                self.log(f"{c.label}: {task.describe()} is not applicable to {old.describe()}")
                return True
            self.proposals.append((latest.number + 1, new))
            self.assured = min(self.assured, new.replicas)
            if (not self.storage.rebalance(c.index, self.mapping(new.id), old.backends, drop=False)
                    and self.copy_first_completely):
                self.stats["configuration changes postponed (copies not all placed first)"] += 1
                self.log(f"{c.label}: {task.describe()} waits: not every copy could be placed first")
                return False
            after = Change("rebalance", task.backend, task.dead, sources=old.backends)
            if self.rebalance_pending_first and after not in c.tasks:
                # Recorded before proposing: a crash after the decision still finishes it.
                c.tasks.append(after)
            proposal = Version(latest.number + 1, latest.master, new.id)
            setup = self.setup(c, old.id, c.label, self.p.max_attempts)
            cached, c.cached = c.cached, None
            logs = (cached.logs if cached is not None and c.cached_on == old.id
                    and cached.instance == proposal.number else None)
            self.log(f"{c.label} proposes {short(proposal)}: {task.describe()}, "
                     f"{old.describe()} -> {new.describe()}")
            try:
                outcome = yield from self.on(c, old.id, propose(setup, proposal.number, proposal, rng, logs))
            except (NoQuorum, Contended) as exc:
                self.log(f"{c.label} change failed: {exc}")
                return False
            except Compacted:
                continue
            self.observe(c, outcome, "propose")
            if outcome != proposal:
                continue
            self.stats[f"configuration changes decided: {task.describe().split(' ')[0]}"
                       + (" dead" if task.dead else "")] += 1
            yield from self.on(c, old.id, publish_hint(setup, proposal))
            fresh = [b for b in new.acceptors if b not in old.acceptors]
            if fresh:
                # A clone from a new acceptor starts there (the hint names the old
                # configuration, which decided the change).
                c.using = old.id
                yield [WriteHint(b, proposal.number) for b in fresh]
            if self.seal_on_new and set(new.acceptors) != set(old.acceptors):
                yield from self.seal(c, proposal, rng)
            if self.rebalance_to_latest:
                done = yield from self.finish_rebalance(c, after, rng)
            else:
                done = self.rebalanced(c, new, old.backends, task)
            if done:
                if after in c.tasks:
                    c.tasks.remove(after)
            else:
                self.stats["rebalances left unfinished (run again)"] += 1
                if after not in c.tasks:
                    c.tasks.append(after)
            return True
        return False

    def seal(self, c: Client, change: Version, rng: random.Random) -> Generator[Out, Any, None]:
        """Decide ``(change + 1, same master, new configuration)`` on the new
        configuration's acceptors and publish its hint there. Another client's
        version winning that instance serves as well; a failure is left to the
        next push (the same window as before, no worse)."""
        seal = Version(change.number + 1, change.master, change.config)
        setup = self.setup(c, change.config, c.label, self.p.max_attempts)
        self.log(f"{c.label} seals {short(change)} with {short(seal)} on its new configuration")
        try:
            outcome = yield from self.on(c, change.config, propose(setup, seal.number, seal, rng))
        except (NoQuorum, Contended, Compacted) as exc:
            self.stats["seals left to the next version"] += 1
            self.log(f"{c.label} seal failed: {exc}")
            return
        self.observe(c, outcome, "propose")
        self.stats["seals decided" if outcome == seal else "seals won by another version"] += 1
        if outcome == seal:
            yield from self.on(c, change.config, publish_hint(setup, seal))

    def rebalanced(self, c: Client, config: SimConfig, sources: tuple[str, ...], task: Change) -> bool:
        """Rebalance (with drops) to ``config`` from its backends and ``sources``; if the
        report is clean, a lost backend ``task`` removed is repaired, and every
        object has ``config``'s R copies if ``config`` is still the current one."""
        if not self.storage.rebalance(c.index, self.mapping(config.id),
                                      set(sources) | set(config.backends), drop=True):
            return False
        if task.dead:
            self.repaired.add(task.backend)
        if config.id == self.current().id and not any(
                n > self.newest.number for n, _ in self.proposals):
            self.assured = config.replicas
        return True

    def finish_rebalance(self, c: Client, task: Change, rng: random.Random) -> Generator[Out, Any, bool]:
        """The rebalance a change leaves to do (``metasync rebalance``): every object on
        the holders of the latest configuration, read from its backends and the
        changed configuration's, extra copies dropped. False (retry) if unclean."""
        try:
            latest = yield from self.walk(c, follow.latest(c.known, c.known.config), rng,
                                          self.p.max_attempts)
        except (NoQuorum, Contended, BackendError):
            return False
        return self.rebalanced(c, self.configs[latest.config], task.sources, task)

    def resolve(self, task: Change, old: SimConfig) -> SimConfig | None:
        """The configuration ``task`` makes of ``old`` (``make_new``), or None if it does
        not apply any more or the result would not tolerate what is lost."""
        backends = list(old.backends)
        replicas = old.replicas
        if task.kind == "add":
            if task.backend in backends:
                return None
            backends.append(task.backend)
        elif task.kind == "remove":
            if task.dead:
                if task.backend not in backends:
                    return None
                backends.remove(task.backend)
            else:
                live = [b for b in backends if not self.acceptors[b].lost]
                if not live:
                    return None
                backends.remove(self.plan_rng.choice(live))
        else:
            replicas = task.replicas
        ordered = tuple(sorted(backends, key=lambda b: (len(b), b)))
        new = SimConfig(config_id(old.serial + 1, ordered, replicas), ordered, replicas,
                        old.bft, old.serial + 1)
        if not self.tolerates(new):
            return None
        return self.configs.setdefault(new.id, new)

    def tolerates(self, config: SimConfig) -> bool:
        """Whether ``config`` is valid and tolerates what is lost: its lost and
        Byzantine acceptors within its quorums' faults, and the backends lost and
        not yet repaired fewer than its R."""
        n = len(config.backends)
        if n < 1 or not 1 <= config.replicas <= n:
            return False
        byzantine = sum(1 for b in config.backends if self.acceptors[b].byzantine)
        if config.bft and (n < 4 or byzantine > (n - 1) // 3):
            return False
        lost = sum(1 for b in config.backends if self.acceptors[b].lost)
        return lost + byzantine <= config.quorums.faults and self.unrepaired() <= config.replicas - 1

    def unrepaired(self) -> int:
        """Backends lost for good whose loss no clean rebalance has repaired yet."""
        return sum(1 for a in self.acceptors.values() if a.lost and a.name not in self.repaired)

    # --------------------------------------------------------------- clones and the end
    def clone_start(self, c: Client, rng: random.Random) -> Generator[Out, Any, None]:
        """``metasync clone``: start from the entry backend's hint once confirmed
        (:func:`metasync.follow.start`), then pull; a clone that fails starts over."""
        failures = 0
        while True:
            c.using = V0.config
            replies = yield [ReadRawHint(c.entry)]
            hint = replies[0] if replies else None
            if hint is not None:
                start = yield from self.walk(
                    c, follow.start(hint if isinstance(hint, tuple) else None, V0), rng, 10)
                if start is not None:
                    self.adopt(c, start)
                    self.stats["clones started from a confirmed hint"] += 1
                else:
                    self.stats["clones started from version 0"] += 1
                self.log(f"{c.label} clones from {c.entry} (hint {hint}): starts at {short(c.known)}")
                if (yield from self.learn(c, rng)):
                    c.started = True
                    return
            self.stats["clones that failed and started over"] += 1
            c.known, c.changes = V0, set()
            if hint is None:
                # The entry did not answer: the user clones from another backend.
                c.entry = self.plan_rng.choice(self.live(self.current()))
            failures += 1
            yield Backoff(rng.uniform(0.1, 1.0) * 2 ** min(failures, 5))

    def final_session(self, c: Client, proposer: str) -> Session:
        """The quiescent check: a fresh session learns the newest version, following
        configurations (retrying a few times)."""
        rng = random.Random(self.rng.getrandbits(64))
        for tries in range(6):
            if (yield from self.learn(c, rng, 10)):
                c.final = c.known
                self.log(f"{proposer} final get_recent -> {short(c.final)}")
                return
            yield Backoff(rng.uniform(0.5, 1.0) * 2 ** tries)

    def live(self, config: SimConfig) -> list[str]:
        """The backends of ``config`` not lost for good."""
        return [b for b in config.backends if not self.acceptors[b].lost]

    def knows_current(self, c: Client) -> bool:
        """Whether ``c`` can reach the current configuration: it knows (its base
        configuration's backends, or a clone's entry until it started) a backend of
        it not lost."""
        known = {c.entry} if c.clone and not c.started else set(self.configs[c.known.config].backends)
        return any(b in known and not self.acceptors[b].lost for b in self.current().backends)
