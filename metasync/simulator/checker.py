"""The checker: the invariants a schedule's outcome must hold, checked once every
fault has healed, every client has finished and all are quiescent.

(a) At most one value is chosen per instance, whoever looks: the honest acceptors'
    logs (as they were before compaction) of the configuration that ran the
    instance (the one of the version before it) and every client's decisions
    agree, and every decision -- including every version a client learned by
    following configurations or confirming a hint -- is backed by an honest quorum.
(b) Every push that reported success is in the final history, in the version
    chosen in its instance.
(c) Liveness of following: every client that can reach the current configuration
    (it knows a backend of it that is not lost) learns the newest version; they
    all converge on it.
(d) The decided versions 1..final form one linear chain: each push's commit has
    its predecessor's master as parent, keeps its changes and its configuration;
    each configuration change keeps its predecessor's master; no instance beyond
    the final version chose a value.
(e) Durability: every object of every push acknowledged with R copies (its commit
    and the content of its changes) has a copy on a backend of the final
    configuration that is not lost -- the schedule never loses more backends than
    the configuration tolerates (fewer than R not yet repaired).

docs/simulator.md, "The checker", explains why each counts as it does.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING

from metasync.objects import Version
from metasync.paxos import FAST_ROUND, Round, replay
from metasync.simulator.model import CONFIG, V0, Client, SimConfig, blob_id, short, show_round

if TYPE_CHECKING:
    from metasync.simulator.sessions import Sessions


class Checker:
    """Checks the outcome in ``world`` of ``clients`` (their ``final`` versions),
    given what their protocol runs ``observed`` decided, per instance, and their
    ``successes`` (change, session, version); every broken invariant is a
    ``world.violation``."""

    def __init__(self, world: Sessions, clients: Sequence[Client],
                 observed: dict[int, list[tuple[Version, str]]],
                 successes: Sequence[tuple[str, str, Version]]) -> None:
        self.world = world
        self.clients = clients
        self.observed = observed
        self.successes = successes

    def violation(self, text: str) -> None:
        self.world.violation(text)

    def chosen_by_logs(self, instance: int, config: SimConfig) -> dict[Version, list[str]]:
        """Values the honest acceptors' logs of ``config`` (which ran ``instance``) show
        chosen (or choosable with the help of Byzantine claims) in ``instance``:
        ``classic - f`` honest acceptances in a classic round (``f`` Byzantine
        acceptors could claim the rest), ``fast`` in the fast round."""
        counts: Counter[tuple[Round, Version]] = Counter()
        for name in config.acceptors:
            acc = self.world.acceptors[name]
            if not acc.byzantine:
                # A compacted log as it was: what was appended after (by proposers
                # that then found the floor) decides nothing.
                log = acc.archive.get(instance, acc.logs.get(instance, ()))
                for rnd, value in replay(log).accepts.items():
                    counts[(rnd, value)] += 1
        quorums = config.quorums
        slack = (quorums.acceptors - 1) // 3 if config.bft else 0
        out: dict[Version, list[str]] = {}
        for (rnd, value), count in counts.items():
            needed = quorums.fast if rnd == FAST_ROUND else quorums.classic - slack
            if needed is not None and count >= needed:
                out.setdefault(value, []).append(
                    f"{count} honest acceptors accepted it in round {show_round(rnd)}")
        return out

    def check(self) -> None:
        """Report each broken invariant, (a) to (e) above."""
        chosen = self.check_agreement()
        reaching = [c for c in self.clients if self.world.knows_current(c)]
        self.world.stats["clients out of reach of the current configuration at the end"] += (
            len(self.clients) - len(reaching))
        # (c) every client that can reach the current configuration converges.
        finals = [c.final for c in reaching]
        if not finals:
            return
        if None in finals or len(set(finals)) != 1:
            self.violation("clients did not converge: " + ", ".join(
                f"c{c.index}={short(c.final)}" for c in reaching))
            return
        final = finals[0]
        assert final is not None
        if not self.check_history(chosen, final):
            return
        changes = self.world.changes_of(final.master)
        # (b) every push that reported success is in the final history.
        for change, who, version in self.successes:
            if change not in changes:
                self.violation(f"lost push: {who} pushed {change} successfully in "
                               f"{short(version)} but the final {short(final)} lacks it")
            if chosen.get(version.number) != version:
                self.violation(f"{who}'s push of {change} succeeded in {short(version)}, which "
                               f"is not the value chosen in instance {version.number}")
        self.check_durability(self.world.configs[final.config])
        self.world.log(f"final {short(final)} = {sorted(changes)}")

    def check_agreement(self) -> dict[int, Version]:
        """(a): the value chosen in each instance, each on the acceptors that ran it."""
        acceptors = self.world.acceptors.values()
        instances = sorted({i for a in acceptors for i in [*a.logs, *a.archive]} | set(self.observed))
        chosen: dict[int, Version] = {0: V0}
        for inst in instances:
            before = chosen.get(inst - 1)
            if inst < 1 or before is None:
                continue  # what ran it is unknown: a gap that (d) reports if it matters
            by_logs = self.chosen_by_logs(inst, self.world.configs[before.config])
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
                chosen[inst] = min(values, key=lambda v: (v.master or "", v.config))
                fast = any("round fast" in why for why in by_logs.get(chosen[inst], ()))
                self.world.stats["versions decided in the fast round" if fast
                                 else "versions decided in a classic round"] += 1
                if chosen[inst].config != before.config:
                    self.world.stats["versions chosen that change the configuration"] += 1
        return chosen

    def check_history(self, chosen: dict[int, Version], final: Version) -> bool:
        """(d): versions 1..final form one chain; False if it is broken."""
        parent: str | None = None
        config = CONFIG
        sealable = False
        for number in range(1, final.number + 1):
            link = chosen.get(number)
            if link is None:
                self.violation(f"history: no value chosen in instance {number} below the "
                               f"final version {short(final)}")
                return False
            if link.master == parent:
                if link.config == config and not sealable:
                    self.violation(f"history: version {number} ({short(link)}) repeats its "
                                   "predecessor's master and configuration")
                # A configuration change may be followed by one seal (same master,
                # same configuration) decided on the new configuration.
                sealable = link.config != config
                config = link.config
                continue
            sealable = False
            commit = self.world.commits.get(link.master or "")
            if commit is None:
                self.violation(f"history: version {number}'s master {link.master} names no commit")
                return False
            if commit[0] != parent:
                self.violation(f"history: version {number} ({short(link)}) has parent "
                               f"{(commit[0] or 'none')[:6]}, not version {number - 1}'s master "
                               f"{(parent or 'none')[:6]}")
            if link.config != config:
                self.violation(f"history: version {number} ({short(link)}) is a push that changes "
                               "the configuration")
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
        return True

    def check_durability(self, config: SimConfig) -> None:
        """(e): every object of every push acknowledged with R copies is readable
        from the final configuration ``config``."""
        world = self.world
        lost = sorted(b for b, acc in world.acceptors.items() if acc.lost)
        seen: set[str] = set()
        for version, who, changes in world.acknowledged:
            for oid in [version.master or "", *(blob_id(ch) for ch in changes)]:
                if oid in seen or not oid:
                    continue
                seen.add(oid)
                world.stats["objects of acknowledged pushes checked"] += 1
                if not world.storage.readable(oid, config.backends):
                    holding = sorted(b for b, acc in world.acceptors.items() if oid in acc.objects)
                    self.violation(
                        f"durability: {who}'s push of {short(version)} was acknowledged with R "
                        f"copies, but object {oid[:6]} has no copy on a backend of the final "
                        f"configuration {config.describe()} that is not lost (copies on "
                        f"{holding or 'none'}; lost: {lost or 'none'})")
