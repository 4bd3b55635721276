"""PLACEHOLDER for the service's web server (helper web19 replaces this file with
the real page and REST API of docs/api.md). It has the interface the service uses
and answers every request with 404."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from metasync.app.fleet import Fleet
    from metasync.app.registry import Registry


class _NotFound(BaseHTTPRequestHandler):
    def _answer(self) -> None:
        body = b'{"error": "not found"}'
        self.send_response(404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = do_PUT = do_DELETE = _answer

    def log_message(self, format: str, *args: object) -> None:
        pass


class WebServer:
    """Serves on ``host:port`` (0: any free port) in its own thread."""

    def __init__(self, fleet: Fleet, registry: Registry, host: str, port: int) -> None:
        self.fleet = fleet
        self.registry = registry
        self.host = host
        self.port = port
        self.url = ""
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Listen (OSError if the address is taken), then serve in a thread."""
        self._server = ThreadingHTTPServer((self.host, self.port), _NotFound)
        self.port = self._server.server_address[1]
        self.url = f"http://{self.host}:{self.port}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
