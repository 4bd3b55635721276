"""The storage-service abstraction (paper Table 2) every backend implements.

A backend instance is bound to one repository namespace on one storage service:
all keys are relative to ``<service location>/<namespace>/``. Keys are
``/``-separated, each part matching ``[A-Za-z0-9._-]+`` and not ``.`` or ``..``;
:func:`check_key` enforces this so a key can never escape the namespace.

:class:`Backend` is the object store (Table 2a); its append-only logs (Table 2b)
are a separate component, :class:`~metasync.backends.logs.LogStore`, reached as
:attr:`Backend.logs` and chosen from the backend's capabilities
(:func:`~metasync.backends.logs.log_store_for`).

Error contract (every method, and every log store method):
- a missing key raises :class:`ObjectNotFound`;
- an unreachable service raises :class:`BackendUnavailable`;
- other failures raise :class:`BackendError` (``transient=True`` if a retry may help).
"""

from __future__ import annotations

import builtins
import functools
import io
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO

# Capabilities and the key rules live in modules of their own (the log constructions
# need them too); they are part of this interface and importable from here.
from metasync.backends.bwlimit import DOWN, LIMITER, metered_upload
from metasync.backends.capabilities import Capabilities as Capabilities
from metasync.backends.feeds import ChangeFeed, PollingFeed
from metasync.backends.keys import TEMP_PREFIX as TEMP_PREFIX
from metasync.backends.keys import check_key as check_key
from metasync.backends.keys import check_namespace as check_namespace
from metasync.backends.keys import check_prefix as check_prefix
from metasync.backends.keys import is_key_part as is_key_part
from metasync.backends.keys import temp_path_parts as temp_path_parts
from metasync.backends.logs import LogStore, log_store_for
from metasync.backends.retry import TransientError
from metasync.backends.uris import public_uri as public_uri
from metasync.errors import BackendError, ObjectNotFound

#: The methods that ask the service something: each call of one (not one made from
#: inside another, e.g. ``list_sizes`` calling ``size``) counts in
#: :attr:`Backend.requests`, whatever the implementation.
REQUEST_METHODS = frozenset({"exists", "probe", "create", "put", "put_if_absent", "get", "open",
                             "get_range", "size", "delete", "list", "list_sizes", "poll",
                             "replace_if"})
_IN_REQUEST = threading.local()


#: The methods whose data (the argument after the key) is an upload's payload.
_UPLOADS = frozenset({"put", "put_if_absent", "replace_if"})
#: The methods whose result is a download's payload (``open``: its stream's reads).
_DOWNLOADS = frozenset({"get", "get_range", "open"})
#: A request that moves at most this many bytes measures the backend's latency
#: (:attr:`Backend.latency`): a bigger transfer's time is mostly its size's.
LATENCY_PAYLOAD = 64 * 1024
#: Requests whose time says little of the round trip: a listing's grows with its
#: length, and ``open`` returns before its stream is read.
_UNTIMED = frozenset({"list", "list_sizes", "open"})


def _counted(method: Any) -> Any:
    """``method``, counting its outermost calls in the instance's ``requests``, timing
    the small ones (:attr:`Backend.latency`), and charging their payload to the
    process's bandwidth limit (:mod:`.bwlimit`): an outermost call is the one place
    every transfer of every backend passes through (a wrapper backend's inner calls
    are not charged again)."""
    name = method.__name__

    @functools.wraps(method)
    def call(self: Backend, *args: Any, **kwargs: Any) -> Any:
        if getattr(_IN_REQUEST, "depth", 0):
            return method(self, *args, **kwargs)
        self.requests += 1
        _IN_REQUEST.depth = 1
        try:
            if not LIMITER.active:
                return _timed(name, method, self, args, kwargs)
            return _limited(name, method, self, args, kwargs)
        finally:
            _IN_REQUEST.depth = 0
    call.__wrapped_request__ = True  # type: ignore[attr-defined]
    return call


def _timed(name: str, method: Any, self: Backend, args: tuple[Any, ...],
           kwargs: dict[str, Any]) -> Any:
    """``method`` called; if it succeeds having moved at most :data:`LATENCY_PAYLOAD`
    bytes (and is no listing), its seconds are the backend's :attr:`~Backend.latency`."""
    started = time.monotonic()
    result = method(self, *args, **kwargs)
    seconds = time.monotonic() - started
    if name not in _UNTIMED and _payload(name, args, kwargs, result) <= LATENCY_PAYLOAD:
        self.latency = seconds
    return result


def _payload(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], result: Any) -> float:
    """Bytes a request moved: an upload's data, a download's result (a stream, whose
    size is unknown: infinite), else none."""
    if name in _UPLOADS:
        data = args[1] if len(args) >= 2 else kwargs.get("data")
    elif name in _DOWNLOADS:
        data = result
    else:
        return 0
    if isinstance(data, bytes | bytearray | memoryview):
        return memoryview(data).nbytes
    return float("inf")


def _limited(name: str, method: Any, self: Backend, args: tuple[Any, ...],
             kwargs: dict[str, Any]) -> Any:
    """``method`` called with its payload charged to :data:`.bwlimit.LIMITER`: an
    upload's data before it is sent (a stream as it is read), a download's bytes as
    they arrive (``open``'s stream as it is read). The waits for the limit are not
    part of the time measured (:func:`_timed`)."""
    if name in _UPLOADS:
        if len(args) >= 2:
            args = (args[0], metered_upload(args[1]), *args[2:])
        elif "data" in kwargs:
            kwargs = {**kwargs, "data": metered_upload(kwargs["data"])}
        return _timed(name, method, self, args, kwargs)
    result = _timed(name, method, self, args, kwargs)
    if name == "open":
        return LIMITER.reader(result, DOWN)
    if name in _DOWNLOADS:
        LIMITER.charge(DOWN, len(result))
    return result


#: Guards the one-time creation of each backend's log store (creation does no I/O).
#: Reentrant: a wrapper's store may be its inner backend's, made on the way.
_LOG_STORE_LOCK = threading.RLock()


def one_line(exc: BaseException) -> str:
    """``exc``'s message with its white space folded to single spaces (messages are one
    line), or the exception's class name if it has no message."""
    return " ".join(str(exc).split()) or type(exc).__name__


def read_full(stream: BinaryIO, size: int) -> bytes:
    """Up to ``size`` bytes of ``stream``, fewer only at EOF: unlike one ``read``, which
    may return less than asked (sockets, pipes, SDK streams), it reads until it has
    ``size`` bytes or the stream ends."""
    parts: builtins.list[bytes] = []
    left = size
    while left > 0:
        piece = stream.read(left)
        if not piece:
            break
        parts.append(piece)
        left -= len(piece)
    return b"".join(parts)


@dataclass(frozen=True)
class TempFile:
    """A temporary upload file in a backend's namespace (see
    :meth:`Backend.sweep_temp_files`)."""

    #: Where it is, relative to the namespace folder (``/``-separated).
    path: str
    size: int
    #: When it was last written, in seconds since the epoch by the service's clock.
    modified: float


class Backend(ABC):
    """One storage service, bound to one repository namespace."""

    #: Declared by each implementation; the single place its abilities are stated.
    capabilities: Capabilities = Capabilities()
    #: URI scheme this class handles, e.g. ``"dir"``.
    scheme: str = ""
    #: Whether ``init`` and ``backend add`` create a missing location folder only when
    #: asked (``--mkdir``): ``dir:``, where a missing folder is usually an unmounted disk.
    location_needs_mkdir: bool = False
    #: Calls of :data:`REQUEST_METHODS` made on this instance (the service's
    #: ``/metrics``); approximate under concurrent calls, never reset.
    requests: int = 0
    #: Seconds the last successful small request took (one that moved at most
    #: :data:`LATENCY_PAYLOAD` bytes, not a listing): the service's ``latency_ms``
    #: of a backend; None before one.
    latency: float | None = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for name in REQUEST_METHODS & cls.__dict__.keys():
            method = cls.__dict__[name]
            if callable(method) and not getattr(method, "__isabstractmethod__", False) \
                    and not getattr(method, "__wrapped_request__", False):
                setattr(cls, name, _counted(method))

    def __init__(self, uri: str, namespace: str) -> None:
        self.uri = uri
        self.namespace = namespace
        self._log_store: LogStore | None = None

    @property
    def name(self) -> str:
        """A short human name for messages: the URI without any password."""
        return public_uri(self.uri)

    def truncated_error(self, key: str, needed: int, size: int | None = None) -> BackendError:
        """The error for a read that needs ``needed`` bytes of ``key`` but the stored
        object (``size`` bytes, if known) is shorter: a truncated copy."""
        have = f"{size} bytes" if size is not None else "too short"
        return BackendError(
            f"object {key!r} on {self.name} is {have}, shorter than the {needed} bytes "
            "needed (a truncated copy?)"
        )

    # --- lifecycle --------------------------------------------------------------
    @abstractmethod
    def exists(self) -> bool:
        """True if the namespace exists on the service (a repository may live there)."""

    def probe(self) -> None:  # noqa: B027 - optional hook
        """Raise :class:`BackendUnavailable` (naming the location and the fix) if the
        service location cannot be reached. Never writes. The default checks nothing."""

    def create_location(self) -> None:  # noqa: B027 - optional hook
        """Create the location folder the URI names, with its parents, if it is missing
        (``init`` and ``backend add`` call it before :meth:`create`, as restic and
        rclone do; see :attr:`location_needs_mkdir`). The default creates nothing: the
        service has no such folder, or it must exist (an S3 bucket)."""

    def format_needed(self) -> int:
        """The lowest repository format version (docs/FORMAT.md) whose readers read
        what this backend's namespace holds; 0: any. A configuration that names the
        backend says at least this version, so older clients refuse the repository
        with "upgrade" instead of misreading it."""
        return 0

    @abstractmethod
    def create(self) -> None:
        """Create the namespace. The service location itself must already exist
        (raise :class:`BackendUnavailable` naming it if not)."""

    # --- storage abstraction (Table 2a) ------------------------------------------
    @abstractmethod
    def put(self, key: str, data: bytes | BinaryIO) -> None:
        """Store ``data`` at ``key``, replacing any previous object atomically:
        readers see the old object or the whole new one, never a part.
        A file-like ``data`` is streamed, never read whole into memory."""

    @abstractmethod
    def put_if_absent(self, key: str, data: bytes) -> bool:
        """Create ``key`` only if absent, atomically; return False if it existed.
        Backends without ``conditional_create`` may emulate this best-effort."""

    @abstractmethod
    def get(self, key: str) -> bytes:
        """Return the whole object at ``key``."""

    @abstractmethod
    def open(self, key: str) -> BinaryIO:
        """Return a readable stream of the object at ``key`` (caller closes it)."""

    @abstractmethod
    def get_range(self, key: str, offset: int, length: int) -> bytes:
        """Return ``length`` bytes from ``offset``; raise :class:`BackendError` if the
        object is shorter than ``offset + length`` (a truncated copy)."""

    @abstractmethod
    def size(self, key: str) -> int:
        """Size of the object at ``key`` in bytes."""

    @abstractmethod
    def delete(self, key: str) -> None:
        """Remove ``key``. Deleting a missing key raises :class:`ObjectNotFound`."""

    @abstractmethod
    def list(self, prefix: str = "") -> Iterator[str]:
        """Yield every key under ``prefix`` (a folder-like prefix, ``""`` for all), in
        no particular order. Temporary files of in-progress writes are never listed."""

    def list_sizes(self, prefix: str = "") -> Iterator[tuple[str, int]]:
        """Like :meth:`list`, with each object's size in bytes. The default asks
        :meth:`size` per key (a key deleted meanwhile is skipped); services whose
        listings carry sizes answer in one listing."""
        for key in self.list(prefix):
            try:
                yield key, self.size(key)
            except ObjectNotFound:
                continue

    @abstractmethod
    def poll(self, key: str) -> str | None:
        """Return a token that changes whenever the object at ``key`` changes, or
        ``None`` if it does not exist. Comparing tokens tells a client to re-read."""

    def change_feed(self, watch_key: str | None = None) -> ChangeFeed | None:
        """A new :class:`~metasync.backends.feeds.ChangeFeed` for this namespace, of
        the kind ``capabilities.change_feed`` declares; ``None`` where the backend
        offers none and the caller reads :meth:`poll` tokens itself.

        ``watch_key`` is the key every writer rewrites after a change (the
        repository's ``latest`` hint; the caller names it, backends know no
        repository layout). Backends with a change notification of their own watch
        the whole namespace and may ignore it; the default, for backends without one
        (S3, SFTP, WebDAV, rclone, ``memory:``), is a
        :class:`~metasync.backends.feeds.PollingFeed` on ``watch_key`` (``None``
        without one)."""
        if watch_key is None:
            return None
        return PollingFeed(self, watch_key)

    def replace_if(self, key: str, data: bytes, token: str) -> bool:
        """Replace the object at ``key`` with ``data`` only if its :meth:`poll` token is
        still ``token`` (compare-and-swap, S3's ``If-Match``), atomically; return False
        (writing nothing) if it changed or is gone. Only where
        ``capabilities.compare_and_swap``."""
        raise NotImplementedError(f"{type(self).__name__} has no compare-and-swap")

    def share(self, email: str) -> str:
        """Give the user ``email`` of this service read-write access to the namespace
        folder (an invitation they accept on the service); return one line saying what
        was done. Idempotent. Only where ``capabilities.sharing``."""
        raise NotImplementedError(f"{type(self).__name__} cannot share folders")

    # --- leftovers of killed writers ---------------------------------------------------
    def sweep_temp_files(self, older_than: float, *, delete: bool) -> builtins.list[TempFile]:
        """The temporary upload files (``.tmp-*``) in the namespace last written before
        ``older_than`` (seconds since the epoch): what a writer killed mid-upload left.
        With ``delete`` each is removed, and one already gone (another sweep) is not
        returned. A younger one may belong to an upload in progress (its writes keep
        it young) and is never touched; the caller picks ``older_than`` with a grace
        period that covers clock differences and stalls. Only where
        ``capabilities.temp_files``; otherwise there is nothing to find (``[]``)."""
        if not self.capabilities.temp_files:
            return []
        found = []
        for temp in self._temp_files():
            if temp.modified >= older_than:
                continue
            if delete and not self._remove_temp(temp.path):
                continue
            found.append(temp)
        return found

    def _temp_files(self) -> Iterator[TempFile]:
        """Every temporary upload file in the namespace (``capabilities.temp_files``)."""
        raise NotImplementedError(f"{type(self).__name__} keeps no temporary files")

    def _remove_temp(self, path: str) -> bool:
        """Remove the temporary file at ``path`` (as :meth:`_temp_files` named it);
        False if it was already gone."""
        raise NotImplementedError(f"{type(self).__name__} keeps no temporary files")

    # --- logs (Table 2b) -----------------------------------------------------------------
    def specific_logs(self) -> LogStore | None:
        """This backend's own log construction, for a service whose logs are not (or
        not only) the generic ones: a new store, or None (the default) to have
        :func:`~metasync.backends.logs.log_store_for` choose a generic one from
        :attr:`capabilities`. Called once per instance, by :attr:`logs`; no I/O."""
        return None

    @property
    def logs(self) -> LogStore:
        """This namespace's append-only logs (paper Table 2b): the store
        :func:`~metasync.backends.logs.log_store_for` chose for this backend, made on
        first use and the same object from then on (it may cache decided entries)."""
        store = self._log_store
        if store is None:
            with _LOG_STORE_LOCK:
                store = self._log_store
                if store is None:
                    store = self._log_store = log_store_for(self)
        return store

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections. The default does nothing."""


class ObjectReader(io.RawIOBase):
    """The stream :meth:`Backend.open` returns (inside an ``io.BufferedReader``): the
    ``size`` bytes of the object ``key``, handed out from position ``_pos`` on.

    A subclass fetches the bytes in :meth:`_next_piece`, resuming at ``_pos`` after a
    failure as its service allows; this class hands them out through ``readinto``,
    keeps what a caller did not take for the next call, and reads nothing more once
    ``size`` bytes were handed out."""

    def __init__(self, backend: Backend, key: str, size: int) -> None:
        super().__init__()
        self._backend = backend
        self._key = key
        self._size = size
        #: Bytes handed out so far (the position in the object).
        self._pos = 0
        #: Bytes fetched but not yet handed out.
        self._buffer = b""

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        if self._pos >= self._size or not len(view):
            return 0
        if not self._buffer:
            self._buffer = self._next_piece(min(len(view), self._size - self._pos))
        n = min(len(view), len(self._buffer))
        piece = self._buffer[:n]
        view[:n] = piece
        self._buffer = self._buffer[n:]
        self._pos += n
        self._handed_out(piece)
        return n

    @abstractmethod
    def _next_piece(self, wanted: int) -> bytes:
        """The object's next bytes from ``_pos`` (``wanted`` is what the caller asked
        for, at most what is left; a piece may be shorter or longer). An empty piece
        ends the stream early, so a subclass raises instead (:meth:`_ended_early`)."""

    def _handed_out(self, data: bytes) -> None:
        """Called with the bytes each ``readinto`` handed out, after ``_pos`` moved past
        them (a subclass checks a hash here). The default does nothing."""

    def _ended_early(self) -> TransientError:
        """The error for a connection that ended before the object did: transient, so
        the backend's retry resumes at ``_pos``."""
        return TransientError(
            f"reading {self._key!r} on {self._backend.name} ended at byte {self._pos} "
            f"of {self._size}"
        )
