"""What every part of an open repository shares: handles, not decisions.

:class:`RepoContext` holds the folder, the local database and its typed
settings, the codec, the reporter, this client's identity, the backends opened
so far (:class:`BackendPool`) and the replicated store. It holds no
configuration logic: which configuration is current is
:class:`metasync.versions.Versions`'s business.

Also here: creating the ``.metasync`` folder whole, and the folder lock that
keeps one command (or daemon cycle) per folder at a time.
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from metasync.backends import (
    AUTOMATIC_SCHEMES,
    Backend,
    normalize_uri,
    open_backend,
    public_uri,
    scheme_of,
    typed_uri,
    without_local_options,
)
from metasync.backends.unconnected import Unconnected
from metasync.backends.uris import Location, location_identity
from metasync.codec import Codec
from metasync.errors import (
    BackendUnavailable,
    FolderBusy,
    FormatError,
    KeyRevoked,
    MetasyncError,
    NotTrusted,
    ObjectNotFound,
    UsageError,
)
from metasync.faults import crash_point
from metasync.keys import Keyring
from metasync.keyslots import LocalKey, open_envelope, parse_slot
from metasync.layout import DESCRIPTOR_KEY, parse_descriptor, slot_key
from metasync.localdb import LocalDB
from metasync.objects import FORMAT_VERSION, READABLE_FORMATS, BackendSpec, Config, Version
from metasync.portable import try_lock
from metasync.progress import NullReporter, Reporter
from metasync.state import LocalState
from metasync.store import RemoteStore
from metasync.worktree import META_DIR, Chunker, file_mode, write_private

#: The outbox folder inside ``.metasync``: stored bytes not uploaded yet.
OUTBOX_DIR = "outbox"


class BackendPool:
    """Every backend this client has opened, by id: those of the current
    configuration and of others read while following configuration changes.

    A backend is reached by this client's own URI for it (``uri_overrides``: every
    backend this client created, cloned from, added or connected, with its
    passwords and local options). A backend another client added is *not
    connected* until this client connects it (``metasync backend connect``), with one
    exception: a kind that reaches nothing but storage on this machine
    (:data:`~metasync.backends.AUTOMATIC_SCHEMES`, i.e. ``dir:``), opened by its
    shared URI less any local option, and only if it already holds this
    repository's descriptor for that backend id -- so a shared setting cannot make
    this client run a program, read a file, contact a host, or write into (and gc)
    a folder of its choosing. A backend not connected is an :class:`Unconnected`
    stand-in, reported once on :attr:`reporter`: every use fails as unavailable,
    and the rest keeps working."""

    def __init__(self, namespace: str, state: LocalState,
                 reporter: Reporter | None = None, typed: list[str] | None = None) -> None:
        self.namespace = namespace
        self._state = state
        self._opened: dict[str, Backend] = {}
        #: Where the one-line "not connected" notes go.
        self.reporter: Reporter = reporter or NullReporter()
        #: URIs typed on this machine's command line for backends of the shared
        #: configuration (``clone --backend``), with what each names: connected
        #: (remembered) when a configuration names them.
        self.typed: list[tuple[Location, str]] = []
        for given in typed or ():
            uri = typed_uri(normalize_uri(given))
            self.typed.append((location_identity(uri), uri))

    def uri_of(self, backend_id: str, shared: str) -> str | None:
        """The URI this client reaches backend ``backend_id`` (shared URI ``shared``)
        by: its own if it has one, else for an automatic kind the shared URI less
        its local options (still to be checked: :meth:`open`), else None (not
        connected)."""
        own = self._state.uri_overrides.get(backend_id)
        if own is not None:
            return own
        try:
            automatic = scheme_of(shared) in AUTOMATIC_SCHEMES
        except UsageError:
            return None
        return without_local_options(shared) if automatic else None

    def connected_uri(self, spec: BackendSpec) -> str | None:
        """The URI to reach ``spec`` by, if this client may (:meth:`uri_of`, with an
        automatic kind's descriptor checked), else None."""
        backend = self._get(spec)
        if not isinstance(backend, Unconnected):
            return backend.uri
        # Out of reach when checked (an unmounted disk): it may be watched, and is
        # checked again before a command uses it.
        return None if backend.connect_needed else self.uri_of(spec.id, spec.uri)

    def open(self, config: Config) -> dict[str, Backend]:
        """The backends of ``config`` by id, opening those not open yet (a backend
        this client may not open yet is an :class:`Unconnected` stand-in)."""
        return {spec.id: self._get(spec) for spec in config.backends}

    def _get(self, spec: BackendSpec) -> Backend:
        """``spec``'s backend, opened (or its stand-in made) on first use."""
        backend = self._opened.get(spec.id)
        if backend is None:
            backend = self._opened[spec.id] = self._open_spec(spec)
        return backend

    def _open_spec(self, spec: BackendSpec) -> Backend:
        typed = self._typed_for(spec.uri)
        if typed is not None and spec.id not in self._state.uri_overrides:
            self.remember(spec.id, typed)
        uri = self.uri_of(spec.id, spec.uri)
        shown = public_uri(spec.uri)
        connect = f"run `metasync backend connect {spec.id} [URI]` to use it"
        if uri is None:
            return self._unconnected(spec, f"backend {spec.id} ({shown}) was added by another "
                                           f"client and is not connected here; {connect}")
        own = spec.id in self._state.uri_overrides
        try:
            backend = open_backend(uri, self.namespace)
        except MetasyncError as exc:
            if own:
                raise
            return self._unconnected(spec, f"backend {spec.id} ({shown}) cannot be opened "
                                           f"here ({exc}); {connect}")
        if not own:
            try:
                problem = foreign(backend, spec.id)
            except MetasyncError as exc:
                # Out of reach (an unmounted disk): unavailable like any backend, and
                # checked again by the next command.
                backend.close()
                return Unconnected(public_uri(spec.uri), self.namespace, str(exc),
                                   connect_needed=False)
            if problem is not None:
                backend.close()
                return self._unconnected(
                    spec, f"backend {spec.id} ({shown}) {problem} on this machine (another "
                          f"disk, or not mounted?); run `metasync backend connect {spec.id} "
                          "URI` with where it is here")
        return backend

    def _typed_for(self, shared: str) -> str | None:
        """The URI typed here (``clone --backend``) that names the same location as
        the shared URI ``shared``, however either is spelled."""
        if not self.typed:
            return None
        try:
            where = location_identity(shared)
        except UsageError:
            return None
        return next((uri for loc, uri in self.typed if loc.relation(where) == "same"), None)

    def _unconnected(self, spec: BackendSpec, reason: str) -> Backend:
        self.reporter.note(reason)
        return Unconnected(public_uri(spec.uri), self.namespace, reason)

    def open_by_id(self, uris: dict[str, str]) -> dict[str, Backend]:
        """Open backends given by id and this client's URI for them (not named by a
        known configuration)."""
        for backend_id, uri in uris.items():
            if backend_id not in self._opened:
                self._opened[backend_id] = open_backend(uri, self.namespace)
        return {b: self._opened[b] for b in uris}

    def adopt(self, backend_id: str, backend: Backend, uri: str) -> None:
        """Take an already opened backend (one being added or connected) under
        ``backend_id``; its URI, with passwords and local options, is remembered
        here as this client's, never written to a backend."""
        old = self._opened.get(backend_id)
        if old is not None and old is not backend:
            old.close()
        self._opened[backend_id] = backend
        self.remember(backend_id, uri)

    def remember(self, backend_id: str, uri: str) -> None:
        """Record ``uri`` as this client's URI for ``backend_id`` (connected)."""
        if self._state.uri_overrides.get(backend_id) != uri:
            with self._state.transaction():
                self._state.uri_overrides = {**self._state.uri_overrides, backend_id: uri}

    def opened(self) -> list[Backend]:
        """Every backend opened so far."""
        return list(self._opened.values())

    def requests(self) -> dict[str, int]:
        """Backend id -> requests made to it so far (:attr:`Backend.requests`)."""
        return {b: backend.requests for b, backend in self._opened.items()}

    def latencies(self) -> dict[str, float]:
        """Backend id -> seconds its last small request took (:attr:`Backend.latency`),
        for those that answered one."""
        return {b: backend.latency for b, backend in self._opened.items()
                if backend.latency is not None}

    def name(self, backend_id: str) -> str:
        """A backend's name for messages (its id if it was never opened)."""
        backend = self._opened.get(backend_id)
        return backend.name if backend is not None else backend_id

    def close(self) -> None:
        for backend in self._opened.values():
            backend.close()


class InPlaceWrite(NamedTuple):
    """A file or link a checkout wrote at its own name (a fresh clone writes in
    place: :mod:`metasync.filewriter`), as it was then: a failed clone removes it
    only if it is still that (:meth:`metasync.lifecycle.CloneStart.undo`)."""

    #: Relative to the folder, as spelled on disk.
    path: str
    #: A file's size, mtime and inode and its file system (0 for a link).
    size: int
    mtime_ns: int
    ino: int
    dev: int
    #: A link's target (None: a file).
    target: str | None
    #: A file's content as the tree has it (its ref): what it is compared with where
    #: the file system's timestamps are too coarse to tell an edit
    #: (:func:`~metasync.worktree.coarse_time`).
    ref: str = ""


@dataclass
class RepoContext:
    """The shared handles of one open repository (see the module docstring)."""

    root: Path
    db: LocalDB
    state: LocalState
    codec: Codec
    pool: BackendPool
    store: RemoteStore
    client_id: str
    device: str
    chunker: Chunker
    #: File modes for new files, by executable bit. Read once, at open: os.umask can
    #: only be read by setting it, which must not race with worker threads.
    file_modes: dict[bool, int] = field(default_factory=dict)
    #: The open lock file while this context has the folder (see :func:`lock_folder`);
    #: None for a read-only open while another command has it (:func:`open_context`).
    lock_fd: int | None = None
    #: Every data key this client holds (the codec uses those its configuration allows).
    keyring: Keyring | None = None
    #: Fetches this client's keyring anew from its key slot (after a key rotation).
    reload_keyring: Callable[[], Keyring] | None = None
    #: Every file and link this process wrote in place (any thread appends).
    written_in_place: list[InPlaceWrite] = field(default_factory=list)

    def note_full_backends(self) -> dict[str, str]:
        """Remember the backends that refused a copy for want of space in this
        session, and forget those that were full before but have no copy left that
        this client could not write there (the copies went in: there is room again).
        Returns backend id -> why, as ``backend list`` and the daemon show them."""
        full = {**self.state.full_backends, **self.store.full}
        waiting = {backend_id for _, backend_id in self.db.missing_copies()}
        full = {b: why for b, why in full.items() if b in waiting or b in self.store.full}
        if full != self.state.full_backends:
            with self.db.transaction():
                self.state.full_backends = full
        return full

    @property
    def reporter(self) -> Reporter:
        """Where progress and notes go: the pool's reporter (its "not connected" notes)."""
        return self.pool.reporter

    @reporter.setter
    def reporter(self, reporter: Reporter) -> None:
        self.pool.reporter = reporter

    def use_keys(self, config: Config) -> None:
        """Encrypt under ``config``'s data key epoch and read under the epochs it
        allows from now on; fetch the keyring anew first if it lacks that epoch
        (another client rotated the key)."""
        if self.keyring is None:
            return
        held = self._holding(config.key_epoch, newer_will_do=True)
        # A client that joined after a rotation holds only newer keys: it reads and
        # writes objects under those (every key holder has them).
        current = min(e for e in held.data_keys if e >= config.key_epoch)
        ring = held.narrowed(current, config.key_oldest)
        if ring != self.codec.keyring:
            self.codec.use(ring)

    def keys_moved_on(self) -> bool:
        """After an item failed to authenticate: fetch the keyring anew from this
        client's key slot (another client may have rotated the key, and re-encrypted
        it), keep reading by the same configuration; True if that gave new keys.
        Raises :class:`KeyRevoked` (one line) if this device's slot was removed."""
        if self.keyring is None or self.reload_keyring is None:
            return False
        before = self.keyring
        self.keyring = self.reload_keyring()
        if self.keyring == before:
            return False
        current = self.codec.keyring
        assert current is not None
        self.codec.use(Keyring(self.keyring.id_key,
                               {**self.keyring.data_keys, **current.data_keys}, current.current))
        return True

    def _holding(self, epoch: int, newer_will_do: bool = False) -> Keyring:
        """This client's keyring, fetched anew from its key slot if it lacks ``epoch``
        (with ``newer_will_do``: if it holds no key of ``epoch`` or newer)."""
        assert self.keyring is not None

        def enough(ring: Keyring) -> bool:
            return epoch in ring.data_keys or (newer_will_do and max(ring.data_keys) > epoch)

        if not enough(self.keyring) and self.reload_keyring is not None:
            self.keyring = self.reload_keyring()
        if not enough(self.keyring):
            raise FormatError(
                f"the repository's key was rotated (data key epoch {epoch}) and this client "
                "does not hold that key; clone the repository again")
        return self.keyring

    def log_codec(self, config: Config) -> Codec:
        """The codec of the pPaxos records of the instances ``config``'s acceptors run:
        written under its data key epoch, read under that epoch and newer ones only,
        so an older key (a revoked one) can forge no entry of an instance run after a
        rotation began, while the entries of instances before it stay readable to the
        clients that hold their key."""
        if self.keyring is None:
            return self.codec
        ring = self._holding(config.key_epoch)
        return Codec(Keyring(ring.id_key, {e: k for e, k in ring.data_keys.items()
                                           if e >= config.key_epoch}, config.key_epoch))

    @property
    def exclusive(self) -> bool:
        """True if this context holds the folder lock; False for a read-only open
        while another command holds it (see :func:`open_context`): then nothing but
        content-addressed caches may be written, and no checkout resumed."""
        return self.lock_fd is not None

    @property
    def meta(self) -> Path:
        return self.root / META_DIR

    @property
    def outbox_dir(self) -> Path:
        return self.root / META_DIR / OUTBOX_DIR

    def share_folder(self) -> None:
        """Release the folder lock and go on as a read-only open does (for a handle
        kept open for long, e.g. a mount: other commands and the daemon may run)."""
        if self.lock_fd is not None:
            os.close(self.lock_fd)
            self.lock_fd = None

    def close(self) -> None:
        self.store.close()
        self.db.close()
        self.pool.close()
        if self.lock_fd is not None:
            os.close(self.lock_fd)  # releases the folder lock
            self.lock_fd = None


def foreign(backend: Backend, backend_id: str) -> str | None:
    """None if ``backend`` holds this repository's descriptor for ``backend_id``, else
    why not ("holds no ...", "holds another ..."). Only the backend id is compared:
    ids are random, so another repository's (or backend's) folder never matches.
    A backend that cannot be read raises (:class:`BackendUnavailable`, ...): it is
    out of reach, which says nothing about what it holds."""
    try:
        raw = backend.get(DESCRIPTOR_KEY)
    except ObjectNotFound:
        return "holds no descriptor of this repository"
    try:
        doc = parse_descriptor(raw, backend.name)
    except MetasyncError as exc:
        return f"holds a damaged descriptor ({' '.join(str(exc).split())})"
    if doc.get("backend") != backend_id:
        return "holds another repository or backend"
    return None


def open_context(root: Path, reporter: Reporter | None = None,
                 wait: float = 0.0, typed: list[str] | None = None,
                 read_only: bool = False) -> RepoContext:
    """Lock ``root``'s folder (waiting up to ``wait`` seconds while another process
    has it) and open its repository's handles. ``typed``: URIs of other backends of
    the shared configuration given on this machine's command line (``clone
    --backend``), connected when a configuration names them (see :class:`BackendPool`).

    ``read_only``: for a command that changes nothing (``status``, ``log``, ``backend
    list``): the lock is taken if free, else the repository is opened without it (at
    once, never waiting) and the context is not :attr:`~RepoContext.exclusive`: it
    reads what the holder committed to ``state.db`` (in WAL mode each read sees a
    committed state, never a transaction half done, and never blocks the holder) and
    must write nothing but content-addressed caches."""
    meta = root / META_DIR
    lock = lock_folder(meta, wait, reporter, read_only=read_only)
    try:
        db = LocalDB(meta / "state.db")
        try:
            state = LocalState(db)
            fmt = state.format
            if fmt not in READABLE_FORMATS:
                raise FormatError(
                    f"{meta} has format {fmt}; this metasync reads {FORMAT_VERSION}; upgrade metasync"
                )
            config = state.config
            if fmt < FORMAT_VERSION:
                if lock is None:  # the holder is an older metasync: no upgrade under it
                    raise FolderBusy(f"another metasync command is using {root}; wait "
                                     "for it to finish")
                connect_backends_of_older_client(state, config)
            key_path = meta / KEY_FILE
            local = LocalKey.from_bytes(key_path.read_bytes()) if key_path.exists() else None
            if (config.encryption != "none") != (local is not None):
                raise FormatError(f"{key_path} is missing; clone the repository again")
        except BaseException:
            db.close()
            raise
        pool = BackendPool(config.namespace, state, reporter, typed)
        try:
            if local is not None and max(local.ring.data_keys) < config.key_epoch:
                local = refresh_key(meta, local, pool.open(config).values(), config.key_epoch)
        except BaseException:
            pool.close()
            db.close()
            raise
        codec = Codec(local.ring if local is not None else None)
        store = RemoteStore(config, codec, pool.open(config))
        (meta / OUTBOX_DIR).mkdir(exist_ok=True)
        store.local = meta / OUTBOX_DIR
        ctx = RepoContext(
            root=root, db=db, state=state, codec=codec, pool=pool, store=store,
            client_id=state.client_id,
            device=state.device, chunker=Chunker(codec.hasher),
            file_modes={False: file_mode(False), True: file_mode(True)}, lock_fd=lock,
            keyring=local.ring if local is not None else None,
        )
        if local is not None:
            held = local

            def reload_keyring() -> Keyring:
                # Another client rotated the key while this one is open.
                nonlocal held
                held = refresh_key(meta, held, ctx.pool.open(ctx.store.config).values(), None)
                return held.ring

            ctx.reload_keyring = reload_keyring
        ctx.use_keys(config)
        return ctx
    except BaseException:
        if lock is not None:
            os.close(lock)
        raise


#: This client's key in ``.metasync`` (0600): a :class:`~metasync.keyslots.LocalKey`.
KEY_FILE = "key"


def connect_backends_of_older_client(state: LocalState, config: Config) -> None:
    """A folder made by older metasync (local format 3) used every backend of its
    configuration as the configuration named it; it now keeps its own URI for each
    backend it uses (``uri_overrides``). So once, at upgrade, the backends of its
    current configuration become connected as it reached them -- less any local
    option (never taken from shared settings), with the environment's credentials as
    for a URI typed here; one whose credentials would now go over plain HTTP stays
    not connected (its note names ``backend connect``)."""
    overrides = dict(state.uri_overrides)
    for spec in config.backends:
        if spec.id in overrides:
            continue
        try:
            overrides[spec.id] = typed_uri(without_local_options(spec.uri))
        except UsageError:
            continue
    with state.transaction():
        state.uri_overrides = overrides
        state.format = FORMAT_VERSION


def refresh_key(meta: Path, local: LocalKey, backends: Iterable[Backend],
                epoch: int | None) -> LocalKey:
    """This client's keys once the repository moved on to key epoch ``epoch`` (a
    ``key rotate``; ``None``: whatever its slot holds now): its slot's envelope
    re-opened with the slot's private key, read from the first backend whose copy
    holds that epoch, and saved to ``.metasync/key`` (atomically). :class:`KeyRevoked` (one line) if the slot is gone or no longer
    opens: this device's key was removed, and so is its access to new keys."""
    if local.slot is None or local.private is None:
        raise KeyRevoked(
            "the repository's keys were rotated and this folder holds a key from before key "
            "slots; clone again with a passphrase that is still valid")
    removed = "this device's key was removed from the repository (key slot " + local.slot + \
        "); clone again with a passphrase that is still valid"
    answered = False
    for backend in backends:
        try:
            slot = parse_slot(backend.get(slot_key(local.slot)), local.slot)
        except ObjectNotFound:
            answered = True
            continue
        except MetasyncError:
            continue
        answered = True
        if not slot.live:
            raise KeyRevoked(removed)
        try:
            ring = open_envelope(slot, local.private)
        except NotTrusted:
            continue
        if (epoch is not None and epoch not in ring.data_keys) or ring.id_key != local.ring.id_key:
            continue
        # Keep the older data keys this client holds: the pPaxos log entries of
        # instances before a rotation stay under them (docs/FORMAT.md §16).
        merged = Keyring(ring.id_key, {**local.ring.data_keys, **ring.data_keys}, ring.current)
        fresh = LocalKey(merged, local.slot, local.private)
        save_key(meta, fresh)
        return fresh
    if not answered:
        raise BackendUnavailable(f"no backend could be read for this device's new keys (key "
                                 f"epoch {epoch}); retry when one is reachable")
    raise KeyRevoked(removed)


def save_key(meta: Path, local: LocalKey) -> None:
    """Replace ``.metasync/key`` with ``local``, atomically (0600 throughout)."""
    tmp = meta / f"{KEY_FILE}.new-{secrets.token_hex(4)}"
    try:
        write_private(tmp, local.to_bytes())
        os.replace(tmp, meta / KEY_FILE)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def create_local(
    root: Path, config: Config, config_id: str, key: LocalKey | None,
    uri_overrides: dict[str, str], *, clone: bool = False,
) -> None:
    """Create ``root/.metasync`` for a repository at version 0 of ``config``: built
    in a staging folder and renamed, so it appears whole or not at all. A
    ``clone``'s is marked unfinished (``LocalState.unfinished_clone``) until its
    first pull ends."""
    root.mkdir(exist_ok=True)
    staging = root / f"{META_DIR}.new-{secrets.token_hex(4)}"
    staging.mkdir(mode=0o700)
    try:
        if key is not None:
            write_private(staging / KEY_FILE, key.to_bytes())
        db = LocalDB(staging / "state.db")
        state = LocalState(db)
        with state.transaction():
            state.format = FORMAT_VERSION
            state.client_id = secrets.token_hex(8)
            state.device = device_name()
            state.namespace = config.namespace
            state.config_id = config_id
            state.config = config
            state.uri_overrides = uri_overrides
            state.prev = Version(0, None, config_id)
            state.init_config_id = config_id
            state.head = None
            if clone:
                state.unfinished_clone = True
        db.close()
        (staging / OUTBOX_DIR).mkdir()
        crash_point("create:staged")
        os.rename(staging, root / META_DIR)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def device_name() -> str:
    """This machine's short host name, reduced to letters, digits, ``-`` and ``_``."""
    name = socket.gethostname().split(".")[0] or "device"
    return "".join(ch for ch in name if ch.isalnum() or ch in "-_") or "device"


def lock_folder(meta: Path, wait: float = 0.0, reporter: Reporter | None = None,
                read_only: bool = False) -> int | None:
    """Take the repository's exclusive lock (``.metasync/lock``) for as long as the
    returned descriptor is open: one command (or daemon cycle) at a time, so no two
    writers interleave commits, checkouts or outbox cleanup. If another process
    holds it, wait up to ``wait`` seconds for it (saying so once, on ``reporter``),
    then fail with one line -- or, ``read_only``, return None at once: a reader
    goes on without it (see :func:`open_context`)."""
    fd = os.open(meta / "lock", os.O_RDWR | os.O_CREAT, 0o600)
    deadline = time.monotonic() + wait
    said = False
    while True:
        if try_lock(fd):
            return fd
        if read_only:
            os.close(fd)
            return None
        if time.monotonic() >= deadline:
            os.close(fd)
            if not wait:
                raise FolderBusy(
                    f"another metasync command is using {meta.parent}; wait for it to finish")
            raise FolderBusy(
                f"{_holder(meta)} is using {meta.parent} and did not finish within "
                f"{wait:g} s; retry, or give it longer with --timeout")
        holder = _holder(meta)
        if not said and reporter is not None:
            reporter.note(f"waiting for {holder} to finish with {meta.parent}…")
            said = True
        time.sleep(LOCK_POLL)


def _holder(meta: Path) -> str:
    return "the daemon" if daemon_running(meta.parent) else "another metasync command"


#: Seconds between tries of a held folder lock.
LOCK_POLL = 0.05
#: The daemon's pid file in ``.metasync``: its pid while it runs.
PID_FILE = "daemon.pid"
#: The daemon's lock file in ``.metasync``: locked while a daemon runs for the folder.
#: Not the pid file: a Windows lock is mandatory, so the locked file's pid could not
#: be read by ``daemon stop``.
DAEMON_LOCK = "daemon.lock"


def daemon_running(root: Path) -> bool:
    """True if some process holds the daemon's lock for ``root``."""
    try:
        fd = os.open(root / META_DIR / DAEMON_LOCK, os.O_RDWR)
    except OSError:
        return False
    try:
        return not try_lock(fd)
    finally:
        os.close(fd)
