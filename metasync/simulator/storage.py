"""The copies of pushed objects on the simulated backends, placed by the production
rules (docs/FORMAT.md §7 and §7.1, ``metasync/replicator.py`` and
``metasync/placement.py``), with the real :class:`~metasync.mapping.StableMapping`
of each configuration:

- **an upload** walks the object's preference order (its holders first) until R
  backends took a copy; a holder that does not take one is a missed copy (a
  missing-copy row of the uploading client) and the next backend that takes one
  holds a *spilled* copy, with a spill record on every backend that took one;
- **a repair** (any client's push) writes the holders' missing copies from a
  verified copy, and moves spilled objects home: every holder gets its copy, the
  copies on other backends are dropped only once every holder's copy is verified
  (the numcopies rule), the records last;
- **a rebalance** (a configuration change) copies every object found on the
  backends to the holders the new mapping names and, with ``drop``, drops the
  other copies by the same numcopies rule.

Each storage operation happens at one instant of virtual time; whether it
reaches a backend (not lost, not down, not cut off from that client, no injected
failure) is decided by the ``ok`` callback. The copies on a lost backend are
kept here but never count.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from metasync.mapping import StableMapping
from metasync.simulator.model import Acceptor


@dataclass
class Upload:
    """Where one upload put an object."""

    object: str
    holders: tuple[str, ...]
    copies: list[str] = field(default_factory=list)
    missed: list[str] = field(default_factory=list)

    @property
    def short(self) -> bool:
        """Fewer copies than R: fewer than R backends took writes."""
        return len(self.copies) < len(self.holders)

    @property
    def spilled(self) -> list[str]:
        return [b for b in self.copies if b not in self.holders]


@dataclass
class Placed:
    """What placing one object did (``placement.place``'s outcome)."""

    #: Backends that now verifiably hold the object among those that should.
    placed: set[str] = field(default_factory=set)
    copied: int = 0
    dropped: int = 0
    kept: int = 0
    #: No verified copy was found to copy from.
    lost: bool = False


class Storage:
    """Object copies and spill records on ``backends``; ``ok(client, backend)`` says
    whether one operation of that client on that backend succeeds now."""

    def __init__(self, backends: dict[str, Acceptor], ok: Callable[[int, str], bool],
                 stats: Counter[str], log: Callable[[str], None]) -> None:
        self.backends = backends
        self.ok = ok
        self.stats = stats
        self.log = log

    # ---------------------------------------------------------------- one copy
    def put(self, who: int, backend: str, oid: str) -> bool:
        if not self.ok(who, backend):
            return False
        self.backends[backend].objects.add(oid)
        return True

    def verified(self, who: int, backend: str, oid: str) -> bool:
        """A good copy of ``oid`` read back from ``backend``."""
        return oid in self.backends[backend].objects and self.ok(who, backend)

    def drop(self, who: int, backend: str, oid: str) -> bool:
        if not self.ok(who, backend):
            return False
        self.backends[backend].objects.discard(oid)
        return True

    def readable(self, oid: str, backends: Iterable[str]) -> list[str]:
        """The backends among ``backends`` that hold a copy and are not lost."""
        return [b for b in backends if oid in self.backends[b].objects and not self.backends[b].lost]

    # ---------------------------------------------------------------- uploads
    def upload(self, who: int, oid: str, mapping: StableMapping) -> Upload:
        """``Replicator.upload`` of one object: holders first, then, for each holder
        that did not take its copy, the next backend of the preference order that
        does, until R backends hold one; spill records where a holder missed it."""
        order = mapping.preference(oid)
        out = Upload(oid, order[: mapping.replicas])
        for backend in order:
            if len(out.copies) >= len(out.holders):
                break
            if self.put(who, backend, oid):
                out.copies.append(backend)
            elif backend in out.holders:
                out.missed.append(backend)
        self.stats["objects uploaded"] += 1
        self.stats["copies spilled"] += len(out.spilled)
        if out.short:
            self.stats["objects uploaded with fewer than R copies"] += 1
        if out.missed and out.copies:
            for backend in out.copies:
                if self.ok(who, backend):
                    self.backends[backend].spills[oid] = tuple(out.copies)
        return out

    # ---------------------------------------------------------------- repairs
    def place(self, who: int, oid: str, holders: tuple[str, ...], have: Iterable[str],
              reachable: set[str], *, drop: bool,
              may_drop: Callable[[tuple[str, ...], set[str]], bool] | None = None) -> Placed:
        """``placement.place``: copy ``oid`` to the ``holders`` that lack it from a
        verified copy (``have``: backends that may hold one, holders first); with
        ``drop``, then drop the copies on the other backends of ``have``, but only
        once every holder's copy is verified (numcopies)."""
        out = Placed()
        have = sorted(set(have), key=lambda b: (b not in holders, b))
        verified = {b for b in have if b in holders and self.verified(who, b, oid)}
        missing = [h for h in holders if h not in verified and h in reachable]
        if missing:
            source = None
            unanswered = False
            for b in have:
                if b in verified or self.verified(who, b, oid):
                    source = b
                    break
                # Listed but not read just now: its copy is not lost (production's
                # placement keeps the holders short and the caller tries again).
                unanswered = unanswered or oid in self.backends[b].objects
            if source is None:
                out.lost = not unanswered
                out.placed = verified & set(holders)
                return out
            for h in missing:
                if self.put(who, h, oid):
                    verified.add(h)
                    out.copied += 1
        out.placed = verified & set(holders)
        if drop:
            extras = [b for b in have if b not in holders]
            if extras and not (may_drop or self.may_drop)(holders, verified):
                out.kept += len(extras)
            else:
                for b in extras:
                    if b in reachable and self.drop(who, b, oid):
                        out.dropped += 1
                    else:
                        out.kept += 1
        return out

    @staticmethod
    def may_drop(holders: tuple[str, ...], verified: set[str]) -> bool:
        """numcopies: extra copies go only once every holder's copy is verified."""
        return all(h in verified for h in holders)

    def may_hand_off(self, holders: tuple[str, ...], verified: set[str]) -> bool:
        """When a hand-off drops the spilled copies: by the numcopies rule."""
        return self.may_drop(holders, verified)

    def repair(self, who: int, rows: set[tuple[str, str]],
               mapping: StableMapping) -> tuple[set[tuple[str, str]], set[str]]:
        """``Replicator.repair_missing`` for client ``who`` over the backends of
        ``mapping``: its missing-copy ``rows`` (a row whose backend is no longer a
        holder is settled) and every spilled object whose record a backend lists,
        moved home. Returns the rows that stay, and the objects of rows settled
        only because the configuration changed (not written)."""
        backends = mapping.backend_ids
        reachable = {b for b in backends if self.ok(who, b)}
        wanted: dict[str, set[str]] = {}
        left: set[tuple[str, str]] = set()
        settled: set[str] = set()
        for oid, backend in sorted(rows):
            if backend in mapping.locate(oid):
                wanted.setdefault(oid, set()).add(backend)
            else:
                settled.add(oid)
        records: dict[str, tuple[str, ...] | None] = {}
        listed: dict[str, set[str]] = {}
        for backend in sorted(reachable):
            for oid, copies in sorted(self.backends[backend].spills.items()):
                records.setdefault(oid, copies)
                listed.setdefault(oid, set()).add(backend)
        for oid in sorted(set(wanted) | set(records)):
            holders = mapping.locate(oid)
            if oid in records:
                recorded = records[oid] or ()
                have = [b for b in recorded if b in backends]
                have += [h for h in holders if self.verified(who, h, oid)]
                out = self.place(who, oid, holders, have, reachable, drop=True,
                                 may_drop=self.may_hand_off)
                done = set(holders) <= out.placed and out.kept == 0
                self.stats["spilled copies dropped"] += out.dropped
                if done:
                    self.stats["spilled objects handed off"] += 1
                    for b in sorted(listed[oid] | set(recorded)):
                        if b in backends and self.ok(who, b):
                            self.backends[b].spills.pop(oid, None)
            else:
                others = [b for b in backends if b not in wanted[oid]]
                out = self.place(who, oid, tuple(sorted(wanted[oid])), others, reachable,
                                 drop=False)
            self.stats["missing copies written"] += out.copied
            left |= {(oid, b) for b in wanted.get(oid, ()) if b not in out.placed}
        return left, settled

    def rebalance(self, who: int, mapping: StableMapping, sources: Iterable[str], *,
                  drop: bool) -> bool:
        """``maintenance.rebalance``: every object found on ``sources`` or the
        mapping's backends goes to the holders ``mapping`` names (from a verified
        copy); with ``drop``, copies elsewhere go by the numcopies rule. True if the
        report is clean: every backend not lost for good listed, and every object
        that has a good copy on all its holders not lost."""
        every = sorted(set(sources) | set(mapping.backend_ids))
        reachable = {b for b in every if self.ok(who, b)}
        # Backends lost for good are known to be gone; every other must be listed.
        clean = all(b in reachable or self.backends[b].lost for b in every)
        inventory: dict[str, list[str]] = {}
        for b in sorted(reachable):
            for oid in sorted(self.backends[b].objects):
                inventory.setdefault(oid, []).append(b)
        for oid, have in sorted(inventory.items()):
            holders = mapping.locate(oid)
            out = self.place(who, oid, holders, have, reachable, drop=drop)
            self.stats["copies written by rebalances"] += out.copied
            self.stats["copies dropped by rebalances"] += out.dropped
            if out.lost:
                self.stats["objects a rebalance found no good copy of"] += 1
            alive = {h for h in holders if not self.backends[h].lost}
            clean = clean and (out.lost or alive <= out.placed)
        return clean
