"""The service's web server: the page, the REST API and ``/metrics`` on loopback.

An aiohttp application run by an ``AppRunner`` and a ``TCPSite`` on an event loop
of its own, in a thread of its own, so the fleet's threads and the server never
wait on each other. :meth:`WebServer.start` returns once the socket listens (or
raises the one-line reason it cannot); :meth:`WebServer.stop` closes the site and
every connection and joins the thread.

Every request passes :func:`_guard` first (docs/api.md, "Authentication";
:mod:`metasync.app.auth`): a Host that is not a loopback name -> 403; no valid key
nor session -> 401 (a short HTML page for a page, JSON for the API); a
state-changing call with the session cookie and no matching ``X-CSRF-Token`` ->
403. Then every error becomes a JSON one-liner (:func:`_errors`).

The page is whatever :data:`STATIC` holds (``index.html`` at ``/``), served with a
content security policy that allows nothing from elsewhere.
"""

from __future__ import annotations

import asyncio
import logging
import mimetypes
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING

from aiohttp import web

from metasync.app.api import Api, error_response, json_response
from metasync.app.auth import (
    API_KEY_HEADER,
    CSRF_COOKIE,
    CSRF_HEADER,
    SESSION_COOKIE,
    UNSAFE_METHODS,
    Gate,
)
from metasync.app.folder_ops import ApiError
from metasync.app.metrics import CONTENT_TYPE, Metrics
from metasync.app.notify import Notifier
from metasync.errors import UsageError

if TYPE_CHECKING:
    from metasync.app.fleet import Fleet
    from metasync.app.registry import Registry

#: The page's files.
STATIC = Path(__file__).resolve().parent / "static"
#: Seconds start() waits for the socket, and stop() for the thread.
START_WAIT = 30.0
#: Headers of every answer: no framing, no sniffing, no referrer (a login URL
#: carries a token), nothing loaded from elsewhere.
SECURITY_HEADERS = {
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; "
                               "frame-ancestors 'none'; base-uri 'none'; form-action 'self'",
}
LOGIN_HELP = ("<!doctype html><meta charset=utf-8><title>metasync</title>"
              "<p>{why}</p><p>Run <code>metasync gui</code> to open this page "
              "(or <code>metasync gui --print</code> for its address).</p>")

log = logging.getLogger("metasync.app.web")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _is_page(request: web.Request) -> bool:
    return not request.path.startswith("/rest/") and request.path != "/metrics"


def _refuse(request: web.Request, status: int, why: str) -> web.Response:
    if _is_page(request) and request.method == "GET":
        return web.Response(text=LOGIN_HELP.format(why=why), status=status,
                            content_type="text/html")
    return json_response({"error": why}, status=status)


class WebServer:
    """The page and the API of one fleet (docs/api.md)."""

    def __init__(self, fleet: Fleet, registry: Registry, host: str, port: int,
                 static: Path = STATIC) -> None:
        self.fleet = fleet
        #: The page's folder (tests may give another).
        self.static = static.resolve()
        self.registry = registry
        self.host = host
        #: The port asked for (0: any free one); the one listened on once started.
        self.port = port
        self.url = ""
        self.gate = Gate(registry.api_key(), port)
        self.api = Api(fleet, registry)
        self.metrics = Metrics(fleet)
        self.notifier = Notifier(fleet.events)
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None

    # ------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Listen and serve in a thread of its own; returns once listening. Raises
        UsageError (one line) if the address cannot be listened on."""
        self._thread = threading.Thread(target=self._run, name="metasync-web", daemon=True)
        self._thread.start()
        if not self._ready.wait(START_WAIT):
            raise UsageError(f"the web server did not start within {START_WAIT:g} s")
        if self._error is not None:
            self._thread.join()
            self._thread = self._loop = None
            raise UsageError(f"cannot listen on {self.host}:{self.port} ({self._error}); pick "
                             "another with --listen 127.0.0.1:PORT") from self._error
        self.notifier.start()

    def stop(self) -> None:
        """Close the listening socket and every connection; returns when done."""
        self.notifier.stop()
        loop, stop = self._loop, self._stop
        if loop is not None and stop is not None and self._thread is not None:
            loop.call_soon_threadsafe(stop.set)
            self._thread.join(START_WAIT)
        self._thread = None
        self.api.close()

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        self._loop = loop
        try:
            runner = loop.run_until_complete(self._listen())
        except BaseException as exc:
            self._error = exc
            self._ready.set()
            loop.close()
            return
        self._ready.set()
        try:
            assert self._stop is not None
            loop.run_until_complete(self._stop.wait())
        finally:
            loop.run_until_complete(runner.cleanup())
            loop.close()

    async def _listen(self) -> web.AppRunner:
        self._stop = asyncio.Event()
        runner = web.AppRunner(self.application(), access_log=None, handle_signals=False)
        await runner.setup()
        site = web.TCPSite(runner, self.host, self.port, reuse_address=True)
        try:
            await site.start()
        except BaseException:
            await runner.cleanup()
            raise
        self.port = runner.addresses[0][1]
        self.gate.port = self.port
        shown = "[::1]" if ":" in self.host else "127.0.0.1" if self.host in (
            "", "0.0.0.0", "localhost") else self.host
        self.url = f"http://{shown}:{self.port}"
        return runner

    # ------------------------------------------------------------ the application
    def application(self) -> web.Application:
        app = web.Application(middlewares=[self._headers, self._guard, self._errors],
                              client_max_size=1024 * 1024)
        app.add_routes([web.get("/login", self.login), web.get("/metrics", self.serve_metrics),
                        *self.api.routes(),
                        web.get("/", self.page), web.get("/{name:.+}", self.page)])
        return app

    @web.middleware
    async def _headers(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        response = await handler(request)
        if not response.prepared:
            response.headers.update(SECURITY_HEADERS)
        return response

    @web.middleware
    async def _guard(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if not self.gate.host_ok(request.headers.get("Host")):
            return _refuse(request, 403, "this service answers only to 127.0.0.1, localhost or "
                                         "[::1]; open it at one of those")
        if request.path == "/login":
            return await handler(request)
        key = request.headers.get(API_KEY_HEADER)
        if key is not None:
            if not self.gate.key_ok(key):
                return _refuse(request, 401, "wrong API key; `metasync service api-key` prints it")
            return await handler(request)
        session = request.cookies.get(SESSION_COOKIE)
        if self.gate.session_csrf(session) is None:
            return _refuse(request, 401, "not signed in: send the X-API-Key header "
                                         "(`metasync service api-key` prints it), or run "
                                         "`metasync gui`")
        if request.method in UNSAFE_METHODS and not self.gate.csrf_ok(
                session, request.cookies.get(CSRF_COOKIE), request.headers.get(CSRF_HEADER)):
            return _refuse(request, 403, f"missing or wrong {CSRF_HEADER} header; reload the page")
        return await handler(request)

    @web.middleware
    async def _errors(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            why = {404: f"{request.path} is not a page or API call of this service; see "
                        "docs/api.md",
                   405: f"{request.method} is not allowed on {request.path}; see docs/api.md"}
            return _refuse(request, exc.status, why.get(exc.status, exc.reason))
        except (ConnectionResetError, asyncio.CancelledError):
            raise
        except Exception as exc:
            response = error_response(exc)
            if response.status >= 500:
                log.exception("%s %s failed", request.method, request.path)
            return response

    # ------------------------------------------------------------ handlers
    async def login(self, request: web.Request) -> web.StreamResponse:
        """``/login?token=T``: a valid one-time token opens a session (cookies set)
        and goes to the page; anything else is 401."""
        opened = self.gate.redeem(request.query.get("token", ""))
        if opened is None:
            return _refuse(request, 401, "this login link is used, expired or wrong")
        session, csrf = opened
        response = web.Response(status=303, headers={"Location": "/"})
        response.set_cookie(SESSION_COOKIE, session, httponly=True, samesite="Strict", path="/")
        # Read by the page's script and sent back as X-CSRF-Token (double submit).
        response.set_cookie(CSRF_COOKIE, csrf, samesite="Strict", path="/")
        response.headers.update(SECURITY_HEADERS)
        return response

    async def serve_metrics(self, request: web.Request) -> web.Response:
        body = await self.api.blocking(self.metrics.render)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE,
                                                "Cache-Control": "no-store"})

    async def page(self, request: web.Request) -> web.StreamResponse:
        """A file of the page (``index.html`` for ``/``, ``/static/NAME`` or ``/NAME``
        for the others); nothing outside the page's folder, no hidden file."""
        name = request.match_info.get("name", "") or "index.html"
        if name.startswith("static/"):
            name = name[len("static/"):]
        parts = name.split("/")
        if any(p in ("", ".", "..") or p.startswith(".") or "\\" in p or "\0" in p for p in parts):
            raise ApiError(404, f"{request.path} is not a page of this service")
        path = self.static.joinpath(*parts)
        if not path.is_file() or self.static not in path.resolve().parents:
            raise ApiError(404, f"{request.path} is not a page of this service")
        kind = mimetypes.guess_type(path.name)[0] or "application/octet-stream"
        return web.Response(body=path.read_bytes(), content_type=kind,
                            charset="utf-8" if kind.startswith("text/") or kind.endswith(
                                "javascript") else None,
                            headers={"Cache-Control": "no-cache"})
