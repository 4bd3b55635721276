"""The one way an object's copies and fragments are written, repaired and dropped.

Every write to ``objects/`` goes through :class:`Replicator`: a push's first
upload of what it committed (:meth:`Replicator.upload`), the retry of copies a
backend refused and the hand-off of copies spilled to other backends
(:meth:`Replicator.repair_missing`), ``fsck --repair`` (:meth:`Replicator.repair`),
a rebalance's placement of copies and fragments on the holders a configuration
names (:meth:`Replicator.place`, :meth:`Replicator.place_fragments`), and the
deletions of a rebalance and of gc (:meth:`Replicator.delete`). The placement
rules themselves are :mod:`metasync.placement`'s.

The rules it keeps:

- **A byte copied from one backend to another is verified against its id
  first** (:func:`~metasync.placement.verify_stored` for a whole copy, the
  fragment's cross-checksum for a fragment; a fragment rebuilt from others is
  checked against the cross-checksum before it is written), and a copy is
  dropped only when every holder has the object and those copies were verified
  by content in this run (git-annex's numcopies). A source that fails its check
  is never copied; the copy it should have fed stays missing and is reported.
- **Copies spill instead of staying single** (Hybris; Dynamo's sloppy quorum
  with hinted hand-off): an upload walks the object's preference order
  (:meth:`~metasync.mapping.StableMapping.preference`) until R backends took a
  copy -- its holders first, then, for each holder that could not be written,
  the next backend that can. Where a holder missed its copy, a record
  ``spills/<id>`` goes to every backend that took one (docs/FORMAT.md §7.1), so
  any client -- not only the writer -- moves the copy home once the holder is
  back, and drops the spilled one. Readers already look at every backend of the
  configuration after the holders.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection, Iterable, Iterator
from concurrent.futures import CancelledError, Future, wait
from dataclasses import dataclass, field
from typing import BinaryIO

from metasync.backends import Backend
from metasync.codec import Codec
from metasync.errors import Interrupted, MetasyncError, ObjectNotFound, ObjectUnavailable
from metasync.layout import SPILLS_PREFIX, fragment_key, object_key, parse_spill_key, spill_key
from metasync.localdb import LocalDB
from metasync.objects import Config
from metasync.placement import (
    Inventory,
    PlaceOutcome,
    enough_copies,
    place,
    place_fragments,
    take_inventory,
    verify_stored,
)
from metasync.progress import CANCEL, Reporter
from metasync.store import SMALL_READ, RemoteStore, fragment_mapping_of

__all__ = ["Inventory", "PlaceOutcome", "Replicator", "Uploaded", "take_inventory", "verify_stored"]


@dataclass(frozen=True)
class Uploaded:
    """Where one upload put an object."""

    stored_id: str
    #: Bytes sent to backends, all copies or fragments together (a copy a backend
    #: already held, whole, is not sent: :meth:`Replicator.upload`'s ``resumed``).
    written: int
    #: The backends that should hold it (its R holders, or its n fragment holders).
    holders: tuple[str, ...]
    #: Backend id -> fragment index (None: a whole copy) of every copy made.
    copies: dict[str, int | None]
    #: Holders that did not take their copy, with the reason.
    missed: dict[str, str]

    @property
    def spilled(self) -> list[str]:
        """Backends that took a copy in place of a holder."""
        return [b for b in self.copies if b not in self.holders]

    @property
    def short(self) -> bool:
        """Fewer copies (or fragments) than the object should have."""
        return len(self.copies) < len(self.holders)


@dataclass
class SpillRecord:
    """What ``spills/<id>`` records say, and which backends list one."""

    listed_on: set[str] = field(default_factory=set)
    #: Backend id -> fragment index (None: a whole copy), as the writer recorded;
    #: None if no record could be read back (then the holders are probed).
    copies: dict[str, int | None] | None = None


def holders_of(store: RemoteStore, stored_id: str, copies: dict[str, int | None]) -> tuple[str, ...]:
    """The backends that should hold ``stored_id`` (its fragment holders if
    ``copies`` are fragments)."""
    coded = any(i is not None for i in copies.values())
    return (store.fragment_mapping if coded else store.mapping).locate(stored_id)


def settle_short(db: LocalDB, store: RemoteStore, stored_id: str,
                 copies: dict[str, int | None], placed: set[str]) -> None:
    """A short object (``copies``: what its row says) whose holders in ``placed``
    now verifiably hold their copy: forget it once it has the copies the
    configuration asks for, else remember the new copies."""
    known = {b: i for b, i in copies.items() if b in store.backends}
    known.update((b, None) for b in placed if b not in known)
    n = store.scheme.n if store.scheme is not None else store.config.replicas
    with db.transaction():
        if enough_copies(known, holders_of(store, stored_id, copies), store.config.replicas, n):
            db.remove_short(stored_id)
        elif known != copies:
            db.set_short(stored_id, known)


def _stop(futures: list[Future[Uploaded]]) -> bool:
    """Stop an upload: transfers not started are dropped, running ones stop at their
    next piece (:data:`~metasync.progress.CANCEL`); returns once none runs. Copies
    finished before stay (their object is recorded as uploaded); a stopped copy left
    only a temporary file, which nothing refers to. A stop this asked for itself (a
    ``KeyboardInterrupt`` without the CLI's handler) is withdrawn once all stopped,
    and True returned."""
    asked_here = CANCEL.request()
    for fut in futures:
        fut.cancel()
    try:
        wait(futures)
    finally:
        if asked_here:
            CANCEL.clear()
    return asked_here


def _results(futures: list[Future[Uploaded]]) -> Iterator[Uploaded | BaseException]:
    """Each upload's result (or its error), in order, waiting for each; once all are
    given, :class:`Interrupted` if the upload was stopped (the user asked:
    :data:`~metasync.progress.CANCEL`). A ``KeyboardInterrupt`` in this thread stops
    every transfer (:func:`_stop`) and the finished ones are still given, so what was
    kept is recorded; if nobody had asked for the stop, it is raised again at the end."""
    interrupt: BaseException | None = None
    i = 0
    while i < len(futures):
        try:
            result: Uploaded | BaseException = futures[i].result()
        except KeyboardInterrupt as exc:
            asked_here = _stop(futures)
            interrupt = interrupt or (exc if asked_here else Interrupted("the upload was stopped"))
            continue  # this one again: now done or cancelled
        except (CancelledError, Interrupted):
            interrupt = interrupt or Interrupted("the upload was stopped")
            i += 1
            continue
        except BaseException as exc:  # keep draining so no task is left running
            result = exc
        i += 1
        yield result
    if interrupt is not None:
        raise interrupt


class Replicator:
    """Writes, repairs and drops copies of stored objects on the store's backends
    (or on the backends a caller names, during a configuration change)."""

    def __init__(self, codec: Codec, store: RemoteStore, db: LocalDB, reporter: Reporter) -> None:
        self.codec = codec
        self.store = store
        self.db = db
        self.reporter = reporter

    # ---------------------------------------------------------------- first placement
    def upload(
        self,
        items: Iterable[tuple[str, Callable[[], BinaryIO]]],
        on_done: Callable[[Uploaded], None],
        resumed: Collection[str] = (),
    ) -> None:
        """Upload every ``(stored_id, open)`` (bytes this client made), many at once;
        ``open()`` returns a fresh readable, seekable stream of the stored bytes.
        Each object goes to its holders, and a copy a holder cannot take spills to
        the next backend of its preference order that can (see the module
        docstring), with a spill record where a holder missed it.

        ``on_done(uploaded)`` runs in the caller's thread for each object that
        reached enough backends to be read (one, or k fragment holders): record its
        ``missed`` holders (:meth:`repair_missing` writes them later) and tell the
        user if it is ``short``. The copies of one object are written one after
        another; different objects (and so different backends) in parallel. Raises
        :class:`ObjectUnavailable` if some object reached no backend at all (it is
        not reported done: it stays queued). Stopped (Ctrl-C, see :func:`_results`),
        it raises once no transfer runs, every finished object reported done.

        ``resumed``: ids an earlier command may have begun uploading (left queued by
        a Ctrl-C or a crash); a backend that already holds a whole copy of one is not
        sent it again (fragments of an erasure-coded object are sent again).
        """
        store = self.store

        def task(stored_id: str, open_: Callable[[], BinaryIO]) -> Uploaded:
            # Streamed from the source for each copy: memory stays at a few pieces
            # per worker however large the object.
            with open_() as stream:
                size = stream.seek(0, 2)
                if store.coded(size):
                    stream.seek(0)
                    return self._put_fragments(stored_id, stream.read())
                order = store.mapping.preference(stored_id)
                holders = order[: store.config.replicas]
                copies: dict[str, int | None] = {}
                missed: dict[str, str] = {}
                written = 0
                for backend_id in order:
                    if len(copies) >= len(holders):
                        break
                    if backend_id not in holders and backend_id in store.down:
                        continue  # a spill goes only where writes work
                    if (stored_id in resumed and backend_id not in store.down
                            and store.has_copy(backend_id, stored_id, size)):
                        copies[backend_id] = None
                        continue
                    stream.seek(0)
                    reason = store.put_copy(backend_id, stored_id, stream)
                    if reason is None:
                        copies[backend_id] = None
                        written += size
                    elif backend_id in holders:
                        missed[backend_id] = reason
            placed = Uploaded(stored_id, written, holders, copies, missed)
            self._record_spill(placed)
            return placed

        futures = [store.executor.submit(task, sid, load) for sid, load in items]
        unplaced: list[str] = []
        first_error: BaseException | None = None
        try:
            for placed in _results(futures):
                if isinstance(placed, BaseException):
                    first_error = first_error or placed
                    continue
                coded = any(index is not None for index in placed.copies.values())
                needed = store.scheme.k if coded and store.scheme is not None else 1
                if len(placed.copies) < needed:
                    unplaced.append(placed.stored_id)
                    continue
                on_done(placed)
        except BaseException:
            _stop(futures)  # interrupted while recording: leave nothing running
            raise
        if first_error is not None:
            raise first_error
        if unplaced:
            reasons = "; ".join(sorted(set(store.down.values())))
            raise ObjectUnavailable(
                f"could not store {len(unplaced)} object(s) on any backend ({reasons}); "
                "they stay queued and the next push retries"
            )

    def _put_fragments(self, stored_id: str, data: bytes) -> Uploaded:
        """Write fragment j of ``data`` to the j-th fragment holder, or, where that
        one cannot take it, to the next backend of the fragment order that holds no
        fragment of the object yet."""
        from metasync.erasure import encode_fragments

        store = self.store
        assert store.scheme is not None
        fragments = encode_fragments(self.codec.hasher, store.scheme, stored_id, data)
        order = store.fragment_mapping.preference(stored_id)
        holders = order[: store.scheme.n]
        spares = [b for b in order[store.scheme.n:] if b not in store.down]
        copies: dict[str, int | None] = {}
        missed: dict[str, str] = {}
        written = 0
        for index, (holder, fragment) in enumerate(zip(holders, fragments, strict=True)):
            key = fragment_key(stored_id, index)
            reason = store.put_copy(holder, stored_id, fragment, key)
            if reason is not None:
                missed[holder] = reason
                while spares and reason is not None:
                    target = spares.pop(0)
                    reason = store.put_copy(target, stored_id, fragment, key)
                    if reason is None:
                        copies[target] = index
            else:
                copies[holder] = index
            if reason is None:
                written += len(fragment)
        placed = Uploaded(stored_id, written, holders, copies, missed)
        self._record_spill(placed)
        return placed

    def _record_spill(self, placed: Uploaded) -> None:
        """Where a holder missed its copy, tell every backend that took one (best
        effort: this client also keeps a missing-copy row of its own)."""
        if not placed.missed or not placed.copies:
            return
        key = spill_key(placed.stored_id)
        data = self.codec.encode("spill", key, json.dumps(
            {"copies": {b: i for b, i in placed.copies.items()}}, sort_keys=True).encode())
        for backend_id in placed.copies:
            try:
                self.store.backends[backend_id].put(key, data)
            except MetasyncError:
                continue

    # ---------------------------------------------------------------- repairs
    def repair_missing(self) -> int:
        """Bring every copy home: the copies and fragments this client's uploads
        missed (its missing-copy rows), the holders its short objects lack (fewer
        copies than R: see :meth:`short_objects`) and the copies any client spilled
        (the ``spills/`` records the backends list), each written from a verified
        source, the spilled copy dropped once every holder's copy is verified.
        Backends down in this session are skipped. Returns how many rows stay."""
        store = self.store
        by_object: dict[str, set[str]] = {}
        for stored_id, backend_id in self.db.missing_copies():
            if (backend_id not in store.mapping.locate(stored_id)
                    and backend_id not in store.fragment_mapping.locate(stored_id)):
                # No longer a holder (the configuration changed since): the change's
                # rebalance placed the object where the current mapping says.
                self.forget_missing(stored_id, [backend_id])
            elif backend_id not in store.down:
                by_object.setdefault(stored_id, set()).add(backend_id)
        short = self.db.short_objects()
        for stored_id, copies in short.items():
            lacking = {h for h in holders_of(store, stored_id, copies)
                       if h not in copies and h not in store.down}
            if lacking:
                by_object.setdefault(stored_id, set()).update(lacking)
        records = self.spill_records(store.backends)
        backends = store.backends
        for stored_id in sorted(set(by_object) | set(records)):
            record = records.get(stored_id)
            if record is not None:
                placed = self._hand_off(backends, stored_id, record)
            else:
                wanted = by_object[stored_id]
                outcome = self.restore(backends, stored_id, wanted)
                if outcome.lost:
                    self._no_source(stored_id)
                placed = outcome.placed & wanted
                self.forget_missing(stored_id, placed)
            if stored_id in short:
                settle_short(self.db, self.store, stored_id, short[stored_id], placed)
        return len(self.db.missing_copies())

    def short_objects(self) -> list[str]:
        """Objects this client stored with fewer copies (or fragments) than the
        configuration asks for, whichever of its pushes uploaded them, and not
        repaired since: recorded at the upload, forgotten only once R copies
        exist (a copy spilled in place of a holder counts; one missed does not)."""
        return sorted(self.db.short_objects())

    def _no_source(self, stored_id: str) -> None:
        self.reporter.note(
            f"no good copy of object {stored_id[:12]} to repair from; its missing "
            "copies stay missing (run `metasync fsck`)")

    def spill_records(self, backends: dict[str, Backend], *,
                      read: bool = True) -> dict[str, SpillRecord]:
        """The ``spills/`` records every reachable backend lists, by stored id (names
        parsed strictly), with the recorded copies read from one of them (unless
        ``read`` is false)."""

        def listing(item: tuple[str, Backend]) -> tuple[str, list[str]]:
            backend_id, backend = item
            try:
                return backend_id, list(backend.list(SPILLS_PREFIX))
            except MetasyncError:
                return backend_id, []

        records: dict[str, SpillRecord] = {}
        for backend_id, keys in self.store.executor.map(listing, sorted(backends.items())):
            for key in keys:
                stored_id = parse_spill_key(key)
                if stored_id is not None:
                    records.setdefault(stored_id, SpillRecord()).listed_on.add(backend_id)
        for stored_id, record in records.items() if read else ():
            record.copies = self._read_record(backends, stored_id, record.listed_on)
        return records

    def _read_record(self, backends: dict[str, Backend], stored_id: str,
                     listed_on: set[str]) -> dict[str, int | None] | None:
        key = spill_key(stored_id)
        for backend_id in sorted(listed_on):
            try:
                doc = json.loads(self.codec.decode("spill", key, backends[backend_id].get(key)))
                copies = doc["copies"]
            except (MetasyncError, ValueError, KeyError, TypeError, RecursionError):
                continue  # damaged or forged: as if unread
            if isinstance(copies, dict) and all(
                    isinstance(b, str) and (i is None or type(i) is int) for b, i in copies.items()):
                return copies
        return None

    def _hand_off(self, backends: dict[str, Backend], stored_id: str,
                  record: SpillRecord) -> set[str]:
        """Move a spilled object home: every holder gets its verified copy (or
        fragment), the copies on other backends go, and the record goes last.
        Returns the holders that verifiably hold theirs."""
        store = self.store
        recorded = record.copies or {}
        coded_holders = store.fragment_mapping.locate(stored_id)
        lacking = [h for h in (coded_holders if any(i is not None for i in recorded.values())
                               else store.mapping.locate(stored_id)) if h not in recorded]
        if record.copies is not None and any(h in store.down for h in lacking):
            return set()  # a holder that lacks its copy is down in this session: not yet
        coded = any(index is not None for index in recorded.values()) or (
            record.copies is None and bool(self._probe_fragments(backends, stored_id)))
        if coded and store.config.erasure is not None:
            held = self._probe_fragments(backends, stored_id)
            for backend_id, index in recorded.items():
                if index is not None and backend_id in backends:
                    held.setdefault(index, {})[backend_id] = 0
            holders = coded_holders
            outcome = place_fragments(self.codec, backends, holders, stored_id, held,
                                      erasure=store.config.erasure, drop=True,
                                      unreachable=dict(store.down))
        else:
            holders = store.mapping.locate(stored_id)
            have = {b: 0 for b in recorded if b in backends}
            for backend_id in holders:
                try:
                    backends[backend_id].size(object_key(stored_id))
                    have[backend_id] = 0
                except MetasyncError:
                    continue
            outcome = place(self.codec, backends, holders, stored_id, have, drop=True,
                            unreachable=dict(store.down))
        if outcome.lost:
            self._no_source(stored_id)
        done = set(holders) <= outcome.placed and outcome.kept == 0
        self.forget_missing(stored_id, outcome.placed & set(holders))
        if done:
            for backend_id in sorted(record.listed_on | set(recorded)):
                if backend_id in backends:
                    try:
                        backends[backend_id].delete(spill_key(stored_id))
                    except MetasyncError:
                        continue
        return outcome.placed & set(holders)

    def forget_missing(self, stored_id: str, backend_ids: Iterable[str]) -> None:
        """Missing-copy rows of ``stored_id`` on these backends are settled."""
        with self.db.transaction():
            for backend_id in backend_ids:
                self.db.remove_missing_copy(stored_id, backend_id)

    def restore(self, backends: dict[str, Backend], stored_id: str, wanted: set[str]) -> PlaceOutcome:
        """Make the backends in ``wanted`` hold their copy or fragment of ``stored_id``
        again, from verified sources among ``backends``. Whether the object is stored
        whole or erasure-coded is read from what its holders have."""
        store = self.store
        fragments = self._probe_fragments(backends, stored_id) if store.scheme is not None else {}
        if fragments:
            holders = store.fragment_mapping.locate(stored_id)
            held = {i: {b: n for b, n in where.items() if b not in wanted}
                    for i, where in fragments.items()}
            assert store.config.erasure is not None
            return place_fragments(self.codec, backends, holders, stored_id,
                                   {i: w for i, w in held.items() if w},
                                   erasure=store.config.erasure)
        order = [b for b in store.read_order(stored_id, SMALL_READ) if b in backends and b not in wanted]
        return place(self.codec, backends, tuple(sorted(wanted)), stored_id, dict.fromkeys(order, 0))

    def _probe_fragments(self, backends: dict[str, Backend], stored_id: str) -> dict[int, dict[str, int]]:
        """Which fragments of ``stored_id`` its fragment holders have (empty if the
        object is stored whole: then some whole holder answers first)."""
        store = self.store
        for backend_id in store.mapping.locate(stored_id):
            try:
                backends[backend_id].size(object_key(stored_id))
                return {}  # a whole copy exists: not coded
            except (MetasyncError, KeyError):
                continue
        held: dict[int, dict[str, int]] = {}
        for index, backend_id in enumerate(store.fragment_mapping.locate(stored_id)):
            try:
                size = backends[backend_id].size(fragment_key(stored_id, index))
            except (MetasyncError, KeyError):
                continue
            held.setdefault(index, {})[backend_id] = size
        return held

    def repair(self, backends: dict[str, Backend], broken: dict[str, set[str]],
               coded: dict[str, dict[int, dict[str, int]]], config: Config) -> dict[str, set[str]]:
        """``fsck --repair``: re-create each broken copy or fragment (``broken`` maps
        stored id to the backends of ``config`` whose copy is missing or bad) from
        verified good ones; ``coded`` is what the listing showed of coded objects.
        Returns what was repaired, by stored id; missing-copy rows of those are
        settled."""
        fragment_holders = fragment_mapping_of(config)

        def fix(item: tuple[str, set[str]]) -> tuple[str, set[str]]:
            stored_id, bad = item
            if stored_id in coded and config.erasure is not None:
                # Every fragment is checked again: a bad one is not assigned, so it
                # is replaced like a missing one.
                outcome = place_fragments(
                    self.codec, backends, fragment_holders.locate(stored_id), stored_id,
                    coded[stored_id], erasure=config.erasure, verify_all=True)
            else:
                order = [b for b in self.store.read_order(stored_id, SMALL_READ)
                         if b in backends and b not in bad]
                outcome = place(self.codec, backends, tuple(sorted(bad)), stored_id,
                                dict.fromkeys(order, 0))
            return stored_id, outcome.placed & bad

        repaired: dict[str, set[str]] = {}
        self.reporter.start("repair", len(broken))
        try:
            for stored_id, fixed in self.store.executor.map(fix, sorted(broken.items())):
                if fixed:
                    repaired[stored_id] = fixed
                self.reporter.advance(1)
        finally:
            self.reporter.finish()
        short = self.db.short_objects()
        with self.db.transaction():
            for stored_id, fixed in repaired.items():
                for backend_id in fixed:
                    self.db.remove_missing_copy(stored_id, backend_id)
                if stored_id in short:
                    settle_short(self.db, self.store, stored_id, short[stored_id], fixed)
        return repaired

    # ---------------------------------------------------------------- placement
    def place(self, backends: dict[str, Backend], holders: tuple[str, ...], stored_id: str,
              have: dict[str, int], *, drop: bool = False, verify_all: bool = False,
              unreachable: dict[str, str] | None = None) -> PlaceOutcome:
        """:func:`metasync.placement.place` with this replicator's codec."""
        return place(self.codec, backends, holders, stored_id, have, drop=drop,
                     verify_all=verify_all, unreachable=unreachable)

    def place_fragments(self, backends: dict[str, Backend], holders: tuple[str, ...],
                        stored_id: str, held: dict[int, dict[str, int]], *,
                        erasure: tuple[int, int], drop: bool = False, verify_all: bool = False,
                        unreachable: dict[str, str] | None = None) -> PlaceOutcome:
        """:func:`metasync.placement.place_fragments` with this replicator's codec."""
        return place_fragments(self.codec, backends, holders, stored_id, held, erasure=erasure,
                               drop=drop, verify_all=verify_all, unreachable=unreachable)

    # ---------------------------------------------------------------- deletion
    def delete(self, backend: Backend, keys: dict[str, int]) -> tuple[int, int, int]:
        """Delete objects no version needs (gc): ``keys`` maps key to size. Returns
        (deleted, bytes deleted, failed); a copy already gone counts as neither."""
        done = size = failed = 0
        for key, n in keys.items():
            try:
                backend.delete(key)
                done += 1
                size += n
            except ObjectNotFound:
                pass
            except MetasyncError:
                failed += 1
        return done, size, failed
