"""An emulator of the part of Microsoft Graph v1.0 (OneDrive) and of the Microsoft
identity platform (Entra ID, OAuth 2.0 v2.0 endpoints) the ``onedrive:`` backend and
MSAL use.

Written from Microsoft's documentation (Graph API reference for driveItem, upload
sessions, errors and throttling; the identity platform's OpenID discovery,
authorization-code, device-code and refresh flows), not from the backend: the
backend and MSAL are what is under test. One TLS port serves both hosts
(``graph.microsoft.com`` and ``login.microsoftonline.com``); absolute URLs it hands
out (download URLs, upload URLs, next-page links, OAuth endpoints) are built from the
request's ``Host``, so a client behind a fault proxy keeps going through it.

Faithful in what the backend relies on:

- **Addressing**: ``/v1.0/me/drive/root``, ``/root:/PATH:`` (percent-encoded, case-
  insensitive, case-preserving), ``/items/{id}``, with ``/children``, ``/content``,
  ``/createUploadSession``, ``/invite``; ``GET /v1.0/me/drive``.
- **Children**: ``$top`` and ``$select``; pages of at most :attr:`page_size` entries
  with ``@odata.nextLink`` (a ``$skiptoken``); ``POST children`` creates a folder with
  ``@microsoft.graph.conflictBehavior`` (``fail`` → 409 ``nameAlreadyExists``).
- **Simple upload** (``PUT content``, up to 250 MB): ``?@microsoft.graph.
  conflictBehavior=fail|replace|rename`` (default ``replace``), ``If-Match`` /
  ``If-None-Match`` on the eTag or cTag (412 ``resourceModified``), 201 for a new file
  and 200 for a replaced one; missing parent folders are created (unless
  :attr:`auto_create_parents` is off, then 404).
- **Upload sessions**: ``createUploadSession`` (``item.@microsoft.graph.
  conflictBehavior``, default ``fail``; ``If-Match``), fragments ``PUT`` to the upload
  URL *without* ``Authorization`` (401 if sent) with ``Content-Range: bytes a-b/total``:
  sequential (416 ``invalidRange`` on overlap or out of order), lengths multiples of
  320 KiB except the last (400), at most 60 MiB (413), the same total each time (400
  ``fragmentLengthMismatch``); 202 with ``nextExpectedRanges``, the last one commits
  (201/200 with the driveItem, or 409 ``nameAlreadyExists`` / 412, the session then kept
  with no expected range); ``GET`` the upload URL for its status, ``DELETE`` to cancel.
  A fragment cut short leaves the session as it was.
- **Downloads**: ``@microsoft.graph.downloadUrl`` (pre-authenticated, bound to the
  version it was issued for) with ``Range`` (206, 416); ``GET content`` answers 302 to
  it.
- **Deletes**: ``DELETE`` with ``If-Match`` (412), 204; folders with their contents.
- **Delta**: ``GET .../delta`` on the root, a path or an item id (a folder): without
  ``token`` the folder's whole hierarchy, with ``token=latest`` nothing, with a token
  of an earlier ``@odata.deltaLink`` the items below the folder changed since (their
  current driveItem, or ``id``/``name``/``parentReference`` with the ``deleted``
  facet), without ``parentReference.path`` (as Graph omits it in delta); pages of at
  most :attr:`page_size` items with ``@odata.nextLink``, the last with
  ``@odata.deltaLink``; a malformed token is 400, an unknown one 410
  ``resyncRequired``. A change journal of the drive keeps what each change was below.
- **eTag/cTag**: SharePoint-style quoted tags that change with every new content.
- **Hashes**: ``file.hashes.quickXorHash`` (the backend's :class:`QuickXorHash`, itself
  checked against published test vectors in the backend tests).
- **Names**: OneDrive's refusals (``"*:<>?/\\|``, a leading ``~`` or space, a trailing
  ``.`` or space, ``.lock``, ``desktop.ini``, ``CON``... ``LPT9``, ``_vti_``): 400
  ``invalidRequest`` / ``invalidPath``.
- **Errors**: ``{"error": {"code", "message", "innerError": {"code"?, "date",
  "request-id", "client-request-id"}}}``; 401 ``InvalidAuthenticationToken`` with
  ``WWW-Authenticate``; throttling as 429 ``activityLimitReached`` (with and without
  ``Retry-After``) and 503 ``serviceNotAvailable`` (with and without), 500
  ``generalException``, injectable through :attr:`faults`.
- **Sign-in**: ``/{tenant}/v2.0/.well-known/openid-configuration``,
  ``/{tenant}/oauth2/v2.0/authorize`` (auto-approved; ``response_mode=form_post``
  answers an auto-submitting form, as Entra does), ``/devicecode`` + the
  ``/devicelogin`` page where the user enters the code, ``/token`` (authorization
  code with PKCE and nonce, device code with ``authorization_pending``, refresh with
  rotating refresh tokens), ID tokens and ``client_info`` as MSAL expects; errors as
  ``{"error", "error_description": "AADSTS...", "error_codes"}``.
"""

from __future__ import annotations

import base64
import contextlib
import datetime
import hashlib
import html
import itertools
import json
import re
import secrets
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote, urlencode

import pytest

from metasync.backends.onedrive import QuickXorHash
from tests.emulators.base import (
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

#: OneDrive-specific fault kind: 503 without a Retry-After header.
UNAVAILABLE_NO_RETRY_AFTER = "503-no-retry-after"
ONEDRIVE_FAULTS = (THROTTLE, THROTTLE_NO_RETRY_AFTER, UNAVAILABLE, UNAVAILABLE_NO_RETRY_AFTER,
                   SERVER_ERROR)

#: The app id of the test app (a public client, as `metasync auth onedrive` uses).
TEST_APP_ID = "6f1c2d3e-4b5a-4c6d-8e9f-0a1b2c3d4e5f"
TEST_EMAIL = "tester@outlook.example"
TEST_NAME = "Test User"
#: Microsoft's tenant id of personal accounts, and the test user's object id.
CONSUMERS_TENANT_ID = "9188040d-6c67-4c5b-b112-36a304b66dad"
TEST_OID = "00000000-0000-0000-4d3a-5e6f7a8b9c0d"
DRIVE_ID = "4d3a5e6f7a8b9c0d"
FRAGMENT_UNIT = 320 * 1024
MAX_FRAGMENT = 60 * 1024 * 1024
MAX_SIMPLE_UPLOAD = 250 * 1000 * 1000
KEEP_VERSIONS = 10
_INVALID_CHARS = set('"*:<>?/\\|')
_RESERVED = {".lock", "desktop.ini", "con", "prn", "aux", "nul",
             *(f"com{i}" for i in range(10)), *(f"lpt{i}" for i in range(10))}


class GraphError(Exception):
    """A Graph error answer: status, code, message, optional inner code."""

    def __init__(self, status: int, code: str, message: str, inner: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.inner = inner
        self.headers = headers or {}


def graph_error_body(code: str, message: str, inner: str | None = None) -> dict[str, Any]:
    inner_error: dict[str, Any] = {}
    if inner:
        inner_error["code"] = inner
    inner_error.update({
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S"),
        "request-id": str(uuid.uuid4()),
        "client-request-id": str(uuid.uuid4()),
    })
    return {"error": {"code": code, "message": message, "innerError": inner_error}}


def not_found() -> GraphError:
    return GraphError(404, "itemNotFound", "The resource could not be found.")


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


def _b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def check_name(name: str) -> None:
    """Raise the 400 OneDrive answers for a name it does not allow."""
    bad = (
        not name
        or any(c in _INVALID_CHARS or ord(c) < 32 for c in name)
        or name[0] in " ~"
        or name[-1] in " ."
        or name.lower() in _RESERVED
        or "_vti_" in name.lower()
    )
    if bad:
        raise GraphError(400, "invalidRequest", "The provided name contains invalid characters.",
                         "invalidPath")


@dataclass
class Item:
    """A file or folder of the drive."""

    id: str
    name: str
    parent: str | None
    is_folder: bool
    #: Lower-cased child name -> child id (folders).
    children: dict[str, str] = field(default_factory=dict)
    size: int = 0
    blob: str = ""
    quick_xor: str = ""
    version: int = 1
    guid: str = field(default_factory=lambda: str(uuid.uuid4()).upper())
    created: str = field(default_factory=_now)
    modified: str = field(default_factory=_now)
    #: Earlier contents still downloadable through their URLs: blobs, oldest first.
    history: list[str] = field(default_factory=list)

    @property
    def etag(self) -> str:
        return f'"{{{self.guid}}},{self.version}"'

    @property
    def ctag(self) -> str:
        return f'"c:{{{self.guid}}},{self.version}"'


@dataclass
class UploadSession:
    #: Where it commits: a drive path (new or replaced file) or an item id (update).
    path: str | None
    item_id: str | None
    conflict: str
    if_match: str | None
    blob: str
    received: int = 0
    total: int | None = None
    expires: str = ""
    #: Held while a fragment of this session is written (fragments never interleave).
    lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass
class DeviceGrant:
    user_code: str
    client_id: str
    scope: str
    expires_at: float
    verifier: str
    code: str | None = None  # set once the user approved


class OneDriveEmulator(Emulator):
    """Graph's drive API for one user, plus the identity platform (module docstring)."""

    name = "onedrive"

    def __init__(self, folder: Path, *, page_size: int = 200) -> None:
        super().__init__()
        self.blobs = BlobStore(folder)
        self.oauth = OAuth2Server({TEST_APP_ID: None}, TEST_OID, access_lifetime=3600.0,
                                  rotate_refresh_tokens=True)
        self.page_size = page_size
        #: Create missing parent folders of a path upload (False: answer 404).
        self.auto_create_parents = True
        #: Device-flow polling interval handed to clients (seconds).
        self.device_interval = 1
        self._lock = threading.RLock()
        self._ids = itertools.count(101)
        self.root = Item(self._new_id(), "root", None, True)
        self.items: dict[str, Item] = {self.root.id: self.root}
        self._sessions: dict[str, UploadSession] = {}
        self._cursors: dict[str, tuple[list[dict[str, Any]], str]] = {}
        #: Download URL token (the blob id) -> (blob, size) of a file version.
        self._downloads: dict[str, tuple[str, int]] = {}
        self._nonces: dict[str, str | None] = {}
        self._device: dict[str, DeviceGrant] = {}
        #: Invitations: item id -> e-mails invited to write.
        self.members: dict[str, set[str]] = {}
        #: Counters by route name, for tests that count round trips.
        self.calls: dict[str, int] = {}
        #: (start, length, total) of every fragment accepted, for alignment tests.
        self.fragments: list[tuple[int, int, int]] = []
        #: The change journal: (number, item id, the item's ancestors' ids then, and
        #: what a deleted item's delta entry says), oldest first.
        self.journal: list[tuple[int, str, tuple[str, ...], dict[str, Any] | None]] = []
        self._seq = 0
        #: Delta pages still to hand out: skip token -> (items, folder id, position).
        self._delta_pages: dict[str, tuple[list[dict[str, Any]], str, int]] = {}

    def _new_id(self) -> str:
        return f"{DRIVE_ID.upper()}!{next(self._ids)}"

    # --- faults and errors ---------------------------------------------------------
    def render_fault(self, fault: str, request: Request) -> Response | None:
        retry = {"Retry-After": str(self.faults.retry_after)}
        oauth = "/oauth2/" in request.path or "/.well-known/" in request.path
        if fault in (THROTTLE, THROTTLE_NO_RETRY_AFTER):
            headers = retry if fault == THROTTLE else {}
            if oauth:
                return json_response(429, self._oauth_body("temporarily_unavailable", 50196,
                                                           "The server is busy."), headers)
            return json_response(429, graph_error_body(
                "activityLimitReached", "The request has been throttled", "throttledRequest"),
                headers)
        if fault in (UNAVAILABLE, UNAVAILABLE_NO_RETRY_AFTER):
            headers = retry if fault == UNAVAILABLE else {}
            return json_response(503, graph_error_body(
                "serviceNotAvailable", "Service unavailable. Try again later."), headers)
        if fault == QUOTA:
            return json_response(507, graph_error_body(
                "quotaLimitReached", "Insufficient Storage"))
        if fault == SERVER_ERROR:
            return json_response(500, graph_error_body(
                "generalException", "An unspecified error has occurred."))
        return super().render_fault(fault, request)

    def _error(self, exc: GraphError) -> Response:
        return json_response(exc.status, graph_error_body(exc.code, exc.message, exc.inner),
                             exc.headers)

    def _count(self, name: str) -> None:
        with self._lock:
            self.calls[name] = self.calls.get(name, 0) + 1

    def _graph(self, request: Request, name: str, fn: Any, *, auth: bool = True) -> Response:
        """Run one Graph route: authenticate, map errors."""
        self._count(name)
        if auth:
            account, reason = self.oauth.check(request.bearer())
            if account is None:
                message = {
                    "missing": "Access token is empty.",
                    "expired": "Lifetime validation failed, the token is expired.",
                }.get(reason, "IDX14100: JWT is not well formed.")
                return json_response(
                    401, graph_error_body("InvalidAuthenticationToken", message),
                    {"WWW-Authenticate": 'Bearer realm="", authorization_uri='
                     '"https://login.microsoftonline.com/common/oauth2/authorize", '
                     f'client_id="00000003-0000-0000-c000-000000000000", error="{reason}"'},
                )
        try:
            return fn()  # type: ignore[no-any-return]
        except GraphError as exc:
            return self._error(exc)
        except (ValueError, KeyError, TypeError) as exc:
            return self._error(GraphError(400, "invalidRequest", f"Invalid request: {exc}"))

    def _base(self, request: Request) -> str:
        scheme = self.base_url.split("://", 1)[0] or "https"
        return f"{scheme}://{request.header('Host') or self.base_url.split('://', 1)[-1]}"

    # --- change journal -----------------------------------------------------------------
    def _ancestors(self, item: Item) -> tuple[str, ...]:
        chain = []
        parent = item.parent
        while parent is not None:
            chain.append(parent)
            parent = self.items[parent].parent if parent in self.items else None
        return tuple(chain)

    def _record(self, item: Item, *, deleted: bool = False) -> None:
        """Journal a change of ``item`` (before it is unlinked, if ``deleted``).
        Caller holds the lock."""
        self._seq += 1
        gone = None
        if deleted:
            gone = {"id": item.id, "name": item.name, "deleted": {"state": "deleted"},
                    "parentReference": {"driveId": DRIVE_ID, "driveType": "personal",
                                        **({"id": item.parent} if item.parent else {})}}
            if item.is_folder:
                gone["folder"] = {"childCount": 0}
            else:
                gone["file"] = {}
        self.journal.append((self._seq, item.id, self._ancestors(item), gone))

    # --- items -----------------------------------------------------------------------
    def _path_of(self, item: Item) -> str:
        parts = []
        node: Item | None = item
        while node is not None and node.parent is not None:
            parts.append(node.name)
            node = self.items.get(node.parent)
        return "/" + "/".join(reversed(parts)) if parts else ""

    @staticmethod
    def _split(raw: str) -> list[str]:
        path = unquote(raw)
        if not path.startswith("/") and path:
            raise GraphError(400, "invalidRequest", "Invalid path")
        return [p for p in path.split("/") if p]

    def _by_path(self, raw: str) -> Item:
        node = self.root
        for part in self._split(raw):
            if not node.is_folder:
                raise not_found()
            child = node.children.get(part.lower())
            if child is None:
                raise not_found()
            node = self.items[child]
        return node

    def _by_id(self, item_id: str) -> Item:
        item = self.items.get(unquote(item_id))
        if item is None:
            raise not_found()
        return item

    def _target(self, request: Request) -> Item:
        if "id" in request.params:
            return self._by_id(request.params["id"])
        if "path" in request.params:
            return self._by_path(request.params["path"])
        return self.root

    def _resource(self, item: Item, request: Request, select: str | None = None) -> dict[str, Any]:
        base = self._base(request)
        doc: dict[str, Any] = {
            "@odata.context": f"{base}/v1.0/$metadata#drives('{DRIVE_ID}')/items/$entity",
            "id": item.id,
            "name": item.name,
            "size": item.size if not item.is_folder else self._folder_size(item),
            "eTag": item.etag,
            "cTag": item.ctag,
            "createdDateTime": item.created,
            "lastModifiedDateTime": item.modified,
            "createdBy": {"user": {"displayName": TEST_NAME, "id": DRIVE_ID}},
            "parentReference": self._parent_reference(item),
        }
        if item.is_folder:
            doc["folder"] = {"childCount": len(item.children)}
            if item.parent is None:
                doc["root"] = {}
        else:
            doc["file"] = {"mimeType": "application/octet-stream",
                           "hashes": {"quickXorHash": item.quick_xor}}
            # Pre-authenticated and bound to this version (its blob id is unguessable).
            self._downloads[item.blob] = (item.blob, item.size)
            doc["@microsoft.graph.downloadUrl"] = f"{base}/dl/{item.blob}"
        if select:
            wanted = {s.strip() for s in select.split(",")} | {"id"}
            doc = {k: v for k, v in doc.items() if k in wanted}
        return doc

    def _folder_size(self, item: Item) -> int:
        return sum(
            (self.items[c].size if not self.items[c].is_folder else self._folder_size(self.items[c]))
            for c in item.children.values()
        )

    def _parent_reference(self, item: Item) -> dict[str, Any]:
        if item.parent is None:
            return {"driveId": DRIVE_ID, "driveType": "personal"}
        parent = self.items[item.parent]
        return {"driveId": DRIVE_ID, "driveType": "personal", "id": parent.id,
                "path": "/drive/root:" + quote(self._path_of(parent))}

    def _ensure_folder(self, parts: list[str], create: bool) -> Item:
        """The folder at ``parts`` below the root, creating missing ones if asked."""
        node = self.root
        for part in parts:
            child_id = node.children.get(part.lower())
            if child_id is None:
                if not create:
                    raise not_found()
                check_name(part)
                child = Item(self._new_id(), part, node.id, True)
                self.items[child.id] = child
                node.children[part.lower()] = child.id
                self._record(child)
                node = child
                continue
            node = self.items[child_id]
            if not node.is_folder:
                raise GraphError(409, "nameAlreadyExists",
                                 "The specified item name already exists.")
        return node

    def _matches(self, item: Item | None, request: Request) -> None:
        """Enforce If-Match / If-None-Match on ``item`` (None: no such item)."""
        if_match = request.header("If-Match")
        if if_match is not None:
            tags = _entity_tags(if_match)
            if item is None or not ("*" in tags or item.etag in tags or item.ctag in tags):
                raise GraphError(412, "resourceModified", "ETag does not match current item's value",
                                 "entityTagDoesNotMatch")
        if_none_match = request.header("If-None-Match")
        if if_none_match is not None and item is not None:
            tags = _entity_tags(if_none_match)
            if "*" in tags or item.etag in tags or item.ctag in tags:
                raise GraphError(412, "resourceModified", "ETag matches current item's value",
                                 "entityTagDoesNotMatch")

    def _write_file(self, parent: Item, name: str, blob: str, size: int, digest: str,
                    conflict: str, existing_id: str | None = None) -> tuple[Item, bool]:
        """Store a new content at ``parent/name`` (or item ``existing_id``) per
        ``conflict``; ``(item, created)``. Caller holds the lock; the blob is the
        caller's to drop if this raises."""
        if existing_id is not None:
            existing: Item | None = self.items.get(existing_id)
            if existing is None:
                raise not_found()
        else:
            check_name(name)
            child_id = parent.children.get(name.lower())
            existing = self.items.get(child_id) if child_id else None
            if existing is not None:
                if conflict == "fail" or existing.is_folder:
                    raise GraphError(409, "nameAlreadyExists",
                                     "The specified item name already exists.")
                if conflict == "rename":
                    stem, dot, ext = name.rpartition(".")
                    for n in itertools.count(1):
                        candidate = f"{stem} {n}.{ext}" if dot and stem else f"{name} {n}"
                        if candidate.lower() not in parent.children:
                            name, existing = candidate, None
                            break
        if existing is None:
            item = Item(self._new_id(), name, parent.id, False, size=size, blob=blob,
                        quick_xor=digest)
            self.items[item.id] = item
            parent.children[name.lower()] = item.id
            self._record(item)
            return item, True
        existing.history.append(existing.blob)
        while len(existing.history) > KEEP_VERSIONS:
            self._drop_blob(existing.history.pop(0))
        existing.blob, existing.size, existing.quick_xor = blob, size, digest
        existing.version += 1
        existing.modified = _now()
        self._record(existing)
        return existing, False

    def _drop_blob(self, blob: str) -> None:
        self.blobs.delete(blob)
        self._downloads.pop(blob, None)

    def _remove(self, item: Item) -> None:
        for child_id in list(item.children.values()):
            self._remove(self.items[child_id])
        self._record(item, deleted=True)
        if item.parent is not None:
            parent = self.items[item.parent]
            parent.children.pop(item.name.lower(), None)
        self.items.pop(item.id, None)
        if not item.is_folder:
            self._drop_blob(item.blob)
            for blob in item.history:
                self._drop_blob(blob)

    # --- drive and item routes ---------------------------------------------------------
    @route("GET", r"/v1\.0/me/drive")
    def get_drive(self, request: Request) -> Response:
        def run() -> Response:
            with self._lock:
                used = self._folder_size(self.root)
            return json_response(200, {
                "id": DRIVE_ID, "driveType": "personal",
                "owner": {"user": {"displayName": TEST_NAME, "id": DRIVE_ID}},
                "quota": {"total": 5 * 1024**3, "used": used, "remaining": 5 * 1024**3 - used,
                          "deleted": 0, "state": "normal"},
            })

        return self._graph(request, "drive", run)

    @route("GET", r"/v1\.0/me/drive/root")
    @route("GET", r"/v1\.0/me/drive/root:(?P<path>/[^:]*):?")
    @route("GET", r"/v1\.0/me/drive/items/(?P<id>[^/:]+)")
    def get_item(self, request: Request) -> Response:
        def run() -> Response:
            with self._lock:
                item = self._target(request)
                return json_response(200, self._resource(item, request, request.query.get("$select")))

        return self._graph(request, "get item", run)

    @route("GET", r"/v1\.0/me/drive/root/children")
    @route("GET", r"/v1\.0/me/drive/root:(?P<path>/[^:]*):/children")
    @route("GET", r"/v1\.0/me/drive/items/(?P<id>[^/:]+)/children")
    def list_children(self, request: Request) -> Response:
        def run() -> Response:
            token = request.query.get("$skiptoken")
            with self._lock:
                if token is not None:
                    cursor = self._cursors.pop(token, None)
                    if cursor is None:
                        raise GraphError(400, "invalidRequest", "Invalid skip token",
                                         "invalidStartIndex")
                    rest, folder_id = cursor
                else:
                    folder = self._target(request)
                    if not folder.is_folder:
                        raise GraphError(400, "invalidRequest",
                                         "The item is not a folder", "notAllowed")
                    folder_id = folder.id
                    rest = [
                        self._resource(self.items[c], request, request.query.get("$select"))
                        for _, c in sorted(folder.children.items())
                    ]
                top = int(request.query.get("$top") or 200)
                if top < 1:
                    raise GraphError(400, "invalidRequest", "Invalid $top", "invalidParameterFormat")
                size = min(top, self.page_size)
                page, rest = rest[:size], rest[size:]
                doc: dict[str, Any] = {
                    "@odata.context": f"{self._base(request)}/v1.0/$metadata#"
                                      f"drives('{DRIVE_ID}')/items('{folder_id}')/children",
                    "value": page,
                }
                if rest:
                    skip = secrets.token_urlsafe(12)
                    self._cursors[skip] = (rest, folder_id)
                    query = {k: v for k, v in request.query.items() if k != "$skiptoken"}
                    query["$skiptoken"] = skip
                    doc["@odata.nextLink"] = (
                        f"{self._base(request)}/v1.0/me/drive/items/{quote(folder_id, safe='!')}"
                        f"/children?{urlencode(query)}"
                    )
            return json_response(200, doc)

        return self._graph(request, "list children", run)

    @route("POST", r"/v1\.0/me/drive/root/children")
    @route("POST", r"/v1\.0/me/drive/root:(?P<path>/[^:]*):/children")
    @route("POST", r"/v1\.0/me/drive/items/(?P<id>[^/:]+)/children")
    def create_folder(self, request: Request) -> Response:
        body = request.json() or {}

        def run() -> Response:
            name = str(body["name"])
            if "folder" not in body:
                raise GraphError(400, "invalidRequest", "Only folders can be created here")
            conflict = str(body.get("@microsoft.graph.conflictBehavior")
                           or request.query.get("@microsoft.graph.conflictBehavior") or "fail")
            with self._lock:
                parent = self._target(request)
                if not parent.is_folder:
                    raise GraphError(400, "invalidRequest", "The parent is not a folder")
                check_name(name)
                existing_id = parent.children.get(name.lower())
                if existing_id is not None:
                    existing = self.items[existing_id]
                    if conflict == "fail" or not existing.is_folder:
                        raise GraphError(409, "nameAlreadyExists",
                                         "The specified item name already exists.")
                    if conflict == "replace":
                        return json_response(200, self._resource(existing, request))
                    name = f"{name} 1"
                folder = Item(self._new_id(), name, parent.id, True)
                self.items[folder.id] = folder
                parent.children[name.lower()] = folder.id
                self._record(folder)
                return json_response(201, self._resource(folder, request))

        return self._graph(request, "create folder", run)

    @route("GET", r"/v1\.0/me/drive/root/delta")
    @route("GET", r"/v1\.0/me/drive/root:(?P<path>/[^:]*):/delta")
    @route("GET", r"/v1\.0/me/drive/items/(?P<id>[^/:]+)/delta")
    def delta(self, request: Request) -> Response:
        def run() -> Response:
            skip = request.query.get("$skiptoken")
            with self._lock:
                if skip is not None:
                    pending = self._delta_pages.pop(skip, None)
                    if pending is None:
                        raise GraphError(400, "invalidRequest", "Invalid skip token",
                                         "invalidStartIndex")
                    rest, folder_id, position = pending
                else:
                    folder = self._target(request)
                    if not folder.is_folder:
                        raise GraphError(400, "invalidRequest", "The item is not a folder",
                                         "notAllowed")
                    folder_id, position = folder.id, self._seq
                    rest = self._delta_items(folder, request, request.query.get("token"))
                top = int(request.query.get("$top") or self.page_size)
                size = max(1, min(top, self.page_size))
                page, rest = rest[:size], rest[size:]
                base = f"{self._base(request)}/v1.0/me/drive/items/{quote(folder_id, safe='!')}/delta"
                doc: dict[str, Any] = {
                    "@odata.context": f"{self._base(request)}/v1.0/$metadata#"
                                      "Collection(driveItem)",
                    "value": page,
                }
                if rest:
                    token = secrets.token_urlsafe(12)
                    self._delta_pages[token] = (rest, folder_id, position)
                    doc["@odata.nextLink"] = f"{base}?{urlencode({'$skiptoken': token})}"
                else:
                    doc["@odata.deltaLink"] = f"{base}?{urlencode({'token': str(position)})}"
            return json_response(200, doc)

        return self._graph(request, "delta", run)

    def _delta_items(self, folder: Item, request: Request, token: str | None) -> list[dict[str, Any]]:
        """What a delta of ``folder`` from ``token`` lists. Caller holds the lock."""
        def entry(item: Item) -> dict[str, Any]:
            doc = self._resource(item, request, request.query.get("$select"))
            doc.pop("@odata.context", None)
            if isinstance(doc.get("parentReference"), dict):
                doc["parentReference"] = {k: v for k, v in doc["parentReference"].items()
                                          if k != "path"}
            return doc

        if token is None:  # the whole hierarchy, the folder first
            found, stack = [], [folder]
            while stack:
                node = stack.pop()
                found.append(entry(node))
                stack.extend(self.items[c] for c in sorted(node.children.values(), reverse=True))
            return found
        if token == "latest":
            return []
        try:
            since = int(token)
        except ValueError:
            raise GraphError(400, "invalidRequest", "Invalid token", "invalidParameterFormat") from None
        if since > self._seq or since < 0:
            raise GraphError(410, "resyncRequired", "Resync required: the token is not valid",
                             "resyncChangesApplyDifferences")
        latest: dict[str, dict[str, Any] | None] = {}
        for number, item_id, ancestors, gone in self.journal:
            if number > since and (item_id == folder.id or folder.id in ancestors):
                latest.pop(item_id, None)  # listed once, where it last changed
                latest[item_id] = gone
        items = []
        for item_id, gone in latest.items():
            item = self.items.get(item_id)
            items.append(entry(item) if item is not None else dict(gone or {"id": item_id,
                                                                           "deleted": {}}))
        return items

    @route("DELETE", r"/v1\.0/me/drive/root:(?P<path>/[^:]*):?")
    @route("DELETE", r"/v1\.0/me/drive/items/(?P<id>[^/:]+)")
    def delete_item(self, request: Request) -> Response:
        def run() -> Response:
            with self._lock:
                item = self._target(request)
                if item.parent is None:
                    raise GraphError(403, "accessDenied", "The root cannot be deleted")
                self._matches(item, request)
                self._remove(item)
            return Response(204)

        return self._graph(request, "delete", run)

    # --- simple upload and content -------------------------------------------------------
    @route("PUT", r"/v1\.0/me/drive/root:(?P<path>/[^:]*):/content")
    @route("PUT", r"/v1\.0/me/drive/items/(?P<id>[^/:]+)/content")
    def put_content(self, request: Request) -> Response:
        def run() -> Response:
            length = int(request.header("Content-Length", "0") or 0)
            if length > MAX_SIMPLE_UPLOAD:
                raise GraphError(413, "invalidRequest", "Request entity too large",
                                 "maxFileSizeExceeded")
            conflict = request.query.get("@microsoft.graph.conflictBehavior", "replace")
            if conflict not in ("fail", "replace", "rename"):
                raise GraphError(400, "invalidRequest", "Invalid conflict behavior")
            # Cheap checks first, so a refused request stores nothing.
            with self._lock:
                self._check_target(request, conflict)
            hasher = QuickXorHash()
            blob, size = self.blobs.write(request.chunks(), (hasher,))
            with self._lock:
                try:
                    if "id" in request.params:
                        item = self._by_id(request.params["id"])
                        if item.is_folder:
                            raise GraphError(400, "invalidRequest", "Cannot upload to a folder")
                        self._matches(item, request)
                        item, created = self._write_file(self.root, "", blob, size,
                                                         hasher.b64digest(), "replace", item.id)
                    else:
                        parts = self._split(request.params["path"])
                        if not parts:
                            raise GraphError(400, "invalidRequest", "Cannot upload to the root")
                        parent = self._ensure_folder(parts[:-1], self.auto_create_parents)
                        if request.header("If-Match") or request.header("If-None-Match"):
                            current = parent.children.get(parts[-1].lower())
                            self._matches(self.items.get(current) if current else None, request)
                        item, created = self._write_file(parent, parts[-1], blob, size,
                                                         hasher.b64digest(), conflict)
                except GraphError:
                    self.blobs.delete(blob)
                    raise
                return json_response(201 if created else 200, self._resource(item, request))

        return self._graph(request, "put content", run)

    def _check_target(self, request: Request, conflict: str) -> None:
        """The conditions of a simple upload that do not depend on its body."""
        if "id" in request.params:
            self._matches(self._by_id(request.params["id"]), request)
            return
        parts = self._split(request.params["path"])
        for part in parts:
            check_name(part)
        try:
            parent = self._ensure_folder(parts[:-1], False)
        except GraphError as exc:
            if exc.status != 404 or not self.auto_create_parents:
                raise
            return
        current = parent.children.get(parts[-1].lower()) if parts else None
        if current is not None and conflict == "fail":
            raise GraphError(409, "nameAlreadyExists", "The specified item name already exists.")

    @route("GET", r"/v1\.0/me/drive/root:(?P<path>/[^:]*):/content")
    @route("GET", r"/v1\.0/me/drive/items/(?P<id>[^/:]+)/content")
    def get_content(self, request: Request) -> Response:
        def run() -> Response:
            with self._lock:
                item = self._target(request)
                if item.is_folder:
                    raise not_found()
                if_none_match = request.header("If-None-Match")
                if if_none_match and if_none_match in (item.etag, item.ctag):
                    return Response(304)
                url = self._resource(item, request)["@microsoft.graph.downloadUrl"]
            return Response(302, {"Location": url})

        return self._graph(request, "get content", run)

    @route("GET", r"/dl/(?P<token>[A-Za-z0-9_-]+)")
    def download(self, request: Request) -> Response:
        """A pre-authenticated download URL: one version's bytes, with Range."""
        self._count("download")
        with self._lock:
            entry = self._downloads.get(request.params["token"])
            if entry is None:
                return self._error(not_found())
            blob, size = entry
            try:
                handle = self.blobs.open(blob)  # opened under the lock: one version
            except FileNotFoundError:
                return self._error(not_found())
        headers = {"Content-Type": "application/octet-stream", "Accept-Ranges": "bytes"}
        spec = request.header("Range")
        if spec:
            parsed = parse_range(spec, size)
            if parsed is None:
                handle.close()
                return json_response(416, graph_error_body(
                    "invalidRange", "The specified byte range is invalid or unavailable."),
                    {"Content-Range": f"bytes */{size}"})
            start, end = parsed
            headers["Content-Range"] = f"bytes {start}-{end - 1}/{size}"
            return Response(206, headers, handle=handle, start=start, end=end)
        return Response(200, headers, handle=handle, start=0, end=size)

    # --- upload sessions -----------------------------------------------------------------
    @route("POST", r"/v1\.0/me/drive/root:(?P<path>/[^:]*):/createUploadSession")
    @route("POST", r"/v1\.0/me/drive/items/(?P<id>[^/:]+)/createUploadSession")
    def create_upload_session(self, request: Request) -> Response:
        body = request.json() or {}

        def run() -> Response:
            item_props = body.get("item") or {}
            conflict = str(item_props.get("@microsoft.graph.conflictBehavior")
                           or request.query.get("@microsoft.graph.conflictBehavior") or "fail")
            if conflict not in ("fail", "replace", "rename"):
                raise GraphError(400, "invalidRequest", "Invalid conflict behavior")
            with self._lock:
                path: str | None = None
                item_id: str | None = None
                if "id" in request.params:
                    item = self._by_id(request.params["id"])
                    if item.is_folder:
                        raise GraphError(400, "invalidRequest", "Cannot upload to a folder")
                    self._matches(item, request)
                    item_id = item.id
                else:
                    parts = self._split(request.params["path"])
                    if not parts:
                        raise GraphError(400, "invalidRequest", "Cannot upload to the root")
                    for part in parts:
                        check_name(part)
                    path = "/" + "/".join(parts)
                    try:
                        current: Item | None = self._by_path(quote(path))
                    except GraphError:
                        current = None
                    if request.header("If-Match") or request.header("If-None-Match"):
                        self._matches(current, request)
                    if current is not None and (conflict == "fail" or current.is_folder):
                        raise GraphError(409, "nameAlreadyExists",
                                         "The specified item name already exists.")
                blob, _ = self.blobs.write([])
                session_id = secrets.token_urlsafe(24)
                expires = (datetime.datetime.now(datetime.UTC) + datetime.timedelta(days=6)
                           ).strftime("%Y-%m-%dT%H:%M:%S.000Z")
                self._sessions[session_id] = UploadSession(
                    path, item_id, conflict, request.header("If-Match"), blob, expires=expires)
            return json_response(200, {
                "@odata.context": f"{self._base(request)}/v1.0/$metadata#microsoft.graph.uploadSession",
                "uploadUrl": f"{self._base(request)}/up/{session_id}",
                "expirationDateTime": expires,
                "nextExpectedRanges": ["0-"],
            })

        return self._graph(request, "create upload session", run)

    def _upload_session(self, request: Request) -> UploadSession:
        if request.header("Authorization"):
            raise GraphError(401, "unauthenticated",
                             "Do not send an Authorization header to an upload URL")
        session = self._sessions.get(request.params["session"])
        if session is None:
            raise GraphError(404, "itemNotFound", "The upload session was not found",
                             "uploadSessionNotFound")
        return session

    @staticmethod
    def _session_doc(session: UploadSession) -> dict[str, Any]:
        done = session.total is not None and session.received >= session.total
        return {"expirationDateTime": session.expires,
                "nextExpectedRanges": [] if done else [f"{session.received}-"]}

    @route("GET", r"/up/(?P<session>[A-Za-z0-9_-]+)")
    def upload_status(self, request: Request) -> Response:
        def run() -> Response:
            with self._lock:
                return json_response(200, self._session_doc(self._upload_session(request)))

        return self._graph(request, "upload status", run, auth=False)

    @route("DELETE", r"/up/(?P<session>[A-Za-z0-9_-]+)")
    def upload_cancel(self, request: Request) -> Response:
        def run() -> Response:
            with self._lock:
                session = self._upload_session(request)
                del self._sessions[request.params["session"]]
                self.blobs.delete(session.blob)
            return Response(204)

        return self._graph(request, "cancel upload", run, auth=False)

    @route("PUT", r"/up/(?P<session>[A-Za-z0-9_-]+)")
    def upload_fragment(self, request: Request) -> Response:
        def run() -> Response:
            with self._lock:
                session = self._upload_session(request)
            with session.lock:  # fragments of one session never interleave
                return self._fragment(request, session)

        return self._graph(request, "upload fragment", run, auth=False)

    def _fragment(self, request: Request, session: UploadSession) -> Response:
        spec = request.header("Content-Range") or ""
        match = re.fullmatch(r"bytes (\d+)-(\d+)/(\d+)", spec.strip())
        if match is None:
            raise GraphError(400, "invalidRequest", "The Content-Range header is missing or malformed.")
        start, last, total = (int(g) for g in match.groups())
        length = int(request.header("Content-Length", "0") or 0)
        if last < start or last >= total or length != last - start + 1:
            raise GraphError(400, "invalidRequest",
                             "The Content-Range header length does not match the provided "
                             "number of bytes.")
        if session.total is not None and total != session.total:
            raise GraphError(400, "invalidRequest",
                             f"The current upload session is for {session.total} total bytes, "
                             f"but the current fragment declares a total of {total}.",
                             "fragmentLengthMismatch")
        if length > MAX_FRAGMENT:
            raise GraphError(413, "invalidRequest", "Fragment too large", "maxFragmentLengthExceeded")
        if last + 1 < total and length % FRAGMENT_UNIT:
            raise GraphError(400, "invalidRequest",
                             "A fragment that is not the last must be a multiple of 320 KiB.")
        if start != session.received:
            inner = "fragmentOverlap" if start < session.received else "fragmentOutOfOrder"
            raise GraphError(416, "invalidRange",
                             "Uploaded fragment overlaps with existing data." if start < session.received
                             else "Uploaded fragment is out of order.", inner)
        if session.total is not None and session.received >= session.total:
            raise GraphError(416, "invalidRange", "The session has every byte", "fragmentOverlap")
        # Stream into a side blob first: a body cut short leaves the session as it was.
        part, size = self.blobs.write(request.chunks())
        if size != length:
            self.blobs.delete(part)
            raise ConnectionError("fragment body ended early")
        with self.blobs.open(part) as piece:
            self.blobs.append(session.blob, iter(lambda: piece.read(1 << 20), b""))
        self.blobs.delete(part)
        with self._lock:
            session.total = total
            session.received += size
            self.fragments.append((start, size, total))
            if session.received < total:
                return json_response(202, self._session_doc(session))
            return self._commit(request, session)

    def _commit(self, request: Request, session: UploadSession) -> Response:
        """The last fragment arrived: write the file (caller holds the lock). A refused
        commit keeps the session (every byte received, none expected)."""
        hasher = QuickXorHash()
        with self.blobs.open(session.blob) as whole:
            for piece in iter(lambda: whole.read(1 << 20), b""):
                hasher.update(piece)
        assert session.total is not None
        if session.item_id is not None:
            item = self.items.get(session.item_id)
            if item is None:
                raise not_found()
            if session.if_match and not {item.etag, item.ctag, "*"} & set(_entity_tags(session.if_match)):
                raise GraphError(412, "resourceModified", "ETag does not match current item's value",
                                 "entityTagDoesNotMatch")
            item, created = self._write_file(self.root, "", session.blob, session.total,
                                             hasher.b64digest(), "replace", item.id)
        else:
            assert session.path is not None
            parts = [p for p in session.path.split("/") if p]
            parent = self._ensure_folder(parts[:-1], True)
            if session.if_match:
                current_id = parent.children.get(parts[-1].lower())
                current = self.items.get(current_id) if current_id else None
                if current is None or not ({current.etag, current.ctag, "*"}
                                           & set(_entity_tags(session.if_match))):
                    raise GraphError(412, "resourceModified",
                                     "ETag does not match current item's value",
                                     "entityTagDoesNotMatch")
            item, created = self._write_file(parent, parts[-1], session.blob, session.total,
                                             hasher.b64digest(), session.conflict)
        self._sessions = {k: v for k, v in self._sessions.items() if v is not session}
        return json_response(201 if created else 200, self._resource(item, request))

    # --- sharing ----------------------------------------------------------------------------
    @route("POST", r"/v1\.0/me/drive/root:(?P<path>/[^:]*):/invite")
    @route("POST", r"/v1\.0/me/drive/items/(?P<id>[^/:]+)/invite")
    def invite(self, request: Request) -> Response:
        body = request.json() or {}

        def run() -> Response:
            recipients = body.get("recipients") or []
            roles = body.get("roles") or []
            if not recipients or not set(roles) <= {"read", "write"} or not roles:
                raise GraphError(400, "invalidRequest", "recipients and roles are required")
            emails = []
            for recipient in recipients:
                email = str(recipient.get("email") or "")
                if not re.fullmatch(r"[^@\s]+@[^@\s]+\.[^@\s]+", email):
                    raise GraphError(400, "invalidRequest",
                                     f"Invalid recipient email address: {email!r}")
                emails.append(email.lower())
            with self._lock:
                item = self._target(request)
                self.members.setdefault(item.id, set()).update(emails)
            return json_response(200, {"@odata.context": f"{self._base(request)}/v1.0/"
                                        "$metadata#Collection(permission)", "value": [
                {"@odata.type": "#microsoft.graph.permission",
                 "id": secrets.token_hex(8), "roles": roles,
                 "grantedToIdentities": [{"user": {"email": e, "displayName": e}}],
                 "invitation": {"email": e, "signInRequired": bool(body.get("requireSignIn", True))}}
                for e in emails
            ]})

        return self._graph(request, "invite", run)

    # --- sign-in (Microsoft identity platform v2.0) ------------------------------------------
    @staticmethod
    def _oauth_body(error: str, code: int, description: str) -> dict[str, Any]:
        return {
            "error": error,
            "error_description": f"AADSTS{code}: {description} Trace ID: {uuid.uuid4()} "
                                 f"Correlation ID: {uuid.uuid4()} Timestamp: {_now()}",
            "error_codes": [code],
            "timestamp": _now(),
            "trace_id": str(uuid.uuid4()),
            "correlation_id": str(uuid.uuid4()),
        }

    def _oauth_error(self, exc: OAuthError) -> Response:
        codes = {"invalid_grant": 70000, "invalid_client": 7000215, "invalid_request": 900144,
                 "unsupported_grant_type": 70003, "unsupported_response_type": 700054}
        return json_response(exc.status, self._oauth_body(
            exc.error, codes.get(exc.error, 90000), exc.description or exc.error))

    @route("GET", r"/(?P<tenant>[A-Za-z0-9.-]+)/v2\.0/\.well-known/openid-configuration")
    def openid_configuration(self, request: Request) -> Response:
        self._count("openid-configuration")
        tenant = request.params["tenant"]
        base = f"{self._base(request)}/{tenant}"
        issuer_tenant = "{tenantid}" if tenant in ("common", "organizations") else (
            CONSUMERS_TENANT_ID if tenant == "consumers" else tenant)
        return json_response(200, {
            "token_endpoint": f"{base}/oauth2/v2.0/token",
            "token_endpoint_auth_methods_supported": ["client_secret_post", "private_key_jwt",
                                                      "client_secret_basic"],
            "jwks_uri": f"{base}/discovery/v2.0/keys",
            "response_modes_supported": ["query", "fragment", "form_post"],
            "subject_types_supported": ["pairwise"],
            "id_token_signing_alg_values_supported": ["RS256"],
            "response_types_supported": ["code", "id_token", "code id_token", "id_token token"],
            "scopes_supported": ["openid", "profile", "email", "offline_access"],
            "issuer": f"https://login.microsoftonline.com/{issuer_tenant}/v2.0",
            "request_uri_parameter_supported": False,
            "userinfo_endpoint": f"{self._base(request)}/oidc/userinfo",
            "authorization_endpoint": f"{base}/oauth2/v2.0/authorize",
            "device_authorization_endpoint": f"{base}/oauth2/v2.0/devicecode",
            "http_logout_supported": True,
            "frontchannel_logout_supported": True,
            "end_session_endpoint": f"{base}/oauth2/v2.0/logout",
            "claims_supported": ["sub", "iss", "aud", "exp", "iat", "nonce",
                                 "preferred_username", "name", "tid", "ver", "oid"],
            "tenant_region_scope": None,
            "cloud_instance_name": "microsoftonline.com",
            "cloud_graph_host_name": "graph.windows.net",
            "msgraph_host": "graph.microsoft.com",
        })

    @route("GET", r"/(?P<tenant>[A-Za-z0-9.-]+)/oauth2/v2\.0/authorize")
    def authorize(self, request: Request) -> Response:
        """The sign-in and consent pages, approved at once: the code goes back to
        ``redirect_uri`` as a query (302) or, with ``response_mode=form_post``, in an
        auto-submitting form (as Entra does)."""
        self._count("authorize")
        params = dict(request.query)
        try:
            code = self.oauth.approve(params)
        except OAuthError as exc:
            return text_response(400, f"AADSTS error ({exc.error}): {exc.description}")
        with self._lock:
            self._nonces[code] = params.get("nonce")
        redirect = params.get("redirect_uri") or ""
        answer = {"code": code, "client_info": self._client_info(),
                  **({"state": params["state"]} if "state" in params else {}),
                  "session_state": str(uuid.uuid4())}
        if params.get("response_mode") == "form_post":
            fields = "".join(
                f'<input type="hidden" name="{html.escape(k)}" value="{html.escape(v)}"/>'
                for k, v in answer.items()
            )
            page = (f'<html><head><title>Working...</title></head><body>'
                    f'<form method="POST" name="hiddenform" action="{html.escape(redirect)}">'
                    f'{fields}<noscript><p>Script is disabled. Click Submit to continue.</p>'
                    f'<input type="submit" value="Submit"/></noscript></form>'
                    f'<script language="javascript">document.forms[0].submit();</script>'
                    f'</body></html>')
            return Response(200, {"Content-Type": "text/html; charset=utf-8"}, page.encode())
        return Response(302, {"Location": f"{redirect}?{urlencode(answer)}"})

    @route("POST", r"/(?P<tenant>[A-Za-z0-9.-]+)/oauth2/v2\.0/devicecode")
    def device_code(self, request: Request) -> Response:
        self._count("devicecode")
        form = request.form()
        client_id = form.get("client_id", "")
        if client_id not in self.oauth.clients:
            return self._oauth_error(OAuthError("invalid_client", 400,
                                                f"Application with identifier '{client_id}' was "
                                                "not found in the directory."))
        device = secrets.token_urlsafe(48)
        user_code = "".join(secrets.choice("ABCDEFGHJKLMNPQRSTUVWXYZ23456789") for _ in range(9))
        verifier = secrets.token_urlsafe(48)
        with self._lock:
            self._device[device] = DeviceGrant(user_code, client_id, form.get("scope", ""),
                                               time.time() + 900, verifier)
        uri = f"{self._base(request)}/devicelogin"
        return json_response(200, {
            "user_code": user_code,
            "device_code": device,
            "verification_uri": uri,
            "expires_in": 900,
            "interval": self.device_interval,
            "message": f"To sign in, use a web browser to open the page {uri} and enter the "
                       f"code {user_code} to authenticate.",
        })

    @route("GET", r"/devicelogin")
    def device_login_page(self, request: Request) -> Response:
        page = ('<html><body><form method="POST" action="/devicelogin">Enter code '
                '<input name="otc"/><input type="submit" value="Next"/></form></body></html>')
        return Response(200, {"Content-Type": "text/html; charset=utf-8"}, page.encode())

    @route("POST", r"/devicelogin")
    def device_login(self, request: Request) -> Response:
        """The user types the code shown by the device (and signs in: approved)."""
        otc = request.form().get("otc", "").strip().upper()
        with self._lock:
            grant = next((g for g in self._device.values() if g.user_code == otc), None)
            if grant is None or grant.expires_at <= time.time():
                return text_response(400, "That code didn't work. Check the code and try again.")
            challenge = _b64url(hashlib.sha256(grant.verifier.encode()).digest())
        grant.code = self.oauth.approve({
            "client_id": grant.client_id, "response_type": "code", "scope": grant.scope,
            "code_challenge": challenge, "code_challenge_method": "S256",
        })
        return text_response(200, "You have signed in to the metasync application on your "
                                  "device. You may now close this window.")

    def _client_info(self) -> str:
        return _b64url(json.dumps({"uid": TEST_OID, "utid": CONSUMERS_TENANT_ID}).encode())

    def _id_token(self, client_id: str, nonce: str | None) -> str:
        now = int(time.time())
        claims: dict[str, Any] = {
            "ver": "2.0", "iss": f"https://login.microsoftonline.com/{CONSUMERS_TENANT_ID}/v2.0",
            "sub": _b64url(hashlib.sha256(TEST_OID.encode()).digest()[:24]),
            "aud": client_id, "exp": now + 3600, "iat": now, "nbf": now,
            "name": TEST_NAME, "preferred_username": TEST_EMAIL, "oid": TEST_OID,
            "tid": CONSUMERS_TENANT_ID,
        }
        if nonce:
            claims["nonce"] = nonce
        header = {"typ": "JWT", "alg": "RS256", "kid": "emulator"}
        return ".".join((_b64url(json.dumps(header).encode()), _b64url(json.dumps(claims).encode()),
                         _b64url(secrets.token_bytes(64))))

    @route("POST", r"/(?P<tenant>[A-Za-z0-9.-]+)/oauth2/v2\.0/token")
    def token(self, request: Request) -> Response:
        self._count("token")
        form = request.form()
        grant_type = form.get("grant_type", "")
        nonce: str | None = None
        try:
            if grant_type == "urn:ietf:params:oauth:grant-type:device_code":
                with self._lock:
                    device = self._device.get(form.get("device_code", ""))
                    if device is None:
                        raise OAuthError("invalid_grant", 400, "The provided value for the "
                                         "input parameter 'device_code' is not valid.")
                    if device.expires_at <= time.time():
                        del self._device[form.get("device_code", "")]
                        return json_response(400, self._oauth_body(
                            "expired_token", 70020, "The provided value for the input parameter "
                            "'device_code' is not valid. Device codes expire after 15 minutes."))
                    if device.code is None:
                        return json_response(400, self._oauth_body(
                            "authorization_pending", 70016, "OAuth 2.0 device flow error. "
                            "Authorization is pending. Continue polling."))
                    del self._device[form.get("device_code", "")]
                answer = self.oauth.token({
                    "grant_type": "authorization_code", "code": device.code,
                    "client_id": device.client_id, "code_verifier": device.verifier,
                })
                scope = device.scope
            else:
                if grant_type == "authorization_code":
                    with self._lock:
                        nonce = self._nonces.pop(form.get("code", ""), None)
                answer = self.oauth.token(form)
                scope = form.get("scope", "")
        except OAuthError as exc:
            return self._oauth_error(exc)
        client_id = form.get("client_id", "")
        answer.update(
            token_type="Bearer",
            scope=" ".join(s for s in scope.split() if s not in ("openid", "profile",
                                                                  "offline_access")) or "Files.ReadWrite",
            ext_expires_in=answer.get("expires_in"),
            id_token=self._id_token(client_id, nonce),
            client_info=self._client_info(),
        )
        return json_response(200, answer)

    # --- test helpers ----------------------------------------------------------------------
    def make_folder(self, path: str) -> None:
        """Create ``path`` (and its parents) as a user would in the OneDrive app."""
        with self._lock:
            self._ensure_folder([p for p in path.split("/") if p], True)

    def item_at(self, path: str) -> Item:
        with self._lock:
            return self._by_path(quote(path))

    def file_bytes(self, path: str) -> bytes:
        item = self.item_at(path)
        return self.blobs.path(item.blob).read_bytes()

    def sessions(self) -> int:
        with self._lock:
            return len(self._sessions)

    def close(self) -> None:
        self.blobs.close()


def _entity_tags(value: str) -> list[str]:
    """The entity tags of an If-Match / If-None-Match value: ``*`` or quoted tags
    (which may hold commas, as SharePoint's ``"{GUID},N"`` do); an unquoted value
    (OneDrive personal's eTags) is one tag."""
    tags = re.findall(r'\*|(?:W/)?"[^"]*"', value)
    return tags or [value.strip()]


# --- fixtures --------------------------------------------------------------------------------


@dataclass
class OneDriveService(EmulatorService):
    """A running OneDrive emulator plus what clients need to reach it."""

    emulator: OneDriveEmulator

    def env(self) -> dict[str, str]:
        return {**environment_for("onedrive", self.server), "METASYNC_ONEDRIVE_APP_KEY": TEST_APP_ID}

    def sign_in(self, account: str = "default") -> None:
        """Sign ``account`` in through MSAL's device-code flow against the emulator,
        approving the code as the user would, and keep the grant in the test token
        store (what `metasync auth onedrive --no-browser` does)."""
        from metasync.backends.cloud import AuthRequest, Endpoint, authorize

        class UI:
            def show(self, text: str) -> None:
                code = re.search(r"enter the code (\S+)", text)
                assert code is not None, text
                import ssl

                import httpx

                httpx.post(f"{service.base_url}/devicelogin", data={"otc": code.group(1)},
                           verify=ssl.create_default_context(cafile=service.ca_file))

            def open_browser(self, url: str) -> bool:
                return False

            def prompt(self, text: str) -> str:
                raise AssertionError("no prompt expected")

        service = self
        authorize(AuthRequest("onedrive", account, TEST_APP_ID, None, True, None,
                              Endpoint(self.base_url, self.ca_file)), UI())

    def faults_via_proxy(self) -> EmulatorFaults:
        return EmulatorFaults(self.server, ONEDRIVE_FAULTS)


@contextlib.contextmanager
def running_onedrive() -> Iterator[OneDriveService]:
    with emulator_server("onedrive", OneDriveEmulator) as (server, emulator):
        yield OneDriveService(server, emulator)


@pytest.fixture(scope="session")
def onedrive_service() -> Iterator[OneDriveService]:
    """A OneDrive emulator for the whole session, aimed at by the process environment
    (child processes inherit it), with the default account signed in."""
    with running_onedrive() as service:
        yield from serve_for_session(service)


__all__ = [
    "ONEDRIVE_FAULTS",
    "TEST_APP_ID",
    "TEST_EMAIL",
    "UNAVAILABLE_NO_RETRY_AFTER",
    "OneDriveEmulator",
    "OneDriveService",
    "check_name",
    "graph_error_body",
    "running_onedrive",
]
