"""An emulator of the part of the Box Content API (v2.0) the ``box:`` backend uses.

Written from Box's API reference and its error catalogue ("common errors"), not from
the SDK: the SDK (``boxsdk`` 10, the generated SDK) is what is under test. Served over
TLS on one port that plays Box's three hosts, as the SDK's ``BaseUrls`` name them:

- ``api.box.com`` → ``/2.0/...`` and ``/oauth2/token``, ``/oauth2/revoke``;
- ``upload.box.com/api`` → ``/api/2.0/files/content``, ``/api/2.0/files/{id}/content``
  and the chunked-upload routes ``/api/2.0/files/[{id}/]upload_sessions...``;
- ``account.box.com/api/oauth2`` → ``/api/oauth2/authorize`` (auto-approved, redirects
  to the loopback ``redirect_uri`` with ``code`` and ``state``);
- ``dl.boxcloud.com`` → ``/dl/{token}``, where ``GET /2.0/files/{id}/content`` redirects
  (``302``) to download the bytes (with ``Range``).

Faithful in what the backend relies on:

- **Items by id.** Folder ``0`` is the root. Names are unique per folder among files
  *and* folders, compared case-insensitively (case-preserving). ``DELETE`` moves a
  file to the trash: its id then answers ``404 trashed``; its name is free again.
- **Exclusive create.** ``POST /files/content`` (multipart: ``attributes`` JSON part
  before the ``file`` part, else ``400 metadata_after_file_contents``) refuses an
  existing name with ``409 item_name_in_use`` whose ``context_info.conflicts`` is
  *one object* (the existing file's mini representation: ``id``, ``etag``, ``sha1``,
  ``file_version``), as Box really answers (its docs show an array; folder creation
  answers an array). While one upload of a name is in flight, a second one of the
  same name gets ``409 name_temporarily_reserved``. ``OPTIONS /files/content``
  (preflight) runs the same name checks without a body.
- **Compare-and-swap.** ``POST /files/{id}/content`` with ``If-Match: <etag>``:
  ``412 precondition_failed`` if the file's etag differs, or if it is trashed and the
  etag matches its last one; ``404`` otherwise for a trashed file (Box's table of
  If-Match outcomes). Each new version increments the file's ``etag``/``sequence_id``.
- **Integrity.** ``Content-MD5`` (the SHA-1 of the file, hex) is checked: ``400
  bad_digest``. Every file carries its ``sha1``. Direct uploads over 50 MiB get ``413``.
- **Chunked uploads** (files of at least 20 MB): sessions with a ``part_size`` chosen
  by the server (8 MiB, larger for huge files), parts ``PUT`` with ``Digest:
  sha=<base64 SHA-1>`` and ``Content-Range`` aligned to the part size (``416``
  otherwise), a part overlapping one already uploaded ``409``, a part whose bytes do
  not match its digest ``412``; ``GET .../parts`` (offset paging), commit with the
  whole file's ``Digest`` and the part list (``201``, or ``202`` + ``Retry-After``
  while "processing" when :attr:`BoxEmulator.commit_processing` is set), abort, and
  ``410 session_expired`` after :meth:`BoxEmulator.expire_upload_sessions`.
- **Listing.** ``GET /folders/{id}/items`` with offset paging (``total_count``,
  ``offset``, ``limit``) or marker paging (``usemarker=true``, ``next_marker``), at
  most :attr:`BoxEmulator.page_size` (Box: 1,000) entries a page; ``fields=``.
- **Errors.** Box's client-error JSON (``type: error``, ``status``, ``code``,
  ``message``, ``context_info``, ``help_url``, ``request_id``); ``401`` with an empty
  body and ``WWW-Authenticate: Bearer ... error="invalid_token"``; ``429
  rate_limit_exceeded`` with ``Retry-After``; ``500``/``502``/``503`` with Box bodies.
- **Per-user rate limits** (off unless :meth:`BoxEmulator.limit_rates` is called):
  Box allows about 1,000 API calls and 240 uploads per minute and user; over the
  limit a request gets ``429 rate_limit_exceeded`` with the seconds until a slot
  frees up in ``Retry-After``.
- **Events.** Every upload, new version, trashing and folder creation is an event
  (``ITEM_UPLOAD``, ``ITEM_TRASH``, ``ITEM_CREATE``) with the item as its ``source``
  (``parent``, ``path_collection``) at an increasing stream position: ``GET
  /events?stream_position=now|N&limit=`` pages them (``next_stream_position``),
  ``OPTIONS /events`` names a realtime server (``/subscribe?channel=..``, ``ttl``,
  ``max_retries``, ``retry_timeout`` 610 s), whose ``GET ...&stream_position=N``
  (no sign-in needed) answers ``{"message": "new_change"}`` as soon as an event after
  ``N`` exists, else ``reconnect`` after :attr:`BoxEmulator.realtime_wait` seconds
  (times :attr:`BoxEmulator.realtime_scale`, which tests shrink).
- **OAuth 2** (confidential client: id + secret, authorization codes valid 30 s,
  refresh tokens rotating and single-use, as Box's) and collaborations
  (``400 user_already_collaborator`` the second time).

File contents live on disk (:class:`BlobStore`); up to :data:`KEEP_VERSIONS`
versions of a file stay downloadable by ``?version=``.
"""

from __future__ import annotations

import base64
import contextlib
import datetime
import hashlib
import itertools
import json
import math
import secrets
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import pytest

from tests.emulators.base import (
    COPY_CHUNK,
    GENERIC_FAULTS,
    QUOTA,
    SERVER_ERROR,
    THROTTLE,
    THROTTLE_NO_RETRY_AFTER,
    UNAVAILABLE,
    BlobStore,
    Emulator,
    EmulatorFaults,
    EmulatorService,
    OAuth2Server,
    OAuthError,
    Request,
    Response,
    emulator_server,
    environment_for,
    json_response,
    parse_range,
    route,
    serve_for_session,
    text_response,
)

#: Box-specific fault kinds (see :meth:`BoxEmulator.render_fault`).
BAD_GATEWAY = "502"
NAME_TEMPORARILY_RESERVED = "name_temporarily_reserved"  # 409 on a write
BOX_FAULTS = (*GENERIC_FAULTS, BAD_GATEWAY)

#: Largest file of one direct upload (Box: "up to 50MB").
MAX_DIRECT_UPLOAD = 50 * 1024 * 1024
#: Smallest file of a chunked upload session (Box: "from 20MB").
MIN_CHUNKED_UPLOAD = 20_000_000
#: Box's part size for files of up to 10,000 parts of it.
PART_SIZE = 8 * 1024 * 1024
MAX_PARTS = 10_000
SESSION_LIFETIME = 7 * 24 * 3600.0
KEEP_VERSIONS = 10
#: Box's per-user limits (requests per minute): all API calls, and uploads.
API_CALLS_PER_MINUTE = 1000
UPLOADS_PER_MINUTE = 240
AUTH_CODE_LIFETIME = 30.0

#: The test app (a confidential client, as every Box OAuth 2 app is).
TEST_CLIENT_ID = "metasynctestclientid0000000000000"
TEST_CLIENT_SECRET = "metasync-test-client-secret"
TEST_USER_ID = "31415926"
TEST_LOGIN = "tester@example.com"
HELP_URL = "https://developer.box.com/guides/api-calls/permissions-and-errors/common-errors/"


class BoxError(Exception):
    """A Box client error answer."""

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        context_info: dict[str, Any] | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(f"{status} {code}: {message}")
        self.status = status
        self.code = code
        self.message = message
        self.context_info = context_info
        self.headers = headers or {}


def error_body(status: int, code: str, message: str,
               context_info: dict[str, Any] | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"type": "error", "status": status, "code": code}
    if context_info is not None:
        body["context_info"] = context_info
    body.update(help_url=HELP_URL, message=message, request_id=secrets.token_hex(8))
    return body


def _not_found(kind: str, item_id: str) -> BoxError:
    return BoxError(404, "not_found", "Not Found", {"errors": [{
        "reason": "invalid_parameter", "name": kind,
        "message": f"Invalid value '{item_id}'. '{kind}' with value '{item_id}' not found",
    }]})


def _trashed() -> BoxError:
    return BoxError(404, "trashed", "Item is trashed")


def _bad_request(message: str, code: str = "bad_request") -> BoxError:
    return BoxError(400, code, message)


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S-00:00")


@dataclass
class Version:
    id: str
    blob: str
    size: int
    sha1: str


@dataclass
class Item:
    """A file or folder."""

    type: str  # "file" | "folder"
    id: str
    name: str
    parent: str | None  # parent folder id (None: the root)
    etag: int = 0
    trashed: bool = False
    created_at: str = field(default_factory=_now)
    modified_at: str = field(default_factory=_now)
    #: Folders: lower-cased name -> child id.
    children: dict[str, str] = field(default_factory=dict)
    #: Files: versions, oldest first; the last one is current.
    versions: list[Version] = field(default_factory=list)

    @property
    def current(self) -> Version:
        return self.versions[-1]


@dataclass
class Part:
    part_id: str
    offset: int
    size: int
    sha1: str
    blob: str

    def to_json(self) -> dict[str, Any]:
        return {"part_id": self.part_id, "offset": self.offset, "size": self.size,
                "sha1": self.sha1}


@dataclass
class UploadSession:
    id: str
    file_size: int
    part_size: int
    expires_at: float
    #: New file: (folder id, name); new version: file id.
    folder_id: str | None = None
    file_name: str | None = None
    file_id: str | None = None
    parts: dict[int, Part] = field(default_factory=dict)
    expired: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def total_parts(self) -> int:
        return max(1, math.ceil(self.file_size / self.part_size))


class _RateLimiter:
    """Sliding-window request counts per user and category."""

    def __init__(self, limits: dict[str, tuple[int, float]],
                 clock: Callable[[], float]) -> None:
        self.limits = limits
        self.clock = clock
        self._lock = threading.Lock()
        self._seen: dict[tuple[str, str], deque[float]] = {}
        self.refused = 0

    def admit(self, user: str, categories: tuple[str, ...]) -> float | None:
        """None if the request may run (and count it), else seconds to wait."""
        with self._lock:
            now = self.clock()
            wait = 0.0
            for category in categories:
                if category not in self.limits:
                    continue
                limit, window = self.limits[category]
                seen = self._seen.setdefault((user, category), deque())
                while seen and seen[0] <= now - window:
                    seen.popleft()
                if len(seen) >= limit:
                    wait = max(wait, seen[0] + window - now)
            if wait > 0:
                self.refused += 1
                return wait
            for category in categories:
                if category in self.limits:
                    self._seen.setdefault((user, category), deque()).append(now)
            return None


def _host_base(request: Request, fallback: str) -> str:
    """``https://HOST`` as the client addressed this server (a proxy in front keeps
    its own address in the URLs the emulator hands out)."""
    host = request.header("Host")
    if not host:
        return fallback
    return f"{fallback.split('://', 1)[0]}://{host}"


def _arriving(request: Request) -> Iterator[bytes]:
    """The request body as it arrives (``read1``): unlike ``Request.chunks()``, which
    reads 1 MiB blocks, this hands a handler the start of a body (an upload's
    ``attributes`` part) before the client has sent the rest, as Box sees it."""
    if (request.header("Transfer-Encoding") or "").lower() == "chunked":
        yield from request.chunks()
        return
    request._consumed = True  # the handler's drain() must not read it again
    rfile = request._handler.rfile
    length = int(request.header("Content-Length", "0") or 0)
    while length > 0:
        piece = rfile.read1(min(length, COPY_CHUNK))
        if not piece:
            raise ConnectionError("body ended early")
        length -= len(piece)
        yield piece


def _digest_header(value: str | None) -> str | None:
    """The hex SHA-1 of a ``Digest: sha=<base64>`` header, or None."""
    if not value:
        return None
    for piece in value.split(","):
        name, _, encoded = piece.strip().partition("=")
        if name.lower() in ("sha", "sha-1", "sha1"):
            try:
                return base64.b64decode(encoded + "=" * (-len(encoded) % 4)).hex()
            except ValueError:
                return None
    return None


class BoxEmulator(Emulator):
    """The Box API for one user (see the module docstring)."""

    name = "box"

    def __init__(self, folder: Path, *, page_size: int = 1000,
                 clock: Callable[[], float] = time.time) -> None:
        super().__init__()
        self.blobs = BlobStore(folder)
        self.clock = clock
        self.oauth = OAuth2Server({TEST_CLIENT_ID: TEST_CLIENT_SECRET}, TEST_USER_ID,
                                  access_lifetime=3600.0, rotate_refresh_tokens=True,
                                  clock=clock)
        #: Redirect URIs registered for the test app (empty: any loopback address).
        self.redirect_uris: set[str] = set()
        self.page_size = page_size
        #: Commits answered ``202`` (still processing) before one succeeds.
        self.commit_processing = 0
        self._lock = threading.RLock()
        self._ids = itertools.count(10_000_001)
        self.items: dict[str, Item] = {"0": Item("folder", "0", "All Files", None)}
        self.sessions: dict[str, UploadSession] = {}
        self._reserved: set[tuple[str, str]] = set()
        self._downloads: dict[str, tuple[str, str, float]] = {}
        self._markers: dict[str, int] = {}
        self.collaborations: dict[str, dict[str, Any]] = {}
        #: Uploads refused with name_temporarily_reserved (and an event for tests).
        self.reserved_refusals = 0
        self.reserved_event = threading.Event()
        #: Set whenever an upload reserves its name (tests wait for it).
        self.reservation_made = threading.Event()
        self._code_times: dict[str, float] = {}
        self.limiter: _RateLimiter | None = None
        #: Requests per route name, for tests that count round trips.
        self.calls: dict[str, int] = {}
        #: The event stream: (stream position, event), oldest first; ``_events_cond``
        #: is notified on each.
        self.events: list[tuple[int, dict[str, Any]]] = []
        self._position = itertools.count(1_000_000_001)
        self._last_position = 1_000_000_000
        self._events_cond = threading.Condition(self._lock)
        #: What ``OPTIONS /events`` advertises, and the seconds a realtime long-poll
        #: waits before ``reconnect`` (times ``realtime_scale``: tests shrink it).
        self.retry_timeout = 610
        self.max_retries = 10
        self.realtime_wait = 600.0
        self.realtime_scale = 1.0
        #: Realtime long-polls that carried an Authorization header (none should).
        self.realtime_signed = 0
        self._closed = False

    # --- plumbing ----------------------------------------------------------------
    def _next_id(self) -> str:
        return str(next(self._ids))

    def limit_rates(self, api: tuple[int, float] | None = (API_CALLS_PER_MINUTE, 60.0),
                    uploads: tuple[int, float] | None = (UPLOADS_PER_MINUTE, 60.0)) -> None:
        """Enforce per-user limits: ``(requests, window seconds)`` for all API calls
        and for uploads (None: that limit off). ``limit_rates(None, None)`` ends it."""
        limits = {k: v for k, v in (("api", api), ("upload", uploads)) if v is not None}
        self.limiter = _RateLimiter(limits, self.clock) if limits else None

    def render_fault(self, fault: str, request: Request) -> Response | None:
        retry = str(self.faults.retry_after)
        if fault == THROTTLE:
            return json_response(429, error_body(
                429, "rate_limit_exceeded", "Request rate limit exceeded, please try again later"),
                {"Retry-After": retry})
        if fault == THROTTLE_NO_RETRY_AFTER:
            return json_response(429, error_body(
                429, "rate_limit_exceeded", "Request rate limit exceeded, please try again later"))
        if fault == UNAVAILABLE:
            return json_response(503, error_body(503, "unavailable", "Unavailable"),
                                 {"Retry-After": retry})
        if fault == SERVER_ERROR:
            return json_response(500, error_body(500, "internal_server_error",
                                                 "Internal Server Error"))
        if fault == QUOTA:
            return json_response(403, error_body(
                403, "storage_limit_exceeded", "Account storage limit reached"))
        if fault == BAD_GATEWAY:
            return json_response(502, error_body(502, "bad_gateway", ""))
        if fault == NAME_TEMPORARILY_RESERVED:
            return json_response(409, error_body(
                409, "name_temporarily_reserved",
                "The item name is reserved by another processing item. Wait and then retry "
                "the request, or wait and check the parent folder to see if the name is in use."))
        return super().render_fault(fault, request)

    def dispatch(self, handler: Any) -> Response | None:
        # Answers go out as headers, then body: without TCP_NODELAY the body waits for
        # the client's delayed ACK (40 ms a request on Linux).
        with contextlib.suppress(OSError):
            handler.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return super().dispatch(handler)

    def not_found(self, request: Request) -> Response:
        return json_response(404, error_body(404, "not_found", "Not Found"))

    def _call(self, request: Request, name: str, fn: Callable[[str], Response], *,
              upload: bool = False) -> Response:
        """Run one API route: authenticate, apply rate limits, map errors. ``fn``
        gets the user id."""
        with self._lock:
            self.calls[name] = self.calls.get(name, 0) + 1
        user, reason = self.oauth.check(request.bearer())
        if user is None:
            challenge = 'Bearer realm="Service"'
            if reason != "missing":
                challenge += (', error="invalid_token", error_description="The access token '
                              'provided is invalid."')
            return Response(401, {"WWW-Authenticate": challenge})
        if self.limiter is not None:
            wait = self.limiter.admit(user, ("api", "upload") if upload else ("api",))
            if wait is not None:
                return json_response(429, error_body(
                    429, "rate_limit_exceeded",
                    "Request rate limit exceeded, please try again later"),
                    {"Retry-After": str(max(1, math.ceil(wait)))})
        try:
            return fn(user)
        except BoxError as exc:
            return json_response(exc.status, error_body(exc.status, exc.code, exc.message,
                                                        exc.context_info), exc.headers)
        except (ValueError, KeyError, TypeError) as exc:
            return json_response(400, error_body(400, "bad_request", f"Bad Request: {exc}"))

    # --- representations -------------------------------------------------------------
    def _user_mini(self) -> dict[str, Any]:
        return {"type": "user", "id": TEST_USER_ID, "name": "Test User", "login": TEST_LOGIN}

    def _folder_mini(self, item: Item) -> dict[str, Any]:
        return {"type": "folder", "id": item.id, "sequence_id": str(item.etag) if item.id != "0"
                else None, "etag": str(item.etag) if item.id != "0" else None,
                "name": item.name}

    def _file_mini(self, item: Item) -> dict[str, Any]:
        version = item.current
        return {"type": "file", "id": item.id,
                "file_version": {"type": "file_version", "id": version.id, "sha1": version.sha1},
                "sequence_id": str(item.etag), "etag": str(item.etag), "sha1": version.sha1,
                "name": item.name}

    def _mini(self, item: Item) -> dict[str, Any]:
        return self._file_mini(item) if item.type == "file" else self._folder_mini(item)

    def _path_collection(self, item: Item) -> dict[str, Any]:
        chain = []
        parent = item.parent
        while parent is not None:
            folder = self.items[parent]
            chain.append(self._folder_mini(folder))
            parent = folder.parent
        chain.reverse()
        return {"total_count": len(chain), "entries": chain}

    def _standard(self, item: Item) -> dict[str, Any]:
        doc = self._mini(item)
        parent = self._folder_mini(self.items[item.parent]) if item.parent is not None else None
        doc.update(
            description="", path_collection=self._path_collection(item),
            created_at=item.created_at, modified_at=item.modified_at,
            trashed_at=_now() if item.trashed else None, purged_at=None,
            content_created_at=item.created_at, content_modified_at=item.modified_at,
            created_by=self._user_mini(), modified_by=self._user_mini(),
            owned_by=self._user_mini(), shared_link=None, parent=parent,
            item_status="trashed" if item.trashed else "active",
        )
        if item.type == "file":
            doc["size"] = item.current.size
        else:
            doc.update(size=0, folder_upload_email=None)
        return doc

    def _fields(self, item: Item, fields: str | None) -> dict[str, Any]:
        """The item as Box answers with ``fields=`` (mini keys type/id/etag plus the
        asked fields) or without (the standard representation)."""
        if not fields:
            return self._standard(item)
        full = self._standard(item)
        doc = {"type": full["type"], "id": full["id"], "etag": full["etag"]}
        for name in fields.split(","):
            name = name.strip()
            if name in full:
                doc[name] = full[name]
        return doc

    # --- items ---------------------------------------------------------------------------
    def _folder(self, folder_id: str) -> Item:
        item = self.items.get(folder_id)
        if item is None or item.type != "folder":
            raise _not_found("folder", folder_id)
        if item.trashed:
            raise _trashed()
        return item

    def _file(self, file_id: str) -> Item:
        item = self.items.get(file_id)
        if item is None or item.type != "file":
            raise _not_found("file", file_id)
        if item.trashed:
            raise _trashed()
        return item

    @staticmethod
    def _check_name(name: Any) -> str:
        if not isinstance(name, str) or not name:
            raise _bad_request("'name' is required", "bad_request")
        if len(name) > 255:
            raise _bad_request("Item name too long", "item_name_too_long")
        if (name in (".", "..") or name != name.strip() or any(c in name for c in "/\\")
                or any(ord(c) < 32 for c in name)):
            raise _bad_request("Item name invalid", "item_name_invalid")
        return name

    def _conflict(self, folder: Item, name: str, *, as_list: bool) -> None:
        """Raise ``409 item_name_in_use`` (or ``name_temporarily_reserved``) if the
        folder has an item named ``name`` (any case). Caller holds the lock."""
        existing = folder.children.get(name.lower())
        if existing is not None:
            mini = self._mini(self.items[existing])
            raise BoxError(409, "item_name_in_use", "Item with the same name already exists",
                           {"conflicts": [mini] if as_list else mini})
        if (folder.id, name.lower()) in self._reserved:
            self.reserved_refusals += 1
            self.reserved_event.set()
            raise BoxError(409, "name_temporarily_reserved",
                           "The item name is reserved by another processing item. Wait and "
                           "then retry the request, or wait and check the parent folder to "
                           "see if the name is in use.")

    def _new_file(self, folder: Item, name: str, blob: str, size: int, sha1: str) -> Item:
        item = Item("file", self._next_id(), name, folder.id,
                    versions=[Version(self._next_id(), blob, size, sha1)])
        self.items[item.id] = item
        folder.children[name.lower()] = item.id
        self._event("ITEM_UPLOAD", item)
        return item

    def _new_version(self, item: Item, blob: str, size: int, sha1: str) -> None:
        item.versions.append(Version(self._next_id(), blob, size, sha1))
        item.etag += 1
        item.modified_at = _now()
        while len(item.versions) > KEEP_VERSIONS:
            self.blobs.delete(item.versions.pop(0).blob)
        self._event("ITEM_UPLOAD", item)

    def _event(self, event_type: str, item: Item) -> None:
        """Add an event about ``item`` to the stream and wake the realtime long-polls.
        Caller holds the lock."""
        position = next(self._position)
        self._last_position = position
        self.events.append((position, {
            "type": "event", "event_id": secrets.token_hex(16), "event_type": event_type,
            "created_by": self._user_mini(), "created_at": _now(), "recorded_at": _now(),
            "session_id": None, "source": self._standard(item), "additional_details": None,
        }))
        self._events_cond.notify_all()

    @staticmethod
    def _check_if_match(item: Item, if_match: str | None) -> None:
        """Box's If-Match table: exists + match → go on; exists + no match → 412;
        trashed + match → 412; trashed + no match → 404."""
        if if_match is None:
            if item.trashed:
                raise _trashed()
            return
        matches = if_match.strip().strip('"') == str(item.etag)
        if item.trashed and not matches:
            raise _trashed()
        if item.trashed or not matches:
            raise BoxError(412, "precondition_failed", "The resource has been modified. "
                           "Please retrieve the resource again and retry")

    # --- OAuth ---------------------------------------------------------------------------
    @route("GET", "/api/oauth2/authorize")
    def authorize(self, request: Request) -> Response:
        """The consent page: the user approves at once; Box sends the browser to the
        app's ``redirect_uri`` with ``code`` and ``state``."""
        query = request.query
        redirect = query.get("redirect_uri", "")
        allowed = redirect in self.redirect_uris if self.redirect_uris else (
            redirect.startswith("http://127.0.0.1:") or redirect.startswith("http://localhost"))
        if query.get("client_id") not in self.oauth.clients:
            return text_response(400, "Invalid client_id parameter")
        if not redirect or not allowed:
            return text_response(400, "The redirect_uri parameter is not registered for this app")
        # Box has no PKCE, and its token request carries no redirect_uri.
        params = {k: v for k, v in query.items()
                  if k not in ("code_challenge", "code_challenge_method", "redirect_uri")}
        try:
            code = self.oauth.approve(params)
            with self._lock:
                self._code_times[code] = self.clock()
        except OAuthError as exc:
            answer = {"error": exc.error, "error_description": exc.description}
        else:
            answer = {"code": code}
        if "state" in query:
            answer["state"] = query["state"]
        return Response(302, {"Location": f"{redirect}{'&' if '?' in redirect else '?'}"
                              f"{urlencode(answer)}"})

    @route("POST", "/oauth2/token")
    def token(self, request: Request) -> Response:
        form = request.form()
        try:
            if form.get("grant_type") == "authorization_code":
                self._check_code_age(form.get("code", ""))
            answer = self.oauth.token(form)
        except OAuthError as exc:
            return json_response(exc.status, {"error": exc.error,
                                              "error_description": exc.description})
        answer.update(restricted_to=[], token_type="bearer")
        return json_response(200, answer)

    def _check_code_age(self, code: str) -> None:
        """Box's authorization codes are valid for 30 seconds."""
        with self._lock:
            issued = self._code_times.pop(code, None)
        if issued is not None and self.clock() - issued > AUTH_CODE_LIFETIME:
            raise OAuthError("invalid_grant", 400, "The authorization code has expired")

    @route("POST", "/oauth2/revoke")
    def revoke(self, request: Request) -> Response:
        form = request.form()
        self.oauth.revoke(form.get("token", ""))
        return Response(200)

    # --- users -----------------------------------------------------------------------------
    @route("GET", "/2.0/users/me")
    def users_me(self, request: Request) -> Response:
        return self._call(request, "users/me", lambda user: json_response(200, {
            **self._user_mini(), "created_at": "2020-01-01T00:00:00-08:00",
            "modified_at": "2020-01-01T00:00:00-08:00", "language": "en",
            "timezone": "America/Los_Angeles", "space_amount": 10 * 1024**3,
            "space_used": 0, "max_upload_size": 250 * 1024**2, "status": "active",
            "job_title": "", "phone": "", "address": "",
            "avatar_url": "https://app.box.com/api/avatar/large/31415926",
        }))

    # --- folders ---------------------------------------------------------------------------
    @route("GET", r"/2.0/folders/(?P<id>[0-9]+)")
    def get_folder(self, request: Request) -> Response:
        def run(user: str) -> Response:
            with self._lock:
                folder = self._folder(request.params["id"])
                return json_response(200, self._fields(folder, request.query.get("fields")))

        return self._call(request, "folders/get", run)

    @route("POST", "/2.0/folders")
    def create_folder(self, request: Request) -> Response:
        arg = request.json()

        def run(user: str) -> Response:
            name = self._check_name(arg.get("name"))
            parent_id = str(arg["parent"]["id"])
            with self._lock:
                parent = self._folder(parent_id)
                self._conflict(parent, name, as_list=True)
                folder = Item("folder", self._next_id(), name, parent.id)
                self.items[folder.id] = folder
                parent.children[name.lower()] = folder.id
                self._event("ITEM_CREATE", folder)
                doc = self._standard(folder)
            doc["item_collection"] = {"total_count": 0, "entries": [], "offset": 0,
                                      "limit": 100, "order": [{"by": "type", "direction": "ASC"},
                                                              {"by": "name", "direction": "ASC"}]}
            return json_response(201, doc)

        return self._call(request, "folders/create", run)

    @route("GET", r"/2.0/folders/(?P<id>[0-9]+)/items")
    def folder_items(self, request: Request) -> Response:
        query = request.query

        def run(user: str) -> Response:
            try:
                limit = int(query.get("limit", "100"))
            except ValueError:
                raise _bad_request("Limit is not a valid number", "invalid_limit") from None
            if limit < 1:
                raise _bad_request("Limit is not a valid number", "invalid_limit")
            limit = min(limit, 1000, self.page_size)
            with self._lock:
                folder = self._folder(request.params["id"])
                children = [self.items[i] for i in folder.children.values()]
                # Box's default order: folders first, then by name.
                children.sort(key=lambda it: (it.type != "folder", it.name.lower(), it.id))
                entries = [self._fields(it, query.get("fields")) if query.get("fields")
                           else self._mini(it) for it in children]
                if query.get("usemarker", "").lower() == "true":
                    marker = query.get("marker")
                    start = 0
                    if marker:
                        if marker not in self._markers:
                            raise _bad_request("Invalid marker", "invalid_parameter")
                        start = self._markers[marker]
                    page = entries[start:start + limit]
                    doc: dict[str, Any] = {"limit": limit, "entries": page}
                    if start + limit < len(entries):
                        token = base64.urlsafe_b64encode(secrets.token_bytes(24)).decode()
                        self._markers[token] = start + limit
                        doc["next_marker"] = token
                    else:
                        doc["next_marker"] = None
                    return json_response(200, doc)
                try:
                    offset = int(query.get("offset", "0"))
                except ValueError:
                    raise _bad_request("Offset is not a valid number", "invalid_offset") from None
                if offset > 10_000:
                    raise _bad_request("Offset is too large, use marker-based paging",
                                       "invalid_offset")
                return json_response(200, {
                    "total_count": len(entries), "entries": entries[offset:offset + limit],
                    "offset": offset, "limit": limit,
                    "order": [{"by": "type", "direction": "ASC"},
                              {"by": "name", "direction": "ASC"}],
                })

        return self._call(request, "folders/items", run)

    # --- files -----------------------------------------------------------------------------
    @route("GET", r"/2.0/files/(?P<id>[0-9]+)")
    def get_file(self, request: Request) -> Response:
        def run(user: str) -> Response:
            with self._lock:
                item = self._file(request.params["id"])
                return json_response(200, self._fields(item, request.query.get("fields")))

        return self._call(request, "files/get", run)

    @route("DELETE", r"/2.0/files/(?P<id>[0-9]+)")
    def delete_file(self, request: Request) -> Response:
        def run(user: str) -> Response:
            with self._lock:
                item = self.items.get(request.params["id"])
                if item is None or item.type != "file":
                    raise _not_found("file", request.params["id"])
                self._check_if_match(item, request.header("If-Match"))
                item.trashed = True
                item.etag += 1
                parent = self.items[item.parent or "0"]
                if parent.children.get(item.name.lower()) == item.id:
                    del parent.children[item.name.lower()]
                self._event("ITEM_TRASH", item)
            return Response(204)

        return self._call(request, "files/delete", run)

    @route("OPTIONS", "/2.0/files/content")
    def preflight(self, request: Request) -> Response:
        arg = request.json() or {}

        def run(user: str) -> Response:
            name = self._check_name(arg.get("name"))
            parent_id = str((arg.get("parent") or {}).get("id", ""))
            size = arg.get("size")
            with self._lock:
                folder = self._folder(parent_id)
                self._conflict(folder, name, as_list=False)
            if isinstance(size, int) and size > 250 * 1024**3:
                raise BoxError(403, "file_size_limit_exceeded",
                               "File size exceeds the folder owner's file size limit")
            return json_response(200, {
                "upload_url": f"{_host_base(request, self.base_url)}/api/2.0/files/content",
                "upload_token": None})

        return self._call(request, "files/preflight", run)

    # --- downloads -------------------------------------------------------------------------
    @route("GET", r"/2.0/files/(?P<id>[0-9]+)/content")
    def download(self, request: Request) -> Response:
        def run(user: str) -> Response:
            with self._lock:
                item = self._file(request.params["id"])
                wanted = request.query.get("version")
                version = item.current
                if wanted:
                    matches = [v for v in item.versions if v.id == wanted]
                    if not matches:
                        raise _not_found("file_version", wanted)
                    version = matches[0]
                token = secrets.token_urlsafe(24)
                self._downloads[token] = (item.id, version.id, self.clock() + 900)
            location = f"{_host_base(request, self.base_url)}/dl/{token}"
            return Response(302, {"Location": location})

        return self._call(request, "files/content", run)

    @route("GET", r"/dl/(?P<token>[A-Za-z0-9_-]+)")
    def download_blob(self, request: Request) -> Response:
        """dl.boxcloud.com: the bytes of one version (the URL is the credential)."""
        with self._lock:
            self.calls["dl"] = self.calls.get("dl", 0) + 1
            entry = self._downloads.get(request.params["token"])
            if entry is None or entry[2] < self.clock():
                return text_response(404, "Not Found")
            item = self.items[entry[0]]
            version = next((v for v in item.versions if v.id == entry[1]), None)
            if version is None:
                return text_response(404, "Not Found")
            handle = self.blobs.open(version.blob)  # opened under the lock: one version
        size = version.size
        headers = {"Content-Type": "application/octet-stream", "Accept-Ranges": "bytes",
                   "ETag": f'"{version.sha1}"'}
        spec = request.header("Range")
        start, end, status = 0, size, 200
        if spec:
            parsed = parse_range(spec, size)
            if parsed is None:
                handle.close()
                return Response(416, {"Content-Range": f"bytes */{size}"})
            start, end = parsed
            status = 206
            headers["Content-Range"] = f"bytes {start}-{end - 1}/{size}"
        return Response(status, headers, handle=handle, start=start, end=end)

    # --- direct uploads --------------------------------------------------------------------
    def _receive_multipart(self, request: Request, on_attributes: Callable[[dict[str, Any]], None]
                           ) -> tuple[dict[str, Any], str, int, str]:
        """Parse a multipart upload as it streams in: the ``attributes`` part (JSON,
        handed to ``on_attributes`` before the file arrives) and the ``file`` part,
        streamed to a new blob. ``(attributes, blob, size, sha1)``."""
        ctype = request.header("Content-Type", "") or ""
        boundary = ""
        for piece in ctype.split(";"):
            key, _, value = piece.strip().partition("=")
            if key.lower() == "boundary":
                boundary = value.strip('"')
        if not ctype.lower().startswith("multipart/form-data") or not boundary:
            raise _bad_request("Multipart form data expected")
        delimiter = b"--" + boundary.encode()
        chunks = _arriving(request)
        buffer = b""
        attributes: dict[str, Any] | None = None

        def fill() -> bool:
            nonlocal buffer
            piece = next(chunks, b"")
            buffer += piece
            return bool(piece)

        while True:  # parts before the file's bytes
            start = buffer.find(delimiter)
            while start < 0 or buffer.find(b"\r\n\r\n", start) < 0:
                if not fill():
                    raise _bad_request("Malformed multipart body")
                start = buffer.find(delimiter)
            head_end = buffer.find(b"\r\n\r\n", start)
            headers = buffer[start + len(delimiter):head_end].decode("utf-8", "replace")
            buffer = buffer[head_end + 4:]
            disposition = next((line for line in headers.split("\r\n")
                                if line.lower().startswith("content-disposition")), "")
            part_name = ""
            for piece in disposition.split(";"):
                key, _, value = piece.strip().partition("=")
                if key.lower() == "name":
                    part_name = value.strip('"')
            if part_name == "attributes":
                end = buffer.find(b"\r\n" + delimiter)
                while end < 0:
                    if not fill():
                        raise _bad_request("Malformed multipart body")
                    end = buffer.find(b"\r\n" + delimiter)
                attributes = json.loads(buffer[:end])
                if not isinstance(attributes, dict):
                    raise _bad_request("attributes must be a JSON object")
                on_attributes(attributes)
                buffer = buffer[end + 2:]
                continue
            if part_name == "file":
                if attributes is None:
                    raise BoxError(400, "metadata_after_file_contents",
                                   "Metadata is included after file contents in a file "
                                   "upload request.")
                break
            raise _bad_request(f"Unexpected multipart part {part_name!r}")
        # The file's bytes run until "\r\n--boundary--": hold back that many bytes.
        tail = b"\r\n" + delimiter
        hasher = hashlib.sha1()
        held = [buffer]

        def body() -> Iterator[bytes]:
            pending = b"".join(held)
            for piece in chunks:
                pending += piece
                if len(pending) > len(tail) + 8:
                    out, pending = pending[:-(len(tail) + 8)], pending[-(len(tail) + 8):]
                    hasher.update(out)
                    yield out
            end = pending.rfind(tail)
            if end < 0:
                raise _bad_request("Malformed multipart body")
            hasher.update(pending[:end])
            yield pending[:end]

        blob, size = self.blobs.write(body())
        return attributes, blob, size, hasher.hexdigest()

    def _check_upload(self, request: Request, blob: str, size: int, sha1: str) -> None:
        given = request.header("Content-MD5")
        if given is not None and given.strip().lower() != sha1:
            self.blobs.delete(blob)
            raise BoxError(400, "bad_digest",
                           "The specified content-md5 did not match what we received")
        if size > MAX_DIRECT_UPLOAD:
            self.blobs.delete(blob)
            raise BoxError(413, "request_entity_too_large", "Request Entity too Large")

    def _files(self, item: Item) -> Response:
        return json_response(201, {"total_count": 1, "entries": [self._standard(item)]})

    @route("POST", "/api/2.0/files/content")
    def upload(self, request: Request) -> Response:
        def run(user: str) -> Response:
            reserved: list[tuple[str, str]] = []

            def check(attributes: dict[str, Any]) -> None:
                name = self._check_name(attributes.get("name"))
                parent_id = str((attributes.get("parent") or {}).get("id", ""))
                with self._lock:
                    folder = self._folder(parent_id)
                    self._conflict(folder, name, as_list=False)
                    self._reserved.add((folder.id, name.lower()))
                    reserved.append((folder.id, name.lower()))
                    self.reservation_made.set()

            try:
                attributes, blob, size, sha1 = self._receive_multipart(request, check)
                self._check_upload(request, blob, size, sha1)
                with self._lock:
                    self._reserved.discard(reserved[0])
                    reserved.clear()
                    folder = self._folder(str(attributes["parent"]["id"]))
                    name = str(attributes["name"])
                    try:
                        self._conflict(folder, name, as_list=False)
                    except BoxError:
                        self.blobs.delete(blob)
                        raise
                    return self._files(self._new_file(folder, name, blob, size, sha1))
            finally:
                with self._lock:
                    for key in reserved:
                        self._reserved.discard(key)

        return self._call(request, "files/upload", run, upload=True)

    @route("POST", r"/api/2.0/files/(?P<id>[0-9]+)/content")
    def upload_version(self, request: Request) -> Response:
        def run(user: str) -> Response:
            file_id = request.params["id"]

            def check(attributes: dict[str, Any]) -> None:
                with self._lock:
                    item = self.items.get(file_id)
                    if item is None or item.type != "file":
                        raise _not_found("file", file_id)
                    self._check_if_match(item, request.header("If-Match"))

            attributes, blob, size, sha1 = self._receive_multipart(request, check)
            self._check_upload(request, blob, size, sha1)
            with self._lock:
                try:
                    item = self.items.get(file_id)
                    if item is None or item.type != "file":
                        raise _not_found("file", file_id)
                    # Checked again: another version may have landed while this one streamed.
                    self._check_if_match(item, request.header("If-Match"))
                    new_name = attributes.get("name")
                    if new_name and new_name != item.name:  # a new version may rename
                        self._check_name(new_name)
                        parent = self.items[item.parent or "0"]
                        if new_name.lower() != item.name.lower():
                            self._conflict(parent, new_name, as_list=False)
                        del parent.children[item.name.lower()]
                        item.name = new_name
                        parent.children[new_name.lower()] = item.id
                except BoxError:
                    self.blobs.delete(blob)
                    raise
                self._new_version(item, blob, size, sha1)
                answer = {"total_count": 1, "entries": [self._standard(item)]}
            return json_response(200, answer)

        return self._call(request, "files/upload_version", run, upload=True)

    # --- chunked uploads ----------------------------------------------------------------
    def _session_doc(self, request: Request, session: UploadSession) -> dict[str, Any]:
        base = f"{_host_base(request, self.base_url)}/api/2.0/files/upload_sessions/{session.id}"
        expires = datetime.datetime.fromtimestamp(session.expires_at, datetime.UTC)
        return {
            "id": session.id, "type": "upload_session",
            "session_expires_at": expires.strftime("%Y-%m-%dT%H:%M:%S-00:00"),
            "part_size": session.part_size, "total_parts": session.total_parts,
            "num_parts_processed": len(session.parts),
            "session_endpoints": {
                "upload_part": base, "commit": f"{base}/commit", "abort": base,
                "list_parts": f"{base}/parts", "status": base, "log_event": f"{base}/log",
            },
        }

    def _new_session(self, file_size: Any, **target: Any) -> UploadSession:
        if not isinstance(file_size, int):
            raise _bad_request("file_size was not a valid number", "invalid_file_size")
        if file_size < MIN_CHUNKED_UPLOAD:
            raise _bad_request("file_size is below minimum file size for uploads via this API",
                               "file_size_too_small")
        part_size = PART_SIZE
        while math.ceil(file_size / part_size) > MAX_PARTS:
            part_size *= 2
        session = UploadSession(secrets.token_hex(16).upper(), file_size, part_size,
                                self.clock() + SESSION_LIFETIME, **target)
        self.sessions[session.id] = session
        return session

    @route("POST", "/api/2.0/files/upload_sessions")
    def create_session(self, request: Request) -> Response:
        arg = request.json() or {}

        def run(user: str) -> Response:
            if "folder_id" not in arg:
                raise _bad_request("No folder_id was provided", "missing_destination")
            name = self._check_name(arg.get("file_name"))
            with self._lock:
                folder = self.items.get(str(arg["folder_id"]))
                if folder is None or folder.type != "folder" or folder.trashed:
                    raise BoxError(404, "not_found", "Not Found", {"errors": [{
                        "reason": "invalid_parameter", "name": "folder_id",
                        "message": "folder_id is not valid"}]})
                self._conflict(folder, name, as_list=False)
                session = self._new_session(arg.get("file_size"), folder_id=folder.id,
                                            file_name=name)
                return json_response(201, self._session_doc(request, session))

        return self._call(request, "upload_sessions/create", run, upload=True)

    @route("POST", r"/api/2.0/files/(?P<id>[0-9]+)/upload_sessions")
    def create_version_session(self, request: Request) -> Response:
        arg = request.json() or {}

        def run(user: str) -> Response:
            with self._lock:
                item = self._file(request.params["id"])
                session = self._new_session(arg.get("file_size"), file_id=item.id)
                return json_response(201, self._session_doc(request, session))

        return self._call(request, "upload_sessions/create_version", run, upload=True)

    def _session(self, session_id: str) -> UploadSession:
        session = self.sessions.get(session_id)
        if session is None:
            raise BoxError(404, "not_found", "Not Found")
        if session.expired or session.expires_at < self.clock():
            session.expired = True
            raise BoxError(410, "session_expired", "")
        return session

    @route("GET", r"/api/2.0/files/upload_sessions/(?P<id>[0-9A-F]+)")
    def get_session(self, request: Request) -> Response:
        def run(user: str) -> Response:
            with self._lock:
                return json_response(200, self._session_doc(
                    request, self._session(request.params["id"])))

        return self._call(request, "upload_sessions/get", run)

    @route("PUT", r"/api/2.0/files/upload_sessions/(?P<id>[0-9A-F]+)")
    def upload_part(self, request: Request) -> Response:
        def run(user: str) -> Response:
            with self._lock:
                session = self._session(request.params["id"])
            spec = request.header("Content-Range") or ""
            digest = _digest_header(request.header("Digest"))
            if digest is None:
                raise _bad_request("Missing or malformed Digest header")
            try:
                unit, _, rest = spec.partition(" ")
                span, _, total = rest.partition("/")
                first, _, last = span.partition("-")
                start, end, total_size = int(first), int(last) + 1, int(total)
                if unit != "bytes":
                    raise ValueError(unit)
            except ValueError:
                raise BoxError(416, "range_not_satisfiable",
                               "The content range is not valid") from None
            size = end - start
            aligned = start % session.part_size == 0 and (
                size == session.part_size or end == session.file_size)
            if total_size != session.file_size or not aligned or end > session.file_size:
                raise BoxError(416, "range_not_satisfiable",
                               "The content range does not match a range of the session")
            hasher = hashlib.sha1()
            blob, received = self.blobs.write(request.chunks(), (hasher,))
            if received != size:
                self.blobs.delete(blob)
                raise _bad_request("Content-Length does not match Content-Range")
            if hasher.hexdigest() != digest:
                self.blobs.delete(blob)
                raise BoxError(412, "precondition_failed",
                               "The digest of the part does not match its contents")
            with session.lock, self._lock:
                for part in session.parts.values():
                    if part.offset < end and start < part.offset + part.size:
                        self.blobs.delete(blob)
                        raise BoxError(409, "conflict",
                                       "The part overlaps a part already uploaded")
                part = Part(secrets.token_hex(4).upper(), start, size, digest, blob)
                session.parts[start] = part
            return json_response(200, {"part": part.to_json()})

        return self._call(request, "upload_sessions/part", run, upload=True)

    @route("GET", r"/api/2.0/files/upload_sessions/(?P<id>[0-9A-F]+)/parts")
    def list_parts(self, request: Request) -> Response:
        def run(user: str) -> Response:
            offset = int(request.query.get("offset", "0"))
            limit = min(int(request.query.get("limit", "100")), 1000)
            with self._lock:
                session = self._session(request.params["id"])
                parts = [session.parts[k].to_json() for k in sorted(session.parts)]
            return json_response(200, {
                "total_count": len(parts), "limit": limit, "offset": offset,
                "order": [{"by": "offset", "direction": "ASC"}],
                "entries": parts[offset:offset + limit]})

        return self._call(request, "upload_sessions/parts", run)

    @route("DELETE", r"/api/2.0/files/upload_sessions/(?P<id>[0-9A-F]+)")
    def abort_session(self, request: Request) -> Response:
        def run(user: str) -> Response:
            with self._lock:
                session = self._session(request.params["id"])
                del self.sessions[session.id]
            for part in session.parts.values():
                self.blobs.delete(part.blob)
            return Response(204)

        return self._call(request, "upload_sessions/abort", run)

    @route("POST", r"/api/2.0/files/upload_sessions/(?P<id>[0-9A-F]+)/commit")
    def commit_session(self, request: Request) -> Response:
        arg = request.json() or {}

        def run(user: str) -> Response:
            digest = _digest_header(request.header("Digest"))
            if digest is None:
                raise _bad_request("Missing or malformed Digest header")
            with self._lock:
                session = self._session(request.params["id"])
                if self.commit_processing > 0:
                    self.commit_processing -= 1
                    return Response(202, {"Retry-After": str(self.faults.retry_after)})
            with session.lock:
                listed = [(str(p["part_id"]), int(p["offset"]), int(p["size"]))
                          for p in arg.get("parts") or []]
                have = [(p.part_id, p.offset, p.size)
                        for p in sorted(session.parts.values(), key=lambda p: p.offset)]
                covered = sum(p.size for p in session.parts.values())
                if sorted(listed, key=lambda p: p[1]) != have or covered != session.file_size:
                    raise _bad_request("The parts do not make up the whole file",
                                       "invalid_request_parameters")
                blob = secrets.token_hex(12)
                hasher = hashlib.sha1()
                with open(self.blobs.path(blob), "wb") as out:
                    for part in sorted(session.parts.values(), key=lambda p: p.offset):
                        with self.blobs.open(part.blob) as piece:
                            for data in iter(lambda piece=piece: piece.read(1 << 20), b""):
                                out.write(data)
                                hasher.update(data)
                if hasher.hexdigest() != digest:
                    self.blobs.delete(blob)
                    raise BoxError(422, "bad_digest",
                                   "The specified digest did not match what we received")
                with self._lock:
                    try:
                        if session.file_id is not None:
                            item = self.items.get(session.file_id)
                            if item is None:
                                raise _not_found("file", session.file_id)
                            self._check_if_match(item, request.header("If-Match"))
                            self._new_version(item, blob, session.file_size, digest)
                            status = 201
                        else:
                            folder = self._folder(str(session.folder_id))
                            self._conflict(folder, str(session.file_name), as_list=False)
                            item = self._new_file(folder, str(session.file_name), blob,
                                                  session.file_size, digest)
                            status = 201
                    except BoxError:
                        self.blobs.delete(blob)
                        raise
                    del self.sessions[session.id]
                    doc = {"total_count": 1, "entries": [self._standard(item)]}
                for part in session.parts.values():
                    self.blobs.delete(part.blob)
            return json_response(status, doc)

        return self._call(request, "upload_sessions/commit", run, upload=True)

    # --- collaborations -------------------------------------------------------------------
    @route("POST", "/2.0/collaborations")
    def create_collaboration(self, request: Request) -> Response:
        arg = request.json() or {}

        def run(user: str) -> Response:
            item_ref = arg.get("item") or {}
            who = arg.get("accessible_by") or {}
            role = arg.get("role")
            if item_ref.get("type") != "folder":
                raise _bad_request("Item type must be specified and set to 'folder'",
                                   "invalid_collaboration_item")
            login = str(who.get("login") or "")
            if who.get("type") != "user" or "@" not in login:
                raise _bad_request("Invalid input parameters in request",
                                   "invalid_request_parameters")
            if role not in ("editor", "viewer", "previewer", "uploader", "previewer uploader",
                            "viewer uploader", "co-owner"):
                raise _bad_request("Invalid role", "invalid_request_parameters")
            with self._lock:
                folder = self._folder(str(item_ref.get("id")))
                if folder.id == "0":
                    raise _bad_request("Root folder cannot be collaborated",
                                       "collaborations_not_available_on_root_folder")
                key = f"{folder.id}:{login.lower()}"
                if key in self.collaborations:
                    raise _bad_request("User is already a collaborator",
                                       "user_already_collaborator")
                collab = {
                    "type": "collaboration", "id": self._next_id(),
                    "item": self._folder_mini(folder),
                    "accessible_by": {"type": "user", "id": self._next_id(), "name": login,
                                      "login": login},
                    "invite_email": None, "role": role, "expires_at": None,
                    "is_access_only": False, "status": "pending",
                    "acknowledged_at": None, "created_by": self._user_mini(),
                    "created_at": _now(), "modified_at": _now(),
                    "acceptance_requirements_status": {
                        "terms_of_service_requirement": {"is_accepted": None,
                                                         "terms_of_service": None},
                        "strong_password_requirement": {
                            "enterprise_has_strong_password_required_for_external_users": False,
                            "user_has_strong_password": None},
                        "two_factor_authentication_requirement": {
                            "enterprise_has_two_factor_auth_enabled": False,
                            "user_has_two_factor_authentication_enabled": None},
                    },
                }
                self.collaborations[key] = collab
            return json_response(201, collab)

        return self._call(request, "collaborations/create", run)

    # --- events ------------------------------------------------------------------------------
    @route("GET", "/2.0/events")
    def get_events(self, request: Request) -> Response:
        """The user's event stream from ``stream_position`` (``now``: none, only the
        position; ``0`` or none: from the start), at most ``limit`` (500) events."""
        def run(user: str) -> Response:
            position = request.query.get("stream_position", "0") or "0"
            limit = max(1, min(int(request.query.get("limit", "100")), 500))
            with self._lock:
                if position == "now":
                    return json_response(200, {"chunk_size": 0, "entries": [],
                                               "next_stream_position": self._last_position})
                after = int(position)
                chunk = [event for number, event in self.events if number > after][:limit]
                numbers = [number for number, _ in self.events if number > after][:limit]
            following = numbers[-1] if numbers else max(after, 0)
            return json_response(200, {"chunk_size": len(chunk), "entries": chunk,
                                       "next_stream_position": following})

        return self._call(request, "events", run)

    @route("OPTIONS", "/2.0/events")
    def events_long_polling(self, request: Request) -> Response:
        """A realtime server for long-polls of the event stream."""
        def run(user: str) -> Response:
            base = _host_base(request, self.base_url)
            url = f"{base}/subscribe?channel={secrets.token_hex(10)}&stream_type=all"
            return json_response(200, {"chunk_size": 1, "entries": [{
                "type": "realtime_server", "url": url, "ttl": "10",
                "max_retries": str(self.max_retries), "retry_timeout": self.retry_timeout}]})

        return self._call(request, "events/options", run)

    @route("GET", "/subscribe")
    def realtime(self, request: Request) -> Response:
        """The realtime server: ``new_change`` once an event after ``stream_position``
        exists, else ``reconnect`` after :attr:`realtime_wait` (scaled). No sign-in."""
        with self._lock:
            self.calls["events/realtime"] = self.calls.get("events/realtime", 0) + 1
            if request.header("Authorization"):
                self.realtime_signed += 1
        try:
            after = int(request.query.get("stream_position", "0"))
        except ValueError:
            return json_response(400, error_body(400, "bad_request", "bad stream_position"))
        with self._lock:
            changed = self._events_cond.wait_for(
                lambda: self._closed or self._last_position > after,
                self.realtime_wait * self.realtime_scale)
            changed = changed and self._last_position > after
        return json_response(200, {"message": "new_change" if changed else "reconnect"})

    # --- test helpers -----------------------------------------------------------------------
    def make_folder(self, path: str) -> str:
        """Create ``path`` (and its parents) as a user would in the Box web app; return
        the folder's id."""
        with self._lock:
            current = self.items["0"]
            for name in [p for p in path.split("/") if p]:
                child = current.children.get(name.lower())
                if child is None:
                    folder = Item("folder", self._next_id(), name, current.id)
                    self.items[folder.id] = folder
                    current.children[name.lower()] = folder.id
                    self._event("ITEM_CREATE", folder)
                    child = folder.id
                current = self.items[child]
                if current.type != "folder":
                    raise ValueError(f"{path}: {name} is a file")
            return current.id

    def lookup(self, path: str) -> Item | None:
        """The live item at ``path`` (``/a/b``), or None."""
        with self._lock:
            current = self.items["0"]
            for name in [p for p in path.split("/") if p]:
                child = current.children.get(name.lower())
                if child is None:
                    return None
                current = self.items[child]
            return current

    def file_bytes(self, path: str) -> bytes:
        item = self.lookup(path)
        assert item is not None and item.type == "file", path
        return self.blobs.path(item.current.blob).read_bytes()

    def expire_upload_sessions(self) -> None:
        with self._lock:
            for session in self.sessions.values():
                session.expired = True

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._events_cond.notify_all()
        self.blobs.close()


# --- fixtures --------------------------------------------------------------------------------


@dataclass
class BoxService(EmulatorService):
    """A running Box emulator plus what clients need to reach it."""

    emulator: BoxEmulator

    def env(self) -> dict[str, str]:
        return {
            **environment_for("box", self.server),
            "METASYNC_BOX_APP_KEY": TEST_CLIENT_ID,
            "METASYNC_BOX_APP_SECRET": TEST_CLIENT_SECRET,
        }

    def sign_in(self, account: str = "default") -> None:
        """Store a grant for ``account`` in the test token store (as `metasync auth
        box` would after the user approved)."""
        from metasync.backends.cloud import Grant, grant_lock, token_store

        code = self.emulator.oauth.approve({"client_id": TEST_CLIENT_ID, "response_type": "code"})
        answer = self.emulator.oauth.token(
            {"grant_type": "authorization_code", "code": code, "client_id": TEST_CLIENT_ID,
             "client_secret": TEST_CLIENT_SECRET})
        grant = Grant(
            "box", account, TEST_CLIENT_ID, answer["refresh_token"], answer["access_token"],
            time.time() + answer["expires_in"], TEST_CLIENT_SECRET,
            {"user_id": TEST_USER_ID, "email": TEST_LOGIN},
        )
        with grant_lock("box", account):
            token_store().save(grant)

    def faults_via_proxy(self) -> EmulatorFaults:
        return EmulatorFaults(
            self.server,
            (THROTTLE, UNAVAILABLE, THROTTLE_NO_RETRY_AFTER, SERVER_ERROR, BAD_GATEWAY),
        )


@contextlib.contextmanager
def running_box() -> Iterator[BoxService]:
    with emulator_server("box", BoxEmulator) as (server, emulator):
        yield BoxService(server, emulator)


@pytest.fixture(scope="session")
def box_service() -> Iterator[BoxService]:
    """A Box emulator for the whole session, aimed at by the process environment
    (child processes inherit it), with the default account signed in."""
    with running_box() as service:
        yield from serve_for_session(service)
