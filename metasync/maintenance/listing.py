"""What the backends hold (``metasync backend list``) and sharing them (``share``)."""

from __future__ import annotations

from dataclasses import dataclass

from metasync.backends import Backend
from metasync.context import RepoContext
from metasync.erasure import header_length
from metasync.errors import MetasyncError, UsageError
from metasync.objects import Config
from metasync.replicator import Replicator, take_inventory
from metasync.store import mapping_of


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


def list_backends(ctx: RepoContext, replicator: Replicator, config: Config) -> BackendListing:
    """Every backend of ``config`` with what it holds (from one listing of each)."""
    backends = ctx.pool.open(config)
    inventory = take_inventory(backends, ctx.store.executor)
    mapping = mapping_of(config)
    full = ctx.note_full_backends()
    infos = []
    for spec in config.backends:
        objects, size = inventory.held_by(spec.id)
        health = "ok"
        if spec.id in inventory.unreachable:
            health = f"unreachable: {inventory.unreachable[spec.id]}"
        elif spec.id in full:
            health = f"full: {full[spec.id]}"
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
                          logical, stored, bool(ctx.state.rebalance_pending))


@dataclass(frozen=True)
class ShareResult:
    """What ``share`` did on one backend."""

    backend: str
    #: True if the service itself shared the folder (or invited the user).
    shared: bool
    #: One line: what was done, or why it must be shared by hand.
    detail: str


def share(ctx: RepoContext, backends: dict[str, Backend], email: str) -> list[ShareResult]:
    """Share the repository folder with ``email`` (paper 3.8) on every backend
    whose service can (``capabilities.sharing``); the others are reported as
    needing manual sharing. A failure on one backend does not stop the others."""
    if "@" not in email or email.startswith("@") or email.endswith("@") or " " in email:
        raise UsageError(f"{email!r} is not an e-mail address")

    def one(backend: Backend) -> ShareResult:
        if not backend.capabilities.sharing:
            return ShareResult(
                backend.name, False,
                f"{backend.scheme or 'this'}: backends have no sharing API; give {email} "
                f"access to {backend.name} (namespace {backend.namespace!r}) by hand",
            )
        try:
            return ShareResult(backend.name, True, backend.share(email))
        except MetasyncError as exc:
            return ShareResult(backend.name, False, f"sharing failed: {exc}")

    return list(ctx.store.executor.map(one, backends.values()))
