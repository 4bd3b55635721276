"""Stable deterministic mapping of objects onto backends (paper §3.4, Figures 7 and 8).

Every client must compute exactly the same placement from the shared service
configuration alone, so everything below marked *format* is part of the on-disk
format and must never change without a format version bump.

Algorithm (format)
------------------
Inputs: backends ``(backend_id, capacity)``, the replica count ``R`` and the number
of partitions ``H`` (:data:`DEFAULT_PARTITIONS`; it never changes when backends are
added or removed).

1. *Virtual nodes.* Backend ``b`` owns the vnodes ``(b, 0) … (b, v_b - 1)``:

   a. Every capacity becomes an exact rational: an ``int`` as is, a ``float`` as its
      shortest round-trip decimal (``repr``), so ``0.1`` means exactly ``1/10``.
   b. The *vnode unit* ``u`` (:func:`vnode_unit`) is chosen once, when the repository
      is created, and stored in the config: ``g``, the largest rational such that
      every ``capacity_b / g`` is an integer, if those integers sum to at most
      ``MAX_VNODES``; else ``sum(capacity) / MAX_VNODES``. Example: A(1) B(2) C(2)
      D(1) -> u = 1 (counts 1, 2, 2, 1 as in Figure 8); 10, 10, 10 GB -> u = 10.
   c. Reconfigurations keep ``u`` (:meth:`StableMapping.reconfigured`).
   d. ``v_b = max(1, round_half_up(capacity_b / u))`` (exact rational arithmetic), so
      a backend's vnodes depend on nothing but its own capacity and ``u``.

2. *Partition order.* In partition ``i`` (``0 <= i < H``) every vnode gets the key
   :func:`vnode_digest` ``(i, b, j)`` = ``blake2b(msg, digest_size=8)`` (no key, salt
   or personalisation) over the canonical message::

       msg = b"metasync/mapping/v1\\x00"              # 20-byte domain tag
             + i.to_bytes(8, "big")                   # partition, unsigned 64-bit
             + len(bid).to_bytes(2, "big") + bid      # bid = backend_id.encode("utf-8")
             + j.to_bytes(4, "big")                   # vnode index, 0-based

   The 8-byte digests are compared as byte strings, i.e. as unsigned big-endian
   64-bit integers. Partition ``i``'s list is all vnodes sorted by key ascending
   (ties, which need a 64-bit collision, are broken by ``bid`` then ``j``).

3. *Lookup.* An object id is 64 lowercase hex digits (uniformly random). Its
   partition is ``int(object_id[:16], 16) % H`` (nothing else), and its replica set
   is the first ``R`` *distinct* backends of that partition's list, in list order.

Taking the first ``R`` distinct backends of the vnode list is the same as sorting
backends by their smallest vnode key (ties by ``bid``), which is what
:class:`StableMapping` computes, lazily, one partition at a time.

Properties
----------
With ``R = 1`` each backend receives an expected share ``v_b / sum(v)`` of the
objects (the first vnode of a uniformly random order is a uniformly random vnode).
Removing backends keeps every surviving copy in place, and adding backends only
places copies on the added backends, because the surviving backends' vnodes (their
count fixed by step 1d) and so their relative order in every partition are
untouched. A mapping built afresh from new capacities (a new unit) does not have
this property; reconfigure with :meth:`StableMapping.reconfigured`.
"""

from __future__ import annotations

import math
import re
import struct
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from fractions import Fraction
from functools import lru_cache
from hashlib import blake2b
from operator import itemgetter
from typing import Final

__all__ = [
    "DEFAULT_PARTITIONS",
    "HASH_TAG",
    "MAX_VNODES",
    "StableMapping",
    "minimum_moved_copies",
    "moved_copies",
    "movement",
    "vnode_counts",
    "vnode_digest",
    "vnode_unit",
]

#: H: number of partitions of the object-id space (format). 16384 keeps each
#: backend's R=1 share within ~0.4 percentage points (1 sigma) of its vnode share.
DEFAULT_PARTITIONS: Final = 16384

#: Upper bound on the total number of vnodes of one configuration (format).
MAX_VNODES: Final = 256

#: Domain-separation tag at the start of every hashed message (format).
HASH_TAG: Final = b"metasync/mapping/v1\x00"

_OBJECT_ID: Final = re.compile(r"[0-9a-f]{64}")
_MAX_PARTITIONS: Final = 1 << 64
_MAX_ID_BYTES: Final = 0xFFFF


def _encode_backend_id(backend_id: object) -> bytes:
    """Return the UTF-8 encoding of a valid backend id, else raise ValueError/TypeError."""
    if not isinstance(backend_id, str):
        raise TypeError(f"backend id must be a str, not {type(backend_id).__name__}")
    if not backend_id:
        raise ValueError("backend id must not be empty")
    try:
        encoded = backend_id.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"backend id {backend_id!r} is not valid Unicode text") from exc
    if len(encoded) > _MAX_ID_BYTES:
        raise ValueError(f"backend id is longer than {_MAX_ID_BYTES} UTF-8 bytes")
    return encoded


def _vnode_suffix(encoded_id: bytes, vnode: int) -> bytes:
    return len(encoded_id).to_bytes(2, "big") + encoded_id + vnode.to_bytes(4, "big")


def _partition_prefix(partition: int) -> bytes:
    return HASH_TAG + partition.to_bytes(8, "big")


def vnode_digest(partition: int, backend_id: str, vnode: int) -> bytes:
    """Return the 8-byte ordering key of vnode ``(backend_id, vnode)`` in ``partition``.

    Contract (format): ``blake2b(HASH_TAG + partition as 8-byte big-endian +
    len(bid) as 2-byte big-endian + bid + vnode as 4-byte big-endian,
    digest_size=8).digest()`` with ``bid = backend_id.encode("utf-8")``.
    Raises ValueError if ``partition`` or ``vnode`` is out of its field's range.
    """
    encoded = _encode_backend_id(backend_id)
    if not 0 <= partition < _MAX_PARTITIONS:
        raise ValueError(f"partition {partition} out of range")
    if not 0 <= vnode < 1 << 32:
        raise ValueError(f"vnode index {vnode} out of range")
    msg = _partition_prefix(partition) + _vnode_suffix(encoded, vnode)
    return blake2b(msg, digest_size=8).digest()


def _exact_capacity(backend_id: str, capacity: object) -> Fraction:
    """Return ``capacity`` as an exact positive rational (step 1a), else raise."""
    if isinstance(capacity, bool) or not isinstance(capacity, int | float):
        raise TypeError(
            f"capacity of backend {backend_id!r} must be an int or float, "
            f"not {type(capacity).__name__}"
        )
    if isinstance(capacity, float) and not math.isfinite(capacity):
        raise ValueError(f"capacity of backend {backend_id!r} must be finite, got {capacity}")
    if capacity <= 0:
        raise ValueError(f"capacity of backend {backend_id!r} must be > 0, got {capacity}")
    if isinstance(capacity, float):
        return Fraction(repr(capacity))
    return Fraction(capacity)


def _round_half_up(value: Fraction) -> int:
    return math.floor(value + Fraction(1, 2))


def vnode_unit(capacities: Sequence[Fraction]) -> Fraction:
    """The capacity one vnode stands for (format, step 1b-c), fixed for good when a
    repository is created and stored in its config.

    ``g`` = the largest rational such that every ``capacity / g`` is an integer. If
    those integers sum to at most ``MAX_VNODES`` the unit is ``g`` (so Figure 8's
    1, 2, 2, 1 give exactly 1, 2, 2, 1 vnodes and equal capacities give one vnode
    each); otherwise it is ``sum(capacities) / MAX_VNODES``. Only capacity ratios
    matter, so GB or TB give the same unit up to scale and the same counts.
    """
    if not capacities:
        raise ValueError("no capacities")
    if len(capacities) > MAX_VNODES:
        raise ValueError(f"at most {MAX_VNODES} backends are supported")
    if any(c <= 0 for c in capacities):
        raise ValueError("capacities must be > 0")
    common_denominator = math.lcm(*(c.denominator for c in capacities))
    scaled = [c.numerator * (common_denominator // c.denominator) for c in capacities]
    g = Fraction(math.gcd(*scaled), common_denominator)
    if sum(c / g for c in capacities) <= MAX_VNODES:
        return g
    return Fraction(sum(capacities), MAX_VNODES)


def vnode_counts(capacities: Sequence[Fraction], unit: Fraction | None = None) -> list[int]:
    """The vnode count of each capacity, in the same order (format, step 1d):
    ``max(1, round_half_up(capacity / unit))`` with ``unit`` from :func:`vnode_unit`
    when not given.

    Contract: every count is >= 1; equal capacities get equal counts; a backend's
    count depends only on its own capacity and the unit, so adding, removing or
    resizing other backends never changes it (this is what keeps the mapping stable
    across reconfigurations). With a fresh unit the total is at most
    ``MAX_VNODES + len(capacities)``.
    """
    if unit is None:
        unit = vnode_unit(capacities)
    if unit <= 0:
        raise ValueError("the vnode unit must be > 0")
    if any(c <= 0 for c in capacities):
        raise ValueError("capacities must be > 0")
    return [max(1, _round_half_up(c / unit)) for c in capacities]


_Vnodes = tuple[tuple[bytes, str, int], ...]


class _PartitionOrders:
    """Backend order of every partition for one ``(vnodes, H)``, computed lazily.

    ``order(i)`` is the tuple of *all* backend ids sorted by their smallest vnode key
    (ties by encoded id), i.e. the distinct backends of Figure 7's list for partition
    ``i``. Shared by every :class:`StableMapping` with the same vnodes and H whatever
    its R (see :func:`_orders_for`).
    """

    __slots__ = ("_cache", "_largest", "_others", "partitions")

    def __init__(self, vnodes: _Vnodes, partitions: int) -> None:
        per_backend = [
            (encoded, backend_id, tuple(_vnode_suffix(encoded, j) for j in range(count)))
            for encoded, backend_id, count in vnodes
        ]
        largest = max(range(len(per_backend)), key=lambda k: len(per_backend[k][2]))
        # (encoded id, id, message suffix of each vnode) of the backend with the most
        # vnodes (first in canonical order on ties), and of all the others.
        self._largest = per_backend.pop(largest)
        self._others = tuple(per_backend)
        self._cache: dict[int, tuple[str, ...]] = {}
        self.partitions = partitions

    def order(self, partition: int) -> tuple[str, ...]:
        cached = self._cache.get(partition)
        if cached is not None:
            return cached
        state = blake2b(_partition_prefix(partition), digest_size=8)
        copy = state.copy
        keys: list[tuple[bytes, bytes, str]] = []
        for encoded, backend_id, suffixes in self._others:
            digests = []
            for suffix in suffixes:
                h = copy()
                h.update(suffix)
                digests.append(h.digest())
            keys.append((min(digests), encoded, backend_id))
        # The backend with the most vnodes is scanned last and only until its running
        # minimum beats every other backend's (exact) key: from then on it is certainly
        # first, and the order of the rest is already exact. Same result as a full scan.
        encoded, backend_id, suffixes = self._largest
        best_other = min(keys)[0] if keys else None
        running: bytes | None = None
        for suffix in suffixes:
            h = copy()
            h.update(suffix)
            digest = h.digest()
            if running is None or digest < running:
                running = digest
                if best_other is None or running < best_other:
                    break
        assert running is not None
        keys.append((running, encoded, backend_id))
        keys.sort()
        result = tuple(key[2] for key in keys)
        self._cache[partition] = result
        return result


@lru_cache(maxsize=16)
def _orders_for(vnodes: _Vnodes, partitions: int) -> _PartitionOrders:
    """Shared partition-order table (a cache of a pure function: results never differ)."""
    return _PartitionOrders(vnodes, partitions)


class StableMapping:
    """Deterministic, capacity-proportional, stable placement of objects on backends.

    Pure: no I/O, no randomness; instances are immutable apart from lazily filled
    caches (per instance, and a module-level memo of the partition orders of the 16
    most recently used ``(vnodes, H)`` pairs, shared by instances that differ only in
    R). Two instances built from the same set of ``(backend_id, capacity)`` pairs (in
    any order), the same ``replicas`` and the same ``partitions`` return identical
    placements on every machine.

    Cost: a partition's order is computed on first use with one BLAKE2b call per vnode
    (the backend with most vnodes usually needs only a few), so touching all H
    partitions costs about ``H * total_vnodes`` hashes once per configuration; after
    that ``locate`` is a dictionary lookup (~2.5 µs).
    """

    __slots__ = (
        "_backends",
        "_cache",
        "_capacities",
        "_orders",
        "_partitions",
        "_replicas",
        "_unit",
        "_vnodes",
    )

    def __init__(
        self,
        backends: Sequence[tuple[str, int | float]],
        replicas: int,
        partitions: int = DEFAULT_PARTITIONS,
        unit: Fraction | None = None,
    ) -> None:
        """Build the mapping for ``backends`` = ``[(backend_id, capacity), ...]``.

        ``capacity`` is a positive int or float in any unit (only ratios matter).
        Raises ValueError if ``replicas < 1`` or ``replicas > len(backends)``, if two
        backends share an id, if an id is empty or not encodable as UTF-8, if a
        capacity is <= 0 or not finite, if ``partitions < 1`` (or >= 2**64), or if
        there are more than ``MAX_VNODES`` backends; TypeError for wrongly typed
        values (``bool`` is not accepted as a number).
        """
        if isinstance(replicas, bool) or not isinstance(replicas, int):
            raise TypeError("replicas must be an int")
        if isinstance(partitions, bool) or not isinstance(partitions, int):
            raise TypeError("partitions must be an int")
        if not 1 <= partitions < _MAX_PARTITIONS:
            raise ValueError(f"partitions must be between 1 and 2**64 - 1, got {partitions}")
        if replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {replicas}")
        if replicas > len(backends):
            raise ValueError(
                f"replicas ({replicas}) must not exceed the number of backends ({len(backends)})"
            )
        entries: dict[str, tuple[bytes, Fraction, int | float]] = {}
        for entry in backends:
            backend_id, capacity = entry
            encoded = _encode_backend_id(backend_id)
            if backend_id in entries:
                raise ValueError(f"duplicate backend id {backend_id!r}")
            entries[backend_id] = (encoded, _exact_capacity(backend_id, capacity), capacity)
        # Canonical order: by UTF-8 bytes of the id (equals code-point order).
        ordered = sorted(entries.items(), key=lambda item: item[1][0])
        exacts = [exact for _, (_, exact, _) in ordered]
        if len(exacts) > MAX_VNODES:
            raise ValueError(f"at most {MAX_VNODES} backends are supported")
        self._unit = unit if unit is not None else vnode_unit(exacts)
        counts = vnode_counts(exacts, self._unit)

        self._replicas = replicas
        self._partitions = partitions
        self._backends: tuple[str, ...] = tuple(bid for bid, _ in ordered)
        self._capacities: dict[str, int | float] = {bid: raw for bid, (_, _, raw) in ordered}
        self._vnodes: dict[str, int] = {bid: n for (bid, _), n in zip(ordered, counts, strict=True)}
        self._orders = _orders_for(
            tuple((enc, bid, n) for (bid, (enc, _, _)), n in zip(ordered, counts, strict=True)),
            partitions,
        )
        self._cache: dict[int, tuple[str, ...]] = {}

    # -- configuration ---------------------------------------------------------

    @property
    def unit(self) -> Fraction:
        """The capacity one vnode stands for; keep it across reconfigurations."""
        return self._unit

    def reconfigured(
        self, backends: Sequence[tuple[str, int | float]], replicas: int | None = None
    ) -> StableMapping:
        """The mapping after adding, removing or resizing backends (or changing R):
        same H and the same vnode unit, so unchanged backends keep their vnodes and
        only the copies the change requires move."""
        return StableMapping(
            backends, self._replicas if replicas is None else replicas, self._partitions, self._unit
        )

    @property
    def replicas(self) -> int:
        """R: how many distinct backends hold each object."""
        return self._replicas

    @property
    def partitions(self) -> int:
        """H: number of partitions of the object-id space."""
        return self._partitions

    @property
    def backend_ids(self) -> tuple[str, ...]:
        """All backend ids, sorted by their UTF-8 bytes (independent of input order)."""
        return self._backends

    def capacity(self, backend_id: str) -> int | float:
        """Return the capacity given for ``backend_id``; KeyError if unknown."""
        return self._capacities[backend_id]

    def vnodes(self, backend_id: str) -> int:
        """Return the number of vnodes of ``backend_id`` (see module docs); KeyError if unknown."""
        return self._vnodes[backend_id]

    @property
    def total_vnodes(self) -> int:
        """Sum of all backends' vnode counts (<= MAX_VNODES)."""
        return sum(self._vnodes.values())

    def __repr__(self) -> str:
        backends = ", ".join(f"{b}({self._capacities[b]})" for b in self._backends)
        return (
            f"StableMapping([{backends}], replicas={self._replicas}, partitions={self._partitions})"
        )

    # -- lookup ----------------------------------------------------------------

    def partition_of(self, object_id: str) -> int:
        """Return ``int(object_id[:16], 16) % H``.

        Contract: depends only on ``object_id`` and H. Raises ValueError unless
        ``object_id`` is exactly 64 lowercase hex digits.
        """
        if not isinstance(object_id, str) or not _OBJECT_ID.fullmatch(object_id):
            raise ValueError(f"object id must be 64 lowercase hex digits, got {object_id!r}")
        return int(object_id[:16], 16) % self._partitions

    def partition_replicas(self, partition: int) -> tuple[str, ...]:
        """Return the first R distinct backends of ``partition``'s vnode order.

        Contract: R distinct backend ids from this configuration, in order of
        preference; computed once per partition and cached. Raises ValueError if
        ``partition`` is not in ``range(H)``.
        """
        cached = self._cache.get(partition)
        if cached is not None:
            return cached
        if (
            isinstance(partition, bool)
            or not isinstance(partition, int)
            or not 0 <= partition < self._partitions
        ):
            raise ValueError(f"partition {partition!r} not in range({self._partitions})")
        result = self._orders.order(partition)[: self._replicas]
        self._cache[partition] = result
        return result

    def locate(self, object_id: str) -> tuple[str, ...]:
        """Return the R distinct backends that store ``object_id``, in preference order.

        Contract: deterministic function of ``object_id`` and the configuration;
        ValueError unless ``object_id`` is 64 lowercase hex digits.
        """
        return self.partition_replicas(self.partition_of(object_id))

    def preference(self, object_id: str) -> tuple[str, ...]:
        """Every backend, in ``object_id``'s preference order: the first R are its
        holders (:meth:`locate`), the rest the order in which copies spill when a
        holder cannot be written (docs/FORMAT.md §7).

        Contract: deterministic function of ``object_id`` and the configuration;
        ValueError unless ``object_id`` is 64 lowercase hex digits.
        """
        return self._orders.order(self.partition_of(object_id))


_FIRST_U64: Final = struct.Struct(">Q24x")  # first 8 of 32 bytes, unsigned big-endian


def _partition_counts(mapping: StableMapping, object_ids: Iterable[str]) -> Counter[int]:
    """Return how many of ``object_ids`` fall in each partition (ValueError on a bad id)."""
    ids = object_ids if isinstance(object_ids, list | tuple) else list(object_ids)
    # Fast path, same result as partition_of: all ids are str of 64 lowercase hex
    # digits iff their concatenation round-trips through bytes.fromhex/hex.
    if set(map(type, ids)) <= {str} and set(map(len, ids)) <= {64}:
        joined = "".join(ids)
        try:
            raw = bytes.fromhex(joined)
        except ValueError:
            raw = b""
        if raw.hex() == joined:
            firsts = map(itemgetter(0), _FIRST_U64.iter_unpack(raw))
            return Counter(map(mapping.partitions.__rmod__, firsts))
    return Counter(map(mapping.partition_of, ids))  # raises for the first bad id


def _per_object(old: StableMapping, new: StableMapping) -> Callable[[int, int], tuple[int, int]]:
    """Return f(old partition, new partition) -> (moved copies, minimum) for one object."""
    removed = set(old.backend_ids).difference(new.backend_ids)
    added = set(new.backend_ids).difference(old.backend_ids)
    replicas = new.replicas
    # Straight to the shared orders: callers visit each partition once, so the
    # per-instance cache would only cost time (partitions are in range by construction).
    old_order, old_r = old._orders.order, old.replicas
    new_order = new._orders.order

    def f(old_partition: int, new_partition: int) -> tuple[int, int]:
        old_set = set(old_order(old_partition)[:old_r])
        new_set = new_order(new_partition)[:replicas]
        moved = len(old_set.union(new_set)) - len(old_set)
        kept = len(old_set.difference(removed))
        on_added = len(added.intersection(new_set))
        return moved, max(replicas - kept, on_added, 0)

    return f


def movement(old: StableMapping, new: StableMapping, object_ids: Iterable[str]) -> tuple[int, int]:
    """Return ``(moved_copies(old, new, ids), minimum_moved_copies(old, new, ids))``.

    Contract: same values as the two functions, computed in one pass over the ids
    (objects are grouped by partition, since placement depends only on it).
    ValueError for an id that is not 64 lowercase hex digits.
    """
    per_object = _per_object(old, new)
    moved = minimum = 0
    if old.partitions == new.partitions:
        for p, n in _partition_counts(new, object_ids).items():
            m, b = per_object(p, p)
            moved += n * m
            minimum += n * b
    else:
        for o in object_ids:
            m, b = per_object(old.partition_of(o), new.partition_of(o))
            moved += m
            minimum += b
    return moved, minimum


def moved_copies(old: StableMapping, new: StableMapping, object_ids: Iterable[str]) -> int:
    """Return how many object copies must be created to go from ``old`` to ``new``.

    Contract: ``sum(len(set(new.locate(o)) - set(old.locate(o))) for o in object_ids)``
    (duplicates in ``object_ids`` count each time). Copies that ``new`` no longer
    needs are garbage, not moves, and are not counted.
    """
    return movement(old, new, object_ids)[0]


def minimum_moved_copies(old: StableMapping, new: StableMapping, object_ids: Iterable[str]) -> int:
    """Return the theoretical minimum of :func:`moved_copies` for this reconfiguration.

    Definition: with ``removed`` = backends of ``old`` not in ``new`` and ``added`` =
    backends of ``new`` not in ``old``, sum over objects ``o`` of
    ``max(new.replicas - |old.locate(o) - removed|, |new.locate(o) ∩ added|, 0)``:
    the copies lost with removed backends that must be recreated (when R is
    unchanged: the copies the removed backends held), or the copies ``new`` puts on
    added backends (which cannot already exist), whichever is larger. It is a lower
    bound: ``moved_copies(old, new, ids) >= minimum_moved_copies(old, new, ids)``
    always. For pure removal it equals the copies held by the removed backends; for
    pure addition, the copies placed on the added backends; when only R grows, it is
    the growth of R per object.
    """
    return movement(old, new, object_ids)[1]
