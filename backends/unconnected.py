"""A backend of the shared configuration that this client has not connected.

Stands in for a backend another client added, until this client has what it needs
locally to reach it (``metasync backend connect``, see
:mod:`metasync.backends.uris`). It touches nothing -- no program is run, no file read,
no host contacted -- and every operation, its logs' included, raises
:class:`BackendUnavailable` with the reason and the command that connects it, so the
rest of metasync counts it as one more unreachable backend (a quorum and the other
replicas carry on without it).
"""

from __future__ import annotations

import builtins
from collections.abc import Iterator
from typing import BinaryIO, NoReturn

from metasync.backends.base import Backend, Capabilities
from metasync.backends.logs import LogStore
from metasync.errors import BackendUnavailable


class Unconnected(Backend):
    """A backend this client must not open yet; ``reason`` is the one-line message
    every operation raises (naming the backend and ``metasync backend connect``)."""

    scheme = "unconnected"
    capabilities = Capabilities(conditional_append=True)

    def __init__(self, uri: str, namespace: str, reason: str, *,
                 connect_needed: bool = True) -> None:
        super().__init__(uri, namespace)
        self.reason = reason
        #: False for a backend that only could not be checked (out of reach): no
        #: ``backend connect`` is needed, the next command checks it again.
        self.connect_needed = connect_needed

    def _refuse(self) -> NoReturn:
        raise BackendUnavailable(self.reason)

    def specific_logs(self) -> LogStore | None:
        return _UnconnectedLogs(self)

    def exists(self) -> bool:
        self._refuse()

    def probe(self) -> None:
        self._refuse()

    def create(self) -> None:
        self._refuse()

    def put(self, key: str, data: bytes | BinaryIO) -> None:
        self._refuse()

    def put_if_absent(self, key: str, data: bytes) -> bool:
        self._refuse()

    def get(self, key: str) -> bytes:
        self._refuse()

    def open(self, key: str) -> BinaryIO:
        self._refuse()

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        self._refuse()

    def size(self, key: str) -> int:
        self._refuse()

    def delete(self, key: str) -> None:
        self._refuse()

    def list(self, prefix: str = "") -> Iterator[str]:
        self._refuse()

    def poll(self, key: str) -> str | None:
        self._refuse()


class _UnconnectedLogs(LogStore):
    """The logs of an :class:`Unconnected` backend: unreachable too."""

    def __init__(self, backend: Unconnected) -> None:
        self._backend = backend

    def append(self, log: str, message: bytes) -> int:
        self._backend._refuse()

    def append_at(self, log: str, position: int, message: bytes) -> bool:
        self._backend._refuse()

    def fetch(self, log: str, start: int = 0) -> builtins.list[tuple[int, bytes]]:
        self._backend._refuse()

    def delete_log(self, log: str) -> int:
        self._backend._refuse()
