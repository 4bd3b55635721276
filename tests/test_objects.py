"""The object model: canonical serialization, deterministic ids, hostile input.

Every ``from_bytes`` reads bytes a backend returned, so besides round trips these
tests check that any input is either parsed into an object that re-serializes to
itself, or refused with :class:`CorruptObject` (never another exception).
"""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from metasync.errors import CorruptObject, FormatError
from metasync.objects import (
    ENTRY_TYPES,
    FORMAT_VERSION,
    BackendSpec,
    Chunk,
    Commit,
    Config,
    FileObject,
    Index,
    ObjectHasher,
    PackEntry,
    Tree,
    TreeEntry,
    Version,
    canonical_json,
    check_name,
    is_object_id,
)
from metasync.retention import Policy

FUZZ = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
ROUND = settings(max_examples=50, deadline=None)

A = "a" * 64
B = "b" * 64
C = "c" * 64

# ----------------------------------------------------------------------------- strategies

ids = st.binary(min_size=32, max_size=32).map(bytes.hex)
#: Any text, lone surrogates included (commit messages, device names, URIs).
any_text = st.text(st.characters(exclude_categories=()), max_size=20)
sizes = st.integers(min_value=0, max_value=2**63)

_RESERVED = {"", ".", "..", ".metasync"}


def _is_safe_name(name: str) -> bool:
    return name not in _RESERVED and "/" not in name and "\x00" not in name


#: File names as a POSIX system hands them to Python: unicode text, or arbitrary
#: bytes decoded with surrogate escapes (os.fsdecode) when they are not UTF-8.
names = st.one_of(
    st.text(min_size=1, max_size=12),
    st.binary(min_size=1, max_size=12).map(os.fsdecode),
).filter(_is_safe_name)

link_targets = st.one_of(
    st.text(min_size=1, max_size=30),
    st.binary(min_size=1, max_size=30).map(os.fsdecode),
).filter(lambda t: "\x00" not in t)


@st.composite
def tree_entries(draw: st.DrawFn, name: str) -> TreeEntry:
    etype = draw(st.sampled_from(ENTRY_TYPES))
    ref = draw(link_targets if etype == "link" else ids)
    executable = etype in ("file", "chunked") and draw(st.booleans())
    return TreeEntry(name, etype, ref, draw(sizes), executable)


@st.composite
def trees(draw: st.DrawFn) -> Tree:
    entry_names = draw(st.lists(names, max_size=8, unique_by=os.fsencode))
    return Tree.build([draw(tree_entries(n)) for n in entry_names])


@st.composite
def file_objects(draw: st.DrawFn) -> FileObject:
    lengths = draw(st.lists(st.integers(min_value=0, max_value=2**40), min_size=1, max_size=8))
    chunks, offset = [], 0
    for length in lengths:
        chunks.append(Chunk(draw(ids), offset, length))
        offset += length
    return FileObject(offset, tuple(chunks))


commits = st.builds(
    Commit,
    tree=ids,
    parents=st.lists(ids, max_size=3).map(tuple),
    client=any_text,
    device=any_text,
    time_ns=sizes,
    message=st.text(st.characters(exclude_categories=()), max_size=200),
    indexes=st.lists(ids, max_size=3).map(tuple),
)

pack_entries = st.builds(
    PackEntry,
    object_id=ids,
    kind=st.sampled_from(["blob", "file", "tree"]),
    offset=sizes,
    length=st.integers(min_value=1, max_value=2**40),
)

indexes = st.lists(
    st.tuples(ids, st.lists(pack_entries, max_size=4).map(tuple)), max_size=4
).map(lambda packs: Index(tuple(packs)))

capacities = st.one_of(
    st.integers(min_value=1, max_value=2**60),
    st.floats(min_value=1e-9, max_value=1e18, allow_nan=False, allow_infinity=False),
)


@st.composite
def configs(draw: st.DrawFn) -> Config:
    specs = draw(
        st.lists(
            st.builds(BackendSpec, id=any_text, uri=any_text, capacity=capacities),
            min_size=1, max_size=5, unique_by=lambda s: s.id,
        )
    )
    backend_ids = [s.id for s in specs]
    acceptors = draw(st.lists(st.sampled_from(backend_ids), min_size=1, max_size=5, unique=True))
    erasure = draw(st.none() | st.integers(1, len(specs) - 1).flatmap(
        lambda k: st.tuples(st.just(k), st.integers(k + 1, len(specs))))) if len(specs) > 1 else None
    return Config(
        format=FORMAT_VERSION,
        namespace=draw(any_text),
        backends=tuple(specs),
        replicas=draw(st.integers(min_value=1, max_value=len(specs))),
        partitions=draw(st.integers(min_value=1, max_value=2**20)),
        encryption=draw(st.sampled_from(["aes-256-gcm", "none"])),
        acceptors=tuple(acceptors),
        vnode_unit=draw(st.tuples(st.integers(1, 2**40), st.integers(1, 2**40))),
        retention_days=draw(st.integers(0, 10_000)),
        snapshots=tuple(sorted(draw(st.dictionaries(
            st.from_regex(r"[a-z0-9][a-z0-9._-]{0,20}", fullmatch=True), ids, max_size=3)).items())),
        gc_epoch=draw(st.integers(0, 2**40)),
        gc_cutoff_ns=draw(st.integers(0, 2**62)),
        erasure=erasure,
        # Without erasure coding the threshold is not stored: it keeps its default.
        erasure_threshold=draw(st.integers(0, 2**30)) if erasure else 1 << 20,
        policy=draw(st.none() | st.builds(
            Policy, last=st.integers(-1, 9), daily=st.integers(-1, 9),
            yearly=st.integers(-1, 9)).filter(lambda p: not p.empty())),
    )


versions = st.builds(Version, number=sizes, master=st.none() | ids, config=ids)

OBJECT_STRATEGIES = {
    "file": file_objects(),
    "tree": trees(),
    "commit": commits,
    "index": indexes,
    "config": configs(),
}
CLASSES: dict[str, Any] = {
    "file": FileObject,
    "tree": Tree,
    "commit": Commit,
    "index": Index,
    "config": Config,
}

#: JSON of any shape, with the awkward values a hostile backend may choose.
json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats()
    | any_text
    | st.sampled_from(["", ".", "..", ".metasync", "a/b", "\x00", "\udcff", "\ud800", A, "blob"]),
    lambda children: st.lists(children, max_size=6)
    | st.dictionaries(st.text(max_size=10) | st.sampled_from(["size", "chunks", "tree"]), children, max_size=6),
    max_leaves=25,
)


def assert_parses_canonically_or_corrupt(cls: Any, data: bytes) -> None:
    """``data`` is refused with CorruptObject, or parses into an object that
    survives its own round trip. Any other exception fails the test."""
    try:
        obj = cls.from_bytes(data)
    except CorruptObject:
        return
    again = cls.from_bytes(obj.to_bytes())
    assert again == obj
    assert again.to_bytes() == obj.to_bytes()


# ----------------------------------------------------------------------------- round trips


@ROUND
@given(obj=file_objects())
def test_file_object_round_trip(obj: FileObject) -> None:
    """FileObject.from_bytes(x.to_bytes()) == x for any contiguous chunk list."""
    assert FileObject.from_bytes(obj.to_bytes()) == obj


@ROUND
@given(tree=trees())
def test_tree_round_trip(tree: Tree) -> None:
    """Tree.from_bytes(t.to_bytes()) == t, for names of any unicode and for
    undecodable bytes carried as surrogate escapes (os.fsdecode)."""
    data = tree.to_bytes()
    assert data.isascii()  # canonical JSON is ASCII: surrogates are escaped
    parsed = Tree.from_bytes(data)
    assert parsed == tree
    for entry in parsed.entries:
        # the name still maps back to the exact file-system bytes it came from
        assert os.fsdecode(os.fsencode(entry.name)) == entry.name


@ROUND
@given(tree=trees(), seed=st.randoms(use_true_random=False))
def test_tree_build_is_order_independent(tree: Tree, seed: Any) -> None:
    """Tree.build sorts entries by the bytes of their names, so the order entries
    are supplied in never changes the bytes (nor the id)."""
    shuffled = list(tree.entries)
    seed.shuffle(shuffled)
    rebuilt = Tree.build(shuffled)
    assert rebuilt == tree
    assert rebuilt.to_bytes() == tree.to_bytes()


def test_tree_sorted_by_bytes_not_code_points() -> None:
    """Entries are ordered by their file-system bytes: U+FFFF (EF BF BF) sorts
    before U+10000 (F0 90 80 80), and an escaped byte 0xFF sorts last."""
    names_in = ["\U00010000", "\uffff", os.fsdecode(b"\xff"), "z"]
    tree = Tree.build([TreeEntry(n, "file", A) for n in names_in])
    assert [e.name for e in tree.entries] == ["z", "\uffff", "\U00010000", os.fsdecode(b"\xff")]
    assert Tree.from_bytes(tree.to_bytes()) == tree


@ROUND
@given(commit=commits)
def test_commit_round_trip(commit: Commit) -> None:
    """Commit.from_bytes(c.to_bytes()) == c, for any text including lone surrogates."""
    assert Commit.from_bytes(commit.to_bytes()) == commit


@ROUND
@given(index=indexes)
def test_index_round_trip(index: Index) -> None:
    """Index.from_bytes(i.to_bytes()) == i."""
    assert Index.from_bytes(index.to_bytes()) == index


@ROUND
@given(config=configs())
def test_config_round_trip(config: Config) -> None:
    """Config.from_bytes(c.to_bytes()) == c (int and float capacities alike, any
    vnode unit)."""
    parsed = Config.from_bytes(config.to_bytes())
    assert parsed == config
    assert parsed.to_bytes() == config.to_bytes()


@ROUND
@given(version=versions)
def test_version_round_trip(version: Version) -> None:
    """Version.from_json(json of v.to_json()) == v; master may be None (version 0)."""
    assert Version.from_json(json.loads(canonical_json(version.to_json()))) == version


# ----------------------------------------------------------------------------- ids


@ROUND
@given(kind=st.sampled_from(sorted(OBJECT_STRATEGIES)), data=st.data())
def test_ids_are_deterministic_and_well_formed(kind: str, data: st.DataObject) -> None:
    """The same content gives the same id (also after a parse round trip); ids are
    64 lowercase hex digits; keyed and unkeyed hashers name it differently."""
    obj = data.draw(OBJECT_STRATEGIES[kind])
    plain, keyed = ObjectHasher(None), ObjectHasher(b"k" * 32)
    first = plain.id_of(kind, obj.to_bytes())
    reparsed = CLASSES[kind].from_bytes(obj.to_bytes())
    assert plain.id_of(kind, reparsed.to_bytes()) == first
    assert ObjectHasher(None).id_of(kind, obj.to_bytes()) == first
    assert is_object_id(first)
    keyed_id = keyed.id_of(kind, obj.to_bytes())
    assert is_object_id(keyed_id)
    assert keyed_id != first
    assert ObjectHasher(b"k" * 32).id_of(kind, obj.to_bytes()) == keyed_id
    assert ObjectHasher(b"j" * 32).id_of(kind, obj.to_bytes()) != keyed_id


@given(payload=st.binary(max_size=200))
def test_kind_is_part_of_the_id(payload: bytes) -> None:
    """Different kinds with the same bytes get different ids (keyed or not), so a
    blob can never be passed off as a tree with the same bytes."""
    for hasher in (ObjectHasher(None), ObjectHasher(b"\x01" * 32)):
        kind_ids = {hasher.id_of(k, payload) for k in ("blob", "file", "tree", "commit", "index", "config", "pack")}
        assert len(kind_ids) == 7


def test_incremental_hash_matches_id_of() -> None:
    """ObjectHasher.new(kind) fed in pieces gives the same id as id_of in one go."""
    hasher = ObjectHasher(b"\x02" * 32)
    h = hasher.new("blob")
    h.update(b"hello ")
    h.update(memoryview(b"world"))
    assert h.hexdigest() == hasher.id_of("blob", b"hello world")


def test_equal_content_equal_id_different_content_different_id() -> None:
    """Changing any field of an object changes its bytes and its id."""
    hasher = ObjectHasher(None)
    base = Commit(A, (B,), "client", "laptop", 1, "msg", (C,))
    same = Commit(A, (B,), "client", "laptop", 1, "msg", (C,))
    assert hasher.id_of("commit", base.to_bytes()) == hasher.id_of("commit", same.to_bytes())
    variants = [
        Commit(B, (B,), "client", "laptop", 1, "msg", (C,)),
        Commit(A, (), "client", "laptop", 1, "msg", (C,)),
        Commit(A, (B,), "other", "laptop", 1, "msg", (C,)),
        Commit(A, (B,), "client", "desk", 1, "msg", (C,)),
        Commit(A, (B,), "client", "laptop", 2, "msg", (C,)),
        Commit(A, (B,), "client", "laptop", 1, "msg2", (C,)),
        Commit(A, (B,), "client", "laptop", 1, "msg", ()),
    ]
    all_ids = {hasher.id_of("commit", c.to_bytes()) for c in [base, *variants]}
    assert len(all_ids) == len(variants) + 1


# ----------------------------------------------------------------------------- hostile input


def _tree_json(*entries: list[Any]) -> bytes:
    return json.dumps(list(entries)).encode()


BAD_TREES = {
    "unsorted": _tree_json(["b", "file", A, 0, 0], ["a", "file", A, 0, 0]),
    "duplicate": _tree_json(["a", "file", A, 0, 0], ["a", "dir", B, 0, 0]),
    "duplicate bytes, other spelling": _tree_json(
        ["\u00e9", "file", A, 0, 0], ["\udcc3\udca9", "file", A, 0, 0]
    ),
    "dotdot": _tree_json(["..", "dir", A, 0, 0]),
    "dot": _tree_json([".", "dir", A, 0, 0]),
    "slash": _tree_json(["a/b", "file", A, 0, 0]),
    "leading slash": _tree_json(["/etc", "file", A, 0, 0]),
    "empty name": _tree_json(["", "file", A, 0, 0]),
    "metadata folder": _tree_json([".metasync", "dir", A, 0, 0]),
    "nul in name": _tree_json(["a\x00b", "file", A, 0, 0]),
    "unencodable surrogate": _tree_json(["\ud800", "file", A, 0, 0]),
    "non-canonical escape spelling": _tree_json(["\udcc3\udca9", "file", A, 0, 0]),
    "name not a string": _tree_json([1, "file", A, 0, 0]),
    "bad id short": _tree_json(["a", "file", "abc", 0, 0]),
    "bad id upper": _tree_json(["a", "file", "A" * 64, 0, 0]),
    "bad id not hex": _tree_json(["a", "file", "g" * 64, 0, 0]),
    "bad id int": _tree_json(["a", "dir", 7, 0, 0]),
    "bad id and a newline": _tree_json(["a", "file", A + "\n", 0, 0]),
    "type unhashable": _tree_json(["a", ["file"], A, 0, 0]),
    "unknown type": _tree_json(["a", "socket", A, 0, 0]),
    "empty link": _tree_json(["a", "link", "", 0, 0]),
    "nul in link": _tree_json(["a", "link", "x\x00y", 0, 0]),
    "unencodable link": _tree_json(["a", "link", "\ud800", 0, 0]),
    "negative size": _tree_json(["a", "file", A, -1, 0]),
    "float size": _tree_json(["a", "file", A, 1.0, 0]),
    "bool size": _tree_json(["a", "file", A, True, 0]),
    "exec 2": _tree_json(["a", "file", A, 0, 2]),
    "exec true": _tree_json(["a", "file", A, 0, True]),
    "exec float": _tree_json(["a", "file", A, 0, 1.0]),
    "short entry": _tree_json(["a", "file", A, 0]),
    "long entry": _tree_json(["a", "file", A, 0, 0, 0]),
    "entry is dict": json.dumps([{"name": "a"}]).encode(),
    "tree is dict": b"{}",
    "tree is string": b'"tree"',
    "garbage": b"\x00\xff\xfe garbage",
    "not utf-8": b'[["\xff", "file", "' + A.encode() + b'", 0, 0]]',
    "truncated": _tree_json(["a", "file", A, 0, 0])[:-3],
    "deeply nested": b"[" * 100_000 + b"]" * 100_000,
    "empty": b"",
}


@pytest.mark.parametrize("data", BAD_TREES.values(), ids=BAD_TREES.keys())
def test_tree_rejects_hostile_input(data: bytes) -> None:
    """Unsorted or duplicate entries (by bytes), unsafe names ('..', 'a/b', '',
    '.metasync', NUL, unencodable or non-canonical surrogates), bad ids, bad types
    and garbage are refused with CorruptObject."""
    with pytest.raises(CorruptObject):
        Tree.from_bytes(data)


BAD_FILES = {
    "gap": json.dumps({"size": 20, "chunks": [[A, 0, 10], [B, 11, 9]]}).encode(),
    "overlap": json.dumps({"size": 20, "chunks": [[A, 0, 10], [B, 9, 11]]}).encode(),
    "not from zero": json.dumps({"size": 10, "chunks": [[A, 5, 10]]}).encode(),
    "size too big": json.dumps({"size": 21, "chunks": [[A, 0, 10], [B, 10, 10]]}).encode(),
    "size too small": json.dumps({"size": 19, "chunks": [[A, 0, 10], [B, 10, 10]]}).encode(),
    "bad chunk id": json.dumps({"size": 10, "chunks": [["xyz", 0, 10]]}).encode(),
    "negative length": json.dumps({"size": 0, "chunks": [[A, 0, 10], [B, 10, -10]]}).encode(),
    "string size": json.dumps({"size": "10", "chunks": [[A, 0, 10]]}).encode(),
    "float offset": json.dumps({"size": 10, "chunks": [[A, 0.0, 10]]}).encode(),
    "chunk as dict": json.dumps({"size": 10, "chunks": [{"id": A}]}).encode(),
    "chunks not list": json.dumps({"size": 0, "chunks": {}}).encode(),
    "extra key": json.dumps({"size": 0, "chunks": [], "x": 1}).encode(),
    "missing key": json.dumps({"size": 0}).encode(),
    "list": b"[]",
    "huge number": b'{"size":' + b"9" * 5000 + b',"chunks":[]}',
    "garbage": os.urandom(64) + b"\xff",
}


@pytest.mark.parametrize("data", BAD_FILES.values(), ids=BAD_FILES.keys())
def test_file_object_rejects_hostile_input(data: bytes) -> None:
    """Non-contiguous chunks, chunk lengths not adding up to the size, bad ids and
    wrong JSON types are refused with CorruptObject."""
    with pytest.raises(CorruptObject):
        FileObject.from_bytes(data)


def _commit(**changes: Any) -> bytes:
    raw: dict[str, Any] = {
        "tree": A, "parents": [B], "client": "c", "device": "d",
        "time_ns": 1, "message": "m", "indexes": [C],
    }
    raw.update(changes)
    return json.dumps({k: v for k, v in raw.items() if v is not ...}).encode()


BAD_COMMITS = {
    "bad tree": _commit(tree="nope"),
    "tree null": _commit(tree=None),
    "bad parent": _commit(parents=[A, "x"]),
    "parents not list": _commit(parents=A),
    "bad index": _commit(indexes=[1]),
    "client int": _commit(client=1),
    "message null": _commit(message=None),
    "negative time": _commit(time_ns=-1),
    "float time": _commit(time_ns=1.5),
    "missing key": _commit(device=...),
    "extra key": _commit(extra=1),
}


@pytest.mark.parametrize("data", BAD_COMMITS.values(), ids=BAD_COMMITS.keys())
def test_commit_rejects_hostile_input(data: bytes) -> None:
    """A commit with bad ids, wrong JSON types or wrong keys is refused."""
    Commit.from_bytes(_commit())  # the unmodified template parses
    with pytest.raises(CorruptObject):
        Commit.from_bytes(data)


BAD_INDEXES = {
    "not a list": b"{}",
    "bad pack id": json.dumps([["x", []]]).encode(),
    "entries not list": json.dumps([[A, {}]]).encode(),
    "entry short": json.dumps([[A, [[B, "blob", 0]]]]).encode(),
    "bad entry id": json.dumps([[A, [["b", "blob", 0, 1]]]]).encode(),
    "entry id and a newline": json.dumps([[A, [[B + "\n", "blob", 0, 1]]]]).encode(),
    "pack id and a newline": json.dumps([[A + "\n", [[B, "blob", 0, 1]]]]).encode(),
    "bool offset": json.dumps([[A, [[B, "blob", True, 1]]]]).encode(),
    "commit packed": json.dumps([[A, [[B, "commit", 0, 1]]]]).encode(),
    "kind unhashable": json.dumps([[A, [[B, ["blob"], 0, 1]]]]).encode(),
    "zero length": json.dumps([[A, [[B, "blob", 0, 0]]]]).encode(),
    "negative offset": json.dumps([[A, [[B, "blob", -1, 1]]]]).encode(),
    "pack triple": json.dumps([[A, [], 1]]).encode(),
}


@pytest.mark.parametrize("data", BAD_INDEXES.values(), ids=BAD_INDEXES.keys())
def test_index_rejects_hostile_input(data: bytes) -> None:
    """An index with bad ids, unexpected kinds, empty or negative ranges, or wrong
    shapes is refused."""
    with pytest.raises(CorruptObject):
        Index.from_bytes(data)


def _config(**changes: Any) -> bytes:
    raw: dict[str, Any] = {
        "format": FORMAT_VERSION, "namespace": "ns",
        "backends": [{"id": "a", "uri": "dir:/a", "capacity": 1},
                     {"id": "b", "uri": "dir:/b", "capacity": 1}],
        "replicas": 1, "partitions": 1, "encryption": "aes-256-gcm", "acceptors": ["a"],
        "vnode_unit": [1, 1], "fault_model": "crash", "retention_days": 30,
        "snapshots": {"keep": "ab" * 32}, "gc": {"epoch": 0, "cutoff_ns": 0},
        "erasure": {"k": 1, "n": 2, "threshold": 1024},
    }
    raw.update(changes)
    return json.dumps({k: v for k, v in raw.items() if v is not ...}).encode()


BAD_CONFIGS = {
    "format 0": _config(format=0),
    "format string": _config(format="1"),
    "no backends": _config(backends=[]),
    "backend not dict": _config(backends=["a"]),
    "zero capacity": _config(backends=[{"id": "a", "uri": "u", "capacity": 0}]),
    "negative capacity": _config(backends=[{"id": "a", "uri": "u", "capacity": -1}]),
    "string capacity": _config(backends=[{"id": "a", "uri": "u", "capacity": "1"}]),
    "bool capacity": _config(backends=[{"id": "a", "uri": "u", "capacity": True}]),
    "infinite capacity": _config(backends=[{"id": "a", "uri": "u", "capacity": float("inf")}]),
    "nan capacity": _config(backends=[{"id": "a", "uri": "u", "capacity": float("nan")}]),
    "id not string": _config(backends=[{"id": 1, "uri": "u", "capacity": 1}], acceptors=[],
                             erasure=None),
    "unknown acceptor": _config(acceptors=["c"]),
    "unknown fault model": _config(fault_model="omission"),
    "no fault model": _config(fault_model=...),
    "byzantine with one acceptor": _config(fault_model="byzantine"),
    "acceptor unhashable": _config(acceptors=[["a"]]),
    "acceptors not list": _config(acceptors="a"),
    "replicas 0": _config(replicas=0),
    "partitions float": _config(partitions=1.0),
    "namespace null": _config(namespace=None),
    "missing key": _config(encryption=...),
    "unknown encryption": _config(encryption="rot13"),
    "duplicate backend id": _config(
        backends=[{"id": "a", "uri": "u", "capacity": 1}, {"id": "a", "uri": "v", "capacity": 1}]
    ),
    "no acceptors": _config(acceptors=[]),
    "duplicate acceptor": _config(acceptors=["a", "a"]),
    "more replicas than backends": _config(replicas=3),
    "bad snapshot name": _config(snapshots={"../x": "ab" * 32}),
    "bad snapshot commit": _config(snapshots={"x": "zz"}),
    "snapshots not dict": _config(snapshots=[]),
    "negative retention": _config(retention_days=-1),
    "gc missing epoch": _config(gc={"cutoff_ns": 0}),
    "gc epoch string": _config(gc={"epoch": "1", "cutoff_ns": 0}),
    "erasure k >= n": _config(erasure={"k": 2, "n": 2, "threshold": 0}),
    "erasure n > backends": _config(erasure={"k": 1, "n": 3, "threshold": 0}),
    "erasure extra key": _config(erasure={"k": 1, "n": 2, "threshold": 0, "x": 1}),
    "no erasure key": _config(erasure=...),
    "vnode unit zero": _config(vnode_unit=[0, 1]),
    "vnode unit float": _config(vnode_unit=[1, 1.5]),
    "vnode unit short": _config(vnode_unit=[1]),
    "vnode unit not list": _config(vnode_unit=1),
    "keep not a dict": _config(keep=[1]),
    "keep unknown rule": _config(keep={"sometimes": 1}),
    "keep count too big": _config(keep={"daily": 10**7}),
    "keep empty": _config(keep={}),
}


@pytest.mark.parametrize("data", BAD_CONFIGS.values(), ids=BAD_CONFIGS.keys())
def test_config_rejects_hostile_input(data: bytes) -> None:
    """A config with impossible numbers (zero, negative, infinite or NaN capacity,
    zero replicas or more than backends, bad vnode unit), unknown, missing or
    duplicate acceptors, duplicate backend ids, an unknown encryption or wrong
    JSON types is refused."""
    Config.from_bytes(_config())  # the unmodified template parses
    with pytest.raises(CorruptObject):
        Config.from_bytes(data)


@pytest.mark.parametrize(
    "raw",
    [
        None,
        [],
        {"version": 1, "master": None},
        {"version": -1, "master": None, "config": A},
        {"version": True, "master": None, "config": A},
        {"version": 1, "master": "x", "config": A},
        {"version": 1, "master": None, "config": None},
        {"version": 1, "master": None, "config": A, "extra": 0},
    ],
)
def test_version_rejects_hostile_input(raw: Any) -> None:
    """Version.from_json refuses wrong shapes, negative or boolean numbers and bad ids."""
    with pytest.raises(CorruptObject):
        Version.from_json(raw)


@pytest.mark.parametrize("name", ["..", ".", "", ".metasync", "a/b", "/", "a\x00", None, 3, "\ud800"])
def test_check_name_rejects(name: Any) -> None:
    """check_name refuses anything that is not one safe path component."""
    with pytest.raises(CorruptObject):
        check_name(name)


@given(name=names)
def test_check_name_accepts_every_real_file_name(name: str) -> None:
    """Every name a POSIX directory can hold (except our reserved ones) passes."""
    assert check_name(name) == name


@FUZZ
@given(kind=st.sampled_from(sorted(CLASSES)), data=st.binary(max_size=300))
def test_from_bytes_fuzz_random_bytes(kind: str, data: bytes) -> None:
    """Random bytes only ever raise CorruptObject (or parse canonically)."""
    assert_parses_canonically_or_corrupt(CLASSES[kind], data)


@FUZZ
@given(kind=st.sampled_from(sorted(CLASSES)), value=json_values)
def test_from_bytes_fuzz_random_json(kind: str, value: Any) -> None:
    """Random JSON documents (NaN, huge ints, surrogates, reserved names included)
    only ever raise CorruptObject (or parse canonically)."""
    assert_parses_canonically_or_corrupt(CLASSES[kind], json.dumps(value).encode())


@st.composite
def mutated(draw: st.DrawFn, value: Any) -> Any:
    """``value`` with one node somewhere inside replaced by random JSON."""
    if isinstance(value, list | dict) and value and draw(st.booleans()):
        if isinstance(value, list):
            i = draw(st.integers(0, len(value) - 1))
            copy = list(value)
            copy[i] = draw(mutated(value[i]))
            return copy
        key = draw(st.sampled_from(sorted(value)))
        copy_d = dict(value)
        copy_d[key] = draw(mutated(value[key]))
        return copy_d
    return draw(json_values)


@FUZZ
@given(kind=st.sampled_from(sorted(CLASSES)), data=st.data())
def test_from_bytes_fuzz_mutated_valid_objects(kind: str, data: st.DataObject) -> None:
    """Valid objects with one node replaced anywhere inside (a near miss, the most
    likely shape of an attack) only ever raise CorruptObject or parse canonically."""
    obj = data.draw(OBJECT_STRATEGIES[kind])
    value = data.draw(mutated(json.loads(obj.to_bytes())))
    assert_parses_canonically_or_corrupt(CLASSES[kind], json.dumps(value).encode())


@settings(max_examples=50, deadline=None)
@given(value=json_values)
def test_version_from_json_fuzz(value: Any) -> None:
    """Version.from_json only ever raises CorruptObject on random JSON."""
    try:
        Version.from_json(value)
    except CorruptObject:
        pass


@pytest.mark.parametrize("fmt", [1, FORMAT_VERSION + 1])
def test_config_of_another_format_says_upgrade(fmt: int) -> None:
    """A config written by another format version is refused with a message naming
    both versions, not parsed by guesswork."""
    with pytest.raises(FormatError, match=f"format {fmt} is not supported"):
        Config.from_bytes(_config(format=fmt))
