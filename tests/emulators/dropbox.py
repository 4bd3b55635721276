"""An emulator of the part of the Dropbox API v2 the ``dropbox:`` backend uses.

Written from Dropbox's HTTP documentation (developers' reference for API v2), not
from the SDK: the SDK is what is under test. Served over TLS (the SDK only speaks
``https://``), on one port for the ``api``, ``content``, ``notify`` and ``www``
hosts. Faithful in what the backend relies on:

- **Routes**: RPC routes take a JSON body; upload and download routes take their
  argument in the ``Dropbox-API-Arg`` header (ASCII JSON) and answer download results
  in ``Dropbox-API-Result``. ``files/get_metadata``, ``files/upload``,
  ``files/upload_session/{start,append_v2,finish}``, ``files/download`` (with
  ``Range``, and ``rev:`` paths), ``files/delete_v2``, ``files/create_folder_v2``,
  ``files/list_folder`` + ``/continue`` (cursors, ``has_more``, pages of at most
  :attr:`DropboxEmulator.page_size` entries; the last page's cursor lists the changes
  since, as file/folder metadata or ``deleted`` entries),
  ``files/list_folder/get_latest_cursor``, ``files/list_folder/longpoll`` (the notify
  host: no sign-in, ``timeout`` 30..480 s, blocks until a change below the cursor's
  folder or the timeout, answers ``{"changes", "backoff"?}``; a change journal of the
  account), ``users/get_current_account``,
  ``sharing/share_folder``, ``sharing/add_folder_member``, ``auth/token/revoke``,
  and OAuth 2 at ``/oauth2/authorize`` (auto-approved, PKCE) and ``/oauth2/token``.
- **Paths**: case-insensitive and case-preserving (``path_lower``/``path_display``);
  uploads create missing parent folders; a file cannot be a folder's parent.
- **Write modes**: ``add`` (conflict if the name exists — unless the content is
  identical and ``strict_conflict`` is off, as Dropbox does), ``overwrite``,
  ``update`` (by ``rev``; ``strict_conflict`` also fails on a deleted file);
  ``autorename``. Identical content keeps the ``rev``.
- **Errors**: status 409 with ``{"error_summary", "error"}`` bodies (``path/
  not_found/``, ``path/conflict/file/``, ``incorrect_offset`` with
  ``correct_offset``, ``content_hash_mismatch``, ...), 401 ``expired_access_token``
  / ``invalid_access_token``, 400 for malformed input, 429 with
  ``{"error": {"reason": {".tag": "too_many_requests"|"too_many_write_operations"},
  "retry_after": N}}`` and ``Retry-After``.
- **Content hash**: the ``content_hash`` of file metadata (SHA-256 of the
  SHA-256s of 4 MiB blocks) and the check of a ``content_hash`` argument.
- **Limits**: 150 MiB per upload request (``payload_too_large``).

File contents live on disk (:class:`BlobStore`); revisions of a file stay readable
by ``rev:`` until the file is deleted (at most :data:`KEEP_REVISIONS` per file).
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import itertools
import json
import secrets
import threading
from collections.abc import Iterator
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

#: Dropbox-specific fault kinds (see :meth:`DropboxEmulator.render_fault`).
TOO_MANY_WRITE_OPERATIONS = "too_many_write_operations"  # 429, write throttling
WRITE_CONFLICT_THROTTLE = "write/too_many_write_operations"  # 409 WriteError on writes
DROPBOX_FAULTS = (*GENERIC_FAULTS, TOO_MANY_WRITE_OPERATIONS)

#: Largest body of one upload request (files/upload, upload_session/*).
MAX_UPLOAD_REQUEST = 150 * 1024 * 1024
BLOCK = 4 * 1024 * 1024
KEEP_REVISIONS = 10
#: The app key of the test app (a public PKCE client, as `metasync auth` uses).
TEST_APP_KEY = "metasync-test-app"
TEST_ACCOUNT_ID = "dbid:AAemulatedUser00000000000000000000000"[:40]
TEST_EMAIL = "tester@example.com"
_DISALLOWED = {"desktop.ini", "thumbs.db", ".ds_store", "icon\r", ".dropbox", ".dropbox.attr"}


class ContentHasher:
    """Dropbox's content hash, written from its documentation."""

    def __init__(self) -> None:
        self._overall = hashlib.sha256()
        self._block = hashlib.sha256()
        self._in_block = 0

    def update(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            take = min(BLOCK - self._in_block, len(view))
            self._block.update(view[:take])
            self._in_block += take
            view = view[take:]
            if self._in_block == BLOCK:
                self._overall.update(self._block.digest())
                self._block = hashlib.sha256()
                self._in_block = 0

    def hexdigest(self) -> str:
        overall = self._overall.copy()
        if self._in_block:
            overall.update(self._block.digest())
        return overall.hexdigest()


class DropboxApiError(Exception):
    """An endpoint-specific error: status 409 (default) with this ``error`` body."""

    def __init__(self, error: Any, summary: str, status: int = 409) -> None:
        super().__init__(summary)
        self.error = error
        self.summary = summary
        self.status = status
        self.write_reason: dict[str, Any] | None = None


def _tag(tag: str, /, **fields: Any) -> dict[str, Any]:
    return {".tag": tag, **fields}


def lookup_error(outer: str, reason: str) -> DropboxApiError:
    return DropboxApiError(_tag(outer, **{outer: _tag(reason)}), f"{outer}/{reason}/")


def write_error(outer: str, reason: dict[str, Any], summary: str) -> DropboxApiError:
    """A WriteError ``reason`` nested under the union tag ``outer`` (as
    create_folder_v2, delete_v2 and upload_session/finish answer); files/upload
    re-renders it as an UploadWriteFailed (see :func:`as_upload_error`)."""
    error = DropboxApiError(_tag(outer, **{outer: reason}), f"{outer}/{summary}")
    error.write_reason = reason
    return error


def as_upload_error(exc: DropboxApiError) -> DropboxApiError:
    """files/upload's form of a write error: the struct UploadWriteFailed inlined
    under ``path`` (``reason`` + ``upload_session_id``)."""
    if exc.write_reason is None:
        return exc
    return DropboxApiError(
        _tag("path", reason=exc.write_reason, upload_session_id=_session_id()), exc.summary
    )


def _session_id() -> str:
    return "pid_upload_session:" + secrets.token_urlsafe(16)


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class Node:
    """A file or folder."""

    is_folder: bool
    path_display: str
    id: str
    rev: str = ""
    size: int = 0
    blob: str = ""
    content_hash: str = ""
    server_modified: str = ""
    shared_folder_id: str | None = None
    #: Earlier revisions still readable by rev: (rev -> (blob, size, hash)).
    history: dict[str, tuple[str, int, str]] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.path_display.rsplit("/", 1)[-1]

    def metadata(self) -> dict[str, Any]:
        if self.is_folder:
            doc: dict[str, Any] = {
                ".tag": "folder",
                "name": self.name,
                "path_lower": self.path_display.lower(),
                "path_display": self.path_display,
                "id": self.id,
            }
            if self.shared_folder_id:
                doc["shared_folder_id"] = self.shared_folder_id
                doc["sharing_info"] = {
                    "read_only": False,
                    "shared_folder_id": self.shared_folder_id,
                    "traverse_only": False,
                    "no_access": False,
                }
            return doc
        return {
            ".tag": "file",
            "name": self.name,
            "path_lower": self.path_display.lower(),
            "path_display": self.path_display,
            "id": self.id,
            "client_modified": self.server_modified,
            "server_modified": self.server_modified,
            "rev": self.rev,
            "size": self.size,
            "is_downloadable": True,
            "content_hash": self.content_hash,
        }


@dataclass
class UploadSession:
    blob: str
    offset: int = 0
    closed: bool = False
    #: Held while a request of this session runs (appends never interleave).
    lock: threading.Lock = field(default_factory=threading.Lock)


class DropboxEmulator(Emulator):
    """Dropbox API v2 for one user (see the module docstring)."""

    name = "dropbox"

    def __init__(self, folder: Path, *, page_size: int = 500) -> None:
        super().__init__()
        self.blobs = BlobStore(folder)
        self.oauth = OAuth2Server({TEST_APP_KEY: None}, TEST_ACCOUNT_ID)
        self.page_size = page_size
        self._lock = threading.RLock()
        #: path_lower -> node ("" is the root folder).
        self.nodes: dict[str, Node] = {"": Node(True, "", "id:root")}
        self._sessions: dict[str, UploadSession] = {}
        self._cursors: dict[str, list[dict[str, Any]]] = {}
        self._revs = itertools.count(0x1000000000)
        #: Members added per shared folder id.
        self.members: dict[str, set[str]] = {}
        #: Counters by route, for tests that count round trips.
        self.calls: dict[str, int] = {}
        #: The change journal: (sequence number, path_lower) of every path created,
        #: changed or removed, oldest first; ``_changes`` is notified on each.
        self.journal: list[tuple[int, str]] = []
        self._seq = 0
        self._changes = threading.Condition(self._lock)
        #: Cursor -> (folder path_lower, recursive, journal position it lists from).
        self._positions: dict[str, tuple[str, bool, int]] = {}
        #: Real seconds a long-poll waits per second of its ``timeout`` (tests shrink
        #: Dropbox's 30 s minimum), and the ``backoff`` it answers (None: none).
        self.longpoll_scale = 1.0
        self.longpoll_backoff: int | None = None
        self._closed = False

    # --- faults and errors ---------------------------------------------------------
    def render_fault(self, fault: str, request: Request) -> Response | None:
        retry = self.faults.retry_after
        if fault in (THROTTLE, TOO_MANY_WRITE_OPERATIONS):
            reason = "too_many_requests" if fault == THROTTLE else "too_many_write_operations"
            return json_response(
                429,
                {"error_summary": f"{reason}/..", "error": {"reason": _tag(reason),
                                                             "retry_after": retry}},
                {"Retry-After": str(retry)},
            )
        if fault == WRITE_CONFLICT_THROTTLE:
            return self._error(
                as_upload_error(write_error("path", _tag("too_many_write_operations"),
                                            "too_many_write_operations/"))
            )
        if fault == QUOTA:
            return self._error(as_upload_error(
                write_error("path", _tag("insufficient_space"), "insufficient_space/")))
        if fault == THROTTLE_NO_RETRY_AFTER:
            return text_response(429, "Too many requests")
        if fault == UNAVAILABLE:
            return text_response(503, "Service Unavailable", {"Retry-After": str(retry)})
        if fault == SERVER_ERROR:
            return text_response(500, "Internal Server Error")
        return super().render_fault(fault, request)

    def _error(self, exc: DropboxApiError) -> Response:
        body = {"error_summary": exc.summary + ".", "error": exc.error}
        return json_response(exc.status, body)

    def _call(self, request: Request, name: str, fn: Any, *, auth: bool = True) -> Response:
        """Run one API route: authenticate, parse the argument, map errors."""
        with self._lock:
            self.calls[name] = self.calls.get(name, 0) + 1
        if auth:
            account, reason = self.oauth.check(request.bearer())
            if account is None:
                if reason == "missing":
                    return text_response(
                        400, "Error in call to API function: Must provide HTTP header "
                        '"Authorization" or URL parameter "authorization".'
                    )
                tag = "expired_access_token" if reason == "expired" else "invalid_access_token"
                return json_response(401, {"error_summary": f"{tag}/.", "error": _tag(tag)})
        try:
            return fn()  # type: ignore[no-any-return]
        except DropboxApiError as exc:
            return self._error(exc)
        except (ValueError, KeyError, TypeError) as exc:
            return text_response(400, f"Error in call to API function \"{name}\": {exc}")

    @staticmethod
    def _header_arg(request: Request) -> dict[str, Any]:
        raw = request.header("Dropbox-API-Arg") or request.query.get("arg") or "{}"
        raw.encode("ascii")  # must be ASCII: non-ASCII is escaped as \\uXXXX
        arg = json.loads(raw)
        if not isinstance(arg, dict):
            raise ValueError("argument must be a JSON object")
        return arg

    # --- paths ---------------------------------------------------------------------
    @staticmethod
    def _normalize(path: str) -> str:
        if path in ("", "/"):
            return ""
        if not path.startswith("/") or path.endswith("/") or "//" in path:
            raise DropboxApiError(_tag("path", path=_tag("malformed_path")),
                                  "path/malformed_path/")
        return path

    def _resolve(self, path: str, outer: str = "path") -> Node:
        if path.startswith("id:"):
            for node in self.nodes.values():
                if node.id == path:
                    return node
            raise lookup_error(outer, "not_found")
        normalized = self._normalize(path)
        node = self.nodes.get(normalized.lower())
        if node is None:
            raise lookup_error(outer, "not_found")
        return node

    def _new_rev(self) -> str:
        return f"{next(self._revs):x}"

    def _ensure_parents(self, path: str) -> None:
        """Create the folders above ``path``; a file in the way is a conflict."""
        parts = path.split("/")[1:-1]
        current = ""
        for part in parts:
            current += "/" + part
            node = self.nodes.get(current.lower())
            if node is None:
                self.nodes[current.lower()] = Node(True, current, "id:" + secrets.token_hex(8))
                self._record(current)
            elif not node.is_folder:
                raise write_error("path", _tag("conflict", conflict=_tag("file_ancestor")),
                                  "conflict/file_ancestor/")

    def _check_name(self, path: str) -> None:
        if path.rsplit("/", 1)[-1].lower() in _DISALLOWED:
            raise write_error("path", _tag("disallowed_name"), "disallowed_name/")

    def _commit(self, commit: dict[str, Any], blob: str, size: int, digest: str) -> Node:
        """Write a finished upload at ``commit["path"]`` per its write mode. Caller holds
        the lock. The blob is dropped if nothing is written."""
        path = self._normalize(str(commit["path"]))
        if path == "":
            raise write_error("path", _tag("malformed_path"), "malformed_path/")
        self._check_name(path)
        mode = commit.get("mode", "add")
        if isinstance(mode, str):
            mode = {".tag": mode}
        strict = bool(commit.get("strict_conflict", False))
        autorename = bool(commit.get("autorename", False))
        existing = self.nodes.get(path.lower())

        def conflict(kind: str) -> DropboxApiError:
            return write_error("path", _tag("conflict", conflict=_tag(kind)), f"conflict/{kind}/")

        def renamed() -> str:
            stem, dot, ext = path.rpartition(".")
            base, suffix = (stem, dot + ext) if dot and "/" not in ext and stem else (path, "")
            for n in itertools.count(1):
                candidate = f"{base} ({n}){suffix}"
                if candidate.lower() not in self.nodes:
                    return candidate
            raise AssertionError("unreachable")

        tag = mode[".tag"]
        if existing is not None and existing.is_folder:
            if not autorename:
                raise conflict("folder")
            path, existing = renamed(), None
        if tag == "add" and existing is not None:
            if existing.content_hash == digest and not strict:
                self.blobs.delete(blob)
                return existing
            if not autorename:
                raise conflict("file")
            path, existing = renamed(), None
        elif tag == "update":
            rev = str(mode["update"])
            if existing is None:
                if strict:
                    raise conflict("file")
            elif existing.rev != rev and not (existing.content_hash == digest and not strict):
                if not autorename:
                    raise conflict("file")
                stem = path.rsplit(".", 1)
                path = f"{stem[0]} (conflicted copy){'.' + stem[1] if len(stem) > 1 else ''}"
                existing = self.nodes.get(path.lower())
        elif tag not in ("add", "overwrite", "update"):
            raise ValueError(f"unknown write mode {tag!r}")
        self._ensure_parents(path)
        if existing is not None and existing.content_hash == digest:
            self.blobs.delete(blob)  # identical content: no new revision
            return existing
        node = existing or Node(False, path, "id:" + secrets.token_hex(8))
        if existing is not None:
            node.history[node.rev] = (node.blob, node.size, node.content_hash)
            while len(node.history) > KEEP_REVISIONS:
                old = next(iter(node.history))
                self.blobs.delete(node.history.pop(old)[0])
        node.rev, node.blob, node.size, node.content_hash = self._new_rev(), blob, size, digest
        node.server_modified = _now()
        self.nodes[path.lower()] = node
        self._record(path)
        return node

    def _record(self, path: str) -> None:
        """Journal a change of ``path`` and wake the long-polls. Caller holds the lock."""
        self._seq += 1
        self.journal.append((self._seq, path.lower()))
        self._changes.notify_all()

    @staticmethod
    def _below(path: str, folder: str, recursive: bool) -> bool:
        """``path`` (lower-cased) is in ``folder`` (below it, if ``recursive``)."""
        if not path.startswith(folder + "/"):
            return False
        return recursive or "/" not in path[len(folder) + 1 :]

    def _changed_paths(self, position: tuple[str, bool, int]) -> list[str]:
        """The paths below a cursor's folder changed after its position, each once, in
        the order of their first change. Caller holds the lock."""
        folder, recursive, seq = position
        seen: dict[str, None] = {}
        for number, path in reversed(self.journal):
            if number <= seq:
                break
            if self._below(path, folder, recursive):
                seen[path] = None
        return list(reversed(seen))

    def _remove(self, node: Node) -> None:
        prefix = node.path_display.lower() + "/"
        for key in [k for k in self.nodes if k == node.path_display.lower() or k.startswith(prefix)]:
            gone = self.nodes.pop(key)
            self._record(key)
            if not gone.is_folder:
                self.blobs.delete(gone.blob)
                for blob, _, _ in gone.history.values():
                    self.blobs.delete(blob)

    def _store_body(self, request: Request) -> tuple[str, int, str]:
        """Stream the request body into a new blob: (blob, size, content hash)."""
        length = int(request.header("Content-Length", "0") or 0)
        if length > MAX_UPLOAD_REQUEST:
            request.drain()
            raise DropboxApiError(_tag("payload_too_large"), "payload_too_large/")
        hasher = ContentHasher()
        blob, size = self.blobs.write(request.chunks(), (hasher,))
        return blob, size, hasher.hexdigest()

    @staticmethod
    def _check_hash(arg: dict[str, Any], digest: str, blob: str, blobs: BlobStore) -> None:
        given = arg.get("content_hash")
        if given is not None and given != digest:
            blobs.delete(blob)
            raise DropboxApiError(_tag("content_hash_mismatch"), "content_hash_mismatch/")

    # --- OAuth ---------------------------------------------------------------------
    @route("GET", "/oauth2/authorize")
    def authorize(self, request: Request) -> Response:
        """The consent page: approve at once and show the code (no-redirect flow) or
        redirect to ``redirect_uri`` with it."""
        try:
            code = self.oauth.approve(request.query)
        except OAuthError as exc:
            return text_response(400, f"Error ({exc.error}): {exc.description}")
        redirect = request.query.get("redirect_uri")
        if redirect:
            state = request.query.get("state")
            query = urlencode({"code": code, **({"state": state} if state else {})})
            return Response(302, {"Location": f"{redirect}?{query}"})
        return text_response(200, f"Enter this code into metasync: {code}\n")

    @route("POST", "/oauth2/token")
    def token(self, request: Request) -> Response:
        form = request.form()
        try:
            answer = self.oauth.token(form)
        except OAuthError as exc:
            return json_response(exc.status, {"error": exc.error,
                                              "error_description": exc.description})
        if form.get("grant_type") == "authorization_code":
            answer.update(account_id=TEST_ACCOUNT_ID, uid="12345")
        return json_response(200, answer)

    @route("POST", "/2/auth/token/revoke")
    def token_revoke(self, request: Request) -> Response:
        token = request.bearer() or ""

        def run() -> Response:
            self.oauth.revoke(token)
            return json_response(200, None)

        return self._call(request, "auth/token/revoke", run)

    @route("POST", "/2/users/get_current_account")
    def current_account(self, request: Request) -> Response:
        return self._call(request, "users/get_current_account", lambda: json_response(200, {
            "account_id": TEST_ACCOUNT_ID,
            "name": {"given_name": "Test", "surname": "User", "familiar_name": "Test",
                     "display_name": "Test User", "abbreviated_name": "TU"},
            "email": TEST_EMAIL,
            "email_verified": True,
            "disabled": False,
            "locale": "en",
            "referral_link": "https://www.dropbox.com/referrals/x",
            "is_paired": False,
            "account_type": _tag("basic"),
            "root_info": _tag("user", root_namespace_id="1", home_namespace_id="1"),
        }))

    # --- files: metadata, folders, delete, listing -----------------------------------
    @route("POST", "/2/files/get_metadata")
    def get_metadata(self, request: Request) -> Response:
        arg = request.json()

        def run() -> Response:
            path = str(arg["path"])
            if path in ("", "/"):
                raise ValueError("the root folder is unsupported")
            with self._lock:
                return json_response(200, self._resolve(path).metadata())

        return self._call(request, "files/get_metadata", run)

    @route("POST", "/2/files/create_folder_v2")
    def create_folder(self, request: Request) -> Response:
        arg = request.json()

        def run() -> Response:
            path = self._normalize(str(arg["path"]))
            with self._lock:
                existing = self.nodes.get(path.lower())
                if path == "" or existing is not None:
                    kind = "folder" if existing is None or existing.is_folder else "file"
                    raise write_error("path", _tag("conflict", conflict=_tag(kind)),
                                      f"conflict/{kind}/")
                self._ensure_parents(path)
                node = Node(True, path, "id:" + secrets.token_hex(8))
                self.nodes[path.lower()] = node
                self._record(path)
                return json_response(200, {"metadata": node.metadata()})

        return self._call(request, "files/create_folder_v2", run)

    @route("POST", "/2/files/delete_v2")
    def delete(self, request: Request) -> Response:
        arg = request.json()

        def run() -> Response:
            with self._lock:
                try:
                    node = self._resolve(str(arg["path"]), "path_lookup")
                except DropboxApiError:
                    raise lookup_error("path_lookup", "not_found") from None
                if node.path_display == "":
                    raise ValueError("cannot delete the root")
                parent_rev = arg.get("parent_rev")
                if parent_rev is not None and (node.is_folder or node.rev != parent_rev):
                    raise write_error("path_write", _tag("conflict", conflict=_tag("file")),
                                      "conflict/file/")
                metadata = node.metadata()
                self._remove(node)
                return json_response(200, {"metadata": metadata})

        return self._call(request, "files/delete_v2", run)

    def _listing(self, folder: Node, recursive: bool) -> list[dict[str, Any]]:
        base = folder.path_display.lower()
        entries = []
        if recursive and base:
            entries.append(folder.metadata())
        for key in sorted(self.nodes):
            if key == "" or key == base or not key.startswith(base + "/"):
                continue
            if not recursive and "/" in key[len(base) + 1 :]:
                continue
            entries.append(self.nodes[key].metadata())
        return entries

    def _page(self, entries: list[dict[str, Any]], limit: int,
              position: tuple[str, bool, int] | None = None) -> Response:
        """A page of ``entries`` and a cursor to the rest; the last page's cursor lists
        the changes after ``position`` (see :meth:`_changed_paths`)."""
        size = max(1, min(limit, self.page_size))
        page, rest = entries[:size], entries[size:]
        cursor = "AAE" + secrets.token_urlsafe(24)
        with self._lock:
            self._cursors[cursor] = rest
            if position is not None:
                self._positions[cursor] = position
        return json_response(200, {"entries": page, "cursor": cursor, "has_more": bool(rest)})

    def _change_entries(self, position: tuple[str, bool, int]) -> list[dict[str, Any]]:
        """What ``list_folder/continue`` lists for a cursor at ``position``: the current
        metadata of each changed path, or a ``deleted`` entry. Caller holds the lock."""
        entries = []
        for path in self._changed_paths(position):
            node = self.nodes.get(path)
            if node is not None:
                entries.append(node.metadata())
            else:
                entries.append(_tag("deleted", name=path.rsplit("/", 1)[-1],
                                    path_lower=path, path_display=path))
        return entries

    def _folder_position(self, arg: dict[str, Any]) -> tuple[str, bool, int]:
        """The position "now" of a listing of the folder ``arg["path"]``. Caller holds
        the lock."""
        folder = self._resolve(str(arg.get("path", "")))
        if not folder.is_folder:
            raise lookup_error("path", "not_folder")
        return folder.path_display.lower(), bool(arg.get("recursive", False)), self._seq

    @route("POST", "/2/files/list_folder")
    def list_folder(self, request: Request) -> Response:
        arg = request.json()

        def run() -> Response:
            with self._lock:
                position = self._folder_position(arg)
                folder = self._resolve(str(arg.get("path", "")))
                entries = self._listing(folder, bool(arg.get("recursive", False)))
            return self._page(entries, int(arg.get("limit") or 2000), position)

        return self._call(request, "files/list_folder", run)

    @route("POST", "/2/files/list_folder/continue")
    def list_folder_continue(self, request: Request) -> Response:
        arg = request.json()

        def run() -> Response:
            cursor = str(arg["cursor"])
            with self._lock:
                position = self._positions.get(cursor)
                rest = self._cursors.get(cursor) if position is not None else None
                if rest or position is None:
                    # A page's cursor is used once (as before); a last page's cursor
                    # stays valid and lists what changed since it was made.
                    rest = self._cursors.pop(cursor, None)
                else:
                    now = (position[0], position[1], self._seq)
                    return self._page(self._change_entries(position), 2000, now)
            if rest is None:
                raise DropboxApiError(_tag("reset"), "reset/")
            return self._page(rest, 2000, position)

        return self._call(request, "files/list_folder/continue", run)

    @route("POST", "/2/files/list_folder/get_latest_cursor")
    def get_latest_cursor(self, request: Request) -> Response:
        arg = request.json()

        def run() -> Response:
            cursor = "AAE" + secrets.token_urlsafe(24)
            with self._lock:
                self._positions[cursor] = self._folder_position(arg)
            return json_response(200, {"cursor": cursor})

        return self._call(request, "files/list_folder/get_latest_cursor", run)

    @route("POST", "/2/files/list_folder/longpoll")
    def longpoll(self, request: Request) -> Response:
        """The notify host's long-poll: no sign-in; blocks until a change below the
        cursor's folder or ``timeout`` (30..480 s, times :attr:`longpoll_scale`)."""
        arg = request.json()

        def run() -> Response:
            timeout = int(arg.get("timeout", 30))
            if not 30 <= timeout <= 480:
                raise ValueError(f"timeout: {timeout} is not between 30 and 480")
            with self._lock:
                position = self._positions.get(str(arg["cursor"]))
                if position is None:
                    raise DropboxApiError(_tag("reset"), "reset/")
                self._changes.wait_for(
                    lambda: self._closed or bool(self._changed_paths(position)),
                    timeout * self.longpoll_scale,
                )
                answer: dict[str, Any] = {"changes": bool(self._changed_paths(position))}
                if self.longpoll_backoff is not None:
                    answer["backoff"] = self.longpoll_backoff
            return json_response(200, answer)

        return self._call(request, "files/list_folder/longpoll", run, auth=False)

    # --- uploads ---------------------------------------------------------------------
    @route("POST", "/2/files/upload")
    def upload(self, request: Request) -> Response:
        def run() -> Response:
            arg = self._header_arg(request)
            blob, size, digest = self._store_body(request)
            self._check_hash(arg, digest, blob, self.blobs)
            with self._lock:
                try:
                    node = self._commit(arg, blob, size, digest)
                except DropboxApiError as exc:
                    self.blobs.delete(blob)
                    raise as_upload_error(exc) from None
                return json_response(200, node.metadata())

        return self._call(request, "files/upload", run)

    @route("POST", "/2/files/upload_session/start")
    def session_start(self, request: Request) -> Response:
        def run() -> Response:
            arg = self._header_arg(request)
            blob, size, digest = self._store_body(request)
            self._check_hash(arg, digest, blob, self.blobs)
            session_id = _session_id()
            with self._lock:
                self._sessions[session_id] = UploadSession(blob, size, bool(arg.get("close")))
            return json_response(200, {"session_id": session_id})

        return self._call(request, "files/upload_session/start", run)

    def _session(self, cursor: dict[str, Any], outer: str | None) -> UploadSession:
        """The session for ``cursor`` at its offset (errors nested under ``outer``)."""
        def fail(tag: dict[str, Any], summary: str) -> DropboxApiError:
            if outer is None:
                return DropboxApiError(tag, summary)
            return DropboxApiError(_tag(outer, **{outer: tag}), f"{outer}/{summary}")

        session = self._sessions.get(str(cursor["session_id"]))
        if session is None:
            raise fail(_tag("not_found"), "not_found/")
        if int(cursor["offset"]) != session.offset:
            raise fail(_tag("incorrect_offset", correct_offset=session.offset),
                       "incorrect_offset/")
        if session.closed:
            raise fail(_tag("closed"), "closed/")
        return session

    @route("POST", "/2/files/upload_session/append_v2")
    def session_append(self, request: Request) -> Response:
        def run() -> Response:
            arg = self._header_arg(request)
            with self._lock:
                session = self._session(arg["cursor"], None)
            # Appends of one session run one at a time, as on Dropbox (a second
            # concurrent append sees the offset move and fails).
            with session.lock:
                self._session(arg["cursor"], None)
                length = int(request.header("Content-Length", "0") or 0)
                if length > MAX_UPLOAD_REQUEST:
                    raise DropboxApiError(_tag("payload_too_large"), "payload_too_large/")
                hasher = ContentHasher()
                # Stream into a side blob first: a body cut short leaves the session
                # exactly as it was (the client resends from the same offset).
                part, size = self.blobs.write(request.chunks(), (hasher,))
                self._check_hash(arg, hasher.hexdigest(), part, self.blobs)
                with self.blobs.open(part) as piece:
                    self.blobs.append(session.blob, iter(lambda: piece.read(1 << 20), b""))
                self.blobs.delete(part)
                session.offset += size
                session.closed = bool(arg.get("close"))
            return json_response(200, None)

        return self._call(request, "files/upload_session/append_v2", run)

    @route("POST", "/2/files/upload_session/finish")
    def session_finish(self, request: Request) -> Response:
        def run() -> Response:
            arg = self._header_arg(request)
            tail, _, tail_digest = self._store_body(request)
            self._check_hash(arg, tail_digest, tail, self.blobs)
            with self._lock:
                try:
                    session = self._session(arg["cursor"], "lookup_failed")
                except DropboxApiError:
                    self.blobs.delete(tail)
                    raise
            with session.lock:
                with self._lock:
                    try:
                        self._session(arg["cursor"], "lookup_failed")
                    except DropboxApiError:
                        self.blobs.delete(tail)
                        raise
                    del self._sessions[str(arg["cursor"]["session_id"])]
                with self.blobs.open(tail) as piece:
                    self.blobs.append(session.blob, iter(lambda: piece.read(1 << 20), b""))
                self.blobs.delete(tail)
                hasher = ContentHasher()
                size = 0
                with self.blobs.open(session.blob) as whole:
                    for piece_data in iter(lambda: whole.read(1 << 20), b""):
                        hasher.update(piece_data)
                        size += len(piece_data)
            with self._lock:
                try:
                    node = self._commit(arg["commit"], session.blob, size, hasher.hexdigest())
                except DropboxApiError:
                    self.blobs.delete(session.blob)
                    raise
                return json_response(200, node.metadata())

        return self._call(request, "files/upload_session/finish", run)

    # --- downloads -------------------------------------------------------------------
    @route("POST", "/2/files/download")
    def download(self, request: Request) -> Response:
        def run() -> Response:
            arg = self._header_arg(request)
            path = str(arg["path"])
            with self._lock:
                if path.startswith("rev:"):
                    found = None
                    for node in self.nodes.values():
                        if node.rev == path[4:]:
                            found = (node, node.blob, node.size, node.content_hash, node.rev)
                        elif path[4:] in node.history:
                            blob, size, digest = node.history[path[4:]]
                            found = (node, blob, size, digest, path[4:])
                    if found is None:
                        raise lookup_error("path", "not_found")
                    node, blob, size, digest, rev = found
                else:
                    node = self._resolve(path)
                    if node.is_folder:
                        raise lookup_error("path", "not_file")
                    blob, size, digest, rev = node.blob, node.size, node.content_hash, node.rev
                metadata = node.metadata()
                metadata.update(rev=rev, size=size, content_hash=digest)
                handle = self.blobs.open(blob)  # opened under the lock: one version
            start, end, status = 0, size, 200
            headers = {
                "Content-Type": "application/octet-stream",
                "Dropbox-API-Result": json.dumps(metadata),
                "Accept-Ranges": "bytes",
                "ETag": f'W/"{rev}"',
            }
            spec = request.header("Range")
            if spec:
                parsed = parse_range(spec, size)
                if parsed is None:
                    handle.close()
                    return text_response(416, "Range Not Satisfiable",
                                         {"Content-Range": f"bytes */{size}"})
                start, end = parsed
                status = 206
                headers["Content-Range"] = f"bytes {start}-{end - 1}/{size}"
            return Response(status, headers, handle=handle, start=start, end=end)

        return self._call(request, "files/download", run)

    # --- sharing ---------------------------------------------------------------------
    def _shared_folder(self, node: Node) -> dict[str, Any]:
        return {
            "access_type": _tag("owner"),
            "is_inside_team_folder": False,
            "is_team_folder": False,
            "name": node.name,
            "policy": {"acl_update_policy": _tag("editors"),
                       "shared_link_policy": _tag("anyone")},
            "preview_url": "https://www.dropbox.com/scl/fo/x",
            "shared_folder_id": node.shared_folder_id,
            "time_invited": node.server_modified or _now(),
            "path_lower": node.path_display.lower(),
            "path_display": node.path_display,
            "access_inheritance": _tag("inherit"),
        }

    @route("POST", "/2/sharing/share_folder")
    def share_folder(self, request: Request) -> Response:
        arg = request.json()

        def run() -> Response:
            with self._lock:
                try:
                    node = self._resolve(str(arg["path"]))
                except DropboxApiError:
                    raise DropboxApiError(_tag("bad_path", bad_path=_tag("invalid_path")),
                                          "bad_path/invalid_path/") from None
                if not node.is_folder:
                    raise DropboxApiError(_tag("bad_path", bad_path=_tag("is_file")),
                                          "bad_path/is_file/")
                if node.shared_folder_id:
                    raise DropboxApiError(
                        _tag("bad_path", bad_path=_tag("already_shared",
                                                        **self._shared_folder(node))),
                        "bad_path/already_shared/")
                node.shared_folder_id = str(secrets.randbelow(10**10) + 10**10)
                self.members[node.shared_folder_id] = set()
                return json_response(200, _tag("complete", **self._shared_folder(node)))

        return self._call(request, "sharing/share_folder", run)

    @route("POST", "/2/sharing/add_folder_member")
    def add_folder_member(self, request: Request) -> Response:
        arg = request.json()

        def run() -> Response:
            with self._lock:
                members = self.members.get(str(arg["shared_folder_id"]))
                if members is None:
                    raise DropboxApiError(_tag("invalid_shared_folder"), "invalid_shared_folder/")
                for member in arg["members"]:
                    selector = member["member"]
                    email = str(selector.get("email", ""))
                    if selector.get(".tag") != "email" or "@" not in email:
                        raise DropboxApiError(
                            _tag("bad_member", bad_member=_tag("invalid_email", invalid_email=email)),
                            "bad_member/invalid_email/")
                    members.add(email.lower())
            return json_response(200, None)

        return self._call(request, "sharing/add_folder_member", run)

    # --- test helpers ----------------------------------------------------------------
    def make_folder(self, path: str) -> None:
        """Create ``path`` (and its parents) as a user would in the Dropbox app."""
        with self._lock:
            self._ensure_parents(path + "/x")

    def file_bytes(self, path: str) -> bytes:
        with self._lock:
            node = self.nodes[path.lower()]
        return self.blobs.path(node.blob).read_bytes()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._changes.notify_all()
        self.blobs.close()


# --- fixtures --------------------------------------------------------------------------------


@dataclass
class DropboxService(EmulatorService):
    """A running Dropbox emulator plus what clients need to reach it."""

    emulator: DropboxEmulator

    def env(self) -> dict[str, str]:
        return {**environment_for("dropbox", self.server), "METASYNC_DROPBOX_APP_KEY": TEST_APP_KEY}

    def sign_in(self, account: str = "default") -> None:
        """Store a grant for ``account`` in the test token store (as `metasync auth
        dropbox` would after the user approved)."""
        from metasync.backends.cloud import Grant, grant_lock, token_store

        code = self.emulator.oauth.approve(
            {"client_id": TEST_APP_KEY, "response_type": "code",
             "code_challenge": pkce_challenge("v" * 64), "code_challenge_method": "S256"}
        )
        answer = self.emulator.oauth.token(
            {"grant_type": "authorization_code", "code": code, "client_id": TEST_APP_KEY,
             "code_verifier": "v" * 64}
        )
        import time

        grant = Grant(
            "dropbox", account, TEST_APP_KEY, answer["refresh_token"], answer["access_token"],
            time.time() + answer["expires_in"], extra={"account_id": TEST_ACCOUNT_ID},
        )
        with grant_lock("dropbox", account):
            token_store().save(grant)

    def faults_via_proxy(self) -> EmulatorFaults:
        return EmulatorFaults(
            self.server,
            (THROTTLE, TOO_MANY_WRITE_OPERATIONS, UNAVAILABLE, THROTTLE_NO_RETRY_AFTER,
             SERVER_ERROR),
        )


@contextlib.contextmanager
def running_dropbox() -> Iterator[DropboxService]:
    with emulator_server("dropbox", DropboxEmulator) as (server, emulator):
        yield DropboxService(server, emulator)


@pytest.fixture(scope="session")
def dropbox_service() -> Iterator[DropboxService]:
    """A Dropbox emulator for the whole session, aimed at by the process environment
    (child processes inherit it), with the default account signed in."""
    with running_dropbox() as service:
        yield from serve_for_session(service)
