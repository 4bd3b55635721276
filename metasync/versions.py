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
from typing import TYPE_CHECKING

from metasync.backends import Backend
from metasync.context import RepoContext
from metasync.errors import (
    BackendError,
    BackendUnavailable,
    CorruptObject,
    FloorElsewhere,
    MetasyncError,
    ObjectUnavailable,
)
from metasync.layout import config_key
from metasync.objects import Config, Version
from metasync.state import LocalState
from metasync.timeouts import DEFAULT_TIMEOUT, parse_timeout

if TYPE_CHECKING:
    from metasync.consensus import Consensus

#: Most configuration changes one read follows (each costs a round trip or two).
MAX_CONFIG_HOPS = 1000


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
                acceptors, self.ctx.codec, self.ctx.client_id,
                quorums=Quorums.bft(len(acceptors)) if config.fault_model == "byzantine"
                else Quorums.crash(len(acceptors)),
                timeout=self._timeout or DEFAULT_TIMEOUT,
                config_id=config_id,
            )
            self._consensus[config_id] = consensus
        return consensus

    def consensus_errors(self) -> dict[str, str]:
        """Acceptor id -> why it failed, in the last agreement this client ran."""
        consensus = self._consensus.get(self.config_id)
        return consensus.last_errors if consensus is not None else {}

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

    def read_config_bytes(self, config_id: str, stored: bool = False) -> bytes:
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
        try:
            yield
        finally:
            store.reconfigure(old_config, old_backends)

    # ---------------------------------------------------------------- learning
    def learn_latest(self) -> Version:
        """The newest decided version. Follows configuration changes: the instances
        after a version that changes the configuration are decided by the acceptors
        of its new configuration (docs/FORMAT.md §9). A newer gc epoch is taken into
        account before anything is read or deduplicated under what that gc left."""
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
            except BackendUnavailable:
                # No quorum of this configuration answers. If a later configuration
                # (which no longer waits for the lost backends) has decided a newer
                # version, a hint names it and a quorum of that one confirms it.
                newer = self._newer_from_hints(consensus, known)
                if newer is None:
                    raise
                known, consensus = newer, self.consensus_for(newer.config)
                continue
            if latest.config == consensus.config_id:
                self.note_gc_epoch(self.load_config(latest.config).gc_epoch)
                return latest
            consensus = self.consensus_for(latest.config)
            known = latest
        raise BackendError(
            f"the configuration changed more than {MAX_CONFIG_HOPS} times while reading; retry",
            transient=True,
        )

    def note_gc_epoch(self, epoch: int) -> None:
        """A configuration of gc epoch ``epoch`` was learned: if a gc ran since this
        client last looked, forget where collected objects were."""
        if epoch > self.state.gc_epoch:
            self.state.forget_collected(epoch)

    def confirm_hint(self, number: int, config_id: str) -> Version | None:
        """Version ``number`` if the acceptors of ``config_id`` (the configuration a
        hint names) show it decided and not compacted, else None (hints are only
        shortcuts)."""
        try:
            consensus = self.consensus_for(config_id)
            decided = consensus.learn(number)
            if decided is None:
                # Reading alone needs a quorum of matching accepts in view; a version
                # decided in the fast round shows fewer once one of the acceptors
                # that accepted it is gone. Finishing the instance -- a Paxos recovery
                # that proposes nothing of its own -- learns it safely.
                decided = consensus.propose(number, None)
        except MetasyncError:
            return None
        return decided if decided is not None and decided.number == number else None

    def _version_from_hints(self, consensus: Consensus, behind: MetasyncError) -> Version:
        """The newest version that some backend's ``latest`` hint names and the
        acceptors of the hint's configuration confirm (decided, not compacted)."""
        found = self._newer_from_hints(consensus, None)
        if found is None:
            raise BackendError(f"{behind}, and no backend's latest-version hint could be "
                               "confirmed; retry, or clone the repository again", transient=True)
        return found

    def _newer_from_hints(self, consensus: Consensus, known: Version | None) -> Version | None:
        """The newest version after ``known`` (any, if None) that some reachable
        backend's ``latest`` hint names and a quorum of the hint's configuration
        confirms; None if there is none. Hints are only shortcuts: nothing is
        believed that the acceptors do not confirm."""
        from metasync.consensus import read_hint

        backends = {**self.ctx.pool.open(self.config), **consensus.acceptors}
        after = known.number if known is not None else -1

        def hint_of(backend: Backend) -> tuple[int, str] | None:
            try:
                return read_hint(self.ctx.codec, backend)
            except MetasyncError:
                return None  # unreachable: its hint is as good as absent

        found = self.ctx.store.executor.map(hint_of, backends.values())
        hints = sorted({h for h in found if h is not None and h[0] > after}, reverse=True)
        for number, config_id in hints:
            decided = self.confirm_hint(number, config_id)
            if decided is not None:
                return decided
        return None

    def start_from_hint(self, entry_id: str) -> None:
        """A fresh clone starts from the version its entry backend's ``latest`` hint
        names, once that version's acceptors confirm it: learning from version 0
        would need the first configuration's backends, which may be long gone. Any
        failure leaves the start at version 0."""
        from metasync.consensus import read_hint

        uri = self.state.uri_overrides[entry_id]
        entry = self.ctx.pool.open_by_id({entry_id: uri})[entry_id]
        hint = read_hint(self.ctx.codec, entry)
        if hint is None or hint[0] <= self.prev.number + 1:
            return
        decided = self.confirm_hint(*hint)
        if decided is None:
            return
        with self.state.transaction():
            self.set_base(decided)
        self.adopt_config()

    def acceptor_uris(self) -> dict[str, str]:
        """The URI this client uses for each acceptor of its configuration, by id."""
        return {a: self.ctx.pool.uri_of(a, self.config.backend(a).uri)
                for a in self.config.acceptors}
