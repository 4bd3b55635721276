"""A loopback TCP server that accepts connections and then says nothing.

The server a user meets when a host is up but its service hangs (a stuck WebDAV
server, an sshd whose disk is gone, a firewall that completes the handshake):
the connection opens, and no byte ever comes back. ``first_bytes`` makes it a
server that sends the start of a reply (half an HTTP status line, an SSH banner
with no key exchange after it) and then goes silent. With ``target`` it is first a
plain TCP proxy to a real server (so a repository can be made there) until
:meth:`SilentServer.silence` is called; from then on nothing is relayed any more,
on open connections or new ones.

Use it as a context manager::

    with silent_server() as server:
        uri = f"webdav://127.0.0.1:{server.port}/x"

Connections are held open (never closed by the server) until the context ends,
so the client's only way out is its own timeout. ``accepted`` counts them, so a
test can check that the client really reached the server.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator


class SilentServer:
    """Accept on ``127.0.0.1:port``; send ``first_bytes`` (maybe none); then nothing."""

    def __init__(self, first_bytes: bytes = b"", target: tuple[str, int] | None = None) -> None:
        self.first_bytes = first_bytes
        self.target = target
        #: Whether the server has gone silent (always, without ``target``).
        self.silent = target is None
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._held: list[socket.socket] = []
        self._lock = threading.Lock()
        #: Connections accepted so far.
        self.accepted = 0
        self._thread = threading.Thread(target=self._serve, name="silent-server", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:  # the listener was closed: the server stops
                return
            with self._lock:
                self.accepted += 1
                self._held.append(conn)
            if not self.silent and self.target is not None:
                self._relay(conn, self.target)
                continue
            if self.first_bytes:
                with contextlib.suppress(OSError):
                    conn.sendall(self.first_bytes)

    def silence(self) -> None:
        """Stop relaying: from now on the server says nothing on any connection."""
        self.silent = True

    def _relay(self, conn: socket.socket, target: tuple[str, int]) -> None:
        try:
            upstream = socket.create_connection(target)
        except OSError:
            return
        with self._lock:
            self._held.append(upstream)
        for src, dst in ((conn, upstream), (upstream, conn)):
            threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        # Bytes read once the server is silent are dropped, never relayed; the
        # sockets stay open so that the client waits.
        with contextlib.suppress(OSError):
            while data := src.recv(1 << 16):
                if not self.silent:
                    dst.sendall(data)

    def close(self) -> None:
        """Stop accepting and drop every held connection."""
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        self._thread.join(timeout=5)
        with self._lock:
            for conn in self._held:
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)  # wakes the relay threads
                with contextlib.suppress(OSError):
                    conn.close()
            self._held.clear()


@contextlib.contextmanager
def silent_server(
    first_bytes: bytes = b"", target: tuple[str, int] | None = None
) -> Iterator[SilentServer]:
    """A running :class:`SilentServer`, closed on exit."""
    server = SilentServer(first_bytes, target)
    try:
        yield server
    finally:
        server.close()
