"""``/metrics``: the fleet's counters in the Prometheus text format.

A :class:`FleetCollector` in a registry of its own (never the process-wide default,
so two services in one process -- the tests -- do not mix) reads every folder's
:meth:`FolderRunner.stats` and :meth:`FolderRunner.snapshot` at each scrape; the
fleet keeps the numbers, this module only names them. The series are listed in
docs/app.md ("Metrics").
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    Metric,
    SummaryMetricFamily,
)
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from metasync.app.fleet import Fleet

#: The text format's content type.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
FOLDER = ["folder", "path"]
BACKEND = ["folder", "backend"]
#: The states a folder's ``metasync_folder_state`` series takes (docs/api.md).
STATES = ("starting", "idle", "syncing", "paused", "offline", "error", "stopped")


class FleetCollector(Collector):
    """Collects the fleet's series at each scrape."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet

    def collect(self) -> Iterator[Metric]:
        c = "metasync_folder_"
        syncs = CounterMetricFamily(c + "syncs", "Syncs finished", labels=FOLDER)
        duration = SummaryMetricFamily(c + "sync_duration_seconds",
                                       "Time spent in syncs", labels=FOLDER)
        errors = CounterMetricFamily(c + "errors", "Syncs that failed", labels=FOLDER)
        up = CounterMetricFamily(c + "uploaded_bytes", "Bytes uploaded", labels=FOLDER)
        down = CounterMetricFamily(c + "downloaded_bytes", "Bytes downloaded", labels=FOLDER)
        pending = GaugeMetricFamily(c + "pending_changes", "Local changes not synced yet",
                                    labels=FOLDER)
        conflicts = GaugeMetricFamily(c + "conflicts", "Conflict copies this service made that "
                                      "are still in the folder", labels=FOLDER)
        conflicts_made = CounterMetricFamily(c + "conflicts_made", "Conflict copies made",
                                             labels=FOLDER)
        last = GaugeMetricFamily(c + "last_success_timestamp_seconds",
                                 "When the last sync succeeded (Unix time)", labels=FOLDER)
        state = GaugeMetricFamily(c + "state", "1 for the folder's state", labels=[*FOLDER, "state"])
        b = "metasync_backend_"
        requests = CounterMetricFamily(b + "requests", "Requests made to the backend", labels=BACKEND)
        b_errors = CounterMetricFamily(b + "errors", "Hint polls that failed", labels=BACKEND)
        b_up = GaugeMetricFamily(b + "up", "1 if the backend answers, 0 if it is failing",
                                 labels=BACKEND)
        latency = GaugeMetricFamily(b + "latency_seconds", "Latency of the last requests",
                                    labels=BACKEND)
        stored = GaugeMetricFamily(b + "stored_bytes", "Bytes the backend stores for the folder",
                                   labels=BACKEND)
        capacity = GaugeMetricFamily(b + "capacity_bytes", "The backend's configured capacity",
                                     labels=BACKEND)
        for runner in self.fleet.runners():
            try:
                stats = runner.stats()
                snap: dict[str, Any] = runner.snapshot()
            except Exception:
                continue  # a folder failing right now is shown by its state, not here
            labels = [runner.id, str(runner.path)]
            syncs.add_metric(labels, stats.syncs)
            duration.add_metric(labels, count_value=stats.syncs, sum_value=stats.sync_seconds)
            errors.add_metric(labels, stats.errors)
            up.add_metric(labels, stats.bytes_up)
            down.add_metric(labels, stats.bytes_down)
            pending.add_metric(labels, stats.pending_changes)
            conflicts.add_metric(labels, len(snap.get("conflicts", [])))
            conflicts_made.add_metric(labels, stats.conflicts)
            if stats.last_success is not None:
                last.add_metric(labels, stats.last_success)
            for s in STATES:
                state.add_metric([*labels, s], 1.0 if snap.get("state") == s else 0.0)
            shown = {x.get("name"): x for x in snap.get("backends", []) if isinstance(x, dict)}
            for name, bs in stats.backends.items():
                bl = [runner.id, name]
                requests.add_metric(bl, bs.requests)
                b_errors.add_metric(bl, bs.errors)
                healthy = bs.failing_since is None and shown.get(name, {}).get("health", "ok") == "ok"
                b_up.add_metric(bl, 1.0 if healthy else 0.0)
                if bs.latency_ms is not None:
                    latency.add_metric(bl, bs.latency_ms / 1000)
                info = shown.get(name, {})
                if isinstance(info.get("bytes"), (int, float)):
                    stored.add_metric(bl, info["bytes"])
                if isinstance(info.get("capacity"), (int, float)):
                    capacity.add_metric(bl, info["capacity"])
        yield from (syncs, duration, errors, up, down, pending, conflicts, conflicts_made, last, state,
                    requests, b_errors, b_up, latency, stored, capacity)


class Metrics:
    """The service's metrics registry."""

    def __init__(self, fleet: Fleet) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(FleetCollector(fleet))

    def render(self) -> bytes:
        """The text exposition of every series now."""
        return generate_latest(self.registry)
