"""Rebalancing: every object on the backends a configuration names for it.

Driven by what the backends hold (their listings), not by a local journal, so
it is idempotent: a crash at any point is completed by running it again
(``metasync rebalance``). Each object is placed by the replicator, which copies
only from verified copies and drops a copy only once every holder's copy is
verified (git-annex's numcopies rule).
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field

from metasync.backends import Backend
from metasync.context import RepoContext
from metasync.objects import Config
from metasync.replicator import PlaceOutcome, Replicator, take_inventory
from metasync.store import fragment_mapping_of, mapping_of


@dataclass
class RebalanceReport:
    """What a rebalance did."""

    objects: int = 0
    #: Object copies written to a backend that should hold them and did not.
    copied: int = 0
    bytes_copied: int = 0
    #: The fewest copies any placement change of the same objects must write (None
    #: when no reconfiguration is involved).
    minimum: int | None = None
    #: Copies removed from backends that no longer should hold them.
    dropped: int = 0
    #: Objects with no good copy anywhere reachable (reported, never dropped).
    lost: list[str] = field(default_factory=list)
    #: Copies kept although no longer needed: too few verified copies elsewhere, or
    #: the backend holding them could not be reached.
    kept: int = 0
    unreachable: dict[str, str] = field(default_factory=dict)
    #: Objects (not lost) that some holder still lacks: its write was refused, or
    #: it did not answer.
    short: list[str] = field(default_factory=list)
    #: Holder -> why it lacks a copy it should have (one reason per backend).
    missed: dict[str, str] = field(default_factory=dict)
    #: Every object found on the backends.
    stored_ids: set[str] = field(default_factory=set, repr=False)

    def merge(self, other: RebalanceReport) -> None:
        self.objects = max(self.objects, other.objects)
        self.copied += other.copied
        self.bytes_copied += other.bytes_copied
        self.dropped += other.dropped
        self.kept = other.kept
        self.lost = other.lost
        self.short = other.short
        self.missed = other.missed
        self.unreachable = {**self.unreachable, **other.unreachable}


def rebalance(
    ctx: RepoContext,
    replicator: Replicator,
    config: Config,
    extra: dict[str, Backend] | None = None,
    *,
    drop: bool,
    verify_all: bool = False,
) -> RebalanceReport:
    """Put every object held anywhere on the backends ``config``'s mapping names
    for it; with ``drop``, then remove copies from backends that should not hold
    it (``extra`` backends, such as one being removed, are read from and, with
    ``drop``, emptied). With ``verify_all`` every copy is downloaded and checked
    first, and a corrupt one is replaced."""
    targets = ctx.pool.open(config)
    sources = {**(extra or {}), **targets}
    inventory = take_inventory(sources, ctx.store.executor)
    mapping = mapping_of(config)
    report = RebalanceReport(objects=len(inventory.stored_ids()),
                             unreachable=dict(inventory.unreachable),
                             stored_ids=inventory.stored_ids())
    work = sorted(inventory.copies.items())
    coded = sorted(inventory.fragments.items())
    fragment_map = fragment_mapping_of(config)
    executor = ctx.store.executor
    unreachable = inventory.unreachable
    ctx.reporter.start("rebalance", len(work) + len(coded))
    try:
        futures: list[Future[PlaceOutcome]] = [
            executor.submit(
                replicator.place, sources, mapping.locate(stored_id), stored_id, have,
                drop=drop, verify_all=verify_all, unreachable=unreachable,
            )
            for stored_id, have in work
        ]
        if config.erasure is not None:
            futures += [
                executor.submit(
                    replicator.place_fragments, sources, fragment_map.locate(stored_id),
                    stored_id, held, erasure=config.erasure, drop=drop,
                    verify_all=verify_all, unreachable=unreachable,
                )
                for stored_id, held in coded
            ]
        else:
            # Fragments of a repository no longer coded: none is dropped (nothing
            # places them), and each is reported as kept.
            report.kept += sum(len(h) for _, by_index in coded for h in by_index.values())
            ctx.reporter.advance(len(coded))
        for future in futures:
            outcome = future.result()
            report.copied += outcome.copied
            report.bytes_copied += outcome.bytes_copied
            report.dropped += outcome.dropped
            report.kept += outcome.kept
            if outcome.lost:
                report.lost.append(outcome.stored_id)
            elif outcome.missed:
                report.short.append(outcome.stored_id)
                for backend_id, why in outcome.missed.items():
                    report.missed.setdefault(backend_id, why)
            ctx.reporter.advance(1)
    finally:
        ctx.reporter.finish()
    return report
