"""How a simulated client learns: it follows configurations through the production
generator :func:`metasync.follow.latest` (and a clone starts through
:func:`metasync.follow.start`), whose steps run here on the acceptors of the
configuration each step names, through the real :mod:`metasync.paxos`
generators -- what :class:`metasync.versions.Versions` does with
:class:`metasync.consensus.Consensus`.

A step's result is sent into the follow generator, a step's error thrown in,
as ``Versions`` does; the steps themselves mirror the driver: ``GetRecent`` is
``Consensus.get_recent`` (jumping over a compaction floor its own acceptors
decided, :class:`FloorElsewhere` if others did), ``Learn`` is ``Consensus.learn``,
``Finish`` is ``Consensus.propose(n, None)`` and ``ReadHints`` reads the raw
``latest`` hint of every backend named.
"""

from __future__ import annotations

import random
from collections.abc import Generator
from typing import Any, TypeVar

from metasync import follow
from metasync.errors import BackendError, Compacted, FloorElsewhere, MetasyncError
from metasync.objects import Version
from metasync.paxos import Run, Setup, get_recent, past_floor, propose, read
from metasync.simulator.model import Client, Out, ReadRawHint, short
from metasync.simulator.params import DEFAULT_BFT_SHARE
from metasync.simulator.world import World

T = TypeVar("T")

#: ``consensus.MAX_FLOOR_JUMPS``: floor jumps one get_recent makes before giving up.
MAX_FLOOR_JUMPS = 20


class Following(World):
    """The world with its clients' learning: what they observed decided, and the
    follow generator driven on simulated acceptors."""

    def __init__(self, seed: int, bft_share: float = DEFAULT_BFT_SHARE, trace: bool = False) -> None:
        super().__init__(seed, bft_share, trace)
        #: Every value a client's protocol run returned as decided, per instance.
        self.observed: dict[int, list[tuple[Version, str]]] = {}
        #: Per instance, when some client first reported it decided.
        self.observed_at: dict[int, float] = {}
        self.compacted_below = 0

    # --------------------------------------------------------------- what clients know
    def observe(self, c: Client, value: Version | None, how: str) -> None:
        """``c``'s protocol run reported ``value`` decided: record it."""
        if value is None or value.number == 0:
            return
        self.observed.setdefault(value.number, []).append((value, f"{c.label} ({how})"))
        self.observed_at.setdefault(value.number, self.now)
        if value.number > self.newest.number:
            self.newest = value
        if value.master is not None and value.master not in self.commits:
            self.violation(f"{c.label} learned {value} whose master names no commit ({how})")

    def adopt(self, c: Client, value: Version) -> None:
        """``c`` makes decided ``value`` its base (and merges its changes in)."""
        if value.number > c.known.number:
            if value.master is not None and value.master in self.commits:
                c.changes |= self.changes_of(value.master)
            if value.config != c.known.config:
                self.stats["configuration changes followed by clients"] += 1
            c.known = value

    def setup(self, c: Client, config: str, proposer: str, max_attempts: int) -> Setup:
        """The pPaxos setup of ``c`` on the acceptors of configuration ``config``."""
        conf = self.configs[config]
        flags = c.index % len(self.p.fast_path)
        conditional = (frozenset(a for a in conf.acceptors if a in self.p.conditional)
                       if self.p.use_conditional[flags] else frozenset())
        return Setup(conf.acceptors, conditional, conf.quorums, proposer, max_attempts=max_attempts,
                     backoff=0.05, fast_path=self.p.fast_path[flags])

    def on(self, c: Client, config: str, run: Run[T]) -> Generator[Out, Any, T]:
        """Run protocol generator ``run`` as ``c``'s running operation, on the acceptors
        of ``config`` (the requests go out as a client of that configuration)."""
        c.using = config
        c.in_op, c.op_started = True, self.now
        try:
            return (yield from run)
        finally:
            c.in_op = False

    # --------------------------------------------------------------- the follow generator
    def walk(self, c: Client, walk: follow.Follow[T], rng: random.Random,
             max_attempts: int) -> Generator[Out, Any, T]:
        """Drive a :mod:`metasync.follow` generator for ``c`` (as ``Versions._follow``)."""
        reply: Any = None
        error: MetasyncError | None = None
        try:
            while True:
                try:
                    step = walk.throw(error) if error is not None else walk.send(reply)
                except StopIteration as stop:
                    result: T = stop.value
                    return result
                reply, error = None, None
                try:
                    reply = yield from self.step(c, step, rng, max_attempts)
                except MetasyncError as exc:
                    if isinstance(exc, FloorElsewhere):
                        self.stats["walks behind a floor other acceptors decided"] += 1
                    error = exc
        finally:
            walk.close()

    def step(self, c: Client, step: follow.Step, rng: random.Random,
             max_attempts: int) -> Generator[Out, Any, Any]:
        setup = self.setup(c, step.config if not isinstance(step, follow.ReadHints)
                           else step.acceptors, c.label, max_attempts)
        if isinstance(step, follow.GetRecent):
            return (yield from self.get_recent_on(c, step.config, step.known, setup, rng))
        if isinstance(step, follow.ReadHints):
            self.stats["hint reads of a client following configurations"] += 1
            backends = sorted(set(self.configs[step.storage].backends)
                              | set(self.configs[step.acceptors].acceptors))
            c.using = step.acceptors
            replies = yield [ReadRawHint(b) for b in backends]
            return [r if isinstance(r, tuple) else None for r in replies or [None] * len(backends)]
        if isinstance(step, follow.Learn):
            reading = yield from self.on(c, step.config, read(setup, step.number, rng, floor=True))
            found = None if reading.floor > step.number else reading.decided
            if found is not None and found.number == step.number:
                self.stats["hints confirmed by reading"] += 1
        else:
            try:
                found = yield from self.on(c, step.config, propose(setup, step.number, None, rng))
            except Compacted:
                return None
            if found is not None and found.number == step.number:
                self.stats["hints confirmed by finishing their instance"] += 1
        self.observe(c, found, "confirming a hint")
        return found

    def get_recent_on(self, c: Client, config: str, known: Version, setup: Setup,
                      rng: random.Random) -> Generator[Out, Any, Version]:
        """``Consensus.get_recent`` on the acceptors of ``config``: past a floor these
        acceptors decided by ``past_floor``; :class:`FloorElsewhere` if others did."""
        for _ in range(MAX_FLOOR_JUMPS):
            try:
                version, reading = yield from self.on(c, config, get_recent(setup, known, rng))
            except Compacted as exc:
                ran_by = self.floor_acceptors(c, config, exc.floor)
                if ran_by is None:
                    continue  # superseded by a newer floor meanwhile: read again
                if ran_by != set(setup.acceptors):
                    raise FloorElsewhere(exc.floor) from None
                try:
                    known = yield from self.on(c, config, past_floor(setup, exc.floor, rng))
                except Compacted:
                    continue  # the floor moved on: whose it is is checked from the top
                self.observe(c, known, "past the floor")
                if known.number > c.known.number + 1 and c.known.number + 1 < self.compacted_below:
                    self.stats["get_recent jumped over compacted instances"] += 1
                if known.config != config:
                    return known
                continue
            c.cached, c.cached_on = reading, config
            self.observe(c, version, "get_recent")
            self.log(f"{c.label} get_recent on {self.configs[config].describe()} -> {short(version)}")
            return version
        raise BackendError("the log compaction floor kept moving while reading; retry",
                           transient=True)

    def floor_acceptors(self, c: Client, config: str, floor: int) -> set[str] | None:
        """The acceptors floor record ``floor`` names, from the first acceptor of
        ``config`` that has it and answers (``FloorRecords.acceptors_of``)."""
        for name in self.configs[config].acceptors:
            acc = self.acceptors[name]
            if acc.lost or acc.down or (c.index, name) in self.cuts:
                continue
            record = acc.floor_records.get(floor)
            if record is not None:
                return set(record)
        return None
