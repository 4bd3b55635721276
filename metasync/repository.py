"""``metasync.Repository``: the Python API the CLI is a thin layer over.

A repository is a working folder with a ``.metasync`` folder inside, bound to
a namespace on several backends. The flow of a change (paper Figure 3):
``commit`` turns changed files into objects packed into the outbox; ``push``
uploads the outbox to the mapped backends (data before anything refers to it),
then runs pPaxos to make the new commit master; ``pull`` learns master and
brings it into the folder without losing a local change.
"""

from __future__ import annotations

import fcntl
import hashlib
import io
import itertools
import json
import os
import secrets
import shutil
import socket
import stat
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from datetime import datetime
from fractions import Fraction
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, TypeVar

from metasync.backends import Backend, normalize_uri, open_backend, public_uri
from metasync.codec import PACK_TARGET_SIZE, Codec, FinishedPack, PackBuilder
from metasync.errors import (
    BackendError,
    BackendUnavailable,
    CorruptObject,
    FormatError,
    MetasyncError,
    NotARepository,
    ObjectNotFound,
    ObjectUnavailable,
    UsageError,
)
from metasync.faults import crash_point
from metasync.keys import MasterKey, unwrap, wrap
from metasync.localdb import IndexRow, LocalDB, location_in
from metasync.mapping import StableMapping, vnode_unit
from metasync.objects import (
    FORMAT_VERSION,
    MAX_FRAGMENTS,
    BackendSpec,
    Commit,
    Config,
    FileObject,
    Index,
    PackEntry,
    Tree,
    TreeEntry,
    Version,
    is_object_id,
    is_snapshot_name,
    same_entry,
)
from metasync.progress import NullReporter, Reporter
from metasync.store import SMALL_READ, RemoteStore, mapping_of, object_key
from metasync.worktree import (
    META_DIR,
    Chunker,
    FileChanged,
    IgnoreRules,
    ScanEntry,
    conflict_name,
    file_mode,
    remove_stale_temps,
    scan,
    temp_path_for,
)

if TYPE_CHECKING:
    from metasync.consensus import Consensus
    from metasync.maintenance import BackendListing, ConfigChange, GcReport, RebalanceReport

DESCRIPTOR_KEY = "metasync.json"
KEYFILE_KEY = "keys/master"
DEFAULT_NAMESPACE = "metasync"
DEFAULT_PARTITIONS = 16384
#: An index entry is trusted only if the file's mtime is this much older than the
#: moment it was hashed (a write within the filesystem's timestamp granularity
#: could otherwise go unnoticed; git calls these entries "racily clean").
RACY_NS = 2_000_000_000
#: Index rows a commit's scan writes at once (see ``Repository._scan``).
INDEX_FLUSH = 20_000
#: Files being hashed or queued per hashing thread (bounds memory on huge trees).
HASH_WINDOW = 64
#: Settings key of the last (scan fingerprint, root tree id) pair computed: lets
#: ``status`` of an unchanged folder skip rebuilding every tree.
TREE_MEMO = "tree_memo_v1"
#: A commit lists at most this many index objects; beyond it they are merged.
MAX_INDEXES = 64
#: Pack entries per index object (keeps each well under the readers' size limit).
INDEX_ENTRIES = 100_000
#: A push merges with a moving master at most this many times before giving up.
MAX_MERGES = 50
#: Files written by a checkout are flushed and renamed in batches of this many.
WRITE_BATCH = 2000
#: Small files of one pack written by one worker task.
JOB_FILES = 400
#: Checks fsck starts over when a concurrent gc collects what it was checking.
FSCK_ATTEMPTS = 5
#: Most configuration changes one read follows (each costs a round trip or two).
MAX_CONFIG_HOPS = 1000

T = TypeVar("T")
PassphraseSource = Callable[[], str]
#: A file to write: its path, its tree entry, and its content as (blob id, length).
WritePlan = tuple[str, TreeEntry, list[tuple[str, int]]]
#: A written temporary file: its plan, its path, and its stat (None for a link).
WrittenTemp = tuple[WritePlan, Path, "os.stat_result | None"]


def pack_target_size() -> int:
    """Bytes at which a pack is closed: 16 MiB, or ``METASYNC_PACK_SIZE`` (for
    tests that need many objects, and for measuring other sizes on slow links)."""
    raw = os.environ.get("METASYNC_PACK_SIZE")
    if not raw:
        return PACK_TARGET_SIZE
    try:
        value = int(raw)
    except ValueError:
        raise UsageError(f"METASYNC_PACK_SIZE={raw!r} is not a number of bytes") from None
    if not 1 <= value <= PACK_TARGET_SIZE * 4:
        raise UsageError(f"METASYNC_PACK_SIZE must be between 1 and {PACK_TARGET_SIZE * 4}")
    return value


def _config_key(config_id: str) -> str:
    return f"config/{config_id}"


def _now_ns() -> int:
    return time.time_ns()


def _timeout(db: LocalDB) -> float | None:
    """Seconds consensus waits without progress: ``METASYNC_TIMEOUT`` (set by the
    CLI's ``--timeout``), else the repository's setting, else None (the default
    of :class:`~metasync.consensus.Consensus`)."""
    raw = os.environ.get("METASYNC_TIMEOUT") or db.get("timeout")
    if raw is None:
        return None
    try:
        value = float(raw)
    except (TypeError, ValueError):
        raise UsageError(f"timeout {raw!r} is not a number of seconds") from None
    if not value > 0:
        raise UsageError(f"timeout must be positive, got {raw!r}")
    return value


def _stamp(time_ns: int) -> str:
    """A commit time as conflict-copy names show it (local time). The time comes
    from a commit (untrusted): one no calendar can show reads as all zeros."""
    try:
        return datetime.fromtimestamp(time_ns / 1e9).strftime("%Y-%m-%d %H%M%S")
    except (OverflowError, OSError, ValueError):
        return "0000-00-00 000000"


@dataclass(frozen=True)
class Change:
    path: str
    kind: str  # "added", "modified", "deleted"
    type: str


@dataclass
class Status:
    """What ``metasync status`` reports: changes against the last local commit."""

    changes: list[Change]
    version: int
    head: str | None
    unpushed: bool
    files_hashed: int

    @property
    def clean(self) -> bool:
        return not self.changes and not self.unpushed

    def to_json(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "head": self.head,
            "unpushed": self.unpushed,
            "clean": self.clean,
            "changes": [{"path": c.path, "change": c.kind, "type": c.type} for c in self.changes],
        }


@dataclass
class CommitResult:
    commit_id: str
    tree_id: str
    new_objects: dict[str, int]
    packs: int
    files_hashed: int


@dataclass
class PushResult:
    version: Version | None
    commit: CommitResult | None
    objects_uploaded: int = 0
    bytes_uploaded: int = 0
    up_to_date: bool = False
    missing_copies: int = 0
    #: Conflict copies a merge with a moved master made.
    conflicts: list[str] = field(default_factory=list)


@dataclass
class PullResult:
    version: Version
    written: int = 0
    deleted: int = 0
    conflicts: list[str] = field(default_factory=list)
    up_to_date: bool = False


@dataclass(frozen=True)
class LogEntry:
    commit_id: str
    device: str
    client: str
    time_ns: int
    message: str
    parents: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "commit": self.commit_id,
            "device": self.device,
            "client": self.client,
            "time": datetime.fromtimestamp(self.time_ns / 1e9).astimezone().isoformat(),
            "message": self.message,
            "parents": list(self.parents),
        }


@dataclass
class RestoreResult:
    """What ``restore`` brought back, from which version."""

    commit_id: str
    time_ns: int
    target: str
    restored: list[str] = field(default_factory=list)
    conflicts: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class FsckProblem:
    backend: str
    kind: str
    object_id: str
    problem: str  # "missing", "corrupt", "unreachable"


@dataclass
class FsckReport:
    checked_copies: int = 0
    objects: int = 0
    problems: list[FsckProblem] = field(default_factory=list)
    #: Copies ``--repair`` re-created from a good copy (each was a problem above).
    repaired: list[FsckProblem] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """No problem is left (repaired ones do not count)."""
        fixed = set(self.repaired)
        return all(p in fixed for p in self.problems)


@dataclass(frozen=True)
class ShareResult:
    """What ``share`` did on one backend."""

    backend: str
    #: True if the service itself shared the folder (or invited the user).
    shared: bool
    #: One line: what was done, or why it must be shared by hand.
    detail: str


class _KnownIds:
    """Which object ids already have a location, answered from any thread."""

    def __init__(self, db_path: Path) -> None:
        self._path = db_path
        self._local = threading.local()
        self._new: set[str] = set()
        self._lock = threading.Lock()

    def claim(self, object_id: str) -> bool:
        """True exactly once per id that is not yet stored anywhere."""
        with self._lock:
            if object_id in self._new:
                return False
            self._new.add(object_id)
        conn = getattr(self._local, "conn", None)
        if conn is None:
            import sqlite3

            conn = self._local.conn = sqlite3.connect(f"file:{self._path}?mode=ro", uri=True)
        row = conn.execute("SELECT 1 FROM locations WHERE object_id=?", (object_id,)).fetchone()
        return row is None


class _ObjectWriter:
    """Packs new objects into the outbox for one commit (from any thread)."""

    def __init__(self, repo: Repository) -> None:
        self.outbox = repo.meta / "outbox"
        self.repo = repo
        self.known = _KnownIds(repo.meta / "state.db")
        self.builder = PackBuilder(repo.codec, pack_target_size())
        self.finished: list[FinishedPack] = []
        self.counts: dict[str, int] = {}
        self._lock = threading.Lock()

    def _keep(self, pack: FinishedPack | None) -> None:
        if pack is None:
            return
        _write_durable(self.outbox / pack.pack_id, pack.data)
        pack.data = b""  # on disk now: keep only the entries, so memory stays flat
        with self._lock:
            self.finished.append(pack)

    def sink(self, kind: str, object_id: str, data: bytes) -> None:
        """Store one object unless some pack already holds it."""
        if self.known.claim(object_id):
            with self._lock:
                self.counts[kind] = self.counts.get(kind, 0) + 1
            self._keep(self.builder.add(kind, object_id, data))

    def finish(self) -> list[tuple[str, str, bytes]]:
        """Flush the last pack; return the index objects listing every pack."""
        self._keep(self.builder.flush())
        return self.repo._index_objects([(p.pack_id, tuple(p.entries)) for p in self.finished])


class Repository:
    """A metasync working folder. Open with :meth:`open`, :meth:`init` or :meth:`clone`."""

    def __init__(
        self,
        root: Path,
        db: LocalDB,
        config: Config,
        key: MasterKey | None,
        backends: dict[str, Backend],
        reporter: Reporter | None = None,
    ) -> None:
        self.root = root
        self.meta = root / META_DIR
        self.db = db
        self.config = config
        #: Id of ``config``: the configuration of ``prev``, whose acceptors decide the
        #: next version and whose mapping places new objects.
        self.config_id: str = db.get("config")
        self.codec = Codec(key)
        self.backends = backends
        #: Every backend opened so far, by id: those of the current configuration and
        #: of others read while following configuration changes.
        self._opened: dict[str, Backend] = dict(backends)
        self.store = RemoteStore(config, self.codec, backends)
        self.store.local = self.meta / "outbox"
        self.client_id: str = db.get("client_id")
        self.device: str = db.get("device")
        self._consensus_timeout = _timeout(db)  # checked now: a bad value fails every command
        #: pPaxos drivers by configuration id, made on first use (status and commit
        #: never need one, and their modules cost start-up time).
        self._consensus: dict[str, Consensus] = {}
        self.chunker = Chunker(self.codec.hasher)
        self.reporter: Reporter = reporter or NullReporter()
        #: Files whose content was read in the last scan (the index saves the rest).
        self.files_hashed = 0
        self._last_scan: dict[str, ScanEntry] = {}
        # Read the umask once, here: os.umask can only be read by setting it, which
        # must not race with worker threads creating files.
        self._file_modes = {False: file_mode(False), True: file_mode(True)}
        #: The open lock file while this object has the folder (see _lock_folder).
        self._lock_fd: int | None = None

    @property
    def consensus(self) -> Consensus:
        """pPaxos over the acceptors of this client's configuration (made on first use)."""
        return self.consensus_for(self.config_id, self.config)

    # ============================================================== lifecycle
    @classmethod
    def init(
        cls,
        root: str | Path,
        backend_uris: list[str],
        *,
        replicas: int = 2,
        namespace: str = DEFAULT_NAMESPACE,
        encrypt: bool = True,
        passphrase: PassphraseSource | None = None,
        capacities: list[float] | None = None,
        byzantine: bool = False,
        erasure: tuple[int, int] | None = None,
        reporter: Reporter | None = None,
    ) -> Repository:
        """Create a repository in ``root`` on the given backends.

        ``byzantine`` (paper 3.6) makes pPaxos tolerate ``f`` backends that forge
        nothing (entries are authenticated) but drop or reorder log entries; it
        needs ``3f + 1`` backends, at least 4, and encryption (the MAC key).

        Validates everything before writing anything: a bad URI, a missing backend
        folder, a backend that already holds this namespace, or a folder that is
        already a repository fails with nothing written.
        """
        root = Path(root).absolute()
        if (root / META_DIR).exists():
            raise UsageError(f"{root} is already a metasync repository")
        if root.exists() and not root.is_dir():
            raise UsageError(f"{root} exists and is not a folder")
        if not root.parent.is_dir():
            raise UsageError(f"parent folder {root.parent} does not exist; create it first")
        check_namespace(namespace)
        if not backend_uris:
            raise UsageError("give at least one backend: --backend dir:/absolute/path")
        uris = [normalize_uri(u) for u in backend_uris]
        if len({public_uri(u) for u in uris}) != len(uris):
            raise UsageError("the same backend is given twice; each --backend must be distinct")
        if not 1 <= replicas <= len(uris):
            raise UsageError(
                f"--replicas {replicas} needs between 1 and {len(uris)} (the number of backends)"
            )
        if erasure is not None:
            k, n = erasure
            if not 1 <= k < n <= min(len(uris), MAX_FRAGMENTS):
                raise UsageError(
                    f"--erasure {k}/{n} needs 1 <= K < N <= {min(len(uris), MAX_FRAGMENTS)} "
                    f"(N fragments go to N different backends; {len(uris)} given)"
                )
        if byzantine and len(uris) < 4:
            raise UsageError(f"--bft needs at least 4 backends (3f + 1); {len(uris)} given")
        if byzantine and not encrypt:
            raise UsageError("--bft authenticates log entries with the repository key; drop --no-encrypt")
        caps = [float(c) for c in capacities] if capacities else [1.0] * len(uris)
        if len(caps) != len(uris) or any(c <= 0 for c in caps):
            raise UsageError("give one positive capacity per backend")
        backends = [open_backend(u, namespace) for u in uris]
        for b in backends:
            check_backend_free(b)
        key = MasterKey.generate() if encrypt else None
        keyfile = wrap(key, _ask(passphrase)) if key is not None else None

        ids = [secrets.token_hex(4) for _ in uris]
        config = Config(
            format=FORMAT_VERSION,
            namespace=namespace,
            # Passwords in URIs stay on this client (uri_overrides), never on a backend.
            backends=tuple(
                BackendSpec(i, public_uri(u), c) for i, u, c in zip(ids, uris, caps, strict=True)
            ),
            replicas=replicas,
            partitions=DEFAULT_PARTITIONS,
            encryption="aes-256-gcm" if encrypt else "none",
            acceptors=tuple(ids),
            vnode_unit=_unit_pair(vnode_unit([Fraction(repr(float(c))) for c in caps])),
            fault_model="byzantine" if byzantine else "crash",
            erasure=erasure,
        )
        codec = Codec(key)
        config_bytes = config.to_bytes()
        config_id = codec.id_of("config", config_bytes)
        stored_config = codec.encode("config", config_id, config_bytes)
        # Write the descriptor last on each backend: its presence marks a complete repository.
        for backend_id, backend in zip(ids, backends, strict=True):
            backend.create()
            if keyfile is not None:
                backend.put(KEYFILE_KEY, keyfile)
            backend.put(_config_key(config_id), stored_config)
            backend.put(DESCRIPTOR_KEY, descriptor(config, config_id, backend_id))
        by_id = dict(zip(ids, backends, strict=True))
        secret_uris = {i: u for i, u in zip(ids, uris, strict=True) if public_uri(u) != u}
        return cls._create_local(root, config, config_id, key, by_id, secret_uris, reporter)

    @classmethod
    def _create_local(
        cls,
        root: Path,
        config: Config,
        config_id: str,
        key: MasterKey | None,
        backends: dict[str, Backend],
        uri_overrides: dict[str, str],
        reporter: Reporter | None,
    ) -> Repository:
        root.mkdir(exist_ok=True)
        meta = root / META_DIR
        staging = root / f"{META_DIR}.new-{secrets.token_hex(4)}"
        staging.mkdir(mode=0o700)
        try:
            if key is not None:
                _write_private(staging / "key", key.to_hex().encode())
            db = LocalDB(staging / "state.db")
            with db.transaction():
                db.set("format", FORMAT_VERSION)
                db.set("client_id", secrets.token_hex(8))
                db.set("device", _device_name())
                db.set("namespace", config.namespace)
                db.set("config", config_id)
                db.set("config_doc", config.to_bytes().decode())
                db.set("uri_overrides", uri_overrides)
                db.set("prev", Version(0, None, config_id).to_json())
                # The configuration version 0 started with: what a new backend's
                # descriptor names, so a clone from it can start at the beginning.
                db.set("init_config", config_id)
                db.set("head", None)
            db.close()
            (staging / "outbox").mkdir()
            os.rename(staging, meta)  # the repository appears whole or not at all
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        return cls._load(root, reporter)

    @classmethod
    def open(cls, path: str | Path = ".", reporter: Reporter | None = None) -> Repository:
        """Open the repository containing ``path`` (searching upwards, as git does)."""
        start = Path(path).absolute()
        for candidate in (start, *start.parents):
            if (candidate / META_DIR / "state.db").is_file():
                return cls._load(candidate, reporter)
        raise NotARepository(
            f"{start} is not inside a metasync repository; run `metasync init` or `metasync clone`"
        )

    @classmethod
    def _load(cls, root: Path, reporter: Reporter | None) -> Repository:
        meta = root / META_DIR
        lock = _lock_folder(meta)
        try:
            return cls._load_locked(root, reporter, lock)
        except BaseException:
            os.close(lock)
            raise

    @classmethod
    def _load_locked(cls, root: Path, reporter: Reporter | None, lock: int) -> Repository:
        meta = root / META_DIR
        db = LocalDB(meta / "state.db")
        fmt = db.get("format")
        if fmt != FORMAT_VERSION:
            db.close()
            raise FormatError(
                f"{meta} has format {fmt}; this metasync reads {FORMAT_VERSION}; upgrade metasync"
            )
        config = Config.from_bytes(db.get("config_doc").encode())
        key_path = meta / "key"
        key = MasterKey.from_hex(key_path.read_text()) if key_path.exists() else None
        if (config.encryption != "none") != (key is not None):
            db.close()
            raise FormatError(f"{key_path} is missing; clone the repository again")
        overrides: dict[str, str] = db.get("uri_overrides", {})
        backends = {
            spec.id: open_backend(overrides.get(spec.id, spec.uri), config.namespace)
            for spec in config.backends
        }
        (meta / "outbox").mkdir(exist_ok=True)
        repo = cls(root, db, config, key, backends, reporter)
        repo._lock_fd = lock
        return repo

    @classmethod
    def clone(
        cls,
        uri: str,
        root: str | Path,
        *,
        namespace: str = DEFAULT_NAMESPACE,
        passphrase: PassphraseSource | None = None,
        reporter: Reporter | None = None,
    ) -> Repository:
        """Rebuild the folder from any one backend of a repository into ``root``.

        Everything that can fail on bad input (not a repository, wrong passphrase,
        ``root`` not empty) is checked before anything is written.
        """
        root = Path(root).absolute()
        if root.exists() and (not root.is_dir() or any(root.iterdir())):
            raise UsageError(f"{root} is not empty; clone into a new or empty folder")
        if not root.parent.is_dir():
            raise UsageError(f"parent folder {root.parent} does not exist; create it first")
        check_namespace(namespace)
        entry = open_backend(uri, namespace)
        try:
            raw_descriptor = entry.get(DESCRIPTOR_KEY)
        except ObjectNotFound:
            raise NotARepository(
                f"no metasync repository at {uri} (namespace {namespace!r}); check the URI"
            ) from None
        except BackendUnavailable as exc:
            raise NotARepository(f"cannot read {uri}: {exc}") from None
        desc = _parse_descriptor(raw_descriptor, uri)
        key: MasterKey | None = None
        if desc["encryption"] != "none":
            try:
                keyfile = entry.get(KEYFILE_KEY)
            except ObjectNotFound:
                raise FormatError(f"{uri} has no key file; clone from another backend") from None
            key = unwrap(keyfile, _ask(passphrase))
        codec = Codec(key)
        config_id = desc["config"]
        config = Config.from_bytes(
            codec.decode("config", config_id, entry.get(_config_key(config_id)))
        )
        _check_format(config.format)
        entry_id = desc["backend"]
        # This client reaches the entry backend by the URI it was given (a mount point
        # may differ between machines; a password stays here).
        overrides = {entry_id: entry.uri}
        created = not root.exists()
        repo = cls._create_local(root, config, config_id, key, {}, overrides, reporter)
        try:
            repo._start_from_hint(entry_id)
            repo.pull()
        except BaseException:
            repo.close()
            # Leave no half-cloned folder behind on a failure we can report.
            if created:
                shutil.rmtree(root, ignore_errors=True)
            else:  # it was empty before: empty it again
                for child in root.iterdir():
                    if child.is_dir() and not child.is_symlink():
                        shutil.rmtree(child, ignore_errors=True)
                    else:
                        child.unlink(missing_ok=True)
            raise
        return repo

    def close(self) -> None:
        self.store.close()
        self.db.close()
        for b in self._opened.values():
            b.close()
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the folder lock
            self._lock_fd = None

    def __enter__(self) -> Repository:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ============================================================== configurations
    def load_config(self, config_id: str) -> Config:
        """The configuration ``config_id``: from the local cache, else from the first
        backend that has a good copy (every configuration is stored on every backend
        of it and of the one before, before any version names it)."""
        if config_id == self.config_id:
            return self.config
        cached = self.db.cached_object(config_id)
        if cached is None:
            reasons: list[str] = []
            for backend in list(self._opened.values()):
                try:
                    stored = backend.get(_config_key(config_id))
                    cached = self.codec.decode("config", config_id, stored)
                    break
                except MetasyncError as exc:
                    reasons.append(f"{backend.name}: {exc}")
            if cached is None:
                raise ObjectUnavailable(
                    f"no backend has configuration {config_id[:12]} ({'; '.join(reasons[-3:])})"
                )
            with self.db.transaction():
                self.db.cache_object(config_id, "config", cached)
        config = Config.from_bytes(cached)
        if config.namespace != self.config.namespace:
            raise CorruptObject(f"configuration {config_id[:12]} is of another namespace")
        return config

    def open_backends(self, config: Config) -> dict[str, Backend]:
        """The backends of ``config`` by id, opening those not open yet (with this
        client's own URI, password included, where it has one)."""
        overrides: dict[str, str] = self.db.get("uri_overrides", {})
        out: dict[str, Backend] = {}
        for spec in config.backends:
            backend = self._opened.get(spec.id)
            if backend is None:
                backend = open_backend(overrides.get(spec.id, spec.uri), config.namespace)
                self._opened[spec.id] = backend
            out[spec.id] = backend
        return out

    def consensus_for(self, config_id: str, config: Config | None = None) -> Consensus:
        """The pPaxos driver over the acceptors of configuration ``config_id``."""
        consensus = self._consensus.get(config_id)
        if consensus is None:
            from metasync.consensus import DEFAULT_TIMEOUT, Consensus
            from metasync.paxos import Quorums

            config = config or self.load_config(config_id)
            backends = self.open_backends(config)
            acceptors = {b: backends[b] for b in config.acceptors}
            consensus = Consensus(
                acceptors, self.codec, self.client_id,
                quorums=Quorums.bft(len(acceptors)) if config.fault_model == "byzantine"
                else Quorums.crash(len(acceptors)),
                timeout=self._consensus_timeout or DEFAULT_TIMEOUT,
                config_id=config_id,
            )
            self._consensus[config_id] = consensus
        return consensus

    @property
    def init_config_id(self) -> str:
        """The configuration of version 0 (named by every backend's descriptor)."""
        return str(self.db.get("init_config"))

    def _start_from_hint(self, entry_id: str) -> None:
        """A fresh clone starts from the version its entry backend's ``latest`` hint
        names, once that version's acceptors confirm it: learning from version 0
        would need the first configuration's backends, which may be long gone. Any
        failure leaves the start at version 0."""
        overrides: dict[str, str] = self.db.get("uri_overrides", {})
        entry = self.open_backends_by_id({entry_id: overrides[entry_id]})[entry_id]
        from metasync.consensus import read_hint

        hint = read_hint(self.codec, entry)
        if hint is None or hint[0] <= self.prev.number + 1:
            return
        decided = self._confirm_hint(*hint)
        if decided is None:
            return
        with self.db.transaction():
            for name, value in self._base_settings(decided).items():
                self.db.set(name, value)
        self._adopt_config()

    def open_backends_by_id(self, uris: dict[str, str]) -> dict[str, Backend]:
        """Open backends given by id and URI (not named by a known configuration)."""
        for backend_id, uri in uris.items():
            if backend_id not in self._opened:
                self._opened[backend_id] = open_backend(uri, self.config.namespace)
        return {b: self._opened[b] for b in uris}

    def learn_latest(self) -> Version:
        """The newest decided version. Follows configuration changes: the instances
        after a version that changes the configuration are decided by the acceptors
        of its new configuration (docs/FORMAT.md §9)."""
        from metasync.consensus import FloorElsewhere

        known = self.prev
        consensus = self.consensus
        for _ in range(MAX_CONFIG_HOPS):
            try:
                latest = consensus.get_recent(known)
            except FloorElsewhere as exc:
                # Behind a log compaction that other acceptors than ours decided: start
                # again from the newest version the backends' hints confirm, like a clone.
                known = self._version_from_hints(consensus, exc)
                consensus = self.consensus_for(known.config)
                continue
            if latest.config == consensus.config_id:
                epoch = self.load_config(latest.config).gc_epoch
                if epoch > int(self.db.get("gc_epoch", 0)):
                    # Before anything is read or deduplicated under what a gc left.
                    self._forget_collected(epoch)
                return latest
            consensus = self.consensus_for(latest.config)
            known = latest
        raise BackendError(
            f"the configuration changed more than {MAX_CONFIG_HOPS} times while reading; retry",
            transient=True,
        )

    def _confirm_hint(self, number: int, config_id: str) -> Version | None:
        """Version ``number`` if the acceptors of ``config_id`` (the configuration a
        hint names) show it decided and not compacted, else None (hints are only
        shortcuts)."""
        try:
            decided = self.consensus_for(config_id).learn(number)
        except MetasyncError:
            return None
        return decided if decided is not None and decided.number == number else None

    def _version_from_hints(self, consensus: Consensus, behind: MetasyncError) -> Version:
        """The newest version that some backend's ``latest`` hint names and the
        acceptors of the hint's configuration confirm (decided, not compacted)."""
        from metasync.consensus import read_hint

        backends = {**self.open_backends(self.config), **consensus.acceptors}
        hints = sorted({h for b in backends.values() if (h := read_hint(self.codec, b))},
                       reverse=True)
        for number, config_id in hints:
            decided = self._confirm_hint(number, config_id)
            if decided is not None:
                return decided
        raise BackendError(f"{behind}, and no backend's latest-version hint could be "
                           "confirmed; retry, or clone the repository again", transient=True)

    def _base_settings(self, version: Version) -> dict[str, Any]:
        """Local settings that make decided ``version`` the base (``prev``): its
        configuration comes with it, in the same transaction."""
        settings: dict[str, Any] = {"prev": version.to_json()}
        if version.config != self.config_id:
            config = self.load_config(version.config)
            settings["config"] = version.config
            settings["config_doc"] = config.to_bytes().decode()
        return settings

    def _adopt_config(self) -> None:
        """After ``prev`` moved to another configuration: place, read and agree with
        its backends from now on."""
        config_id: str = self.db.get("config")
        if config_id == self.config_id:
            return
        config = Config.from_bytes(self.db.get("config_doc").encode())
        self.config, self.config_id = config, config_id
        self.backends = self.open_backends(config)
        self.store.reconfigure(config, self.backends)

    # ============================================================== state
    @property
    def prev(self) -> Version:
        return Version.from_json(self.db.get("prev"))

    @property
    def head(self) -> str | None:
        head: str | None = self.db.get("head")
        return head

    def _head_commit(self) -> Commit | None:
        return self.load_commit(self.head) if self.head else None

    # ============================================================== objects
    def load_commit(self, commit_id: str) -> Commit:
        data = self.db.cached_object(commit_id)
        if data is None:
            data = self.store.get_standalone("commit", commit_id)
            self.db.cache_object(commit_id, "commit", data)
        return Commit.from_bytes(data)

    def _load_index(self, index_id: str, historic: bool = False) -> None:
        state = self.db.index_state(index_id)
        if state is not None and (historic or state != "historic"):
            return
        data = self.db.cached_object(index_id) or self.store.get_standalone("index", index_id)
        index = Index.from_bytes(data)
        with self.db.transaction():
            self.db.cache_object(index_id, "index", data)
            for pack_id, entries in index.packs:
                self.db.add_locations(pack_id, entries, historic=historic)
            self.db.set_index_state(index_id, "historic" if historic else "remote")

    def _load_indexes(self, commit: Commit, historic: bool = False) -> None:
        """Learn where ``commit``'s objects are. ``historic``: the commit is older than
        the current master's line (a version being restored or compared): its
        indexes may list packs a gc has collected, so they serve reads only."""
        for index_id in commit.indexes:
            self._load_index(index_id, historic)

    def _fetch_packed(self, ids: Iterable[str]) -> dict[str, bytes]:
        """Plaintexts of packed metadata objects (trees, files), cached locally."""
        result: dict[str, bytes] = {}
        by_pack: dict[str, list[PackEntry]] = {}
        for object_id in ids:
            data = self.db.cached_object(object_id)
            if data is not None:
                result[object_id] = data
                continue
            loc = self.db.location(object_id)
            if loc is None:
                raise ObjectUnavailable(f"object {object_id[:12]} is in no known pack")
            by_pack.setdefault(loc[0], []).append(loc[1])
        futures = [
            self.store.executor.submit(self.store.read_entries, pack_id, entries)
            for pack_id, entries in by_pack.items()
        ]
        with self.db.transaction():
            for fut in futures:
                for object_id, data in fut.result().items():
                    entry = self.db.location(object_id)
                    kind = entry[1].kind if entry else "tree"
                    self.db.cache_object(object_id, kind, data)
                    result[object_id] = data
        return result

    def flatten(self, tree_id: str | None) -> dict[str, TreeEntry]:
        """Every path in a tree (folders included), fetching trees level by level."""
        flat: dict[str, TreeEntry] = {}
        if tree_id is None:
            return flat
        level: list[tuple[str, str]] = [("", tree_id)]
        while level:
            fetched = self._fetch_packed(t for _, t in level)
            nxt: list[tuple[str, str]] = []
            for prefix, tid in level:
                tree = Tree.from_bytes(fetched[tid])
                for entry in tree.entries:
                    path = f"{prefix}/{entry.name}" if prefix else entry.name
                    flat[path] = entry
                    if entry.type == "dir":
                        nxt.append((path, entry.ref))
            level = nxt
        return flat

    def tree_at(self, commit_id: str) -> dict[str, TreeEntry]:
        """Every path of a commit's tree (flattened), loading what it needs."""
        commit = self.load_commit(commit_id)
        self._load_indexes(commit, historic=commit_id not in (self.head, self.prev.master))
        return self.flatten(commit.tree)

    def _file_chunks(self, entry: TreeEntry) -> list[tuple[str, int]]:
        """(blob id, length) of a file entry's content, in order."""
        if entry.type == "file":
            return [(entry.ref, entry.size)]
        obj = FileObject.from_bytes(self._fetch_packed([entry.ref])[entry.ref])
        if obj.size != entry.size:
            raise CorruptObject(f"file object {entry.ref[:12]} size differs from its entry")
        return [(c.blob_id, c.length) for c in obj.chunks]

    # ============================================================== scanning
    def _scan(
        self,
        sink: Callable[[str, str, bytes], None] | None,
        *,
        flush_index: bool = False,
        keep_scan: bool = True,
    ) -> tuple[dict[str, TreeEntry], set[str], list[IndexRow], list[str]]:
        """Scan the folder; return (file and link entries, folders, refreshed index
        rows, paths skipped because they changed while being read).

        With ``flush_index``, refreshed rows are written to the index in batches as
        files are hashed and only the last, partial batch is returned (a huge tree
        then never holds them all). That is safe before the commit is recorded: a
        commit trusts a row only if its content is in a recorded pack, and status
        compares the row's content id, which is right whether committed or not.

        ``keep_scan=False`` leaves ``_last_scan`` empty and lets each scanned entry go
        as soon as it is used (a checkout always scans again before it compares)."""
        # Tracked paths are read only if there is an ignore file (load is lazy).
        entries = scan(self.root, IgnoreRules.load(self.root, self.db.index_paths()))
        self._last_scan = entries if keep_scan else {}
        files: dict[str, TreeEntry] = {}
        dirs: set[str] = set()
        to_hash: list[ScanEntry] = []
        # Index rows stream from SQLite and are dropped once used (only those of files
        # to read again are kept), so a huge tree never holds the whole index as well
        # as the scan. Names from scandir are safe components by construction (scan
        # skips .metasync), so the untrusted-name check is not needed here.
        previous: dict[str, IndexRow] = {}
        kinds = {"file": "file", "chunked": "chunked"}  # one str object per kind
        for row in self.db.iter_index_rows():
            e = entries.get(row.path)
            if e is None or e.type != "file":
                continue
            if (
                row.size == e.size
                and row.mtime_ns == e.mtime_ns
                and row.ino == e.ino
                and row.mtime_ns + RACY_NS < row.hashed_at_ns
                # `status` caches hashes without storing content: a commit must
                # read a file again unless its content is in some pack.
                and (sink is None or self.db.is_located(row.ref))
            ):
                name = e.path.rpartition("/")[2]
                kind = kinds.get(row.type, row.type)
                files[e.path] = TreeEntry(name, kind, row.ref, e.size, e.executable)  # type: ignore[arg-type]
            else:
                previous[e.path] = row
        for path, e in entries.items():
            if e.type == "dir":
                dirs.add(path)
            elif e.type == "link":
                files[path] = TreeEntry(path.rpartition("/")[2], "link", e.target, e.size)
            elif path not in files:
                to_hash.append(e)
        del entries  # kept only in _last_scan, if at all
        refreshed: list[IndexRow] = []
        skipped: list[str] = []
        self.files_hashed = len(to_hash)
        if to_hash:
            hashed_at = _now_ns()
            workers = min(len(to_hash), (os.cpu_count() or 2) + 1)
            self.reporter.start("pack" if sink else "hash", sum(e.size for e in to_hash))
            # Handed out one by one, so each entry is freed once hashed.
            queue = deque(to_hash)
            to_hash.clear()
            consume = (queue.popleft() for _ in range(len(queue)))
            with ThreadPoolExecutor(workers, thread_name_prefix="metasync-hash") as pool:
                for e, result in _ordered_map(pool, lambda e: self._hash_one(e, sink), consume,
                                              HASH_WINDOW * workers):
                    self.reporter.advance(e.size)
                    name = e.path.rpartition("/")[2]
                    if result is None:
                        skipped.append(e.path)
                        old = previous.get(e.path)
                        if old is not None:  # keep the last known version of a busy file
                            files[e.path] = TreeEntry(name, old.type, old.ref, old.size, old.executable)  # type: ignore[arg-type]
                        continue
                    files[e.path] = TreeEntry(name, result[0], result[1], e.size, e.executable)  # type: ignore[arg-type]
                    refreshed.append(
                        IndexRow(e.path, result[0], result[1], e.size, e.executable, e.mtime_ns, e.ino, hashed_at)
                    )
                    if flush_index and len(refreshed) >= INDEX_FLUSH:
                        with self.db.transaction():
                            self.db.upsert_index(refreshed)
                        refreshed = []
            self.reporter.finish()
        return files, dirs, refreshed, skipped

    def _hash_one(
        self, e: ScanEntry, sink: Callable[[str, str, bytes], None] | None
    ) -> tuple[str, str] | None:
        for _ in range(3):
            try:
                hashed = self.chunker.hash_file(self.root / e.path, e, sink)
                return hashed.type, hashed.ref
            except FileChanged:
                try:
                    st = os.lstat(self.root / e.path)
                except FileNotFoundError:
                    return None
                e = ScanEntry(e.path, e.type, st.st_size, st.st_mtime_ns, st.st_ino, e.executable)
            except (FileNotFoundError, PermissionError, IsADirectoryError):
                return None
        return None

    def _build_trees(
        self,
        files: dict[str, TreeEntry],
        dirs: set[str],
        emit: Callable[[str, bytes], None] | None = None,
    ) -> tuple[str, dict[str, bytes]]:
        """Root tree id and every tree's canonical bytes, built bottom-up. With
        ``emit``, each tree goes to ``emit(id, bytes)`` as it is built instead of
        into the returned dict, and ``files`` is emptied once read (so a huge tree
        never holds every tree's bytes, nor the path index next to the trees)."""
        children: dict[str, list[TreeEntry]] = {d: [] for d in dirs}
        children[""] = []
        for path, entry in files.items():
            parent = path.rpartition("/")[0]
            children.setdefault(parent, []).append(entry)
        if emit is not None:
            files.clear()
        trees: dict[str, bytes] = {}
        order = sorted((d for d in children if d), key=lambda p: p.count("/"), reverse=True)
        root_id = ""
        for d in [*order, ""]:
            data = Tree.build(children.pop(d)).to_bytes()
            tid = self.codec.id_of("tree", data)
            if emit is None:
                trees[tid] = data
            else:
                emit(tid, data)
            if d:
                parent, _, name = d.rpartition("/")
                children.setdefault(parent, []).append(TreeEntry(name, "dir", tid))
            else:
                root_id = tid
        return root_id, trees

    # ============================================================== status
    def status(self) -> Status:
        """Changes in the folder against the last commit; reads only files whose
        size, mtime or inode changed since they were last hashed. A checkout an
        interrupted pull left is finished first (else its unapplied changes would
        look like the user's)."""
        self._resume_checkout()
        files, dirs, refreshed, _ = self._scan(None)
        if refreshed:
            with self.db.transaction():
                self.db.upsert_index(refreshed)
        head = self._head_commit()
        changes: list[Change] = []
        fingerprint = _tree_fingerprint(files, dirs)
        if head is None or self.db.get(TREE_MEMO) != [fingerprint, head.tree]:
            root_id, trees = self._build_trees(files, dirs)
            if head is not None and head.tree == root_id:
                self.db.set(TREE_MEMO, [fingerprint, root_id])
            else:
                # Descend only into folders whose tree ids differ: an unchanged subtree
                # costs nothing, and an unchanged folder costs one comparison.
                self._diff_trees(head.tree if head else None, root_id, trees, "", changes)
        changes.sort(key=lambda c: c.path)
        return Status(
            changes=changes,
            version=self.prev.number,
            head=self.head,
            unpushed=self.head is not None and self.head != self.prev.master,
            files_hashed=self.files_hashed,
        )

    def _diff_trees(
        self,
        old_id: str | None,
        new_id: str | None,
        new_trees: dict[str, bytes],
        prefix: str,
        out: list[Change],
    ) -> None:
        """Append the changes from tree ``old_id`` (stored) to ``new_id`` (just built)."""
        old = Tree.from_bytes(self._fetch_packed([old_id])[old_id]).by_name() if old_id else {}
        new = Tree.from_bytes(new_trees[new_id]).by_name() if new_id else {}
        for name in old.keys() | new.keys():
            path = f"{prefix}/{name}" if prefix else name
            o, n = old.get(name), new.get(name)
            if o is not None and n is not None and o.type == "dir" and n.type == "dir":
                if o.ref != n.ref:
                    self._diff_trees(o.ref, n.ref, new_trees, path, out)
                continue
            if o is not None and n is not None and same_entry(o, n):
                continue
            if o is not None:
                if n is not None and o.type != "dir" and n.type != "dir":
                    out.append(Change(path, "modified", n.type))
                    continue
                out.append(Change(path, "deleted", o.type))
                if o.type == "dir":
                    self._diff_trees(o.ref, None, new_trees, path, out)
            if n is not None:
                out.append(Change(path, "added", n.type))
                if n.type == "dir":
                    self._diff_trees(None, n.ref, new_trees, path, out)

    # ============================================================== commit
    def commit(self, message: str = "") -> CommitResult | None:
        """Record the folder as a new local commit; ``None`` if nothing changed.

        New objects are packed, encrypted and written to the outbox (flushed to
        disk) before the commit that refers to them is recorded.
        """
        self._resume_checkout()
        self._clean_outbox()
        writer = _ObjectWriter(self)
        # A checkout scans again before it compares anything with a scan, so a commit
        # need not keep this one (on a huge tree it is a third of the memory).
        files, dirs, refreshed, skipped = self._scan(writer.sink, flush_index=True, keep_scan=False)
        for path in skipped:
            self.reporter.note(f"skipped {path}: it changed while being read; it is committed next time")
        fingerprint = _tree_fingerprint(files, dirs)
        empty = not files and not dirs

        def emit(tree_id: str, data: bytes) -> None:
            # Packed and cached as built; both are keyed by content, so a commit that
            # fails after this leaves nothing wrong behind.
            writer.sink("tree", tree_id, data)
            self.db.cache_object(tree_id, "tree", data)

        with self.db.transaction():
            root_id, trees = self._build_trees(files, dirs, emit)  # empties files
            self.db.set(TREE_MEMO, [fingerprint, root_id])
        head = self._head_commit()
        unchanged = (head is not None and head.tree == root_id) or (
            head is None and empty and self.prev.master is None
        )
        if unchanged:
            # Every pack gets an index, even without a commit (a busy file may have left
            # new blobs): a later commit that reuses them must be able to list them.
            stored = writer.finish()
            self._store_standalone(stored)
            with self.db.transaction():
                self._record_packs(writer.finished, refreshed)
                self._record_standalone(stored)
            return None
        parent = head or (self.load_commit(self.prev.master) if self.prev.master else None)
        if head is None and parent is not None:
            self._load_indexes(parent)
        commit_id = self._seal_commit(
            writer, root_id, trees, parents=(self.head,) if self.head else (),
            message=message, inherited=[parent] if parent else [], refreshed=refreshed,
        )
        return CommitResult(commit_id, root_id, writer.counts, len(writer.finished), self.files_hashed)

    def _clean_outbox(self) -> None:
        """Remove outbox files no transaction recorded: what an interrupted commit
        wrote before it could record it (nothing refers to them)."""
        recorded = {stored_id for stored_id, _ in self.db.outbox()}
        with os.scandir(self.meta / "outbox") as it:
            for entry in it:
                if entry.name not in recorded:
                    Path(entry.path).unlink(missing_ok=True)

    def _seal_commit(
        self,
        writer: _ObjectWriter,
        root_id: str,
        trees: dict[str, bytes],
        *,
        parents: tuple[str, ...],
        message: str,
        inherited: list[Commit],
        refreshed: list[IndexRow],
        settings: dict[str, Any] | None = None,
    ) -> str:
        """Pack the new trees, write indexes and the commit to the outbox, and make
        it head -- with ``settings`` -- in one transaction. Returns its id."""
        for tid, data in trees.items():
            writer.sink("tree", tid, data)
        stored = writer.finish()
        indexes = set(self.db.local_indexes())
        for c in inherited:
            # Only indexes of the current line: after a gc, older ones may list
            # collected packs (see _forget_collected).
            indexes |= {i for i in c.indexes if self.db.index_state(i) in ("remote", "local")}
        indexes |= {object_id for _, object_id, _ in stored}
        if len(indexes) > MAX_INDEXES:
            fresh = {object_id: data for _, object_id, data in stored}
            merged = self._index_objects(self._merged_index_packs(indexes, fresh))
            stored += merged
            indexes = {object_id for _, object_id, _ in merged}
        commit = Commit(
            tree=root_id,
            parents=parents,
            client=self.client_id,
            device=self.device,
            time_ns=_now_ns(),
            message=message,
            indexes=tuple(sorted(indexes)),
        )
        commit_bytes = commit.to_bytes()
        commit_id = self.codec.id_of("commit", commit_bytes)
        stored.append(("commit", commit_id, commit_bytes))
        self._store_standalone(stored)
        crash_point("commit:stored")
        with self.db.transaction():
            self._record_packs(writer.finished, refreshed)
            for tid, data in trees.items():
                self.db.cache_object(tid, "tree", data)
            self._record_standalone(stored)
            self.db.set("head", commit_id)
            for name, value in (settings or {}).items():
                self.db.set(name, value)
        return commit_id

    def _index_objects(
        self, packs: list[tuple[str, tuple[PackEntry, ...]]]
    ) -> list[tuple[str, str, bytes]]:
        """Index objects listing ``packs``, each at most INDEX_ENTRIES entries so no
        index exceeds what readers accept."""
        out: list[tuple[str, str, bytes]] = []
        group: list[tuple[str, tuple[PackEntry, ...]]] = []
        count = 0
        for pack_id, entries in packs:
            if group and count + len(entries) > INDEX_ENTRIES:
                out.append(self._index_object(group))
                group, count = [], 0
            group.append((pack_id, entries))
            count += len(entries)
        if group:
            out.append(self._index_object(group))
        return out

    def _index_object(self, packs: list[tuple[str, tuple[PackEntry, ...]]]) -> tuple[str, str, bytes]:
        data = Index(tuple(packs)).to_bytes()
        return "index", self.codec.id_of("index", data), data

    def _merged_index_packs(
        self, index_ids: set[str], fresh: dict[str, bytes]
    ) -> list[tuple[str, tuple[PackEntry, ...]]]:
        """The union of the packs the given indexes list (to merge many into few);
        ``fresh`` holds indexes made by this commit, not yet recorded anywhere."""
        packs: dict[str, tuple[PackEntry, ...]] = {}
        for index_id in sorted(index_ids):
            data = fresh.get(index_id) or self.db.cached_object(index_id)
            if data is None:
                data = self.store.get_standalone("index", index_id)
            for pack_id, entries in Index.from_bytes(data).packs:
                packs.setdefault(pack_id, entries)
        return sorted(packs.items())

    def _store_standalone(self, stored: list[tuple[str, str, bytes]]) -> None:
        outbox = self.meta / "outbox"
        for kind, object_id, plaintext in stored:
            _write_durable(outbox / object_id, self.codec.encode(kind, object_id, plaintext))

    def _record_standalone(self, stored: list[tuple[str, str, bytes]]) -> None:
        for kind, object_id, plaintext in stored:
            self.db.cache_object(object_id, kind, plaintext)
            self.db.add_outbox(object_id, kind)
            if kind == "index":
                self.db.set_index_state(object_id, "local")

    def _record_packs(self, packs: list[FinishedPack], refreshed: list[IndexRow]) -> None:
        with self.db.transaction():
            for pack in packs:
                self.db.add_locations(pack.pack_id, pack.entries)
                self.db.add_outbox(pack.pack_id, "pack")
            self.db.upsert_index(refreshed)

    # ============================================================== push
    def push(self, message: str = "") -> PushResult:
        """Commit pending changes, upload them, and make them master through pPaxos.

        A quorum of acceptors is consulted before anything changes, so with too
        few reachable nothing is committed or uploaded. If master moved since the
        last pull, the local commits are merged with it three ways (see
        :mod:`metasync.merge`), the folder is updated, and the merge is proposed --
        again until it wins. Objects are uploaded before the commit naming them is
        proposed.
        """
        self._resume_checkout()
        latest = self.learn_latest()
        crash_point("push:learned")
        if latest.config != self.config_id:
            # Place this push's objects by the new configuration's mapping.
            self._integrate(latest)
        result = self.commit(message)
        uploaded = self._flush_outbox()
        self._repair_missing_copies()
        conflicts: list[str] = []
        for _ in range(MAX_MERGES):
            if latest.number > self.prev.number:
                conflicts += self._integrate(latest).conflicts
                more = self._flush_outbox()
                uploaded = (uploaded[0] + more[0], uploaded[1] + more[1])
            prev, head = self.prev, self.head
            missing = len(self.db.missing_copies())
            if head is None or head == prev.master:
                return PushResult(prev, result, *uploaded, up_to_date=True,
                                  missing_copies=missing, conflicts=conflicts)
            proposal = Version(prev.number + 1, head, prev.config)
            crash_point("push:propose")
            chosen = self.consensus.propose(proposal.number, proposal)
            crash_point("push:decided")
            if chosen == proposal:
                self._record_decided(chosen)
                self.consensus.publish(chosen)
                self._publish_client_state()
                return PushResult(chosen, result, *uploaded, missing_copies=missing,
                                  conflicts=conflicts)
            latest = self.learn_latest()
        raise BackendError(
            f"other clients kept committing during {MAX_MERGES} merges; run `metasync push` again",
            transient=True,
        )

    def _record_decided(self, version: Version) -> None:
        """``version`` (whose master is our head) is decided: it is the new base."""
        with self.db.transaction():
            for name, value in self._base_settings(version).items():
                self.db.set(name, value)
            self.db.set("announced", [])  # all of it is reachable from master now
            for index_id in self.db.local_indexes():
                self.db.set_index_state(index_id, "remote")
        self._adopt_config()

    def _flush_outbox(self) -> tuple[int, int]:
        """Upload queued objects: all packs, then indexes, then commits, so nothing
        on a backend ever refers to an object that is not there yet."""
        pending = self.db.outbox()
        if pending:
            self._publish_client_state([sid for sid, _ in pending])
        total = 0
        count = 0
        sizes = {sid: (self.meta / "outbox" / sid).stat().st_size for sid, _ in pending}
        self.reporter.start("upload", sum(sizes.values()) * self.config.replicas)
        try:
            for phase in ("pack", "index", "commit"):
                items = [(sid, self._outbox_loader(sid)) for sid, kind in pending if kind == phase]
                if not items:
                    continue

                def done(stored_id: str, written: int, failures: dict[str, str]) -> None:
                    nonlocal total, count
                    with self.db.transaction():
                        for backend_id in failures:
                            self.db.add_missing_copy(stored_id, backend_id)
                        self.db.remove_outbox(stored_id)
                    (self.meta / "outbox" / stored_id).unlink(missing_ok=True)
                    total += written
                    count += 1
                    self.reporter.advance(sizes[stored_id] * self.config.replicas)
                    crash_point("upload")

                self.store.upload(items, done)
        finally:
            self.reporter.finish()
        return count, total

    def _outbox_loader(self, stored_id: str) -> Callable[[], BinaryIO]:
        path = self.meta / "outbox" / stored_id
        return lambda: open(path, "rb")

    def _repair_missing_copies(self) -> None:
        """Retry copies a backend refused earlier, taking the data from a good copy."""
        for stored_id, backend_id in self.db.missing_copies():
            if backend_id in self.store.down:
                continue
            data: bytes | None = None
            for other in self.store.holders(stored_id):
                if other == backend_id:
                    continue
                try:
                    data = self.backends[other].get(object_key(stored_id))
                    break
                except BackendError:
                    continue
            if data is not None and self.store.put_copy(backend_id, stored_id, data) is None:
                with self.db.transaction():
                    self.db.remove_missing_copy(stored_id, backend_id)

    def _publish_client_state(self, pending: list[str] | None = None) -> None:
        """Per-client data (paper 3.1): this client's head and prev on every backend.

        With ``pending`` -- the objects it is about to upload -- this is the push's
        announcement to garbage collection: written to a majority of the backends
        before the first upload (or the push fails), so a gc that lists an upload
        also reads its announcement and keeps it (docs/design.md, "Garbage
        collection"). Announced objects stay in the state until a push of this
        client is decided. Without ``pending``, best effort."""
        announced = set(self.db.get("announced", []))
        if pending:
            announced |= set(pending)
            with self.db.transaction():
                self.db.set("announced", sorted(announced))
        state: dict[str, Any] = {"head": self.head, "prev": self.prev.to_json()}
        if announced:
            # Every object uploaded since the last decided push stays announced: a
            # local commit not decided yet may still need it.
            state["pending"] = sorted(announced)
        name = f"clients/{self.client_id}"
        data = self.codec.encode("client", name, json.dumps(state).encode())

        def one(backend: Backend) -> str | None:
            try:
                backend.put(name, data)
            except MetasyncError as exc:
                return f"{backend.name}: {exc}"
            return None

        failures = [f for f in self.store.executor.map(one, self.backends.values()) if f]
        written = len(self.backends) - len(failures)
        if pending and written <= len(self.backends) // 2:
            raise BackendUnavailable(
                f"could not announce the upload on a majority of the backends "
                f"({written} of {len(self.backends)}: {failures[0]}); nothing was uploaded; retry"
            )

    # ============================================================== pull
    def pull(self) -> PullResult:
        """Bring master into the folder.

        Local commits not yet pushed are merged with master three ways into a new
        local commit (pushed by the next ``push``). Uncommitted changes stay in the
        folder: a remote change applies only where the file is unchanged here;
        where both changed, the local file is kept as a conflict copy; a remote
        delete of a locally changed file keeps the file.
        """
        remove_stale_temps(self.root)
        resumed = self._resume_checkout()
        latest = self.learn_latest()
        if latest.number == self.prev.number and not (self.head is None and latest.master):
            return resumed or PullResult(self.prev, up_to_date=True)
        result = self._integrate(latest)
        self._publish_client_state()
        return result

    def _integrate(self, learned: Version) -> PullResult:
        """Make ``learned`` (decided, newer than prev) the base of head and the folder:
        fast-forward if there are no local commits, else a three-way merge commit.

        The new head, prev and the pending checkout are recorded in one transaction
        before the folder changes, so a crash leaves a checkout the next command
        finishes (:meth:`_resume_checkout`).
        """
        prev, head = self.prev, self.head
        if head is not None and head != prev.master:
            first = learned if learned.number == prev.number + 1 else self.consensus.learn(prev.number + 1)
            if first is not None and first.master == head:
                # Our commit won, but we stopped before recording it (a crash).
                self._record_decided(first)
                prev = first
                if learned == first:
                    return PullResult(learned, up_to_date=True)
        if learned.master is None or (learned.master == prev.master and head == prev.master):
            # Nothing new in the folder (the first versions, or only a configuration change).
            with self.db.transaction():
                for name, value in self._base_settings(learned).items():
                    self.db.set(name, value)
            self._adopt_config()
            return PullResult(learned, up_to_date=True)
        theirs = self.load_commit(learned.master)
        epoch = self.load_config(learned.config).gc_epoch
        if epoch > int(self.db.get("gc_epoch", 0)):
            self._forget_collected(epoch)
        self._load_indexes(theirs)
        ours = self._head_commit()
        from_tree = ours.tree if ours is not None else None
        if head is None or head == prev.master:
            with self.db.transaction():
                self.db.set("head", learned.master)
                for name, value in self._base_settings(learned).items():
                    self.db.set(name, value)
                self.db.set("checkout_pending", {"from": from_tree, "to": theirs.tree, "moves": {}})
            self._adopt_config()
            return self._run_checkout()
        assert ours is not None
        base_commit = self.load_commit(prev.master) if prev.master else None
        ours_flat = self.flatten(ours.tree)
        writer = _ObjectWriter(self)
        self._repack_collected(ours_flat, writer)
        from metasync.merge import Side, merge_trees

        merged, conflicts = merge_trees(
            self.flatten(base_commit.tree if base_commit else None),
            Side(ours_flat, ours.device, _stamp(ours.time_ns)),
            Side(self.flatten(theirs.tree), theirs.device, _stamp(theirs.time_ns)),
        )
        files = {p: e for p, e in merged.items() if e.type != "dir"}
        dirs = {p for p, e in merged.items() if e.type == "dir"}
        root_id, trees = self._build_trees(files, dirs)
        moves = {c.copy: c.path for c in conflicts if c.moved == "ours"}
        self._seal_commit(
            writer, root_id, trees, parents=(learned.master, head),
            message=f"merge version {learned.number}", inherited=[theirs, ours], refreshed=[],
            settings={**self._base_settings(learned),
                      "checkout_pending": {"from": from_tree, "to": root_id, "moves": moves}},
        )
        self._adopt_config()
        for c in conflicts:
            self.reporter.note(f"conflict: {c.path} changed on both sides; the other version is {c.copy}")
        crash_point("merge:sealed")
        result = self._run_checkout()
        result.conflicts[:0] = [c.copy for c in conflicts]
        return result

    def _forget_collected(self, epoch: int) -> None:
        """A gc collected packs since this client last looked: forget where every
        object was, except in this client's own unpublished packs, so nothing is
        deduplicated against a collected object; the new master's indexes (written
        by the gc, listing exactly what survived) are read next."""
        local = {sid for sid, kind in self.db.outbox() if kind == "pack"}
        for index_id in self.db.local_indexes():
            data = self.db.cached_object(index_id)
            if data is not None:
                local |= {pack_id for pack_id, _ in Index.from_bytes(data).packs}
        with self.db.transaction():
            self.db.purge_locations(local)
            self.db.forget_indexes(set())
            self.db.set("gc_epoch", epoch)

    def _repack_collected(self, flat: dict[str, TreeEntry], writer: _ObjectWriter) -> None:
        """Objects an unpushed local commit shares with content a concurrent gc
        collected (it deduplicated against them just before): pack them again from
        the folder, so the merge commit about to be made refers only to objects
        that exist. Content no longer in the folder cannot be recovered: fail."""
        lost: list[str] = []
        for path, entry in flat.items():
            if entry.type not in ("file", "chunked"):
                continue
            needed = [entry.ref]
            cached = self.db.cached_object(entry.ref) if entry.type == "chunked" else None
            if cached is not None:
                needed += [c.blob_id for c in FileObject.from_bytes(cached).chunks]
            if all(self.db.is_located(i) for i in needed):
                continue
            try:
                st = os.lstat(self.root / path)
            except OSError:
                lost.append(path)
                continue
            scanned = ScanEntry(path, "file", st.st_size, st.st_mtime_ns, st.st_ino,
                                entry.executable)
            got = self._hash_one(scanned, writer.sink) if stat.S_ISREG(st.st_mode) else None
            if got is None or got[1] != entry.ref:
                lost.append(path)
        if lost:
            raise ObjectUnavailable(
                f"{len(lost)} file(s) of your unpushed changes ({', '.join(sorted(lost)[:3])}) "
                "shared content with files a concurrent gc collected, and that content is no "
                "longer in the folder; restore them from your backup or re-create them, then push"
            )

    def _resume_checkout(self) -> PullResult | None:
        """Finish a checkout a crash interrupted; ``None`` if none was pending."""
        pending = self.db.get("checkout_pending")
        if pending is None:
            return None
        if not isinstance(pending, dict) or "to" not in pending:
            with self.db.transaction():
                self.db.set("checkout_pending", None)
            return None
        remove_stale_temps(self.root)
        return self._run_checkout()

    def _run_checkout(self) -> PullResult:
        """Change the folder from tree ``from`` to tree ``to`` of the pending checkout."""
        pending = self.db.get("checkout_pending")
        result = PullResult(self.prev)
        head = self._head_commit()
        if head is not None:
            self._load_indexes(head)
        self._checkout(self.flatten(pending["from"]), self.flatten(pending["to"]), result,
                       pending.get("moves") or {})
        crash_point("checkout:done")
        with self.db.transaction():
            self.db.set("checkout_pending", None)
            for index_id in self.db.local_indexes():
                if head is not None and index_id in head.indexes and self.head == self.prev.master:
                    self.db.set_index_state(index_id, "remote")
        return result

    def _checkout(
        self,
        base: dict[str, TreeEntry],
        remote: dict[str, TreeEntry],
        result: PullResult,
        moves: dict[str, str],
    ) -> None:
        """Three-way between ``base`` (what the folder was), the folder, and ``remote``.

        ``moves`` maps new paths to paths whose current content they take (a merge's
        conflict copies of local versions): renamed locally instead of downloaded.
        """
        files, dirs, refreshed, _ = self._scan(None)
        local: dict[str, TreeEntry] = dict(files)
        for d in dirs:
            local[d] = TreeEntry(d.rpartition("/")[2], "dir", "0" * 64)
        stamp = datetime.now().strftime("%Y-%m-%d %H%M%S")
        for copy, source in sorted(moves.items()):
            have = local.get(source)
            if (copy not in local and have is not None and copy in remote
                    and same_entry(have, remote[copy]) and same_entry(have, base.get(source))):
                parent = copy.rpartition("/")[0]
                if parent:
                    self._ensure_dir(parent, stamp, result)
                os.rename(self.root / source, self.root / copy)
                local[copy] = local.pop(source)
                self._last_scan.pop(source, None)
        scanned = {e.path: e for e in refreshed}

        writes: list[tuple[str, TreeEntry]] = []
        deletes: list[str] = []
        for path in sorted(set(base) | set(remote)):
            b, n, loc = base.get(path), remote.get(path), local.get(path)
            if n is not None and n.type == "dir":
                # Folders are created below. A file that master replaced by a folder
                # goes if unchanged here; if changed, creating the folder keeps it as
                # a conflict copy.
                if b is not None and b.type != "dir" and same_entry(loc, b):
                    deletes.append(path)
                continue
            if b is not None and b.type == "dir" and n is None:
                continue  # a removed folder: its contents are paths of their own
            if same_entry(n, b) or same_entry(loc, n):
                continue
            if same_entry(loc, b):
                if n is None:
                    deletes.append(path)
                else:
                    writes.append((path, n))
            elif n is None:
                self.reporter.note(f"kept {path}: deleted remotely but changed here")
            else:
                if loc is not None and loc.type != "dir":
                    copy = self._conflict_copy(path, stamp)
                    result.conflicts.append(copy)
                    self.reporter.note(f"conflict: your version of {path} is now {copy}")
                writes.append((path, n))
        crash_point("checkout:planned")
        for path in deletes:
            target_path = self.root / path
            try:
                if target_path.is_dir() and not target_path.is_symlink():
                    continue
                if self._changed_since_scan(path):
                    self.reporter.note(f"kept {path}: it changed during the pull")
                    continue
                target_path.unlink()
                result.deleted += 1
            except FileNotFoundError:
                pass
        # Folders deleted remotely go if nothing local remains in them, deepest first.
        for path in sorted((p for p, e in base.items() if e.type == "dir" and p not in remote),
                           key=lambda p: p.count("/"), reverse=True):
            try:
                (self.root / path).rmdir()
            except OSError:
                pass
        for path in sorted((p for p, e in remote.items() if e.type == "dir"), key=lambda p: p.count("/")):
            b = base.get(path)
            if b is not None and b.type == "dir" and path not in local:
                continue  # removed here, untouched remotely: stays removed (files
                # the remote changed inside bring their folders back as they are written)
            self._ensure_dir(path, stamp, result)
        rows = self._write_files(writes, stamp, result, scanned)
        with self.db.transaction():
            self.db.delete_index(deletes)
            self.db.upsert_index(rows)
            self.db.upsert_index(r for r in refreshed if r.path not in {w[0] for w in writes})

    def _changed_since_scan(self, path: str, st: os.stat_result | None = None) -> bool:
        """True if ``path`` exists now but differs in size or mtime from the scan the
        pull planned with (or did not exist then): replacing it could lose an edit."""
        if st is None:
            try:
                st = os.lstat(self.root / path)
            except FileNotFoundError:
                return False
        seen = self._last_scan.get(path)
        return seen is None or seen.size != st.st_size or seen.mtime_ns != st.st_mtime_ns

    def _conflict_copy(self, path: str, stamp: str) -> str:
        parent, _, name = path.rpartition("/")
        new_name = conflict_name(name, self.device, stamp)
        new_path = f"{parent}/{new_name}" if parent else new_name
        n = 2
        while os.path.lexists(self.root / new_path):
            alt = conflict_name(name, f"{self.device} {n}", stamp)
            new_path = f"{parent}/{alt}" if parent else alt
            n += 1
        os.rename(self.root / path, self.root / new_path)
        return new_path

    def _ensure_dir(self, path: str, stamp: str, result: PullResult) -> None:
        """Make ``path`` a real folder; a file or link in the way becomes a conflict copy."""
        current = self.root
        for part in path.split("/"):
            current = current / part
            try:
                st = os.lstat(current)
            except FileNotFoundError:
                current.mkdir()
                continue
            if not stat.S_ISDIR(st.st_mode):
                rel = str(current.relative_to(self.root))
                copy = self._conflict_copy(rel, stamp)
                result.conflicts.append(copy)
                self.reporter.note(f"conflict: {rel} is in the way of a folder; moved to {copy}")
                current.mkdir()

    def _write_files(
        self,
        writes: list[tuple[str, TreeEntry]],
        stamp: str,
        result: PullResult,
        scanned: dict[str, IndexRow],
    ) -> list[IndexRow]:
        """Write files and links through temporary files, renamed in flushed batches.

        Files whose content is one blob are grouped by the pack holding it, so a pack
        of a thousand small files costs a few range reads, not a thousand.
        """
        ensured: set[str] = set()
        by_pack: dict[str, list[tuple[int, WritePlan]]] = {}
        jobs: list[list[WritePlan]] = []
        links: list[WritePlan] = []
        total = 0
        for path, entry in writes:
            parent = path.rpartition("/")[0]
            if parent and parent not in ensured:
                self._ensure_dir(parent, stamp, result)
                while parent and parent not in ensured:
                    ensured.add(parent)
                    parent = parent.rpartition("/")[0]
            total += entry.size
            if entry.type == "link":
                links.append((path, entry, []))
            elif entry.type == "file":
                loc = self.db.location(entry.ref)
                if loc is None:
                    raise ObjectUnavailable(f"object {entry.ref[:12]} is in no known pack")
                by_pack.setdefault(loc[0], []).append(
                    (loc[1].offset, (path, entry, [(entry.ref, entry.size)])))
            else:
                jobs.append([(path, entry, self._file_chunks(entry))])
        for placed in by_pack.values():
            # In pack order: each job's blobs are then neighbours, so its coalesced
            # range reads cover only them (in path order they are scattered over the
            # pack, and every job would read most of it).
            placed.sort(key=lambda item: item[0])
            plans = [plan for _, plan in placed]
            jobs.extend(plans[k : k + JOB_FILES] for k in range(0, len(plans), JOB_FILES))
        if links:
            jobs.append(links)

        rows: list[IndexRow] = []
        pending: list[WrittenTemp] = []
        self.reporter.start("download", total)
        futures = [self.store.executor.submit(self._write_job, job) for job in jobs]
        try:
            for fut in futures:
                pending.extend(fut.result())
                if len(pending) >= WRITE_BATCH:
                    rows += self._install(pending, stamp, result)
                    pending = []
            rows += self._install(pending, stamp, result)
            pending = []
        except BaseException:
            for fut in futures:  # leave no temporary file behind
                fut.cancel()
                if not fut.cancelled() and fut.exception() is None:
                    pending.extend(fut.result())
            for _, tmp, _ in pending:
                tmp.unlink(missing_ok=True)
            raise
        finally:
            self.reporter.finish()
        return rows

    def _install(
        self, pending: list[WrittenTemp], stamp: str, result: PullResult
    ) -> list[IndexRow]:
        """Flush a batch of written temporary files once, then rename each into place."""
        if not pending:
            return []
        os.sync()  # one flush for the batch instead of an fsync per file
        written_at = _now_ns()

        def fast(item: WrittenTemp) -> bool:
            """Rename into a free or unchanged place; False leaves it to the slow path."""
            (path, _, _), tmp, _ = item
            final = os.path.join(self.root, path)
            try:
                existing = os.lstat(final)
            except FileNotFoundError:
                os.replace(tmp, final)
                return True
            if stat.S_ISDIR(existing.st_mode) or self._changed_since_scan(path, existing):
                return False
            os.replace(tmp, final)
            return True

        # Serial on purpose: renames into the same folders contend on the folder's
        # lock, and measured slower when spread over threads.
        done = []
        for item in pending:
            done.append(fast(item))
            crash_point("checkout:rename")
        rows: list[IndexRow] = []
        for ((path, entry, _), tmp, st), ok in zip(pending, done, strict=True):
            if not ok:
                self._install_slow(path, tmp, stamp, result)
            result.written += 1
            if st is not None:  # renaming keeps the inode and mtime of the temporary file
                rows.append(IndexRow(path, entry.type, entry.ref, st.st_size,
                                     entry.executable, st.st_mtime_ns, st.st_ino, written_at))
        return rows

    def _install_slow(self, path: str, tmp: Path, stamp: str, result: PullResult) -> None:
        """Put ``tmp`` at ``path`` where a folder or a changed file is in the way."""
        final = os.path.join(self.root, path)
        try:
            existing: os.stat_result | None = os.lstat(final)
        except FileNotFoundError:
            existing = None
        if existing is not None and stat.S_ISDIR(existing.st_mode):
            try:
                os.rmdir(final)
            except OSError:
                result.conflicts.append(self._conflict_copy(path, stamp))
        elif existing is not None and self._changed_since_scan(path, existing):
            # Edited (or created) while we were downloading: keep it.
            copy = self._conflict_copy(path, stamp)
            result.conflicts.append(copy)
            self.reporter.note(f"conflict: {path} changed during the pull; kept as {copy}")
        os.replace(tmp, final)

    def _write_job(self, job: list[WritePlan]) -> list[WrittenTemp]:
        """Write the temporary files of one job (runs in a worker thread)."""
        prefetched: dict[str, bytes] | None = None
        if len(job) > 1 and all(len(chunks) == 1 for _, _, chunks in job):
            prefetched = self._read_blobs([chunks[0] for _, _, chunks in job])
        done: list[WrittenTemp] = []
        try:
            for plan in job:
                done.append((plan, *self._write_temp(plan, prefetched)))
        except BaseException:
            for _, tmp, _ in done:
                tmp.unlink(missing_ok=True)
            raise
        return done

    def _write_temp(
        self, plan: WritePlan, prefetched: dict[str, bytes] | None = None
    ) -> tuple[Path, os.stat_result | None]:
        """Write one file or link to a temporary name beside its target; return the
        name and, for a file, its final stat (size, mtime and inode survive the rename)."""
        path, entry, chunks = plan
        tmp = temp_path_for(self.root / path)
        if entry.type == "link":
            os.symlink(entry.ref, tmp)
            return tmp, None
        mode = self._file_modes[entry.executable]
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
        try:
            with os.fdopen(fd, "wb") as fh:
                for group in _chunk_groups(chunks):
                    data = prefetched if prefetched is not None else self._read_blobs(group)
                    for blob_id, length in group:
                        piece = data[blob_id]
                        if len(piece) != length:
                            raise CorruptObject(f"blob {blob_id[:12]} has the wrong length")
                        fh.write(piece)
                        self.reporter.advance(length)
                fh.flush()
                st = os.fstat(fh.fileno())
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return tmp, st

    def _read_blobs(self, group: list[tuple[str, int]]) -> dict[str, bytes]:
        by_pack: dict[str, list[PackEntry]] = {}
        for blob_id, _ in group:
            loc = self.db_location(blob_id)
            by_pack.setdefault(loc[0], []).append(loc[1])
        data: dict[str, bytes] = {}
        for pack_id, entries in by_pack.items():
            unique = list({e.object_id: e for e in entries}.values())
            data.update(self.store.read_entries(pack_id, unique))
        return data

    def db_location(self, object_id: str) -> tuple[str, PackEntry]:
        """Location lookup usable from worker threads (own read-only connection)."""
        conn = getattr(_thread_conns, "conn", None)
        if conn is None or getattr(_thread_conns, "path", None) != self.db.path:
            import sqlite3

            conn = sqlite3.connect(f"file:{self.db.path}?mode=ro", uri=True)
            _thread_conns.conn, _thread_conns.path = conn, self.db.path
        found = location_in(conn, object_id)
        if found is None:
            raise ObjectUnavailable(f"object {object_id[:12]} is in no known pack")
        return found

    # ============================================================== log
    def log(self, limit: int | None = None) -> list[LogEntry]:
        """The linear history: commits from head back to the first along first
        parents (a merge's first parent is the version it merged into), newest first."""
        out: list[LogEntry] = []
        current = self.head or self.prev.master
        while current and (limit is None or len(out) < limit):
            c = self.load_commit(current)
            out.append(LogEntry(current, c.device, c.client, c.time_ns, c.message, c.parents))
            current = c.parents[0] if c.parents else None
        return out

    # ============================================================== maintenance helpers
    @contextmanager
    def reading_with(self, config: Config) -> Iterator[None]:
        """Read and place objects by ``config`` (a newer configuration this client has
        not made its base yet) for the duration."""
        if config == self.config:
            yield
            return
        old_config, old_backends = self.store.config, self.store.backends
        self.store.reconfigure(config, self.open_backends(config))
        try:
            yield
        finally:
            self.store.reconfigure(old_config, old_backends)

    def index_objects(
        self, packs: list[tuple[str, tuple[PackEntry, ...]]]
    ) -> list[tuple[str, str, bytes]]:
        """``("index", id, plaintext)`` objects listing ``packs`` (bounded in size)."""
        return self._index_objects(packs)

    def upload_standalone(self, stored: list[tuple[str, str, bytes]]) -> None:
        """Encode and upload standalone objects ``(kind, id, plaintext)`` to their
        holders now (copies that fail are recorded for repair)."""
        encoded = {object_id: self.codec.encode(kind, object_id, plaintext)
                   for kind, object_id, plaintext in stored}

        def done(stored_id: str, size: int, failures: dict[str, str]) -> None:
            with self.db.transaction():
                for backend_id in failures:
                    self.db.add_missing_copy(stored_id, backend_id)

        self.store.upload(
            [(object_id, _bytes_loader(data)) for object_id, data in encoded.items()], done)

    def read_index(self, index_id: str) -> Index:
        """An index object, from the local cache or the backends."""
        data = self.db.cached_object(index_id)
        if data is None:
            data = self.store.get_standalone("index", index_id)
            with self.db.transaction():
                self.db.cache_object(index_id, "index", data)
        return Index.from_bytes(data)

    def reachable_objects(self, commit: Commit) -> set[str]:
        """Every tree, file object and blob ``commit``'s tree needs."""
        self._load_indexes(commit, historic=True)
        out = {commit.tree}
        for entry in self.flatten(commit.tree).values():
            if entry.type in ("dir", "file"):
                out.add(entry.ref)
            elif entry.type == "chunked":
                out.add(entry.ref)
                out.update(b for b, _ in self._file_chunks(entry))
        return out

    # ============================================================== storage changes
    def add_backend(self, uri: str, capacity: float | None = None) -> ConfigChange:
        """Add the backend at ``uri`` (capacity in GB; default: the others' mean) and
        move to it exactly the copies the new placement gives it."""
        from metasync import maintenance

        uri = normalize_uri(uri)
        latest = self.learn_latest()
        current = self.load_config(latest.config)
        if public_uri(uri) in {b.uri for b in current.backends}:
            raise UsageError(f"{public_uri(uri)} is already a backend of this repository")
        backend = open_backend(uri, current.namespace)
        spec = maintenance.new_backend_spec(uri, capacity, current)
        maintenance.prepare_new_backend(self, backend, spec.id)
        self._opened[spec.id] = backend
        if public_uri(uri) != uri:
            with self.db.transaction():
                self.db.set("uri_overrides", {**self.db.get("uri_overrides", {}), spec.id: uri})

        def make_new(config: Config) -> Config:
            if spec.uri in {b.uri for b in config.backends}:
                raise UsageError(f"{spec.uri} is already a backend of this repository")
            return replace(config, backends=(*config.backends, spec),
                           acceptors=(*config.acceptors, spec.id))

        return maintenance.reconfigure(self, make_new)

    def remove_backend(self, name: str) -> ConfigChange:
        """Remove a backend (by id or URI): first copy what only it would hold to
        the others, then decide the change, then empty it (if it can be reached).
        Works when the backend is gone for good, from the remaining copies."""
        from metasync import maintenance

        latest = self.learn_latest()
        removed = maintenance.resolve_backend(self.load_config(latest.config), name)
        gone = self.open_backends(self.load_config(latest.config))[removed.id]

        def make_new(config: Config) -> Config:
            spec = maintenance.resolve_backend(config, removed.id)
            rest = tuple(b for b in config.backends if b.id != spec.id)
            acceptors = tuple(a for a in config.acceptors if a != spec.id)
            if not rest:
                raise UsageError("cannot remove the last backend")
            if len(rest) < config.replicas:
                raise UsageError(
                    f"{len(rest)} backends would remain for {config.replicas} replicas; lower "
                    f"them first: metasync config replicas {len(rest)}"
                )
            if config.erasure is not None and len(rest) < config.erasure[1]:
                raise UsageError(
                    f"erasure coding {config.erasure[0]}/{config.erasure[1]} needs "
                    f"{config.erasure[1]} backends; add one before removing this one"
                )
            if config.fault_model == "byzantine" and len(acceptors) < 4:
                raise UsageError("a --bft repository needs at least 4 backends; add one first")
            return replace(config, backends=rest, acceptors=acceptors)

        return maintenance.reconfigure(self, make_new, extra={removed.id: gone})

    def resize_backend(self, name: str, capacity: float) -> ConfigChange:
        """Give a backend a new capacity (GB): it then holds that share of the copies."""
        from metasync import maintenance

        if not capacity > 0:
            raise UsageError("the capacity must be a positive number of GB")

        def make_new(config: Config) -> Config:
            spec = maintenance.resolve_backend(config, name)
            backends = tuple(replace(b, capacity=capacity) if b.id == spec.id else b
                             for b in config.backends)
            return replace(config, backends=backends)

        return maintenance.reconfigure(self, make_new)

    def set_replicas(self, replicas: int) -> ConfigChange:
        """Keep ``replicas`` copies of every object from now on (and of every object
        there is: the missing copies are written, the extra ones dropped)."""
        from metasync import maintenance

        def make_new(config: Config) -> Config:
            if not 1 <= replicas <= len(config.backends):
                raise UsageError(
                    f"replicas must be between 1 and {len(config.backends)} (the number of backends)"
                )
            return replace(config, replicas=replicas)

        return maintenance.reconfigure(self, make_new)

    def rebalance(self) -> RebalanceReport:
        """Put every object on the backends the latest configuration names for it and
        drop copies no longer needed: finishes an interrupted change."""
        from metasync import maintenance

        latest = self.learn_latest()
        config = self.load_config(latest.config)
        report = maintenance.rebalance(self, config, drop=True)
        with self.db.transaction():
            self.db.set("rebalance_pending", None)
        return report

    def backend_list(self) -> BackendListing:
        """Every backend of the latest configuration with what it holds."""
        from metasync import maintenance

        latest = self.learn_latest()
        config = self.load_config(latest.config)
        return maintenance.list_backends(self, config)

    # ============================================================== history
    def snapshot(self, name: str) -> Version:
        """Keep master as it is now under ``name``: gc never collects it."""
        from metasync import maintenance

        if not is_snapshot_name(name):
            raise UsageError(f"invalid snapshot name {name!r}; use letters, digits, '.', '_' or '-'")

        def make_new(config: Config) -> Config:
            master = self.learn_latest().master
            if master is None:
                raise UsageError("nothing to keep yet: push something first")
            if config.snapshot(name) is not None:
                raise UsageError(f"snapshot {name!r} exists; delete it first or choose another name")
            return replace(config, snapshots=tuple(sorted((*config.snapshots, (name, master)))))

        return maintenance.change_config(self, make_new).version

    def delete_snapshot(self, name: str) -> Version:
        """Let gc collect what only snapshot ``name`` kept."""
        from metasync import maintenance

        def make_new(config: Config) -> Config:
            if config.snapshot(name) is None:
                raise UsageError(f"no snapshot named {name!r}")
            return replace(config, snapshots=tuple(s for s in config.snapshots if s[0] != name))

        return maintenance.change_config(self, make_new).version

    def snapshots(self) -> list[tuple[str, str]]:
        """``(name, commit id)`` of every snapshot, by name."""
        return list(self.load_config(self.learn_latest().config).snapshots)

    def set_retention(self, days: int) -> Version:
        """Keep every version for ``days`` days before gc may collect what only it needs."""
        from metasync import maintenance

        if days < 0:
            raise UsageError("the retention must be zero or more days")
        return maintenance.change_config(
            self, lambda config: replace(config, retention_days=days)).version

    def gc(self, log_grace_s: float | None = None) -> GcReport:
        """Delete what no version within the retention, no snapshot, no client's state
        and no push in progress needs, and compact old pPaxos logs (see
        :func:`metasync.maintenance.collect_garbage`)."""
        from metasync import maintenance

        return maintenance.collect_garbage(self, log_grace_s=log_grace_s)

    def restore(self, path: str, version: str | None = None, to: str | Path | None = None) -> RestoreResult:
        """Bring back ``path`` (a file or a folder, relative to the repository) as it
        was in an earlier version: ``version`` is a commit id prefix, a snapshot
        name or ``~N`` (N versions back); by default the newest version in which it
        existed and differed from the folder. Written to ``to`` (default: ``path``);
        a file in the way whose content is not in history is kept as a conflict copy."""
        path = _repo_path(path)
        latest = self.learn_latest()
        config = self.load_config(latest.config)
        if latest.master is None:
            raise UsageError("nothing has been pushed yet")
        with self.reading_with(config):
            commit_id, tree = self._find_version(path, version, latest.master, config)
            commit = self.load_commit(commit_id)
            wanted = {p: e for p, e in tree.items() if p == path or p.startswith(path + "/")}
            dest_root = Path(to).absolute() if to is not None else self.root / path
            head = self._head_commit()
            current = self.flatten(head.tree) if head is not None else {}
            result = RestoreResult(commit_id, commit.time_ns, str(dest_root))
            stamp = datetime.now().strftime("%Y-%m-%d %H%M%S")
            for p, entry in sorted(wanted.items()):
                rel = p[len(path):].lstrip("/")
                dest = dest_root / rel if rel else dest_root
                self._restore_entry(entry, dest, current.get(p) if to is None else None, stamp, result)
        return result

    def _find_version(
        self, path: str, version: str | None, master: str, config: Config
    ) -> tuple[str, dict[str, TreeEntry]]:
        from metasync.maintenance import _history

        chain: list[str] = []
        current: str | None = master
        while current is not None:  # first parents: the versions master went through
            chain.append(current)
            parents = self.load_commit(current).parents
            current = parents[0] if parents else None
        history = _history(self, master)

        def pruned(cid: str) -> bool:
            return (history[cid].time_ns < config.gc_cutoff_ns and cid != master
                    and cid not in dict(config.snapshots).values())

        if version is not None:
            if config.snapshot(version) is not None:
                commit_id = config.snapshot(version)
            elif version.startswith("~") and version[1:].isdigit():
                n = int(version[1:])
                if n >= len(chain):
                    raise UsageError(f"history has only {len(chain)} versions; {version} is too far back")
                commit_id = chain[n]
            else:
                found = [c for c in history if c.startswith(version.lower())] if len(version) >= 4 else []
                if len(found) != 1:
                    raise UsageError(f"{version!r} names {'no' if not found else 'more than one'} "
                                     "version; give a commit id (metasync log), a snapshot or ~N")
                commit_id = found[0]
            assert commit_id is not None
            if pruned(commit_id):
                raise UsageError(f"version {commit_id[:12]} is older than the retention and gc "
                                 "collected its files; snapshot versions you want to keep")
            tree = self.tree_at(commit_id)
            if path not in tree:
                raise UsageError(f"{path} is not in version {commit_id[:12]}")
            return commit_id, tree
        for cid in chain:
            if pruned(cid):
                break
            tree = self.tree_at(cid)
            if path in tree and not self._same_as_folder(path, tree):
                return cid, tree
        raise UsageError(f"no kept version has a {path} that differs from the folder's; "
                         "see `metasync log` and use --version")

    def _same_as_folder(self, path: str, tree: dict[str, TreeEntry]) -> bool:
        """True if every file of ``tree`` at or under ``path`` is in the folder as is."""
        for p, entry in tree.items():
            if p != path and not p.startswith(path + "/"):
                continue
            if not _matches(self, self.root / p, entry):
                return False
        return True

    def _restore_entry(self, entry: TreeEntry, dest: Path, in_head: TreeEntry | None,
                       stamp: str, result: RestoreResult) -> None:
        if entry.type == "dir":
            dest.mkdir(parents=True, exist_ok=True)
            return
        if os.path.lexists(dest):
            if _matches(self, dest, entry):
                return  # already as it was
            if in_head is None or not _matches(self, dest, in_head):
                # Its content is in no version: keep it under a conflict name.
                copy = dest.with_name(conflict_name(dest.name, self.device, stamp))
                os.rename(dest, copy)
                result.conflicts.append(str(copy))
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = temp_path_for(dest)
        try:
            if entry.type == "link":
                os.symlink(entry.ref, tmp)
            else:
                chunks = [(entry.ref, entry.size)] if entry.type == "file" else self._file_chunks(entry)
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW,
                             self._file_modes[entry.executable])
                with os.fdopen(fd, "wb") as fh:
                    for group in _chunk_groups(chunks):
                        data = self._read_blobs(group)
                        for blob_id, length in group:
                            if len(data[blob_id]) != length:
                                raise CorruptObject(f"blob {blob_id[:12]} has the wrong length")
                            fh.write(data[blob_id])
                    fh.flush()
                    os.fsync(fh.fileno())
            os.replace(tmp, dest)
        except BaseException:
            if os.path.lexists(tmp):
                os.unlink(tmp)
            raise
        result.restored.append(str(dest))

    # ============================================================== fsck
    def fsck(self, *, quick: bool = False, repair: bool = False) -> FsckReport:
        """Check every copy of every object reachable from master's history on every
        backend the latest configuration places it on: by downloading and verifying
        it, or with ``quick`` only that it is listed there. With ``repair``, re-create
        each missing or corrupt copy from a good one and report what was fixed.

        A gc that another client finishes meanwhile may collect versions this check
        started from: then it starts again from the new latest version (a few times)
        rather than report their objects as missing."""
        for _ in range(FSCK_ATTEMPTS):
            epoch = self.load_config(self.learn_latest().config).gc_epoch
            report = self._fsck(quick=quick, repair=False)
            if report.ok or self.load_config(self.learn_latest().config).gc_epoch == epoch:
                break
        if repair:
            report = self._fsck(quick=quick, repair=True)
        return report

    def _fsck(self, *, quick: bool, repair: bool) -> FsckReport:
        report = FsckReport()
        latest = self.learn_latest()
        config = self.load_config(latest.config)
        backends = self.open_backends(config)
        mapping = mapping_of(config)
        with self.reading_with(config):
            standalone, packs = self._reachable(latest, config, report)
        report.objects = len(standalone) + len(packs)
        coded: dict[str, dict[int, dict[str, int]]] = {}
        if config.erasure is not None:
            from metasync.maintenance import take_inventory

            fragments = take_inventory(self, backends).fragments
            wanted = {oid for _, oid in standalone} | packs
            coded = {oid: held for oid, held in fragments.items() if oid in wanted}
            self._check_fragments(config, backends, coded, quick, report)
        jobs = [(kind, oid, b) for kind, oid in standalone if oid not in coded
                for b in mapping.locate(oid)]
        jobs += [("pack", p, b) for p in sorted(packs) if p not in coded for b in mapping.locate(p)]
        if quick:
            listed = self._listed(backends, report)
            for kind, oid, b in jobs:
                report.checked_copies += 1
                if b in listed and object_key(oid) not in listed[b]:
                    report.problems.append(FsckProblem(b, kind, oid, "missing"))
        else:
            self.reporter.start("verify", len(jobs))
            try:
                for problem in self.store.executor.map(
                        lambda j: self._verify_copy(backends, *j), jobs):
                    report.checked_copies += 1
                    self.reporter.advance(1)
                    if problem is not None:
                        report.problems.append(problem)
            finally:
                self.reporter.finish()
        if repair:
            self._repair(report, backends)
            if coded:
                self._repair_fragments(config, backends, coded, report)
        return report

    def _check_fragments(
        self, config: Config, backends: dict[str, Backend],
        coded: dict[str, dict[int, dict[str, int]]], quick: bool, report: FsckReport,
    ) -> None:
        """Each of an erasure-coded object's n holders must hold a fragment of its
        own index (verified unless ``quick``)."""
        from metasync.erasure import fragment_key, verify_fragment
        from metasync.store import fragment_mapping_of

        holders_of = fragment_mapping_of(config)

        def check(item: tuple[str, dict[int, dict[str, int]]]) -> list[FsckProblem]:
            oid, held = item
            problems: list[FsckProblem] = []
            seen: set[int] = set()
            for backend_id in holders_of.locate(oid):
                mine = sorted(i for i, where in held.items() if backend_id in where and i not in seen)
                if not mine:
                    problems.append(FsckProblem(backend_id, "fragment", oid, "missing"))
                    continue
                seen.add(mine[0])
                if quick:
                    continue
                try:
                    data = backends[backend_id].get(fragment_key(oid, mine[0]))
                    verify_fragment(self.codec.hasher, oid, mine[0], data)
                except ObjectNotFound:
                    problems.append(FsckProblem(backend_id, "fragment", oid, "missing"))
                except CorruptObject:
                    problems.append(FsckProblem(backend_id, "fragment", oid, "corrupt"))
                except BackendError as exc:
                    problems.append(FsckProblem(backend_id, "fragment", oid, f"unreadable: {exc}"))
            return problems

        for problems in self.store.executor.map(check, sorted(coded.items())):
            report.checked_copies += holders_of.replicas
            report.problems += problems

    def _repair_fragments(
        self, config: Config, backends: dict[str, Backend],
        coded: dict[str, dict[int, dict[str, int]]], report: FsckReport,
    ) -> None:
        """Re-create missing or corrupt fragments from any k good ones."""
        from metasync.maintenance import _place_fragments
        from metasync.store import fragment_mapping_of

        holders_of = fragment_mapping_of(config)
        broken = {p.object_id for p in report.problems if p.kind == "fragment"}
        for oid in sorted(broken):
            outcome = _place_fragments(self, backends, holders_of.locate(oid), oid, coded[oid],
                                       False, True, {}, config)
            if not outcome.lost:
                report.repaired += [p for p in report.problems
                                    if p.object_id == oid and p.kind == "fragment"]

    def _listed(self, backends: dict[str, Backend], report: FsckReport) -> dict[str, set[str]]:
        """The object keys each reachable backend lists (an unreachable one is a problem)."""
        def listing(backend: Backend) -> set[str]:
            return set(backend.list("objects"))

        out: dict[str, set[str]] = {}
        futures = {b: self.store.executor.submit(listing, be) for b, be in backends.items()}
        for backend_id, fut in futures.items():
            try:
                out[backend_id] = fut.result()
            except MetasyncError as exc:
                report.problems.append(FsckProblem(backend_id, "-", "-", f"unreachable: {exc}"))
        return out

    def _reachable(
        self, latest: Version, config: Config, report: FsckReport
    ) -> tuple[list[tuple[str, str]], set[str]]:
        """Standalone objects ``(kind, id)`` and packs that must exist: every commit of
        master's history, and the indexes and content of every commit a gc has not
        pruned (younger than its cutoff, master, or a snapshot)."""
        from metasync.maintenance import _history

        history = _history(self, latest.master) if latest.master else {}
        kept = {cid for cid, c in history.items()
                if c.time_ns >= config.gc_cutoff_ns or cid == latest.master}
        kept |= {cid for _, cid in config.snapshots if cid in history}
        standalone = [("commit", cid) for cid in sorted(history)]
        standalone += [("index", i) for i in sorted({i for cid in kept for i in history[cid].indexes})]
        reachable: set[str] = set()
        for cid in sorted(kept):
            reachable |= self.reachable_objects(history[cid])
        packs: set[str] = set()
        for object_id in reachable:
            loc = self.db.location(object_id)
            if loc is None:
                report.problems.append(FsckProblem("-", "object", object_id, "unindexed"))
            else:
                packs.add(loc[0])
        return standalone, packs

    def _repair(self, report: FsckReport, backends: dict[str, Backend]) -> None:
        """Re-create each missing or corrupt copy from a verified good one."""
        from metasync.maintenance import verify_stored

        broken: dict[str, list[FsckProblem]] = {}
        for p in report.problems:
            if p.problem in ("missing", "corrupt") or p.problem.startswith("unreadable"):
                broken.setdefault(p.object_id, []).append(p)

        def fix(object_id: str, problems: list[FsckProblem]) -> list[FsckProblem]:
            bad = {p.backend for p in problems}
            key = object_key(object_id)
            good: bytes | None = None
            for backend_id in self.store.read_order(object_id, SMALL_READ):
                if backend_id in bad or backend_id not in backends:
                    continue
                try:
                    data = backends[backend_id].get(key)
                    verify_stored(self.codec, object_id, data)
                except MetasyncError:
                    continue
                good = data
                break
            if good is None:
                return []
            fixed = []
            for p in problems:
                try:
                    backends[p.backend].put(key, good)
                except MetasyncError:
                    continue
                fixed.append(p)
            return fixed

        self.reporter.start("repair", len(broken))
        try:
            for fixed in self.store.executor.map(lambda item: fix(*item), broken.items()):
                report.repaired += fixed
                self.reporter.advance(1)
        finally:
            self.reporter.finish()
        with self.db.transaction():
            for p in report.repaired:
                self.db.remove_missing_copy(p.object_id, p.backend)

    def _verify_copy(self, backends: dict[str, Backend], kind: str, object_id: str,
                     backend_id: str) -> FsckProblem | None:
        backend = backends[backend_id]
        try:
            data = backend.get(object_key(object_id))
        except ObjectNotFound:
            return FsckProblem(backend_id, kind, object_id, "missing")
        except BackendError as exc:
            return FsckProblem(backend_id, kind, object_id, f"unreadable: {exc}")
        try:
            if kind == "pack":
                self.codec.pack_entries(object_id, data)
            else:
                self.codec.decode(kind, object_id, data)
        except CorruptObject:
            return FsckProblem(backend_id, kind, object_id, "corrupt")
        return None

    # ============================================================== sharing
    def share(self, email: str) -> list[ShareResult]:
        """Share the repository folder with ``email`` (paper 3.8) on every backend
        whose service can (``capabilities.sharing``); the others are reported as
        needing manual sharing. A failure on one backend does not stop the others."""
        if "@" not in email or email.startswith("@") or email.endswith("@") or " " in email:
            raise UsageError(f"{email!r} is not an e-mail address")

        def one(backend: Backend) -> ShareResult:
            if not backend.capabilities.sharing:
                return ShareResult(
                    backend.name, False,
                    f"{backend.scheme or 'this'}: backends have no sharing API; give {email} "
                    f"access to {backend.name} (namespace {backend.namespace!r}) by hand",
                )
            try:
                return ShareResult(backend.name, True, backend.share(email))
            except MetasyncError as exc:
                return ShareResult(backend.name, False, f"sharing failed: {exc}")

        return list(self.store.executor.map(one, self.backends.values()))

    def backend_name(self, backend_id: str) -> str:
        backend = self._opened.get(backend_id)
        return backend.name if backend is not None else backend_id


_thread_conns = threading.local()


def _repo_path(path: str) -> str:
    """A path inside the repository, as trees name it: relative, ``/``-separated,
    with no ``.`` or ``..`` parts."""
    parts = [p for p in path.replace(os.sep, "/").split("/") if p not in ("", ".")]
    if not parts or ".." in parts or parts[0] == META_DIR:
        raise UsageError(f"{path!r} is not a path inside the repository")
    return "/".join(parts)


def _matches(repo: Repository, path: Path, entry: TreeEntry) -> bool:
    """True if the file, link or folder at ``path`` is exactly ``entry``."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    if entry.type == "dir":
        return stat.S_ISDIR(st.st_mode)
    if entry.type == "link":
        return stat.S_ISLNK(st.st_mode) and os.readlink(path) == entry.ref
    if not stat.S_ISREG(st.st_mode) or st.st_size != entry.size:
        return False
    scanned = ScanEntry(str(path), "file", st.st_size, st.st_mtime_ns, st.st_ino,
                        bool(st.st_mode & stat.S_IXUSR))
    try:
        hashed = repo.chunker.hash_file(path, scanned, None)
    except (OSError, FileChanged):
        return False
    return hashed.ref == entry.ref


def _bytes_loader(data: bytes) -> Callable[[], BinaryIO]:
    return lambda: io.BytesIO(data)


def _ordered_map(
    pool: ThreadPoolExecutor, fn: Callable[[ScanEntry], T], items: Iterable[ScanEntry], window: int
) -> Iterator[tuple[ScanEntry, T]]:
    """``(item, fn(item))`` in order, run on ``pool`` with at most ``window`` tasks
    queued at once (``pool.map`` makes every future up front: ~1.5 kB each, which
    for a million files is gigabytes)."""
    pending: deque[tuple[ScanEntry, Future[T]]] = deque()
    items_iter = iter(items)
    for e in itertools.islice(items_iter, window):
        pending.append((e, pool.submit(fn, e)))
    while pending:
        e, fut = pending.popleft()
        result = fut.result()
        nxt = next(items_iter, None)
        if nxt is not None:
            pending.append((nxt, pool.submit(fn, nxt)))
        yield e, result


def _tree_fingerprint(files: dict[str, TreeEntry], dirs: set[str]) -> str:
    """A digest of everything :meth:`Repository._build_trees` reads: equal
    fingerprints give equal root trees (same key, same format)."""
    # No field holds a NUL (POSIX names and link targets cannot), every field ends
    # with one, and the counts come first, so the hashed text decodes one way only.
    h = hashlib.blake2b(digest_size=32)
    h.update(f"{TREE_MEMO}\0{FORMAT_VERSION}\0{len(files)}\0{len(dirs)}\0".encode())
    batch: list[str] = []
    for path in sorted(files):
        e = files[path]
        batch.append(f"{path}\0{e.type}\0{e.ref}\0{e.size}\0{'x' if e.executable else '-'}\0")
        if len(batch) == 4096:
            h.update("".join(batch).encode("utf-8", "surrogatepass"))
            batch.clear()
    batch.extend(f"{d}\0" for d in sorted(dirs))
    h.update("".join(batch).encode("utf-8", "surrogatepass"))
    return h.hexdigest()


def _chunk_groups(chunks: list[tuple[str, int]], budget: int = 8 * 1024 * 1024) -> list[list[tuple[str, int]]]:
    """Split a file's chunks into groups of about ``budget`` bytes (bounded memory)."""
    groups: list[list[tuple[str, int]]] = [[]]
    size = 0
    for blob_id, length in chunks:
        if groups[-1] and size + length > budget:
            groups.append([])
            size = 0
        groups[-1].append((blob_id, length))
        size += length
    return [g for g in groups if g] or [[]]


def check_namespace(namespace: str) -> None:
    from metasync.backends import check_key

    try:
        check_key(namespace)
    except MetasyncError:
        raise UsageError(f"invalid namespace {namespace!r}; use letters, digits, '.', '_' or '-'") from None
    if "/" in namespace:
        raise UsageError(f"invalid namespace {namespace!r}; it cannot contain '/'")


def _check_format(fmt: int) -> None:
    if fmt != FORMAT_VERSION:
        raise FormatError(
            f"repository format {fmt} is not supported (this metasync reads {FORMAT_VERSION}); "
            "upgrade metasync"
        )


def check_backend_free(backend: Backend) -> None:
    try:
        backend.probe()
        taken = backend.exists() and _has_descriptor(backend)
    except BackendUnavailable as exc:
        raise UsageError(str(exc)) from None
    if taken:
        raise UsageError(
            f"{backend.name} already holds a metasync repository (namespace "
            f"{backend.namespace!r}); use `metasync clone {backend.name}` or another --namespace"
        )


def _has_descriptor(backend: Backend) -> bool:
    try:
        backend.size(DESCRIPTOR_KEY)
        return True
    except ObjectNotFound:
        return False


def descriptor(config: Config, config_id: str, backend_id: str) -> bytes:
    doc = {
        "format": FORMAT_VERSION,
        "encryption": config.encryption,
        "config": config_id,
        "backend": backend_id,
    }
    return json.dumps(doc, indent=2, sort_keys=True).encode() + b"\n"


def _parse_descriptor(raw: bytes, uri: str) -> dict[str, Any]:
    try:
        doc = json.loads(raw)
        fmt = doc["format"]
        ok = (
            isinstance(fmt, int)
            and doc["encryption"] in ("none", "aes-256-gcm")
            and is_object_id(doc["config"])
            and isinstance(doc["backend"], str)
        )
    except (ValueError, KeyError, TypeError):
        ok = False
    if not ok:
        raise NotARepository(f"{uri} holds a damaged {DESCRIPTOR_KEY}; clone from another backend")
    _check_format(doc["format"])
    result: dict[str, Any] = doc
    return result


def _ask(passphrase: PassphraseSource | None) -> str:
    if passphrase is None:
        raise UsageError(
            "this repository is encrypted: set METASYNC_PASSPHRASE or use --passphrase-file"
        )
    value = passphrase()
    if not value:
        raise UsageError("the passphrase is empty")
    return value


def _unit_pair(unit: Fraction) -> tuple[int, int]:
    return unit.numerator, unit.denominator


def _device_name() -> str:
    name = socket.gethostname().split(".")[0] or "device"
    return "".join(ch for ch in name if ch.isalnum() or ch in "-_") or "device"


def _write_private(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())


def _lock_folder(meta: Path) -> int:
    """Take the repository's exclusive lock (``.metasync/lock``) for as long as the
    returned descriptor is open: one command (or daemon cycle) at a time, so no two
    writers interleave commits, checkouts or outbox cleanup."""
    fd = os.open(meta / "lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise UsageError(
            f"another metasync command is using {meta.parent}; wait for it to finish"
        ) from None
    return fd


def _write_durable(path: Path, data: bytes) -> None:
    """Temp file, fsync, rename: ``path`` holds all of ``data`` or does not exist."""
    tmp = path.with_name(f".tmp-{secrets.token_hex(6)}")
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


# Keep the mapping import visible to type checkers of callers that use it.
__all__ = ["Repository", "StableMapping"]
