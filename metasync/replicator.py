"""The one way an object's copies and fragments are written, repaired and dropped.

Every write to ``objects/`` goes through :class:`Replicator`: a push's first
upload of what it committed (:meth:`Replicator.upload`), the retry of copies a
backend refused (:meth:`Replicator.repair_missing`), ``fsck --repair``
(:meth:`Replicator.repair`), a rebalance's placement of copies and fragments on
the holders a configuration names (:meth:`Replicator.place`,
:meth:`Replicator.place_fragments`), and the deletions of a rebalance and of gc
(:meth:`Replicator.delete`).

The rule it keeps: **a byte copied from one backend to another is verified
against its id first** (:func:`verify_stored` for a whole copy, the fragment's
cross-checksum for a fragment; a fragment rebuilt from others is checked
against the cross-checksum before it is written), and a copy is dropped only
when every holder has the object and those copies were verified by content in
this run (git-annex's numcopies). A source that fails its check is never
copied; the copy it should have fed stays missing and is reported.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import BinaryIO

from metasync.backends import Backend
from metasync.codec import Codec
from metasync.errors import (
    CorruptObject,
    MetasyncError,
    ObjectNotFound,
    ObjectUnavailable,
)
from metasync.layout import fragment_key, object_key, parse_fragment_key, parse_object_key
from metasync.localdb import LocalDB
from metasync.objects import Config
from metasync.progress import Reporter
from metasync.store import SMALL_READ, RemoteStore, fragment_mapping_of


def verify_stored(codec: Codec, stored_id: str, data: bytes) -> None:
    """Raise :class:`CorruptObject` unless ``data`` is a good stored copy of
    ``stored_id``: a pack whose bytes hash to its id, or a commit or index that
    decodes under its id (the translator chain checks MAC and id)."""
    if codec.id_of("pack", data) == stored_id:
        return
    for kind in ("commit", "index"):
        try:
            codec.decode(kind, stored_id, data)
            return
        except CorruptObject:
            continue
    raise CorruptObject(f"object {stored_id[:12]}: content does not match its id")


# ============================================================== what the backends hold
@dataclass
class Inventory:
    """Which backend holds a copy of which stored object, and its size."""

    copies: dict[str, dict[str, int]] = field(default_factory=dict)
    #: Erasure-coded objects: stored id -> fragment index -> backend -> size.
    fragments: dict[str, dict[int, dict[str, int]]] = field(default_factory=dict)
    #: Backends whose listing failed, with the reason.
    unreachable: dict[str, str] = field(default_factory=dict)

    def held_by(self, backend_id: str) -> tuple[int, int]:
        """(objects or fragments, bytes) one backend holds."""
        sizes = [c[backend_id] for c in self.copies.values() if backend_id in c]
        sizes += [h[backend_id] for f in self.fragments.values() for h in f.values()
                  if backend_id in h]
        return len(sizes), sum(sizes)

    def stored_ids(self) -> set[str]:
        return set(self.copies) | set(self.fragments)


def take_inventory(backends: dict[str, Backend], executor: Executor) -> Inventory:
    """List ``objects/`` on every backend at once (names are parsed strictly:
    anything but a well-formed object or fragment key is ignored)."""
    inventory = Inventory()

    def listing(backend: Backend) -> list[tuple[str, int]]:
        return list(backend.list_sizes("objects"))

    futures = {b: executor.submit(listing, backend) for b, backend in backends.items()}
    for backend_id, future in futures.items():
        try:
            keys = future.result()
        except MetasyncError as exc:
            inventory.unreachable[backend_id] = str(exc)
            continue
        for key, size in keys:
            stored_id = parse_object_key(key)
            if stored_id is not None:
                inventory.copies.setdefault(stored_id, {})[backend_id] = size
                continue
            fragment = parse_fragment_key(key)
            if fragment is not None:
                by_index = inventory.fragments.setdefault(fragment[0], {})
                by_index.setdefault(fragment[1], {})[backend_id] = size
    return inventory


@dataclass
class PlaceOutcome:
    """What placing one object did."""

    stored_id: str
    copied: int = 0
    bytes_copied: int = 0
    dropped: int = 0
    kept: int = 0
    #: No good copy (or not enough good fragments) could be found to copy from.
    lost: bool = False
    #: Backends that now verifiably hold what they should.
    placed: set[str] = field(default_factory=set)


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
        on_done: Callable[[str, int, dict[str, str]], None],
    ) -> None:
        """Upload every ``(stored_id, open)`` (bytes this client made) to all its
        holders, many at once; ``open()`` returns a fresh readable, seekable stream
        of the stored bytes.

        ``on_done(stored_id, written, failures)`` runs in the caller's thread as each
        object reaches enough holders (one, or k fragment holders); ``written`` is
        the bytes stored on backends, ``failures`` maps backend id to reason for the
        holders it did not reach (record them: :meth:`repair_missing` writes them
        later). The copies of one object are written one after another; different
        objects (and so different backends) in parallel. Raises
        :class:`ObjectUnavailable` if some object reached no backend at all.
        """
        store = self.store

        def task(stored_id: str, open_: Callable[[], BinaryIO]) -> tuple[str, int, dict[str, str]]:
            failures: dict[str, str] = {}
            # Streamed from the source for each copy: memory stays at a few pieces
            # per worker however large the object.
            with open_() as stream:
                size = stream.seek(0, 2)
                if store.coded(size):
                    stream.seek(0)
                    return stored_id, size, self._put_fragments(stored_id, stream.read())
                for backend_id in store.mapping.locate(stored_id):
                    stream.seek(0)
                    reason = store.put_copy(backend_id, stored_id, stream)
                    if reason is not None:
                        failures[backend_id] = reason
            return stored_id, size, failures

        futures = [store.executor.submit(task, sid, load) for sid, load in items]
        unplaced: list[str] = []
        first_error: BaseException | None = None
        for fut in futures:
            try:
                stored_id, size, failures = fut.result()
            except BaseException as exc:  # keep draining so no task is left running
                first_error = first_error or exc
                continue
            if store.scheme is not None and store.coded(size):
                from metasync.erasure import stored_bytes

                needed, total = store.scheme.k, store.scheme.n
                written = stored_bytes(store.scheme, size) // total * (total - len(failures))
            else:
                needed, total = 1, len(store.mapping.locate(stored_id))
                written = size * (total - len(failures))
            if total - len(failures) < needed:
                unplaced.append(stored_id)  # not reported done: it stays queued
                continue
            on_done(stored_id, written, failures)
        if first_error is not None:
            raise first_error
        if unplaced:
            reasons = "; ".join(sorted(set(store.down.values())))
            raise ObjectUnavailable(
                f"could not store {len(unplaced)} object(s) on any backend ({reasons}); "
                "they stay queued and the next push retries"
            )

    def _put_fragments(self, stored_id: str, data: bytes) -> dict[str, str]:
        """Write fragment j of ``data`` to the j-th fragment holder; return failures."""
        from metasync.erasure import encode_fragments

        store = self.store
        assert store.scheme is not None
        fragments = encode_fragments(self.codec.hasher, store.scheme, stored_id, data)
        failures: dict[str, str] = {}
        holders = store.fragment_mapping.locate(stored_id)
        for index, (backend_id, fragment) in enumerate(zip(holders, fragments, strict=True)):
            reason = store.put_copy(backend_id, stored_id, fragment, fragment_key(stored_id, index))
            if reason is not None:
                failures[backend_id] = reason
        return failures

    # ---------------------------------------------------------------- repairs
    def repair_missing(self) -> int:
        """Write the copies and fragments a backend refused earlier (recorded as
        missing copies), each from a verified source; forget each one written.
        Backends down in this session are skipped. Returns how many stay missing."""
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
        backends = store.backends
        for stored_id, wanted in sorted(by_object.items()):
            outcome = self.restore(backends, stored_id, wanted)
            if outcome.lost:
                self.reporter.note(
                    f"no good copy of object {stored_id[:12]} to repair from; its missing "
                    "copies stay missing (run `metasync fsck`)")
            self.forget_missing(stored_id, outcome.placed & wanted)
        return len(self.db.missing_copies())

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
            return self.place_fragments(backends, holders, stored_id,
                                        {i: w for i, w in held.items() if w},
                                        erasure=store.config.erasure)
        order = [b for b in store.read_order(stored_id, SMALL_READ) if b in backends and b not in wanted]
        return self.place(backends, tuple(sorted(wanted)), stored_id, dict.fromkeys(order, 0))

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
                outcome = self.place_fragments(
                    backends, fragment_holders.locate(stored_id), stored_id,
                    coded[stored_id], erasure=config.erasure, verify_all=True)
            else:
                order = [b for b in self.store.read_order(stored_id, SMALL_READ)
                         if b in backends and b not in bad]
                outcome = self.place(backends, tuple(sorted(bad)), stored_id,
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
        with self.db.transaction():
            for stored_id, fixed in repaired.items():
                for backend_id in fixed:
                    self.db.remove_missing_copy(stored_id, backend_id)
        return repaired

    # ---------------------------------------------------------------- placement
    def place(
        self,
        backends: dict[str, Backend],
        holders: tuple[str, ...],
        stored_id: str,
        have: dict[str, int],
        *,
        drop: bool = False,
        verify_all: bool = False,
        unreachable: dict[str, str] | None = None,
    ) -> PlaceOutcome:
        """Copy a whole object to the ``holders`` that lack it (``have`` lists the
        backends that may hold a copy, best source first), from a copy verified
        first; with ``drop``, then delete the copies on backends not among
        ``holders`` (numcopies: only once every holder's copy is verified). With
        ``verify_all`` every copy in ``have`` is checked and a bad one replaced."""
        unreachable = unreachable or {}
        out = PlaceOutcome(stored_id)
        key = object_key(stored_id)
        verified: set[str] = set()
        bad: set[str] = set()

        def verify_at(backend_id: str) -> bytes | None:
            """The copy on ``backend_id`` if it is good (and remember which it was)."""
            if backend_id in unreachable or backend_id in bad or backend_id not in backends:
                return None
            try:
                data = backends[backend_id].get(key)
                verify_stored(self.codec, stored_id, data)
            except MetasyncError:
                bad.add(backend_id)
                return None
            verified.add(backend_id)
            return data

        good: bytes | None = None
        if verify_all:
            for backend_id in sorted(have):
                good = verify_at(backend_id) or good
        missing = [h for h in holders if (h not in have or h in bad) and h not in unreachable]
        if missing:
            # A verified copy, from the best backend that has one (holders first).
            for backend_id in sorted(have, key=lambda b: (b in verified, b not in holders)):
                if good is not None:
                    break
                good = verify_at(backend_id)
            if good is None:
                out.lost = True
                out.placed = verified & set(holders)
                return out
            for backend_id in missing:
                try:
                    backends[backend_id].put(key, good)
                except MetasyncError:
                    continue
                verified.add(backend_id)
                bad.discard(backend_id)
                out.copied += 1
                out.bytes_copied += len(good)
        out.placed = verified & set(holders)
        if not drop:
            return out
        extras = [b for b in have if b not in holders]
        if not extras:
            return out
        # numcopies: every holder has it, and all R of those copies are verified by
        # content, before any extra copy goes.
        for h in holders:
            if h not in verified:
                verify_at(h)
        if not all(h in verified for h in holders):
            out.kept += len(extras)
            return out
        for backend_id in extras:
            if backend_id in unreachable:
                out.kept += 1
                continue
            _drop(out, backends[backend_id], key)
        return out

    def place_fragments(
        self,
        backends: dict[str, Backend],
        holders: tuple[str, ...],
        stored_id: str,
        held: dict[int, dict[str, int]],
        *,
        erasure: tuple[int, int],
        drop: bool = False,
        verify_all: bool = False,
        unreachable: dict[str, str] | None = None,
    ) -> PlaceOutcome:
        """An erasure-coded object: each of its n ``holders`` must hold one fragment,
        all of different indexes (``held``: index -> backend -> size, what is known
        to exist). A fragment stays where it is if that backend is still a holder; a
        holder without one gets a missing index, copied (verified) if some other
        backend has it, else rebuilt from any k good fragments (checked against the
        cross-checksum). With ``drop``, fragments on other backends (and second
        fragments on a holder) go once every holder's fragment is verified."""
        from metasync.erasure import ErasureScheme, rebuild_fragment, verify_fragment

        unreachable = unreachable or {}
        out = PlaceOutcome(stored_id)
        scheme = ErasureScheme(*erasure)
        hasher = self.codec.hasher
        good: dict[int, bytes] = {}
        verified: dict[str, int] = {}  # backend -> the index it verifiably holds

        def fetch(index: int, backend_id: str) -> bytes | None:
            if backend_id in unreachable or backend_id not in backends:
                return None
            try:
                data = backends[backend_id].get(fragment_key(stored_id, index))
                verify_fragment(hasher, stored_id, index, data)
            except MetasyncError:
                return None
            good.setdefault(index, data)
            return data

        # Which index each holder keeps (its own position's if it has that one).
        assigned: dict[str, int] = {}
        for position, backend_id in enumerate(holders):
            options = sorted(i for i, where in held.items() if backend_id in where)
            options.sort(key=lambda i: i != position)
            for index in options:
                if index in assigned.values():
                    continue
                if verify_all and fetch(index, backend_id) is None:
                    continue
                assigned[backend_id] = index
                if verify_all:
                    verified[backend_id] = index
                break
        missing = sorted(set(range(scheme.n)) - set(assigned.values()))
        empty = [b for b in holders if b not in assigned and b not in unreachable]
        for backend_id, index in zip(empty, missing, strict=False):
            data = good.get(index)
            if data is None:
                for source in held.get(index, {}):
                    data = fetch(index, source)
                    if data is not None:
                        break
            if data is None:
                for other, holding in sorted(held.items()):
                    if len(good) >= scheme.k:
                        break
                    for b in holding:
                        if fetch(other, b) is not None:
                            break
                try:
                    data = rebuild_fragment(hasher, scheme, stored_id, good, index)
                except (CorruptObject, ObjectUnavailable):
                    out.lost = True
                    continue
            try:
                backends[backend_id].put(fragment_key(stored_id, index), data)
            except MetasyncError:
                continue
            assigned[backend_id] = index
            verified[backend_id] = index
            out.copied += 1
            out.bytes_copied += len(data)
        out.placed = set(verified)
        if not drop:
            return out
        extras = [(i, b) for i, where in held.items() for b in where if assigned.get(b) != i]
        if not extras:
            return out
        if len(assigned) < len(holders):
            out.kept += len(extras)
            return out
        for backend_id, index in assigned.items():
            if backend_id not in verified and fetch(index, backend_id) is None:
                out.kept += len(extras)
                return out
            verified[backend_id] = index
        for index, backend_id in extras:
            _drop(out, backends[backend_id], fragment_key(stored_id, index))
        return out

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


def _drop(out: PlaceOutcome, backend: Backend, key: str) -> None:
    """Delete one extra copy (its required copies are verified); one that cannot be
    deleted now stays, counted as kept, for the next rebalance."""
    try:
        backend.delete(key)
        out.dropped += 1
    except ObjectNotFound:
        pass
    except MetasyncError:
        out.kept += 1
