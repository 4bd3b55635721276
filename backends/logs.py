"""Append-only logs (paper Table 2b): the log component of every backend.

pPaxos uses each backend as a passive append-only log. A backend's logs are a
:class:`LogStore` (``append``, ``append_at``, ``fetch``, ``delete_log``), reached as
``backend.logs`` and made once per backend instance by :func:`log_store_for`:

- the backend's own construction where it has one (``Backend.specific_logs``): the
  ``dir:`` folder's hard links, WebDAV locks, Google Drive's reserved ids;
- else :class:`ObjectStoreLogs` where ``put_if_absent`` is atomic
  (``capabilities.conditional_create``);
- else :class:`RegisterLogs`, which needs only an atomic whole-object replace.

The two generic constructions hold a backend and use only its object operations
(:class:`ObjectStore`):

:class:`ObjectStoreLogs`, for services with an atomic exclusive create
(``capabilities.conditional_create``: S3's ``If-None-Match: *``, SFTP's
link-based rename on OpenSSH). Entry *p* of log ``L`` is the object
``L/<p:010d>``. ``append`` lists ``L/`` and creates one past the highest entry
exclusively, moving on while the position is taken; ``append_at(p)`` checks that
entry *p − 1* exists and creates entry *p* exclusively. An entry is only ever
created when the one before it exists and entries are never changed or removed,
so positions are contiguous and every reader sees one order.

:class:`RegisterLogs`, for services whose only atomic operation is replacing a
whole object (a WebDAV server, an arbitrary rclone remote). Each position is
decided by Disk Paxos (Gafni and Lamport) on this one service: every attempt to
write position *p* owns a private register, written as a new object
``L/<p:010d>.b.<32 hex>.<version>`` each time (so no object is ever replaced: some
WebDAV servers replace a file by deleting it first, and a listing in that moment
would miss it), and the decided entry is published as ``L/<p:010d>``. Safety needs
only that a read or listing that starts after a write finished sees that write; it
does not depend on timing. See docs/FORMAT.md §11.

This module sits below :mod:`.base` (which reaches it through ``Backend.logs``), so
it names backends only through the :class:`ObjectStore` protocol.
"""

from __future__ import annotations

import builtins
import hashlib
import re
import secrets
import struct
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import BinaryIO, Protocol, TypeVar

from metasync.backends.capabilities import Capabilities
from metasync.backends.keys import check_key
from metasync.backends.retry import TransientError
from metasync.errors import BackendError, FormatError, ObjectNotFound

K = TypeVar("K")
R = TypeVar("R")

# Exactly the canonical spelling counts: an entry must have one name, or two names
# could claim one position.
_ENTRY = re.compile(r"^[0-9]{10,}\Z")
_BLOCK = re.compile(r"^([0-9]{10,})\.b\.([0-9a-f]{32})\.([1-9][0-9]{0,8})\Z")


class LogStore(ABC):
    """The append-only logs of one backend namespace (paper Table 2b).

    A log is named by a key (:func:`check_key`; an invalid name raises
    :class:`InvalidKey` before the service is touched) and holds entries at
    positions 0, 1, 2, ... Failures follow the backend error contract
    (:mod:`metasync.backends.base`): :class:`BackendUnavailable` for an unreachable
    service, :class:`BackendError` otherwise. A store is safe to use from several
    threads, like its backend.
    """

    #: What its appends rest on, for messages (named when a backend fails the check of
    #: :mod:`metasync.backends.probe`).
    primitive: str = "an atomic log append"

    @abstractmethod
    def append(self, log: str, message: bytes) -> int:
        """Append ``message`` to the append-only list ``log`` atomically, even with
        concurrent appenders in other processes; return its position (0-based).
        No entry is lost or duplicated and every reader sees one order."""

    @abstractmethod
    def append_at(self, log: str, position: int, message: bytes) -> bool:
        """Add ``message`` as entry ``position`` of ``log`` only if the log has exactly
        ``position`` entries, atomically against concurrent writers; return False
        (writing nothing) otherwise. Only where the backend declares
        ``capabilities.conditional_append``. :class:`ValueError` for a negative
        ``position``."""

    @abstractmethod
    def fetch(self, log: str, start: int = 0) -> builtins.list[tuple[int, bytes]]:
        """Return ``(position, message)`` for every entry at ``position >= start`` in
        order. A missing log is empty, not an error. :class:`ValueError` for a
        negative ``start``."""

    @abstractmethod
    def delete_log(self, log: str) -> int:
        """Remove every entry of ``log`` and return how many objects went; a missing
        log removes nothing. Entries go highest position first, so a reader at any
        moment sees a prefix of the log (an earlier state of that acceptor). Only for
        pPaxos log compaction, once a floor record covers the log (docs/FORMAT.md
        §9.1), and only where the backend declares ``capabilities.log_deletion``."""


class ObjectStore(Protocol):
    """What this module uses of a backend: its object operations (paper Table 2a,
    with the contracts of :class:`metasync.backends.base.Backend`), its declared
    capabilities and its own log construction, if any. Every ``Backend`` is one."""

    @property
    def capabilities(self) -> Capabilities: ...

    def put(self, key: str, data: bytes | BinaryIO) -> None: ...

    def put_if_absent(self, key: str, data: bytes) -> bool: ...

    def get(self, key: str) -> bytes: ...

    def size(self, key: str) -> int: ...

    def delete(self, key: str) -> None: ...

    def list(self, prefix: str = "") -> Iterator[str]: ...

    def specific_logs(self) -> LogStore | None: ...


def log_store_for(backend: ObjectStore) -> LogStore:
    """A new log store for ``backend`` (``Backend.logs`` keeps one per instance): the
    backend's own construction if it has one, else :class:`ObjectStoreLogs` where
    ``put_if_absent`` is atomic (``capabilities.conditional_create``), else
    :class:`RegisterLogs`, which needs only whole-object replaces. Does no I/O."""
    own = backend.specific_logs()
    if own is not None:
        return own
    if backend.capabilities.conditional_create:
        return ObjectStoreLogs(backend)
    return RegisterLogs(backend)


def entry_name(position: int) -> str:
    """The name of log entry ``position`` inside its log folder."""
    return f"{position:010d}"


def entry_position(name: str) -> int | None:
    """The position a log entry name stands for, or None for any other name."""
    if not _ENTRY.match(name):
        return None
    position = int(name)
    return position if entry_name(position) == name else None


def log_children(backend: ObjectStore, log: str) -> builtins.list[str]:
    """Names directly inside the log folder ``log``."""
    prefix = log + "/"
    return [key[len(prefix) :] for key in backend.list(log) if "/" not in key[len(prefix) :]]


def delete_log_objects(backend: ObjectStore, log: str) -> int:
    """``delete_log`` for every layout whose entries are objects under ``log/`` (entry
    ``p`` named ``p`` in ten or more digits, helper objects named after their
    position): list the log, then delete highest position first. Returns how many
    objects went (one deleted meanwhile by another client does not count)."""
    check_key(log)
    keys = builtins.list(backend.list(log))

    def position_first(key: str) -> tuple[int, str]:
        name = key[len(log) + 1:]
        digits = name[: len(name) - len(name.lstrip("0123456789"))]
        return (int(digits) if digits else -1, name)

    removed = 0
    for key in sorted(keys, key=position_first, reverse=True):
        try:
            backend.delete(key)
            removed += 1
        except ObjectNotFound:
            pass
    return removed


#: Decided entries remembered per log store (one per backend instance; entries never
#: change), so that fetching a growing log re-reads only the new entries.
ENTRY_CACHE_LIMIT = 4096


class EntryCache:
    """Entry bytes by ``(log, position)``; cleared whole when it grows past the limit."""

    def __init__(self) -> None:
        self.entries: dict[tuple[str, int], bytes] = {}

    def read(
        self, log: str, positions: builtins.list[int], get: Callable[[int], bytes]
    ) -> builtins.list[tuple[int, bytes]]:
        """``(p, entry p)`` for each position, reading the ones not cached via ``get``."""
        missing = [p for p in positions if (log, p) not in self.entries]
        fresh = dict(zip(missing, _read_all(get, missing), strict=True))
        if len(self.entries) + len(fresh) > ENTRY_CACHE_LIMIT:
            self.entries.clear()
        result = []
        for p in positions:
            value = self.entries.get((log, p))
            if value is None:
                value = fresh[p]
                self.entries[(log, p)] = value
            result.append((p, value))
        return result

    def forget(self, log: str) -> None:
        """Drop the cached entries of ``log`` (it was deleted by log compaction)."""
        for key in [k for k in self.entries if k[0] == log]:
            del self.entries[key]


class CachedEntries(LogStore):
    """Logs kept as objects under ``log/`` on ``backend``, whose decided entries
    :attr:`entries` remembers: ``delete_log`` removes the log's objects
    (:func:`delete_log_objects`) and forgets its cached entries, so a position
    written again is read afresh."""

    def __init__(self, backend: ObjectStore) -> None:
        #: The backend whose objects hold the logs.
        self.backend = backend
        #: Decided entries already read (or written) through this store.
        self.entries = EntryCache()

    def delete_log(self, log: str) -> int:
        removed = delete_log_objects(self.backend, log)
        self.entries.forget(log)
        return removed


class ObjectStoreLogs(CachedEntries):
    """``append``, ``append_at`` and ``fetch`` from the backend's ``put_if_absent``
    (which must be atomic: ``capabilities.conditional_create``), ``size`` and
    ``list``."""

    primitive = "an exclusive create"

    def has_entry(self, key: str) -> bool:
        """Whether the entry object ``key`` exists now (``append_at`` asks this of
        entry *p − 1*). Asks ``size``; a backend whose ``size`` may answer from a
        cache provides a store that asks the service itself."""
        try:
            self.backend.size(key)
        except ObjectNotFound:
            return False
        return True

    def _log_end(self, log: str) -> int:
        positions = [p for p in map(entry_position, log_children(self.backend, log))
                     if p is not None]
        return max(positions, default=-1) + 1

    def append(self, log: str, message: bytes) -> int:
        check_key(log)
        position = self._log_end(log)
        while not self.backend.put_if_absent(f"{log}/{entry_name(position)}", message):
            position += 1
        return position

    def append_at(self, log: str, position: int, message: bytes) -> bool:
        if position < 0:
            raise ValueError(f"append_at needs position >= 0, got {position}")
        check_key(log)
        if position > 0 and not self.has_entry(f"{log}/{entry_name(position - 1)}"):
            return False
        return self.backend.put_if_absent(f"{log}/{entry_name(position)}", message)

    def fetch(self, log: str, start: int = 0) -> builtins.list[tuple[int, bytes]]:
        if start < 0:
            raise ValueError(f"fetch needs start >= 0, got {start}")
        check_key(log)
        positions = sorted(
            p for p in map(entry_position, log_children(self.backend, log))
            if p is not None and p >= start
        )
        # Entries are never removed, so one that vanishes after listing is an error
        # (ObjectNotFound from get propagates).
        return self.entries.read(
            log, positions, lambda p: self.backend.get(f"{log}/{entry_name(p)}")
        )


# --- Disk Paxos on one service ---------------------------------------------------------

#: A ballot: (number, attempt id). Number 0 is each attempt's own fast ballot.
Ballot = tuple[int, str]

_BLOCK_MAGIC = b"MSB1"
_ENTRY_MAGIC = b"MSE1"
_DIGEST = 16
#: An attempt id / append id is 16 random bytes (32 hex digits in names).
_ID_BYTES = 16
#: Reads of a listed entry that came back "not found" before giving up.
ENTRY_READ_TRIES = 6
#: Rounds one append tries under contention before reporting a transient failure.
MAX_ROUNDS = 200


def _digest(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()[:_DIGEST]


@dataclass(frozen=True)
class Block:
    """One attempt's Disk Paxos register: the highest ballot it joined (``mbal``) and
    the last value it accepted (``bal``, ``value``; ``bal`` None if none)."""

    mbal: Ballot
    bal: Ballot | None
    value: bytes

    def encode(self) -> bytes:
        bal = self.bal or (0, "0" * 32)
        body = (
            _BLOCK_MAGIC
            + struct.pack(">QQB", self.mbal[0], bal[0], self.bal is not None)
            + bytes.fromhex(self.mbal[1])
            + bytes.fromhex(bal[1])
            + self.value
        )
        return body + _digest(body)

    @classmethod
    def decode(cls, data: bytes, what: str) -> Block:
        head = len(_BLOCK_MAGIC) + 17 + 2 * _ID_BYTES
        if len(data) < head + _DIGEST or not data.startswith(_BLOCK_MAGIC):
            raise _torn(what)
        body, digest = data[:-_DIGEST], data[-_DIGEST:]
        if _digest(body) != digest:
            raise _torn(what)
        mbal_n, bal_n, has_bal = struct.unpack(">QQB", body[4:21])
        mbal_id = body[21 : 21 + _ID_BYTES].hex()
        bal_id = body[21 + _ID_BYTES : head].hex()
        return cls((mbal_n, mbal_id), (bal_n, bal_id) if has_bal else None, body[head:])


def _torn(what: str) -> TransientError:
    # A partial or damaged read: the writer may still be replacing it, so a retry
    # can succeed. (A service that tears writes permanently fails every retry.)
    return TransientError(f"{what} is incomplete or damaged; the write may be in progress")


def encode_entry(value: bytes) -> bytes:
    """A decided entry as stored: magic, append id + message, digest."""
    body = _ENTRY_MAGIC + value
    return body + _digest(body)


def decode_entry(data: bytes, what: str) -> bytes:
    """The append id + message of a stored decided entry."""
    if len(data) < len(_ENTRY_MAGIC) + _ID_BYTES + _DIGEST or not data.startswith(_ENTRY_MAGIC):
        raise FormatError(f"{what} is not a metasync log entry")
    body, digest = data[:-_DIGEST], data[-_DIGEST:]
    if _digest(body) != digest:
        raise _torn(what)
    return body[len(_ENTRY_MAGIC) :]


@dataclass
class _Position:
    """What one listing shows of one log position."""

    decided: bool = False
    #: attempt id -> its latest block version
    blocks: dict[str, int] | None = None


class RegisterLogs(CachedEntries):
    """``append``, ``append_at`` and ``fetch`` from the backend's ``put`` (an atomic
    whole-object replace), ``get``, ``list`` and ``delete`` only.

    Each value is stored with a random 16-byte append id, so an appender can tell
    its own value from an equal message of another appender. Uncontended, an
    append costs three listings (find the end; after phase 1; after phase 2), two
    block writes, the entry's create-if-absent and the removal of the two blocks.
    """

    primitive = "whole-object writes that later reads and listings see"

    def _scan(self, log: str) -> dict[int, _Position]:
        positions: dict[int, _Position] = {}
        for name in log_children(self.backend, log):
            position = entry_position(name)
            if position is not None:
                positions.setdefault(position, _Position()).decided = True
                continue
            match = _BLOCK.match(name)
            if match and entry_name(int(match.group(1))) == match.group(1):
                slot = positions.setdefault(int(match.group(1)), _Position())
                if slot.blocks is None:
                    slot.blocks = {}
                attempt, version = match.group(2), int(match.group(3))
                slot.blocks[attempt] = max(version, slot.blocks.get(attempt, 0))
        return positions

    def _decided_value(self, log: str, position: int) -> bytes:
        key = f"{log}/{entry_name(position)}"
        for attempt in range(ENTRY_READ_TRIES):
            try:
                return decode_entry(self.backend.get(key), f"log entry {key}")
            except ObjectNotFound:
                # Entries are never removed. Two attempts that decided the same
                # position may both write its entry (create-if-absent is best effort
                # on these services), and a service that replaces by delete-then-
                # rename hides it for a moment: read again.
                if attempt + 1 == ENTRY_READ_TRIES:
                    raise
                time.sleep(0.005 * 2**attempt)
        raise AssertionError("unreachable")

    def _read_blocks(self, log: str, position: int, mine: str) -> tuple[bool, dict[str, Block]]:
        """(decided?, the other attempts' blocks at ``position``) from a fresh listing.

        Blocks are removed only after their position's entry exists, so a block that
        vanishes between the listing and the read means the position is decided."""
        for _ in range(3):
            slot = self._scan(log).get(position, _Position())
            if slot.decided:
                return True, {}
            others = [(a, v) for a, v in (slot.blocks or {}).items() if a != mine]
            try:
                raw = _read_all(
                    self.backend.get, [_block_key(log, position, a, v) for a, v in others]
                )
            except ObjectNotFound:
                continue
            return False, {
                a: Block.decode(data, f"log block {_block_key(log, position, a, v)}")
                for (a, v), data in zip(others, raw, strict=True)
            }
        raise TransientError(f"log {log} position {position}: blocks vanished without an entry")

    def _decide(self, log: str, position: int, value: bytes) -> bytes:
        """Run Disk Paxos for ``position`` proposing ``value``; return the decided
        value (ours, or one another attempt got decided first).

        Once the position's entry exists the attempt removes its own blocks (best
        effort): they are never read again, and the log folder stays small."""
        mine = secrets.token_hex(_ID_BYTES)
        written: builtins.list[int] = []
        decided = self._attempt(log, position, value, mine, written)
        try:
            _read_all(lambda v: self.backend.delete(_block_key(log, position, mine, v)), written)
        except BackendError:
            pass  # garbage only: a leftover block never changes a decided position
        return decided

    def _attempt(
        self, log: str, position: int, value: bytes, mine: str, written: builtins.list[int]
    ) -> bytes:
        writes = 0
        entry_key = f"{log}/{entry_name(position)}"
        # There is deliberately no fast path that accepts before a phase 1: with a
        # single register set, a late fast accept could outrank one already decided.
        accepted: tuple[Ballot, bytes] | None = None
        highest = 0
        for round_number in range(MAX_ROUNDS):
            ballot: Ballot = (highest + 1, mine)
            # Phase 1: join ``ballot``, keeping what this attempt accepted before.
            writes += 1
            self.backend.put(_block_key(log, position, mine, writes), _block(ballot, accepted).encode())
            written.append(writes)
            decided, others = self._read_blocks(log, position, mine)
            if decided:
                return self._decided_value(log, position)
            highest = max([ballot[0], *(b.mbal[0] for b in others.values())])
            if any(b.mbal > ballot for b in others.values()):
                _contention_pause(round_number)
                continue
            candidates = [(b.bal, b.value) for b in others.values() if b.bal is not None]
            if accepted is not None:
                candidates.append(accepted)
            chosen = max(candidates)[1] if candidates else value
            # Phase 2: accept ``chosen`` at ``ballot``.
            accepted = (ballot, chosen)
            writes += 1
            self.backend.put(_block_key(log, position, mine, writes), _block(ballot, accepted).encode())
            written.append(writes)
            decided, others = self._read_blocks(log, position, mine)
            if decided:
                return self._decided_value(log, position)
            if any(b.mbal > ballot for b in others.values()):
                highest = max(b.mbal[0] for b in others.values())
                _contention_pause(round_number)
                continue
            # Decided. Every attempt that gets here should write the same bytes;
            # creating only if absent avoids replacing the entry, which some servers
            # do by deleting it first. The entry is what every reader takes as the
            # position's value, so an attempt whose create found another value there
            # returns that value, not its own. Two attempts can pass phase 2 with
            # different values where a listing misses both the entry a decided
            # attempt creates and the blocks it then removes (see _decide), which
            # Disk Paxos, whose registers are never erased, does not allow for: a
            # listing of names read at two moments did (``dir:`` before the fix in
            # LocalBackend._walk; 6 processes racing, ~1 run in 10 under load, each
            # of the two returned its own position and one message was lost), and
            # a service whose listings are not one moment still can.
            if self.backend.put_if_absent(entry_key, encode_entry(chosen)):
                return chosen
            return self._decided_value(log, position)
        raise TransientError(
            f"log {log} position {position} stayed contended for {MAX_ROUNDS} rounds"
        )

    def append(self, log: str, message: bytes) -> int:
        check_key(log)
        value = secrets.token_bytes(_ID_BYTES) + message
        scan = self._scan(log)
        position = 0
        while scan.get(position, _Position()).decided:
            position += 1
        while True:
            if self._decide(log, position, value) == value:
                return position
            position += 1

    def append_at(self, log: str, position: int, message: bytes) -> bool:
        if position < 0:
            raise ValueError(f"append_at needs position >= 0, got {position}")
        check_key(log)
        scan = self._scan(log)
        slot = scan.get(position, _Position())
        if slot.decided or (position > 0 and not scan.get(position - 1, _Position()).decided):
            return False
        value = secrets.token_bytes(_ID_BYTES) + message
        return self._decide(log, position, value) == value

    def fetch(self, log: str, start: int = 0) -> builtins.list[tuple[int, bytes]]:
        if start < 0:
            raise ValueError(f"fetch needs start >= 0, got {start}")
        check_key(log)
        scan = self._scan(log)
        # Entries are decided in order, so the decided positions are 0..k-1.
        end = start
        while scan.get(end, _Position()).decided:
            end += 1
        entries = self.entries.read(
            log, list(range(start, end)), lambda p: self._decided_value(log, p)
        )
        return [(p, value[_ID_BYTES:]) for p, value in entries]


#: Entries of one log read at once by ``fetch`` (each read is one request).
FETCH_PARALLELISM = 8


def _read_all(get: Callable[[K], R], keys: builtins.list[K]) -> builtins.list[R]:
    """``[get(k) for k in keys]``, with up to ``FETCH_PARALLELISM`` requests at once:
    a long log costs a few round trips, not one per entry."""
    if len(keys) <= 1:
        return [get(k) for k in keys]
    from concurrent.futures import ThreadPoolExecutor  # not loaded by status (start-up time)

    with ThreadPoolExecutor(min(FETCH_PARALLELISM, len(keys)), "metasync-fetch") as pool:
        return list(pool.map(get, keys))


def _block_key(log: str, position: int, attempt: str, version: int) -> str:
    return f"{log}/{entry_name(position)}.b.{attempt}.{version}"


def _block(ballot: Ballot, accepted: tuple[Ballot, bytes] | None) -> Block:
    if accepted is None:
        return Block(ballot, None, b"")
    return Block(ballot, accepted[0], accepted[1])


def _contention_pause(round_number: int) -> None:
    # Randomized backoff so that competing attempts stop overtaking each other
    # (Disk Paxos is safe without it, but only makes progress once one runs alone).
    import random

    time.sleep(random.uniform(0, min(0.5, 0.005 * 2**round_number)))
