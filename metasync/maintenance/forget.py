"""``metasync forget``: store a retention policy, or show what it would forget.

The policy is part of the shared configuration (``keep``, docs/FORMAT.md §9),
decided as a version like every configuration change, so every client's gc
applies the same one. ``forget`` deletes nothing itself: gc keeps the content of
what :func:`metasync.retention.decide` keeps and collects the rest (restic's
``forget`` then ``prune``; ``forget --prune`` runs both).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

from metasync.context import RepoContext
from metasync.errors import UsageError
from metasync.graph import ObjectGraph
from metasync.maintenance.reconfig import Reconfiguration
from metasync.objects import FORMAT_VERSION, Config, Version
from metasync.retention import Policy, decide
from metasync.versions import Versions


@dataclass(frozen=True)
class PlanRow:
    """One ranked version: its commit, and why it is kept (empty: it goes)."""

    commit_id: str
    time_ns: int
    message: str
    #: The version it became master in, where this client knows it.
    version: int | None
    reasons: tuple[str, ...]
    #: An earlier gc already collected its content (whatever ``reasons`` says now:
    #: raising a policy brings nothing back; restore says "forgotten").
    collected: bool = False


@dataclass(frozen=True)
class ForgetPlan:
    """What gc would keep and forget now under ``policy``."""

    policy: Policy | None
    retention_days: int
    #: Ranked versions, newest first.
    rows: list[PlanRow]
    #: The version that stored the policy (None: a dry run, or it was already stored).
    stored: Version | None = None

    @property
    def forgotten(self) -> list[PlanRow]:
        return [r for r in self.rows if not r.reasons]


class Forget:
    """Reads and stores a repository's retention policy."""

    def __init__(self, ctx: RepoContext, versions: Versions, graph: ObjectGraph,
                 reconfig: Reconfiguration) -> None:
        self.ctx = ctx
        self.versions = versions
        self.graph = graph
        self.reconfig = reconfig

    def policy(self) -> Policy | None:
        """The stored policy, if any."""
        return self.versions.load_config(self.versions.learn_latest().config).policy

    def plan(self, policy: Policy | None, now_ns: int | None = None) -> ForgetPlan:
        """What a gc run at ``now_ns`` would keep of the ranked versions under
        ``policy`` (with the stored retention window and snapshots); writes nothing."""
        latest = self.versions.learn_latest()
        config = self.versions.load_config(latest.config)
        if latest.master is None:
            return ForgetPlan(policy, config.retention_days, [])
        now_ns = time.time_ns() if now_ns is None else now_ns
        cutoff = max(config.gc_cutoff_ns, now_ns - config.retention_days * 86_400 * 10**9)
        with self.versions.reading_with(config):
            history = self.graph.history(latest.master)
            decision = decide(latest.master, history, policy, config.snapshots, cutoff)
            collected = self.graph.collected_test(latest.master, config.gc_cutoff_ns)
            numbers = self.ctx.db.master_numbers()
            rows = [PlanRow(cid, history[cid].time_ns, history[cid].message, numbers.get(cid),
                            decision.keep.get(cid, ()), collected(history[cid]))
                    for cid in decision.ranked]
        return ForgetPlan(policy, config.retention_days, rows)

    def store(self, policy: Policy | None) -> Version | None:
        """Make ``policy`` (None: none) the repository's; None if it already is."""
        if policy is not None and policy.empty():
            raise UsageError("no keep rule given: pass at least one of --keep-last, "
                             "--keep-hourly, --keep-daily, --keep-weekly, --keep-monthly, "
                             "--keep-yearly")
        if self.policy() == policy:
            return None

        def make_new(config: Config) -> Config:
            if policy is None:
                return replace(config, policy=None)
            # Readers older than `keep` would call the config malformed: the current
            # format makes them say "upgrade" instead (as a key rotation does).
            return replace(config, policy=policy, format=max(config.format, FORMAT_VERSION))

        return self.reconfig.change_config(make_new).version
