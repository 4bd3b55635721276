"""Packs: many small encoded objects in one backend object, with a trailer.

Each entry is encoded on its own so a range read of ``(offset, length)`` can be
decoded and verified alone; a pack is named by the hash of its stored bytes.
"""

from __future__ import annotations

import os
import random
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from metasync.codec import _TRAILER, PACK_MAGIC, Codec, FinishedPack, PackBuilder
from metasync.errors import CorruptObject
from metasync.keys import MasterKey
from metasync.objects import Tree, TreeEntry, canonical_json

KEY = MasterKey(bytes(range(32, 64)))
CODECS = {"encrypted": Codec(KEY), "plain": Codec(None)}


@pytest.fixture(params=sorted(CODECS))
def codec(request: pytest.FixtureRequest) -> Codec:
    return CODECS[request.param]


def sample_objects(codec: Codec) -> list[tuple[str, str, bytes]]:
    """Blobs (empty, small, compressible, random), a file object and a tree."""
    blobs = [b"", b"x", b"abc" * 1000, os.urandom(5000)]
    objs = [("blob", codec.id_of("blob", b), b) for b in blobs]
    tree = Tree.build([TreeEntry("f", "file", objs[1][1], 1)]).to_bytes()
    objs.append(("tree", codec.id_of("tree", tree), tree))
    file_bytes = canonical_json({"size": 0, "chunks": []})
    objs.append(("file", codec.id_of("file", file_bytes), file_bytes))
    return objs


def build_pack(codec: Codec, objs: list[tuple[str, str, bytes]]) -> FinishedPack:
    builder = PackBuilder(codec)
    for kind, object_id, data in objs:
        assert builder.add(kind, object_id, data) is None
    pack = builder.flush()
    assert pack is not None
    return pack


def test_entries_decode_individually(codec: Codec) -> None:
    """Every entry of a pack decodes alone from its (offset, length) slice to the
    plaintext it was added with; the entries are contiguous from offset 0."""
    objs = sample_objects(codec)
    pack = build_pack(codec, objs)
    assert [(e.kind, e.object_id) for e in pack.entries] == [(k, i) for k, i, _ in objs]
    expected_offset = 0
    for entry, (kind, object_id, data) in zip(pack.entries, objs, strict=True):
        assert entry.offset == expected_offset
        piece = pack.data[entry.offset : entry.offset + entry.length]
        assert codec.decode(kind, object_id, piece) == data
        expected_offset += entry.length
    assert pack.blobs == 4


def test_entry_slices_are_not_interchangeable(codec: Codec) -> None:
    """A slice decoded as another entry fails: a backend's range answer for one
    object cannot stand in for another."""
    objs = sample_objects(codec)
    pack = build_pack(codec, objs)
    first, second = pack.entries[1], pack.entries[2]
    piece = pack.data[first.offset : first.offset + first.length]
    with pytest.raises(CorruptObject):
        codec.decode(second.kind, second.object_id, piece)


def test_pack_id_is_hash_of_stored_bytes(codec: Codec) -> None:
    """The pack id is id_of('pack', stored bytes); check_pack accepts exactly that."""
    pack = build_pack(codec, sample_objects(codec))
    assert pack.pack_id == codec.id_of("pack", pack.data)
    codec.check_pack(pack.pack_id, pack.data)
    with pytest.raises(CorruptObject):
        codec.check_pack(pack.pack_id, pack.data + b"\x00")
    with pytest.raises(CorruptObject):
        codec.check_pack("0" * 64, pack.data)


def test_pack_entries_reads_the_trailer(codec: Codec) -> None:
    """Codec.pack_entries recovers exactly the entries the builder recorded."""
    pack = build_pack(codec, sample_objects(codec))
    assert codec.pack_entries(pack.pack_id, pack.data) == pack.entries
    header_len, magic = _TRAILER.unpack_from(pack.data, len(pack.data) - _TRAILER.size)
    assert magic == PACK_MAGIC
    last = pack.entries[-1]
    assert last.offset + last.length + header_len + _TRAILER.size == len(pack.data)


def test_encrypted_pack_hides_plaintext() -> None:
    """With encryption, neither contents nor object ids appear in the pack bytes."""
    codec = CODECS["encrypted"]
    secret = b"confidential-marker " * 20
    object_id = codec.id_of("blob", secret)
    pack = build_pack(codec, [("blob", object_id, secret)])
    assert b"confidential" not in pack.data
    assert object_id.encode() not in pack.data


def test_flipping_any_byte_is_detected(codec: Codec) -> None:
    """Flipping any byte anywhere in a pack (entries, header or trailer) makes
    pack_entries raise CorruptObject."""
    objs = sample_objects(codec)[:3] + sample_objects(codec)[4:]  # keep the pack small
    pack = build_pack(codec, objs)
    assert len(pack.data) < 1000
    for i in range(len(pack.data)):
        bad = bytearray(pack.data)
        bad[i] ^= 0x01
        with pytest.raises(CorruptObject):
            codec.pack_entries(pack.pack_id, bytes(bad))
    for bad_bytes in (pack.data[:-1], pack.data[1:], b"", pack.data + b"\x00"):
        with pytest.raises(CorruptObject):
            codec.pack_entries(pack.pack_id, bad_bytes)


def _self_named(codec: Codec, data: bytes) -> tuple[str, bytes]:
    """A pack a hostile writer names by its own hash, so check_pack passes."""
    return codec.id_of("pack", data), data


def test_hostile_but_self_consistent_packs_are_rejected(codec: Codec) -> None:
    """Bytes whose hash matches the pack id but whose trailer or header is bad
    (wrong magic, header length past the start, undecodable or non-list header,
    bad entries) raise CorruptObject."""
    good_header = codec.encode(
        "packheader", "pack", canonical_json([["a" * 64, "blob", 0, 1]])
    )
    bad_cases = [
        b"",
        b"abc",
        _TRAILER.pack(0, b"XXXX"),
        _TRAILER.pack(10, PACK_MAGIC),
        _TRAILER.pack(2**32 - 1, PACK_MAGIC),
        b"junk" + _TRAILER.pack(4, PACK_MAGIC),
        codec.encode("packheader", "pack", b"{}") + _TRAILER.pack(0, PACK_MAGIC),
    ]
    for header in (b"{}", b"not json", b"[" * 50_000, canonical_json([["a" * 64, "commit", 0, 1]])):
        encoded = codec.encode("packheader", "pack", header)
        bad_cases.append(encoded + _TRAILER.pack(len(encoded), PACK_MAGIC))
    # a header encoded for another label (moved from elsewhere) only fails when encrypted
    moved = codec.encode("packheader", "other", canonical_json([]))
    if codec.encrypted:
        bad_cases.append(moved + _TRAILER.pack(len(moved), PACK_MAGIC))
    for data in bad_cases:
        pack_id, data = _self_named(codec, data)
        with pytest.raises(CorruptObject):
            codec.pack_entries(pack_id, data)
    # sanity: the same construction with a good header is accepted
    pack_id, data = _self_named(codec, b"x" + good_header + _TRAILER.pack(len(good_header), PACK_MAGIC))
    assert len(codec.pack_entries(pack_id, data)) == 1


@settings(max_examples=100, deadline=None)
@given(body=st.binary(max_size=200), header_len=st.integers(0, 300), magic=st.sampled_from([PACK_MAGIC, b"MSP0"]))
def test_pack_entries_fuzz(body: bytes, header_len: int, magic: bytes) -> None:
    """Random self-named packs only ever raise CorruptObject (or parse)."""
    codec = CODECS["plain"]
    data = body + _TRAILER.pack(header_len, magic)
    try:
        codec.pack_entries(codec.id_of("pack", data), data)
    except CorruptObject:
        pass


@settings(max_examples=25, deadline=None)
@given(sizes=st.lists(st.integers(0, 3000), min_size=1, max_size=30), target=st.integers(1, 8000))
def test_packs_close_at_target_size(sizes: list[int], target: int) -> None:
    """add() returns a closed pack exactly when the stored entry bytes reach
    target_size; the next pack starts again at offset 0; flush() returns the rest
    (None if empty). Every object ends up in exactly one pack."""
    codec = CODECS["plain"]
    builder = PackBuilder(codec, target_size=target)
    packs: list[FinishedPack] = []
    pending = 0
    for n, size in enumerate(sizes):
        data = n.to_bytes(4, "big") + random.Random(n).randbytes(size)  # incompressible, distinct
        object_id = codec.id_of("blob", data)
        stored = len(codec.encode("blob", object_id, data))
        pending += stored
        closed = builder.add("blob", object_id, data)
        if pending >= target:
            assert closed is not None
            entry_bytes = sum(e.length for e in closed.entries)
            assert entry_bytes == pending
            assert entry_bytes - closed.entries[-1].length < target
            assert closed.entries[0].offset == 0
            packs.append(closed)
            pending = 0
        else:
            assert closed is None
    rest = builder.flush()
    if pending:
        assert rest is not None
        packs.append(rest)
    else:
        assert rest is None
    assert builder.flush() is None
    ids = [e.object_id for p in packs for e in p.entries]
    assert len(ids) == len(sizes) == len(set(ids))
    for p in packs:
        assert codec.pack_entries(p.pack_id, p.data) == p.entries


def test_concurrent_adds() -> None:
    """Adds from several threads all land in some pack with contiguous offsets,
    and every entry still decodes."""
    codec = CODECS["encrypted"]
    builder = PackBuilder(codec, target_size=20_000)
    packs: list[FinishedPack] = []
    lock = threading.Lock()
    added: dict[str, bytes] = {}

    def worker(n: int) -> None:
        for i in range(50):
            data = f"{n}-{i}".encode() * (i + 1)
            object_id = codec.id_of("blob", data)
            with lock:
                added[object_id] = data
            closed = builder.add("blob", object_id, data)
            if closed is not None:
                with lock:
                    packs.append(closed)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    last = builder.flush()
    if last is not None:
        packs.append(last)
    seen = set()
    for p in packs:
        offset = 0
        for e in p.entries:
            assert e.offset == offset
            offset += e.length
            assert codec.decode("blob", e.object_id, p.data[e.offset : e.offset + e.length]) == added[e.object_id]
            seen.add(e.object_id)
        assert codec.pack_entries(p.pack_id, p.data) == p.entries
    assert seen == set(added)
