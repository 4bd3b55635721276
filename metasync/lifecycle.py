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

import contextlib
import os
import secrets
import shutil
import sqlite3
import stat
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from fractions import Fraction
from functools import partial
from pathlib import Path

from metasync import verification
from metasync.backends import Backend, normalize_uri, open_backend, public_uri, typed_uri
from metasync.backends.uris import overlap
from metasync.codec import Codec
from metasync.context import InPlaceWrite, create_local, device_name
from metasync.errors import (
    BackendUnavailable,
    FormatError,
    Interrupted,
    MetasyncError,
    NotARepository,
    NotTrusted,
    ObjectNotFound,
    UsageError,
    WrongPassphrase,
)
from metasync.faults import crash_point
from metasync.keys import Keyring, fingerprint, normalize_fingerprint, unwrap, wrong_passphrase
from metasync.keyslots import (
    LocalKey,
    Slot,
    make_slot,
    new_slot_id,
    open_envelope,
    parse_slot,
    unlock,
)
from metasync.layout import (
    DEFAULT_NAMESPACE,
    DESCRIPTOR_KEY,
    KEYFILE_KEY,
    check_backend_free,
    check_descriptor,
    check_format,
    check_namespace,
    config_key,
    descriptor,
    parse_descriptor,
    read_slot_files,
    slot_key,
)
from metasync.localdb import LocalDB
from metasync.mapping import vnode_unit
from metasync.objects import FORMAT_VERSION, MAX_FRAGMENTS, BackendSpec, Config
from metasync.ownership import check_owner
from metasync.portable import effective_uid
from metasync.progress import CANCEL
from metasync.state import LocalState, PrimitivesChecked
from metasync.worktree import META_DIR, Chunker, Folders, content_is, lstat_at

DEFAULT_PARTITIONS = 16384
#: The most key slots a clone tries (one scrypt each).
MAX_SLOTS = 64
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
    # Typed here: the environment's credentials go with these URIs (and no others).
    uris = [typed_uri(normalize_uri(u)) for u in backend_uris]
    # One folder under two spellings would count one physical copy as two.
    overlap(uris, root=str(root))
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
    local: LocalKey | None = None
    keyfile = b""
    ids = [secrets.token_hex(4) for _ in uris]

    def ready(backend: Backend) -> PrimitivesChecked:
        backend.create()
        return verification.verify(backend)

    # The key slot's scrypt (a third of a second, without the interpreter lock) runs
    # while each backend is made and checked, all at once: they wait on disks and
    # servers. The first backend (in order) that fails is the error.
    with ThreadPoolExecutor(len(backends) + 1, "metasync-init") as pool:
        if encrypt:
            ring = Keyring(id_key=os.urandom(32), data_keys={0: os.urandom(32)}, current=0)
            slot = new_slot_id()
            made = pool.submit(make_slot, ring, ask(passphrase), slot=slot,
                               label=device_name(), created=today())
        verified = [pool.submit(ready, backend) for backend in backends]
        checked = {backend_id: f.result() for backend_id, f in zip(ids, verified, strict=True)}
        if encrypt:
            keyfile, private = made.result()
            local = LocalKey(ring, slot, private)

    unit = vnode_unit([Fraction(repr(float(c))) for c in caps])
    config = Config(
        format=FORMAT_VERSION,
        namespace=namespace,
        # Passwords and local options stay on this client (uri_overrides), never on a
        # backend (backends.uris).
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
    codec = Codec(local.ring if local else None)
    config_bytes = config.to_bytes()
    config_id = codec.id_of("config", config_bytes)
    stored_config = codec.encode("config", config_id, config_bytes)
    # Write the descriptor last on each backend: its presence marks a complete repository.
    for backend_id, backend in zip(ids, backends, strict=True):
        if local is not None and local.slot is not None:
            backend.put(slot_key(local.slot), keyfile)
        backend.put(config_key(config_id), stored_config)
        backend.put(DESCRIPTOR_KEY, descriptor(config, config_id, backend_id,
                                               local.ring if local else None))
    for backend in backends:
        backend.close()
    # This client's own URIs (passwords, local options): it is connected to every backend.
    create_local(root, config, config_id, local, dict(zip(ids, uris, strict=True)))
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
    configuration -- or, ``resumed``, an interrupted clone's, found in the folder
    (:func:`clone_folder`); :meth:`undo` removes what was created."""

    root: Path
    #: The id of the backend the clone was made from.
    entry_id: str
    created: bool
    #: The repository's fingerprint (None: not encrypted).
    fingerprint: str | None = None
    #: The folder held an unfinished clone of this repository: its first pull is
    #: finished, not started (nothing of it is removed if that fails).
    resumed: bool = False

    def finish(self, first_pull: Callable[[], None], close: Callable[[], None],
               written: Sequence[InPlaceWrite] = (), chunker: Chunker | None = None) -> None:
        """Run the clone's ``first_pull``; if it fails, ``close`` and :meth:`undo`
        (``written``: what it wrote in place, filled as it goes; ``chunker``: the
        repository's, to compare contents). A clone the user stopped (Ctrl-C) is
        kept instead, as a pull finishes it."""
        try:
            first_pull()
        except BaseException as exc:
            close()
            if isinstance(exc, Interrupted) or (
                    isinstance(exc, KeyboardInterrupt) and CANCEL.requested()):
                raise Interrupted(
                    f"the clone stopped; `metasync pull` in {self.root} finishes it") from None
            self.undo(written, chunker)
            raise

    def undo(self, written: Sequence[InPlaceWrite] = (), chunker: Chunker | None = None) -> None:
        """Leave no half-cloned folder behind (a failure we can report), removing only
        what the clone made: ``.metasync``, each file or link it wrote (``written``)
        that is still what it wrote (same inode, size and mtime; same target), then
        every folder left empty, and the folder itself if the clone created it and
        nothing is left. Anything else stays: a file saved there during the clone,
        a cloned file edited since. Where timestamps are coarse (:func:`~metasync.worktree.coarse_time`)
        a file's content is compared too, with ``chunker`` (without it, such a file
        stays). A resumed clone is left as it was (the next try finishes it)."""
        if self.resumed:
            return
        shutil.rmtree(self.root / META_DIR, ignore_errors=True)
        _remove_written(self.root, written, chunker)
        _remove_empty_folders(self.root, self.created)


def _still_written(st: os.stat_result, item: InPlaceWrite, target: Callable[[], str],
                   content: Callable[[os.stat_result, str], bool]) -> bool:
    """True if ``st`` is the file or link ``item`` recorded (``target`` reads a link's;
    ``content`` tells whether a file still holds a ref: :func:`content_is`)."""
    if (st.st_ino, st.st_dev) != (item.ino, item.dev):
        return False
    if item.target is not None:
        return stat.S_ISLNK(st.st_mode) and target() == item.target
    if not stat.S_ISREG(st.st_mode) or (st.st_size, st.st_mtime_ns) != (item.size, item.mtime_ns):
        return False
    return content(st, item.ref)


def _remove_written(root: Path, written: Sequence[InPlaceWrite], chunker: Chunker | None) -> None:
    """Remove each of ``written`` (relative to ``root``) that is still as written.
    Folders are opened as the checkout opens them (:class:`Folders`: one name at a
    time, never through a link), so a folder the user replaced by a link to
    elsewhere leads nowhere. (Nothing is written in place where there are no folder
    descriptors: ``Folders`` refuses to write there.)"""
    if not written:
        return
    folders = Folders(root)
    try:
        for item in written:
            folder, _, name = item.path.rpartition("/")
            with folders.opened(folder) as fd, contextlib.suppress(OSError):
                st = lstat_at(fd, name) if fd is not None else None
                if st is not None and fd is not None and _still_written(
                        st, item, partial(os.readlink, name, dir_fd=fd),
                        partial(content_is, chunker, fd, name, item.path)):
                    os.unlink(name, dir_fd=fd)
    finally:
        folders.close()


def _remove_empty_folders(root: Path, created: bool) -> None:
    """Remove every empty folder under ``root`` (and ``root`` itself if ``created``),
    deepest first, entering no link or junction."""

    def prune(path: Path) -> None:
        try:
            entries = list(os.scandir(path))
        except OSError:
            return
        for entry in entries:
            try:
                if not entry.is_dir(follow_symlinks=False) or getattr(
                        entry.stat(follow_symlinks=False), "st_file_attributes", 0) & 0x400:
                    continue
            except OSError:
                continue
            prune(Path(entry.path))
            with contextlib.suppress(OSError):
                os.rmdir(entry.path)  # only an empty one

    prune(root)
    if created:
        with contextlib.suppress(OSError):
            os.rmdir(root)


def new_folder(root: str | Path, verb: str) -> Path:
    """``root`` made absolute, once it is checked to be a new or empty folder whose
    parent exists (where ``verb`` -- clone, recover -- creates a repository)."""
    root = Path(root).absolute()
    if root.exists() and (not root.is_dir() or any(root.iterdir())):
        raise UsageError(f"{root} is not empty; {verb} into a new or empty folder")
    if not root.parent.is_dir():
        raise UsageError(f"parent folder {root.parent} does not exist; create it first")
    return root


@dataclass
class Found:
    """What :func:`clone_folder` found in a clone's folder."""

    #: Staging folders of an interrupted :func:`create_local` (removed, then cloned afresh).
    staging: list[Path]
    #: The first configuration of the unfinished clone there (None: none there).
    unfinished: str | None = None
    #: Its sparse selection, and whether its first checkout started (from then on
    #: the selection stays).
    patterns: list[str] | None = None
    started: bool = False


def clone_folder(root: str | Path) -> tuple[Path, Found]:
    """``root`` made absolute, once it is checked to be a folder a clone may use: new
    or empty, holding only the staging folders of an interrupted
    :func:`create_local`, or holding a clone that never finished its first pull
    (``LocalState.unfinished_clone``; whether it is one of the repository cloned
    is :func:`prepare_clone`'s check). Anything else is refused as not empty."""
    root = Path(root).absolute()
    if not root.parent.is_dir():
        raise UsageError(f"parent folder {root.parent} does not exist; create it first")
    found = Found([])
    if not root.exists():
        return root, found
    refused = UsageError(f"{root} is not empty; clone into a new or empty folder")
    if not root.is_dir():
        raise refused
    names = [child.name for child in root.iterdir()]
    found.staging = [root / n for n in names if n.startswith(f"{META_DIR}.new-")
                     and _own_staging(root / n)]
    if len(found.staging) == len(names):
        return root, found
    meta = root / META_DIR
    if META_DIR not in names or meta.is_symlink() or not (meta / "state.db").is_file():
        raise refused
    # Another user's folder is never resumed (its state would name the backends):
    # the ownership check every command makes on the folder it opens.
    check_owner(root)
    try:
        db = LocalDB(meta / "state.db")
    except (sqlite3.Error, OSError):
        raise refused from None
    try:
        state = LocalState(db)
        if not state.unfinished_clone:
            raise refused
        found.unfinished = state.init_config_id
        found.patterns = state.sparse_patterns
        found.started = state.head is not None or state.checkout_pending is not None
    except (KeyError, ValueError, sqlite3.Error):
        raise refused from None
    finally:
        db.close()
    return root, found


#: What an interrupted :func:`~metasync.context.create_local` may leave in its
#: staging folder (SQLite's side files included).
_STAGED = frozenset({"state.db", "state.db-journal", "state.db-wal", "state.db-shm",
                     "key", "outbox"})


def _own_staging(path: Path) -> bool:
    """True if ``path`` looks like a staging folder this user's clone made (a private
    folder of this user's holding only what one holds): only such are removed."""
    try:
        st = path.lstat()
        if not stat.S_ISDIR(st.st_mode) or stat.S_IMODE(st.st_mode) & 0o077:
            return False
        me = effective_uid()
        return (me is None or st.st_uid == me) and all(c.name in _STAGED for c in path.iterdir())
    except OSError:
        return False


def prepare_clone(
    uri: str,
    root: str | Path,
    *,
    namespace: str = DEFAULT_NAMESPACE,
    passphrase: PassphraseSource | None = None,
    allow_unencrypted: bool = False,
    pinned: str | None = None,
    others: list[str] | None = None,
    sparse: list[str] | None = None,
) -> CloneStart:
    """Read the repository at ``uri`` (descriptor, key, first configuration) and
    create ``root/.metasync`` for it. Everything that can fail on bad input is
    checked before anything is written.

    A folder holding only the staging folders of an interrupted clone's
    ``.metasync`` has them removed; one holding an interrupted clone of this
    repository (its first configuration is the descriptor's) is resumed: after the
    same checks, nothing is created (``sparse``, the clone's patterns, must then be
    the interrupted clone's once its first checkout started).

    Nothing the backend says is taken on trust: an unencrypted repository is
    cloned only with ``allow_unencrypted`` (a backend can rewrite an encrypted
    repository's descriptor and configuration to "none"); an encrypted one must
    open with the passphrase through a key file bound to the descriptor's
    repository id, and the descriptor's MAC must verify under the key
    (:class:`NotTrusted` otherwise); ``pinned`` (a fingerprint) must be the
    repository's. ``others`` (``clone --backend``) must name backends distinct from
    ``uri`` and from one another (:func:`~metasync.backends.uris.overlap`)."""
    root, found = clone_folder(root)
    check_namespace(namespace)
    overlap([normalize_uri(u) for u in [uri, *(others or ())]], root=str(root))
    if pinned is not None:
        try:
            pinned = normalize_fingerprint(pinned)
        except ValueError:
            raise UsageError(f"--fingerprint {pinned!r} is not a fingerprint (20 hex digits, "
                             "as `metasync init` printed them)") from None
    entry = open_backend(typed_uri(normalize_uri(uri)), namespace)
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
        local: LocalKey | None = None
        if desc["encryption"] == "none":
            if not allow_unencrypted:
                raise NotTrusted(
                    f"{uri} says the repository is not encrypted, and a backend can make an "
                    "encrypted one look so; clone with --no-encrypt only if you know it is not"
                )
            if pinned is not None:
                raise UsageError("an unencrypted repository has no fingerprint; drop --fingerprint")
        else:
            local = unlock_keys([entry], desc, passphrase, uri)
            if pinned is not None and fingerprint(local.ring) != pinned:
                raise NotTrusted(
                    f"{uri} holds repository {fingerprint(local.ring)}, not the {pinned} given "
                    "with --fingerprint; check the URI"
                )
        codec = Codec(local.ring if local else None)
        config_id = desc["config"]
        config = Config.from_bytes(codec.decode("config", config_id, entry.get(config_key(config_id))))
        check_format(config.format)
        if config.encryption != desc["encryption"]:
            raise NotTrusted(f"the descriptor on {uri} does not match the repository's "
                             "configuration; clone from another backend")
        entry_id = desc["backend"]
        # This client reaches the entry backend by the URI it was given (a mount point
        # may differ between machines; a password stays here).
        overrides = {entry_id: entry.uri}
    finally:
        entry.close()
    printed = fingerprint(local.ring) if local else None
    crash_point("clone:checked")
    if found.unfinished is not None:
        if found.unfinished != config_id:
            raise UsageError(f"{root} holds an unfinished clone of another repository, or one "
                             "made from another backend; finish it with `metasync pull` there, "
                             "or clone into a new or empty folder")
        if sparse is not None and found.started and sparse != found.patterns:
            raise UsageError(f"the unfinished clone in {root} was started with other --sparse "
                             f"patterns; finish it with `metasync pull` there")
        return CloneStart(root, entry_id, False, printed, resumed=True)
    for folder in found.staging:
        shutil.rmtree(folder)
    created = not root.exists()
    create_local(root, config, config_id, local, overrides, clone=True)
    crash_point("clone:created")
    return CloneStart(root, entry_id, created, printed)


def unlock_keys(backends: list[Backend], desc: dict[str, object],
                passphrase: PassphraseSource | None, uri: str) -> LocalKey:
    """The keys of the encrypted repository that descriptor ``desc`` (read from
    ``uri``) describes, from the key files on ``backends``: the first live slot
    whose passphrase matches, else (older repositories) the legacy key file.

    Only a slot file naming the descriptor's repository is tried (its associated
    data binds that id, so one edited to name it does not open). With the keys, the
    descriptor's MAC is checked (:func:`check_descriptor`), so a key file and a
    descriptor of two repositories -- even with one passphrase -- never combine. A
    descriptor without a MAC (older metasync) is accepted only where no slot file
    exists, i.e. for a repository that older metasync made."""
    repository = desc.get("repository")
    slots: dict[str, Slot] = {}
    removed: set[str] = set()
    foreign = False
    for backend in backends:
        try:
            files = read_slot_files(backend)
        except MetasyncError:
            continue
        for slot_id, raw in files.items():
            try:
                slot = parse_slot(raw, slot_id)
            except FormatError:
                continue
            if not slot.live:
                removed.add(slot_id)
            elif slot.repository != repository:
                foreign = True
            else:
                slots.setdefault(slot_id, slot)
    if repository is None and (slots or foreign):
        raise NotTrusted(f"the descriptor on {uri} is not authenticated (the backend changed "
                         "it); clone from another backend")
    candidates = [s for i, s in sorted(slots.items()) if i not in removed]
    if len(candidates) > MAX_SLOTS:
        # Each try costs a scrypt: a backend must not make a clone burn unbounded time.
        raise NotTrusted(f"{uri} holds {len(candidates)} key slots (more than {MAX_SLOTS}); "
                         "clone from another backend")
    if candidates:
        local = _open_slots(candidates, ask(passphrase))
    else:
        legacy = _read_first(backends, KEYFILE_KEY)
        if legacy is None:
            if foreign:
                raise NotTrusted(f"the key files on {uri} belong to another repository; "
                                 "clone from another backend")
            raise FormatError(f"{uri} has no key file; clone from another backend")
        local = LocalKey(unwrap(legacy, ask(passphrase)).keyring())
    if repository is not None:
        check_descriptor(desc, local.ring, uri)
    return local


def _open_slots(candidates: list[Slot], phrase: str) -> LocalKey:
    """The keys of the first slot ``phrase`` unlocks (each try costs one scrypt)."""
    for slot in candidates:
        try:
            private = unlock(slot, phrase)
        except WrongPassphrase:
            continue
        ring = open_envelope(slot, private)
        if not slot.mac_ok(ring):
            raise NotTrusted(f"key slot {slot.slot} is not vouched for by the repository's key "
                             "(planted on a backend?); clone from another backend")
        return LocalKey(ring, slot.slot, private)
    raise wrong_passphrase()


def _read_first(backends: list[Backend], key: str) -> bytes | None:
    for backend in backends:
        try:
            return backend.get(key)
        except MetasyncError:
            continue
    return None


def today() -> str:
    """The date a key slot records (UTC, to the minute), shown by ``key list``."""
    return datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")


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
