"""A loopback TCP proxy that injects connection failures on command.

Network backends are tested for retries by pointing them at a :class:`FaultProxy`
in front of the real server. ``break_connections(reset_next=n)`` resets every
connection open through the proxy (the client sees "connection reset" in the
middle of whatever it was doing) and resets the next ``n`` new connections as
soon as they are accepted. ``injected`` counts the resets, so a test can assert
that the faults really hit the backend.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
from collections.abc import Iterator


def _reset(sock: socket.socket) -> None:
    # SO_LINGER with a zero timeout makes close() send RST instead of FIN.
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    # Wake a pump thread blocked in recv() on this socket: close() from another
    # thread alone would leave the kernel socket open (and send nothing) until then.
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RD)
    with contextlib.suppress(OSError):
        sock.close()


class FaultProxy:
    """Forward ``127.0.0.1:<port>`` to ``target``; inject resets on command."""

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self._reset_next = 0
        #: Connections reset by the proxy so far.
        self.injected = 0
        #: Connections accepted so far.
        self.accepted = 0
        self._closed = False
        self._thread = threading.Thread(target=self._serve, name="fault-proxy", daemon=True)
        self._thread.start()

    def break_connections(self, *, reset_next: int = 0) -> None:
        """Reset every open connection now, and the next ``reset_next`` new ones."""
        with self._lock:
            self._reset_next = reset_next
            victims = list(self._open)
            self._open.clear()
            self.injected += len(victims) // 2
        for sock in victims:
            _reset(sock)

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._listener.close()
        self.break_connections()

    def _serve(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                self.accepted += 1
                if self._reset_next > 0:
                    self._reset_next -= 1
                    self.injected += 1
                    _reset(client)
                    continue
            try:
                upstream = socket.create_connection(self.target)
            except OSError:
                _reset(client)
                continue
            with self._lock:
                self._open.update((client, upstream))
            pending = [2]  # pumps still running for this connection
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(
                    target=self._pump, args=(src, dst, client, upstream, pending), daemon=True
                ).start()

    def _pump(
        self,
        src: socket.socket,
        dst: socket.socket,
        client: socket.socket,
        upstream: socket.socket,
        pending: list[int],
    ) -> None:
        try:
            while True:
                data = src.recv(1 << 16)
                if not data:
                    break
                dst.sendall(data)
        except OSError:
            pass
        # Half-close so the other direction can finish.
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)
        with self._lock:
            pending[0] -= 1
            finished = pending[0] == 0
            if finished:
                self._open.discard(client)
                self._open.discard(upstream)
        if finished:
            for sock in (client, upstream):
                with contextlib.suppress(OSError):
                    sock.close()


@contextlib.contextmanager
def fault_proxy(host: str, port: int) -> Iterator[FaultProxy]:
    """A :class:`FaultProxy` in front of ``host:port``, closed afterwards."""
    proxy = FaultProxy(host, port)
    try:
        yield proxy
    finally:
        proxy.close()
