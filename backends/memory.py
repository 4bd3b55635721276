"""The ``memory:`` backend: a storage service held in this process's memory.

``memory:NAME`` with namespace ``ns`` keeps every key in the store ``NAME``, in the
namespace ``ns``. Every instance opened with the same ``NAME`` in one process shares
one store (so a repository can be opened twice, as two clients would), until
:func:`drop_store` forgets it; another process sees other stores. Nothing is
persisted.

It is the reference backend for unit tests: every operation is atomic under one
lock per store (``put`` replaces an object whole, ``put_if_absent`` is an exclusive
create, ``replace_if`` a compare-and-swap), so its logs are the generic
:class:`~metasync.backends.logs.ObjectStoreLogs`, the same construction (and bytes)
as on S3. Wrap it in :class:`~metasync.backends.faulty.FaultyBackend` to make it
misbehave.
"""

from __future__ import annotations

import builtins
import io
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import BinaryIO

from metasync.backends import register
from metasync.backends.base import Backend, Capabilities, check_key, check_namespace, check_prefix
from metasync.errors import BackendUnavailable, ObjectNotFound, UsageError

#: Streams given to ``put`` are read in pieces of this size.
CHUNK_SIZE = 1 << 20


@dataclass(eq=False)
class _Object:
    data: bytes
    #: Unique within the store for every write, so a poll token never comes back.
    version: int


@dataclass(eq=False)
class _Store:
    """One named store: namespaces of objects, guarded by ``lock``."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    #: Namespace -> key -> object; a namespace exists once created.
    namespaces: dict[str, dict[str, _Object]] = field(default_factory=dict)
    #: The version the next write gets.
    next_version: int = 1


_STORES: dict[str, _Store] = {}
_STORES_LOCK = threading.Lock()


def _store(name: str) -> _Store:
    """The store ``name``, made empty on first use."""
    with _STORES_LOCK:
        store = _STORES.get(name)
        if store is None:
            store = _STORES[name] = _Store()
        return store


def drop_store(name: str) -> None:
    """Forget the store ``name`` (nothing if there is none): instances opened later
    with that name start from an empty store. Instances already open keep working on
    the forgotten one, which no new instance reaches."""
    with _STORES_LOCK:
        _STORES.pop(name, None)


@register
class MemoryBackend(Backend):
    """A store in this process's memory, URI ``memory:NAME`` (module docstring).

    Thread-safe; each operation holds the store's lock only while it touches the
    store, never during I/O (there is none), so it never blocks for long.
    """

    scheme = "memory"
    capabilities = Capabilities(
        local=True,
        conditional_create=True,
        compare_and_swap=True,
        conditional_append=True,
        range_reads=True,
        max_object_size=None,
        case_sensitive=True,
        long_poll=False,
        sharing=False,
        log_deletion=True,
    )

    def __init__(self, uri: str, namespace: str) -> None:
        """Bind to the store named in ``uri`` (made empty if new); touches no data.

        Raises :class:`UsageError` for a URI without a name or an invalid namespace.
        """
        super().__init__(uri, namespace)
        scheme, _, name = uri.partition(":")
        if scheme != self.scheme or not name:
            raise UsageError(f"not a memory: URI: {uri!r}; use memory:NAME")
        check_namespace(namespace)
        #: The store's name (the URI without ``memory:``).
        self.store_name = name
        self._store = _store(name)

    def _objects(self) -> dict[str, _Object]:
        """The namespace's objects; the caller holds the store's lock. Raises
        :class:`BackendUnavailable` before :meth:`create`, as a missing folder does
        elsewhere: an uncreated namespace is never mistaken for an empty one."""
        objects = self._store.namespaces.get(self.namespace)
        if objects is None:
            raise BackendUnavailable(
                f"namespace {self.namespace!r} does not exist in {self.name}; create it first"
            )
        return objects

    def _write(self, objects: dict[str, _Object], key: str, data: bytes) -> None:
        """Store ``data`` at ``key`` under a fresh version (caller holds the lock)."""
        objects[key] = _Object(data, self._store.next_version)
        self._store.next_version += 1

    def _read(self, key: str) -> bytes:
        check_key(key)
        with self._store.lock:
            found = self._objects().get(key)
        if found is None:
            raise ObjectNotFound(f"no object {key!r} on {self.name}")
        return found.data

    # --- lifecycle -----------------------------------------------------------------
    def exists(self) -> bool:
        with self._store.lock:
            return self.namespace in self._store.namespaces

    def create(self) -> None:
        """Create the namespace (idempotent: an existing one keeps its objects)."""
        with self._store.lock:
            self._store.namespaces.setdefault(self.namespace, {})

    # --- objects -------------------------------------------------------------------
    def put(self, key: str, data: bytes | BinaryIO) -> None:
        """Store ``data`` at ``key``; a stream is read to its end first (in pieces),
        so readers see the old object or the whole new one."""
        check_key(key)
        if isinstance(data, bytes | bytearray | memoryview):
            content = bytes(data)
        else:
            pieces: builtins.list[bytes] = []
            while piece := data.read(CHUNK_SIZE):
                pieces.append(piece)
            content = b"".join(pieces)
        with self._store.lock:
            self._write(self._objects(), key, content)

    def put_if_absent(self, key: str, data: bytes) -> bool:
        """Create ``key`` holding ``data`` unless it exists (atomic)."""
        check_key(key)
        with self._store.lock:
            objects = self._objects()
            if key in objects:
                return False
            self._write(objects, key, bytes(data))
            return True

    def replace_if(self, key: str, data: bytes, token: str) -> bool:
        """Replace ``key`` only while its :meth:`poll` token is ``token`` (atomic)."""
        check_key(key)
        with self._store.lock:
            objects = self._objects()
            current = objects.get(key)
            if current is None or str(current.version) != token:
                return False
            self._write(objects, key, bytes(data))
            return True

    def get(self, key: str) -> bytes:
        return self._read(key)

    def open(self, key: str) -> BinaryIO:
        """A stream of the object as it is now (later writes do not change it)."""
        return io.BytesIO(self._read(key))

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        """``length`` bytes at ``offset``; :class:`BackendError` if the object is
        shorter than ``offset + length``, :class:`ValueError` for negative numbers."""
        if offset < 0 or length < 0:
            raise ValueError(f"get_range needs offset >= 0 and length >= 0, got {offset}, {length}")
        data = self._read(key)
        if len(data) < offset + length:
            raise self.truncated_error(key, offset + length, len(data))
        return data[offset : offset + length]

    def size(self, key: str) -> int:
        return len(self._read(key))

    def delete(self, key: str) -> None:
        check_key(key)
        with self._store.lock:
            if self._objects().pop(key, None) is None:
                raise ObjectNotFound(f"no object {key!r} on {self.name}")

    def list(self, prefix: str = "") -> Iterator[str]:
        """Every key below the folder ``prefix``, as the store holds them when called."""
        return (key for key, _ in self.list_sizes(prefix))

    def list_sizes(self, prefix: str = "") -> Iterator[tuple[str, int]]:
        check_prefix(prefix)
        folder = prefix.rstrip("/") + "/" if prefix else ""
        with self._store.lock:
            found = [(key, len(obj.data)) for key, obj in self._objects().items()
                     if key.startswith(folder)]
        return iter(found)

    def poll(self, key: str) -> str | None:
        """The object's version: every write gets a new one, never reused."""
        check_key(key)
        with self._store.lock:
            found = self._objects().get(key)
        return None if found is None else str(found.version)
