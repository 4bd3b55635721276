"""A loopback TCP proxy that makes a server look like it is far away.

Every byte through a :class:`WanProxy` crosses an emulated wide-area link: one
:class:`Pipe` per direction, shared by *all* connections through that proxy (as
one access link is shared by all of a client's connections), each with

* a **bandwidth** (bytes per second): a FIFO serialisation queue -- a chunk of
  ``n`` bytes occupies the pipe for ``n / rate`` seconds after the previous
  chunk has left it (a token bucket with a burst of one chunk); ``None`` means
  unlimited;
* a **one-way delay** (half the round trip): a chunk is delivered that long
  after it has been serialised;
* a **connection set-up** cost: a new connection's first bytes wait one round
  trip (the TCP handshake the client would have waited for).

Each connection has four threads: a reader per direction that takes data from
one socket, books it on its pipe and queues it with its delivery time, and a
writer per direction that sends it on once that time has come. A reader stops
reading while ``MAX_QUEUED`` bytes of its connection are waiting, so a fast
sender is held back as TCP's window would hold it back, and memory stays
bounded. Closing one side is forwarded (after the delay) as a half-close.

This module needs no ``tc``/netem (which needs root and the ``sch_netem`` kernel
module; this machine's kernel is built without it) and touches nothing but loopback
sockets. Timing is as good as ``time.sleep``: well under a millisecond on an idle
machine, worse on a loaded one (the figures this proxy produces come with the
machine's load).

    proxy = WanProxy("127.0.0.1", 9000, LinkSpec(rtt_ms=50, up_mb_s=10, down_mb_s=10))
    ... connect to 127.0.0.1:proxy.port ...
    proxy.close()
"""

from __future__ import annotations

import contextlib
import queue
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

#: Bytes read from a socket at once.
CHUNK = 64 * 1024
#: Bytes of one connection and direction that may wait in the proxy.
MAX_QUEUED = 1024 * 1024
#: Megabyte, as in "MB/s": 10**6 bytes (the paper's tables use the same).
MB = 1_000_000


@dataclass(frozen=True)
class LinkSpec:
    """One emulated link: round-trip time and bandwidth in each direction.

    ``up`` is client to server (uploads), ``down`` server to client; a bandwidth
    of ``None`` is unlimited.
    """

    rtt_ms: float = 0.0
    up_mb_s: float | None = None
    down_mb_s: float | None = None
    label: str = ""

    def describe(self) -> str:
        def bw(v: float | None) -> str:
            return "unlimited" if v is None else f"{v:g} MB/s"

        name = f"{self.label}: " if self.label else ""
        return f"{name}{self.rtt_ms:g} ms RTT, up {bw(self.up_mb_s)}, down {bw(self.down_mb_s)}"


class Pipe:
    """One direction of a link: a FIFO bottleneck plus a propagation delay."""

    def __init__(self, rate_mb_s: float | None, delay_s: float) -> None:
        self.rate = None if rate_mb_s is None else rate_mb_s * MB
        self.delay = delay_s
        self._free_at = 0.0
        self._lock = threading.Lock()
        #: Bytes booked through this pipe so far.
        self.bytes = 0

    def book(self, size: int, not_before: float = 0.0) -> float:
        """Book ``size`` bytes offered now; return when they reach the other end."""
        now = time.monotonic()
        with self._lock:
            self.bytes += size
            if self.rate is None:
                leaves = now
            else:
                leaves = max(now, self._free_at) + size / self.rate
                self._free_at = leaves
        return max(leaves + self.delay, not_before)


def _sleep_until(deadline: float) -> None:
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return
        time.sleep(left)


class _Direction:
    """Moves one direction of one connection through a pipe."""

    def __init__(self, src: socket.socket, dst: socket.socket, pipe: Pipe, first_at: float,
                 on_exit: threading.Event) -> None:
        self.src, self.dst, self.pipe = src, dst, pipe
        self.first_at = first_at
        self.on_exit = on_exit
        self.queue: queue.Queue[tuple[float, bytes | None]] = queue.Queue()
        self.room = threading.Semaphore(MAX_QUEUED // CHUNK)
        self.broken = False

    def read(self) -> None:
        try:
            while not self.broken:
                self.room.acquire()
                data = self.src.recv(CHUNK)
                if not data:
                    break
                self.queue.put((self.pipe.book(len(data), self.first_at), data))
        except OSError:
            self.broken = True
        # EOF travels behind the data.
        self.queue.put((self.pipe.book(0, self.first_at), None))

    def write(self) -> None:
        while True:
            at, data = self.queue.get()
            _sleep_until(at)
            if data is None:
                break
            self.room.release()
            if self.broken:
                continue  # the other side is gone: drain until the reader stops
            try:
                self.dst.sendall(data)
            except OSError:
                self.broken = True
                with contextlib.suppress(OSError):
                    self.src.shutdown(socket.SHUT_RD)  # wake the reader
        with contextlib.suppress(OSError):
            self.dst.shutdown(socket.SHUT_WR)
        self.on_exit.set()


class WanProxy:
    """Forward ``127.0.0.1:<port>`` to ``target`` across an emulated link."""

    def __init__(self, target_host: str, target_port: int, link: LinkSpec) -> None:
        self.target = (target_host, target_port)
        self.link = link
        one_way = link.rtt_ms / 2000.0
        self.up = Pipe(link.up_mb_s, one_way)
        self.down = Pipe(link.down_mb_s, one_way)
        self._listener = socket.create_server(("127.0.0.1", 0), backlog=128)
        self.port: int = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self._closed = False
        #: Connections accepted so far.
        self.connections = 0
        self._thread = threading.Thread(target=self._serve, name="wan-proxy", daemon=True)
        self._thread.start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def stats(self) -> dict[str, int]:
        """Connections and bytes carried so far, per direction."""
        return {"connections": self.connections, "bytes_up": self.up.bytes,
                "bytes_down": self.down.bytes}

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._listener.close()
        with self._lock:
            victims = list(self._open)
            self._open.clear()
        for sock in victims:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                sock.close()

    def _serve(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            accepted = time.monotonic()
            try:
                upstream = socket.create_connection(self.target)
            except OSError:
                with contextlib.suppress(OSError):
                    client.close()
                continue
            for sock in (client, upstream):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self.connections += 1
                self._open.update((client, upstream))
            rtt = self.link.rtt_ms / 1000.0
            # The client's first bytes leave after the handshake's round trip; the
            # server's first bytes reach the client no earlier than that either.
            done = [threading.Event(), threading.Event()]
            up = _Direction(client, upstream, self.up, accepted + rtt + rtt / 2, done[0])
            down = _Direction(upstream, client, self.down, accepted + rtt, done[1])
            for direction in (up, down):
                threading.Thread(target=direction.read, daemon=True).start()
                threading.Thread(target=direction.write, daemon=True).start()
            threading.Thread(target=self._reap, args=(client, upstream, done),
                             daemon=True).start()

    def _reap(self, client: socket.socket, upstream: socket.socket,
              done: list[threading.Event]) -> None:
        for event in done:
            event.wait()
        with self._lock:
            self._open.discard(client)
            self._open.discard(upstream)
        for sock in (client, upstream):
            with contextlib.suppress(OSError):
                sock.close()


@contextlib.contextmanager
def wan_proxy(host: str, port: int, link: LinkSpec) -> Iterator[WanProxy]:
    """A :class:`WanProxy` in front of ``host:port``, closed afterwards."""
    proxy = WanProxy(host, port, link)
    try:
        yield proxy
    finally:
        proxy.close()


# ---------------------------------------------------------------- link profiles
#: The three backends of a bench run, in order: S3 (SeaweedFS), SFTP (OpenSSH),
#: WebDAV (wsgidav).
BACKEND_KINDS = ("s3", "sftp", "webdav")

#: Link profiles: one :class:`LinkSpec` per backend kind. ``wan`` is the issue's
#: target setting; ``paper-us`` and ``paper-china`` take the 100 MB column of the
#: paper's Table 6 (upload / download MB/s of Google Drive, Dropbox and Box, in that
#: order, measured from the U.S. and from China; the paper gives no latency, so the
#: round trips are assumptions: 40 ms within the U.S., 250 ms from China).
PROFILES: dict[str, dict[str, LinkSpec]] = {
    "lan": {k: LinkSpec(0, None, None, "loopback") for k in BACKEND_KINDS},
    "wan": {k: LinkSpec(50, 10, 10, "50 ms, 10 MB/s") for k in BACKEND_KINDS},
    "paper-us": {
        "s3": LinkSpec(40, 9.43, 26.90, "Google Drive, U.S."),
        "sftp": LinkSpec(40, 3.86, 14.81, "Dropbox, U.S."),
        "webdav": LinkSpec(40, 17.37, 15.77, "Box, U.S."),
    },
    "paper-china": {
        "s3": LinkSpec(250, 0.11, 0.44, "OneDrive, China"),
        "sftp": LinkSpec(250, 0.13, 0.68, "Dropbox, China"),
        "webdav": LinkSpec(250, 0.13, 1.08, "Box, China"),
    },
}
