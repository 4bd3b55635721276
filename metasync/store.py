"""The replicated, untrusted object store: mapping + translators + backends.

Every stored object (pack, index, commit) lives at ``objects/<id[:2]>/<id>`` on
the R backends the stable mapping names for its id. This module places and reads;
the writes themselves -- first uploads, repairs, moves and drops -- are
:class:`metasync.replicator.Replicator`'s, through :meth:`RemoteStore.put_copy`
for one copy. Reads go to the holder expected to answer first -- by
each backend's measured latency and throughput and the bytes already being read
from it, so many reads at once spread over all backends and a clone draws on
their summed bandwidth (Hybris; HyCloud's multi-source downloads) -- and fall
back on any error, missing copy or failed check to the other holders, then to
every other backend of the configuration (a copy a reconfiguration has not moved
yet). One corrupt or vanished backend costs a retry, never data. Nothing read
from a backend is used before it is verified.
"""

from __future__ import annotations

import functools
import itertools
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, Generic, TypeVar

from metasync.backends import Backend
from metasync.codec import Codec
from metasync.errors import (
    BackendError,
    BackendFull,
    CorruptObject,
    Interrupted,
    MetasyncError,
    ObjectUnavailable,
)
from metasync.layout import fragment_key, object_key
from metasync.mapping import StableMapping
from metasync.objects import Config, PackEntry
from metasync.portable import cores
from metasync.progress import CANCEL

if TYPE_CHECKING:
    from metasync.erasure import ErasureScheme, FragmentHeader

#: Entries closer than this in one pack are fetched with one range request.
COALESCE_GAP = 256 * 1024
#: Longest range request: smaller pieces of a big pack spread over its holders.
MAX_RUN = 4 * 1024 * 1024


@dataclass
class TransferStats:
    """Counters for reports and tests (what really crossed the wire)."""

    objects_put: int = 0
    bytes_put: int = 0
    objects_got: int = 0
    bytes_got: int = 0
    corrupt_copies: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add_put(self, size: int) -> None:
        with self.lock:
            self.objects_put += 1
            self.bytes_put += size

    def add_get(self, size: int) -> None:
        with self.lock:
            self.objects_got += 1
            self.bytes_got += size


#: A read of at most this many bytes measures latency; a longer one, throughput.
SMALL_READ = 64 * 1024
#: Weight of the newest measurement in a backend's running estimates.
EWMA_WEIGHT = 0.3


@dataclass
class LinkEstimate:
    """What this client has measured of reads from one backend."""

    #: Seconds until a small read completes (round trip plus service time).
    latency: float = 0.02
    #: Bytes per second of large reads, once under way.
    throughput: float = 50e6
    #: Bytes requested from the backend and not yet received, by all threads.
    outstanding: int = 0
    #: Reads measured so far (an unmeasured backend keeps optimistic defaults, so it
    #: is tried and measured soon).
    samples: int = 0
    bytes_read: int = 0

    def expected_seconds(self, size: int) -> float:
        """When a read of ``size`` bytes started now would finish, queued behind the
        reads already in flight."""
        return self.latency + (self.outstanding + size) / self.throughput

    def record(self, size: int, seconds: float) -> None:
        self.samples += 1
        self.bytes_read += size
        if size <= SMALL_READ:
            self.latency += EWMA_WEIGHT * (seconds - self.latency)
        else:
            rate = size / max(seconds - self.latency, seconds / 2, 1e-6)
            self.throughput += EWMA_WEIGHT * (rate - self.throughput)


T = TypeVar("T")
U = TypeVar("U")


def _call_first(fn: Callable[..., T], args: tuple[Any, ...], item: Any) -> T:
    return fn(item, *args)


class Windowed(Generic[U, T]):
    """``(item, future of fn(item))`` in the order of ``items``, run on ``executor``
    with at most ``width`` submitted and not yet handed out (``executor.map`` makes
    every future up front: ~1.5 kB each, which for a million files is gigabytes; and
    a local read gains nothing from more than a core each). :attr:`outstanding` are
    those submitted and not handed out yet: a caller's clean-up after a failure."""

    def __init__(self, executor: ThreadPoolExecutor, fn: Callable[[U], T],
                 items: Iterable[U], width: int) -> None:
        self._submit = executor.submit
        self._fn = fn
        self._items = iter(items)
        self.outstanding: deque[tuple[U, Future[T]]] = deque()
        for item in itertools.islice(self._items, max(1, width)):
            self.outstanding.append((item, executor.submit(fn, item)))

    def __iter__(self) -> Iterator[tuple[U, Future[T]]]:
        while self.outstanding:
            for item in itertools.islice(self._items, 1):
                self.outstanding.append((item, self._submit(self._fn, item)))
            yield self.outstanding.popleft()


class RemoteStore:
    """Objects on the backends of one configuration."""

    def __init__(
        self,
        config: Config,
        codec: Codec,
        backends: dict[str, Backend],
        *,
        workers: int = 8,
    ) -> None:
        self.codec = codec
        self.reconfigure(config, backends)
        self.links: dict[str, LinkEstimate] = {}
        self._links_lock = threading.Lock()
        self.workers = workers
        self.executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="metasync-io")
        #: Backends that failed as unreachable in this session, with the reason; a
        #: backend that refused a write for want of space is here too (no copy is
        #: written or spilled there again in this session) and in :attr:`full`.
        self.down: dict[str, str] = {}
        #: Backends that refused a write in this session because they are full.
        self.full: dict[str, str] = {}
        self.stats = TransferStats()
        #: A local folder of stored objects not uploaded yet (the outbox), read first.
        self.local: Path | None = None

    def all_local(self) -> bool:
        """Every backend is on this machine (``local``): a read costs no round trip."""
        return all(b.capabilities.local for b in self.backends.values())

    def parallel_reads(self) -> int | None:
        """How many read-and-use jobs to run at once on :attr:`executor`: one per core
        (at least two) where every backend is on this machine (``local``); None -- all
        of them queued, the executor's width running, none waiting for an earlier one
        -- for reads that wait on a network. More threads than cores for local reads
        only contend for the interpreter lock: a 15.8k-file clone from ``dir:``
        backends on 2 cores took 3.1-3.4 s with 2 jobs, 4.0 s with 8."""
        if self.all_local():
            return min(self.workers, max(2, cores()))
        return None

    def windowed(self, fn: Callable[..., T], items: Sequence[U], *args: Any) -> Windowed[U, T]:
        """``fn(item, *args)`` for each of ``items`` on :attr:`executor` (see
        :class:`Windowed`), :meth:`parallel_reads` of them in flight."""
        return Windowed(self.executor, functools.partial(_call_first, fn, args), items,
                        self.parallel_reads() or len(items))

    def reconfigure(self, config: Config, backends: dict[str, Backend]) -> None:
        """Place and read by ``config`` (with these opened backends) from now on."""
        self.config = config
        self.backends = backends
        self.mapping = mapping_of(config)
        self.scheme: ErasureScheme | None = None
        if config.erasure:
            # Imported only by erasure-coded repositories (zfec costs start-up time).
            from metasync.erasure import ErasureScheme

            self.scheme = ErasureScheme(*config.erasure)
        #: Where an erasure-coded object's fragments go: fragment j on the j-th.
        self.fragment_mapping = fragment_mapping_of(config)
        #: Pack layouts learned from fragment headers (None: stored whole).
        self._layouts: dict[str, FragmentHeader | None] = {}

    def coded(self, size: int) -> bool:
        """True if an object of ``size`` stored bytes is erasure-coded."""
        return self.scheme is not None and size >= self.config.erasure_threshold

    def fragment_order(self, stored_id: str, index: int) -> list[str]:
        """Where to look for fragment ``index``: its holder first, then the others."""
        holders = self.fragment_mapping.locate(stored_id)
        first = [holders[index]] if index < len(holders) else []
        return first + [b for b in self.read_order(stored_id, SMALL_READ) if b not in first]

    def get_fragment(self, stored_id: str, index: int, *, whole: bool = True) -> bytes | None:
        """Fragment ``index`` (or only its header), from the first backend that has it."""
        from metasync.erasure import header_length

        assert self.scheme is not None
        key = fragment_key(stored_id, index)
        for backend_id in self.fragment_order(stored_id, index):
            try:
                with self.measured(backend_id, SMALL_READ):
                    backend = self._backend(backend_id)
                    if whole:
                        return backend.get(key)
                    return backend.get_range(key, 0, header_length(self.scheme.n))
            except BackendError:
                continue
        return None

    def decode_coded(self, stored_id: str, check: Callable[[bytes], object]) -> bytes:
        """The stored bytes of an erasure-coded object, from any k good fragments
        (data fragments first: they need no decoding arithmetic)."""
        from metasync.erasure import decode_fragments

        assert self.scheme is not None
        fragments: dict[int, bytes] = {}
        for index in range(self.scheme.n):
            if len(fragments) >= self.scheme.k:
                try:
                    return decode_fragments(self.codec.hasher, stored_id, fragments,
                                            scheme=self.scheme, check=check)
                except (CorruptObject, ObjectUnavailable):
                    pass  # a bad fragment among them: fetch more
            data = self.get_fragment(stored_id, index)
            if data is not None:
                fragments[index] = data
        return decode_fragments(self.codec.hasher, stored_id, fragments, scheme=self.scheme,
                                check=check)

    def layout(self, pack_id: str) -> FragmentHeader | None:
        """The fragment layout of a pack, or None if it is stored whole."""
        if self.scheme is None:
            return None
        if pack_id in self._layouts:
            return self._layouts[pack_id]
        from metasync.erasure import verify_header

        found: FragmentHeader | None = None
        for index in range(self.scheme.n):
            head = self.get_fragment(pack_id, index, whole=False)
            if head is None:
                continue
            try:
                found = verify_header(self.codec.hasher, pack_id, index, head)
                break
            except CorruptObject:
                continue
        self._layouts[pack_id] = found
        return found

    def close(self) -> None:
        # Queued requests are dropped, not run: after an interrupt (or an error) the
        # command is over; running ones finish or stop at their next piece.
        self.executor.shutdown(wait=True, cancel_futures=True)

    # --- placement ----------------------------------------------------------------
    def holders(self, stored_id: str) -> tuple[str, ...]:
        """Backend ids that should hold ``stored_id``, reachable ones first."""
        ids = self.mapping.locate(stored_id)
        return tuple(sorted(ids, key=lambda b: b in self.down))

    def read_order(self, stored_id: str, size: int) -> list[str]:
        """Where to look for ``stored_id``, best first: its holders by when a read of
        ``size`` bytes would finish (unreachable ones last), then every other backend
        of the configuration (which may still hold a copy from before a change)."""
        holders = self.mapping.locate(stored_id)
        with self._links_lock:
            def finish(b: str) -> tuple[bool, float]:
                return b in self.down, self._link(b).expected_seconds(size)

            ranked = sorted(holders, key=finish)
            others = sorted((b for b in self.backends if b not in holders), key=finish)
        return ranked + others

    def _link(self, backend_id: str) -> LinkEstimate:
        link = self.links.get(backend_id)
        if link is None:
            link = self.links[backend_id] = LinkEstimate()
        return link

    @contextmanager
    def measured(self, backend_id: str, size: int) -> Iterator[None]:
        """Count a read of about ``size`` bytes from ``backend_id`` as in flight while
        it runs, and measure it if it succeeds."""
        with self._links_lock:
            self._link(backend_id).outstanding += size
        start = time.monotonic()
        ok = False
        try:
            yield
            ok = True
        finally:
            elapsed = time.monotonic() - start
            with self._links_lock:
                link = self._link(backend_id)
                link.outstanding -= size
                if ok:
                    link.record(size, elapsed)

    def _backend(self, backend_id: str) -> Backend:
        # Every request of the store starts here: once the user asked to stop, none
        # is sent (raises Interrupted).
        CANCEL.check()
        return self.backends[backend_id]

    # --- writes -------------------------------------------------------------------
    def put_copy(
        self, backend_id: str, stored_id: str, data: bytes | BinaryIO, key: str | None = None
    ) -> str | None:
        """Write one copy (a stream is read from its current position, in pieces) at
        ``key`` (default: the object's own key); return None or why it failed."""
        start = 0 if isinstance(data, bytes) else data.tell()
        try:
            self._backend(backend_id).put(
                key or object_key(stored_id),
                data if isinstance(data, bytes) else CANCEL.guard(data))
        except Interrupted:
            raise  # the user's stop, not the backend's failure
        except MetasyncError as exc:
            if isinstance(exc, BackendFull):
                self.full.setdefault(backend_id, str(exc))
            self.down.setdefault(backend_id, str(exc))
            return str(exc)
        self.stats.add_put(len(data) if isinstance(data, bytes) else data.tell() - start)
        return None

    def has_copy(self, backend_id: str, stored_id: str, size: int) -> bool:
        """True if ``backend_id`` already holds an object of ``size`` bytes at the
        object's key (a copy an interrupted upload finished before it was booked).
        As much trust as a put's acknowledgement: stored ids name content, and what
        a backend says it holds is checked by fsck either way."""
        try:
            return self._backend(backend_id).size(object_key(stored_id)) == size
        except Interrupted:
            raise  # the user's stop, not the backend's answer
        except MetasyncError:
            return False

    # --- reads --------------------------------------------------------------------
    def get_standalone(self, kind: str, object_id: str) -> bytes:
        """Plaintext of a standalone object, from the best backend with a good copy
        (or, in an erasure-coded repository, from its fragments)."""
        reasons: list[str] = []
        for backend_id in self.read_order(object_id, SMALL_READ):
            try:
                with self.measured(backend_id, SMALL_READ):
                    stored = self._backend(backend_id).get(object_key(object_id))
                self.stats.add_get(len(stored))
                return self.codec.decode(kind, object_id, stored)
            except CorruptObject as exc:
                self.stats.corrupt_copies += 1
                reasons.append(f"{backend_id}: {exc}")
            except BackendError as exc:
                reasons.append(f"{backend_id}: {exc}")
        if self.scheme is not None:
            try:
                stored = self.decode_coded(object_id, lambda b: self.codec.decode(kind, object_id, b))
                return self.codec.decode(kind, object_id, stored)
            except (CorruptObject, ObjectUnavailable) as exc:
                reasons.append(str(exc))
        raise ObjectUnavailable(f"no good copy of {kind} {object_id[:12]} ({'; '.join(reasons[-3:])})")

    def _read_local(
        self, pack_id: str, wanted: list[PackEntry], result: dict[str, bytes]
    ) -> list[PackEntry]:
        """Decode what the local copy of a pack not uploaded yet holds; return the rest."""
        assert self.local is not None
        still: list[PackEntry] = []
        try:
            with open(self.local / pack_id, "rb") as fh:
                for entry in wanted:
                    fh.seek(entry.offset)
                    try:
                        result[entry.object_id] = self.codec.decode(
                            entry.kind, entry.object_id, fh.read(entry.length))
                    except CorruptObject:
                        still.append(entry)
        except OSError:  # not here (any more): uploaded and removed
            return [e for e in wanted if e.object_id not in result]
        return still

    def read_entries(self, pack_id: str, entries: list[PackEntry]) -> dict[str, bytes]:
        """Plaintexts of ``entries`` of one pack, by object id.

        Nearby entries are fetched with one range read of at most ``MAX_RUN`` bytes,
        each from the backend expected to deliver it first (so the reads of one big
        pack spread over its holders); an entry that fails its check on one backend
        is fetched again from the next.
        """
        wanted = sorted(entries, key=lambda e: e.offset)
        result: dict[str, bytes] = {}
        reasons: list[str] = []
        if self.local is not None:
            wanted = self._read_local(pack_id, wanted, result)
        layout = self.layout(pack_id) if wanted else None
        if layout is not None:
            return self._read_coded(pack_id, layout, wanted, result)
        for run in _coalesce(wanted):
            pending = run
            size = run[-1].offset + run[-1].length - run[0].offset
            for backend_id in self.read_order(pack_id, size):
                pending = self._read_run(backend_id, pack_id, pending, result, reasons)
                if not pending:
                    break
            if pending:
                detail = "; ".join(reasons[-3:])
                raise ObjectUnavailable(
                    f"no good copy of {len(pending)} object(s) in pack {pack_id[:12]} ({detail})"
                )
        return result

    def _read_coded(
        self, pack_id: str, layout: FragmentHeader, wanted: list[PackEntry],
        result: dict[str, bytes],
    ) -> dict[str, bytes]:
        """Entries of an erasure-coded pack: range reads from its data fragments;
        anything missing or bad there is taken from the pack rebuilt from any k."""
        from metasync.erasure import systematic_ranges

        still: list[PackEntry] = []
        for run in _coalesce(wanted):
            start = run[0].offset
            end = run[-1].offset + run[-1].length
            try:
                pieces = []
                for index, offset, length in systematic_ranges(layout, start, end - start):
                    piece = self._range_of_fragment(pack_id, index, offset, length)
                    if piece is None:
                        raise ObjectUnavailable(f"fragment {index} of {pack_id[:12]} is missing")
                    pieces.append(piece)
                data = b"".join(pieces)
            except (ObjectUnavailable, CorruptObject):
                still.extend(run)
                continue
            for entry in run:
                piece = data[entry.offset - start : entry.offset - start + entry.length]
                try:
                    result[entry.object_id] = self.codec.decode(entry.kind, entry.object_id, piece)
                except CorruptObject:
                    self.stats.corrupt_copies += 1
                    still.append(entry)
        if still:
            whole = self.decode_coded(pack_id, lambda b: self.codec.check_pack(pack_id, b))
            for entry in still:
                piece = whole[entry.offset : entry.offset + entry.length]
                result[entry.object_id] = self.codec.decode(entry.kind, entry.object_id, piece)
        return result

    def _range_of_fragment(self, pack_id: str, index: int, offset: int, length: int) -> bytes | None:
        key = fragment_key(pack_id, index)
        for backend_id in self.fragment_order(pack_id, index):
            try:
                with self.measured(backend_id, length):
                    data = self._backend(backend_id).get_range(key, offset, length)
                self.stats.add_get(len(data))
                return data
            except BackendError:
                continue
        return None

    def _read_run(
        self, backend_id: str, pack_id: str, run: list[PackEntry], result: dict[str, bytes],
        reasons: list[str],
    ) -> list[PackEntry]:
        """Read and decode the entries of ``run`` from one backend into ``result``;
        return those it could not deliver."""
        backend = self._backend(backend_id)
        still: list[PackEntry] = []
        for part in _coalesce(run):
            start = part[0].offset
            end = part[-1].offset + part[-1].length
            try:
                with self.measured(backend_id, end - start):
                    data = backend.get_range(object_key(pack_id), start, end - start)
            except BackendError as exc:
                reasons.append(f"{backend_id}: {exc}")
                still.extend(part)
                continue
            self.stats.add_get(len(data))
            for entry in part:
                piece = data[entry.offset - start : entry.offset - start + entry.length]
                try:
                    result[entry.object_id] = self.codec.decode(entry.kind, entry.object_id, piece)
                except CorruptObject as exc:
                    self.stats.corrupt_copies += 1
                    reasons.append(f"{backend_id}: {exc}")
                    still.append(entry)
        return still


def mapping_of(config: Config) -> StableMapping:
    """The stable mapping a configuration defines (R copies of whole objects)."""
    return StableMapping(
        [(b.id, b.capacity) for b in config.backends],
        config.replicas,
        config.partitions,
        Fraction(*config.vnode_unit),
    )


def fragment_mapping_of(config: Config) -> StableMapping:
    """Where the n fragments of an erasure-coded object go: the first n distinct
    backends of the same stable order (so whole copies of small objects, on the
    first R, sit on a prefix of them). Replication only: the plain mapping."""
    if config.erasure is None:
        return mapping_of(config)
    return StableMapping(
        [(b.id, b.capacity) for b in config.backends],
        config.erasure[1],
        config.partitions,
        Fraction(*config.vnode_unit),
    )


def _coalesce(entries: list[PackEntry]) -> list[list[PackEntry]]:
    """Group entries (sorted by offset) into runs read with one request: entries at
    most ``COALESCE_GAP`` apart, spanning at most ``MAX_RUN`` bytes (an entry longer
    than that is a run of its own)."""
    runs: list[list[PackEntry]] = []
    for entry in entries:
        if (runs and entry.offset - (runs[-1][-1].offset + runs[-1][-1].length) <= COALESCE_GAP
                and entry.offset + entry.length - runs[-1][0].offset <= MAX_RUN):
            runs[-1].append(entry)
        else:
            runs.append([entry])
    return runs
