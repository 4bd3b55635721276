"""Erasure-coded objects: N fragments on N backends, any K of which rebuild the object.

An alternative to R-fold replication (issue 7, item 6): the stored bytes of one
object are cut into K equal pieces (the last one zero-padded) and zfec, the
Reed-Solomon coder of Tahoe-LAFS, adds N - K parity pieces. Each of the N
*shares* becomes one backend object, a *fragment*: a small header, then the
share. Storage costs N/K times the object instead of R times; Hybris found coding
pays off from about 1 MB (smaller objects stay replicated, :func:`use_erasure`).

Backends are untrusted, so every fragment carries PoWerStore's *cross-checksum*:
the hash of every one of the N shares, bound to the object id and the share's
position, so a reader checks each share on its own before decoding and knows
which fragment is bad. The header itself carries a hash over it and the object
id; with an encrypted repository the hasher is keyed, so both are MACs and a
backend can neither alter a fragment nor move it to another object or position
undetected. Without encryption they are plain checksums (detect accidents only)
and the caller's check of the decoded object's id is what protects integrity.

zfec's code is *systematic*: shares 0..K-1 are the padded object itself. A reader
that wants a few pack entries can therefore range-read them straight from those
fragments (:func:`systematic_ranges`) without decoding, since each pack entry is
authenticated on its own by the codec; when a systematic fragment is missing or an
entry read from it fails its check, the reader falls back to fetching any K good
fragments and :func:`decode_fragments`.

This module does no I/O. docs/FORMAT.md section 15 is the normative description.
"""

from __future__ import annotations

import hmac
import re
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import zfec

from metasync.errors import CorruptObject, ObjectUnavailable, UsageError

# MAX_FRAGMENTS: the largest N accepted, in schemes and in fragment headers read from a backend.
from metasync.objects import MAX_FRAGMENTS, ObjectHasher, is_object_id

#: Objects whose stored size is below this stay replicated (Hybris, section 5:
#: coding pays off only above about 1 MB).
DEFAULT_THRESHOLD = 1024 * 1024

FRAGMENT_MAGIC = b"MSF1"
#: magic, k, n, index, reserved (0), object size, share length (big-endian).
_FIXED = struct.Struct(">4sBBBBQQ")
_DIGEST = 32
#: Hash kinds (BLAKE2b personalisation ``metasync:<kind>``, at most 7 characters).
SHARE_KIND = "share"
HEADER_KIND = "fraghdr"

_SCHEME = re.compile(r"^\s*(\d{1,3})\s*/\s*(\d{1,3})\s*\Z")


# ----------------------------------------------------------------------------- scheme


@dataclass(frozen=True)
class ErasureScheme:
    """K of N: an object becomes N fragments, any K of which rebuild it.

    ``1 <= k < n <= MAX_FRAGMENTS``; up to ``n - k`` fragments may be lost.
    Constructing one with other values raises :class:`UsageError`.
    """

    k: int
    n: int

    def __post_init__(self) -> None:
        problem = _scheme_problem(self.k, self.n)
        if problem:
            raise UsageError(f"erasure scheme {self.k}/{self.n}: {problem}")

    @classmethod
    def parse(cls, text: str) -> ErasureScheme:
        """``"2/3"`` -> ``ErasureScheme(2, 3)``; :class:`UsageError` naming the fix otherwise."""
        match = _SCHEME.match(text)
        if not match:
            raise UsageError(
                f"erasure scheme {text!r} is not K/N: give the fragments needed and the "
                "fragments stored, for example 2/3"
            )
        return cls(int(match.group(1)), int(match.group(2)))

    def __str__(self) -> str:
        return f"{self.k}/{self.n}"


def _scheme_problem(k: object, n: object) -> str | None:
    if not isinstance(k, int) or not isinstance(n, int) or isinstance(k, bool) or isinstance(n, bool):
        return "K and N must be integers"
    if k < 1:
        return "K must be at least 1 (for example 2/3)"
    if n > MAX_FRAGMENTS:
        return f"N must be at most {MAX_FRAGMENTS} (one fragment per backend)"
    if k >= n:
        return "K must be less than N, or no fragment may be lost (for example 2/3)"
    return None


def use_erasure(
    scheme: ErasureScheme | None, size: int, threshold: int = DEFAULT_THRESHOLD
) -> bool:
    """True if an object of ``size`` stored bytes is erasure-coded under ``scheme``
    (``None``: the repository only replicates); smaller objects stay replicated."""
    return scheme is not None and size >= threshold


def header_length(n: int) -> int:
    """Bytes of a fragment header for ``n`` fragments: 24 + 32 n + 32."""
    return _FIXED.size + _DIGEST * n + _DIGEST


def share_length(k: int, size: int) -> int:
    """Bytes of each share of an object of ``size`` stored bytes: ceil(size / k)."""
    return -(-size // k)


@dataclass(frozen=True)
class FragmentLayout:
    """Where the bytes of a coded object of ``size`` stored bytes are: enough to
    map a range of the object into its systematic fragments."""

    scheme: ErasureScheme
    size: int

    @property
    def share_length(self) -> int:
        return share_length(self.scheme.k, self.size)

    @property
    def header_length(self) -> int:
        return header_length(self.scheme.n)

    @property
    def fragment_length(self) -> int:
        """Bytes of every one of the N fragment objects."""
        return self.header_length + self.share_length


def stored_bytes(scheme: ErasureScheme, size: int) -> int:
    """Total bytes of all N fragments (headers included) of an object of ``size``
    stored bytes: about ``size * n / k`` (1.5x for 2/3)."""
    return scheme.n * FragmentLayout(scheme, size).fragment_length


# ----------------------------------------------------------------------------- header


@dataclass(frozen=True)
class FragmentHeader:
    """A verified fragment header. ``checksums[i]`` is the hash of share ``i``."""

    k: int
    n: int
    index: int
    size: int
    share_length: int
    checksums: tuple[bytes, ...]

    @property
    def scheme(self) -> ErasureScheme:
        return ErasureScheme(self.k, self.n)

    @property
    def layout(self) -> FragmentLayout:
        return FragmentLayout(self.scheme, self.size)

    @property
    def header_length(self) -> int:
        return header_length(self.n)

    def to_bytes(self, hasher: ObjectHasher, object_id: str) -> bytes:
        """The header bytes, MAC included (MAC over the object id and the rest)."""
        body = _FIXED.pack(
            FRAGMENT_MAGIC, self.k, self.n, self.index, 0, self.size, self.share_length
        ) + b"".join(self.checksums)
        return body + _header_mac(hasher, object_id, body)


def _raw_id(object_id: str) -> bytes:
    if not is_object_id(object_id):
        raise ValueError(f"not an object id: {object_id!r}")
    return bytes.fromhex(object_id)


def _header_mac(hasher: ObjectHasher, object_id: str, body: bytes | memoryview) -> bytes:
    h = hasher.new(HEADER_KIND)
    h.update(_raw_id(object_id))
    h.update(body)
    return bytes(h.digest())


def _share_checksum(
    hasher: ObjectHasher, object_id: str, index: int, share: bytes | memoryview
) -> bytes:
    h = hasher.new(SHARE_KIND)
    h.update(_raw_id(object_id))
    h.update(bytes((index,)))
    h.update(share)
    return bytes(h.digest())


def _what(object_id: str, index: int) -> str:
    return f"fragment {index} of {object_id[:12]}"


def verify_header(
    hasher: ObjectHasher, object_id: str, index: int, data: bytes | memoryview
) -> FragmentHeader:
    """The header at the start of ``data`` (a whole fragment, or at least its first
    :func:`header_length` bytes from a range read), if it is well formed, its MAC
    matches and it names position ``index``; else :class:`CorruptObject`.

    Does not look at the share: :func:`verify_fragment` does.
    """
    what = _what(object_id, index)
    view = memoryview(data)
    if len(view) < _FIXED.size:
        raise CorruptObject(f"{what}: too short for a fragment header ({len(view)} bytes)")
    magic, k, n, claimed, reserved, size, share_len = _FIXED.unpack_from(view)
    if magic != FRAGMENT_MAGIC or reserved != 0:
        raise CorruptObject(f"{what}: not a fragment (bad magic or reserved byte)")
    problem = _scheme_problem(k, n)
    if problem:
        raise CorruptObject(f"{what}: header declares scheme {k}/{n}: {problem}")
    if claimed >= n:
        raise CorruptObject(f"{what}: header declares index {claimed} of only {n}")
    if share_len != share_length(k, size):
        raise CorruptObject(f"{what}: share length {share_len} does not fit size {size}")
    hlen = header_length(n)
    if len(view) < hlen:
        raise CorruptObject(f"{what}: too short for its {hlen}-byte header ({len(view)} bytes)")
    body = view[: hlen - _DIGEST]
    if not hmac.compare_digest(_header_mac(hasher, object_id, body), view[hlen - _DIGEST : hlen]):
        raise CorruptObject(f"{what}: header does not match its MAC (altered, or another object's)")
    if claimed != index:
        raise CorruptObject(f"{what}: is fragment {claimed}, stored in the place of {index}")
    checksums = tuple(
        bytes(view[_FIXED.size + i * _DIGEST : _FIXED.size + (i + 1) * _DIGEST]) for i in range(n)
    )
    return FragmentHeader(k, n, index, size, share_len, checksums)


def verify_fragment(
    hasher: ObjectHasher, object_id: str, index: int, data: bytes | memoryview
) -> FragmentHeader:
    """The header of fragment ``index`` of ``object_id`` if ``data`` is a good copy
    of it: header as in :func:`verify_header`, exact length, and the share hashes
    to its entry in the cross-checksum. Otherwise :class:`CorruptObject`."""
    header = verify_header(hasher, object_id, index, data)
    expected = header.header_length + header.share_length
    if len(data) != expected:
        raise CorruptObject(
            f"{_what(object_id, index)}: {len(data)} bytes, its header says {expected}"
        )
    share = memoryview(data)[header.header_length :]
    if not hmac.compare_digest(
        _share_checksum(hasher, object_id, index, share), header.checksums[index]
    ):
        raise CorruptObject(f"{_what(object_id, index)}: share does not match its checksum")
    return header


# ----------------------------------------------------------------------------- coding


def _primary_shares(stored: bytes | memoryview, k: int) -> list[bytes | memoryview]:
    """The K data shares of ``stored``: views of it where whole, zero-padded copies
    where the object ends inside or before a share."""
    view = memoryview(stored)
    size = len(view)
    length = share_length(k, size)
    shares: list[bytes | memoryview] = []
    for i in range(k):
        start, end = i * length, (i + 1) * length
        if end <= size:
            shares.append(view[start:end])
        else:
            piece = view[min(start, size) : size]
            shares.append(bytes(piece) + bytes(length - len(piece)))
    return shares


def encode_fragments(
    hasher: ObjectHasher, scheme: ErasureScheme, object_id: str, stored: bytes | memoryview
) -> list[bytes]:
    """The N fragment objects of the stored bytes of ``object_id``; fragment ``i``
    goes to key :func:`metasync.layout.fragment_key` ``(object_id, i)``. Deterministic: the same
    input always gives the same bytes (so :func:`rebuild_fragment` can re-create
    one exactly)."""
    k, n = scheme.k, scheme.n
    size = len(memoryview(stored))
    shares = zfec.Encoder(k, n).encode(_primary_shares(stored, k))
    checksums = tuple(_share_checksum(hasher, object_id, i, s) for i, s in enumerate(shares))
    share_len = share_length(k, size)
    return [
        b"".join(
            (FragmentHeader(k, n, i, size, share_len, checksums).to_bytes(hasher, object_id), share)
        )
        for i, share in enumerate(shares)
    ]


@dataclass(frozen=True)
class _Good:
    header: FragmentHeader
    share: memoryview


def _sort_out(
    hasher: ObjectHasher,
    object_id: str,
    fragments: Mapping[int, bytes],
    scheme: ErasureScheme | None,
) -> tuple[list[dict[int, _Good]], dict[int, str]]:
    """Verify every fragment; return the good ones grouped by encoding (same K, N,
    size and cross-checksum), most promising group first, and why the others are bad."""
    bad: dict[int, str] = {}
    groups: dict[tuple[int, int, int, tuple[bytes, ...]], dict[int, _Good]] = {}
    for index, data in fragments.items():
        try:
            if not isinstance(index, int) or not 0 <= index < MAX_FRAGMENTS:
                raise CorruptObject(f"fragment index {index!r} out of range")
            header = verify_fragment(hasher, object_id, index, data)
            if scheme is not None and (header.k, header.n) != (scheme.k, scheme.n):
                raise CorruptObject(
                    f"{_what(object_id, index)}: coded {header.k}/{header.n}, expected {scheme}"
                )
        except CorruptObject as exc:
            bad[index] = str(exc).removeprefix(f"{_what(object_id, index)}: ")
            continue
        share = memoryview(data)[header.header_length :]
        group = (header.k, header.n, header.size, header.checksums)
        groups.setdefault(group, {})[index] = _Good(header, share)
    # Largest group first; ties broken by the cross-checksum, so the choice is deterministic.
    ordered = sorted(groups.items(), key=lambda item: (-len(item[1]), item[0][3]))
    return [members for _, members in ordered], bad


def _decode_group(hasher: ObjectHasher, object_id: str, group: dict[int, _Good]) -> list[memoryview]:
    """The K verified data shares of one group of at least K good fragments."""
    header = next(iter(group.values())).header
    k, n = header.k, header.n
    chosen = sorted(group)[:k]  # data shares first: nothing to recover for them
    if chosen[-1] < k:
        return [group[i].share for i in chosen]
    blocks = zfec.Decoder(k, n).decode([group[i].share for i in chosen], chosen)
    shares = [memoryview(b) for b in blocks]
    for i, share in enumerate(shares):
        if i not in chosen and not hmac.compare_digest(
            _share_checksum(hasher, object_id, i, share), header.checksums[i]
        ):
            raise CorruptObject(
                f"{object_id[:12]}: fragments {chosen} decode to data that does not match "
                "their cross-checksum (written inconsistently)"
            )
    return shares


def _join(shares: list[memoryview], size: int, what: str) -> bytes:
    """The object from its K data shares; the padding after ``size`` must be zeros."""
    length = len(shares[0]) if shares else 0
    pieces = []
    for i, share in enumerate(shares):
        keep = max(0, min(length, size - i * length))
        if any(share[keep:]):
            raise CorruptObject(f"{what}: padding of share {i} is not zeros")
        pieces.append(share[:keep])
    return b"".join(pieces)


def _rebuild(
    hasher: ObjectHasher,
    object_id: str,
    fragments: Mapping[int, bytes],
    scheme: ErasureScheme | None,
    check: Callable[[bytes], object] | None,
) -> tuple[bytes, dict[int, _Good], list[memoryview]]:
    groups, bad = _sort_out(hasher, object_id, fragments, scheme)
    reasons = [f"{i}: {why}" for i, why in sorted(bad.items())]
    decodable = False
    for group in groups:
        header = next(iter(group.values())).header
        if len(group) < header.k:
            continue
        decodable = True
        try:
            shares = _decode_group(hasher, object_id, group)
            data = _join(shares, header.size, object_id[:12])
            if check is not None:
                check(data)
        except CorruptObject as exc:
            reasons.append(f"{sorted(group)}: {exc}")
            continue
        return data, group, shares
    detail = "; ".join(reasons) or "none"
    if decodable:
        raise CorruptObject(f"object {object_id[:12]}: no set of fragments decodes ({detail})")
    given = f"given {sorted(fragments)}; bad: {detail}"
    if not groups:
        raise ObjectUnavailable(f"object {object_id[:12]}: no good fragment ({given})")
    best = groups[0]
    needed = next(iter(best.values())).header.k
    raise ObjectUnavailable(
        f"object {object_id[:12]}: {len(best)} good fragment(s) of the {needed} needed "
        f"to rebuild it ({given})"
    )


def decode_fragments(
    hasher: ObjectHasher,
    object_id: str,
    fragments: Mapping[int, bytes],
    *,
    scheme: ErasureScheme | None = None,
    check: Callable[[bytes], object] | None = None,
) -> bytes:
    """The stored bytes of ``object_id`` from its fragments, by index (any subset).

    Every fragment is verified first (:func:`verify_fragment`); bad ones are ignored.
    Good fragments of one encoding (same K, N, size and cross-checksum) rebuild the
    object when there are at least K of them; data recovered from parity is checked
    against the cross-checksum too, so every returned byte is verified. With
    ``scheme``, fragments coded otherwise count as bad. ``check`` (for example the
    caller's id check) may raise :class:`CorruptObject` to reject a result; the next
    encoding, if any, is tried then.

    Raises :class:`ObjectUnavailable` when fewer than K good fragments of any one
    encoding are given, and :class:`CorruptObject` when enough were given but none
    decoded to an acceptable object; both messages name the bad indexes and why.
    """
    return _rebuild(hasher, object_id, fragments, scheme, check)[0]


def rebuild_fragment(
    hasher: ObjectHasher,
    scheme: ErasureScheme,
    object_id: str,
    fragments: Mapping[int, bytes],
    index: int,
) -> bytes:
    """Fragment ``index`` of ``object_id`` re-created from any K good ``fragments``
    (for repair), byte for byte what :func:`encode_fragments` made. Fragments not
    coded with ``scheme`` are ignored. Raises like :func:`decode_fragments`, and
    :class:`CorruptObject` if the re-created share does not match the
    cross-checksum (so a repair never writes something the writer did not)."""
    if not 0 <= index < scheme.n:
        raise ValueError(f"no fragment {index} in scheme {scheme}")
    _, group, shares = _rebuild(hasher, object_id, fragments, scheme, None)
    header = next(iter(group.values())).header
    share: bytes | memoryview
    if index in group:
        share = group[index].share
    elif index < scheme.k:
        share = shares[index]
    else:
        share = zfec.Encoder(scheme.k, scheme.n).encode(shares, [index])[0]
    if not hmac.compare_digest(
        _share_checksum(hasher, object_id, index, share), header.checksums[index]
    ):
        raise CorruptObject(
            f"{_what(object_id, index)}: re-created share does not match the cross-checksum"
        )
    rebuilt = FragmentHeader(
        header.k, header.n, index, header.size, header.share_length, header.checksums
    )
    return b"".join((rebuilt.to_bytes(hasher, object_id), share))


# ----------------------------------------------------------------------------- ranges


def systematic_ranges(
    layout: FragmentLayout | FragmentHeader, offset: int, length: int
) -> list[tuple[int, int, int]]:
    """Where bytes ``[offset, offset + length)`` of the coded object are in its
    systematic fragments: ``(fragment_index, offset_in_fragment_object, length)``
    in order (offsets include the header), at most one per data share the range
    touches; concatenating those ranges gives the requested bytes.

    For range-reading pack entries (each authenticated by the codec) straight from
    fragments 0..K-1 without decoding. A reader whose systematic fragment is
    missing, or whose entry fails its check, falls back to :func:`decode_fragments`
    from any K good fragments. A range beyond the object raises :class:`CorruptObject`
    (the layout, read from a backend, disagrees with the index).
    """
    if offset < 0 or length < 0:
        raise ValueError(f"negative range {offset}+{length}")
    size, share_len, hlen = layout.size, layout.share_length, layout.header_length
    if offset + length > size:
        raise CorruptObject(
            f"range {offset}+{length} lies beyond the coded object's {size} bytes"
        )
    ranges: list[tuple[int, int, int]] = []
    position, end = offset, offset + length
    while position < end:
        index = position // share_len
        start = position - index * share_len
        take = min(end - position, share_len - start)
        ranges.append((index, hlen + start, take))
        position += take
    return ranges
