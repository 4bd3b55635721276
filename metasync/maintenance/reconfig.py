"""Configuration changes: a backend added, removed or resized, a new R, a
snapshot, a retention -- each a version like any other.

A change is ``(latest + 1, latest master, new config)`` decided by pPaxos on the
acceptors of the configuration before it (paper 3.3), so every client learns it
on its next pull or poll. A change that moves data copies every object to its
new holders first (from verified copies), then decides the change, then copies
what arrived meanwhile and drops what is no longer needed (docs/design.md,
"Living with changing storage").
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace

from metasync import verification
from metasync.backends import (
    Backend,
    normalize_uri,
    open_backend,
    public_uri,
    typed_uri,
    without_local_options,
)
from metasync.backends.uris import overlap
from metasync.consensus import encode_hint
from metasync.context import RepoContext, foreign
from metasync.errors import BackendError, MetasyncError, UsageError
from metasync.layout import (
    DESCRIPTOR_KEY,
    HINT_KEY,
    config_key,
    delete_key_files,
    descriptor,
    key_file_keys,
)
from metasync.lifecycle import prepare_locations
from metasync.maintenance.rebalance import RebalanceReport, rebalance
from metasync.mapping import movement
from metasync.objects import BackendSpec, Config, Version, is_snapshot_name
from metasync.replicator import Replicator
from metasync.state import PendingRebalance
from metasync.store import mapping_of
from metasync.versions import Versions

#: A configuration change that keeps losing its instance gives up after this many tries.
MAX_CHANGE_ATTEMPTS = 50


class IncompleteCopy(BackendError):
    """The copy before a change did not reach every new holder: nothing was decided,
    and running the same command again completes it."""

    def __init__(self, message: str) -> None:
        super().__init__(message, transient=True)


@dataclass
class ConfigChange:
    """A decided configuration change."""

    version: Version
    old: Config
    new: Config
    config_id: str
    report: RebalanceReport = field(default_factory=RebalanceReport)


class Reconfiguration:
    """Configuration changes of one repository."""

    def __init__(self, ctx: RepoContext, versions: Versions, replicator: Replicator) -> None:
        self.ctx = ctx
        self.versions = versions
        self.replicator = replicator

    # ---------------------------------------------------------------- deciding a change
    def store_config(self, config: Config, backends: Iterable[Backend]) -> str:
        """Write ``config`` as ``config/<id>`` on every given backend (before any
        version names it); return its id. Raises if none could be written."""
        codec = self.ctx.codec
        data = config.to_bytes()
        config_id = codec.id_of("config", data)
        stored = codec.encode("config", config_id, data)
        written = 0
        errors: list[str] = []
        for backend in backends:
            try:
                backend.put(config_key(config_id), stored)
                written += 1
            except MetasyncError as exc:
                errors.append(f"{backend.name}: {exc}")
        if not written:
            raise BackendError(f"could not store the new configuration anywhere ({'; '.join(errors)})")
        return config_id

    def change_config(
        self,
        make_new: Callable[[Config], Config],
        before_commit: Callable[[Version, Config, Config, str], None] | None = None,
    ) -> ConfigChange:
        """Decide a new configuration through pPaxos: learn the latest version, derive
        the new configuration from its one, store it on every backend of both, run
        ``before_commit(latest, old, new, new id)`` (copies that must exist before
        anyone reads by the new mapping; it may raise to decide nothing), then propose
        ``(latest + 1, latest master, new config)`` to the old configuration's
        acceptors. Retries from the start if another version wins.

        A change of the acceptors is then followed by one more version, the same
        master under the same configuration, decided by the new acceptors
        (:meth:`_settle_on_new_acceptors`).

        Leaves this client's folder and base version alone: its next pull or push
        learns the change like any other client's."""
        versions, pool = self.versions, self.ctx.pool
        for _ in range(MAX_CHANGE_ATTEMPTS):
            latest = versions.learn_latest()
            old = versions.load_config(latest.config)
            new = make_new(old)
            if new == old:
                raise UsageError("nothing to change: the configuration already says so")
            both = {**pool.open(old), **pool.open(new)}
            config_id = self.store_config(new, both.values())
            db = self.ctx.db
            with db.transaction():
                db.cache_object(config_id, "config", new.to_bytes())
                db.cache_object(latest.config, "config", old.to_bytes())
            if before_commit is not None:
                before_commit(latest, old, new, config_id)
            consensus = versions.consensus_for(latest.config)
            proposal = Version(latest.number + 1, latest.master, config_id)
            chosen = consensus.propose(proposal.number, proposal)
            if chosen != proposal:
                continue
            consensus.publish(chosen)
            if set(new.acceptors) != set(old.acceptors):
                self._settle_on_new_acceptors(chosen, latest.config, old, new, both)
            return ConfigChange(chosen, old, new, config_id)
        raise BackendError(
            f"other clients kept committing during {MAX_CHANGE_ATTEMPTS} attempts; retry",
            transient=True,
        )

    def _settle_on_new_acceptors(self, change: Version, old_id: str, old: Config, new: Config,
                                 backends: dict[str, Backend]) -> None:
        """Decide ``(change + 1, same master, new config)`` on the new configuration's
        acceptors and publish it. Until the new acceptors decide some version, the
        newest one (the change) can only be confirmed by a quorum of the old
        configuration, so losing backends the new one tolerates but the old one's
        majority needs would strand every client behind and every fresh clone.
        Another client's version winning that instance is just as good (its
        proposer publishes it). If the new acceptors cannot decide now, they get the
        change's hint instead, as before: nothing is lost, the next push settles."""
        consensus = self.versions.consensus_for(change.config, new)
        settle = Version(change.number + 1, change.master, change.config)
        try:
            chosen = consensus.propose(settle.number, settle)
            if chosen == settle:
                consensus.publish(chosen)
            return
        except MetasyncError as exc:
            self.ctx.reporter.note(f"the new backends did not decide a version yet ({exc}); "
                                   "the next push does")
        hint = encode_hint(self.ctx.codec, change.number, old_id)
        for backend_id in set(new.acceptors) - set(old.acceptors):
            try:
                backends[backend_id].put(HINT_KEY, hint)
            except MetasyncError:
                pass

    def reconfigure(
        self,
        make_new: Callable[[Config], Config],
        extra: dict[str, Backend] | None = None,
    ) -> ConfigChange:
        """A configuration change that moves data: copy to the new places, and only
        if that copy is clean (:func:`unplaced`) record the rebalance it needs and
        decide the change; then finish that rebalance (:meth:`finish_rebalance`:
        copy what arrived meanwhile and drop what is no longer needed, by the newest
        configuration). The report counts every copy written against the
        theoretical minimum."""
        report = RebalanceReport()
        pool, state = self.ctx.pool, self.ctx.state

        def copy_first(latest: Version, old: Config, new: Config, config_id: str) -> None:
            sources = {**pool.open(old), **(extra or {})}
            first = rebalance(self.ctx, self.replicator, new, sources, drop=False)
            problem = unplaced(first, new, pool.name)
            if problem is not None:
                raise IncompleteCopy(problem)
            report.merge(first)
            report.stored_ids = first.stored_ids
            report.minimum = moved_minimum(old, new, first.stored_ids)
            # Recorded before anything is proposed: a crash from here on leaves a
            # rebalance to finish, reading from (and emptying) the old backends.
            with state.transaction():
                pending = state.rebalance_pending or PendingRebalance(())
                state.rebalance_pending = pending.adding(latest.config, config_id)

        change = self.change_config(make_new, copy_first)
        report.merge(self.finish_rebalance(extra))
        change.report = report
        return change

    def finish_rebalance(self, extra: dict[str, Backend] | None = None) -> RebalanceReport:
        """Put every object on the backends the newest configuration names for it and
        drop copies no longer needed, reading also from the backends of the
        configurations a pending change recorded (and ``extra``), which are emptied:
        the second phase of every change, and what finishes an interrupted one. The
        record is cleared once every backend of the newest configuration answered,
        every object is on all its holders and no copy had to be kept (objects with
        no good copy anywhere are reported, and do not keep it)."""
        state, versions = self.ctx.state, self.versions
        pending = state.rebalance_pending
        latest = versions.learn_latest()
        config = versions.load_config(latest.config)
        sources: dict[str, Backend] = {}
        for config_id in pending.sources if pending is not None else ():
            if config_id == latest.config:
                continue
            try:
                sources.update(self.ctx.pool.open(versions.load_config(config_id)))
            except MetasyncError as exc:
                self.ctx.reporter.note(f"cannot read configuration {config_id[:12]} to move "
                                       f"copies from its backends ({exc})")
        sources.update(extra or {})
        report = rebalance(self.ctx, self.replicator, config, sources, drop=True)
        if (pending is not None and unplaced(report, config, self.ctx.pool.name) is None
                and report.kept == 0):
            with state.transaction():
                state.rebalance_pending = None
        return report

    # ---------------------------------------------------------------- backends
    def add_backend(self, uri: str, capacity: float | None = None,
                    mkdir: bool = False) -> ConfigChange:
        """Add the backend at ``uri`` (capacity in GB; default: the others' mean) and
        move to it exactly the copies the new placement gives it. A missing location
        folder is created on servers, and for ``dir:`` only with ``mkdir``; a backend
        whose primitives do not hold is refused (:class:`UsageError`)."""
        uri = typed_uri(normalize_uri(uri))
        latest = self.versions.learn_latest()
        current = self.versions.load_config(latest.config)
        # Compared by what each names, as this client reaches it (init checks the same).
        overlap([uri], root=str(self.ctx.root), existing=[
            self.ctx.pool.uri_of(b.id, b.uri) or b.uri for b in current.backends])
        backend = open_backend(uri, current.namespace)
        spec = new_backend_spec(uri, capacity, current)
        self._prepare_new_backend(backend, spec.id, mkdir)
        self.ctx.pool.adopt(spec.id, backend, uri)

        def make_new(config: Config) -> Config:
            if spec.uri in {b.uri for b in config.backends}:
                raise UsageError(f"{spec.uri} is already a backend of this repository")
            return replace(config, backends=(*config.backends, spec),
                           acceptors=(*config.acceptors, spec.id),
                           format=max(config.format, backend.format_needed()))

        try:
            return self.reconfigure(make_new)
        except IncompleteCopy:
            # Nothing was decided: without its descriptor the backend is free again,
            # so running the command again adds it (the copies made stay and count).
            try:
                backend.delete(DESCRIPTOR_KEY)
            except MetasyncError:
                pass
            raise

    def connect_backend(self, name: str, uri: str | None = None) -> tuple[BackendSpec, str]:
        """Connect this client to backend ``name`` (id, URI or id prefix) of the
        shared configuration, which another client added: by ``uri`` (typed on this
        machine, so with its local options and the environment's credentials), or
        without one by the shared URI less any local option (and no environment
        credentials: that host was not given here). The backend must hold this
        repository's descriptor for that id. Returns the backend's spec and the URI
        now remembered for it (in local state only)."""
        config = self.versions.config
        try:
            spec = resolve_backend(config, name)
        except UsageError:
            config = self.versions.load_config(self.versions.learn_latest().config)
            spec = resolve_backend(config, name)
        own = typed_uri(normalize_uri(uri)) if uri is not None else without_local_options(spec.uri)
        backend = open_backend(own, config.namespace)
        try:
            problem = foreign(backend, spec.id)
        except BaseException:
            backend.close()
            raise
        if problem is not None:
            backend.close()
            raise UsageError(f"{public_uri(own)} {problem} for backend {spec.id}; check the URI")
        self.ctx.pool.adopt(spec.id, backend, own)
        return spec, own

    def _prepare_new_backend(self, backend: Backend, backend_id: str, mkdir: bool) -> None:
        """Make ``backend`` part of the repository before any configuration names it:
        its location (:func:`prepare_locations`), the namespace, a check of its
        primitives (recorded), the wrapped key file, the configurations a clone starts
        from (each copied from a copy verified under its id), and the descriptor last
        (its presence marks a complete repository)."""
        prepare_locations([backend], mkdir)
        backend.create()
        versions, state = self.versions, self.ctx.state
        verification.remember(state, {backend_id: verification.verify(backend)})
        if versions.config.encryption != "none":
            for key, data in self._key_files().items():
                backend.put(key, data)
        init_config = state.init_config_id
        for config_id in {init_config, versions.config_id}:
            backend.put(config_key(config_id), versions.read_config_bytes(config_id, stored=True))
        backend.put(DESCRIPTOR_KEY, descriptor(versions.config, init_config, backend_id,
                                               self.ctx.codec.keyring))

    def _key_files(self) -> dict[str, bytes]:
        """Every key file (slots, tombstones, a legacy key file) of the first backend
        that lists and returns them all."""
        reasons = []
        for backend in self.versions.backends.values():
            try:
                return {key: backend.get(key) for key in key_file_keys(backend)}
            except MetasyncError as exc:
                reasons.append(f"{backend.name}: {exc}")
        raise BackendError(f"no backend returned the key files ({'; '.join(reasons[-3:])})")

    def remove_backend(self, name: str) -> ConfigChange:
        """Remove a backend (by id or URI): first copy what only it would hold to
        the others, then decide the change, then empty it (if it can be reached).
        Works when the backend is gone for good, from the remaining copies."""
        latest = self.versions.learn_latest()
        config = self.versions.load_config(latest.config)
        removed = resolve_backend(config, name)
        gone = self.ctx.pool.open(config)[removed.id]

        def make_new(config: Config) -> Config:
            spec = resolve_backend(config, removed.id)
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

        change = self.reconfigure(make_new, extra={removed.id: gone})
        # The key files go too (best effort): a passphrase must not keep opening keys
        # on a backend the repository no longer uses.
        left = delete_key_files(gone)
        if left:
            self.ctx.reporter.note(f"could not delete the key files from {gone.name}; delete "
                                   f"{', '.join(left)} there when it can be reached")
        return change

    def resize_backend(self, name: str, capacity: float) -> ConfigChange:
        """Give a backend a new capacity (GB): it then holds that share of the copies."""
        if not capacity > 0:
            raise UsageError("the capacity must be a positive number of GB")

        def make_new(config: Config) -> Config:
            spec = resolve_backend(config, name)
            backends = tuple(replace(b, capacity=capacity) if b.id == spec.id else b
                             for b in config.backends)
            return replace(config, backends=backends)

        return self.reconfigure(make_new)

    def set_replicas(self, replicas: int) -> ConfigChange:
        """Keep ``replicas`` copies of every object from now on (and of every object
        there is: the missing copies are written, the extra ones dropped)."""

        def make_new(config: Config) -> Config:
            if not 1 <= replicas <= len(config.backends):
                raise UsageError(
                    f"replicas must be between 1 and {len(config.backends)} (the number of backends)"
                )
            return replace(config, replicas=replicas)

        return self.reconfigure(make_new)

    # ---------------------------------------------------------------- what gc keeps
    def snapshot(self, name: str) -> Version:
        """Keep master as it is now under ``name``: gc never collects it."""
        if not is_snapshot_name(name):
            raise UsageError(f"invalid snapshot name {name!r}; use letters, digits, '.', '_' or '-'")

        def make_new(config: Config) -> Config:
            master = self.versions.learn_latest().master
            if master is None:
                raise UsageError("nothing to keep yet: push something first")
            if config.snapshot(name) is not None:
                raise UsageError(f"snapshot {name!r} exists; delete it first or choose another name")
            return replace(config, snapshots=tuple(sorted((*config.snapshots, (name, master)))))

        return self.change_config(make_new).version

    def delete_snapshot(self, name: str) -> Version:
        """Let gc collect what only snapshot ``name`` kept."""

        def make_new(config: Config) -> Config:
            if config.snapshot(name) is None:
                raise UsageError(f"no snapshot named {name!r}")
            return replace(config, snapshots=tuple(s for s in config.snapshots if s[0] != name))

        return self.change_config(make_new).version

    def snapshots(self) -> list[tuple[str, str]]:
        """``(name, commit id)`` of every snapshot, by name."""
        return list(self.versions.load_config(self.versions.learn_latest().config).snapshots)

    def set_retention(self, days: int) -> Version:
        """Keep every version for ``days`` days before gc may collect what only it needs."""
        if days < 0:
            raise UsageError("the retention must be zero or more days")
        return self.change_config(lambda config: replace(config, retention_days=days)).version


def unplaced(report: RebalanceReport, config: Config,
             name: Callable[[str], str]) -> str | None:
    """Why a copy to ``config``'s holders is not clean, in one line, or None if it
    is: every backend of ``config`` answered its listing and every object found is
    on all of its holders. Backends not in ``config`` (one being removed, maybe dead)
    may be unreachable, and objects with no good copy anywhere (``report.lost``)
    can never be placed: they are reported, never waited for."""
    ids = {b.id for b in config.backends}
    why = {b: f"did not answer: {r}" for b, r in report.unreachable.items() if b in ids}
    for backend_id, reason in report.missed.items():
        why.setdefault(backend_id, reason)
    if not why:
        return None
    backends = "; ".join(f"{name(b)} {' '.join(r.split())}" for b, r in sorted(why.items()))
    count = len(report.short)
    return (f"nothing was changed: {count} object(s) could not be placed on their new holders "
            f"({backends}); retry later (run the command again) to complete the change")


def moved_minimum(old: Config, new: Config, stored_ids: Iterable[str]) -> int:
    """The theoretical minimum of copies to write to go from ``old``'s placement to
    ``new``'s for these objects (see :func:`metasync.mapping.minimum_moved_copies`)."""
    return movement(mapping_of(old), mapping_of(new), list(stored_ids))[1]


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
    uri = public_uri(normalize_uri(name)) if ":" in name or name.startswith("/") else None
    matches = [b for b in config.backends if b.id == name or (uri is not None and b.uri == uri)]
    if not matches:
        matches = [b for b in config.backends if b.id.startswith(name)]
    if len(matches) != 1:
        known = ", ".join(f"{b.id} ({b.uri})" for b in config.backends)
        what = "no backend" if not matches else "more than one backend"
        raise UsageError(f"{what} matches {name!r}; the backends are: {known}")
    return matches[0]
