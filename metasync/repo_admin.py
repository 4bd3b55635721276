"""The maintenance half of the :class:`~metasync.Repository` facade: backends,
replication, snapshots, retention, gc, sharing and keys.

:class:`RepositoryAdmin` is a mixin of :class:`~metasync.Repository` (which
builds the parts it names below); like the facade, each method is a line or two
calling the part that does the work. The parts load on first use: ``status`` and
``commit`` never need them (start-up time).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cached_property
from typing import TYPE_CHECKING

from metasync.objects import BackendSpec, Version

if TYPE_CHECKING:
    from metasync.context import RepoContext
    from metasync.graph import ObjectGraph
    from metasync.maintenance import (
        BackendListing,
        ConfigChange,
        GarbageCollector,
        GcReport,
        RebalanceReport,
        Reconfiguration,
        ShareResult,
    )
    from metasync.maintenance.forget import Forget
    from metasync.maintenance.keymgmt import KeySlots
    from metasync.maintenance.rotation import RotationReport
    from metasync.outbox import Outbox
    from metasync.replicator import Replicator
    from metasync.versions import Versions


class RepositoryAdmin:
    """Maintenance methods of the facade (a mixin of :class:`~metasync.Repository`)."""

    # Built by Repository.__init__.
    _ctx: RepoContext
    versions: Versions
    graph: ObjectGraph
    outbox: Outbox
    replicator: Replicator

    def key_slots(self) -> KeySlots:
        """Key management: the passphrases (slots) that open this repository."""
        from metasync.maintenance.keymgmt import KeySlots

        return KeySlots(self._ctx, self.versions)

    def rotate_keys(self, progress: Callable[[str], None] = lambda _: None) -> RotationReport:
        """``metasync key rotate`` (:func:`metasync.maintenance.rotation.rotate`)."""
        from metasync.maintenance.rotation import rotate

        return rotate(self._ctx, self.versions, self._reconfig, progress)

    # ============================================================== maintenance
    @cached_property
    def _reconfig(self) -> Reconfiguration:
        # Imported on first use: status and commit never need it (start-up time).
        from metasync.maintenance import Reconfiguration

        return Reconfiguration(self._ctx, self.versions, self.replicator)

    @cached_property
    def _gc(self) -> GarbageCollector:
        from metasync.maintenance import GarbageCollector

        return GarbageCollector(self._ctx, self.versions, self.graph, self.outbox,
                                self.replicator, self._reconfig)

    def add_backend(self, uri: str, capacity: float | None = None,
                    mkdir: bool = False) -> ConfigChange:
        return self._reconfig.add_backend(uri, capacity, mkdir)

    def remove_backend(self, name: str) -> ConfigChange:
        return self._reconfig.remove_backend(name)

    def connect_backend(self, name: str, uri: str | None = None) -> tuple[BackendSpec, str]:
        return self._reconfig.connect_backend(name, uri)

    def resize_backend(self, name: str, capacity: float) -> ConfigChange:
        return self._reconfig.resize_backend(name, capacity)

    def set_replicas(self, replicas: int) -> ConfigChange:
        return self._reconfig.set_replicas(replicas)

    def rebalance(self) -> RebalanceReport:
        return self._reconfig.finish_rebalance()

    def rebalance_pending(self) -> bool:
        """Whether a configuration change made here left its rebalance unfinished
        (crashed, or some backend did not answer): :meth:`rebalance` finishes it."""
        return self._ctx.state.rebalance_pending is not None

    def backend_list(self) -> BackendListing:
        """Every backend of the latest configuration with what it holds."""
        from metasync.maintenance import list_backends

        config = self.versions.load_config(self.versions.learn_latest().config)
        return list_backends(self._ctx, self.replicator, config)

    def snapshot(self, name: str) -> Version:
        return self._reconfig.snapshot(name)

    def delete_snapshot(self, name: str) -> Version:
        return self._reconfig.delete_snapshot(name)

    def snapshots(self) -> list[tuple[str, str]]:
        return self._reconfig.snapshots()

    def set_retention(self, days: int) -> Version:
        return self._reconfig.set_retention(days)

    def gc(self, log_grace_s: float | None = None) -> GcReport:
        """Delete what no version within the retention or kept by the retention policy,
        no snapshot, no client's state and no push in progress needs, and compact old
        pPaxos logs."""
        return self._gc.collect_garbage(log_grace_s=log_grace_s)

    def share(self, email: str) -> list[ShareResult]:
        from metasync.maintenance import share

        return share(self._ctx, self.versions.backends, email)

    # ============================================================== retention (forget)
    @cached_property
    def retention(self) -> Forget:
        """The retention policy: ``plan`` (``forget --dry-run``), ``store``, ``policy``."""
        from metasync.maintenance.forget import Forget

        return Forget(self._ctx, self.versions, self.graph, self._reconfig)
