"""``metasync recover``: a repository whose majority of backends is gone for good,
rebuilt from the backends that survived.

pPaxos cannot decide anything without a quorum, and rightly refuses: a client that
could still reach the lost backends might be deciding versions there. When the
user knows those backends are gone (the providers closed the accounts), recovery
is the explicit, loud, documented way out, as etcd's ``--force-new-cluster`` and
CockroachDB's ``debug recover`` are:

1. :func:`prepare` reads what the survivors hold -- descriptor, key, every
   configuration, and every version their acceptor logs show accepted -- and
   creates the local folder's ``.metasync`` at the newest configuration.
2. :meth:`Recovery.restore_newest` checks out the newest of those versions whose
   whole tree is readable (verified) from the survivors, and reports the newer
   ones it saw but cannot restore, with the files they changed where that is known.
3. After the user confirms, :meth:`Recovery.reform` makes the survivors (plus any
   added backends) a new configuration that no longer waits for the lost ones:
   the recovered version is decided there at an instance far above anything the
   old logs hold (:data:`RECOVERY_GAP`), every survivor gets a mark that retires
   every old configuration (a client still using one refuses to go on and says to
   clone again, docs/FORMAT.md §9.2), and every object is copied back to R
   copies by the replicator.
"""

from __future__ import annotations

import json
import secrets
import shutil
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path

from metasync.backends import Backend, normalize_uri, open_backend, typed_uri
from metasync.backends.uris import overlap
from metasync.checkout import Checkout
from metasync.codec import Codec
from metasync.context import RepoContext, create_local
from metasync.errors import (
    CorruptObject,
    MetasyncError,
    NotARepository,
    NotTrusted,
    ObjectNotFound,
    ObjectUnavailable,
    UsageError,
)
from metasync.graph import ObjectGraph
from metasync.keyslots import LocalKey
from metasync.layout import (
    CONFIG_PREFIX,
    DESCRIPTOR_KEY,
    LOG_PREFIX,
    check_backend_free,
    check_descriptor,
    check_namespace,
    config_key,
    descriptor,
    instance_of_log,
    key_file_keys,
    log_key,
    parse_descriptor,
    retired_key,
)
from metasync.lifecycle import PassphraseSource, new_folder, unlock_keys
from metasync.maintenance.rebalance import RebalanceReport, rebalance
from metasync.maintenance.reconfig import Reconfiguration, new_backend_spec
from metasync.objects import BackendSpec, Config, TreeEntry, Version, is_object_id
from metasync.paxos import Message
from metasync.replicator import Replicator
from metasync.state import PendingCheckout
from metasync.versions import Versions

#: The recovered version is decided this many instances above the highest instance
#: any survivor's log shows: a client of an old configuration that has not seen the
#: retirement mark yet can only write instances far below it.
RECOVERY_GAP = 1000
#: Newer versions seen but not restorable, listed by name in the report.
MAX_REPORTED = 5


@dataclass
class RecoveryPlan:
    """What the survivors hold, read before anything is written anywhere."""

    root: Path
    created: bool
    #: Survivor backend id -> the URI this client reaches it by.
    survivors: dict[str, str]
    #: Every configuration found, by id.
    configs: dict[str, Config]
    #: Versions the survivors' logs show accepted, newest first.
    candidates: list[Version]
    #: The highest log instance any survivor holds.
    highest_instance: int
    key: LocalKey | None

    def undo(self) -> None:
        """Remove what the recovery created locally (nothing was written to a backend)."""
        if self.created:
            shutil.rmtree(self.root, ignore_errors=True)
            return
        for child in self.root.iterdir():
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child, ignore_errors=True)
            else:
                child.unlink(missing_ok=True)


@dataclass
class Unrestorable:
    """A version newer than the one restored that could not be restored."""

    version: Version
    reason: str
    #: Paths whose content differs from the restored version's (None: its tree
    #: could not be read either).
    changed: list[str] | None = None


@dataclass
class RecoverResult:
    """What ``metasync recover`` did."""

    restored: Version
    #: The version the recovered repository starts from (in the new configuration).
    version: Version | None = None
    newer: list[Unrestorable] = field(default_factory=list)
    backends: list[str] = field(default_factory=list)
    replicas: int = 0
    rebalance: RebalanceReport = field(default_factory=RebalanceReport)


def prepare(uris: list[str], root: str | Path, *, namespace: str,
            passphrase: PassphraseSource | None, allow_unencrypted: bool = False) -> RecoveryPlan:
    """Read the survivors and create ``root/.metasync`` (nothing goes to a backend).
    Fails with one line if ``root`` is not empty, no survivor holds the repository,
    the passphrase is wrong, or the survivors say the repository is not encrypted and
    ``allow_unencrypted`` is not given (a backend can rewrite its descriptor so, as
    for a clone)."""
    root = new_folder(root, "recover")
    if not uris:
        raise UsageError("give the backends that survived: --backend URI (one or more)")
    check_namespace(namespace)
    overlap([normalize_uri(u) for u in uris], root=str(root))  # one store named twice
    backends = [open_backend(typed_uri(normalize_uri(u)), namespace) for u in uris]
    try:
        descriptors = {}
        for backend in backends:
            try:
                descriptors[backend.uri] = parse_descriptor(backend.get(DESCRIPTOR_KEY), backend.name)
            except (ObjectNotFound, NotARepository):
                continue
            except MetasyncError as exc:
                raise UsageError(f"cannot read {backend.name}: {exc}") from None
        if len(descriptors) != len(backends):
            missing = [b.name for b in backends if b.uri not in descriptors]
            raise NotARepository(f"no metasync repository (namespace {namespace!r}) on "
                                 f"{', '.join(missing)}; give only backends of the repository")
        first = descriptors[backends[0].uri]
        key = None
        if first["encryption"] == "none" and not allow_unencrypted:
            raise NotTrusted(
                f"{backends[0].name} says the repository is not encrypted, and a backend can "
                "make an encrypted one look so; recover with --no-encrypt only if you know it "
                "is not")
        if first["encryption"] != "none":
            key = unlock_keys(backends, first, passphrase, backends[0].name)
            for backend in backends:
                if "repository" in descriptors[backend.uri]:
                    check_descriptor(descriptors[backend.uri], key.ring, backend.name)
        codec = Codec(key.ring if key is not None else None)
        configs = _configs(backends, codec, namespace)
        survivors = {descriptors[b.uri]["backend"]: b.uri for b in backends}
        candidates, highest = _candidates(backends, codec)
    finally:
        for backend in backends:
            backend.close()
    usable = [v for v in candidates if v.master is not None and v.config in configs]
    if not usable:
        raise UsageError("the backends given hold no version to recover (nothing was pushed "
                         "there, or their logs were lost too)")
    newest = configs[usable[0].config]
    created = not root.exists()
    newest_id = usable[0].config
    create_local(root, newest, newest_id, key, survivors)
    return RecoveryPlan(root, created, survivors, configs, usable, highest, key)


def _key_files(backends: list[Backend]) -> dict[str, bytes]:
    """Every key file of the first survivor that lists and returns them all."""
    for backend in backends:
        try:
            return {key: backend.get(key) for key in key_file_keys(backend)}
        except MetasyncError:
            continue
    raise NotARepository("none of the backends given returned the key files; is it the right "
                         "repository?")


def _configs(backends: list[Backend], codec: Codec, namespace: str) -> dict[str, Config]:
    """Every configuration any survivor holds that decodes under its id."""
    found: dict[str, Config] = {}
    for backend in backends:
        try:
            keys = list(backend.list(CONFIG_PREFIX))
        except MetasyncError:
            continue
        for key in keys:
            config_id = key.partition("/")[2]
            if not is_object_id(config_id) or config_id in found or key != config_key(config_id):
                continue
            try:
                config = Config.from_bytes(codec.decode("config", config_id, backend.get(key)))
            except MetasyncError:
                continue
            if config.namespace == namespace:
                found[config_id] = config
    return found


def _candidates(backends: list[Backend], codec: Codec) -> tuple[list[Version], int]:
    """Every version the survivors' logs show accepted (newest first; at one
    instance, the value more survivors accepted first), and the highest instance."""
    accepted: dict[Version, int] = {}
    highest = 0
    for backend in backends:
        try:
            instances = {i for i in map(instance_of_log, backend.list(LOG_PREFIX)) if i is not None}
        except MetasyncError:
            continue
        highest = max(highest, *instances) if instances else highest
        for instance in instances:
            try:
                entries = backend.logs.fetch(log_key(instance))
            except MetasyncError:
                continue
            seen: set[Version] = set()
            for _, raw in entries:
                try:
                    msg = Message.from_json(json.loads(codec.decode("log", str(instance), raw)))
                except (MetasyncError, ValueError, RecursionError):
                    continue
                if msg.value is not None and msg.value.number == instance:
                    seen.add(msg.value)
            for version in seen:
                accepted[version] = accepted.get(version, 0) + 1
    ordered = sorted(accepted, key=lambda v: (v.number, accepted[v]), reverse=True)
    return ordered, highest


class Recovery:
    """Restores and re-forms one repository created by :func:`prepare`."""

    def __init__(self, ctx: RepoContext, versions: Versions, graph: ObjectGraph,
                 checkout: Checkout, replicator: Replicator, plan: RecoveryPlan) -> None:
        self.ctx = ctx
        self.versions = versions
        self.graph = graph
        self.checkout = checkout
        self.replicator = replicator
        self.plan = plan
        # The lost backends are read last, after every survivor (they may still
        # answer, slowly or not at all).
        for config in plan.configs.values():
            for spec in config.backends:
                if spec.id not in plan.survivors:
                    ctx.store.down.setdefault(spec.id, "lost (metasync recover)")

    def restore_newest(self) -> RecoverResult:
        """Check out the newest version whose whole tree the survivors hold (each
        object verified on the way), reporting the newer ones that failed."""
        newer: list[Unrestorable] = []
        for version in self.plan.candidates:
            config = self.plan.configs[version.config]
            try:
                with self.versions.reading_with(config):
                    self._check_out(version)
            except (ObjectUnavailable, CorruptObject) as exc:
                newer.append(Unrestorable(version, str(exc)))
                self._clear_folder()
                continue
            for item in newer:
                item.changed = self._changed(item.version, version)
            return RecoverResult(version, newer=newer)
        raise UsageError(
            "no version's whole tree is readable from the backends given ("
            + "; ".join(f"version {u.version.number}: {u.reason}" for u in newer[:3])
            + "); add the other backends that survived, if any")

    def _check_out(self, version: Version) -> None:
        assert version.master is not None
        commit = self.graph.load_commit(version.master)
        self.graph.load_indexes(commit)
        state = self.ctx.state
        with state.transaction():
            state.head = version.master
            state.checkout_pending = PendingCheckout(None, commit.tree)
        self.checkout.run_pending()

    def _clear_folder(self) -> None:
        state = self.ctx.state
        with state.transaction():
            state.head = None
            state.checkout_pending = None
        for child in self.ctx.root.iterdir():
            if child.name == ".metasync":
                continue
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child, ignore_errors=True)
            else:
                child.unlink(missing_ok=True)
        self.ctx.db.replace_index([])

    def _changed(self, newer: Version, restored: Version) -> list[str] | None:
        """Paths that differ between two versions' trees; None if ``newer``'s tree
        cannot be read."""
        assert newer.master is not None and restored.master is not None
        try:
            with self.versions.reading_with(self.plan.configs[newer.config]):
                theirs = self.graph.tree_at(newer.master)
            ours = self.graph.tree_at(restored.master)
        except (MetasyncError, KeyError):
            return None
        return sorted(p for p in set(theirs) | set(ours)
                      if _entry_key(theirs.get(p)) != _entry_key(ours.get(p)))

    def reform(self, result: RecoverResult, add: list[str],
               reconfig: Reconfiguration) -> RecoverResult:
        """Make the survivors (and ``add``) the new configuration from the restored
        version on; retire every old configuration; copy everything back to R."""
        ctx, plan = self.ctx, self.plan
        old = plan.configs[result.restored.config]
        specs = [spec for spec in _all_specs(plan.configs) if spec.id in plan.survivors]
        added: dict[str, Backend] = {}
        for uri in add:
            uri = typed_uri(normalize_uri(uri))
            backend = open_backend(uri, old.namespace)
            check_backend_free(backend)
            spec = new_backend_spec(uri, None, replace(old, backends=tuple(specs)))
            specs.append(spec)
            added[spec.id] = backend
            ctx.pool.adopt(spec.id, backend, uri)
        erasure = old.erasure if old.erasure and old.erasure[1] <= len(specs) else None
        replicas = min(old.replicas, len(specs))
        if old.erasure and erasure is None:
            replicas = min(old.erasure[1] - old.erasure[0] + 1, len(specs))
        # Prepared first: an added backend knows the format it needs only once its
        # folder is made (a dir: folder of register logs needs format 5), as in
        # `backend add`.
        self._prepare_added(added)
        needed = max((b.format_needed() for b in added.values()), default=0)
        new = replace(old, backends=tuple(specs), acceptors=tuple(s.id for s in specs),
                      replicas=replicas, erasure=erasure, gc_epoch=old.gc_epoch + 1,
                      format=max(old.format, needed))
        new_id = reconfig.store_config(new, ctx.pool.open(new).values())
        number = plan.highest_instance + RECOVERY_GAP
        version = Version(number, result.restored.master, new_id)
        consensus = self.versions.consensus_for(new_id, new)
        chosen = consensus.propose(number, version)
        if chosen != version:
            raise UsageError("another client is recovering this repository at the same time; "
                             "let it finish, then clone from the backends it names")
        consensus.publish(chosen)
        self._retire(new_id, number)
        state = ctx.state
        with state.transaction():
            state.prev = chosen
            state.config_id = new_id
            state.config = new
            state.init_config_id = new_id
        self.versions.adopt_config()
        for backend_id, backend in ctx.pool.open(new).items():
            try:
                backend.put(DESCRIPTOR_KEY, descriptor(new, new_id, backend_id,
                                                       ctx.codec.keyring))
            except MetasyncError:
                continue
        result.version = chosen
        result.backends = [spec.uri for spec in specs]
        result.replicas = replicas
        result.rebalance = rebalance(ctx, self.replicator, new, drop=True)
        return result

    def _prepare_added(self, added: dict[str, Backend]) -> None:
        """The namespace and the key file on each added backend (its configuration
        follows, and its descriptor comes last, with everyone's)."""
        survivors = list(self.ctx.pool.open_by_id(self.plan.survivors).values())
        files = _key_files(survivors) if self.plan.key is not None else {}
        for backend in added.values():
            backend.create()
            for key, data in files.items():
                backend.put(key, data)

    def _retire(self, new_id: str, number: int) -> None:
        """Mark every old configuration retired on every survivor (best effort on
        each; at least one must take every mark)."""
        date = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
        survivors = self.ctx.pool.open_by_id(self.plan.survivors)
        for config_id in self.plan.configs:
            if config_id == new_id:
                continue
            key = retired_key(config_id)
            data = self.ctx.codec.encode("retired", key, json.dumps(
                {"config": new_id, "version": number, "date": date,
                 "token": secrets.token_hex(8)}).encode())
            written = 0
            for backend in survivors.values():
                try:
                    backend.put(key, data)
                    written += 1
                except MetasyncError:
                    continue
            if not written:
                raise UsageError(f"could not mark the old configuration {config_id[:12]} "
                                 "retired on any survivor; retry")


def _all_specs(configs: dict[str, Config]) -> list[BackendSpec]:
    """Every backend spec any configuration names, once each."""
    seen: dict[str, BackendSpec] = {}
    for config in configs.values():
        for spec in config.backends:
            seen[spec.id] = spec
    return list(seen.values())


def _entry_key(entry: TreeEntry | None) -> tuple[str, str, int] | None:
    return (entry.type, entry.ref, entry.size) if entry is not None else None


def explain(plan: RecoveryPlan, result: RecoverResult) -> str:
    """The plain words a user confirms before anything is written to a backend."""
    restored = result.restored
    lines = [
        f"Recovering version {restored.number} (commit {restored.master[:12] if restored.master else '-'}) "
        f"from {len(plan.survivors)} backend(s) that survived.",
    ]
    for item in result.newer[:MAX_REPORTED]:
        files = ("its tree is unreadable" if item.changed is None else
                 f"it changed {', '.join(item.changed[:5]) or 'no file'}"
                 + (f" and {len(item.changed) - 5} more" if item.changed and len(item.changed) > 5 else ""))
        lines.append(f"  version {item.version.number} was seen but cannot be restored ({files})")
    lines += [
        "The repository will go on with these backends only: the others are given up for good.",
        "A computer that can still reach the lost backends must not go on using them:",
        "its next push or pull stops and tells it to clone again (its changes stay in its folder).",
        "Versions that only the lost backends held are lost.",
    ]
    return "\n".join(lines)

