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

import fcntl
import os
import secrets
import shutil
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path

from metasync.backends import Backend, open_backend, public_uri
from metasync.codec import Codec
from metasync.errors import FolderBusy, FormatError
from metasync.keys import MasterKey
from metasync.localdb import LocalDB
from metasync.objects import FORMAT_VERSION, Config, Version
from metasync.progress import NullReporter, Reporter
from metasync.state import LocalState
from metasync.store import RemoteStore
from metasync.worktree import META_DIR, Chunker, file_mode, write_private

#: The outbox folder inside ``.metasync``: stored bytes not uploaded yet.
OUTBOX_DIR = "outbox"


class BackendPool:
    """Every backend this client has opened, by id: those of the current
    configuration and of others read while following configuration changes.
    A backend is reached by this client's own URI for it where it has one
    (a password, or a mount point that differs between machines)."""

    def __init__(self, namespace: str, state: LocalState) -> None:
        self.namespace = namespace
        self._state = state
        self._opened: dict[str, Backend] = {}

    def uri_of(self, backend_id: str, public: str) -> str:
        """The URI this client uses for backend ``backend_id`` (public URI ``public``)."""
        return self._state.uri_overrides.get(backend_id, public)

    def open(self, config: Config) -> dict[str, Backend]:
        """The backends of ``config`` by id, opening those not open yet."""
        out: dict[str, Backend] = {}
        for spec in config.backends:
            backend = self._opened.get(spec.id)
            if backend is None:
                backend = open_backend(self.uri_of(spec.id, spec.uri), self.namespace)
                self._opened[spec.id] = backend
            out[spec.id] = backend
        return out

    def open_by_id(self, uris: dict[str, str]) -> dict[str, Backend]:
        """Open backends given by id and URI (not named by a known configuration)."""
        for backend_id, uri in uris.items():
            if backend_id not in self._opened:
                self._opened[backend_id] = open_backend(uri, self.namespace)
        return {b: self._opened[b] for b in uris}

    def adopt(self, backend_id: str, backend: Backend, uri: str) -> None:
        """Take an already opened backend (one being added) under ``backend_id``; a
        URI with a password is remembered here, never written to a backend."""
        self._opened[backend_id] = backend
        if public_uri(uri) != uri:
            with self._state.transaction():
                self._state.uri_overrides = {**self._state.uri_overrides, backend_id: uri}

    def opened(self) -> list[Backend]:
        """Every backend opened so far."""
        return list(self._opened.values())

    def name(self, backend_id: str) -> str:
        """A backend's name for messages (its id if it was never opened)."""
        backend = self._opened.get(backend_id)
        return backend.name if backend is not None else backend_id

    def close(self) -> None:
        for backend in self._opened.values():
            backend.close()


@dataclass
class RepoContext:
    """The shared handles of one open repository (see the module docstring)."""

    root: Path
    db: LocalDB
    state: LocalState
    codec: Codec
    pool: BackendPool
    store: RemoteStore
    reporter: Reporter
    client_id: str
    device: str
    chunker: Chunker
    #: File modes for new files, by executable bit. Read once, at open: os.umask can
    #: only be read by setting it, which must not race with worker threads.
    file_modes: dict[bool, int] = field(default_factory=dict)
    #: The open lock file while this context has the folder (see :func:`lock_folder`).
    lock_fd: int | None = None

    @property
    def meta(self) -> Path:
        return self.root / META_DIR

    @property
    def outbox_dir(self) -> Path:
        return self.root / META_DIR / OUTBOX_DIR

    def close(self) -> None:
        self.store.close()
        self.db.close()
        self.pool.close()
        if self.lock_fd is not None:
            os.close(self.lock_fd)  # releases the folder lock
            self.lock_fd = None


def open_context(root: Path, reporter: Reporter | None = None,
                 wait: float = 0.0) -> RepoContext:
    """Lock ``root``'s folder (waiting up to ``wait`` seconds while another process
    has it) and open its repository's handles."""
    meta = root / META_DIR
    lock = lock_folder(meta, wait, reporter)
    try:
        db = LocalDB(meta / "state.db")
        try:
            state = LocalState(db)
            fmt = state.format
            if fmt != FORMAT_VERSION:
                raise FormatError(
                    f"{meta} has format {fmt}; this metasync reads {FORMAT_VERSION}; upgrade metasync"
                )
            config = state.config
            key_path = meta / "key"
            key = MasterKey.from_hex(key_path.read_text()) if key_path.exists() else None
            if (config.encryption != "none") != (key is not None):
                raise FormatError(f"{key_path} is missing; clone the repository again")
        except BaseException:
            db.close()
            raise
        codec = Codec(key)
        pool = BackendPool(config.namespace, state)
        store = RemoteStore(config, codec, pool.open(config))
        (meta / OUTBOX_DIR).mkdir(exist_ok=True)
        store.local = meta / OUTBOX_DIR
        return RepoContext(
            root=root, db=db, state=state, codec=codec, pool=pool, store=store,
            reporter=reporter or NullReporter(), client_id=state.client_id,
            device=state.device, chunker=Chunker(codec.hasher),
            file_modes={False: file_mode(False), True: file_mode(True)}, lock_fd=lock,
        )
    except BaseException:
        os.close(lock)
        raise


def create_local(
    root: Path, config: Config, config_id: str, key: MasterKey | None,
    uri_overrides: dict[str, str],
) -> None:
    """Create ``root/.metasync`` for a repository at version 0 of ``config``: built
    in a staging folder and renamed, so it appears whole or not at all."""
    root.mkdir(exist_ok=True)
    staging = root / f"{META_DIR}.new-{secrets.token_hex(4)}"
    staging.mkdir(mode=0o700)
    try:
        if key is not None:
            write_private(staging / "key", key.to_hex().encode())
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
        db.close()
        (staging / OUTBOX_DIR).mkdir()
        os.rename(staging, root / META_DIR)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def device_name() -> str:
    """This machine's short host name, reduced to letters, digits, ``-`` and ``_``."""
    name = socket.gethostname().split(".")[0] or "device"
    return "".join(ch for ch in name if ch.isalnum() or ch in "-_") or "device"


def lock_folder(meta: Path, wait: float = 0.0, reporter: Reporter | None = None) -> int:
    """Take the repository's exclusive lock (``.metasync/lock``) for as long as the
    returned descriptor is open: one command (or daemon cycle) at a time, so no two
    writers interleave commits, checkouts or outbox cleanup. If another process
    holds it, wait up to ``wait`` seconds for it (saying so once, on ``reporter``),
    then fail with one line."""
    fd = os.open(meta / "lock", os.O_RDWR | os.O_CREAT, 0o600)
    deadline = time.monotonic() + wait
    said = False
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            pass
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
#: The daemon's pid file in ``.metasync``: locked while a daemon runs for the folder.
PID_FILE = "daemon.pid"


def daemon_running(root: Path) -> bool:
    """True if some process holds the daemon's pid-file lock for ``root``."""
    try:
        fd = os.open(root / META_DIR / PID_FILE, os.O_RDWR)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False
