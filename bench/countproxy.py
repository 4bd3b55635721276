"""An HTTP reverse proxy that counts requests: what a storage service would bill.

The provider emulators count their own requests (``Emulator.requests``); SeaweedFS
does not, so the feeds benchmark puts this in front of its S3 port. Each client
connection gets one upstream connection (keep-alive on both sides); request and
answer bodies are passed whole (the benchmark's objects are small). The ``Host``
header is passed unchanged, so S3's SigV4 signatures (which cover it) still verify.
"""

from __future__ import annotations

import http.client
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

#: Hop-by-hop headers (RFC 9110 section 7.6.1): not forwarded.
HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-connection", "transfer-encoding",
                        "te", "trailer", "upgrade"})


class CountingProxy:
    """Forwards ``127.0.0.1:<port>`` to ``target_host:target_port``; ``requests``
    counts what passed, ``bytes_answered`` the answers' body bytes, and ``log``
    holds ``(method, path, Range header or None, answer bytes)`` of each request."""

    def __init__(self, target_host: str, target_port: int) -> None:
        self.requests = 0
        self.bytes_answered = 0
        self.log: list[tuple[str, str, str | None, int]] = []
        self._lock = threading.Lock()
        #: Client connections open now (closed by :meth:`close`, as a dying server's are).
        self._clients: set[socket.socket] = set()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            upstream: http.client.HTTPConnection | None = None

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def _forward(self) -> None:
                with proxy._lock:
                    proxy.requests += 1
                length = int(self.headers.get("Content-Length") or 0)
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    body = self._read_chunked()
                else:
                    body = self.rfile.read(length) if length else b""
                if self.upstream is None:
                    self.upstream = http.client.HTTPConnection(target_host, target_port, timeout=120)
                conn = self.upstream
                conn.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
                for name, value in self.headers.items():
                    if name.lower() not in HOP_BY_HOP and name.lower() != "content-length":
                        conn.putheader(name, value)
                if body or self.command in ("PUT", "POST"):
                    conn.putheader("Content-Length", str(len(body)))
                conn.endheaders(body or None)
                answer = conn.getresponse()
                data = answer.read()
                with proxy._lock:
                    proxy.bytes_answered += len(data)
                    proxy.log.append((self.command, self.path, self.headers.get("Range"),
                                      len(data)))
                self.send_response_only(answer.status, answer.reason)
                for name, value in answer.getheaders():
                    if name.lower() not in HOP_BY_HOP and name.lower() != "content-length":
                        self.send_header(name, value)
                if self.command != "HEAD":
                    self.send_header("Content-Length", str(len(data)))
                else:
                    length_header = answer.getheader("Content-Length")
                    if length_header is not None:
                        self.send_header("Content-Length", length_header)
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            def _read_chunked(self) -> bytes:
                parts = []
                while True:
                    size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                    if size == 0:
                        while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                            pass
                        return b"".join(parts)
                    parts.append(self.rfile.read(size))
                    self.rfile.readline()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward

            def setup(self) -> None:
                super().setup()
                with proxy._lock:
                    proxy._clients.add(self.connection)

            def finish(self) -> None:
                with proxy._lock:
                    proxy._clients.discard(self.connection)
                super().finish()
                if self.upstream is not None:
                    self.upstream.close()

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def reset(self) -> None:
        """Start counting afresh."""
        with self._lock:
            self.requests = 0
            self.bytes_answered = 0
            self.log = []

    def close(self) -> None:
        """Stop listening and cut every open connection (a kept-alive one too)."""
        self._server.shutdown()
        self._server.server_close()
        with self._lock:
            clients, self._clients = list(self._clients), set()
        for conn in clients:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
