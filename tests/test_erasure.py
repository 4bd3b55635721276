"""Erasure-coded objects (metasync.erasure, docs/FORMAT.md section 15).

Contracts checked: any K of the N fragments rebuild the exact stored bytes; a
fragment altered anywhere, moved to another position or taken from another object
is detected and ignored while K good ones remain; fewer than K fails with an error
naming the bad fragments; repair re-creates a fragment byte for byte; systematic
range reads give the object's bytes without decoding; nothing hostile makes the
decoder fail other than with CorruptObject / ObjectUnavailable, or return bytes the
writer did not encode.
"""

from __future__ import annotations

import itertools
import os
import random
import re
import struct
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from metasync.backends.base import check_key
from metasync.erasure import (
    DEFAULT_THRESHOLD,
    FRAGMENT_MAGIC,
    MAX_FRAGMENTS,
    ErasureScheme,
    FragmentHeader,
    FragmentLayout,
    decode_fragments,
    encode_fragments,
    header_length,
    rebuild_fragment,
    stored_bytes,
    systematic_ranges,
    use_erasure,
    verify_fragment,
    verify_header,
)
from metasync.errors import CorruptObject, MetasyncError, ObjectUnavailable, UsageError
from metasync.layout import fragment_key, parse_fragment_key
from metasync.objects import ObjectHasher

HASHERS = {"encrypted": ObjectHasher(bytes(range(32))), "plain": ObjectHasher(None)}
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
S23 = ErasureScheme(2, 3)


@pytest.fixture(params=sorted(HASHERS))
def hasher(request: pytest.FixtureRequest) -> ObjectHasher:
    return HASHERS[request.param]


def coded(
    hasher: ObjectHasher, scheme: ErasureScheme, data: bytes | memoryview
) -> tuple[str, list[bytes]]:
    """A pack-like object (named by the hash of its stored bytes) and its fragments."""
    object_id = hasher.id_of("pack", data)
    return object_id, encode_fragments(hasher, scheme, object_id, data)


def flip(data: bytes, position: int) -> bytes:
    changed = bytearray(data)
    changed[position] ^= 0x01
    return bytes(changed)


# ----------------------------------------------------------------------------- scheme


def test_scheme_parse_and_str() -> None:
    """K/N text becomes a scheme and prints back the same way."""
    assert ErasureScheme.parse("2/3") == ErasureScheme(2, 3)
    assert ErasureScheme.parse(" 3 / 5 ") == ErasureScheme(3, 5)
    assert ErasureScheme.parse("1/16") == ErasureScheme(1, 16)
    assert str(ErasureScheme(4, 6)) == "4/6"


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("", "not K/N"),
        ("2", "not K/N"),
        ("2/", "not K/N"),
        ("a/b", "not K/N"),
        ("-1/3", "not K/N"),
        ("1.5/3", "not K/N"),
        ("2/3/4", "not K/N"),
        ("0/3", "at least 1"),
        ("3/3", "less than N"),
        ("4/3", "less than N"),
        ("2/17", "at most 16"),
        ("999/999", "at most 16"),
    ],
)
def test_scheme_parse_rejects(text: str, words: str) -> None:
    """Bad schemes fail with one line naming the problem and an example."""
    with pytest.raises(UsageError, match=re.escape(words)) as info:
        ErasureScheme.parse(text)
    message = str(info.value)
    assert "\n" not in message and "erasure scheme" in message


def test_scheme_constructor_validates() -> None:
    with pytest.raises(UsageError):
        ErasureScheme(3, 3)
    with pytest.raises(UsageError):
        ErasureScheme(0, 2)


def test_use_erasure_threshold() -> None:
    """Objects below the threshold (1 MiB by default, Hybris) stay replicated."""
    assert DEFAULT_THRESHOLD == 1024 * 1024
    assert not use_erasure(None, 100 * DEFAULT_THRESHOLD)
    assert not use_erasure(S23, DEFAULT_THRESHOLD - 1)
    assert use_erasure(S23, DEFAULT_THRESHOLD)
    assert use_erasure(S23, 10, threshold=10) and not use_erasure(S23, 9, threshold=10)


def test_stored_bytes_matches_fragments_and_overhead() -> None:
    """stored_bytes is the total length of the fragments; 2/3 costs about 1.5x."""
    hasher = HASHERS["plain"]
    for scheme in (S23, ErasureScheme(3, 5), ErasureScheme(1, 2)):
        for size in (0, 1, 7, 1000):
            _, fragments = coded(hasher, scheme, os.urandom(size))
            assert stored_bytes(scheme, size) == sum(len(f) for f in fragments)
    size = 16 * 1024 * 1024
    assert 1.5 < stored_bytes(S23, size) / size < 1.5001
    assert header_length(3) == 152 and header_length(16) == 568


# ----------------------------------------------------------------------------- round trips

SCHEMES = [(1, 2), (2, 3), (3, 5), (4, 6), (10, 16), (15, 16)]


def sizes_for(k: int) -> list[int]:
    return sorted({0, 1, max(k - 1, 0), k, k + 1, 2 * k + 1, 4097, 1_000_003})


@pytest.mark.parametrize(("k", "n"), SCHEMES)
def test_round_trip_and_systematic(hasher: ObjectHasher, k: int, n: int) -> None:
    """All fragments, only the data fragments, or only the last K (as much parity
    as possible) give back the stored bytes; data shares are the padded object."""
    scheme = ErasureScheme(k, n)
    for size in [*sizes_for(k), 1024 * 1024]:
        data = os.urandom(size)
        object_id, fragments = coded(hasher, scheme, data)
        assert len(fragments) == n
        hlen = header_length(n)
        piece = -(-size // k)
        assert {len(f) for f in fragments} == {hlen + piece}
        padded = data + bytes(piece * k - size)
        for i in range(k):  # zfec is systematic: shares 0..K-1 are the data itself
            assert fragments[i][hlen:] == padded[i * piece : (i + 1) * piece]
        everything = dict(enumerate(fragments))
        assert decode_fragments(hasher, object_id, everything) == data
        tail = {i: fragments[i] for i in range(n - k, n)}
        assert decode_fragments(hasher, object_id, tail, scheme=scheme) == data


def test_round_trip_16_mib_from_parity(hasher: ObjectHasher) -> None:
    """A full-size pack rebuilds from a data fragment plus the parity fragment."""
    data = random.Random(7).randbytes(16 * 1024 * 1024)
    object_id, fragments = coded(hasher, S23, memoryview(data))
    assert decode_fragments(hasher, object_id, {1: fragments[1], 2: fragments[2]}) == data
    assert decode_fragments(hasher, object_id, {0: fragments[0], 2: fragments[2]}) == data


@pytest.mark.parametrize(("k", "n"), [(1, 2), (1, 3), (2, 3), (2, 4), (3, 5), (3, 6)])
def test_any_k_of_n(k: int, n: int) -> None:
    """Every subset of at least K fragments rebuilds the object; every smaller one
    fails as unavailable."""
    hasher = HASHERS["encrypted"]
    data = os.urandom(1001)
    object_id, fragments = coded(hasher, ErasureScheme(k, n), data)
    for count in range(n + 1):
        for subset in itertools.combinations(range(n), count):
            given = {i: fragments[i] for i in subset}
            if count >= k:
                assert decode_fragments(hasher, object_id, given) == data
            else:
                with pytest.raises(ObjectUnavailable):
                    decode_fragments(hasher, object_id, given)


# ----------------------------------------------------------------------------- corruption


@pytest.mark.parametrize(("k", "n"), [(2, 3), (3, 5)])
def test_every_flipped_byte_is_detected(hasher: ObjectHasher, k: int, n: int) -> None:
    """A bit flipped in any byte of any fragment (header, cross-checksum, MAC or
    share) fails verify_fragment, and decoding ignores that fragment."""
    data = os.urandom(50)
    object_id, fragments = coded(hasher, ErasureScheme(k, n), data)
    for index, fragment in enumerate(fragments):
        for position in range(len(fragment)):
            bad = flip(fragment, position)
            with pytest.raises(CorruptObject):
                verify_fragment(hasher, object_id, index, bad)
            given = dict(enumerate(fragments))
            given[index] = bad
            assert decode_fragments(hasher, object_id, given) == data
            # With the one bad fragment among exactly K, nothing is returned.
            others = [j for j in range(n) if j != index][: k - 1]
            only_k = {index: bad} | {j: fragments[j] for j in others}
            with pytest.raises(ObjectUnavailable, match=rf"\b{index}: "):
                decode_fragments(hasher, object_id, only_k)


def test_truncated_or_extended_fragments_are_detected(hasher: ObjectHasher) -> None:
    data = os.urandom(300)
    object_id, fragments = coded(hasher, S23, data)
    for index, fragment in enumerate(fragments):
        for bad in (fragment[:-1], fragment + b"\x00", fragment[:100], b"", fragment[:24]):
            with pytest.raises(CorruptObject):
                verify_fragment(hasher, object_id, index, bad)
    assert decode_fragments(hasher, object_id, {0: fragments[0][:-1], 1: fragments[1],
                                                2: fragments[2]}) == data


def test_fragments_swapped_between_positions_are_detected(hasher: ObjectHasher) -> None:
    """A fragment stored in another fragment's place (or with another's share) is bad."""
    data = os.urandom(999)
    object_id, fragments = coded(hasher, ErasureScheme(2, 4), data)
    with pytest.raises(CorruptObject, match="is fragment 1, stored in the place of 0"):
        verify_fragment(hasher, object_id, 0, fragments[1])
    hlen = header_length(4)
    mixed = fragments[0][:hlen] + fragments[1][hlen:]  # header of 0, share of 1
    with pytest.raises(CorruptObject, match="share does not match"):
        verify_fragment(hasher, object_id, 0, mixed)
    swapped = {0: fragments[1], 1: fragments[0], 2: fragments[2], 3: fragments[3]}
    assert decode_fragments(hasher, object_id, swapped) == data
    with pytest.raises(ObjectUnavailable) as info:
        decode_fragments(hasher, object_id, {0: fragments[1], 1: fragments[0], 2: fragments[2]})
    assert "0: is fragment 1" in str(info.value) and "1: is fragment 0" in str(info.value)


def test_fragments_of_another_object_are_detected(hasher: ObjectHasher) -> None:
    """Fragments of object B offered as A's fail (header MAC and share checksum
    name the object), even when sizes agree."""
    a, b = os.urandom(500), os.urandom(500)
    id_a, frags_a = coded(hasher, S23, a)
    id_b, frags_b = coded(hasher, S23, b)
    for index in range(3):
        with pytest.raises(CorruptObject, match="MAC"):
            verify_fragment(hasher, id_a, index, frags_b[index])
    hlen = header_length(3)
    transplanted = frags_a[0][:hlen] + frags_b[0][hlen:]
    with pytest.raises(CorruptObject, match="share does not match"):
        verify_fragment(hasher, id_a, 0, transplanted)
    assert decode_fragments(hasher, id_a, {0: frags_b[0], 1: frags_a[1], 2: frags_a[2]}) == a
    with pytest.raises(ObjectUnavailable):
        decode_fragments(hasher, id_a, {0: frags_b[0], 1: frags_b[1], 2: frags_a[2]})
    assert id_a != id_b


def test_keyed_fragments_cannot_be_forged_without_the_key() -> None:
    """With encryption on, fragments made under another key (a backend's forgery,
    even with the right layout) are all rejected."""
    owner, forger = HASHERS["encrypted"], ObjectHasher(bytes(32))
    data = os.urandom(200)
    object_id, _ = coded(owner, S23, data)
    forged = encode_fragments(forger, S23, object_id, os.urandom(200))
    with pytest.raises(ObjectUnavailable, match="no good fragment"):
        decode_fragments(owner, object_id, dict(enumerate(forged)))


def test_check_rejects_a_consistent_forgery_and_next_encoding_is_tried() -> None:
    """Unkeyed checksums only detect accidents: K fragments forged consistently for
    other data verify. The caller's ``check`` (its id check) rejects that result;
    decoding then tries the other encoding present, or fails as corrupt."""
    hasher = HASHERS["plain"]
    data = os.urandom(400)
    object_id, fragments = coded(hasher, ErasureScheme(2, 4), data)
    forged = encode_fragments(hasher, ErasureScheme(2, 4), object_id, os.urandom(400))

    def check(result: bytes) -> None:
        if hasher.id_of("pack", result) != object_id:
            raise CorruptObject("content does not match its id")

    mixture = {0: forged[0], 1: forged[1], 2: fragments[2], 3: fragments[3]}
    assert decode_fragments(hasher, object_id, mixture, check=check) == data
    three_forged = {0: forged[0], 1: forged[1], 2: forged[2], 3: fragments[3]}
    assert decode_fragments(hasher, object_id, three_forged) != data  # why check exists
    with pytest.raises(CorruptObject, match="does not match its id"):
        decode_fragments(hasher, object_id, three_forged, check=check)


def test_inconsistent_parity_is_caught_by_the_cross_checksum() -> None:
    """A writer's parity that does not match its data (a buggy or hostile key holder)
    is detected when data is recovered from it, not returned."""
    hasher = HASHERS["encrypted"]
    data = os.urandom(64)
    object_id, fragments = coded(hasher, S23, data)
    header = verify_fragment(hasher, object_id, 2, fragments[2])
    bogus_share = os.urandom(header.share_length)
    checksums = list(header.checksums)
    # Re-sign all three headers with a cross-checksum naming the bogus parity share.
    h = hasher.new("share")
    h.update(bytes.fromhex(object_id) + bytes((2,)) + bogus_share)
    checksums[2] = h.digest()
    rewritten = []
    for index, fragment in enumerate(fragments):
        share = bogus_share if index == 2 else fragment[header.header_length :]
        head = FragmentHeader(2, 3, index, header.size, header.share_length, tuple(checksums))
        rewritten.append(head.to_bytes(hasher, object_id) + share)
    assert decode_fragments(hasher, object_id, {0: rewritten[0], 1: rewritten[1]}) == data
    with pytest.raises(CorruptObject, match="does not match their cross-checksum"):
        decode_fragments(hasher, object_id, {0: rewritten[0], 2: rewritten[2]})
    with pytest.raises(CorruptObject, match="re-created share"):
        rebuild_fragment(hasher, S23, object_id, {0: rewritten[0], 1: rewritten[1]}, 2)


def test_fewer_than_k_good_fragments_says_which_and_why(hasher: ObjectHasher) -> None:
    data = os.urandom(100)
    object_id, fragments = coded(hasher, ErasureScheme(3, 5), data)
    given = {0: flip(fragments[0], 240), 1: fragments[1], 2: fragments[2][:10]}
    with pytest.raises(ObjectUnavailable) as info:
        decode_fragments(hasher, object_id, given)
    message = str(info.value)
    assert object_id[:12] in message and "1 good fragment(s) of the 3 needed" in message
    assert "0: share does not match its checksum" in message
    assert "2: too short" in message and "\n" not in message
    with pytest.raises(ObjectUnavailable, match="no good fragment"):
        decode_fragments(hasher, object_id, {})


def test_expected_scheme_excludes_other_codings(hasher: ObjectHasher) -> None:
    data = os.urandom(100)
    object_id, fragments = coded(hasher, S23, data)
    with pytest.raises(ObjectUnavailable, match="coded 2/3, expected 3/5"):
        decode_fragments(hasher, object_id, dict(enumerate(fragments)), scheme=ErasureScheme(3, 5))


# ----------------------------------------------------------------------------- repair


@pytest.mark.parametrize(("k", "n"), [(1, 3), (2, 3), (3, 5), (2, 6)])
def test_rebuild_fragment_is_byte_identical(hasher: ObjectHasher, k: int, n: int) -> None:
    """Any fragment re-created from any K others equals what encode produced, also
    when the damaged copy is among the inputs."""
    scheme = ErasureScheme(k, n)
    for size in (0, 1, 2 * k + 1, 3000):
        data = os.urandom(size)
        object_id, fragments = coded(hasher, scheme, data)
        for index in range(n):
            others = [i for i in range(n) if i != index]
            for subset in itertools.combinations(others, k):
                given = {i: fragments[i] for i in subset}
                given[index] = flip(fragments[index], len(fragments[index]) - 1)
                assert rebuild_fragment(hasher, scheme, object_id, given, index) == fragments[index]


def test_rebuild_fragment_errors(hasher: ObjectHasher) -> None:
    data = os.urandom(100)
    object_id, fragments = coded(hasher, S23, data)
    with pytest.raises(ValueError):
        rebuild_fragment(hasher, S23, object_id, dict(enumerate(fragments)), 3)
    with pytest.raises(ObjectUnavailable):
        rebuild_fragment(hasher, S23, object_id, {0: fragments[0]}, 1)
    with pytest.raises(ObjectUnavailable, match="expected 2/4"):
        rebuild_fragment(hasher, ErasureScheme(2, 4), object_id, dict(enumerate(fragments)), 3)


# ----------------------------------------------------------------------------- ranges


@FUZZ
@given(
    scheme=st.sampled_from([ErasureScheme(k, n) for k, n in SCHEMES]),
    data=st.binary(max_size=3000),
    cut=st.tuples(st.floats(0, 1), st.floats(0, 1)),
)
def test_systematic_ranges_reproduce_any_range(
    scheme: ErasureScheme, data: bytes, cut: tuple[float, float]
) -> None:
    """Bytes read at the ranges systematic_ranges names, from the data fragments
    only, concatenate to the requested range of the object."""
    hasher = HASHERS["encrypted"]
    object_id, fragments = coded(hasher, scheme, data)
    offset = int(cut[0] * len(data))
    length = int(cut[1] * (len(data) - offset))
    header = verify_header(hasher, object_id, 0, fragments[0][: header_length(scheme.n)])
    ranges = systematic_ranges(header, offset, length)
    assert ranges == systematic_ranges(FragmentLayout(scheme, len(data)), offset, length)
    assert all(0 <= index < scheme.k and size > 0 for index, _, size in ranges)
    assert len(ranges) <= scheme.k
    got = b"".join(fragments[i][start : start + size] for i, start, size in ranges)
    assert got == data[offset : offset + length]


def test_systematic_ranges_bounds() -> None:
    layout = FragmentLayout(S23, 10)
    assert systematic_ranges(layout, 10, 0) == []
    assert systematic_ranges(layout, 0, 10) == [(0, 152, 5), (1, 152, 5)]
    assert systematic_ranges(FragmentLayout(S23, 0), 0, 0) == []
    with pytest.raises(CorruptObject, match="beyond"):
        systematic_ranges(layout, 5, 6)
    with pytest.raises(ValueError):
        systematic_ranges(layout, -1, 1)


def test_verify_header_alone_for_range_readers(hasher: ObjectHasher) -> None:
    """A range read of just the header verifies and gives the layout; the header of
    another position or object, or a short read, does not."""
    data = os.urandom(5000)
    object_id, fragments = coded(hasher, ErasureScheme(3, 5), data)
    hlen = header_length(5)
    header = verify_header(hasher, object_id, 0, fragments[0][:hlen])
    assert header == verify_fragment(hasher, object_id, 0, fragments[0])
    assert header.layout == FragmentLayout(ErasureScheme(3, 5), 5000)
    with pytest.raises(CorruptObject, match="too short"):
        verify_header(hasher, object_id, 0, fragments[0][: hlen - 1])
    with pytest.raises(CorruptObject):
        verify_header(hasher, object_id, 1, fragments[0][:hlen])


# ----------------------------------------------------------------------------- keys


def test_fragment_keys_round_trip() -> None:
    stored_id = HASHERS["plain"].id_of("pack", b"x")
    for index in range(MAX_FRAGMENTS):
        key = fragment_key(stored_id, index)
        assert key == f"objects/{stored_id[:2]}/{stored_id}.f{index}"
        assert check_key(key) == key
        assert parse_fragment_key(key) == (stored_id, index)
    other = "ff" if stored_id[:2] != "ff" else "00"
    for bad in (
        f"objects/{stored_id[:2]}/{stored_id}",
        f"objects/{other}/{stored_id}.f0",
        f"objects/{stored_id[:2]}/{stored_id}.f16",
        f"objects/{stored_id[:2]}/{stored_id}.f01",
        f"objects/{stored_id[:2]}/{stored_id}.f-1",
        f"objects/{stored_id[:2]}/{stored_id}.f1.tmp",
        f"objects/{stored_id[:2]}/{stored_id.upper()}.f1",
        f"x/objects/{stored_id[:2]}/{stored_id}.f1",
        f"objects/{stored_id[:2]}/{stored_id[:-1]}.f1",
    ):
        assert parse_fragment_key(bad) is None, bad
    with pytest.raises(ValueError):
        fragment_key(stored_id, 16)
    with pytest.raises(ValueError):
        fragment_key("../etc", 0)


# ----------------------------------------------------------------------------- hostile input


def raw_header(
    hasher: ObjectHasher, object_id: str, fields: tuple[bytes, int, int, int, int, int, int],
    checksums: int,
) -> bytes:
    """A header with arbitrary fields but a correct MAC (as a key holder, or anyone
    in a plain repository, could write), so the structural checks are what is tested."""
    body = struct.pack(">4sBBBBQQ", *fields) + os.urandom(32 * checksums)
    h = hasher.new("fraghdr")
    h.update(bytes.fromhex(object_id) + body)
    return body + h.digest()


# Mostly plausible values, so that every check, not only the first, meets hostile input.
small_or_any = st.one_of(st.integers(0, 16), st.integers(0, 16), st.integers(0, 255))


@FUZZ
@given(
    k=small_or_any,
    n=small_or_any,
    index=small_or_any,
    reserved=st.sampled_from([0] * 8 + [1, 255]),
    size=st.one_of(st.integers(0, 300), st.integers(0, 2**64 - 1)),
    share_len=st.one_of(st.integers(0, 300), st.integers(0, 2**64 - 1)),
    honest=st.booleans(),
    tail=st.binary(max_size=200),
    magic=st.sampled_from([FRAGMENT_MAGIC] * 8 + [b"MSF2", b"\x00\x00\x00\x00"]),
)
def test_hostile_headers_only_raise_corrupt_object(
    k: int, n: int, index: int, reserved: int, size: int, share_len: int,
    honest: bool, tail: bytes, magic: bytes,
) -> None:
    """Absurd K, N, index, sizes or lengths in a correctly MAC'd header are refused
    with CorruptObject; decoding them fails cleanly. ``honest`` makes the lengths
    agree, so the checks after them are reached too."""
    hasher = HASHERS["plain"]
    object_id = hasher.id_of("pack", b"victim")
    checksums = min(n, MAX_FRAGMENTS + 4)
    if honest and k >= 1:
        share_len = -(-size // k)
        tail = os.urandom(min(share_len, 1000))
    data = raw_header(hasher, object_id, (magic, k, n, index, reserved, size, share_len),
                      checksums) + tail
    with pytest.raises(CorruptObject):
        verify_fragment(hasher, object_id, index, data)
    with pytest.raises((CorruptObject, ObjectUnavailable)):
        decode_fragments(hasher, object_id, {index: data, (index + 1) % 256: data})


_FIELDS = ("magic", "k", "n", "index", "reserved", "size", "share_len")
_WIDTHS = {"magic": 32, "k": 8, "n": 8, "index": 8, "reserved": 8, "size": 64, "share_len": 64}


@FUZZ
@given(
    field=st.sampled_from(_FIELDS),
    value=st.one_of(st.integers(0, 20), st.integers(0, 2**64 - 1)),
    resize=st.integers(-40, 40),
)
def test_one_hostile_field_in_a_signed_header(field: str, value: int, resize: int) -> None:
    """A real fragment with one header field replaced and the MAC recomputed (what a
    key holder, or anyone in a plain repository, could write), its share cut or
    extended: refused with CorruptObject unless it is the original; decoding with
    it and one good fragment gives the object or fails cleanly."""
    hasher = HASHERS["plain"]
    data = os.urandom(100)
    object_id, fragments = coded(hasher, S23, data)
    fields = list(struct.unpack_from(">4sBBBBQQ", fragments[0]))
    position = _FIELDS.index(field)
    value %= 2 ** _WIDTHS[field]
    fields[position] = value.to_bytes(4, "big") if field == "magic" else value
    checksums = fragments[0][24:120]
    body = struct.pack(">4sBBBBQQ", *fields) + checksums
    h = hasher.new("fraghdr")
    h.update(bytes.fromhex(object_id) + body)
    share = fragments[0][152:]
    share = share[: len(share) + resize] if resize < 0 else share + os.urandom(resize)
    mutated = body + h.digest() + share
    if mutated == fragments[0]:
        assert verify_fragment(hasher, object_id, 0, mutated).index == 0
    else:
        with pytest.raises(CorruptObject):
            verify_fragment(hasher, object_id, 0, mutated)
    try:
        result = decode_fragments(hasher, object_id, {0: mutated, 2: fragments[2]})
    except MetasyncError as exc:
        assert isinstance(exc, CorruptObject | ObjectUnavailable)
    else:
        assert result == data


@FUZZ
@given(st.dictionaries(st.integers(-2, 300), st.binary(max_size=600), max_size=6))
def test_decode_fuzz_random_bytes(fragments: dict[int, bytes]) -> None:
    """Random bytes are never decoded into anything."""
    for hasher in HASHERS.values():
        with pytest.raises((CorruptObject, ObjectUnavailable)):
            decode_fragments(hasher, "ab" * 32, fragments)


@FUZZ
@given(
    scheme=st.sampled_from([ErasureScheme(1, 2), S23, ErasureScheme(3, 5)]),
    data=st.binary(max_size=500),
    edits=st.lists(
        st.tuples(st.integers(0, 4), st.integers(0, 10_000), st.integers(0, 255)), max_size=6
    ),
    drop=st.sets(st.integers(0, 4)),
)
def test_decode_fuzz_mutated_fragments(
    scheme: ErasureScheme,
    data: bytes,
    edits: list[tuple[int, int, int]],
    drop: set[int],
) -> None:
    """Genuine fragments, some dropped, overwritten or truncated anywhere: decoding
    returns exactly the original or fails with CorruptObject / ObjectUnavailable."""
    for hasher in HASHERS.values():
        object_id, fragments = coded(hasher, scheme, data)
        given = {i: bytearray(f) for i, f in enumerate(fragments) if i not in drop}
        for which, position, value in edits:
            target = given.get(which)
            if target:
                if value == 0:
                    del target[position % len(target):]
                else:
                    target[position % len(target)] = value
        try:
            result = decode_fragments(hasher, object_id, {i: bytes(f) for i, f in given.items()})
        except MetasyncError as exc:
            assert isinstance(exc, CorruptObject | ObjectUnavailable)
        else:
            assert result == data


# ----------------------------------------------------------------------------- the document


def test_format_document_test_vector() -> None:
    """The worked example in docs/FORMAT.md section 15 is what the code writes."""
    doc = (Path(__file__).parent.parent / "docs" / "FORMAT.md").read_text()
    section = doc[doc.index("Erasure-coded fragments") :]
    hasher = ObjectHasher(None)
    object_id, fragments = coded(hasher, S23, b"hello world\n")
    assert object_id in section
    for fragment in fragments:
        header = verify_fragment(hasher, object_id, fragments.index(fragment), fragment)
        assert fragment[:24].hex(" ") in section
        assert fragment[header.header_length :].hex(" ") in section
        assert fragment[-38:-6].hex() in section  # the MAC
    for checksum in header.checksums:
        assert checksum.hex() in section


def _gf256() -> tuple[list[int], list[int]]:
    exp, log = [0] * 510, [0] * 256
    x = 1
    for i in range(255):
        exp[i], log[x] = x, i
        x <<= 1
        if x & 0x100:
            x ^= 0x11D
    exp[255:510] = exp[0:255]
    return exp, log


def _code_matrix(k: int, n: int) -> list[list[int]]:
    """The encoding matrix exactly as docs/FORMAT.md section 15 defines it."""
    exp, log = _gf256()

    def mul(a: int, b: int) -> int:
        return 0 if a == 0 or b == 0 else exp[log[a] + log[b]]

    def inv(a: int) -> int:
        return exp[255 - log[a]]

    vdm = [[1] + [0] * (k - 1)] + [[exp[(r - 1) * c % 255] for c in range(k)] for r in range(1, n)]
    # Invert the top K x K block by Gauss-Jordan elimination over GF(2^8).
    top = [row[:] + [int(i == j) for j in range(k)] for i, row in enumerate(vdm[:k])]
    for col in range(k):
        pivot = next(r for r in range(col, k) if top[r][col])
        top[col], top[pivot] = top[pivot], top[col]
        scale = inv(top[col][col])
        top[col] = [mul(scale, v) for v in top[col]]
        for r in range(k):
            if r != col and top[r][col]:
                factor = top[r][col]
                top[r] = [v ^ mul(factor, p) for v, p in zip(top[r], top[col], strict=True)]
    inverse = [row[k:] for row in top]
    matrix = []
    for row in vdm:
        out = [0] * k
        for c in range(k):
            for j in range(k):
                out[c] ^= mul(row[j], inverse[j][c])
        matrix.append(out)
    return matrix


@pytest.mark.parametrize(("k", "n"), [(1, 2), (2, 3), (3, 5), (4, 7), (5, 16)])
def test_code_matches_the_documented_matrix(k: int, n: int) -> None:
    """zfec's shares are the documented systematic Vandermonde code over GF(2^8)
    (polynomial 0x11D), so another implementation can write compatible fragments."""
    exp, log = _gf256()
    matrix = _code_matrix(k, n)
    assert matrix[:k] == [[int(i == j) for j in range(k)] for i in range(k)]
    data = os.urandom(7 * k)
    _, fragments = coded(HASHERS["plain"], ErasureScheme(k, n), data)
    hlen = header_length(n)
    pieces = [data[i * 7 : (i + 1) * 7] for i in range(k)]
    for row, fragment in zip(matrix, fragments, strict=True):
        expected = bytearray(7)
        for c, coefficient in enumerate(row):
            for t in range(7):
                if coefficient and pieces[c][t]:
                    expected[t] ^= exp[log[coefficient] + log[pieces[c][t]]]
        assert fragment[hlen:] == bytes(expected)
