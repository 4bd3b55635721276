"""A schedule's configuration: every size, fault rate and option, drawn from its seed."""

from __future__ import annotations

import random
from dataclasses import dataclass

DEFAULT_BFT_SHARE = 0.25


@dataclass
class Params:
    """One schedule's configuration, all drawn from the seed."""

    bft: bool
    acceptors: int
    byzantine: tuple[str, ...]
    conditional: frozenset[str]
    #: Per client: whether it tries the fast round, whether it uses conditional appends.
    fast_path: tuple[bool, ...]
    use_conditional: tuple[bool, ...]
    pushes: tuple[int, ...]
    max_attempts: int
    fault_time: float
    timeout: float
    delay: dict[str, float]
    p_fail: float
    p_lost: float
    p_tail: float
    p_dup: float
    p_torn: float
    p_client_crash: float
    p_exceed: float
    acceptor_crashes: int
    partitions: int
    p_hint: float
    think: float
    #: How often (virtual seconds, on average) the compactor tries; 0: never.
    compaction_every: float = 0.0

    def describe(self) -> str:
        mode = f"bft n={self.acceptors} byzantine={','.join(self.byzantine) or 'none'}" if self.bft \
            else f"crash n={self.acceptors}"
        cond = ",".join(sorted(self.conditional)) or "none"
        flags = "".join(("f" if f else "-") + ("c" if c else "-")
                        for f, c in zip(self.fast_path, self.use_conditional, strict=True))
        return (f"{mode} conditional={cond} clients={len(self.pushes)} "
                f"pushes={list(self.pushes)} fast/conditional={flags} max_attempts={self.max_attempts} "
                f"faults_until={self.fault_time:.1f} timeout={self.timeout:.2f} "
                f"p_fail={self.p_fail:.3f} p_lost={self.p_lost:.3f} p_tail={self.p_tail:.3f} "
                f"p_dup={self.p_dup:.3f} p_torn={self.p_torn:.2f} "
                f"p_client_crash={self.p_client_crash:.3f} acceptor_crashes={self.acceptor_crashes} "
                f"partitions={self.partitions} "
                f"p_exceed={self.p_exceed:.2f} compaction_every={self.compaction_every:g}")


def draw_params(rng: random.Random, bft_share: float) -> Params:
    bft = rng.random() < bft_share
    n = rng.randint(4, 7) if bft else rng.choice((1, 2, 3, 3, 3, 4, 5, 5))
    names = tuple(f"a{i}" for i in range(n))
    byzantine: tuple[str, ...] = ()
    if bft:
        f = (n - 1) // 3
        count = f if rng.random() < 0.7 else rng.randint(0, f)
        byzantine = tuple(sorted(rng.sample(names, count)))
    support = rng.choice(("all", "none", "some"))
    if support == "all":
        conditional = frozenset(names)
    elif support == "none":
        conditional = frozenset()
    else:
        conditional = frozenset(a for a in names if rng.random() < 0.5)
    clients = rng.randint(2, 5)
    pushes = tuple(rng.randint(1, 4) for _ in range(clients))
    calm = rng.random() < 0.15  # some schedules without network faults: pure contention
    timeout = rng.choice((0.5, 1.0, 2.0))
    delay = {a: rng.choice((0.005, 0.02, 0.05, 0.1)) for a in names}
    return Params(
        bft=bft,
        acceptors=n,
        byzantine=byzantine,
        conditional=conditional,
        fast_path=tuple(rng.random() < 0.8 for _ in pushes),
        use_conditional=tuple(rng.random() < 0.9 for _ in pushes),
        pushes=pushes,
        max_attempts=rng.choice((2, 4, 10, 10)),
        fault_time=rng.uniform(2.0, 20.0),
        timeout=timeout,
        delay=delay,
        p_fail=0.0 if calm else rng.choice((0.0, 0.02, 0.1, 0.25)),
        p_lost=0.0 if calm else rng.choice((0.0, 0.02, 0.1, 0.25)),
        p_tail=0.0 if calm else rng.choice((0.0, 0.01, 0.05, 0.15)),
        p_dup=0.0 if calm else rng.choice((0.0, 0.0, 0.02, 0.1)),
        p_torn=0.0 if calm else rng.choice((0.0, 0.0, 0.2, 0.5)),
        p_client_crash=0.0 if calm else rng.choice((0.0, 0.01, 0.05, 0.1)),
        p_exceed=rng.choice((0.0, 0.1, 0.3)),
        acceptor_crashes=0 if calm else rng.randint(0, 6),
        partitions=0 if calm else rng.choice((0, 0, 2, 6)),
        p_hint=rng.choice((0.0, 0.5, 1.0)),
        think=rng.choice((0.0, 0.05, 0.5, 2.0)),
        compaction_every=rng.choice((0.0, 0.3, 1.0, 3.0)),
    )


@dataclass
class Plan:
    """A schedule's configuration changes, losses, sleepers and clones, drawn from a
    random stream of their own (``random.Random(f"plan/{seed}")``), so that a
    schedule without any of them is the schedule its seed gave before they existed."""

    #: R of version 0's configuration.
    replicas: int
    #: Configuration changes asked of clients during the fault phase, and attempts to
    #: lose a backend for good (each made only if the configuration tolerates it).
    changes: int = 0
    losses: int = 0
    #: Clients that fall asleep early in the fault phase and wake after the heal.
    sleepers: tuple[int, ...] = ()
    #: Fresh clones joining late, each with this many changes to push.
    clones: tuple[int, ...] = ()
    #: Chance that a lost backend is removed from the configuration later.
    p_remove_dead: float = 0.8

    def describe(self) -> str:
        return (f"R={self.replicas} changes={self.changes} losses={self.losses} "
                f"sleepers={list(self.sleepers)} clones={list(self.clones)}")


def draw_plan(rng: random.Random, p: Params) -> Plan:
    """What ``p``'s schedule does to its configuration (``rng``: the plan's stream)."""
    n = p.acceptors
    replicas = 1 if n == 1 else rng.choice((1, 2, 2, 2, 3)) if n >= 3 else rng.choice((1, 2))
    if rng.random() < 0.3:
        return Plan(replicas)  # a schedule of the old kind: one configuration for ever
    clients = len(p.pushes)
    return Plan(
        replicas=replicas,
        changes=rng.randint(1, 6),
        losses=rng.choice((0, 1, 1, 2, 2, 3)),
        sleepers=tuple(i for i in range(clients) if rng.random() < 0.25),
        clones=tuple(rng.randint(1, 2) for _ in range(rng.choice((0, 0, 1, 1, 2)))),
        p_remove_dead=rng.choice((0.5, 0.8, 1.0)),
    )
