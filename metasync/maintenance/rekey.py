"""Re-encrypting what the backends hold under the current data key (key rotation).

``metasync key rotate`` starts a new data key epoch; from then on every writer
encrypts under it. This pass rewrites everything still stored under an older
epoch, so that the older keys can be retired. It is driven by what the backends
hold (their listings), like rebalance, and is idempotent: each key is rewritten
in one atomic ``put`` of the same plaintext under the new key, so a crash at any
point leaves every stored item readable under one of the ring's keys, and the
next run finishes the job (docs/design.md, "Key rotation").

What is rewritten, and how (docs/FORMAT.md §5.1):

- standalone objects, configurations, hints, client states, spill records and
  floor records: the same compressed plaintext under the current key, at the same
  key (ids do not change: they are keyed by the id key, which never rotates);
- packs: every entry and the header, giving a *re-keyed pack* (``MSP2``) whose
  offsets are unchanged, so every index stays valid;
- erasure-coded objects: decoded from K good fragments, re-keyed, and every
  fragment written again -- only for K/N with N >= 2K - 1, so that at every moment
  K fragments of one encoding exist (a crash between two fragment writes leaves
  the object readable); others are reported, not touched;
- pPaxos log entries are never rewritten (logs are append-only). Instances
  decided before the rotation keep entries under the old key; a client only reads
  them while it still holds that key (it is behind the rotation), and a client
  that learns the rotation refreshes its keyring before reading any later instance.
"""

from __future__ import annotations

from concurrent.futures import Executor
from dataclasses import dataclass, field

from metasync import faults
from metasync.backends import Backend
from metasync.codec import PACK_MAGIC, REKEYED_PACK_MAGIC, Codec
from metasync.erasure import ErasureScheme, decode_fragments, encode_fragments
from metasync.errors import BackendError, CorruptObject, MetasyncError, ObjectUnavailable
from metasync.layout import (
    fragment_key,
    object_key,
    parse_fragment_key,
    parse_object_key,
    record_context,
)

#: Kinds a standalone object under ``objects/`` may have (packs are told by their trailer).
_STANDALONE_KINDS = ("commit", "index")


@dataclass
class RekeyReport:
    """What one pass did, and what still holds an older key."""

    #: Stored items looked at (every key of every backend, logs excepted).
    scanned: int = 0
    #: Items written again under the current key.
    rewritten: int = 0
    #: ``backend-id:key`` of items still under an older key: a write failed, the
    #: item could not be decoded, or its erasure code cannot be rewritten safely.
    left: list[str] = field(default_factory=list)
    unreachable: dict[str, str] = field(default_factory=dict)

    @property
    def complete(self) -> bool:
        """True once nothing reachable holds an older key and every backend answered."""
        return not self.left and not self.unreachable


class Rekeyer:
    """One pass of re-encryption over ``backends`` with ``codec`` (whose current
    data key is the new epoch, and whose ring still holds the older ones)."""

    def __init__(self, codec: Codec, backends: dict[str, Backend],
                 scheme: ErasureScheme | None, executor: Executor) -> None:
        if not codec.encrypted:
            raise ValueError("only an encrypted repository has keys to rotate")
        self.codec = codec
        self.backends = backends
        self.scheme = scheme
        self.executor = executor

    def run(self) -> RekeyReport:
        """Rewrite everything found under an older key; see :class:`RekeyReport`."""
        report = RekeyReport()
        listings = dict(zip(self.backends, self.executor.map(self._list, self.backends.values()),
                            strict=True))
        #: coded object id -> {fragment index: [backend ids holding it]}
        coded: dict[str, dict[int, list[str]]] = {}
        work: list[tuple[str, str]] = []
        for backend_id, keys in listings.items():
            if isinstance(keys, str):
                report.unreachable[backend_id] = keys
                continue
            for key in keys:
                fragment = parse_fragment_key(key)
                if fragment is not None:
                    coded.setdefault(fragment[0], {}).setdefault(fragment[1], []).append(backend_id)
                elif parse_object_key(key) is not None or record_context(key) is not None:
                    work.append((backend_id, key))
        for outcome in self.executor.map(lambda item: self._rekey_one(*item), work):
            report.scanned += 1
            if outcome is True:
                report.rewritten += 1
            elif outcome is not False:
                report.left.append(outcome)
        for object_id, holders in sorted(coded.items()):
            report.scanned += 1
            outcome = self._rekey_coded(object_id, holders)
            if outcome is True:
                report.rewritten += 1
            elif outcome is not False:
                report.left.append(outcome)
        return report

    def _list(self, backend: Backend) -> list[str] | str:
        try:
            return list(backend.list())
        except MetasyncError as exc:
            return str(exc)

    def _fresh(self, key: str, stored: bytes) -> bytes | None:
        """``stored`` (the item at ``key``) under the current key, or None if it is
        under it already. Raises :class:`CorruptObject` if no key of the ring opens it."""
        object_id = parse_object_key(key)
        if object_id is not None:
            if stored[-4:] in (PACK_MAGIC, REKEYED_PACK_MAGIC):
                try:
                    return self.codec.rekey_pack(object_id, stored)
                except CorruptObject:
                    pass  # a standalone object whose last bytes look like a trailer
            for kind in _STANDALONE_KINDS:
                try:
                    stale = self.codec.stale(stored, kind, object_id)
                except CorruptObject:
                    continue
                return self.codec.reencrypt(stored, kind, object_id) if stale else None
            raise CorruptObject(f"object {object_id[:12]}: no key of the ring opens it")
        context = record_context(key)
        assert context is not None
        return self.codec.reencrypt(stored, *context) if self.codec.stale(stored, *context) else None

    def _rekey_one(self, backend_id: str, key: str) -> bool | str:
        """True if rewritten, False if already current, else ``backend:key (why)``."""
        backend = self.backends[backend_id]
        try:
            stored = backend.get(key)
            fresh = self._fresh(key, stored)
            if fresh is None:
                return False
            # Narrow the race with the owner of a mutable record (a client state, the
            # hint): rewrite only what is still there.
            if record_context(key) is not None and backend.get(key) != stored:
                return False
            faults.crash_point("rekey:write")
            backend.put(key, fresh)
            return True
        except CorruptObject as exc:
            return f"{backend_id}:{key} ({exc})"
        except (BackendError, MetasyncError) as exc:
            return f"{backend_id}:{key} ({exc})"

    def rebuilt(self, object_id: str, holders: dict[int, list[str]]) -> bytes:
        """The stored bytes of a coded object from its fragments (``holders``: which
        backends hold fragment i); raises like :func:`decode_fragments`."""
        fragments: dict[int, bytes] = {}
        for index, backend_ids in holders.items():
            for backend_id in backend_ids:
                try:
                    fragments[index] = self.backends[backend_id].get(fragment_key(object_id, index))
                    break
                except MetasyncError:
                    continue
        return decode_fragments(self.codec.hasher, object_id, fragments, scheme=self.scheme)

    def _rekey_coded(self, object_id: str, holders: dict[int, list[str]]) -> bool | str:
        scheme = self.scheme
        if scheme is None or scheme.n < 2 * scheme.k - 1:
            # Rewriting fragments in place would pass through a state with fewer than
            # K fragments of either encoding.
            return f"*:{fragment_key(object_id, 0)} (erasure code cannot be re-keyed in place)"
        try:
            fresh = self._fresh(object_key(object_id), self.rebuilt(object_id, holders))
        except (CorruptObject, ObjectUnavailable) as exc:
            return f"*:{fragment_key(object_id, 0)} ({exc})"
        if fresh is None:
            return False
        new = encode_fragments(self.codec.hasher, scheme, object_id, fresh)
        for index, backend_ids in sorted(holders.items()):
            for backend_id in backend_ids:
                faults.crash_point("rekey:write")
                try:
                    self.backends[backend_id].put(fragment_key(object_id, index), new[index])
                except MetasyncError as exc:
                    return f"{backend_id}:{fragment_key(object_id, index)} ({exc})"
        return True
