"""Creating a repository, and starting a clone.

Both check everything that can fail on bad input before writing anything: a
bad URI, a missing backend folder, a backend that already holds the namespace,
a folder that is already a repository, a wrong passphrase. Only then does ``init``
create missing location folders where that is expected (:func:`prepare_locations`)
and the namespaces, and verify each backend's primitives on scratch keys
(:mod:`metasync.verification`) before it writes anything of the repository. A new
backend gets its descriptor last (its presence marks a complete repository); the
local ``.metasync`` folder appears whole or not at all (:func:`create_local`).
"""

from __future__ import annotations

import secrets
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

from metasync import verification
from metasync.backends import Backend, normalize_uri, open_backend, public_uri
from metasync.codec import Codec
from metasync.context import create_local
from metasync.errors import (
    BackendUnavailable,
    FormatError,
    NotARepository,
    ObjectNotFound,
    UsageError,
)
from metasync.keys import MasterKey, unwrap, wrap
from metasync.layout import (
    DEFAULT_NAMESPACE,
    DESCRIPTOR_KEY,
    KEYFILE_KEY,
    check_backend_free,
    check_format,
    check_namespace,
    config_key,
    descriptor,
    parse_descriptor,
)
from metasync.localdb import LocalDB
from metasync.mapping import vnode_unit
from metasync.objects import FORMAT_VERSION, MAX_FRAGMENTS, BackendSpec, Config
from metasync.state import LocalState
from metasync.worktree import META_DIR

DEFAULT_PARTITIONS = 16384
PassphraseSource = Callable[[], str]


def create(
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
    mkdir: bool = False,
) -> Path:
    """Create a repository in ``root`` on the given backends; return ``root``.

    ``byzantine`` (paper 3.6) makes pPaxos tolerate ``f`` backends that forge
    nothing (entries are authenticated) but drop or reorder log entries; it
    needs ``3f + 1`` backends, at least 4, and encryption (the MAC key).

    Validates everything before writing anything: a bad URI, a missing backend
    folder, a backend that already holds this namespace, or a folder that is
    already a repository fails with nothing written. A missing location folder is
    created on servers (SFTP, WebDAV), and for ``dir:`` only with ``mkdir``. Each
    backend's primitives are verified before anything of the repository is written
    there; one that fails is refused (:class:`UsageError`, one line).
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
    prepare_locations(backends, mkdir)
    key = MasterKey.generate() if encrypt else None
    keyfile = wrap(key, ask(passphrase)) if key is not None else None
    ids = [secrets.token_hex(4) for _ in uris]
    checked = {}
    for backend_id, backend in zip(ids, backends, strict=True):
        backend.create()
        checked[backend_id] = verification.verify(backend)

    unit = vnode_unit([Fraction(repr(float(c))) for c in caps])
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
        vnode_unit=(unit.numerator, unit.denominator),
        fault_model="byzantine" if byzantine else "crash",
        erasure=erasure,
    )
    codec = Codec(key)
    config_bytes = config.to_bytes()
    config_id = codec.id_of("config", config_bytes)
    stored_config = codec.encode("config", config_id, config_bytes)
    # Write the descriptor last on each backend: its presence marks a complete repository.
    for backend_id, backend in zip(ids, backends, strict=True):
        if keyfile is not None:
            backend.put(KEYFILE_KEY, keyfile)
        backend.put(config_key(config_id), stored_config)
        backend.put(DESCRIPTOR_KEY, descriptor(config, config_id, backend_id))
    for backend in backends:
        backend.close()
    secret_uris = {i: u for i, u in zip(ids, uris, strict=True) if public_uri(u) != u}
    create_local(root, config, config_id, key, secret_uris)
    db = LocalDB(root / META_DIR / "state.db")
    try:
        verification.remember(LocalState(db), checked)
    finally:
        db.close()
    return root


def prepare_locations(backends: list[Backend], mkdir: bool) -> None:
    """Check that every backend can be used for a new repository
    (:func:`check_backend_free`), creating missing location folders where that is
    expected -- on servers always (SFTP, WebDAV, as restic and rclone do), on ``dir:``
    only with ``mkdir`` (a missing local folder is usually an unmounted disk) -- but
    only once every backend whose location exists passed its check."""
    missing = []
    for backend in backends:
        if mkdir or not backend.location_needs_mkdir:
            try:
                backend.probe()
            except BackendUnavailable:
                missing.append(backend)
                continue
        check_backend_free(backend)
    for backend in missing:
        backend.create_location()
        check_backend_free(backend)


@dataclass
class CloneStart:
    """A clone's local repository, at version 0 of the entry backend's first
    configuration; :meth:`undo` removes what was created."""

    root: Path
    #: The id of the backend the clone was made from.
    entry_id: str
    created: bool

    def undo(self) -> None:
        """Leave no half-cloned folder behind (a failure we can report)."""
        if self.created:
            shutil.rmtree(self.root, ignore_errors=True)
            return
        for child in self.root.iterdir():  # it was empty before: empty it again
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child, ignore_errors=True)
            else:
                child.unlink(missing_ok=True)


def new_folder(root: str | Path, verb: str) -> Path:
    """``root`` made absolute, once it is checked to be a new or empty folder whose
    parent exists (where ``verb`` -- clone, recover -- creates a repository)."""
    root = Path(root).absolute()
    if root.exists() and (not root.is_dir() or any(root.iterdir())):
        raise UsageError(f"{root} is not empty; {verb} into a new or empty folder")
    if not root.parent.is_dir():
        raise UsageError(f"parent folder {root.parent} does not exist; create it first")
    return root


def prepare_clone(
    uri: str,
    root: str | Path,
    *,
    namespace: str = DEFAULT_NAMESPACE,
    passphrase: PassphraseSource | None = None,
) -> CloneStart:
    """Read the repository at ``uri`` (descriptor, key, first configuration) and
    create ``root/.metasync`` for it. Everything that can fail on bad input is
    checked before anything is written."""
    root = new_folder(root, "clone")
    check_namespace(namespace)
    entry = open_backend(uri, namespace)
    try:
        try:
            raw_descriptor = entry.get(DESCRIPTOR_KEY)
        except ObjectNotFound:
            raise NotARepository(
                f"no metasync repository at {uri} (namespace {namespace!r}); check the URI"
            ) from None
        except BackendUnavailable as exc:
            raise NotARepository(f"cannot read {uri}: {exc}") from None
        desc = parse_descriptor(raw_descriptor, uri)
        key: MasterKey | None = None
        if desc["encryption"] != "none":
            try:
                keyfile = entry.get(KEYFILE_KEY)
            except ObjectNotFound:
                raise FormatError(f"{uri} has no key file; clone from another backend") from None
            key = unwrap(keyfile, ask(passphrase))
        codec = Codec(key)
        config_id = desc["config"]
        config = Config.from_bytes(codec.decode("config", config_id, entry.get(config_key(config_id))))
        check_format(config.format)
        entry_id = desc["backend"]
        # This client reaches the entry backend by the URI it was given (a mount point
        # may differ between machines; a password stays here).
        overrides = {entry_id: entry.uri}
    finally:
        entry.close()
    created = not root.exists()
    create_local(root, config, config_id, key, overrides)
    return CloneStart(root, entry_id, created)


def ask(passphrase: PassphraseSource | None) -> str:
    """The passphrase from its source; a clean error if there is none or it is empty."""
    if passphrase is None:
        raise UsageError(
            "this repository is encrypted: set METASYNC_PASSPHRASE or use --passphrase-file"
        )
    value = passphrase()
    if not value:
        raise UsageError("the passphrase is empty")
    return value
