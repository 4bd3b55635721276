"""Living with changing storage: configuration changes, rebalancing, gc, listings.

Uses the layers below (versions, the object graph, the outbox, the replicator)
and is never imported by them: the ``Repository`` facade is its only caller.

- :mod:`~metasync.maintenance.reconfig`: configuration changes (backends, R,
  snapshots, retention), each decided as a version;
- :mod:`~metasync.maintenance.rebalance`: every object on the holders a
  configuration names, through the replicator;
- :mod:`~metasync.maintenance.gc`: garbage collection and log compaction;
- :mod:`~metasync.maintenance.forget`: the retention policy (``forget``);
- :mod:`~metasync.maintenance.listing`: what each backend holds, and sharing.
"""

from metasync.maintenance.gc import ClientStates, GarbageCollector, GcReport
from metasync.maintenance.listing import (
    BackendInfo,
    BackendListing,
    ShareResult,
    list_backends,
    share,
)
from metasync.maintenance.rebalance import RebalanceReport, rebalance
from metasync.maintenance.reconfig import (
    ConfigChange,
    Reconfiguration,
    moved_minimum,
    new_backend_spec,
    resolve_backend,
)
from metasync.replicator import Inventory, verify_stored

__all__ = [
    "BackendInfo",
    "BackendListing",
    "ClientStates",
    "ConfigChange",
    "GarbageCollector",
    "GcReport",
    "Inventory",
    "RebalanceReport",
    "Reconfiguration",
    "ShareResult",
    "list_backends",
    "moved_minimum",
    "new_backend_spec",
    "rebalance",
    "resolve_backend",
    "share",
    "verify_stored",
]
