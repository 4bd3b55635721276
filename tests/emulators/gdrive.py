"""An emulator of the part of the Google Drive API v3 the ``gdrive:`` backend uses.

Written from the Drive v3 reference and guides (and the discovery document the SDK
ships), not from the SDK: the SDK is what is under test. Served over TLS on one port
for the API (``/drive/v3/...``), uploads (``/upload/drive/v3/...``) and OAuth
(``/o/oauth2/auth``, ``/token``, ``/revoke``). Faithful in what the backend relies on:

- **Items by id; names are not unique**: any number of items of one name may share a
  parent. ``files.create`` takes an ``id`` only if ``files.generateIds`` issued it
  (else 400 ``invalid``, "The provided file ID is not usable"), and answers **409**
  once an item with that id exists ("Generate IDs to use with your files").
- **files.list** with the query language subset the backend sends (``name =``,
  ``name !=``, ``mimeType =``/``!=``, ``'ID' in parents``, ``trashed =``, ``and``,
  ``or``, ``not``, parentheses; anything else is 400 ``invalid``), ``pageSize``
  (1..1000, default 100; :attr:`GDriveEmulator.page_size` caps it lower for tests),
  ``pageToken`` and partial responses (``fields``). A page may be shorter than asked.
- **files.get** (metadata with ``fields``; ``alt=media`` with ``Range``: 206, 416),
  ``revisions.get?alt=media`` of the last :data:`KEEP_REVISIONS` revisions,
  **files.create** / **files.update** as metadata-only, ``uploadType=media``,
  ``multipart`` (multipart/related) and ``resumable`` (session URI in ``Location``;
  ``PUT`` pieces with ``Content-Range``, multiples of 256 KiB except the last; 308
  with ``Range`` for an unfinished session, ``bytes */N`` status queries, 404 for an
  unknown session), **files.delete** (recursive for folders), ``files.generateIds``,
  ``permissions.create``/``list``, ``about.get``; POSTs with
  ``X-HTTP-Method-Override: GET`` (the SDK's form of a long GET).
- **Errors** in Google's format: ``{"error": {"code", "message", "errors":
  [{"domain", "reason", "message", ...}], "status"}}`` (404 ``notFound``, 401
  ``authError``, 403 ``userRateLimitExceeded``/``rateLimitExceeded``/
  ``uploadLimitExceeded``, 429 ``rateLimitExceeded``, 500 ``internalError``, 503
  ``backendError``).
- **md5Checksum**, **sha256Checksum**, ``size``, ``headRevisionId``, ``version``,
  ``createdTime``/``modifiedTime`` (RFC 3339 with milliseconds, strictly increasing).
- **Changes**: every create, content or metadata update and deletion of an item is a
  change with an increasing id; ``changes.getStartPageToken`` answers the id the next
  change will get, ``changes.list?pageToken=`` the changes from there (each with
  ``fileId``, ``removed`` and, unless removed, the item's current ``file``; at most
  ``pageSize`` (1..1000, default 100), then ``nextPageToken``; on the last page
  ``newStartPageToken``), ``includeRemoved``, partial responses (``fields``).
- **The daily upload cap**: with :attr:`GDriveEmulator.uploads_blocked` every request
  carrying file content is answered 403 ``uploadLimitExceeded``.

File contents live on disk (:class:`BlobStore`); only metadata is in memory.
"""

from __future__ import annotations

import base64
import contextlib
import datetime
import hashlib
import itertools
import json
import re
import secrets
import socket
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import pytest

from tests.emulators.base import (
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
    pkce_challenge,
    route,
    serve_for_session,
    text_response,
)

#: Drive-specific fault kinds (see :meth:`GDriveEmulator.render_fault`).
USER_RATE_LIMIT = "userRateLimitExceeded"  # 403
RATE_LIMIT_403 = "rateLimitExceeded"  # 403 form of the same
UPLOAD_LIMIT = "uploadLimitExceeded"  # 403, the daily upload cap
GDRIVE_FAULTS = (*GENERIC_FAULTS, USER_RATE_LIMIT, RATE_LIMIT_403)

FOLDER = "application/vnd.google-apps.folder"
ROOT_ID = "0AEmulatedRootFolderUk9PVA"
KEEP_REVISIONS = 10
RESUMABLE_UNIT = 256 * 1024
TEST_CLIENT_ID = "metasync-test.apps.googleusercontent.com"
TEST_CLIENT_SECRET = "GOCSPX-emulated-secret"
TEST_EMAIL = "tester@example.com"
_ID_ALPHABET = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"


def _new_id() -> str:
    return "1" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(32))


class DriveError(Exception):
    """An API error answered in Google's format."""

    def __init__(self, status: int, reason: str, message: str, *, domain: str = "global",
                 location: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason
        self.message = message
        self.domain = domain
        self.location = location
        self.headers = headers or {}

    def response(self) -> Response:
        detail: dict[str, Any] = {"message": self.message, "domain": self.domain,
                                  "reason": self.reason}
        if self.location:
            detail.update(location=self.location, locationType="parameter")
        status_names = {400: "INVALID_ARGUMENT", 401: "UNAUTHENTICATED", 403: "PERMISSION_DENIED",
                        404: "NOT_FOUND", 409: "ALREADY_EXISTS", 429: "RESOURCE_EXHAUSTED",
                        500: "INTERNAL", 503: "UNAVAILABLE"}
        body = {"error": {"code": self.status, "message": self.message, "errors": [detail],
                          "status": status_names.get(self.status, "UNKNOWN")}}
        return json_response(self.status, body, self.headers)


def not_found(file_id: str) -> DriveError:
    return DriveError(404, "notFound", f"File not found: {file_id}.", location="fileId")


def invalid(message: str, location: str | None = None) -> DriveError:
    return DriveError(400, "invalid", message, location=location)


class _Clock:
    """RFC 3339 timestamps with milliseconds, strictly increasing."""

    def __init__(self) -> None:
        self._last = 0

    def now(self) -> str:
        ms = int(datetime.datetime.now(datetime.UTC).timestamp() * 1000)
        self._last = max(ms, self._last + 1)
        when = datetime.datetime.fromtimestamp(self._last / 1000, datetime.UTC)
        return when.strftime("%Y-%m-%dT%H:%M:%S.") + f"{self._last % 1000:03d}Z"


@dataclass
class Revision:
    id: str
    blob: str
    size: int
    md5: str
    sha256: str
    modified: str


@dataclass
class Item:
    id: str
    name: str
    mime: str
    parents: list[str]
    created: str
    modified: str
    properties: dict[str, str] = field(default_factory=dict)
    trashed: bool = False
    version: int = 1
    #: Revisions of a file, oldest first (the last is the head).
    revisions: list[Revision] = field(default_factory=list)

    @property
    def is_folder(self) -> bool:
        return self.mime == FOLDER

    def resource(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "kind": "drive#file", "id": self.id, "name": self.name, "mimeType": self.mime,
            "parents": list(self.parents), "trashed": self.trashed,
            "createdTime": self.created, "modifiedTime": self.modified,
            "version": str(self.version), "properties": dict(self.properties),
        }
        if self.revisions:
            head = self.revisions[-1]
            doc.update(size=str(head.size), md5Checksum=head.md5, sha256Checksum=head.sha256,
                       headRevisionId=head.id)
        return doc


@dataclass
class UploadSession:
    id: str
    blob: str
    meta: dict[str, Any]
    #: File to update (None: create).
    file_id: str | None
    offset: int = 0
    total: int | None = None
    result: dict[str, Any] | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)


# --- the query language -------------------------------------------------------------------

_TOKEN = re.compile(r"\s*(?:(?P<str>'(?:[^'\\]|\\.)*')|(?P<op>!=|<=|>=|=|<|>)|"
                    r"(?P<paren>[()])|(?P<word>[A-Za-z_][A-Za-z0-9_]*))")


def _tokens(q: str) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    pos = 0
    q = q.rstrip()
    while pos < len(q):
        match = _TOKEN.match(q, pos)
        if match is None or match.end() == pos:
            raise invalid("Invalid Value", "q")
        kind = match.lastgroup or ""
        text = match.group(kind)
        if kind == "str":
            text = re.sub(r"\\(.)", r"\1", text[1:-1])
        out.append((kind, text))
        pos = match.end()
    return out


Predicate = Callable[[Item], bool]


class _Parser:
    """``expr := term (or term)*; term := factor (and factor)*; factor := not factor |
    ( expr ) | 'ID' in parents | FIELD OP VALUE``."""

    def __init__(self, q: str) -> None:
        self.tokens = _tokens(q)
        self.pos = 0

    def _peek(self) -> tuple[str, str] | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def _take(self) -> tuple[str, str]:
        token = self._peek()
        if token is None:
            raise invalid("Invalid Value", "q")
        self.pos += 1
        return token

    def parse(self) -> tuple[Predicate, set[str] | None]:
        """The predicate, and the parent ids one of which every match must have (if
        the query says so): the emulator then looks only at those folders' children."""
        if not self.tokens:
            return (lambda item: True), None
        pred, parents = self._expr()
        if self._peek() is not None:
            raise invalid("Invalid Value", "q")
        return pred, parents

    def _expr(self) -> tuple[Predicate, set[str] | None]:
        parts = [self._term()]
        while self._peek() == ("word", "or"):
            self._take()
            parts.append(self._term())
        preds = [p for p, _ in parts]
        sets = [s for _, s in parts]
        parents = set().union(*sets) if all(s is not None for s in sets) else None  # type: ignore[arg-type]
        if len(preds) == 1:
            return preds[0], parents
        return (lambda item: any(p(item) for p in preds)), parents

    def _term(self) -> tuple[Predicate, set[str] | None]:
        parts = [self._factor()]
        while self._peek() == ("word", "and"):
            self._take()
            parts.append(self._factor())
        preds = [p for p, _ in parts]
        sets = [s for _, s in parts if s is not None]
        parents = min(sets, key=len) if sets else None
        if len(preds) == 1:
            return preds[0], parents
        return (lambda item: all(p(item) for p in preds)), parents

    def _factor(self) -> tuple[Predicate, set[str] | None]:
        kind, text = self._take()
        if (kind, text) == ("word", "not"):
            inner, _ = self._factor()
            return (lambda item: not inner(item)), None
        if (kind, text) == ("paren", "("):
            inner, parents = self._expr()
            if self._take() != ("paren", ")"):
                raise invalid("Invalid Value", "q")
            return inner, parents
        if kind == "str":
            if self._take() != ("word", "in") or self._take() != ("word", "parents"):
                raise invalid("Invalid Value", "q")
            parent = ROOT_ID if text == "root" else text
            return (lambda item: parent in item.parents), {parent}
        if kind != "word":
            raise invalid("Invalid Value", "q")
        op_kind, op = self._take()
        value_kind, value = self._take()
        if op_kind != "op":
            raise invalid("Invalid Value", "q")
        if text in ("name", "mimeType") and value_kind == "str" and op in ("=", "!="):
            attr = "name" if text == "name" else "mime"
            if op == "=":
                return (lambda item: getattr(item, attr) == value), None
            return (lambda item: getattr(item, attr) != value), None
        if text == "trashed" and value in ("true", "false") and op in ("=", "!="):
            want = (value == "true") == (op == "=")
            return (lambda item: item.trashed == want), None
        raise invalid("Invalid Value", "q")


# --- partial responses ------------------------------------------------------------------------


def _parse_fields(spec: str) -> dict[str, Any]:
    """``"a,b(c,d),e/f"`` -> ``{"a": None, "b": {"c": None, "d": None}, "e": {"f": None}}``."""
    result: dict[str, Any] = {}
    depth = 0
    current = ""
    items: list[str] = []
    for ch in spec:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        if ch == "," and depth == 0:
            items.append(current)
            current = ""
        else:
            current += ch
    items.append(current)
    for item in (i.strip() for i in items):
        if not item:
            continue
        name, paren, rest = item.partition("(")
        sub = _parse_fields(rest[:-1]) if paren else None
        path = name.split("/")
        target = result
        for part in path[:-1]:
            target = target.setdefault(part, {})
        target[path[-1]] = sub
    return result


def _select(value: Any, selection: dict[str, Any] | None) -> Any:
    if selection is None or "*" in selection:
        return value
    if isinstance(value, list):
        return [_select(v, selection) for v in value]
    if isinstance(value, dict):
        return {k: _select(value[k], sub) for k, sub in selection.items() if k in value}
    return value


# --- the emulator -----------------------------------------------------------------------------


class GDriveEmulator(Emulator):
    """Google Drive API v3 for one user (see the module docstring)."""

    name = "gdrive"

    def __init__(self, folder: Path, *, page_size: int = 1000) -> None:
        super().__init__()
        self.blobs = BlobStore(folder)
        self.oauth = OAuth2Server({TEST_CLIENT_ID: TEST_CLIENT_SECRET}, TEST_EMAIL)
        #: Largest page files.list answers (tests lower it).
        self.page_size = page_size
        #: Every n-th page is cut short (Drive may answer partial pages).
        self.short_pages = False
        #: The daily upload cap is reached: uploads answer 403 uploadLimitExceeded.
        self.uploads_blocked = False
        self._lock = threading.RLock()
        self._clock = _Clock()
        now = self._clock.now()
        self.items: dict[str, Item] = {ROOT_ID: Item(ROOT_ID, "My Drive", FOLDER, [], now, now)}
        self._generated: set[str] = set()
        self._sessions: dict[str, UploadSession] = {}
        self._pages: dict[str, list[dict[str, Any]]] = {}
        self._page_count = itertools.count()
        self.permissions: dict[str, list[dict[str, Any]]] = {}
        #: Parent id -> ids of its children (an index for listings).
        self.children: dict[str, set[str]] = {}
        #: Counters by method, for tests that count round trips.
        self.calls: dict[str, int] = {}
        #: The change log: (change id, file id), oldest first; the next id.
        self.changes: list[tuple[int, str]] = []
        self._next_change = 1

    # --- faults and errors ---------------------------------------------------------
    def render_fault(self, fault: str, request: Request) -> Response | None:
        retry = {"Retry-After": str(self.faults.retry_after)}
        if fault == THROTTLE:
            return DriveError(429, "rateLimitExceeded", "Rate Limit Exceeded",
                              domain="usageLimits", headers=retry).response()
        if fault == THROTTLE_NO_RETRY_AFTER:
            return DriveError(429, "rateLimitExceeded", "Rate Limit Exceeded",
                              domain="usageLimits").response()
        if fault == USER_RATE_LIMIT:
            return DriveError(403, "userRateLimitExceeded", "User Rate Limit Exceeded",
                              domain="usageLimits").response()
        if fault == RATE_LIMIT_403:
            return DriveError(403, "rateLimitExceeded", "Rate Limit Exceeded",
                              domain="usageLimits").response()
        if fault == QUOTA:
            return DriveError(403, "storageQuotaExceeded",
                              "The user's Drive storage quota has been exceeded.",
                              domain="usageLimits").response()
        if fault == UPLOAD_LIMIT:
            return _upload_limit().response()
        if fault == UNAVAILABLE:
            return DriveError(503, "backendError", "Backend Error", headers=retry).response()
        if fault == SERVER_ERROR:
            return DriveError(500, "internalError", "Internal Error").response()
        return super().render_fault(fault, request)

    def _api(self, request: Request, method: str, fn: Callable[[], Response]) -> Response:
        """Run one API method: authenticate, map errors, count."""
        with self._lock:
            self.calls[method] = self.calls.get(method, 0) + 1
        account, reason = self.oauth.check(request.bearer())
        if account is None:
            message = ("Request is missing required authentication credential." if reason ==
                       "missing" else "Request had invalid authentication credentials.")
            return DriveError(401, "authError" if reason != "missing" else "required", message,
                              location="Authorization",
                              headers={"WWW-Authenticate": 'Bearer realm="https://accounts.google.com/"'}
                              ).response()
        try:
            return fn()
        except DriveError as exc:
            return exc.response()
        except (ValueError, KeyError, TypeError) as exc:
            return DriveError(400, "badRequest", f"Bad Request: {exc}").response()

    def _fields(self, request: Request, doc: dict[str, Any], default: str) -> dict[str, Any]:
        return _select(doc, _parse_fields(request.query.get("fields") or default))  # type: ignore[no-any-return]

    # --- helpers -------------------------------------------------------------------
    def _item(self, file_id: str) -> Item:
        item = self.items.get(ROOT_ID if file_id == "root" else file_id)
        if item is None:
            raise not_found(file_id)
        return item

    def _check_parents(self, parents: list[str]) -> list[str]:
        resolved = []
        for parent in parents:
            item = self.items.get(ROOT_ID if parent == "root" else parent)
            if item is None:
                raise not_found(parent)
            if not item.is_folder:
                raise DriveError(400, "invalidParent", "The parent is not a folder.")
            resolved.append(item.id)
        return resolved

    def _take_id(self, meta: dict[str, Any]) -> str:
        """The new item's id: the given one (must be generated, unused) or a new one."""
        wanted = meta.get("id")
        if wanted is None:
            return _new_id()
        if wanted in self.items:
            raise DriveError(409, "duplicate", "A file already exists with the provided ID.")
        if wanted not in self._generated:
            raise invalid("The provided file ID is not usable.", "file.id")
        self._generated.discard(wanted)
        return str(wanted)

    def _revision(self, blob: str, size: int, md5: str, sha: str) -> Revision:
        return Revision(_new_id()[:20], blob, size, md5, sha, self._clock.now())

    def _commit(self, meta: dict[str, Any], file_id: str | None,
                content: tuple[str, int, str, str] | None) -> Item:
        """Create (``file_id`` None) or update an item. Caller holds the lock."""
        for name in ("name", "mimeType", "parents", "properties", "id"):
            value = meta.get(name)
            if value is not None and name in ("name", "mimeType", "id") and not isinstance(value, str):
                raise invalid(f"Invalid value for {name}", name)
        if file_id is None:
            parents = self._check_parents(list(meta.get("parents") or ["root"]))
            if len(parents) != 1:
                raise DriveError(403, "cannotAddParent", "Increasing the number of parents is not allowed.")
            new_id = self._take_id(meta)  # a refused create leaves the id usable
            now = self._clock.now()
            mime = str(meta.get("mimeType") or "application/octet-stream")
            item = Item(new_id, str(meta.get("name") or "Untitled"), mime, parents, now, now,
                        {str(k): str(v) for k, v in (meta.get("properties") or {}).items()})
            if item.is_folder and content is not None:
                raise DriveError(400, "badContent", "A folder cannot have content.")
            if not item.is_folder:
                blob, size, md5, sha = content or self._empty()
                item.revisions.append(self._revision(blob, size, md5, sha))
            self._add(item)
            return item
        item = self._item(file_id)
        if meta.get("id") not in (None, file_id):
            raise DriveError(403, "fieldNotWritable", "The resource body includes fields which are not directly writable.")
        if "name" in meta and meta["name"] is not None:
            item.name = str(meta["name"])
        for key, value in (meta.get("properties") or {}).items():
            if value is None:
                item.properties.pop(key, None)
            else:
                item.properties[str(key)] = str(value)
        if "trashed" in meta:
            item.trashed = bool(meta["trashed"])
        if content is not None:
            if item.is_folder:
                raise DriveError(400, "badContent", "A folder cannot have content.")
            item.revisions.append(self._revision(*content))
            while len(item.revisions) > KEEP_REVISIONS:
                self.blobs.delete(item.revisions.pop(0).blob)
        item.modified = self._clock.now()
        item.version += 1
        self._changed(item.id)
        return item

    def _changed(self, file_id: str) -> None:
        """Log a change of ``file_id``. Caller holds the lock."""
        self.changes.append((self._next_change, file_id))
        self._next_change += 1

    def _add(self, item: Item) -> None:
        self.items[item.id] = item
        for parent in item.parents:
            self.children.setdefault(parent, set()).add(item.id)
        self._changed(item.id)

    def _empty(self) -> tuple[str, int, str, str]:
        blob, size = self.blobs.write([b""])
        return blob, size, hashlib.md5(b"").hexdigest(), hashlib.sha256(b"").hexdigest()

    def _store(self, chunks: Iterator[bytes] | list[bytes]) -> tuple[str, int, str, str]:
        md5, sha = hashlib.md5(), hashlib.sha256()
        blob, size = self.blobs.write(chunks, (md5, sha))
        return blob, size, md5.hexdigest(), sha.hexdigest()

    def _remove(self, item: Item) -> None:
        doomed = [item]
        while doomed:
            victim = doomed.pop()
            self.items.pop(victim.id, None)
            self._changed(victim.id)
            for parent in victim.parents:
                self.children.get(parent, set()).discard(victim.id)
            for revision in victim.revisions:
                self.blobs.delete(revision.blob)
            if victim.is_folder:
                doomed.extend(self.items[c] for c in self.children.pop(victim.id, set())
                              if c in self.items)

    # --- OAuth ---------------------------------------------------------------------
    @route("GET", "/o/oauth2/auth")
    def authorize(self, request: Request) -> Response:
        """The consent screen, approved at once: redirect to the loopback address."""
        redirect = request.query.get("redirect_uri", "")
        if not re.match(r"^http://(localhost|127\.0\.0\.1)(:\d+)?(/.*)?$", redirect):
            return text_response(400, "Error 400: invalid_request (redirect_uri must be a "
                                      "loopback address for a desktop client)")
        try:
            code = self.oauth.approve(request.query)
        except OAuthError as exc:
            return text_response(400, f"Error 400: {exc.error} {exc.description}")
        query = {"code": code, "scope": request.query.get("scope", "")}
        if "state" in request.query:
            query = {"state": request.query["state"], **query}
        return Response(302, {"Location": f"{redirect}?{urlencode(query)}"})

    @route("POST", "/token")
    def token(self, request: Request) -> Response:
        form = request.form()
        basic = request.header("Authorization") or ""
        if basic.lower().startswith("basic "):  # client credentials (RFC 6749 §2.3.1)
            from urllib.parse import unquote

            user, _, password = base64.b64decode(basic[6:]).decode().partition(":")
            form.setdefault("client_id", unquote(user))
            form.setdefault("client_secret", unquote(password))
        try:
            answer = self.oauth.token(form)
        except OAuthError as exc:
            descriptions = {"invalid_grant": "Token has been expired or revoked."}
            return json_response(exc.status, {
                "error": exc.error,
                "error_description": exc.description or descriptions.get(exc.error, exc.error)})
        answer["token_type"] = "Bearer"
        if form.get("grant_type") == "refresh_token":
            answer.pop("refresh_token", None)  # Google keeps the refresh token
        return json_response(200, answer)

    @route("POST", "/revoke")
    def revoke(self, request: Request) -> Response:
        token = request.query.get("token") or request.form().get("token", "")
        self.oauth.revoke(token)
        return json_response(200, {})

    # --- about, ids ------------------------------------------------------------------
    @route("GET", "/drive/v3/about")
    def about(self, request: Request) -> Response:
        return self._api(request, "about.get", lambda: json_response(200, self._fields(
            request, {"kind": "drive#about", "user": {
                "kind": "drive#user", "displayName": "Test User", "me": True,
                "permissionId": "00000000000000000001", "emailAddress": TEST_EMAIL}},
            "kind")))

    @route("GET", "/drive/v3/files/generateIds")
    def generate_ids(self, request: Request) -> Response:
        def run() -> Response:
            count = int(request.query.get("count", "10"))
            if not 1 <= count <= 1000:
                raise invalid("Invalid value for count", "count")
            space = request.query.get("space", "drive")
            if space not in ("drive", "appDataFolder"):
                raise invalid("Invalid value for space", "space")
            ids = [_new_id() for _ in range(count)]
            with self._lock:
                self._generated.update(ids)
            return json_response(200, {"kind": "drive#generatedIds", "space": space, "ids": ids})

        return self._api(request, "files.generateIds", run)

    # --- files: list, get, delete ----------------------------------------------------
    def _list(self, request: Request, query: dict[str, str]) -> Response:
        def run() -> Response:
            size = int(query.get("pageSize", "100"))
            if not 1 <= size <= 1000:
                raise invalid("Invalid value for pageSize", "pageSize")
            size = min(size, self.page_size)
            token = query.get("pageToken")
            with self._lock:
                if token:
                    rest = self._pages.pop(token, None)
                    if rest is None:
                        raise invalid("Invalid Value", "pageToken")
                else:
                    predicate, parents = _Parser(query.get("q", "")).parse()
                    if parents is None:
                        candidates: Iterator[Item] | list[Item] = iter(self.items.values())
                    else:
                        candidates = [self.items[c] for p in parents
                                      for c in self.children.get(p, ()) if c in self.items]
                    matches = [i for i in candidates if i.id != ROOT_ID and predicate(i)]
                    matches.sort(key=lambda i: (i.name, i.id))
                    rest = [i.resource() for i in matches]
                if self.short_pages and next(self._page_count) % 2 == 1:
                    size = max(0, size // 3)  # Drive may answer a partial (even empty) page
                page, rest = rest[:size], rest[size:]
                doc: dict[str, Any] = {"kind": "drive#fileList", "incompleteSearch": False,
                                       "files": page}
                if rest:
                    next_token = secrets.token_urlsafe(18)
                    self._pages[next_token] = rest
                    doc["nextPageToken"] = next_token
            return json_response(200, _select(doc, _parse_fields(
                query.get("fields") or "kind,incompleteSearch,nextPageToken,files(kind,id,name,mimeType)")))

        return self._api(request, "files.list", run)

    @route("GET", "/drive/v3/files")
    def list_files(self, request: Request) -> Response:
        return self._list(request, request.query)

    @route("GET", "/drive/v3/files/(?P<id>[^/]+)")
    def get_file(self, request: Request) -> Response:
        file_id = request.params["id"]

        def run() -> Response:
            with self._lock:
                item = self._item(file_id)
                if request.query.get("alt") != "media":
                    return json_response(200, self._fields(request, item.resource(),
                                                           "kind,id,name,mimeType"))
                if item.is_folder:
                    raise DriveError(403, "fileNotDownloadable",
                                     "Only files with binary content can be downloaded.")
                revision = item.revisions[-1]
                handle = self.blobs.open(revision.blob)  # under the lock: one version
            return self._media(request, handle, revision.size)

        return self._api(request, "files.get", run)

    @route("GET", "/drive/v3/files/(?P<id>[^/]+)/revisions/(?P<rev>[^/]+)")
    def get_revision(self, request: Request) -> Response:
        def run() -> Response:
            with self._lock:
                item = self._item(request.params["id"])
                found = [r for r in item.revisions if r.id == request.params["rev"]]
                if not found:
                    raise DriveError(404, "notFound", f"Revision not found: {request.params['rev']}.",
                                     location="revisionId")
                revision = found[0]
                if request.query.get("alt") != "media":
                    return json_response(200, {"kind": "drive#revision", "id": revision.id,
                                               "size": str(revision.size),
                                               "md5Checksum": revision.md5})
                handle = self.blobs.open(revision.blob)
            return self._media(request, handle, revision.size)

        return self._api(request, "revisions.get", run)

    def _media(self, request: Request, handle: Any, size: int) -> Response:
        headers = {"Content-Type": "application/octet-stream", "Accept-Ranges": "bytes"}
        spec = request.header("Range")
        if not spec:
            return Response(200, headers, handle=handle, start=0, end=size)
        parsed = parse_range(spec, size)
        if parsed is None:
            handle.close()
            return DriveError(416, "requestedRangeNotSatisfiable",
                              "Request range not satisfiable",
                              headers={"Content-Range": f"bytes */{size}"}).response()
        start, end = parsed
        headers["Content-Range"] = f"bytes {start}-{end - 1}/{size}"
        return Response(206, headers, handle=handle, start=start, end=end)

    @route("DELETE", "/drive/v3/files/(?P<id>[^/]+)")
    def delete_file(self, request: Request) -> Response:
        def run() -> Response:
            with self._lock:
                item = self._item(request.params["id"])
                if item.id == ROOT_ID:
                    raise DriveError(403, "insufficientFilePermissions", "Cannot delete My Drive.")
                self._remove(item)
            return Response(204)

        return self._api(request, "files.delete", run)

    # --- files: create and update -----------------------------------------------------
    @route("POST", "/drive/v3/files")
    def create_metadata(self, request: Request) -> Response:
        if (request.header("X-HTTP-Method-Override") or "").upper() == "GET":
            return self._list(request, {**request.query, **request.form()})

        def run() -> Response:
            meta = request.json() or {}
            with self._lock:
                item = self._commit(meta, None, None)
                return json_response(200, self._fields(request, item.resource(),
                                                       "kind,id,name,mimeType"))

        return self._api(request, "files.create", run)

    @route("PATCH", "/drive/v3/files/(?P<id>[^/]+)")
    def update_metadata(self, request: Request) -> Response:
        def run() -> Response:
            meta = request.json() or {}
            with self._lock:
                item = self._commit(meta, request.params["id"], None)
                return json_response(200, self._fields(request, item.resource(),
                                                       "kind,id,name,mimeType"))

        return self._api(request, "files.update", run)

    @route("POST", "/upload/drive/v3/files")
    def upload_create(self, request: Request) -> Response:
        return self._upload(request, None)

    @route("PATCH", "/upload/drive/v3/files/(?P<id>[^/]+)")
    def upload_update(self, request: Request) -> Response:
        return self._upload(request, request.params["id"])

    def _upload(self, request: Request, file_id: str | None) -> Response:
        method = "files.create" if file_id is None else "files.update"

        def run() -> Response:
            kind = request.query.get("uploadType", "")
            if kind == "resumable":
                return self._start_session(request, file_id)
            if self.uploads_blocked:
                request.drain()
                raise _upload_limit()
            if kind == "media":
                meta: dict[str, Any] = {}
                content = self._store(request.chunks())
            elif kind == "multipart":
                meta, data = _multipart(request)
                content = self._store([data])
            else:
                raise invalid("Invalid value for uploadType", "uploadType")
            with self._lock:
                try:
                    item = self._commit(meta, file_id, content)
                except DriveError:
                    self.blobs.delete(content[0])
                    raise
                return json_response(200, self._fields(request, item.resource(),
                                                       "kind,id,name,mimeType"))

        return self._api(request, method, run)

    def _start_session(self, request: Request, file_id: str | None) -> Response:
        meta = request.json() or {}
        if self.uploads_blocked:
            raise _upload_limit()
        with self._lock:
            if file_id is not None:
                self._item(file_id)
            elif meta.get("id") is not None:
                if meta["id"] in self.items:
                    raise DriveError(409, "duplicate", "A file already exists with the provided ID.")
                if meta["id"] not in self._generated:
                    raise invalid("The provided file ID is not usable.", "file.id")
            self._check_parents(list(meta.get("parents") or ["root"])) if file_id is None else None
            session_id = secrets.token_urlsafe(24)
            blob, _ = self.blobs.write([b""])
            length = request.header("X-Upload-Content-Length")
            self._sessions[session_id] = UploadSession(
                session_id, blob, meta, file_id, total=int(length) if length else None)
        host = request.header("Host") or self.base_url.split("://", 1)[1]
        path = "/upload/drive/v3/files" + (f"/{file_id}" if file_id else "")
        query = urlencode({**{k: v for k, v in request.query.items() if k != "upload_id"},
                           "upload_id": session_id})
        return Response(200, {"Location": f"https://{host}{path}?{query}",
                              "X-GUploader-UploadID": session_id})

    @route("PUT", "/upload/drive/v3/files(?:/(?P<id>[^/]+))?")
    def upload_piece(self, request: Request) -> Response:
        """A piece of a resumable upload, or a status query (``bytes */N``). Sessions
        are authorized by their id (as Google's are)."""
        with self._lock:
            self.calls["upload.put"] = self.calls.get("upload.put", 0) + 1
            session = self._sessions.get(request.query.get("upload_id", ""))
        if session is None:
            request.drain()
            return DriveError(404, "notFound", "No such upload session.").response()
        try:
            with session.lock:
                return self._piece(request, session)
        except DriveError as exc:
            return exc.response()

    def _piece(self, request: Request, session: UploadSession) -> Response:
        if session.result is not None:
            request.drain()
            return json_response(200, session.result)
        spec = (request.header("Content-Range") or "").strip()
        match = re.fullmatch(r"bytes (?:(\d+)-(\d+)|\*)/(\d+|\*)", spec)
        length = int(request.header("Content-Length", "0") or 0)
        if not spec and length == 0:
            match = re.fullmatch(r"bytes \*/(\*)", "bytes */*")
        if match is None:
            request.drain()
            raise invalid("Invalid Content-Range", "Content-Range")
        total = None if match.group(3) == "*" else int(match.group(3))
        if total is not None:
            if session.total is not None and session.total != total:
                request.drain()
                raise invalid("The total size differs from the one announced")
            session.total = total
        if match.group(1) is not None:
            if self.uploads_blocked:
                request.drain()
                raise _upload_limit()
            start, end = int(match.group(1)), int(match.group(2))
            if end - start + 1 != length or start > session.offset:
                request.drain()
                raise invalid("Invalid Content-Range for this upload session")
            final = session.total is not None and end + 1 == session.total
            if not final and length % RESUMABLE_UNIT:
                request.drain()
                raise invalid("Pieces of a resumable upload must be multiples of 256 KiB")
            # A side blob first: a body cut short leaves the session as it was.
            part, size = self.blobs.write(request.chunks())
            if size != length:
                self.blobs.delete(part)
                raise invalid("The piece ended early")
            skip = session.offset - start  # bytes Drive has already (a resent piece)
            with self.blobs.open(part) as piece:
                piece.seek(skip)
                self.blobs.append(session.blob, iter(lambda: piece.read(1 << 20), b""))
            self.blobs.delete(part)
            session.offset = max(session.offset, end + 1)
        else:
            request.drain()
        if session.total is not None and session.offset >= session.total:
            return self._finish(request, session)
        headers = {"Range": f"bytes=0-{session.offset - 1}"} if session.offset else {}
        return Response(308, {**headers, "Content-Length": "0"})

    def _finish(self, request: Request, session: UploadSession) -> Response:
        md5, sha = hashlib.md5(), hashlib.sha256()
        with self.blobs.open(session.blob) as whole:
            for piece in iter(lambda: whole.read(1 << 20), b""):
                md5.update(piece)
                sha.update(piece)
        content = (session.blob, session.offset, md5.hexdigest(), sha.hexdigest())
        with self._lock:
            item = self._commit(session.meta, session.file_id, content)
            session.result = self._fields(request, item.resource(), "kind,id,name,mimeType")
        return json_response(200, session.result)

    # --- changes ---------------------------------------------------------------------
    @route("GET", "/drive/v3/changes/startPageToken")
    def start_page_token(self, request: Request) -> Response:
        def run() -> Response:
            with self._lock:
                token = str(self._next_change)
            return json_response(200, self._fields(
                request, {"kind": "drive#startPageToken", "startPageToken": token},
                "kind,startPageToken"))

        return self._api(request, "changes.getStartPageToken", run)

    @route("GET", "/drive/v3/changes")
    def list_changes(self, request: Request) -> Response:
        def run() -> Response:
            raw = request.query.get("pageToken")
            if not raw:
                raise DriveError(400, "required", "Required parameter: pageToken",
                                 location="pageToken")
            try:
                start = int(raw)
            except ValueError:
                raise invalid("Invalid Value", "pageToken") from None
            size = int(request.query.get("pageSize", "100"))
            if not 1 <= size <= 1000:
                raise invalid("Invalid value for pageSize", "pageSize")
            removed_too = request.query.get("includeRemoved", "true") != "false"
            with self._lock:
                pending = [(n, f) for n, f in self.changes if n >= start]
                page = pending[:size]
                changes = []
                for _, file_id in page:
                    item = self.items.get(file_id)
                    if item is None and not removed_too:
                        continue
                    change: dict[str, Any] = {
                        "kind": "drive#change", "changeType": "file", "time": self._clock.now(),
                        "removed": item is None, "fileId": file_id}
                    if item is not None:
                        change["file"] = item.resource()
                    changes.append(change)
                doc: dict[str, Any] = {"kind": "drive#changeList", "changes": changes}
                if len(pending) > size:
                    doc["nextPageToken"] = str(page[-1][0] + 1)
                else:
                    doc["newStartPageToken"] = str(self._next_change)
            return json_response(200, self._fields(
                request, doc, "kind,nextPageToken,newStartPageToken,changes(kind,changeType,"
                "time,removed,fileId,file(kind,id,name,mimeType))"))

        return self._api(request, "changes.list", run)

    # --- permissions -----------------------------------------------------------------
    @route("GET", "/drive/v3/files/(?P<id>[^/]+)/permissions")
    def list_permissions(self, request: Request) -> Response:
        def run() -> Response:
            with self._lock:
                self._item(request.params["id"])
                owner = {"kind": "drive#permission", "id": "00000000000000000001",
                         "type": "user", "role": "owner", "emailAddress": TEST_EMAIL}
                perms = [owner, *self.permissions.get(request.params["id"], [])]
            return json_response(200, _select({"kind": "drive#permissionList",
                                               "permissions": perms},
                                              _parse_fields(request.query.get("fields") or "*")))

        return self._api(request, "permissions.list", run)

    @route("POST", "/drive/v3/files/(?P<id>[^/]+)/permissions")
    def create_permission(self, request: Request) -> Response:
        def run() -> Response:
            body = request.json() or {}
            email = str(body.get("emailAddress", ""))
            if body.get("type") != "user" or body.get("role") not in ("reader", "commenter", "writer"):
                raise invalid("Invalid permission type or role")
            if not re.fullmatch(r"[^@\s]+@[^@\s]+\.[^@\s]+", email):
                raise DriveError(400, "invalid", "Invalid email or User ID", location="permission.emailAddress")
            with self._lock:
                self._item(request.params["id"])
                permission = {"kind": "drive#permission", "id": str(secrets.randbelow(10**20)),
                              "type": "user", "role": body["role"], "emailAddress": email}
                self.permissions.setdefault(request.params["id"], []).append(permission)
            return json_response(200, self._fields(request, permission, "kind,id,type,role"))

        return self._api(request, "permissions.create", run)

    # --- test helpers ----------------------------------------------------------------
    def path_items(self, path: str, parent: str = ROOT_ID) -> list[Item]:
        """Every item at ``path`` (names, '/'-separated) below ``parent``."""
        with self._lock:
            current = [parent]
            found: list[Item] = []
            for name in [p for p in path.split("/") if p]:
                found = [i for i in self.items.values() if i.name == name and not i.trashed
                         and any(p in i.parents for p in current)]
                current = [i.id for i in found]
            return found

    def make_folder(self, path: str) -> str:
        """Create the folders of ``path`` under My Drive as a user would (once)."""
        with self._lock:
            parent = ROOT_ID
            for name in [p for p in path.split("/") if p]:
                existing = [i for i in self.items.values() if i.name == name and i.is_folder
                            and parent in i.parents and not i.trashed]
                if existing:
                    parent = existing[0].id
                    continue
                now = self._clock.now()
                item = Item(_new_id(), name, FOLDER, [parent], now, now)
                self._add(item)
                parent = item.id
            return parent

    def add_item(self, parent: str, name: str, data: bytes | None) -> str:
        """Add a file (``data``) or folder (None) directly, as another app would."""
        with self._lock:
            now = self._clock.now()
            item = Item(_new_id(), name, FOLDER if data is None else "application/octet-stream",
                        [parent], now, now)
            if data is not None:
                item.revisions.append(self._revision(*self._store([data])))
            self._add(item)
            return item.id

    def content(self, file_id: str) -> bytes:
        with self._lock:
            revision = self.items[file_id].revisions[-1]
        return self.blobs.path(revision.blob).read_bytes()

    def close(self) -> None:
        self.blobs.close()


def _upload_limit() -> DriveError:
    return DriveError(403, "uploadLimitExceeded",
                      "The user has exceeded their daily upload limit.", domain="usageLimits")


def _multipart(request: Request) -> tuple[dict[str, Any], bytes]:
    """The metadata and the media of a multipart/related body."""
    content_type = request.header("Content-Type") or ""
    match = re.search(r'boundary="?([^";]+)"?', content_type)
    if not content_type.startswith("multipart/related") or match is None:
        raise invalid("multipart uploads need a multipart/related body")
    delimiter = b"--" + match.group(1).encode()
    body = request.body()
    sections = body.split(delimiter)
    if len(sections) < 4 or not sections[-1].startswith(b"--"):
        raise invalid("malformed multipart body")
    linesep = b"\r\n" if sections[1].startswith(b"\r\n") else b"\n"
    parts = []
    for section in sections[1:-1]:
        section = section[len(linesep):]
        if section.endswith(linesep):
            section = section[: -len(linesep)]
        _, sep, content = section.partition(linesep + linesep)
        if not sep:
            raise invalid("malformed multipart part")
        parts.append(content)
    if len(parts) != 2:
        raise invalid("a multipart upload has exactly two parts")
    meta = json.loads(parts[0] or b"{}")
    return meta, parts[1]


# --- fixtures --------------------------------------------------------------------------------


@dataclass
class GDriveService(EmulatorService):
    """A running Google Drive emulator plus what clients need to reach it."""

    emulator: GDriveEmulator

    def env(self) -> dict[str, str]:
        return {
            **environment_for("gdrive", self.server),
            "METASYNC_GDRIVE_APP_KEY": TEST_CLIENT_ID,
            "METASYNC_GDRIVE_APP_SECRET": TEST_CLIENT_SECRET,
        }

    def sign_in(self, account: str = "default") -> None:
        """Store a grant for ``account`` (as `metasync auth gdrive` would)."""
        import time

        from metasync.backends.cloud import Grant, grant_lock, token_store

        verifier = "v" * 64
        challenge = pkce_challenge(verifier)
        code = self.emulator.oauth.approve(
            {"client_id": TEST_CLIENT_ID, "response_type": "code", "code_challenge": challenge,
             "code_challenge_method": "S256"})
        answer = self.emulator.oauth.token(
            {"grant_type": "authorization_code", "code": code, "client_id": TEST_CLIENT_ID,
             "code_verifier": verifier, "client_secret": TEST_CLIENT_SECRET})
        grant = Grant("gdrive", account, TEST_CLIENT_ID, answer["refresh_token"],
                      answer["access_token"], time.time() + answer["expires_in"],
                      TEST_CLIENT_SECRET, {"email": TEST_EMAIL})
        with grant_lock("gdrive", account):
            token_store().save(grant)

    def faults_via_proxy(self) -> EmulatorFaults:
        return EmulatorFaults(
            self.server,
            (THROTTLE, USER_RATE_LIMIT, UNAVAILABLE, RATE_LIMIT_403, THROTTLE_NO_RETRY_AFTER,
             SERVER_ERROR),
        )


@contextlib.contextmanager
def running_gdrive() -> Iterator[GDriveService]:
    with emulator_server("gdrive", GDriveEmulator) as (server, emulator):
        # Answers are written as headers, then body: without TCP_NODELAY (inherited by
        # accepted sockets on Linux) each answer waits ~40 ms for the client's delayed ACK.
        server._server.socket.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        yield GDriveService(server, emulator)


@pytest.fixture(scope="session")
def gdrive_service() -> Iterator[GDriveService]:
    """A Google Drive emulator for the whole session, aimed at by the process
    environment (child processes inherit it), with the default account signed in."""
    with running_gdrive() as service:
        yield from serve_for_session(service)


__all__ = ["GDRIVE_FAULTS", "GDriveEmulator", "GDriveService"]
