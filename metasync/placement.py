"""Verified placement of one object's copies or fragments: the rules the
:class:`~metasync.replicator.Replicator` applies (and nothing else writes with).

- :func:`place` copies a whole object to the holders that lack it, from a copy
  verified against its id first, and drops copies on other backends only once
  every holder's copy is verified (git-annex's numcopies);
- :func:`place_fragments` does the same for the n fragments of an erasure-coded
  object, rebuilding a missing fragment from any k good ones and checking it
  against the cross-checksum before it is written;
- :func:`take_inventory` reads what the backends hold from their listings,
  accepting only names metasync writes.
"""

from __future__ import annotations

from concurrent.futures import Executor
from dataclasses import dataclass, field

from metasync.backends import Backend
from metasync.codec import Codec
from metasync.errors import CorruptObject, MetasyncError, ObjectNotFound, ObjectUnavailable
from metasync.layout import fragment_key, object_key, parse_fragment_key, parse_object_key


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


def enough_copies(copies: dict[str, int | None], holders: tuple[str, ...], replicas: int,
                  fragments: int) -> bool:
    """Whether an object has what the configuration asks for, given ``copies``
    (backend -> fragment index, None for a whole copy or an unknown one): R
    whole copies on different backends (a copy spilled in place of a holder
    counts), or, erasure-coded, a fragment on every fragment holder or its
    ``fragments`` distinct indexes somewhere."""
    if any(i is not None for i in copies.values()):
        indexes = {i for i in copies.values() if i is not None}
        return set(holders) <= set(copies) or len(indexes) >= fragments
    return len(copies) >= replicas


# ---------------------------------------------------------------- what the backends hold
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
    #: Holders known to lack their copy (or fragment) after this placement -- not
    #: listed as holding it and not written now -- with the reason (a refused write,
    #: an unreachable backend, no source). Empty when every holder has it.
    missed: dict[str, str] = field(default_factory=dict)


def place(
    codec: Codec,
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
    #: Backends that listed the object but failed to hand it over just now: their
    #: copy may well be good, so the object is not lost (a change must wait).
    unanswered: dict[str, str] = {}

    def verify_at(backend_id: str) -> bytes | None:
        """The copy on ``backend_id`` if it is good (and remember which it was)."""
        if backend_id in unreachable or backend_id in bad or backend_id not in backends:
            return None
        try:
            data = backends[backend_id].get(key)
            verify_stored(codec, stored_id, data)
        except (CorruptObject, ObjectNotFound):
            bad.add(backend_id)
            return None
        except MetasyncError as exc:
            bad.add(backend_id)
            unanswered[backend_id] = " ".join(str(exc).split())
            return None
        verified.add(backend_id)
        return data

    good: bytes | None = None
    if verify_all:
        for backend_id in sorted(have):
            good = verify_at(backend_id) or good
    missing = [h for h in holders if (h not in have or h in bad) and h not in unreachable]
    out.missed = {h: f"did not answer: {unreachable[h]}" for h in holders
                  if h in unreachable and h not in have}
    if missing:
        # A verified copy, from the best backend that has one (holders first).
        for backend_id in sorted(have, key=lambda b: (b in verified, b not in holders)):
            if good is not None:
                break
            good = verify_at(backend_id)
        if good is None:
            out.placed = verified & set(holders)
            if unanswered:
                # Not lost: a copy is there but could not be read now (a transient
                # failure); the holders stay short and the caller tries again.
                source, why = sorted(unanswered.items())[0]
                out.missed.update(dict.fromkeys(
                    missing, f"its copy on {source} could not be read ({why})"))
                return out
            out.lost = True
            out.missed.update(dict.fromkeys(missing, "no good copy to copy from"))
            return out
        for backend_id in missing:
            try:
                backends[backend_id].put(key, good)
            except MetasyncError as exc:
                out.missed[backend_id] = f"refused: {exc}"
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
    # content, before any extra copy goes. A holder known to lack it (not listed,
    # bad, unreachable, and not written just now) settles that without downloading
    # the others.
    if any(h not in verified and (h not in have or h in bad or h in unreachable)
           for h in holders):
        out.kept += len(extras)
        return out
    for h in holders:
        if h not in verified:
            verify_at(h)
    out.placed = verified & set(holders)
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
    codec: Codec,
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
    hasher = codec.hasher
    good: dict[int, bytes] = {}
    verified: dict[str, int] = {}  # backend -> the index it verifiably holds
    #: Backends that failed to hand over a fragment just now (not corrupt, not
    #: absent): with them the object is not lost, only not placed yet.
    unanswered: dict[str, str] = {}

    def fetch(index: int, backend_id: str) -> bytes | None:
        if backend_id in unreachable or backend_id not in backends:
            return None
        try:
            data = backends[backend_id].get(fragment_key(stored_id, index))
            verify_fragment(hasher, stored_id, index, data)
        except (CorruptObject, ObjectNotFound):
            return None
        except MetasyncError as exc:
            unanswered[backend_id] = " ".join(str(exc).split())
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
                if unanswered:
                    source, why = sorted(unanswered.items())[0]
                    out.missed[backend_id] = f"fragments on {source} could not be read ({why})"
                    continue
                out.lost = True
                out.missed[backend_id] = "no good fragments to rebuild from"
                continue
        try:
            backends[backend_id].put(fragment_key(stored_id, index), data)
        except MetasyncError as exc:
            out.missed[backend_id] = f"refused: {exc}"
            continue
        assigned[backend_id] = index
        verified[backend_id] = index
        out.copied += 1
        out.bytes_copied += len(data)
    out.placed = set(verified)
    out.missed.update({b: f"did not answer: {unreachable[b]}" for b in holders
                       if b in unreachable and b not in assigned})
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
    out.placed = set(verified)
    for index, backend_id in extras:
        _drop(out, backends[backend_id], fragment_key(stored_id, index))
    return out


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
