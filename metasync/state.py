"""This client's settings, typed: what ``.metasync/state.db`` remembers besides
the tables (docs/FORMAT.md §14).

Each setting is a field of :class:`LocalState` with a type; reading it decodes
the stored JSON, assigning it writes it (inside the caller's transaction, when
there is one). Nothing else reads or writes the ``settings`` table, so a key
name appears once, here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar, overload

from metasync.fstraits import FolderTraits
from metasync.localdb import LocalDB
from metasync.objects import Config, Index, Version

T = TypeVar("T")

_MISSING = object()


def _same(value: Any) -> Any:
    return value


class Setting(Generic[T]):
    """A typed field of :class:`LocalState`, stored as JSON under ``key``."""

    def __init__(
        self,
        key: str,
        default: Callable[[], T] | None = None,
        load: Callable[[Any], T] = _same,
        dump: Callable[[T], Any] = _same,
    ) -> None:
        self.key = key
        self._default = default
        self._load = load
        self._dump = dump

    @overload
    def __get__(self, state: None, owner: type) -> Setting[T]: ...

    @overload
    def __get__(self, state: LocalState, owner: type) -> T: ...

    def __get__(self, state: LocalState | None, owner: type) -> Setting[T] | T:
        if state is None:
            return self
        raw = state.db.get(self.key, _MISSING)
        if raw is _MISSING:
            if self._default is None:
                raise KeyError(f"setting {self.key!r} is missing from {state.db.path}")
            return self._default()
        return self._load(raw)

    def __set__(self, state: LocalState, value: T) -> None:
        state.db.set(self.key, self._dump(value))


class _Base(Setting[Version]):
    """``prev``: every version made the base is also remembered by number (the
    ``versions_seen`` table), so ``log`` can number the commits that were master."""

    def __set__(self, state: LocalState, value: Version) -> None:
        super().__set__(state, value)
        state.db.note_version(value.number, value.master)


@dataclass(frozen=True)
class PendingCheckout:
    """A change of the folder from tree ``from_tree`` to ``to_tree`` that has been
    recorded but maybe not finished; every command finishes it first. ``moves``
    maps new paths to paths whose current content they take (a merge's conflict
    copies of local versions: renamed here rather than downloaded). ``in_place``:
    the checkout found the folder empty and writes files in place, once, without
    temporary files (a fresh clone); until it finishes, a file at one of its paths
    that differs from ``to_tree`` is one it was writing, and is written again."""

    from_tree: str | None
    to_tree: str
    moves: dict[str, str] = field(default_factory=dict)
    in_place: bool = False

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"from": self.from_tree, "to": self.to_tree, "moves": self.moves}
        if self.in_place:  # absent otherwise: the record older code wrote and reads
            out["in_place"] = True
        return out

    @classmethod
    def from_json(cls, raw: Any) -> PendingCheckout | None:
        """The checkout ``raw`` describes; None for anything else (a damaged row is
        as if nothing were pending: the next checkout scans the folder anyway)."""
        if not isinstance(raw, dict) or not isinstance(raw.get("to"), str):
            return None
        moves = raw.get("moves") or {}
        if not isinstance(moves, dict):
            moves = {}
        start = raw.get("from")
        return cls(start if isinstance(start, str) else None, raw["to"],
                   {str(k): str(v) for k, v in moves.items()}, raw.get("in_place") is True)


@dataclass(frozen=True)
class PrimitivesChecked:
    """This client's last successful check of one backend's atomic primitives
    (:func:`metasync.backends.probe.verify_primitives`; when it runs:
    :mod:`metasync.verification`)."""

    #: The URI the check went through (without a password): a backend this client
    #: reaches by another URI since is checked again.
    uri: str
    #: The log construction checked (the class of ``backend.logs``).
    logs: str
    #: The primitives checked, e.g. ``["exclusive create", "log appends"]``.
    checked: tuple[str, ...]
    #: When (Unix time, seconds).
    at: float

    def to_json(self) -> dict[str, Any]:
        return {"uri": self.uri, "logs": self.logs, "checked": list(self.checked), "at": self.at}

    @classmethod
    def from_json(cls, raw: Any) -> PrimitivesChecked | None:
        """The record ``raw`` describes; None for anything else (a damaged record is as
        if the backend had never been checked: it is checked again)."""
        if not isinstance(raw, dict):
            return None
        uri, logs, checked, at = raw.get("uri"), raw.get("logs"), raw.get("checked"), raw.get("at")
        if not (isinstance(uri, str) and isinstance(logs, str) and isinstance(checked, list)
                and isinstance(at, int | float)):
            return None
        return cls(uri, logs, tuple(str(c) for c in checked), float(at))


@dataclass(frozen=True)
class PendingRebalance:
    """A configuration change whose rebalance may not be finished: recorded before
    the change is proposed. ``sources`` are the configurations this client moved
    away from (and one it proposed, if that lost its instance): their backends may
    hold copies the newest configuration places elsewhere, so finishing reads from
    them and empties them; the target is always the newest configuration."""

    sources: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        return {"sources": list(self.sources)}

    @classmethod
    def from_json(cls, raw: Any) -> PendingRebalance | None:
        """The record ``raw`` describes: a bare configuration id (what earlier
        versions wrote) is a rebalance with that one source; None for anything else."""
        if isinstance(raw, str):
            return cls((raw,))
        if isinstance(raw, dict) and isinstance(raw.get("sources"), list):
            return cls(tuple(str(s) for s in raw["sources"] if isinstance(s, str)))
        return None

    def adding(self, *config_ids: str) -> PendingRebalance:
        """This record with more sources (each once, in order)."""
        return PendingRebalance(tuple(dict.fromkeys((*self.sources, *config_ids))))


def _pending_rebalance(raw: Any) -> PendingRebalance | None:
    return PendingRebalance.from_json(raw)


def _primitives_checked(raw: Any) -> dict[str, PrimitivesChecked]:
    if not isinstance(raw, dict):
        return {}
    records = {str(k): PrimitivesChecked.from_json(v) for k, v in raw.items()}
    return {k: v for k, v in records.items() if v is not None}


def _pending_checkout(raw: Any) -> PendingCheckout | None:
    return PendingCheckout.from_json(raw)


def _dump_pending(value: PendingCheckout | None) -> Any:
    return value.to_json() if value is not None else None


def _waiting_folders(raw: Any) -> dict[str, str]:
    if not isinstance(raw, dict):
        return {}
    return {k: v for k, v in raw.items() if isinstance(k, str) and k and isinstance(v, str)}


def _patterns(raw: Any) -> list[str]:
    if not isinstance(raw, list):
        return []
    return [p for p in raw if isinstance(p, str) and p]


def _tree_memo(raw: Any) -> tuple[str, str] | None:
    if isinstance(raw, list) and len(raw) == 2 and all(isinstance(x, str) for x in raw):
        return raw[0], raw[1]
    return None


class LocalState:
    """The typed settings of one repository's local database."""

    #: The local format; a different one aborts (docs/FORMAT.md §14).
    format: Setting[int] = Setting("format")
    #: This client's random id (``clients/<id>`` on backends, commits' ``client``).
    client_id: Setting[str] = Setting("client_id")
    #: The device name commits and conflict copies carry.
    device: Setting[str] = Setting("device")
    namespace: Setting[str] = Setting("namespace")
    #: Id of the configuration of ``prev`` (whose acceptors decide the next version
    #: and whose mapping places new objects), and that configuration itself.
    config_id: Setting[str] = Setting("config")
    config: Setting[Config] = Setting(
        "config_doc", load=lambda raw: Config.from_bytes(raw.encode()),
        dump=lambda config: config.to_bytes().decode())
    #: The configuration version 0 started with: what a new backend's descriptor
    #: names, so a clone from it can start at the beginning.
    init_config_id: Setting[str] = Setting("init_config")
    #: This client's own URIs of backends, by id (passwords stay here, and a mount
    #: point may differ between machines).
    uri_overrides: Setting[dict[str, str]] = Setting("uri_overrides", default=dict)
    #: The last decided version this client synchronised with (paper 3.1).
    prev: Setting[Version] = _Base("prev", load=Version.from_json, dump=Version.to_json)
    #: This client's latest local commit (None before the first).
    head: Setting[str | None] = Setting("head", default=lambda: None)
    #: True from the moment a clone creates ``.metasync`` until its first pull
    #: finished: the folder may hold only part of the tree (``status`` says so;
    #: ``pull``, or the same ``clone`` again, finishes it).
    unfinished_clone: Setting[bool] = Setting("unfinished_clone", default=lambda: False,
                                              load=lambda raw: raw is True)
    checkout_pending: Setting[PendingCheckout | None] = Setting(
        "checkout_pending", default=lambda: None, load=_pending_checkout, dump=_dump_pending)
    #: Folders that could not be read when a checkout had changes for them, by path,
    #: with the tree id each still holds ("" if none): the changes are applied
    #: once it can be read (``Checkout.resume``).
    waiting_folders: Setting[dict[str, str]] = Setting(
        "waiting_folders", default=dict, load=_waiting_folders)
    #: The gc epoch whose collections this client has taken into account.
    gc_epoch: Setting[int] = Setting("gc_epoch", default=lambda: 0, load=int)
    #: A configuration change whose rebalance did not finish (``backend list`` says
    #: so; ``metasync rebalance`` finishes it), with the configurations to read from.
    rebalance_pending: Setting[PendingRebalance | None] = Setting(
        "rebalance_pending", default=lambda: None, load=_pending_rebalance,
        dump=lambda value: value.to_json() if value is not None else None)
    #: Objects this client announced to gc (``pending`` in its client state) since
    #: its last decided push.
    announced: Setting[list[str]] = Setting("announced", default=list)
    #: Backend id -> why it refused a copy for want of space (``BackendFull``); kept
    #: while this client has copies for it that it could not write
    #: (:meth:`metasync.context.RepoContext.note_full_backends`).
    full_backends: Setting[dict[str, str]] = Setting("full_backends", default=dict)
    #: Seconds consensus waits without progress (overridden by ``--timeout``).
    timeout: Setting[Any] = Setting("timeout", default=lambda: None)
    #: The last (scan fingerprint, root tree id) computed: lets ``status`` of an
    #: unchanged folder skip rebuilding every tree.
    tree_memo: Setting[tuple[str, str] | None] = Setting(
        "tree_memo_v1", default=lambda: None, load=_tree_memo, dump=lambda v: list(v) if v else None)

    #: This machine's sparse selection (:mod:`metasync.selection`): gitignore-style
    #: patterns of what is checked out here; empty: everything. Never shared.
    sparse_patterns: Setting[list[str]] = Setting("sparse_patterns", default=list, load=_patterns)

    #: What the folder's file system can hold, as last probed (``Scanner.traits``).
    folder_traits: Setting[FolderTraits | None] = Setting(
        "folder_traits", default=lambda: None, load=FolderTraits.from_json,
        dump=lambda t: t.to_json() if t is not None else None)

    #: Backend id -> the compaction floor keys (``floor/<below>``) whose record this
    #: client verified there: a floor key is written once, so its name is enough
    #: from then on (``consensus.FloorRecords``; only the newest few are kept).
    verified_floors: Setting[dict[str, list[str]]] = Setting("verified_floors", default=dict)
    #: Backend id -> this client's last successful check of its primitives.
    primitives_checked: Setting[dict[str, PrimitivesChecked]] = Setting(
        "primitives_checked", default=dict, load=_primitives_checked,
        dump=lambda records: {k: v.to_json() for k, v in records.items()})

    def __init__(self, db: LocalDB) -> None:
        self.db = db

    @contextmanager
    def transaction(self) -> Iterator[None]:
        with self.db.transaction():
            yield

    def forget_collected(self, epoch: int) -> None:
        """A gc collected packs since this client last looked (``epoch`` is its
        epoch): forget where every object was, except in this client's own
        unpublished packs, so nothing is deduplicated against a collected object;
        the new master's indexes (written by the gc, listing exactly what survived)
        are read next."""
        db = self.db
        local = {sid for sid, kind in db.outbox() if kind == "pack"}
        for index_id in db.local_indexes():
            data = db.cached_object(index_id)
            if data is not None:
                local |= {pack_id for pack_id, _ in Index.from_bytes(data).packs}
        with db.transaction():
            db.purge_locations(local)
            db.forget_indexes(set())
            self.gc_epoch = epoch
