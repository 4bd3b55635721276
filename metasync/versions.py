"""Versions: which configuration is current, agreement per configuration, and
learning the newest decided version.

A version is ``(number, master, config)`` (paper 3.3). The instance after a
version is decided by the acceptors of that version's configuration, so
learning the latest version follows configuration changes hop by hop
(docs/FORMAT.md §9). This client's *base* is ``prev``: its configuration places
new objects and its acceptors decide the next version.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, TypeVar

from metasync import follow
from metasync.backends import Backend
from metasync.context import RepoContext
from metasync.errors import (
    CorruptObject,
    MetasyncError,
    ObjectUnavailable,
)
from metasync.follow import MAX_CONFIG_HOPS
from metasync.layout import config_key
from metasync.objects import Config, Version
from metasync.state import LocalState
from metasync.timeouts import DEFAULT_TIMEOUT, parse_timeout

if TYPE_CHECKING:
    from metasync.consensus import Consensus

__all__ = ["MAX_CONFIG_HOPS", "Versions", "consensus_timeout"]

T = TypeVar("T")

def consensus_timeout(state: LocalState) -> float | None:
    """Seconds consensus waits without progress: ``METASYNC_TIMEOUT`` (set by the
    CLI's ``--timeout``), else the repository's setting, else None (the default
    of :class:`~metasync.consensus.Consensus`)."""
    return parse_timeout(os.environ.get("METASYNC_TIMEOUT") or state.timeout)


class Versions:
    """This client's configuration and its view of the decided versions."""

    def __init__(self, ctx: RepoContext) -> None:
        self.ctx = ctx
        self.state = ctx.state
        #: The configuration of ``prev`` and its id.
        self.config: Config = ctx.state.config
        self.config_id: str = ctx.state.config_id
        #: The backends of ``config`` by id.
        self.backends: dict[str, Backend] = ctx.store.backends
        # Checked now: a bad value fails every command, not only those that agree.
        self._timeout = consensus_timeout(ctx.state)
        #: pPaxos drivers by configuration id, made on first use (status and commit
        #: never need one, and their modules cost start-up time).
        self._consensus: dict[str, Consensus] = {}
        #: Whether a record that failed to authenticate led to new keys (None: no such
        #: record yet in this session).
        self._rotation_checked: str | None = None

    @property
    def prev(self) -> Version:
        return self.state.prev

    @property
    def consensus(self) -> Consensus:
        """pPaxos over the acceptors of this client's configuration (made on first use)."""
        return self.consensus_for(self.config_id, self.config)

    def consensus_for(self, config_id: str, config: Config | None = None) -> Consensus:
        """The pPaxos driver over the acceptors of configuration ``config_id``."""
        consensus = self._consensus.get(config_id)
        if consensus is None:
            from metasync.consensus import Consensus
            from metasync.paxos import Quorums

            config = config or self.load_config(config_id)
            backends = self.ctx.pool.open(config)
            acceptors = {b: backends[b] for b in config.acceptors}
            consensus = Consensus(
                acceptors, self.ctx.log_codec(config), self.ctx.client_id,
                quorums=Quorums.bft(len(acceptors)) if config.fault_model == "byzantine"
                else Quorums.crash(len(acceptors)),
                timeout=self._timeout or DEFAULT_TIMEOUT,
                config_id=config_id, warn=self._warn_unless_rotated,
                verified_floors=self.state.verified_floors,
            )
            self._consensus[config_id] = consensus
        return consensus

    def _warn_unless_rotated(self, message: str) -> None:
        """Report a pPaxos record that failed to authenticate -- unless it is only
        under a key this client had not received yet: the first such record in a
        session fetches the keyring anew (another client rotated the key) and lets
        the readers use it. If this device's key slot is gone, nothing is reported
        here: the configuration the client is about to learn fails in one line."""
        if self._rotation_checked is None:
            try:
                moved = self.ctx.keys_moved_on()
            except MetasyncError:
                self._rotation_checked = "revoked"
                return
            self._rotation_checked = "moved" if moved else "same"
            if moved:
                self.keys_changed()
                return
        if self._rotation_checked != "revoked":
            self.ctx.reporter.note(message)

    def keys_changed(self) -> None:
        """Let every agreement opened so far read under the keys this client holds
        now: after it fetched a newer keyring, or made one (``key rotate``), whose
        re-encrypted records -- a backend's ``latest`` hint -- are under the new key."""
        for config_id, consensus in self._consensus.items():
            consensus.codec.use(self.ctx.log_codec(self.load_config(config_id)).keyring)

    def consensus_errors(self) -> dict[str, str]:
        """Acceptor id -> why it failed, in the last agreement this client ran, or
        why its log appends keep failing (its latest one failed)."""
        consensus = self._consensus.get(self.config_id)
        if consensus is None:
            return {}
        return {**consensus.failing_appends, **consensus.last_errors}

    def failing_appends(self) -> dict[str, str]:
        """Acceptor id -> why, for each acceptor whose log appends keep failing while
        it answered the rest of the last operation: outvoted and otherwise unnoticed
        (one that does not answer at all is reported as unreachable anyway)."""
        consensus = self._consensus.get(self.config_id)
        if consensus is None:
            return {}
        failing = consensus.failing_appends
        # A failed append is recorded among the operation's errors too, as
        # "<failed|unreachable>: <error>" beside "log appends fail: <error>": an
        # acceptor whose latest error is its append's still answered the rest, so
        # only one whose latest error is another request's counts as down.
        down = {b for b, why in consensus.last_errors.items()
                if b not in failing or why.partition(": ")[2] != failing[b].partition(": ")[2]}
        return {b: why for b, why in failing.items() if b not in down}

    # ---------------------------------------------------------------- configurations
    def load_config(self, config_id: str) -> Config:
        """The configuration ``config_id``: from the local cache, else from the first
        backend that has a good copy (every configuration is stored on every backend
        of it and of the one before, before any version names it)."""
        if config_id == self.config_id:
            return self.config
        db = self.ctx.db
        cached = db.cached_object(config_id)
        if cached is None:
            cached = self.read_config_bytes(config_id)
            with db.transaction():
                db.cache_object(config_id, "config", cached)
        config = Config.from_bytes(cached)
        if config.namespace != self.config.namespace:
            raise CorruptObject(f"configuration {config_id[:12]} is of another namespace")
        return config

    def read_config_bytes(self, config_id: str, stored: bool = False, retry: bool = True) -> bytes:
        """Configuration ``config_id`` from the first opened backend with a copy that
        decodes under its id: its plaintext, or with ``stored`` the stored bytes of
        that verified copy (to copy to a new backend)."""
        reasons: list[str] = []
        for backend in self.ctx.pool.opened():
            try:
                data = backend.get(config_key(config_id))
                plain = self.ctx.codec.decode("config", config_id, data)
            except MetasyncError as exc:
                reasons.append(f"{backend.name}: {exc}")
                continue
            return data if stored else plain
        if retry and self.ctx.keys_moved_on():
            # A key rotation re-encrypted it under a key this client did not hold yet.
            return self.read_config_bytes(config_id, stored, retry=False)
        raise ObjectUnavailable(
            f"no backend has configuration {config_id[:12]} ({'; '.join(reasons[-3:])})"
        )

    def set_base(self, version: Version) -> None:
        """Make decided ``version`` the base (``prev``), its configuration with it.
        Call inside the transaction that records what goes with it, then
        :meth:`adopt_config`."""
        config = self.load_config(version.config) if version.config != self.config_id else None
        self.state.prev = version
        if config is not None:
            self.state.config_id = version.config
            self.state.config = config

    def adopt_config(self) -> None:
        """After ``prev`` moved to another configuration: place, read and agree with
        its backends from now on."""
        config_id = self.state.config_id
        if config_id == self.config_id:
            return
        config = self.state.config
        self.config, self.config_id = config, config_id
        self.backends = self.ctx.pool.open(config)
        self.ctx.store.reconfigure(config, self.backends)
        self.ctx.use_keys(config)

    @contextmanager
    def reading_with(self, config: Config) -> Iterator[None]:
        """Read and place objects by ``config`` (a newer configuration this client has
        not made its base yet) for the duration."""
        store = self.ctx.store
        if config == store.config:
            yield
            return
        old_config, old_backends = store.config, store.backends
        store.reconfigure(config, self.ctx.pool.open(config))
        self.ctx.use_keys(config)
        try:
            yield
        finally:
            store.reconfigure(old_config, old_backends)
            self.ctx.use_keys(old_config)

    # ---------------------------------------------------------------- learning
    def learn_latest(self) -> Version:
        """The newest decided version. Follows configuration changes: the instances
        after a version that changes the configuration are decided by the acceptors
        of its new configuration (docs/FORMAT.md §9), and where a configuration has
        no quorum left, or the client is behind a compaction other acceptors
        decided, from the newest version a backend's hint names and a quorum of the
        hint's configuration confirms (:func:`metasync.follow.latest` decides; this
        drives it). A newer gc epoch is taken into account before anything is read
        or deduplicated under what that gc left."""
        latest = self._follow(follow.latest(self.prev, self.config_id))
        self.note_gc_epoch(self.load_config(latest.config).gc_epoch)
        self._remember_floors()
        return latest

    def _remember_floors(self) -> None:
        """Keep the compaction floors verified this session for the next ones (each
        would otherwise cost a read per acceptor per command)."""
        known = self.state.verified_floors
        merged = dict(known)
        for consensus in self._consensus.values():
            merged.update(consensus.floors.verified())
        if merged != known:
            with self.state.transaction():
                self.state.verified_floors = merged

    def note_gc_epoch(self, epoch: int) -> None:
        """A configuration of gc epoch ``epoch`` was learned: if a gc ran since this
        client last looked, forget where collected objects were."""
        if epoch > self.state.gc_epoch:
            self.state.forget_collected(epoch)

    def confirm_hint(self, number: int, config_id: str) -> Version | None:
        """Version ``number`` if the acceptors of ``config_id`` (the configuration a
        hint names) show it decided and not compacted, else None (hints are only
        shortcuts; :func:`metasync.follow.confirm`)."""
        return self._follow(follow.confirm(number, config_id))

    def start_from_hint(self, entry_id: str) -> None:
        """A fresh clone starts from the version its entry backend's ``latest`` hint
        names, once that version's acceptors confirm it: learning from version 0
        would need the first configuration's backends, which may be long gone. Any
        failure to confirm leaves the start at version 0 (:func:`metasync.follow.start`)."""
        from metasync.consensus import read_hint

        uri = self.state.uri_overrides[entry_id]
        entry = self.ctx.pool.open_by_id({entry_id: uri})[entry_id]
        decided = self._follow(follow.start(read_hint(self.ctx.codec, entry), self.prev))
        if decided is None:
            return
        with self.state.transaction():
            self.set_base(decided)
        self.adopt_config()

    def _follow(self, walk: follow.Follow[T]) -> T:
        """Drive a :mod:`metasync.follow` generator with the pPaxos drivers of the
        configurations it names: each step's result is sent in, a step's
        :class:`MetasyncError` thrown in. An error making a configuration's driver
        for ``get_recent`` (its configuration unreadable, a backend that cannot be
        opened) ends the walk as is; for a hint's confirmation it only leaves the
        hint unconfirmed."""
        reply: Any = None
        error: MetasyncError | None = None
        try:
            while True:
                try:
                    step = walk.throw(error) if error is not None else walk.send(reply)
                except StopIteration as stop:
                    result: T = stop.value
                    return result
                reply, error = None, None
                if isinstance(step, follow.GetRecent):
                    consensus = self.consensus_for(step.config)
                    try:
                        reply = consensus.get_recent(step.known)
                    except MetasyncError as exc:
                        error = exc
                elif isinstance(step, follow.ReadHints):
                    reply = self._read_hints(step)
                else:
                    try:
                        consensus = self.consensus_for(step.config)
                        if isinstance(step, follow.Learn):
                            reply = consensus.learn(step.number)
                        else:
                            reply = consensus.propose(step.number, None)
                    except MetasyncError as exc:
                        error = exc
        finally:
            walk.close()

    def _read_hints(self, step: follow.ReadHints) -> list[tuple[int, str] | None]:
        """The ``latest`` hint of every backend of configuration ``step.storage``
        (this client's) and every acceptor of ``step.acceptors``, read at once; None
        for a backend whose hint is missing, unreadable or out of reach."""
        from metasync.consensus import read_hint

        own = self.config if step.storage == self.config_id else self.load_config(step.storage)
        backends = {**self.ctx.pool.open(own), **self.consensus_for(step.acceptors).acceptors}

        def hint_of(backend: Backend) -> tuple[int, str] | None:
            try:
                return read_hint(self.ctx.codec, backend)
            except MetasyncError:
                return None  # unreachable: its hint is as good as absent

        return list(self.ctx.store.executor.map(hint_of, backends.values()))

    def acceptor_uris(self) -> dict[str, str]:
        """The URI this client uses for each acceptor of its configuration, by id;
        an acceptor this client has not connected is left out."""
        uris = {a: self.ctx.pool.connected_uri(self.config.backend(a))
                for a in self.config.acceptors}
        return {a: uri for a, uri in uris.items() if uri is not None}
