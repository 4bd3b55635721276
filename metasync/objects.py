"""The content-addressed object model (paper section 3.1).

Logical objects are immutable and named by a hash of their kind and canonical
bytes, so equal content has an equal id on every client:

- ``Blob``: one chunk of file content (raw bytes);
- ``FileObject``: the chunks of a file that needs more than one, with offsets;
- ``Tree``: a directory: entries sorted by name (the paper's Dir);
- ``Commit``: a snapshot: root tree, parents, author, message, and the indexes
  that locate every object in packs;
- ``Index``: which pack holds which object, at which offset;
- ``Config``: the shared configuration (backends, capacities, R, H, format).

With encryption on, ids are *keyed* BLAKE2b hashes (the key never leaves the
client), so a backend cannot confirm a guess of a file's content. Every parser
here treats its input as hostile: wrong types, bad names or bad ids raise
:class:`CorruptObject`. ``docs/FORMAT.md`` is the normative description.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from metasync.errors import CorruptObject, FormatError
from metasync.retention import Policy

#: The repository format this metasync writes for new repositories (docs/FORMAT.md).
FORMAT_VERSION = 6
#: Every format it reads (and keeps writing, for a repository made in it, until a
#: change that needs the newer one, such as a key rotation).
READABLE_FORMATS = (3, 4, 5, 6)
#: Days a version stays restorable by default (``retention_days``).
DEFAULT_RETENTION_DAYS = 30
#: Most erasure-coded fragments per object.
MAX_FRAGMENTS = 16

ObjectKind = Literal["blob", "file", "tree", "commit", "index", "config", "pack"]
KINDS: tuple[str, ...] = ("blob", "file", "tree", "commit", "index", "config", "pack")

_ID = re.compile(r"[0-9a-f]{64}")


def is_object_id(value: object) -> bool:
    """True if ``value`` is a well-formed object id (64 lowercase hex digits)."""
    return isinstance(value, str) and bool(_ID.fullmatch(value))  # "$" would allow a "\n"


class ObjectHasher:
    """Names objects: BLAKE2b-256 over the canonical bytes, personalised by kind.

    ``id_key`` (32 bytes) makes the hash keyed; ``None`` gives plain hashes for
    unencrypted repositories. Both sides of a repository must use the same key.
    """

    def __init__(self, id_key: bytes | None) -> None:
        self._key = id_key or b""

    def new(self, kind: str) -> Any:
        """A hashlib object for ``kind``, to feed incrementally."""
        return hashlib.blake2b(digest_size=32, key=self._key, person=b"metasync:" + kind.encode())

    def id_of(self, kind: str, data: bytes | memoryview) -> str:
        """The id of an object of ``kind`` whose canonical bytes are ``data``."""
        h = self.new(kind)
        h.update(data)
        return str(h.hexdigest())


def canonical_json(value: Any) -> bytes:
    """The one byte encoding of ``value`` used for ids: sorted keys, no spaces,
    ASCII only (lone surrogates from undecodable file names are escaped, so any
    POSIX name round-trips)."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def parse_json(data: bytes, what: str) -> Any:
    try:
        return json.loads(data)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise CorruptObject(f"{what} is not valid JSON") from exc


def _fs_roundtrips(text: str) -> bool:
    """True if ``text`` is what ``os.fsdecode`` gives for its own bytes: no lone
    surrogate that cannot be encoded, and no second spelling of the same bytes."""
    try:
        return os.fsdecode(os.fsencode(text)) == text
    except UnicodeError:
        return False


def check_name(name: object) -> str:
    """Return ``name`` if it is a safe single path component, else raise CorruptObject.

    Names come from backends, which are untrusted: no ``/``, no NUL, not ``.`` or
    ``..``, not empty, and not our own metadata folder.
    """
    if (
        not isinstance(name, str)
        or name in ("", ".", "..", ".metasync")
        or "/" in name
        or "\x00" in name
        # An ASCII name round-trips in every file system encoding (and isascii is
        # one flag test): only the others are encoded and decoded.
        or not (name.isascii() or _fs_roundtrips(name))
    ):
        raise CorruptObject(f"unsafe entry name {name!r}")
    return name


def _want(cond: bool, what: str) -> None:
    if not cond:
        raise CorruptObject(what)


def _want_id(value: object, what: str) -> str:
    _want(is_object_id(value), f"{what} is not an object id")
    assert isinstance(value, str)
    return value


def _want_int(value: object, what: str, minimum: int = 0) -> int:
    _want(isinstance(value, int) and not isinstance(value, bool) and value >= minimum, what)
    assert isinstance(value, int)
    return value


# ----------------------------------------------------------------------------- file


@dataclass(frozen=True, slots=True)
class Chunk:
    """One Blob of a file: its id, where it starts in the file, and its length."""

    blob_id: str
    offset: int
    length: int


@dataclass(frozen=True)
class FileObject:
    """A file made of more than one chunk. Chunks are contiguous from offset 0."""

    kind: ClassVar[str] = "file"
    size: int
    chunks: tuple[Chunk, ...]

    def to_bytes(self) -> bytes:
        return canonical_json(
            {"size": self.size, "chunks": [[c.blob_id, c.offset, c.length] for c in self.chunks]}
        )

    @classmethod
    def from_bytes(cls, data: bytes) -> FileObject:
        raw = parse_json(data, "file object")
        _want(isinstance(raw, dict) and set(raw) == {"size", "chunks"}, "malformed file object")
        size = _want_int(raw["size"], "file size")
        _want(isinstance(raw["chunks"], list), "file chunks")
        chunks: list[Chunk] = []
        expected = 0
        for item in raw["chunks"]:
            _want(isinstance(item, list) and len(item) == 3, "malformed chunk")
            blob_id = _want_id(item[0], "chunk")
            offset = _want_int(item[1], "chunk offset")
            length = _want_int(item[2], "chunk length")
            _want(offset == expected, "chunks are not contiguous")
            expected += length
            chunks.append(Chunk(blob_id, offset, length))
        _want(expected == size, "chunk lengths do not add up to the file size")
        return cls(size, tuple(chunks))


# ----------------------------------------------------------------------------- tree

EntryType = Literal["file", "chunked", "dir", "link"]
ENTRY_TYPES: tuple[str, ...] = ("file", "chunked", "dir", "link")


@dataclass(frozen=True, slots=True)
class TreeEntry:
    """One name in a directory.

    ``type``: ``file`` (content is the single Blob ``ref``), ``chunked`` (content
    is the FileObject ``ref``), ``dir`` (``ref`` is a Tree), ``link`` (a symbolic
    link; ``ref`` is its target, stored verbatim and never followed).
    ``size`` is the content length in bytes (for a link, of the target's UTF-8).
    """

    name: str
    type: EntryType
    ref: str
    size: int = 0
    executable: bool = False

    def sort_key(self) -> bytes:
        return os.fsencode(self.name)


@dataclass(frozen=True)
class Tree:
    """A directory: entries in byte order of their names, names unique."""

    kind: ClassVar[str] = "tree"
    entries: tuple[TreeEntry, ...] = field(default_factory=tuple)

    @classmethod
    def build(cls, entries: list[TreeEntry]) -> Tree:
        return cls(tuple(sorted(entries, key=TreeEntry.sort_key)))

    def to_bytes(self) -> bytes:
        return canonical_json(
            [[e.name, e.type, e.ref, e.size, 1 if e.executable else 0] for e in self.entries]
        )

    def by_name(self) -> dict[str, TreeEntry]:
        return {e.name: e for e in self.entries}

    @classmethod
    def from_bytes(cls, data: bytes) -> Tree:
        # Checks inline, messages built only on failure: a clone parses every tree
        # before it writes a file.
        raw = parse_json(data, "tree")
        _want(isinstance(raw, list), "malformed tree")
        entries: list[TreeEntry] = []
        previous: bytes | None = None
        is_id = _ID.fullmatch
        for item in raw:
            if type(item) is not list or len(item) != 5:
                raise CorruptObject("malformed tree entry")
            name, etype, ref, size, xbit = item
            check_name(name)
            if etype == "link":
                _want(
                    isinstance(ref, str) and "\x00" not in ref and ref != "" and _fs_roundtrips(ref),
                    "bad link target",
                )
            elif etype not in ENTRY_TYPES:
                raise CorruptObject(f"unknown entry type {etype!r}")
            elif type(ref) is not str or not is_id(ref):
                raise CorruptObject("tree entry is not an object id")
            if type(size) is not int or size < 0:
                raise CorruptObject("entry size")
            if type(xbit) is not int or xbit not in (0, 1):
                raise CorruptObject("entry exec bit")
            key = os.fsencode(name)  # TreeEntry.sort_key
            if previous is not None and key <= previous:
                raise CorruptObject("tree entries not sorted or not unique")
            previous = key
            entries.append(TreeEntry(name, etype, ref, size, xbit == 1))
        return cls(tuple(entries))


# ----------------------------------------------------------------------------- commit


@dataclass(frozen=True)
class Commit:
    """A snapshot of the whole folder and how to find its objects."""

    kind: ClassVar[str] = "commit"
    tree: str
    parents: tuple[str, ...]
    client: str
    device: str
    time_ns: int
    message: str
    indexes: tuple[str, ...]

    def to_bytes(self) -> bytes:
        return canonical_json(
            {
                "tree": self.tree,
                "parents": list(self.parents),
                "client": self.client,
                "device": self.device,
                "time_ns": self.time_ns,
                "message": self.message,
                "indexes": list(self.indexes),
            }
        )

    @classmethod
    def from_bytes(cls, data: bytes) -> Commit:
        raw = parse_json(data, "commit")
        keys = {"tree", "parents", "client", "device", "time_ns", "message", "indexes"}
        _want(isinstance(raw, dict) and set(raw) == keys, "malformed commit")
        _want(isinstance(raw["parents"], list) and isinstance(raw["indexes"], list), "commit")
        _want(all(isinstance(raw[k], str) for k in ("client", "device", "message")), "commit")
        return cls(
            tree=_want_id(raw["tree"], "commit tree"),
            parents=tuple(_want_id(p, "commit parent") for p in raw["parents"]),
            client=raw["client"],
            device=raw["device"],
            time_ns=_want_int(raw["time_ns"], "commit time"),
            message=raw["message"],
            indexes=tuple(_want_id(i, "commit index") for i in raw["indexes"]),
        )


# ----------------------------------------------------------------------------- index


@dataclass(frozen=True, slots=True)
class PackEntry:
    """Where one encoded object sits inside a pack."""

    object_id: str
    kind: str
    offset: int
    length: int


@dataclass(frozen=True)
class Index:
    """Pack contents: ``packs[pack_id]`` lists the entries stored in that pack."""

    kind: ClassVar[str] = "index"
    packs: tuple[tuple[str, tuple[PackEntry, ...]], ...]

    def to_bytes(self) -> bytes:
        return canonical_json(
            [
                [pack_id, [[e.object_id, e.kind, e.offset, e.length] for e in entries]]
                for pack_id, entries in self.packs
            ]
        )

    @classmethod
    def from_bytes(cls, data: bytes) -> Index:
        raw = parse_json(data, "index")
        _want(isinstance(raw, list), "malformed index")
        packs = []
        for item in raw:
            _want(isinstance(item, list) and len(item) == 2, "malformed index pack")
            pack_id = _want_id(item[0], "index pack")
            _want(isinstance(item[1], list), "malformed index entries")
            packs.append((pack_id, tuple(parse_pack_entry(e) for e in item[1])))
        return cls(tuple(packs))


def parse_pack_entry(item: object) -> PackEntry:
    if type(item) is not list or len(item) != 4:
        raise CorruptObject("malformed pack entry")
    object_id, kind, offset, length = item
    if kind not in PACKED_KINDS:
        raise CorruptObject(f"unexpected packed kind {kind!r}")
    if type(object_id) is not str or not _ID.fullmatch(object_id):
        raise CorruptObject("pack entry is not an object id")
    if type(offset) is not int or offset < 0:
        raise CorruptObject("pack entry offset")
    if type(length) is not int or length < 1:
        raise CorruptObject("pack entry length")
    return PackEntry(object_id, kind, offset, length)


#: What a pack holds.
PACKED_KINDS = ("blob", "file", "tree")  # a tuple: a hostile unhashable kind is refused, not a TypeError


def same_entry(a: TreeEntry | None, b: TreeEntry | None) -> bool:
    """Same content at a path (folders compare by kind: their contents are paths too)."""
    if a is None or b is None:
        return a is b
    if a.type == "dir" or b.type == "dir":
        return a.type == b.type
    return (a.type, a.ref, a.executable) == (b.type, b.ref, b.executable)


# ----------------------------------------------------------------------------- config


@dataclass(frozen=True)
class BackendSpec:
    """One storage service in the shared configuration."""

    id: str
    uri: str
    capacity: float


@dataclass(frozen=True)
class Config:
    """The shared configuration, stored on every backend (paper 3.1 "shared data")."""

    kind: ClassVar[str] = "config"
    format: int
    namespace: str
    backends: tuple[BackendSpec, ...]
    replicas: int
    partitions: int
    encryption: str
    #: Backend ids acting as pPaxos acceptors (may differ from the storage set).
    acceptors: tuple[str, ...]
    #: Capacity one mapping vnode stands for, as (numerator, denominator); fixed at
    #: init so reconfigurations move only what they must (see mapping.py).
    vnode_unit: tuple[int, int] = (1, 1)
    #: ``crash`` (majority quorums) or ``byzantine`` (paper 3.6: 3f + 1 acceptors,
    #: quorums of 2f + 1, authenticated log entries).
    fault_model: str = "crash"
    #: Days a version stays restorable before ``gc`` may drop what only it needs.
    retention_days: int = DEFAULT_RETENTION_DAYS
    #: Named versions kept from gc for ever: ``(name, commit id)``, sorted by name.
    snapshots: tuple[tuple[str, str], ...] = ()
    #: Bumped by every gc that deletes objects; clients that see it change drop what
    #: they knew about deleted packs (see docs/design.md, "Garbage collection").
    gc_epoch: int = 0
    #: Commits older than this (ns since the epoch) were pruned by the last gc: their
    #: trees may be gone. 0: nothing pruned yet.
    gc_cutoff_ns: int = 0
    #: ``(k, n)``: objects of at least ``erasure_threshold`` bytes are stored as n
    #: erasure-coded fragments, any k of which rebuild them; ``None``: replication.
    erasure: tuple[int, int] | None = None
    erasure_threshold: int = 1 << 20
    #: The data key epoch new objects are encrypted under (``metasync key rotate``
    #: moves it on); a client whose keyring lacks it re-opens its key slot. Written
    #: only when not 0, so configurations of older repositories keep their bytes.
    key_epoch: int = 0
    #: Data keys of epochs below this are retired by a completed rotation: nothing is
    #: stored under them any more (log entries aside), and no reader accepts them.
    key_oldest: int = 0
    #: The retention policy (``metasync forget``; docs/retention.md): which versions
    #: older than ``retention_days`` gc keeps. Written (as ``keep``) only when set.
    policy: Policy | None = None

    def to_bytes(self) -> bytes:
        extra: dict[str, Any] = {"key_epoch": self.key_epoch} if self.key_epoch else {}
        if self.key_oldest:
            extra["key_oldest"] = self.key_oldest
        if self.policy is not None and not self.policy.empty():
            extra["keep"] = self.policy.to_json()
        return canonical_json(
            {
                **extra,
                "format": self.format,
                "namespace": self.namespace,
                "backends": [
                    {"id": b.id, "uri": b.uri, "capacity": b.capacity} for b in self.backends
                ],
                "replicas": self.replicas,
                "partitions": self.partitions,
                "encryption": self.encryption,
                "acceptors": list(self.acceptors),
                "vnode_unit": list(self.vnode_unit),
                "fault_model": self.fault_model,
                "retention_days": self.retention_days,
                "snapshots": {name: commit for name, commit in self.snapshots},
                "gc": {"epoch": self.gc_epoch, "cutoff_ns": self.gc_cutoff_ns},
                "erasure": (
                    None if self.erasure is None
                    else {"k": self.erasure[0], "n": self.erasure[1],
                          "threshold": self.erasure_threshold}
                ),
            }
        )

    def snapshot(self, name: str) -> str | None:
        """The commit id kept under snapshot ``name``, if any."""
        return dict(self.snapshots).get(name)

    @property
    def backend_ids(self) -> tuple[str, ...]:
        return tuple(b.id for b in self.backends)

    def backend(self, backend_id: str) -> BackendSpec:
        for spec in self.backends:
            if spec.id == backend_id:
                return spec
        raise KeyError(backend_id)

    @classmethod
    def from_bytes(cls, data: bytes) -> Config:
        raw = parse_json(data, "config")
        _want(isinstance(raw, dict), "malformed config")
        fmt = _want_int(raw.get("format"), "config format", 1)
        if fmt not in READABLE_FORMATS:
            raise FormatError(
                f"repository format {fmt} is not supported (this metasync reads "
                f"{' and '.join(map(str, READABLE_FORMATS))}); upgrade metasync"
            )
        keys = {"format", "namespace", "backends", "replicas", "partitions", "encryption",
                "acceptors", "vnode_unit", "fault_model", "retention_days", "snapshots", "gc",
                "erasure"}
        _want(set(raw) - {"key_epoch", "key_oldest", "keep"} == keys, "malformed config")
        policy = None
        if "keep" in raw:
            try:
                policy = Policy.from_json(raw["keep"])
            except ValueError as exc:
                raise CorruptObject(f"config: {exc}") from None
            _want(not policy.empty(), "empty retention policy")
        key_epoch = _want_int(raw.get("key_epoch", 0), "key epoch")
        key_oldest = _want_int(raw.get("key_oldest", 0), "oldest key epoch")
        _want(key_epoch == 0 or raw["encryption"] != "none", "a key epoch needs encryption")
        _want(key_oldest <= key_epoch, "the oldest key epoch is above the current one")
        _want(isinstance(raw["backends"], list) and bool(raw["backends"]), "config backends")
        specs = []
        for b in raw["backends"]:
            _want(isinstance(b, dict) and set(b) == {"id", "uri", "capacity"}, "config backend")
            _want(isinstance(b["id"], str) and isinstance(b["uri"], str), "config backend")
            _want(
                isinstance(b["capacity"], int | float)
                and not isinstance(b["capacity"], bool)
                and (isinstance(b["capacity"], int) or math.isfinite(b["capacity"]))
                and b["capacity"] > 0,
                "capacity",
            )
            specs.append(BackendSpec(b["id"], b["uri"], b["capacity"]))
        _want(isinstance(raw["acceptors"], list), "config acceptors")
        ids = {s.id for s in specs}
        _want(all(isinstance(a, str) and a in ids for a in raw["acceptors"]), "acceptor is not a backend")
        _want(isinstance(raw["namespace"], str) and raw["encryption"] in ("none", "aes-256-gcm"), "config")
        _want(len(ids) == len(specs), "duplicate backend ids in config")
        _want(bool(raw["acceptors"]) and len(set(raw["acceptors"])) == len(raw["acceptors"]), "acceptors")
        unit = raw["vnode_unit"]
        _want(isinstance(unit, list) and len(unit) == 2, "config vnode unit")
        unit_pair = (_want_int(unit[0], "vnode unit", 1), _want_int(unit[1], "vnode unit", 1))
        replicas = _want_int(raw["replicas"], "replicas", 1)
        _want(raw["fault_model"] in ("crash", "byzantine"), "config fault model")
        if raw["fault_model"] == "byzantine":
            _want(len(raw["acceptors"]) >= 4 and raw["encryption"] != "none",
                  "a byzantine config needs 4 acceptors and encryption")
        _want(replicas <= len(specs), "more replicas than backends")
        snapshots = raw["snapshots"]
        _want(isinstance(snapshots, dict), "config snapshots")
        for name, commit in snapshots.items():
            _want(is_snapshot_name(name), "snapshot name")
            _want_id(commit, "snapshot")
        gc = raw["gc"]
        _want(isinstance(gc, dict) and set(gc) == {"epoch", "cutoff_ns"}, "config gc")
        erasure: tuple[int, int] | None = None
        threshold = 1 << 20
        if raw["erasure"] is not None:
            ec = raw["erasure"]
            _want(isinstance(ec, dict) and set(ec) == {"k", "n", "threshold"}, "config erasure")
            k, n = _want_int(ec["k"], "erasure k", 1), _want_int(ec["n"], "erasure n", 2)
            _want(k < n <= len(specs) and n <= MAX_FRAGMENTS, "erasure k/n")
            threshold = _want_int(ec["threshold"], "erasure threshold")
            erasure = (k, n)
        return cls(
            format=fmt,
            namespace=raw["namespace"],
            backends=tuple(specs),
            replicas=replicas,
            partitions=_want_int(raw["partitions"], "partitions", 1),
            encryption=raw["encryption"],
            acceptors=tuple(raw["acceptors"]),
            vnode_unit=unit_pair,
            fault_model=raw["fault_model"],
            retention_days=_want_int(raw["retention_days"], "retention days"),
            snapshots=tuple(sorted(snapshots.items())),
            gc_epoch=_want_int(gc["epoch"], "gc epoch"),
            gc_cutoff_ns=_want_int(gc["cutoff_ns"], "gc cutoff"),
            erasure=erasure,
            erasure_threshold=threshold,
            key_epoch=key_epoch,
            key_oldest=key_oldest,
            policy=policy,
        )


_SNAPSHOT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}\Z")


def is_snapshot_name(name: object) -> bool:
    """Snapshot names: 1-64 of ``[A-Za-z0-9._-]``, starting with a letter or digit."""
    return isinstance(name, str) and bool(_SNAPSHOT_NAME.match(name))


# ----------------------------------------------------------------------------- tuple


@dataclass(frozen=True, order=True)
class Version:
    """The value pPaxos agrees on (paper 3.3): (version, master, config).

    ``master`` is a Commit id (``None`` only for version 0, the empty repository).
    """

    number: int
    master: str | None
    config: str

    def to_json(self) -> dict[str, Any]:
        return {"version": self.number, "master": self.master, "config": self.config}

    @classmethod
    def from_json(cls, raw: object) -> Version:
        _want(isinstance(raw, dict) and set(raw) == {"version", "master", "config"}, "version")
        assert isinstance(raw, dict)
        master = raw["master"]
        if master is not None:
            _want_id(master, "master")
        return cls(_want_int(raw["version"], "version number"), master, _want_id(raw["config"], "config"))
