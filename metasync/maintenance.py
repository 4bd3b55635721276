"""Living with changing storage: configuration changes, rebalancing and repair.

A configuration change (a backend added, removed or resized, a new R, a
snapshot, a gc) is a version like any other: ``(number, master, config)``
decided by pPaxos on the acceptors of the configuration before it (paper 3.3),
so every client learns it on its next pull or poll.

Rebalancing makes every object present on the backends the stable mapping of a
configuration names for it, copying from a verified copy, and then drops copies
no longer needed. It is driven by what the backends hold (their listings), not
by a local journal, so it is idempotent: a crash at any point is completed by
running it again (``metasync rebalance``). A copy is only dropped once every
backend that should hold the object has it, at least R of those copies verified
by content in this run (git-annex's numcopies rule).
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from metasync.backends import Backend, public_uri
from metasync.codec import Codec
from metasync.consensus import HINT_KEY, encode_hint
from metasync.erasure import (
    ErasureScheme,
    fragment_key,
    header_length,
    parse_fragment_key,
    rebuild_fragment,
    verify_fragment,
)
from metasync.errors import (
    BackendError,
    BackendUnavailable,
    CorruptObject,
    MetasyncError,
    ObjectNotFound,
    ObjectUnavailable,
    UsageError,
)
from metasync.mapping import StableMapping, movement
from metasync.objects import BackendSpec, Commit, Config, PackEntry, Version, is_object_id
from metasync.store import fragment_mapping_of, mapping_of, object_key

if TYPE_CHECKING:
    from metasync.repository import Repository

#: A configuration change that keeps losing its instance gives up after this many tries.
MAX_CHANGE_ATTEMPTS = 50


# ============================================================== what the backends hold
@dataclass
class Inventory:
    """Which backend holds a copy of which stored object, and its size."""

    copies: dict[str, dict[str, int]] = field(default_factory=dict)
    #: Erasure-coded objects: stored id -> fragment index -> backend -> size.
    fragments: dict[str, dict[int, dict[str, int]]] = field(default_factory=dict)
    #: Backends whose listing failed, with the reason.
    unreachable: dict[str, str] = field(default_factory=dict)

    def held_by(self, backend_id: str) -> tuple[int, int]:
        """(objects or fragments, bytes) one backend holds."""
        sizes = [c[backend_id] for c in self.copies.values() if backend_id in c]
        sizes += [h[backend_id] for f in self.fragments.values() for h in f.values()
                  if backend_id in h]
        return len(sizes), sum(sizes)

    def stored_ids(self) -> set[str]:
        return set(self.copies) | set(self.fragments)


def parse_object_key(key: str) -> str | None:
    """The stored id of ``objects/<id[:2]>/<id>``, or None for any other name (a
    backend's listing is untrusted: a name must be exactly a well-formed id)."""
    parts = key.split("/")
    if len(parts) != 3 or parts[0] != "objects" or not is_object_id(parts[2]):
        return None
    return parts[2] if parts[1] == parts[2][:2] else None


def take_inventory(repo: Repository, backends: dict[str, Backend]) -> Inventory:
    """List ``objects/`` on every backend at once."""
    inventory = Inventory()

    def listing(backend: Backend) -> list[tuple[str, int]]:
        return list(backend.list_sizes("objects"))

    futures = {b: repo.store.executor.submit(listing, backend) for b, backend in backends.items()}
    for backend_id, future in futures.items():
        try:
            keys = future.result()
        except MetasyncError as exc:
            inventory.unreachable[backend_id] = str(exc)
            continue
        for key, size in keys:
            stored_id = parse_object_key(key)
            if stored_id is not None:
                inventory.copies.setdefault(stored_id, {})[backend_id] = size
                continue
            fragment = parse_fragment_key(key)
            if fragment is not None:
                by_index = inventory.fragments.setdefault(fragment[0], {})
                by_index.setdefault(fragment[1], {})[backend_id] = size
    return inventory


def verify_stored(codec: Codec, stored_id: str, data: bytes) -> None:
    """Raise :class:`CorruptObject` unless ``data`` is a good stored copy of
    ``stored_id``: a pack whose bytes hash to its id, or a commit or index that
    decodes under its id (the translator chain checks MAC and id)."""
    if codec.id_of("pack", data) == stored_id:
        return
    for kind in ("commit", "index"):
        try:
            codec.decode(kind, stored_id, data)
            return
        except CorruptObject:
            continue
    raise CorruptObject(f"object {stored_id[:12]}: content does not match its id")


# ============================================================== rebalancing
@dataclass
class RebalanceReport:
    """What a rebalance did."""

    objects: int = 0
    #: Object copies written to a backend that should hold them and did not.
    copied: int = 0
    bytes_copied: int = 0
    #: The fewest copies any placement change of the same objects must write (None
    #: when no reconfiguration is involved).
    minimum: int | None = None
    #: Copies removed from backends that no longer should hold them.
    dropped: int = 0
    #: Objects with no good copy anywhere reachable (reported, never dropped).
    lost: list[str] = field(default_factory=list)
    #: Copies kept although no longer needed: too few verified copies elsewhere, or
    #: the backend holding them could not be reached.
    kept: int = 0
    unreachable: dict[str, str] = field(default_factory=dict)
    #: Every object found on the backends.
    stored_ids: set[str] = field(default_factory=set, repr=False)

    def merge(self, other: RebalanceReport) -> None:
        self.objects = max(self.objects, other.objects)
        self.copied += other.copied
        self.bytes_copied += other.bytes_copied
        self.dropped += other.dropped
        self.kept = other.kept
        self.lost = other.lost
        self.unreachable = {**self.unreachable, **other.unreachable}


def rebalance(
    repo: Repository,
    config: Config,
    extra: dict[str, Backend] | None = None,
    *,
    drop: bool,
    verify_all: bool = False,
) -> RebalanceReport:
    """Put every object held anywhere on the backends ``config``'s mapping names
    for it; with ``drop``, then remove copies from backends that should not hold
    it (``extra`` backends, such as one being removed, are read from and, with
    ``drop``, emptied). With ``verify_all`` every copy is downloaded and checked
    first, and a corrupt one is replaced (``fsck --repair``)."""
    targets = repo.open_backends(config)
    sources = {**(extra or {}), **targets}
    inventory = take_inventory(repo, sources)
    mapping = mapping_of(config)
    report = RebalanceReport(objects=len(inventory.stored_ids()),
                             unreachable=dict(inventory.unreachable),
                             stored_ids=inventory.stored_ids())
    work = sorted(inventory.copies.items())
    coded = sorted(inventory.fragments.items())
    fragment_map = fragment_mapping_of(config)
    repo.reporter.start("rebalance", len(work) + len(coded))
    try:
        futures: list[Future[_ObjectOutcome]] = [
            repo.store.executor.submit(
                _place_one, repo, sources, mapping.locate(stored_id), stored_id, have,
                drop, verify_all, inventory.unreachable,
            )
            for stored_id, have in work
        ]
        futures += [
            repo.store.executor.submit(
                _place_fragments, repo, sources, fragment_map.locate(stored_id), stored_id,
                held, drop, verify_all, inventory.unreachable, config,
            )
            for stored_id, held in coded
        ]
        for future in futures:
            outcome = future.result()
            report.copied += outcome.copied
            report.bytes_copied += outcome.bytes_copied
            report.dropped += outcome.dropped
            report.kept += outcome.kept
            if outcome.lost:
                report.lost.append(outcome.stored_id)
            repo.reporter.advance(1)
    finally:
        repo.reporter.finish()
    return report


@dataclass
class _ObjectOutcome:
    stored_id: str
    copied: int = 0
    bytes_copied: int = 0
    dropped: int = 0
    kept: int = 0
    lost: bool = False

    def drop(self, backend: Backend, key: str) -> None:
        """Delete one extra copy (its required copies are verified); one that cannot
        be deleted now stays, counted as kept, for the next rebalance."""
        try:
            backend.delete(key)
            self.dropped += 1
        except ObjectNotFound:
            pass
        except MetasyncError:
            self.kept += 1


def _place_one(
    repo: Repository,
    backends: dict[str, Backend],
    holders: tuple[str, ...],
    stored_id: str,
    have: dict[str, int],
    drop: bool,
    verify_all: bool,
    unreachable: dict[str, str],
) -> _ObjectOutcome:
    """Copy one object to the holders missing it, then drop extra copies (numcopies)."""
    out = _ObjectOutcome(stored_id)
    key = object_key(stored_id)
    verified: set[str] = set()
    bad: set[str] = set()

    def verify_at(backend_id: str) -> bytes | None:
        """The copy on ``backend_id`` if it is good (and remember which it was)."""
        if backend_id in unreachable or backend_id in bad:
            return None
        try:
            data = backends[backend_id].get(key)
            verify_stored(repo.codec, stored_id, data)
        except MetasyncError:
            bad.add(backend_id)
            return None
        verified.add(backend_id)
        return data

    good: bytes | None = None
    if verify_all:
        for backend_id in sorted(have):
            good = verify_at(backend_id) or good
    missing = [h for h in holders if (h not in have or h in bad) and h not in unreachable]
    if missing:
        # A verified copy, from the best backend that has one (holders first).
        for backend_id in sorted(have, key=lambda b: (b in verified, b not in holders)):
            if good is not None:
                break
            good = verify_at(backend_id)
        if good is None:
            out.lost = True
            return out
        for backend_id in missing:
            try:
                backends[backend_id].put(key, good)
            except MetasyncError:
                continue
            verified.add(backend_id)
            bad.discard(backend_id)
            out.copied += 1
            out.bytes_copied += len(good)
    if not drop:
        return out
    extras = [b for b in have if b not in holders]
    if not extras:
        return out
    # numcopies: every holder has it, and all R of those copies are verified by
    # content, before any extra copy goes.
    for h in holders:
        if h not in verified:
            verify_at(h)
    if not all(h in verified for h in holders):
        out.kept += len(extras)
        return out
    for backend_id in extras:
        if backend_id in unreachable:
            out.kept += 1
            continue
        out.drop(backends[backend_id], key)
    return out


def _place_fragments(
    repo: Repository,
    backends: dict[str, Backend],
    holders: tuple[str, ...],
    stored_id: str,
    held: dict[int, dict[str, int]],
    drop: bool,
    verify_all: bool,
    unreachable: dict[str, str],
    config: Config,
) -> _ObjectOutcome:
    """An erasure-coded object: each of its n holders must hold one fragment, all
    of different indexes. A fragment stays where it is if that backend is still a
    holder; a holder without one gets a missing index, copied if some other backend
    has it, else rebuilt from any k good fragments. With ``drop``, fragments on
    other backends (and second fragments on a holder) go once every holder's
    fragment is verified."""
    out = _ObjectOutcome(stored_id)
    if config.erasure is None:
        out.kept += sum(len(h) for h in held.values())
        return out
    scheme = ErasureScheme(*config.erasure)
    hasher = repo.codec.hasher
    good: dict[int, bytes] = {}
    verified: dict[str, int] = {}  # backend -> the index it verifiably holds

    def fetch(index: int, backend_id: str) -> bytes | None:
        if backend_id in unreachable:
            return None
        try:
            data = backends[backend_id].get(fragment_key(stored_id, index))
            verify_fragment(hasher, stored_id, index, data)
        except MetasyncError:
            return None
        good.setdefault(index, data)
        return data

    # Which index each holder keeps (its own position's if it has that one).
    assigned: dict[str, int] = {}
    for position, backend_id in enumerate(holders):
        options = sorted(i for i, where in held.items() if backend_id in where)
        options.sort(key=lambda i: i != position)
        for index in options:
            if index in assigned.values():
                continue
            if verify_all and fetch(index, backend_id) is None:
                continue
            assigned[backend_id] = index
            if verify_all:
                verified[backend_id] = index
            break
    missing = sorted(set(range(scheme.n)) - set(assigned.values()))
    empty = [b for b in holders if b not in assigned and b not in unreachable]
    for backend_id, index in zip(empty, missing, strict=False):
        data = good.get(index)
        if data is None:
            for source in held.get(index, {}):
                data = fetch(index, source)
                if data is not None:
                    break
        if data is None:
            for other, holding in sorted(held.items()):
                if len(good) >= scheme.k:
                    break
                for b in holding:
                    if fetch(other, b) is not None:
                        break
            try:
                data = rebuild_fragment(hasher, scheme, stored_id, good, index)
            except (CorruptObject, ObjectUnavailable):
                out.lost = True
                continue
        try:
            backends[backend_id].put(fragment_key(stored_id, index), data)
        except MetasyncError:
            continue
        assigned[backend_id] = index
        verified[backend_id] = index
        out.copied += 1
        out.bytes_copied += len(data)
    if not drop:
        return out
    extras = [(i, b) for i, where in held.items() for b in where if assigned.get(b) != i]
    if not extras:
        return out
    if len(assigned) < len(holders):
        out.kept += len(extras)
        return out
    for backend_id, index in assigned.items():
        if backend_id not in verified and fetch(index, backend_id) is None:
            out.kept += len(extras)
            return out
        verified[backend_id] = index
    for index, backend_id in extras:
        out.drop(backends[backend_id], fragment_key(stored_id, index))
    return out


# ============================================================== configuration changes
@dataclass
class ConfigChange:
    """A decided configuration change."""

    version: Version
    old: Config
    new: Config
    config_id: str
    report: RebalanceReport = field(default_factory=RebalanceReport)


def store_config(repo: Repository, config: Config, backends: Iterable[Backend]) -> str:
    """Write ``config`` as ``config/<id>`` on every given backend (before any version
    names it); return its id. Raises if none could be written."""
    data = config.to_bytes()
    config_id = repo.codec.id_of("config", data)
    stored = repo.codec.encode("config", config_id, data)
    written = 0
    errors: list[str] = []
    for backend in backends:
        try:
            backend.put(f"config/{config_id}", stored)
            written += 1
        except MetasyncError as exc:
            errors.append(f"{backend.name}: {exc}")
    if not written:
        raise BackendError(f"could not store the new configuration anywhere ({'; '.join(errors)})")
    return config_id


def change_config(
    repo: Repository,
    make_new: Callable[[Config], Config],
    before_commit: Callable[[Config, Config], None] | None = None,
) -> ConfigChange:
    """Decide a new configuration through pPaxos: learn the latest version, derive
    the new configuration from its one, store it on every backend of both, run
    ``before_commit`` (copies that must exist before anyone reads by the new
    mapping), then propose ``(latest + 1, latest master, new config)`` to the old
    configuration's acceptors. Retries from the start if another version wins.

    Leaves this client's folder and base version alone: its next pull or push
    learns the change like any other client's."""
    for _ in range(MAX_CHANGE_ATTEMPTS):
        latest = repo.learn_latest()
        old = repo.load_config(latest.config)
        new = make_new(old)
        if new == old:
            raise UsageError("nothing to change: the configuration already says so")
        both = {**repo.open_backends(old), **repo.open_backends(new)}
        config_id = store_config(repo, new, both.values())
        with repo.db.transaction():
            repo.db.cache_object(config_id, "config", new.to_bytes())
        if before_commit is not None:
            before_commit(old, new)
        consensus = repo.consensus_for(latest.config)
        proposal = Version(latest.number + 1, latest.master, config_id)
        chosen = consensus.propose(proposal.number, proposal)
        if chosen != proposal:
            continue
        consensus.publish(chosen)
        # New acceptors get the hint too: a clone from one of them starts there.
        hint = encode_hint(repo.codec, chosen.number, latest.config)
        for backend_id in set(new.acceptors) - set(old.acceptors):
            try:
                both[backend_id].put(HINT_KEY, hint)
            except MetasyncError:
                pass
        return ConfigChange(chosen, old, new, config_id)
    raise BackendError(
        f"other clients kept committing during {MAX_CHANGE_ATTEMPTS} attempts; retry",
        transient=True,
    )


def moved_minimum(old: Config, new: Config, stored_ids: Iterable[str]) -> int:
    """The theoretical minimum of copies to write to go from ``old``'s placement to
    ``new``'s for these objects (see :func:`metasync.mapping.minimum_moved_copies`)."""
    old_map: StableMapping = mapping_of(old)
    return movement(old_map, mapping_of(new), list(stored_ids))[1]


def reconfigure(
    repo: Repository,
    make_new: Callable[[Config], Config],
    extra: dict[str, Backend] | None = None,
) -> ConfigChange:
    """A configuration change that moves data: copy to the new places, decide the
    change, copy what arrived meanwhile and drop what is no longer needed. The
    report counts every copy written against the theoretical minimum."""
    report = RebalanceReport()

    def copy_first(old: Config, new: Config) -> None:
        sources = {**repo.open_backends(old), **(extra or {})}
        first = rebalance(repo, new, sources, drop=False)
        report.merge(first)
        report.stored_ids = first.stored_ids
        report.minimum = moved_minimum(old, new, first.stored_ids)

    change = change_config(repo, make_new, copy_first)
    with repo.db.transaction():
        repo.db.set("rebalance_pending", change.config_id)
    second = rebalance(repo, change.new, {**repo.open_backends(change.old), **(extra or {})}, drop=True)
    with repo.db.transaction():
        repo.db.set("rebalance_pending", None)
    report.merge(second)
    change.report = report
    return change


# ============================================================== adding a backend
def prepare_new_backend(repo: Repository, backend: Backend, backend_id: str) -> None:
    """Make ``backend`` part of the repository before any configuration names it:
    the namespace, the wrapped key file, the configurations a clone starts from,
    and the descriptor last (its presence marks a complete repository)."""
    from metasync.repository import DESCRIPTOR_KEY, KEYFILE_KEY, check_backend_free, descriptor

    check_backend_free(backend)
    backend.create()
    if repo.config.encryption != "none":
        backend.put(KEYFILE_KEY, _read_anywhere(repo, KEYFILE_KEY))
    init_config = repo.init_config_id
    for config_id in {init_config, repo.config_id}:
        backend.put(f"config/{config_id}", _read_anywhere(repo, f"config/{config_id}"))
    backend.put(DESCRIPTOR_KEY, descriptor(repo.config, init_config, backend_id))


def _read_anywhere(repo: Repository, key: str) -> bytes:
    reasons = []
    for backend in repo.backends.values():
        try:
            return backend.get(key)
        except MetasyncError as exc:
            reasons.append(f"{backend.name}: {exc}")
    raise BackendError(f"no backend returned {key} ({'; '.join(reasons[-3:])})")


def new_backend_spec(uri: str, capacity: float | None, current: Config) -> BackendSpec:
    """The spec of a backend being added: a fresh id, its public URI, and a capacity
    (default: the mean of the others', so it gets an equal share)."""
    if capacity is None:
        capacity = sum(b.capacity for b in current.backends) / len(current.backends)
    if not capacity > 0:
        raise UsageError("--capacity must be a positive number of GB")
    taken = {b.id for b in current.backends}
    backend_id = secrets.token_hex(4)
    while backend_id in taken:
        backend_id = secrets.token_hex(4)
    return BackendSpec(backend_id, public_uri(uri), capacity)


def resolve_backend(config: Config, name: str) -> BackendSpec:
    """The backend ``name`` names: its id, its URI (with or without a password),
    or a unique prefix of its id."""
    from metasync.backends import normalize_uri

    uri = public_uri(normalize_uri(name)) if ":" in name or name.startswith("/") else None
    matches = [b for b in config.backends if b.id == name or (uri is not None and b.uri == uri)]
    if not matches:
        matches = [b for b in config.backends if b.id.startswith(name)]
    if len(matches) != 1:
        known = ", ".join(f"{b.id} ({b.uri})" for b in config.backends)
        what = "no backend" if not matches else "more than one backend"
        raise UsageError(f"{what} matches {name!r}; the backends are: {known}")
    return matches[0]



# ============================================================== listing
@dataclass
class BackendInfo:
    """One backend as ``metasync backend list`` shows it."""

    id: str
    uri: str
    capacity: float
    #: The share of object copies the mapping gives it (its vnodes' share).
    share: float
    objects: int
    bytes: int
    health: str

    def to_json(self) -> dict[str, object]:
        return {"id": self.id, "uri": self.uri, "capacity": self.capacity, "share": self.share,
                "objects": self.objects, "bytes": self.bytes, "health": self.health}


@dataclass
class BackendListing:
    backends: list[BackendInfo]
    replicas: int
    erasure: tuple[int, int] | None
    #: Distinct stored objects, and the bytes of one copy of each.
    objects: int
    logical_bytes: int
    #: Bytes held on all backends together.
    stored_bytes: int
    rebalance_pending: bool

    @property
    def overhead(self) -> float:
        """Stored bytes per byte of content (2.0 for R = 2, about 1.5 for 2/3 coding)."""
        return self.stored_bytes / self.logical_bytes if self.logical_bytes else 0.0

    def to_json(self) -> dict[str, object]:
        return {"backends": [b.to_json() for b in self.backends], "replicas": self.replicas,
                "erasure": list(self.erasure) if self.erasure else None, "objects": self.objects,
                "logical_bytes": self.logical_bytes, "stored_bytes": self.stored_bytes,
                "overhead": round(self.overhead, 3), "rebalance_pending": self.rebalance_pending}


def list_backends(repo: Repository, config: Config) -> BackendListing:
    backends = repo.open_backends(config)
    inventory = take_inventory(repo, backends)
    mapping = mapping_of(config)
    infos = []
    for spec in config.backends:
        objects, size = inventory.held_by(spec.id)
        health = "ok"
        if spec.id in inventory.unreachable:
            health = f"unreachable: {inventory.unreachable[spec.id]}"
        infos.append(BackendInfo(spec.id, spec.uri, spec.capacity,
                                 mapping.vnodes(spec.id) / mapping.total_vnodes, objects, size, health))
    logical = sum(max(c.values()) for c in inventory.copies.values())
    stored = sum(sum(c.values()) for c in inventory.copies.values())
    k = config.erasure[0] if config.erasure else 1
    header = header_length(config.erasure[1]) if config.erasure else 0
    for by_index in inventory.fragments.values():
        sizes = [max(where.values()) for where in by_index.values()]
        # A fragment is a header and 1/k of the (padded) object.
        logical += k * (max(sizes) - header)
        stored += sum(sum(where.values()) for where in by_index.values())
    return BackendListing(infos, config.replicas, config.erasure, len(inventory.stored_ids()),
                          logical, stored, bool(repo.db.get("rebalance_pending")))


# ============================================================== garbage collection
@dataclass
class ClientStates:
    """What the clients published in ``clients/<id>`` (union over backends)."""

    heads: set[str] = field(default_factory=set)
    prev_masters: set[str] = field(default_factory=set)
    #: Objects announced by pushes in progress (uploaded or about to be).
    pending: set[str] = field(default_factory=set)


def read_client_states(repo: Repository, backends: dict[str, Backend]) -> ClientStates:
    """Read every client's state from every backend. A push announces its uploads
    on a majority of the backends before making them, so reading a majority is
    enough to see every announcement made before this read started."""
    states = ClientStates()

    def read_all(backend: Backend) -> list[dict[str, object]]:
        docs = []
        for key in backend.list("clients"):
            try:
                raw = repo.codec.decode("client", key, backend.get(key))
                doc = json.loads(raw)
            except ObjectNotFound:
                continue
            except (CorruptObject, ValueError, RecursionError):
                continue  # unreadable: as if absent (it cannot announce anything)
            if isinstance(doc, dict):
                docs.append(doc)
        return docs

    answered = 0
    errors: list[str] = []
    futures = {b: repo.store.executor.submit(read_all, backend) for b, backend in backends.items()}
    for backend_id, future in futures.items():
        try:
            docs = future.result()
        except MetasyncError as exc:
            errors.append(f"{backends[backend_id].name}: {exc}")
            continue
        answered += 1
        for doc in docs:
            head = doc.get("head")
            if is_object_id(head):
                states.heads.add(str(head))
            prev = doc.get("prev")
            if isinstance(prev, dict) and is_object_id(prev.get("master")):
                states.prev_masters.add(str(prev["master"]))
            pending = doc.get("pending")
            if isinstance(pending, list):
                states.pending.update(p for p in pending if is_object_id(p))
    if answered <= len(backends) // 2:
        raise BackendUnavailable(
            f"only {answered} of {len(backends)} backends could be read; gc needs a majority "
            f"to see every push in progress ({errors[0] if errors else ''}); nothing was deleted"
        )
    return states


@dataclass
class GcReport:
    """What a gc did."""

    #: The version the gc decided (its commit names what survives), or None.
    version: Version | None = None
    objects: int = 0
    deleted: int = 0
    bytes_deleted: int = 0
    #: Copies that could not be deleted (an unreachable backend): the next gc retries.
    failed: int = 0
    #: Commits whose content is no longer kept (older than the retention).
    pruned_commits: int = 0
    cutoff_ns: int = 0
    #: Another client's version won the instance: nothing was deleted.
    lost_race: bool = False
    #: Log compaction: the floor it set (0: nothing old enough yet) and the log
    #: objects it removed, or why it was postponed.
    log_floor: int = 0
    logs_removed: int = 0
    log_compaction_error: str = ""


def collect_garbage(
    repo: Repository, now_ns: int | None = None, log_grace_s: float | None = None
) -> GcReport:
    """Collect unneeded objects (:func:`collect_objects`), then compact the pPaxos
    logs of versions decided more than the grace period ago (default one day; see
    :meth:`metasync.consensus.Consensus.compact_logs`). A compaction that cannot
    record its floor on every backend is postponed, which is no error."""
    latest = repo.learn_latest()
    learned_ns = time.time_ns()
    report = collect_objects(repo, latest, now_ns)
    try:
        report.log_floor, report.logs_removed = repo.consensus_for(latest.config).compact_logs(
            latest, learned_ns, time.time_ns() if now_ns is None else now_ns, log_grace_s)
    except MetasyncError as exc:
        report.log_compaction_error = str(exc)
    return report


def collect_objects(repo: Repository, latest: Version, now_ns: int | None = None) -> GcReport:
    """Delete every stored object no version still needs (paper 3.8).

    Kept: every commit of master's history (they are small, and keep ``log``
    whole); the trees, files, blobs and indexes of master, of every commit younger
    than the retention, of every snapshot, and of every client's published head
    and base; and every object a push in progress announced. The gc then writes a
    commit with master's tree whose indexes list exactly the surviving objects, and
    decides it through pPaxos together with a configuration whose ``gc_epoch`` is
    one higher. Only if that version wins does it delete -- so a push that raced it
    either won first (and its objects were kept as master's) or learns the new
    epoch, forgets what it knew of collected objects and re-packs what it needs.
    See docs/design.md, "Garbage collection", for why nothing needed is lost."""
    report = GcReport()
    config = repo.load_config(latest.config)
    if latest.master is None:
        return report
    now_ns = time.time_ns() if now_ns is None else now_ns
    cutoff = max(config.gc_cutoff_ns, now_ns - config.retention_days * 86_400 * 10**9)
    report.cutoff_ns = cutoff
    backends = repo.open_backends(config)
    with repo.reading_with(config):
        inventory = take_inventory(repo, backends)
        states = read_client_states(repo, backends)
        report.objects = len(inventory.stored_ids())
        history = _history(repo, latest.master)
        retained = {cid for cid, c in history.items()
                    if c.time_ns >= cutoff or cid == latest.master}
        retained |= {cid for _, cid in config.snapshots}
        retained |= states.heads | states.prev_masters
        live_packs, live_indexes, kept_commits = _live(
            repo, retained, config, required={latest.master, *(c for _, c in config.snapshots)})
        report.pruned_commits = sum(
            1 for cid, c in history.items() if cid not in kept_commits and c.time_ns >= config.gc_cutoff_ns)
        master = history[latest.master]
        indexes = repo.index_objects(sorted(
            (pack_id, tuple(sorted(entries.values(), key=lambda e: e.offset)))
            for pack_id, entries in live_packs.items()))
        commit = Commit(tree=master.tree, parents=(latest.master,), client=repo.client_id,
                        device=repo.device, time_ns=now_ns, message="gc",
                        indexes=tuple(sorted(i for _, i, _ in indexes)))
        commit_bytes = commit.to_bytes()
        commit_id = repo.codec.id_of("commit", commit_bytes)
        keep = (set(history) | kept_commits | live_indexes | set(live_packs) | states.pending
                | {i for _, i, _ in indexes} | {commit_id})
        garbage_keys: dict[str, dict[str, dict[str, int]]] = {}
        for sid, held in inventory.copies.items():
            if sid not in keep:
                for b, size in held.items():
                    garbage_keys.setdefault(sid, {}).setdefault(b, {})[object_key(sid)] = size
        for sid, by_index in inventory.fragments.items():
            if sid not in keep:
                for index, where in by_index.items():
                    for b, size in where.items():
                        garbage_keys.setdefault(sid, {}).setdefault(b, {})[
                            fragment_key(sid, index)] = size
        if not garbage_keys:
            return report
        repo.upload_standalone([*indexes, ("commit", commit_id, commit_bytes)])
    new = replace(config, gc_epoch=config.gc_epoch + 1, gc_cutoff_ns=cutoff)
    new_id = store_config(repo, new, backends.values())
    consensus = repo.consensus_for(latest.config)
    proposal = Version(latest.number + 1, commit_id, new_id)
    chosen = consensus.propose(proposal.number, proposal)
    if chosen != proposal:
        report.lost_race = True
        return report
    consensus.publish(chosen)
    report.version = chosen

    def delete(item: tuple[str, dict[str, dict[str, int]]]) -> tuple[int, int, int]:
        _, held = item
        done = size = failed = 0
        for backend_id, keys in held.items():
            for key, n in keys.items():
                try:
                    backends[backend_id].delete(key)
                    done += 1
                    size += n
                except ObjectNotFound:
                    pass
                except MetasyncError:
                    failed += 1
        return done, size, failed

    repo.reporter.start("gc", len(garbage_keys))
    try:
        for done, size, failed in repo.store.executor.map(delete, sorted(garbage_keys.items())):
            report.deleted += done
            report.bytes_deleted += size
            report.failed += failed
            repo.reporter.advance(1)
    finally:
        repo.reporter.finish()
    return report


def _history(repo: Repository, master: str) -> dict[str, Commit]:
    """Every commit reachable from ``master`` through any parent."""
    out: dict[str, Commit] = {}
    todo = [master]
    while todo:
        cid = todo.pop()
        if cid in out:
            continue
        commit = repo.load_commit(cid)
        out[cid] = commit
        todo.extend(p for p in commit.parents if p not in out)
    return out


def _live(
    repo: Repository, retained: set[str], config: Config, required: set[str]
) -> tuple[dict[str, dict[str, PackEntry]], set[str], set[str]]:
    """Live pack entries by pack, live index ids, and the retained commits whose
    content could be read (a commit pruned by an earlier gc is only a name now).

    Each retained commit's objects are located through *its own* indexes, and every
    pack so named is live: a client reading that commit (say master, just before
    it learns of this gc) finds each object where that commit says, even when
    another pack holds a copy too."""
    packs: dict[str, dict[str, PackEntry]] = {}
    indexes: set[str] = set()
    kept: set[str] = set()
    maps: dict[str, dict[str, tuple[str, PackEntry]]] = {}

    def index_map(index_id: str) -> dict[str, tuple[str, PackEntry]]:
        found = maps.get(index_id)
        if found is None:
            index = repo.read_index(index_id)
            found = maps[index_id] = {
                e.object_id: (pack_id, e) for pack_id, entries in index.packs for e in entries}
        return found

    for cid in sorted(retained):
        try:
            commit = repo.load_commit(cid)
            objects = repo.reachable_objects(commit)
            located = [index_map(i) for i in commit.indexes]
        except ObjectUnavailable as exc:
            if cid in required:  # master or a snapshot must be whole: stop, delete nothing
                raise ObjectUnavailable(
                    f"cannot read all of version {cid[:12]} ({exc}); run `metasync fsck`; "
                    "gc deleted nothing") from None
            continue  # an unpushed head, or a version an earlier gc already collected
        kept.add(cid)
        indexes.update(commit.indexes)
        for object_id in objects:
            hit = next((m[object_id] for m in located if object_id in m), None)
            if hit is None:
                raise ObjectUnavailable(
                    f"object {object_id[:12]} of commit {cid[:12]} is in none of its indexes; "
                    "run `metasync fsck` (gc deleted nothing)")
            packs.setdefault(hit[0], {})[object_id] = hit[1]
    return packs, indexes, kept
