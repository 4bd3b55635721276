"""The REST API's handlers (docs/api.md): JSON in, JSON out, one route each.

Handlers run on the web server's event loop and never block it: whatever touches
a repository or the fleet runs in a worker thread (:meth:`Api.blocking`). A file
download is read by a thread of its own (a repository's SQLite handles stay in
the thread that opened them) and written to the response piece by piece, so a
large file never sits whole in memory. Errors become ``{"error": "one line"}``
with their status in :mod:`metasync.app.web`'s middleware.
"""

from __future__ import annotations

import asyncio
import json
import os
import urllib.parse
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from aiohttp import web

import metasync
from metasync.app import folder_ops
from metasync.app.folder_ops import ApiError, Download, parse_path
from metasync.errors import MetasyncError

if TYPE_CHECKING:
    from metasync.app.fleet import Fleet, FolderRunner
    from metasync.app.registry import Registry

T = TypeVar("T")
#: Activity entries a request may ask for at most.
MAX_ACTIVITY = 500


def json_response(data: object, status: int = 200) -> web.Response:
    return web.Response(text=json.dumps(data), status=status, content_type="application/json",
                        headers={"Cache-Control": "no-store"})


async def _body(request: web.Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ApiError(400, "the request body is not JSON; send a JSON object") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return body


def _int_query(request: web.Request, name: str, default: int, low: int, high: int) -> int:
    text = request.query.get(name)
    if text is None:
        return default
    try:
        value = int(text)
    except ValueError:
        raise ApiError(400, f"{name}={text!r} is not a whole number") from None
    if not low <= value <= high:
        raise ApiError(400, f"{name} must be between {low} and {high}")
    return value


class Api:
    """The handlers over one fleet and its registry."""

    def __init__(self, fleet: Fleet, registry: Registry) -> None:
        self.fleet = fleet
        self.registry = registry
        self.pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="metasync-api")

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)

    async def blocking(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` in a worker thread, awaited."""
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    def routes(self) -> list[web.RouteDef]:
        f = "/rest/folders/{id}"
        return [
            web.get("/rest/folders", self.folders),
            web.post("/rest/folders", self.add_folder),
            web.get(f, self.folder),
            web.delete(f, self.remove_folder),
            web.post(f + "/pause", self.pause),
            web.post(f + "/resume", self.resume),
            web.post(f + "/sync", self.sync),
            web.get(f + "/status", self.status),
            web.get(f + "/activity", self.activity),
            web.get(f + "/tree", self.tree),
            web.get(f + "/file", self.file),
            web.post(f + "/restore", self.restore),
            web.get(f + "/conflicts", self.conflicts),
            web.post(f + "/conflicts/resolve", self.resolve),
            web.get("/rest/events", self.events),
            web.get("/rest/system", self.system),
        ]

    def _runner(self, request: web.Request) -> FolderRunner:
        folder_id = request.match_info["id"]
        try:
            return self.fleet.get(folder_id)
        except KeyError:
            raise ApiError(404, f"no folder has id {folder_id!r}; GET /rest/folders lists them") from None

    # ------------------------------------------------------------ folders
    async def folders(self, request: web.Request) -> web.Response:
        runners = self.fleet.runners()
        return json_response(await self.blocking(lambda: [r.snapshot() for r in runners]))

    async def folder(self, request: web.Request) -> web.Response:
        runner = self._runner(request)
        return json_response(await self.blocking(runner.snapshot))

    async def add_folder(self, request: web.Request) -> web.Response:
        body = await _body(request)
        path = body.get("path")
        if not isinstance(path, str) or not path or "\0" in path:
            raise ApiError(400, "give the folder as {\"path\": \"/absolute/path\"}")
        folder = Path(path).expanduser()
        if not folder.is_absolute():
            raise ApiError(400, f"{path!r} is not absolute; give the folder's full path")

        def add() -> dict[str, Any]:
            return self.fleet.add(folder).snapshot()

        return json_response(await self.blocking(add), status=201)

    async def remove_folder(self, request: web.Request) -> web.Response:
        runner = self._runner(request)

        def remove() -> None:
            try:
                self.fleet.remove(runner.id)
            except KeyError:
                raise ApiError(404, f"folder {runner.id} was removed already") from None

        await self.blocking(remove)
        return json_response({"removed": runner.id, "path": str(runner.path)})

    async def _act(self, request: web.Request, action: str) -> web.Response:
        runner = self._runner(request)

        def act() -> dict[str, Any]:
            getattr(runner, action)()
            return runner.snapshot()

        return json_response(await self.blocking(act))

    async def pause(self, request: web.Request) -> web.Response:
        return await self._act(request, "pause")

    async def resume(self, request: web.Request) -> web.Response:
        return await self._act(request, "resume")

    async def sync(self, request: web.Request) -> web.Response:
        return await self._act(request, "sync_now")

    async def status(self, request: web.Request) -> web.Response:
        runner = self._runner(request)
        return json_response(await self.blocking(folder_ops.status, runner.path))

    # ------------------------------------------------------------ history and files
    async def activity(self, request: web.Request) -> web.Response:
        runner = self._runner(request)
        limit = _int_query(request, "limit", 20, 1, MAX_ACTIVITY)
        return json_response(await self.blocking(folder_ops.activity, runner.path, limit))

    async def tree(self, request: web.Request) -> web.Response:
        runner = self._runner(request)
        folder = parse_path(request.query.get("path"), root_ok=True)
        version = request.query.get("version")
        return json_response(await self.blocking(folder_ops.tree, runner.path, version, folder))

    async def file(self, request: web.Request) -> web.StreamResponse:
        runner = self._runner(request)
        path = parse_path(request.query.get("path"))
        version = request.query.get("version")
        # One thread for the whole download: the repository stays in the thread that opened it.
        reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="metasync-download")
        loop = asyncio.get_running_loop()
        try:
            if version:
                download: Download = await loop.run_in_executor(
                    reader, folder_ops.version_file, runner.path, path, version)
            else:
                download = await loop.run_in_executor(reader, folder_ops.disk_file, runner.path, path)
            try:
                # The first piece before the headers: a backend that fails at once
                # still gets a clean error answer.
                first = await loop.run_in_executor(reader, next, download.pieces, None)
                response = web.StreamResponse(headers={
                    "Content-Type": "application/octet-stream",
                    "Content-Disposition": "attachment; filename*=UTF-8''"
                                           # bytes: a name that is not UTF-8 still quotes
                                           + urllib.parse.quote(os.fsencode(download.name), safe=""),
                    "Content-Length": str(download.size),
                    "Cache-Control": "no-store",
                })
                await response.prepare(request)
                piece = first
                while piece is not None:
                    await response.write(piece)
                    piece = await loop.run_in_executor(reader, next, download.pieces, None)
                await response.write_eof()
                return response
            finally:
                await loop.run_in_executor(reader, download.close)
        finally:
            reader.shutdown(wait=False)

    async def restore(self, request: web.Request) -> web.Response:
        runner = self._runner(request)
        body = await _body(request)
        path = parse_path(body.get("path"))
        restored = await self.blocking(folder_ops.restore, runner.path, path, body.get("version"))
        await self.blocking(runner.sync_now)
        return json_response({"restored": restored})

    # ------------------------------------------------------------ conflicts
    async def conflicts(self, request: web.Request) -> web.Response:
        runner = self._runner(request)
        return json_response(await self.blocking(folder_ops.conflicts, runner.path))

    async def resolve(self, request: web.Request) -> web.Response:
        runner = self._runner(request)
        body = await _body(request)
        left = await self.blocking(folder_ops.resolve, runner.path, body.get("copy"),
                                   body.get("keep"))
        await self.blocking(runner.sync_now)
        return json_response(left)

    # ------------------------------------------------------------ events and system
    async def events(self, request: web.Request) -> web.Response:
        since = _int_query(request, "since", 0, 0, 2**62)
        last = self.fleet.events.last
        if since > last:
            since = 0  # ids of an earlier run of the service: this run's are all new
        events = self.fleet.events.since(since)
        return json_response({
            "last": events[-1].id if events else since,
            "events": [{"id": e.id, "time": e.time, "folder": e.folder, "kind": e.kind,
                        "message": e.message} for e in events],
        })

    async def system(self, request: web.Request) -> web.Response:
        return json_response({"version": metasync.__version__, "folders": len(self.fleet.runners()),
                              "config_dir": str(self.registry.config_dir)})


def error_response(exc: BaseException) -> web.Response:
    """The JSON answer of a failed call (one line, its status)."""
    status = folder_ops.error_status(exc)
    if isinstance(exc, (ApiError, MetasyncError)):
        message = str(exc)
    else:
        message = (f"unexpected {type(exc).__name__}: {exc}; see the service's log and "
                   "report it")
    return json_response({"error": " ".join(message.split())}, status=status)
