"""A test wrapper that limits one backend's bandwidth: ``throttle:RATE:INNER-URI``.

``RATE`` is bytes per second shared by every request to that backend (all threads,
both directions), like one network link: each transfer reserves its bytes' worth of
time on the link and waits until that time has passed, so concurrent requests
queue and the backend never moves more than ``RATE`` bytes per second. Only data
bytes are counted; small requests (logs, listings) pass unthrottled.

Importing this module registers the scheme in this process (tests and benches use
it through the Python API). ``links`` exposes each link's byte count, so a test can
check how a clone spread its reads without asserting on time.
"""

from __future__ import annotations

import io
import threading
import time
from collections.abc import Iterator
from typing import BinaryIO

from metasync.backends import Backend, open_backend, register
from metasync.backends.base import TempFile
from metasync.backends.logs import LogStore


class Link:
    """One throttled link: a virtual clock of when it is next free."""

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self._free_at = 0.0
        self._lock = threading.Lock()
        self.bytes = 0

    def transfer(self, size: int) -> None:
        """Block until ``size`` bytes would have crossed the link."""
        with self._lock:
            now = time.monotonic()
            start = max(now, self._free_at)
            self._free_at = start + size / self.rate
            done_at = self._free_at
            self.bytes += size
        pause = done_at - time.monotonic()
        if pause > 0:
            time.sleep(pause)  # emulating a slow link, not synchronising


#: Links by inner URI, shared by every instance of the same backend in the process.
links: dict[str, Link] = {}
_links_lock = threading.Lock()


@register
class ThrottledBackend(Backend):
    """Delegates to the inner backend, paying data bytes through a :class:`Link`."""

    scheme = "throttle"

    def __init__(self, uri: str, namespace: str) -> None:
        super().__init__(uri, namespace)
        _, rate, inner = uri.split(":", 2)
        self.inner = open_backend(inner, namespace)
        self.capabilities = self.inner.capabilities
        with _links_lock:
            self.link = links.setdefault(inner, Link(float(rate)))

    def exists(self) -> bool:
        return self.inner.exists()

    def probe(self) -> None:
        self.inner.probe()

    def create(self) -> None:
        self.inner.create()

    def put(self, key: str, data: bytes | BinaryIO) -> None:
        if isinstance(data, bytes):
            self.link.transfer(len(data))
        self.inner.put(key, data)

    def put_if_absent(self, key: str, data: bytes) -> bool:
        return self.inner.put_if_absent(key, data)

    def get(self, key: str) -> bytes:
        data = self.inner.get(key)
        self.link.transfer(len(data))
        return data

    def open(self, key: str) -> BinaryIO:
        return io.BytesIO(self.get(key))

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        data = self.inner.get_range(key, offset, length)
        self.link.transfer(len(data))
        return data

    def size(self, key: str) -> int:
        return self.inner.size(key)

    def delete(self, key: str) -> None:
        self.inner.delete(key)

    def list(self, prefix: str = "") -> Iterator[str]:
        return self.inner.list(prefix)

    def list_sizes(self, prefix: str = "") -> Iterator[tuple[str, int]]:
        return self.inner.list_sizes(prefix)

    def poll(self, key: str) -> str | None:
        return self.inner.poll(key)

    def specific_logs(self) -> LogStore:
        # Log requests are small: the inner backend's logs, unthrottled.
        return self.inner.logs

    def sweep_temp_files(self, older_than: float, *, delete: bool) -> list[TempFile]:
        return self.inner.sweep_temp_files(older_than, delete=delete)

    def close(self) -> None:
        self.inner.close()
