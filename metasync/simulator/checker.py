"""The checker: the invariants a schedule's outcome must hold, checked once every
fault has healed, every client has finished and all are quiescent.

(a) At most one value is chosen per instance, whoever looks: the honest acceptors'
    logs (as they were before compaction) and every client's decisions agree, and
    every decision is backed by an honest quorum.
(b) Every push that reported success is in the final history, in the version
    chosen in its instance.
(c) All clients converge on one version.
(d) The decided versions 1..final form one linear chain of commits, each keeping
    its parent's changes, and no instance beyond the final version chose a value.

docs/simulator.md, "The checker", explains why each counts as it does.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from metasync.objects import Version
from metasync.paxos import FAST_ROUND, Round, replay
from metasync.simulator.model import Client, short, show_round
from metasync.simulator.world import World


class Checker:
    """Checks the outcome in ``world`` of ``clients`` (their ``final`` versions),
    given what their protocol runs ``observed`` decided, per instance, and their
    ``successes`` (change, session, version); every broken invariant is a
    ``world.violation``."""

    def __init__(self, world: World, clients: Sequence[Client],
                 observed: dict[int, list[tuple[Version, str]]],
                 successes: Sequence[tuple[str, str, Version]]) -> None:
        self.world = world
        self.clients = clients
        self.observed = observed
        self.successes = successes

    def violation(self, text: str) -> None:
        self.world.violation(text)

    def chosen_by_logs(self, instance: int) -> dict[Version, list[str]]:
        """Values the honest acceptors' logs show chosen (or choosable with the help of
        Byzantine claims) in ``instance``: ``classic - f`` honest acceptances in a
        classic round (``f`` Byzantine acceptors could claim the rest), ``fast`` in
        the fast round."""
        counts: Counter[tuple[Round, Version]] = Counter()
        for acc in self.world.acceptors.values():
            if not acc.byzantine:
                # A compacted log as it was: what was appended after (by proposers
                # that then found the floor) decides nothing.
                log = acc.archive.get(instance, acc.logs.get(instance, ()))
                for rnd, value in replay(log).accepts.items():
                    counts[(rnd, value)] += 1
        p, quorums = self.world.p, self.world.quorums
        slack = (p.acceptors - 1) // 3 if p.bft else 0
        out: dict[Version, list[str]] = {}
        for (rnd, value), count in counts.items():
            needed = quorums.fast if rnd == FAST_ROUND else quorums.classic - slack
            if needed is not None and count >= needed:
                out.setdefault(value, []).append(
                    f"{count} honest acceptors accepted it in round {show_round(rnd)}")
        return out

    def check(self) -> None:
        """Report each broken invariant, (a) to (d) above."""
        instances = sorted({i for a in self.world.acceptors.values() for i in [*a.logs, *a.archive]}
                           | set(self.observed))
        chosen: dict[int, Version] = {}
        # (a) at most one value chosen per instance, whoever looks.
        for inst in instances:
            by_logs = self.chosen_by_logs(inst)
            values: dict[Version, list[str]] = {v: list(why) for v, why in by_logs.items()}
            for value, who in self.observed.get(inst, ()):
                values.setdefault(value, []).append(f"{who} decided it")
                if value not in by_logs:
                    self.violation(f"instance {inst}: {who} decided {value} but the honest "
                                   f"acceptors' logs show no quorum accepting it")
            for value in values:
                if value.number != inst:
                    self.violation(f"instance {inst} chose a value numbered {value.number}: {value}")
            if len(values) > 1:
                detail = "; ".join(f"{short(v)} [{', '.join(why[:3])}]"
                                   for v, why in sorted(values.items(), key=lambda kv: kv[0].master or ""))
                self.violation(f"instance {inst}: {len(values)} different values chosen: {detail}")
            if values:
                chosen[inst] = min(values, key=lambda v: v.master or "")
                fast = any("round fast" in why for why in by_logs.get(chosen[inst], ()))
                self.world.stats["versions decided in the fast round" if fast
                                 else "versions decided in a classic round"] += 1
        # (c) every client converges on the same version.
        finals = [c.final for c in self.clients]
        if None in finals or len(set(finals)) != 1:
            self.violation("clients did not converge: " + ", ".join(
                f"c{c.index}={short(c.final)}" for c in self.clients))
            return
        final = finals[0]
        assert final is not None
        # (d) versions 1..final form one chain, each commit's parent the previous master.
        parent: str | None = None
        for number in range(1, final.number + 1):
            link = chosen.get(number)
            if link is None:
                self.violation(f"history: no value chosen in instance {number} below the "
                               f"final version {short(final)}")
                return
            commit = self.world.commits.get(link.master or "")
            if commit is None:
                self.violation(f"history: version {number}'s master {link.master} names no commit")
                return
            if commit[0] != parent:
                self.violation(f"history: version {number} ({short(link)}) has parent "
                               f"{(commit[0] or 'none')[:6]}, not version {number - 1}'s master "
                               f"{(parent or 'none')[:6]}")
            if not self.world.changes_of(parent) <= commit[1]:
                lost = sorted(self.world.changes_of(parent) - commit[1])
                self.violation(f"history: version {number} dropped changes {lost} of its parent")
            parent = link.master
        if chosen.get(final.number, final) != final:
            self.violation(f"clients converged on {final} but instance {final.number} chose "
                           f"{chosen[final.number]}")
        beyond = [i for i in chosen if i > final.number]
        if beyond:
            self.violation(f"instances {beyond} chose values beyond the converged version "
                           f"{short(final)}")
        # (b) every push that reported success is in the final history.
        changes = self.world.changes_of(final.master)
        for change, who, version in self.successes:
            if change not in changes:
                self.violation(f"lost push: {who} pushed {change} successfully in "
                               f"{short(version)} but the final {short(final)} lacks it")
            if chosen.get(version.number) != version:
                self.violation(f"{who}'s push of {change} succeeded in {short(version)}, which "
                               f"is not the value chosen in instance {version.number}")
        self.world.log(f"final {short(final)} = {sorted(changes)}")
