"""The ``gdrive:`` backend: a folder in a Google Drive ("My Drive"), through the
official ``google-api-python-client`` SDK (Drive API v3).

URI: ``gdrive:PATH?account=NAME&transfers=N&timeout=S`` (and, for tests and
emulators, ``api=https://HOST:PORT&ca=FILE``). ``PATH`` is a folder below My Drive
(``gdrive:`` alone is My Drive itself); it must exist. With namespace ``ns``, key
``a/b`` is the file ``b`` in the folder ``a`` of the folder ``PATH/ns``. The sign-in
is this client's grant for ``NAME`` (default ``default``), made by ``metasync auth
gdrive``.

What Drive guarantees, and what this module relies on (each from the Drive v3
reference or its guides, see docs/backends.md):

- items are addressed by **id**; names are not unique: two folders or files with one
  name may share a parent. Every lookup by name therefore takes *all* matches:
  folders with one name are one folder (their contents are unioned), and of several
  files with one name the most recently modified one is the object (ties: the larger
  id), so a write is never hidden by an older duplicate. ``delete`` removes all.
- ``files.create`` with an ``id`` from ``files.generateIds`` creates the item with
  that id; once it exists, every later create with the same id is answered
  ``409 Conflict`` and creates nothing ("Create and manage files", section
  "Generate IDs to use with your files"). This is the one atomic exclusive operation
  Drive has, and the logs are built on it (below). Every create here uses a
  reserved id, so a create retried after a lost answer cannot make a second item.
- an upload commits atomically (readers get the old content or the whole new one);
  ``md5Checksum`` of the stored content is returned and checked;
- old revisions of a binary file stay readable by revision id for a while, so
  ``open()`` resumes a broken download from the revision it started with;
- resumable uploads survive interruptions: the session URI and the offset Drive
  holds are journaled (:class:`UploadJournal`) and a later ``put`` continues them.

Logs (append-only lists) are chains of immutable files created by reserved id: entry
*p* of a log carries the ids reserved for entries *p+1..p+K*; whoever creates entry
*p+1* uses the id entry *p* named, so two appenders race for one id and Drive lets
exactly one win. A log's entry 0 is found through a two-level index of reserved ids
(hash of the log's name) and a chain of such "first entries" per bucket. See
:class:`DriveLogs` and docs/FORMAT.md §11.6 for the exact layout and the proof.

The SDK's own retries are off (``num_retries=0``); every request goes through
:func:`retrying`. Access tokens come from a
:class:`~metasync.backends.cloud.TokenSource`: the SDK never sees a refresh token.
"""

from __future__ import annotations

import builtins
import contextlib
import hashlib
import http.client
import io
import json
import logging
import re
import secrets
import socket
import ssl
import struct
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, BinaryIO, TypeVar, cast

from metasync.backends import register
from metasync.backends.base import (
    Backend,
    Capabilities,
    ObjectReader,
    check_key,
    check_prefix,
    is_key_part,
    one_line,
    read_full,
)
from metasync.backends.cloud import (
    DEFAULT_TIMEOUT,
    AuthRequest,
    AuthUI,
    CloudAccess,
    Grant,
    TokenSource,
    app_credentials,
    oauth2_refresh,
    parse_cloud_uri,
    parse_retry_after,
    pasted_code,
)
from metasync.backends.cloudfeeds import CursorFeed
from metasync.backends.feeds import ChangeFeed
from metasync.backends.http import pin_ca
from metasync.backends.logs import LogStore
from metasync.backends.retry import TransientError
from metasync.backends.uploads import PendingUpload, UploadJournal
from metasync.errors import (
    BackendError,
    BackendFull,
    BackendUnavailable,
    FormatError,
    NoAnswer,
    ObjectNotFound,
    UsageError,
)

T = TypeVar("T")

log = logging.getLogger("metasync.backends")

#: The real service's hosts.
DRIVE_API = "https://www.googleapis.com"
GOOGLE_AUTH_URI = "https://accounts.google.com/o/oauth2/auth"
GOOGLE_TOKEN_URI = "https://oauth2.googleapis.com/token"
#: Full Drive access: the location folder is one the user made, which the narrower
#: ``drive.file`` scope would not show.
SCOPES = ("https://www.googleapis.com/auth/drive",)
FOLDER = "application/vnd.google-apps.folder"
#: Redirect address of sign-ins without a local server (nothing listens on port 1).
MANUAL_REDIRECT = "http://localhost:1/"
OCTET = "application/octet-stream"
#: Objects up to this size are one multipart upload; larger ones a resumable upload.
MULTIPART_LIMIT = 5 * 1024 * 1024
#: Piece of a resumable upload (Drive wants multiples of 256 KiB) and of a download.
CHUNK_SIZE = 8 << 20
#: Largest file Drive stores (5 TiB, the discovery document's ``maxSize``).
MAX_FILE_SIZE = 5 * (1 << 40)
#: Items asked for per listing page (Drive's maximum).
PAGE_SIZE = 1000
#: Changes asked for per ``changes.list`` page (Drive's most), and the most folders a
#: change feed walks up from an item before it gives up (calls it outside).
CHANGES_PAGE_SIZE = 1000
MAX_FOLDER_DEPTH = 64
#: Parent ids per listing query (the query stays well below URL length limits).
PARENTS_PER_QUERY = 20
#: Ids asked from files.generateIds at a time.
ID_BATCH = 200
#: Reserved successor ids each log entry carries (entries read ahead in parallel).
SUCCESSORS = 8
#: Children of each node of the log index (two levels: 65,536 buckets).
FANOUT = 256
#: Attempts to read an item whose create Drive answered 409 (it exists) but whose
#: read says 404: a read racing the other creator's commit.
READ_AFTER_CONFLICT_TRIES = 6
_FILE_FIELDS = "id,name,mimeType,size,md5Checksum,headRevisionId,modifiedTime,createdTime,trashed"
_ID = re.compile(r"^[A-Za-z0-9_-]{8,128}\Z")
#: Properties of the namespace folder naming the reserved ids of the log machinery.
PROP_LOG_FOLDER = "metasyncLogFolder"
PROP_LOG_ROOT = "metasyncLogRoot"
LOG_FOLDER_NAME = "metasync logs"


def _parse_uri(uri: str) -> tuple[list[str], dict[str, str]]:
    """``(location folder names, options)``; ``[]`` is My Drive itself."""
    return parse_cloud_uri("gdrive", uri)


def _quote(value: str) -> str:
    """A string literal of Drive's query language."""
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _parents_clause(parents: builtins.list[str]) -> str:
    return "(" + " or ".join(f"{_quote(p)} in parents" for p in parents) + ")"


def _reasons(exc: Any) -> builtins.list[str]:
    """The ``errors[].reason`` values of a Google API error body."""
    try:
        doc = json.loads(exc.content.decode("utf-8"))
        return [str(e.get("reason", "")) for e in doc["error"].get("errors", [])]
    except (ValueError, KeyError, TypeError, AttributeError):
        return []


def _newest(files: builtins.list[dict[str, Any]]) -> dict[str, Any]:
    """The object among several files of one name: the most recently modified."""
    return max(files, key=lambda f: (str(f.get("modifiedTime", "")), str(f["id"])))


def _oldest(files: builtins.list[dict[str, Any]]) -> dict[str, Any]:
    """The canonical one of several namespace folders of one name: the first made."""
    return min(files, key=lambda f: (str(f.get("createdTime", "")), str(f["id"])))


class _BearerHttp:
    """An ``httplib2.Http`` look-alike that adds the current access token to every
    request (the SDK calls only ``request``). One per thread: httplib2 is not
    thread-safe."""

    def __init__(self, raw: Any, tokens: TokenSource) -> None:
        self.raw = raw
        self.tokens = tokens
        #: The token the last request of this thread carried.
        self.token = ""

    def request(self, uri: str, method: str = "GET", body: Any = None,
                headers: dict[str, str] | None = None, **kwargs: Any) -> Any:
        headers = dict(headers or {})
        self.token = self.tokens.access_token()
        headers["authorization"] = f"Bearer {self.token}"
        return self.raw.request(uri, method, body=body, headers=headers, **kwargs)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.raw.close()


def _new_http(timeout: float, ca_file: str | None) -> Any:
    import httplib2

    # HTTPLIB2_CA_CERTS may be set on the machine: an explicit ca_certs wins.
    raw = httplib2.Http(timeout=timeout, ca_certs=ca_file)
    # Resumable uploads answer 308 "Resume Incomplete", which is not a redirect here
    # (googleapiclient.http.build_http does the same).
    raw.redirect_codes = raw.redirect_codes - {308}
    return raw


def refresher(base_url: str | None, ca_file: str | None) -> Callable[[Grant], Grant]:
    """The refresh function of Google grants (OAuth 2 at the token endpoint)."""
    token_url = f"{base_url}/token" if base_url else GOOGLE_TOKEN_URI
    return lambda grant: oauth2_refresh(token_url, grant, ca_file=ca_file)


def _api_endpoint(base_url: str | None) -> str | None:
    return f"{base_url}/drive/v3/" if base_url else None


def _build_service(http: Any, base_url: str | None) -> Any:
    """The SDK's Drive v3 resource from its bundled (static) discovery document,
    aimed at ``base_url`` through the SDK's ``api_endpoint`` client option."""
    from googleapiclient.discovery import build

    options = {"api_endpoint": _api_endpoint(base_url)} if base_url else None
    return build("drive", "v3", http=http, static_discovery=True, cache_discovery=False,
                 client_options=options)


class _Resources:
    """The SDK service with its collections (``files()``, ``revisions()``, ...) made
    once: the SDK builds every method of a collection each time it is asked for one,
    which costs more than the request. Requests made from them are independent."""

    def __init__(self, service: Any) -> None:
        self._service = service
        self._made: dict[str, Any] = {}
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> Callable[[], Any]:
        def collection() -> Any:
            with self._lock:
                made = self._made.get(name)
                if made is None:
                    made = self._made[name] = getattr(self._service, name)()
                return made

        return collection


# --- resumable uploads ------------------------------------------------------------------


def _media_upload_class() -> type:
    from googleapiclient.http import MediaUpload

    class ChunkSource(MediaUpload):
        """The SDK's view of a source read one piece at a time: ``getbytes`` serves
        from a window holding the unacknowledged piece (plus one byte read ahead, so
        the piece that ends the stream is sent with the total size). Bytes Drive
        acknowledged are hashed once, in order (the journal's SHA-256 of the prefix,
        and the MD5 compared with Drive's ``md5Checksum`` at the end)."""

        def __init__(self, source: BinaryIO, first: bytes) -> None:
            self.source = source
            #: Offset in the upload of ``window[0]``.
            self.window_start = 0
            self.window = first
            self.total: int | None = None
            self.eof = False
            self.sha: Any = hashlib.sha256()
            self.md5: Any = hashlib.md5()
            self.hashed = 0

        def chunksize(self) -> int:
            return CHUNK_SIZE

        def mimetype(self) -> str:
            return OCTET

        def size(self) -> int | None:
            return self.total

        def resumable(self) -> bool:
            return True

        def has_stream(self) -> bool:
            return False

        def prepare(self, offset: int) -> None:
            """Make the window start at ``offset`` (what Drive holds) and hold the
            next piece and one byte more, or the rest of the source."""
            if offset < self.window_start:
                raise BackendError(f"Google Drive asked again for bytes at {offset}, "
                                   "which it had acknowledged")
            while offset > self.window_start + len(self.window) and not self.eof:
                self._slide()  # Drive holds more than we read (a resumed session)
            self.hash_upto(offset)
            self.window = self.window[offset - self.window_start :]
            self.window_start = offset
            while not self.eof and len(self.window) <= CHUNK_SIZE:
                piece = _read_source(self.source, CHUNK_SIZE + 1 - len(self.window))
                if not piece:
                    self.eof = True
                    break
                self.window += piece
            if self.eof:
                self.total = self.window_start + len(self.window)

        def _slide(self) -> None:
            self.hash_upto(self.window_start + len(self.window))
            self.window_start += len(self.window)
            self.window = _read_source(self.source, CHUNK_SIZE)
            if not self.window:
                self.eof = True

        def hash_upto(self, offset: int) -> None:
            if offset > self.hashed:
                part = self.window[self.hashed - self.window_start : offset - self.window_start]
                self.sha.update(part)
                self.md5.update(part)
                self.hashed += len(part)

        def getbytes(self, begin: int, length: int) -> bytes:
            rel = begin - self.window_start
            if rel < 0:
                raise BackendError(f"Google Drive asked again for bytes at {begin}")
            return bytes(self.window[rel : rel + length])

        def finish(self) -> int:
            """Hash the rest of the source; its total size."""
            while True:
                self._slide()
                if self.eof:
                    break
            self.total = self.hashed
            return self.hashed

        def to_json(self) -> str:
            raise NotImplementedError("a streamed source cannot be serialized")

    return ChunkSource


class _SourceFailed(Exception):
    """Reading the caller's source failed (not a network error: never retried)."""

    def __init__(self, original: BaseException) -> None:
        super().__init__(str(original))
        self.original = original


def _read_source(source: BinaryIO, size: int) -> bytes:
    try:
        return read_full(source, size)
    except Exception as exc:
        raise _SourceFailed(exc) from exc


class _UploadSessionGone(Exception):
    """The resumable session no longer exists (expired or never finished)."""


# --- the backend --------------------------------------------------------------------------


@register
class GDriveBackend(CloudAccess, Backend):
    """A folder in Google Drive, URI ``gdrive:PATH?account=NAME`` (module docstring).

    Thread-safe: each thread has its own HTTP connection (httplib2 is not
    thread-safe); at most ``transfers`` requests run at once.
    """

    scheme = "gdrive"
    capabilities = Capabilities(
        # Drive has no exclusive create by *name* (names are not unique) and no
        # If-Match on files: put_if_absent is best effort and there is no CAS. Logs
        # do not need either (they use exclusive creates by reserved id).
        conditional_create=False,
        compare_and_swap=False,
        conditional_append=True,
        range_reads=True,
        max_object_size=MAX_FILE_SIZE,
        case_sensitive=True,
        long_poll=False,
        change_feed="cursor",
        sharing=True,
        # A log's first entry is a link of its bucket's chain of log heads (DriveLogs):
        # removing it would cut other logs off, so Drive keeps its pPaxos logs.
        log_deletion=False,
    )

    def __init__(self, uri: str, namespace: str) -> None:
        """Parse the URI; sends no request (the sign-in is read on first use).

        Raises :class:`UsageError` for a malformed URI, option or namespace."""
        super().__init__(uri, namespace)
        self.location, options = _parse_uri(uri)
        self._bind_account("gdrive", uri, namespace, options, refresher)
        self._local = threading.local()
        self._https: builtins.list[_BearerHttp] = []
        self._lock = threading.RLock()
        self._service: Any = None
        #: The namespace folder (id and properties) once found.
        self._ns: dict[str, Any] | None = None
        self._location_id: str | None = None
        #: Folder path below the namespace ("" is the namespace) -> its folder ids.
        self._folders: dict[str, builtins.list[str]] = {}
        #: Key -> id of the file last seen holding it (a hint; checked on use).
        self._files: dict[str, str] = {}
        self._ids: builtins.list[str] = []

    @property
    def name(self) -> str:
        """``gdrive:PATH`` (with ``?account=`` if not the default account)."""
        return self._named("gdrive:" + ("/".join(self.location) or "/"))

    # --- plumbing ------------------------------------------------------------------
    def _http(self) -> _BearerHttp:
        http_ = getattr(self._local, "http", None)
        if http_ is None:
            http_ = _BearerHttp(_new_http(self.timeout, self._ca_file), self.tokens)
            self._local.http = http_
            with self._lock:
                self._https.append(http_)
        return cast(_BearerHttp, http_)

    def _drive(self) -> Any:
        with self._lock:
            if self._service is None:
                self._service = _Resources(_build_service(self._http(), self._base_url))
            return self._service

    def _connect(self) -> tuple[Any, None]:
        """The Drive resources; each HTTP request carries the token its thread's
        :class:`_BearerHttp` fetched for it (so there is none to name here)."""
        return self._drive(), None

    def _translate(self, exc: Exception, key: str | None, action: str,
                   token: str | None) -> BaseException:
        """The backend-contract error for an SDK or transport exception. A refused token
        is the one this thread's last request carried."""
        import httplib2
        from googleapiclient.errors import HttpError

        if isinstance(exc, _SourceFailed):
            return exc  # the caller's source failed, not Drive: never retried
        what = self._what(action, key)
        if isinstance(exc, HttpError):
            status = exc.resp.status
            reasons = _reasons(exc)
            retry_after = parse_retry_after(exc.resp.get("retry-after"))
            summary = "/".join(r for r in reasons if r) or str(status)
            if status == 404:
                return ObjectNotFound(f"no object {key!r} on {self.name}")
            if status == 401:
                return self.tokens.rejected(self._http().token, summary)
            if status == 429 or (status == 403 and {"userRateLimitExceeded", "rateLimitExceeded"}
                                 & set(reasons)):
                return TransientError(
                    f"cannot {what}: Google Drive is throttling ({summary})", retry_after=retry_after
                )
            if status == 403 and {"uploadLimitExceeded", "dailyLimitExceeded"} & set(reasons):
                # The daily upload cap (750 GB a day per user): not worth retrying for
                # hours. The put fails; the copy is recorded as missing and the daemon or
                # `fsck --repair` writes it once Drive accepts uploads again.
                return BackendError(
                    f"cannot {what}: Google Drive's daily upload limit is reached ({summary}); "
                    "this copy is postponed until Drive accepts uploads again"
                )
            if status == 403 and {"storageQuotaExceeded", "quotaExceeded"} & set(reasons):
                return BackendFull.of(self.name, "the Google Drive storage quota is used up")
            if status == 403:
                return BackendError(f"cannot {what}: Google Drive refused it ({summary})")
            if status in (408, 425) or status >= 500:
                return TransientError(f"cannot {what}: Google Drive answered {status}",
                                      retry_after=retry_after)
            return BackendError(f"cannot {what}: HTTP {status} ({summary}): {exc.reason}")
        if isinstance(exc, ssl.SSLCertVerificationError):
            return BackendError(f"cannot {what}: TLS certificate check failed ({one_line(exc)})")
        if isinstance(exc, httplib2.ServerNotFoundError | ConnectionRefusedError):
            target = self._base_url or DRIVE_API
            return BackendUnavailable(
                f"cannot {what}: {target} cannot be reached ({one_line(exc)}); is the network up?"
            )
        if isinstance(exc, socket.gaierror):
            return BackendUnavailable(f"cannot {what}: cannot resolve the Google Drive host")
        if isinstance(exc, TimeoutError):
            return NoAnswer(f"cannot {what}: no answer from Google Drive in time "
                            f"({one_line(exc)}); check the network, or allow longer with --timeout")
        if isinstance(exc, OSError | http.client.HTTPException | httplib2.HttpLib2Error):
            return TransientError(f"cannot {what}: connection failed ({one_line(exc)})")
        return exc

    def _exec(self, request: Any) -> Any:
        return request.execute(http=self._http(), num_retries=0)

    def _raw(self, request: Any) -> tuple[Any, bytes]:
        """Execute ``request`` returning ``(response, body bytes)``."""
        request.postproc = lambda resp, content: (resp, content)
        return cast(tuple[Any, bytes], request.execute(http=self._http(), num_retries=0))

    def reserve_ids(self, count: int) -> builtins.list[str]:
        """``count`` fresh ids from ``files.generateIds`` (kept in a pool)."""
        with self._lock:
            while len(self._ids) < count:
                answer = self._call(None, "reserve ids on", lambda d: self._exec(
                    d.files().generateIds(count=max(ID_BATCH, count), space="drive",
                                          type="files")))
                ids = [str(i) for i in answer.get("ids", [])]
                if not ids or not all(_ID.match(i) for i in ids):
                    raise BackendError(f"{self.name}: files.generateIds gave unusable ids")
                self._ids.extend(ids)
            taken, self._ids = self._ids[:count], self._ids[count:]
            return taken

    def create_with_id(self, file_id: str, body: dict[str, Any], data: bytes | None,
                       what: str) -> bool:
        """Create the item ``file_id`` (reserved) exclusively: True if this call made
        it, False if it existed (409). A retry of our own create whose answer was lost
        also gets 409: callers compare what is stored to what they wrote."""
        from googleapiclient.errors import HttpError
        from googleapiclient.http import MediaIoBaseUpload

        meta = {**body, "id": file_id}

        def create(drive: Any) -> bool:
            media = None if data is None else MediaIoBaseUpload(io.BytesIO(data), OCTET,
                                                                  resumable=False)
            try:
                self._exec(drive.files().create(body=meta, media_body=media, fields="id"))
            except HttpError as exc:
                if exc.resp.status == 409:
                    return False
                raise
            return True

        return self._call(None, what, create)

    def read_by_id(self, file_id: str, what: str) -> bytes | None:
        """The content of the file ``file_id``, None if there is none."""
        try:
            return cast(bytes, self._call(None, what, lambda d: self._exec(
                d.files().get_media(fileId=file_id))))
        except ObjectNotFound:
            return None

    # --- folders -------------------------------------------------------------------
    def _query(self, q: str, fields: str = _FILE_FIELDS, what: str = "list") -> builtins.list[dict[str, Any]]:
        """Every item matching ``q`` (all pages, each retried on its own)."""
        items: builtins.list[dict[str, Any]] = []
        token: str | None = None
        while True:
            def page(drive: Any, token: str | None = token) -> Any:
                return self._exec(drive.files().list(
                    q=q, pageSize=PAGE_SIZE, pageToken=token, spaces="drive",
                    fields=f"nextPageToken,files({fields},parents)"))

            answer = self._call(None, what, page)
            items.extend(answer.get("files", []))
            token = answer.get("nextPageToken")
            if not token:
                return items

    def _children(self, parents: builtins.list[str], name: str | None = None,
                  folders: bool | None = None) -> builtins.list[dict[str, Any]]:
        found: builtins.list[dict[str, Any]] = []
        for i in range(0, len(parents), PARENTS_PER_QUERY):
            clauses = [_parents_clause(parents[i : i + PARENTS_PER_QUERY]), "trashed = false"]
            if name is not None:
                clauses.append(f"name = {_quote(name)}")
            if folders is True:
                clauses.append(f"mimeType = {_quote(FOLDER)}")
            elif folders is False:
                clauses.append(f"mimeType != {_quote(FOLDER)}")
            found.extend(self._query(" and ".join(clauses)))
        return found

    def _location(self) -> str:
        """The id of the location folder (``root`` for My Drive)."""
        if self._location_id is not None:
            return self._location_id
        parent = "root"
        walked: builtins.list[str] = []
        for part in self.location:
            walked.append(part)
            matches = self._children([parent], part, folders=True)
            if not matches:
                raise BackendUnavailable(
                    f"the folder {'/'.join(walked)!r} does not exist in Google Drive "
                    f"({self.name}); create it there first (or fix the URI)"
                )
            if len({m["id"] for m in matches}) > 1:
                raise BackendError(
                    f"Google Drive has {len(matches)} folders named {'/'.join(walked)!r}; "
                    "rename all but one so the location is unambiguous"
                )
            parent = str(matches[0]["id"])
        self._location_id = parent
        return parent

    def _find_namespace(self) -> dict[str, Any] | None:
        with self._lock:
            if self._ns is not None:
                return self._ns
        matches = self._query(
            f"{_quote(self._location())} in parents and name = {_quote(self.namespace)} "
            f"and mimeType = {_quote(FOLDER)} and trashed = false",
            fields=_FILE_FIELDS + ",properties",
        )
        if not matches:
            return None
        ns = _oldest(matches)
        with self._lock:
            self._ns = ns
            self._folders[""] = [str(ns["id"])]
        return ns

    def namespace_folder(self) -> dict[str, Any]:
        ns = self._find_namespace()
        if ns is None:
            raise ObjectNotFound(f"{self.name}: the namespace {self.namespace!r} does not exist")
        return ns

    def _folder_ids(self, parts: builtins.list[str], create: bool, fresh: bool = False) -> builtins.list[str]:
        """Ids of every folder at path ``parts`` below the namespace (duplicates of a
        name are one folder); ``[]`` if missing and not ``create``."""
        ns = self.namespace_folder()
        ids = [str(ns["id"])]
        for depth in range(len(parts)):
            path = "/".join(parts[: depth + 1])
            with self._lock:
                cached = None if fresh else self._folders.get(path)
            if cached is not None:
                ids = cached
                continue
            parent_ids = ids
            found = [str(f["id"]) for f in self._children(parent_ids, parts[depth], folders=True)]
            if not found:
                if not create:
                    return []
                found = [self._make_folder(parent_ids[0], parts[depth])]
            ids = sorted(set(found))
            with self._lock:
                self._folders[path] = ids
        return ids

    def _make_folder(self, parent: str, name: str) -> str:
        """Create a folder (a duplicate of a concurrent creator's is harmless)."""
        (folder_id,) = self.reserve_ids(1)
        self.create_with_id(folder_id, {"name": name, "mimeType": FOLDER, "parents": [parent]},
                            None, "create a folder on")
        return folder_id

    def _forget(self, key: str) -> None:
        with self._lock:
            self._files.pop(key, None)
            parts = key.split("/")[:-1]
            for depth in range(1, len(parts) + 1):
                self._folders.pop("/".join(parts[:depth]), None)

    def _matches(self, key: str, fresh: bool) -> builtins.list[dict[str, Any]]:
        """Every file named ``key`` (all duplicates); folders re-read if ``fresh``."""
        parts = check_key(key).split("/")
        try:
            parents = self._folder_ids(parts[:-1], create=False, fresh=fresh)
        except ObjectNotFound:
            return []
        if not parents:
            return []
        return self._children(parents, parts[-1], folders=False)

    def _lookup(self, key: str, recheck: bool = True) -> dict[str, Any] | None:
        """The file holding ``key`` (the newest of duplicates), None if none. A miss
        with cached folders looks again with the folders re-read (another client may
        have made a duplicate folder meanwhile), unless not ``recheck``."""
        matches = self._matches(key, fresh=False)
        if not matches and recheck:
            matches = self._matches(key, fresh=True)
        if not matches:
            return None
        found = _newest(matches)
        with self._lock:
            self._files[key] = str(found["id"])
        return found

    def _file(self, key: str) -> dict[str, Any]:
        found = self._lookup(key)
        if found is None:
            raise ObjectNotFound(f"no object {key!r} on {self.name}")
        return found

    # --- lifecycle -----------------------------------------------------------------
    def probe(self) -> None:
        """Check the sign-in and that the location folder exists. Never writes."""
        self._location()

    def exists(self) -> bool:
        return self._find_namespace() is not None

    def create(self) -> None:
        """Create the namespace folder (idempotent); the location must exist.

        The folder is made with the ids of the log machinery in its properties. If
        two clients create it at once, Drive holds two folders of that name: the
        first made (createdTime, then id) is the namespace, and the other creator
        removes its own, still empty, folder."""
        location = self._location()
        if self._find_namespace() is not None:
            return
        folder_id, log_folder, log_root = self.reserve_ids(3)
        body = {"name": self.namespace, "mimeType": FOLDER, "parents": [location],
                "properties": {PROP_LOG_FOLDER: log_folder, PROP_LOG_ROOT: log_root}}
        self.create_with_id(folder_id, body, None, "create the namespace on")
        with self._lock:
            self._ns = None
        ns = self._find_namespace()
        if ns is None:
            raise TransientError(f"{self.name}: the namespace folder just made is not listed yet")
        if ns["id"] != folder_id:
            with contextlib.suppress(BackendError):
                self._call(None, "remove a duplicate namespace folder on",
                           lambda d: self._exec(d.files().delete(fileId=folder_id)))

    def close(self) -> None:
        with self._lock:
            https, self._https = self._https, []
            self._service = None
        for h in https:
            h.close()
        self._local = threading.local()

    # --- writes --------------------------------------------------------------------
    def put(self, key: str, data: bytes | BinaryIO) -> None:
        """Store ``data`` at ``key``: a new content of the file holding it, or a new
        file. Up to :data:`MULTIPART_LIMIT` bytes is one multipart upload; more is a
        resumable upload sent in :data:`CHUNK_SIZE` pieces (one in memory)."""
        parts = check_key(key).split("/")
        if isinstance(data, bytes | bytearray | memoryview):
            body = bytes(data)
            if len(body) <= MULTIPART_LIMIT:
                self._put_small(key, parts, body)
                return
            self._put_large(key, parts, io.BytesIO(body), 0, body[:CHUNK_SIZE + 1])
            return
        try:
            start = data.tell() if data.seekable() else None
        except (AttributeError, OSError, ValueError):
            start = None
        first = read_full(data, MULTIPART_LIMIT + 1)
        if len(first) <= MULTIPART_LIMIT:
            self._put_small(key, parts, first)
            return
        self._put_large(key, parts, data, start, first)

    def _existing_id(self, key: str) -> str | None:
        with self._lock:
            cached = self._files.get(key)
        if cached is not None:
            return cached
        # No second look with the folders re-read: a file missed in a duplicate
        # folder only gets a newer duplicate, which is then the object.
        found = self._lookup(key, recheck=False)
        return None if found is None else str(found["id"])

    def _put_small(self, key: str, parts: builtins.list[str], body: bytes) -> None:
        from googleapiclient.errors import HttpError
        from googleapiclient.http import MediaIoBaseUpload

        digest = hashlib.md5(body).hexdigest()
        parents = self._folder_ids(parts[:-1], create=True)
        for _ in range(3):
            file_id = self._existing_id(key)
            if file_id is None:
                (new_id,) = self.reserve_ids(1)
                meta = {"id": new_id, "name": parts[-1], "parents": [parents[0]],
                        "mimeType": OCTET}

                def create(drive: Any, meta: dict[str, Any] = meta) -> dict[str, Any] | None:
                    try:
                        return cast(dict[str, Any], self._exec(drive.files().create(
                            body=meta, fields=_FILE_FIELDS,
                            media_body=MediaIoBaseUpload(io.BytesIO(body), OCTET,
                                                         resumable=False))))
                    except HttpError as exc:
                        if exc.resp.status == 409:  # our own earlier attempt made it
                            return None
                        raise

                stored = self._call(key, "write", create)
                if stored is None:
                    stored = self._call(key, "write", self._getter(new_id))
                self._check_stored(key, stored, len(body), digest)
                with self._lock:
                    self._files[key] = new_id
                return

            def update(drive: Any, file_id: str = file_id) -> dict[str, Any]:
                return cast(dict[str, Any], self._exec(drive.files().update(
                    fileId=file_id, fields=_FILE_FIELDS,
                    media_body=MediaIoBaseUpload(io.BytesIO(body), OCTET, resumable=False))))

            try:
                stored = self._call(key, "write", update)
            except ObjectNotFound:
                self._forget(key)  # deleted meanwhile: look again, then create
                continue
            if stored.get("trashed"):
                self._forget(key)
                continue
            self._check_stored(key, stored, len(body), digest)
            return
        raise TransientError(f"cannot write {key!r} on {self.name}: it keeps vanishing")

    def _getter(self, file_id: str) -> Callable[[Any], dict[str, Any]]:
        return lambda drive: cast(dict[str, Any], self._exec(
            drive.files().get(fileId=file_id, fields=_FILE_FIELDS)))

    def _deleter(self, file_id: str) -> Callable[[Any], None]:
        return lambda drive: self._exec(drive.files().delete(fileId=file_id))

    def _check_stored(self, key: str, stored: dict[str, Any], size: int, md5: str) -> None:
        if int(stored.get("size", -1)) != size or stored.get("md5Checksum", md5) != md5:
            raise TransientError(f"Google Drive stored other bytes than sent for {key!r}")

    def _put_large(self, key: str, parts: builtins.list[str], source: BinaryIO,
                   start: int | None, first: bytes) -> None:
        """A resumable upload of ``first`` + the rest of ``source``.

        A seekable source is journaled (:class:`UploadJournal`): a later ``put`` of
        the same key after an interruption re-reads the part Drive holds, checks its
        SHA-256 against the journal and continues the same session; a changed source
        or an expired session starts over."""
        parents = self._folder_ids(parts[:-1], create=True)
        target = (f"{self._base_url or DRIVE_API}|{self.account}|"
                  f"{self.namespace_folder()['id']}|{key}")
        with UploadJournal("gdrive", target) as journal:
            if start is not None:
                resumed = self._resume(key, journal, source, start, first)
                if resumed is not None:
                    request, upload, started = resumed
                    self._send_all(key, request, upload, journal, started)
                    return
                if source.tell() != start + len(first):
                    source.seek(start)
                    first = read_full(source, MULTIPART_LIMIT + 1)
            upload = _media_upload_class()(source, first)
            file_id = self._existing_id(key)
            drive = self._drive()
            if file_id is None:
                (new_id,) = self.reserve_ids(1)
                meta = {"id": new_id, "name": parts[-1], "parents": [parents[0]],
                        "mimeType": OCTET}
                request = drive.files().create(body=meta, media_body=upload, fields=_FILE_FIELDS)
            else:
                request = drive.files().update(fileId=file_id, media_body=upload,
                                               fields=_FILE_FIELDS)
            self._send_all(key, request, upload, journal if start is not None else None,
                           time.time())

    def _status(self, request: Any, upload: Any) -> int | dict[str, Any]:
        """Ask Drive how much of the session it holds: the offset, or the finished
        file's metadata. Raises _UploadSessionGone for an unknown session."""
        from googleapiclient.errors import HttpError

        size = upload.size()
        headers = {"Content-Range": f"bytes */{'*' if size is None else size}",
                   "content-length": "0"}
        resp, content = self._http().request(request.resumable_uri, "PUT", headers=headers)
        if resp.status in (200, 201):
            return cast(dict[str, Any], json.loads(content.decode("utf-8")))
        if resp.status == 308:
            held = resp.get("range")
            return int(held.split("-")[1]) + 1 if held else 0
        if resp.status in (404, 410):
            raise _UploadSessionGone()
        raise HttpError(resp, content, uri=request.resumable_uri)

    def _send_all(self, key: str, request: Any, upload: Any, journal: UploadJournal | None,
                  started: float) -> None:
        """Send the pieces of a resumable upload (the first request opens the
        session) until Drive has the whole file; after a failure ask Drive for its
        offset (``Content-Range: bytes */N``) and go on from there. Each piece is
        journaled once Drive acknowledged it."""
        state = {"broken": request.resumable_uri is not None}

        def mark(_: BaseException) -> None:
            state["broken"] = True

        def step(_: Any) -> dict[str, Any] | None:
            if state["broken"] and request.resumable_uri is not None:
                held = self._status(request, upload)
                state["broken"] = False
                if isinstance(held, dict):
                    return held
                request.resumable_progress = held
            request._in_error_state = False
            upload.prepare(request.resumable_progress)
            try:
                _, body = request.next_chunk(http=self._http(), num_retries=0)
            except BaseException:
                state["broken"] = True
                raise
            return cast(dict[str, Any] | None, body)

        while True:
            try:
                done = self._call(key, "upload part of", step, on_retry=mark)
            except _SourceFailed as exc:
                raise exc.original from None  # journaled: the next put continues
            except _UploadSessionGone:
                if journal is not None:
                    journal.clear()
                raise TransientError(
                    f"cannot write {key!r} on {self.name}: the upload session expired"
                ) from None
            if done is not None:
                total = upload.finish()
                self._check_stored(key, done, total, upload.md5.hexdigest())
                if journal is not None:
                    journal.clear()
                with self._lock:
                    self._files[key] = str(done["id"])
                return
            if journal is not None and request.resumable_progress > 0:
                upload.hash_upto(request.resumable_progress)
                journal.record(PendingUpload(request.resumable_uri, request.resumable_progress,
                                             upload.sha.hexdigest(), started))

    def _resume(self, key: str, journal: UploadJournal, source: BinaryIO, start: int,
                first: bytes) -> tuple[Any, Any, float] | None:
        """The request and source view continuing the journaled session of this key,
        if the source's first bytes are the ones Drive holds and the session is still
        open at (or past) the journaled offset; else None."""
        pending = journal.pending()
        if pending is None:
            return None
        journal.clear()  # used now; re-recorded as the upload goes on
        sha, md5 = hashlib.sha256(), hashlib.md5()
        have = min(len(first), pending.offset)
        sha.update(first[:have])
        md5.update(first[:have])
        while have < pending.offset:
            piece = read_full(source, min(CHUNK_SIZE, pending.offset - have))
            if not piece:
                break
            sha.update(piece)
            md5.update(piece)
            have += len(piece)
        if have != pending.offset or sha.hexdigest() != pending.prefix_sha256:
            return None
        upload = _media_upload_class()(source, first[pending.offset :])
        upload.window_start = upload.hashed = pending.offset
        upload.sha, upload.md5 = sha, md5
        request = self._drive().files().create(media_body=upload, fields=_FILE_FIELDS)
        request.resumable_uri = pending.session
        try:
            held = self._call(key, "resume upload of", lambda _: self._status(request, upload))
        except (_UploadSessionGone, BackendError):
            return None
        if isinstance(held, int) and held < pending.offset:
            return None
        log.info("resuming the upload of %r on %s at byte %d", key, self.name, pending.offset)
        request.resumable_progress = pending.offset
        return request, upload, pending.started

    def put_if_absent(self, key: str, data: bytes) -> bool:
        """Create ``key`` if no file holds it. Best effort: Drive has no exclusive
        create by name, so two racing creators may both succeed (capability
        ``conditional_create`` is False; logs do not use this)."""
        check_key(key)
        if self._lookup(key) is not None:
            return False
        with self._lock:
            self._files.pop(key, None)
        self._put_small(key, key.split("/"), bytes(data))
        return True

    def delete(self, key: str) -> None:
        """Remove every file holding ``key`` (``files.delete`` of each duplicate)."""
        matches = self._matches(key, fresh=False) or self._matches(key, fresh=True)
        if not matches:
            raise ObjectNotFound(f"no object {key!r} on {self.name}")
        for match in matches:
            try:
                self._call(key, "delete", self._deleter(str(match["id"])))
            except ObjectNotFound:
                pass  # gone already (an earlier attempt whose answer was lost)
        with self._lock:
            self._files.pop(key, None)

    # --- reads ---------------------------------------------------------------------
    def _with_file(self, key: str, action: str, fn: Callable[[Any, str], T]) -> T:
        """``fn(drive, file_id)`` for the file holding ``key``; a remembered id that
        is gone is looked up again once."""
        check_key(key)
        with self._lock:
            cached = self._files.get(key)
        if cached is not None:
            try:
                return self._call(key, action, lambda d: fn(d, cached))
            except ObjectNotFound:
                self._forget(key)
        file_id = str(self._file(key)["id"])
        return self._call(key, action, lambda d: fn(d, file_id))

    def get(self, key: str) -> bytes:
        """The whole file (one ``files.get?alt=media``)."""
        return self._with_file(key, "read", lambda d, i: cast(bytes, self._exec(
            d.files().get_media(fileId=i))))

    def open(self, key: str) -> BinaryIO:
        """A stream of the file, read in :data:`CHUNK_SIZE` ranges of the head
        revision it started with (``revisions.get?alt=media``), so a replace while
        reading never mixes versions."""
        meta = self._file(key)
        reader = _DriveReader(self, key, str(meta["id"]), meta.get("headRevisionId"),
                              int(meta.get("size", 0)))
        return cast(BinaryIO, io.BufferedReader(reader, 1 << 20))

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        """``length`` bytes at ``offset``: ``files.get?alt=media`` with ``Range``."""
        from googleapiclient.errors import HttpError

        if offset < 0 or length < 0:
            raise ValueError(f"get_range needs offset >= 0, length >= 0, got {offset}, {length}")
        if length == 0:
            size = self.size(key)
            if size < offset:
                raise self.truncated_error(key, offset, size)
            return b""

        def read(drive: Any, file_id: str) -> tuple[bytes, int | None]:
            request = drive.files().get_media(fileId=file_id)
            request.headers["range"] = f"bytes={offset}-{offset + length - 1}"
            try:
                resp, content = self._raw(request)
            except HttpError as exc:
                if exc.resp.status == 416:
                    return b"", None
                raise
            total = None
            content_range = resp.get("content-range", "")
            if "/" in content_range and content_range.rsplit("/", 1)[1].isdigit():
                total = int(content_range.rsplit("/", 1)[1])
            if resp.status != 206:  # the whole file: keep only the range
                total = len(content)
                content = content[offset : offset + length]
            return content, total

        data, total = self._with_file(key, "read", read)
        if len(data) != length:
            raise self.truncated_error(key, offset + length, total)
        return data

    def size(self, key: str) -> int:
        return int(self._file(key).get("size", 0))

    def list(self, prefix: str = "") -> Iterator[str]:
        """Every key below the folder ``prefix``: one query per folder level (all
        duplicate folders at once), each page retried on its own. Names that are not
        key parts (other tools' files, the log machinery) are skipped."""
        check_prefix(prefix)
        parts = [p for p in prefix.rstrip("/").split("/") if p]
        return iter(self._walk(parts))

    def _walk(self, parts: builtins.list[str]) -> builtins.list[str]:
        if self._find_namespace() is None:
            return []
        top = self._folder_ids(parts, create=False, fresh=True)
        if not top:
            return []
        keys: set[str] = set()
        level: dict[str, str] = {i: "/".join(parts) for i in top}
        while level:
            children = self._children(sorted(level))
            next_level: dict[str, str] = {}
            for item in children:
                name = str(item.get("name", ""))
                if not is_key_part(name):
                    continue
                for parent in item.get("parents", []):
                    if parent not in level:
                        continue
                    path = f"{level[parent]}/{name}" if level[parent] else name
                    if item.get("mimeType") == FOLDER:
                        next_level[str(item["id"])] = path
                    else:
                        keys.add(path)
            level = next_level
        return sorted(keys)

    def poll(self, key: str) -> str | None:
        """The holding file's id and head revision (changes with every new content,
        and when a newer duplicate appears), None if missing."""
        found = self._lookup(key)
        if found is None:
            return None
        return (f"{found['id']}:{found.get('headRevisionId', '')}:{found.get('md5Checksum', '')}"
                f":{found.get('size', '')}")

    # --- logs ----------------------------------------------------------------------
    # --- change feed -----------------------------------------------------------------
    def change_feed(self, watch_key: str | None = None) -> ChangeFeed:
        """A :class:`DriveFeed`: ``changes.list`` from a saved page token, keeping the
        changes below the namespace folder."""
        return DriveFeed(self)

    def start_page_token(self) -> str:
        """``changes.getStartPageToken``: the page token of "now"."""
        answer = self._call(None, "watch", lambda d: self._exec(
            d.changes().getStartPageToken(fields="startPageToken")))
        token = answer.get("startPageToken") if isinstance(answer, dict) else None
        if not isinstance(token, str) or not token:
            raise BackendError(f"cannot watch {self.name}: Drive answered no start page token")
        return token

    def changes_since(self, token: str) -> tuple[builtins.list[dict[str, Any]], str]:
        """``changes.list`` from page token ``token``, page after page: the changes
        (``fileId``, ``removed``, ``file`` with ``mimeType``/``parents``) and the
        ``newStartPageToken`` to ask from next time."""
        changes: builtins.list[dict[str, Any]] = []
        while True:
            def page(drive: Any, token: str = token) -> Any:
                return self._exec(drive.changes().list(
                    pageToken=token, pageSize=CHANGES_PAGE_SIZE, spaces="drive",
                    includeRemoved=True,
                    fields="nextPageToken,newStartPageToken,"
                           "changes(changeType,fileId,removed,file(mimeType,parents))"))

            answer = self._call(None, "watch", page)
            if not isinstance(answer, dict):
                raise BackendError(f"cannot watch {self.name}: Drive answered no change list")
            changes.extend(c for c in answer.get("changes") or [] if isinstance(c, dict))
            following = answer.get("newStartPageToken")
            if isinstance(following, str) and following:
                return changes, following
            token = answer.get("nextPageToken") or ""
            if not isinstance(token, str) or not token:
                raise BackendError(f"cannot watch {self.name}: Drive answered no page token")

    def parents_of(self, file_id: str) -> builtins.list[str] | None:
        """The parents of the item ``file_id`` (``files.get``), None if it is gone."""
        try:
            answer = self._call(None, "watch", lambda d: self._exec(
                d.files().get(fileId=file_id, fields="parents")))
        except ObjectNotFound:
            return None
        parents = answer.get("parents") if isinstance(answer, dict) else None
        return [str(p) for p in parents or [] if isinstance(p, str)]

    def specific_logs(self) -> LogStore:
        """Logs from exclusive creates by reserved id (:class:`DriveLogs`): Drive has no
        exclusive create by name."""
        return DriveLogs(self)

    # --- sharing -------------------------------------------------------------------
    def share(self, email: str) -> str:
        """Give ``email`` write access to the namespace folder (``permissions.create``
        with role ``writer``; Drive mails the invitation). Idempotent: an existing
        permission for that address is kept."""
        from googleapiclient.errors import HttpError

        folder = str(self.namespace_folder()["id"])
        existing = self._call(None, "share", lambda d: self._exec(d.permissions().list(
            fileId=folder, fields="permissions(id,type,role,emailAddress)")))
        for permission in existing.get("permissions", []):
            if str(permission.get("emailAddress", "")).lower() == email.lower() and \
                    permission.get("role") in ("writer", "organizer", "owner"):
                return f"{email} can already edit the Google Drive folder of {self.namespace!r}"

        def grant(drive: Any) -> None:
            try:
                self._exec(drive.permissions().create(
                    fileId=folder, sendNotificationEmail=True, fields="id",
                    body={"type": "user", "role": "writer", "emailAddress": email}))
            except HttpError as exc:
                if exc.resp.status == 400:
                    raise UsageError(
                        f"Google Drive refused {email!r} as a collaborator ({exc.reason})"
                    ) from None
                raise

        self._call(None, "share", grant)
        location = "/".join(self.location) or "My Drive"
        return (f"invited {email} to edit the Google Drive folder {location}/{self.namespace}")


class DriveFeed(CursorFeed):
    """The namespace's changes through ``changes.list`` from a saved page token
    (``changes.getStartPageToken`` at the start, ``newStartPageToken`` after each
    ask), one request an ask when nothing changed. Drive reports changes of the whole
    account with each item's parents only, so a change counts if its item is the
    namespace folder or lies below it: the folders above it are looked up
    (``files.get``, once per folder: known inside and outside folders are
    remembered). A removed item (Drive no longer says where it was) counts: a false
    alarm at worst, never a miss."""

    def __init__(self, backend: GDriveBackend) -> None:
        super().__init__(backend.name)
        self._backend = backend
        self._token = ""
        self._inside: set[str] = set()
        self._outside: set[str] = set()

    def _begin(self) -> None:
        try:
            namespace = str(self._backend.namespace_folder()["id"])
        except ObjectNotFound:
            raise BackendError(
                f"cannot watch {self._backend.name}: the namespace folder "
                f"{self._backend.namespace!r} is missing") from None
        self._inside = {namespace}
        self._outside = set()
        self._token = self._backend.start_page_token()

    def _changed_since(self) -> bool:
        changes, self._token = self._backend.changes_since(self._token)
        # Every change is looked at (not only up to the first that counts): folders
        # made inside are learnt from them.
        return any([self._concerns(change) for change in changes])

    def _concerns(self, change: dict[str, Any]) -> bool:
        if change.get("changeType", "file") != "file":
            return False  # a shared drive's own change: My Drive holds the namespace
        file_id = change.get("fileId")
        item = change.get("file")
        if change.get("removed") or not isinstance(item, dict) or not isinstance(file_id, str):
            return True
        parents = item.get("parents")
        if not isinstance(parents, builtins.list) or not parents:
            return True  # nothing says where it is
        is_folder = item.get("mimeType") == FOLDER
        if is_folder:
            # A folder moved in or out changes what lies below what: learn again.
            self._outside.clear()
        if file_id in self._inside:
            return True
        if any(self._below_namespace(str(p)) for p in parents):
            if is_folder:
                self._inside.add(file_id)
            return True
        return False

    def _below_namespace(self, folder_id: str) -> bool:
        """Whether ``folder_id`` is the namespace folder or below it, walking up its
        parents (each looked up once) to a known folder or the top."""
        walked: builtins.list[str] = []
        current = folder_id
        for _ in range(MAX_FOLDER_DEPTH):
            if current in self._inside:
                self._inside.update(walked)
                return True
            if current in self._outside:
                break
            walked.append(current)
            parents = self._backend.parents_of(current)
            if not parents:
                break  # the top of My Drive, or gone
            current = parents[0]
        self._outside.update(walked)
        return False


class _DriveReader(ObjectReader):
    """A file read in ranges of one revision; each range retried on its own."""

    _backend: GDriveBackend

    def __init__(self, backend: GDriveBackend, key: str, file_id: str,
                 revision: str | None, size: int) -> None:
        super().__init__(backend, key, size)
        self._file_id = file_id
        self._revision = revision

    def _next_piece(self, wanted: int) -> bytes:
        piece = self._backend._call(self._key, "read", self._next)
        if not piece:
            raise self._backend.truncated_error(self._key, self._size, self._pos)
        return piece

    def _next(self, drive: Any) -> bytes:
        end = min(self._size, self._pos + CHUNK_SIZE) - 1
        if self._revision:
            request = drive.revisions().get_media(fileId=self._file_id, revisionId=self._revision)
        else:
            request = drive.files().get_media(fileId=self._file_id)
        request.headers["range"] = f"bytes={self._pos}-{end}"
        resp, content = self._backend._raw(request)
        if resp.status == 200:
            content = content[self._pos : end + 1]
        if len(content) != end + 1 - self._pos:
            raise TransientError(f"reading {self._key!r} on {self._backend.name} ended early")
        return content


# --- logs -----------------------------------------------------------------------------------

_ENTRY_MAGIC = b"MDL1"
_NODE_MAGIC = b"MDN1"
_DIGEST = 16
_TOKEN = 16


def _digest(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()[:_DIGEST]


@dataclass(frozen=True)
class LogEntry:
    """One stored log entry. Entry 0 of a log (its *head*) also names the log and the
    next head of its index bucket."""

    token: bytes
    message: bytes
    #: Ids reserved for the entries after this one (positions p+1 .. p+K).
    successors: tuple[str, ...]
    log: str | None = None
    next_head: str | None = None

    def encode(self) -> bytes:
        header: dict[str, Any] = {"t": self.token.hex(), "s": list(self.successors)}
        if self.log is not None:
            header["l"] = self.log
            header["n"] = self.next_head
        head = json.dumps(header, separators=(",", ":"), sort_keys=True).encode()
        body = _ENTRY_MAGIC + struct.pack(">I", len(head)) + head + self.message
        return body + _digest(body)

    @classmethod
    def decode(cls, data: bytes, what: str) -> LogEntry:
        if len(data) < 8 + _DIGEST or not data.startswith(_ENTRY_MAGIC):
            raise FormatError(f"{what} is not a metasync log entry")
        body, digest = data[:-_DIGEST], data[-_DIGEST:]
        if _digest(body) != digest:
            raise FormatError(f"{what} is damaged (digest mismatch)")
        (size,) = struct.unpack(">I", body[4:8])
        try:
            header = json.loads(body[8 : 8 + size])
            token = bytes.fromhex(header["t"])
            successors = tuple(str(s) for s in header["s"])
            name = header.get("l")
            next_head = header.get("n")
        except (ValueError, KeyError, TypeError) as exc:
            raise FormatError(f"{what} has a damaged header ({exc})") from None
        ids = [*successors, *([next_head] if name is not None else [])]
        if len(token) != _TOKEN or len(successors) != SUCCESSORS or not all(
            isinstance(i, str) and _ID.match(i) for i in ids
        ) or (name is not None and not isinstance(name, str)):
            raise FormatError(f"{what} has a malformed header")
        return cls(token, body[8 + size :], successors, name, next_head)


def encode_node(children: builtins.list[str]) -> bytes:
    body = _NODE_MAGIC + json.dumps(children, separators=(",", ":")).encode()
    return body + _digest(body)


def decode_node(data: bytes, count: int, what: str) -> builtins.list[str]:
    body, digest = data[:-_DIGEST], data[-_DIGEST:]
    if not body.startswith(_NODE_MAGIC) or _digest(body) != digest:
        raise FormatError(f"{what} is not a metasync log index node")
    try:
        children = json.loads(body[len(_NODE_MAGIC):])
    except ValueError:
        raise FormatError(f"{what} is damaged") from None
    if not isinstance(children, list) or len(children) != count or not all(
        isinstance(c, str) and _ID.match(c) for c in children
    ):
        raise FormatError(f"{what} is malformed")
    return children


@dataclass
class _Chain:
    """What this client knows of one log: the id of each known entry, in order."""

    ids: builtins.list[str]
    entries: builtins.list[LogEntry]

    def id_of(self, position: int) -> str | None:
        """The reserved id of ``position`` if a known entry names it."""
        if position < len(self.ids):
            return self.ids[position]
        last = len(self.entries) - 1
        if last < 0 or position - last > SUCCESSORS:
            return None
        return self.entries[last].successors[position - last - 1]


class DriveLogs(LogStore):
    """Append-only logs on Drive from exclusive creates by reserved id.

    Layout (all items are created with ids from ``files.generateIds``; the
    namespace folder's properties name the first two):

    - folder ``metasync logs`` (id ``metasyncLogFolder``) in the namespace folder;
    - the index root, a file (id ``metasyncLogRoot``) listing 256 reserved ids, one
      per first byte of ``sha256(log name)``; each of those, once created, is an index
      node listing 256 reserved ids of bucket heads (second byte) plus the id of a
      shard folder holding that node's entries;
    - a bucket is a chain of *log heads*: head = entry 0 of one log, carrying the
      log's name and the id reserved for the bucket's next head;
    - entry *p* carries the ids reserved for entries *p+1 .. p+K* (K =
      :data:`SUCCESSORS`): entry *p+1* can only be created with the id entry *p*
      named, and the list of entry *p+1* is that of entry *p* shifted by one plus
      one fresh id.

    Safety: every entry, head and node is immutable and is created only by
    ``files.create`` with its reserved id, which Drive performs at most once (later
    creates get 409). So each position of each log holds one value forever, a
    position exists only after the one before it (its id is only known from there)
    and every reader sees the same sequence. A log has one head: a creator of a
    bucket's *j*-th head has read heads 0..*j*-1 and found none of its log. Nothing
    depends on listings or on timing.
    """

    def __init__(self, backend: GDriveBackend) -> None:
        self.b = backend
        self._lock = threading.Lock()
        self._nodes: dict[str, builtins.list[str]] = {}
        self._heads: dict[str, LogEntry] = {}
        self._chains: dict[str, _Chain] = {}
        self._made: set[str] = set()

    # --- index ---------------------------------------------------------------------
    def _props(self) -> tuple[str, str, str]:
        ns = self.b.namespace_folder()
        props = ns.get("properties") or {}
        folder, root = props.get(PROP_LOG_FOLDER), props.get(PROP_LOG_ROOT)
        if not (isinstance(folder, str) and _ID.match(folder) and isinstance(root, str)
                and _ID.match(root)):
            raise FormatError(
                f"{self.b.name}: the namespace folder {self.b.namespace!r} lacks the "
                "properties of a metasync repository (made by another tool?)"
            )
        return str(ns["id"]), folder, root

    def _folder(self, folder_id: str, parent: str, name: str) -> str:
        """Make sure the reserved folder ``folder_id`` exists (exclusive create)."""
        with self._lock:
            if folder_id in self._made:
                return folder_id
        self.b.create_with_id(folder_id, {"name": name, "mimeType": FOLDER, "parents": [parent]},
                              None, "create a log folder on")
        with self._lock:
            self._made.add(folder_id)
        return folder_id

    def _read(self, file_id: str, what: str, must_exist: bool) -> bytes | None:
        """Read ``file_id``; if ``must_exist`` (Drive said 409), a 404 is a read racing
        the creator's commit: read again a few times."""
        for attempt in range(READ_AFTER_CONFLICT_TRIES if must_exist else 1):
            data = self.b.read_by_id(file_id, what)
            if data is not None or not must_exist:
                return data
            time.sleep(0.05 * 2**attempt)  # the creator's commit is not visible yet
        raise TransientError(f"{self.b.name}: {what} exists but cannot be read yet")

    def _create_in(self, file_id: str, body: dict[str, Any], data: bytes,
                   folders: builtins.list[tuple[str, str, str]], what: str) -> bool:
        """``create_with_id`` of an item whose parent folders (``(id, parent, name)``,
        outermost first) are made only when Drive says a parent is missing (404): a
        reserved folder exists once anyone made it, so the common case costs nothing."""
        try:
            return self.b.create_with_id(file_id, body, data, what)
        except ObjectNotFound:
            for folder_id, parent, name in folders:
                self._folder(folder_id, parent, name)
            return self.b.create_with_id(file_id, body, data, what)

    def _node(self, node_id: str, parent: str, name: str, count: int, create: bool) -> builtins.list[str] | None:
        with self._lock:
            cached = self._nodes.get(node_id)
        if cached is not None:
            return cached
        data = self._read(node_id, f"log index node {name}", must_exist=False)
        if data is None:
            if not create:
                return None
            children = self.b.reserve_ids(count)
            ns_id, folder, _ = self._props()
            if self._create_in(node_id, {"name": name, "parents": [parent], "mimeType": OCTET},
                               encode_node(children), [(folder, ns_id, LOG_FOLDER_NAME)],
                               "create a log index node on"):
                data = encode_node(children)
            else:  # made by another client (or by our own lost attempt): theirs counts
                data = self._read(node_id, f"log index node {name}", must_exist=True)
        assert data is not None
        children = decode_node(data, count, f"log index node {name} on {self.b.name}")
        with self._lock:
            self._nodes[node_id] = children
        return children

    def _bucket(self, log: str, create: bool) -> tuple[str, str] | None:
        """``(id of the bucket's first head, shard folder id)`` for ``log``."""
        _, folder, root = self._props()
        top = self._node(root, folder, "index", FANOUT, create)
        if top is None:
            return None
        h = hashlib.sha256(log.encode()).digest()
        node = self._node(top[h[0]], folder, f"index {h[0]:02x}", FANOUT + 1, create)
        if node is None:
            return None
        return node[h[1]], node[FANOUT]

    def _shard_path(self, log: str, shard: str) -> builtins.list[tuple[str, str, str]]:
        """The folders an entry of ``log`` goes into, outermost first."""
        ns_id, folder, _ = self._props()
        first = hashlib.sha256(log.encode()).digest()[0]
        return [(folder, ns_id, LOG_FOLDER_NAME), (shard, folder, f"{first:02x}")]

    def _entry(self, file_id: str, what: str, must_exist: bool) -> LogEntry | None:
        data = self._read(file_id, what, must_exist)
        return None if data is None else LogEntry.decode(data, f"{what} on {self.b.name}")

    def _head(self, log: str, create: tuple[bytes, bytes] | None) -> tuple[str, LogEntry, bool] | None:
        """``(head id, head, made by this call)`` of ``log``; with ``create=(token,
        message)`` a missing log is started with that message as entry 0."""
        bucket = self._bucket(log, create is not None)
        if bucket is None:
            return None
        slot, shard = bucket
        for _ in range(1 << 20):
            with self._lock:
                head = self._heads.get(slot)
            if head is None:
                head = self._entry(slot, f"log head of bucket {slot}", must_exist=False)
            if head is None:
                if create is None:
                    return None
                token, message = create
                mine = LogEntry(token, message, tuple(self.b.reserve_ids(SUCCESSORS)), log,
                                self.b.reserve_ids(1)[0])
                name = f"log {log.replace('/', '-')} {0:010d}"
                if self._create_in(slot, {"name": name, "parents": [shard], "mimeType": OCTET},
                                   mine.encode(), self._shard_path(log, shard),
                                   "append to a log on"):
                    head, made = mine, True
                else:
                    head = self._entry(slot, "a log head", must_exist=True)
                    assert head is not None
                    made = head.token == token and head.log == log
            else:
                made = False
            with self._lock:
                self._heads[slot] = head
            if head.log == log:
                return slot, head, made
            assert head.next_head is not None
            slot = head.next_head
        raise FormatError(f"{self.b.name}: the log index bucket of {log!r} does not end")

    def _chain(self, log: str, head_id: str, head: LogEntry) -> _Chain:
        with self._lock:
            chain = self._chains.get(log)
            if chain is None or chain.ids[0] != head_id:
                chain = _Chain([head_id], [head])
                self._chains[log] = chain
            return chain

    def _learn(self, log: str, chain: _Chain, position: int, file_id: str, entry: LogEntry) -> None:
        """Add entry ``position`` (just read or written) to what is known."""
        with self._lock:
            if position != len(chain.entries):
                return  # another thread learned it already
            previous = chain.entries[-1]
            if entry.log is not None or entry.successors[:-1] != previous.successors[1:]:
                raise FormatError(
                    f"log {log} entry {position} on {self.b.name} does not continue entry "
                    f"{position - 1} (damaged or forged)"
                )
            chain.ids.append(file_id)
            chain.entries.append(entry)

    def _advance(self, log: str, chain: _Chain, upto: int | None = None) -> None:
        """Read entries past the known end until one is missing (or ``upto`` entries
        are known): one at first, then 2, 4, ... up to K at once (every entry names
        the ids of the K after it)."""
        batch = 1
        while upto is None or len(chain.entries) < upto:
            known = len(chain.entries)
            ids = [chain.id_of(known + i) for i in range(batch)]
            found = _read_many(
                lambda i: self._entry(cast(str, i), f"log {log} entry", must_exist=False),
                ids,
            )
            for offset, entry in enumerate(found):
                if entry is None:
                    return
                self._learn(log, chain, known + offset, cast(str, ids[offset]), entry)
            if not found:
                return
            batch = min(SUCCESSORS, 2 * batch)  # a busy log: read further ahead

    def fetch(self, log: str, start: int = 0) -> builtins.list[tuple[int, bytes]]:
        """Entries from ``start`` on: the head through the index (cached), then the
        entries past what this client knows, read ahead in parallel by their ids."""
        if start < 0:
            raise ValueError(f"fetch needs start >= 0, got {start}")
        check_key(log)
        if not self.b.exists():
            return []
        found = self._head(log, None)
        if found is None:
            return []
        head_id, head, _ = found
        chain = self._chain(log, head_id, head)
        self._advance(log, chain)
        return [(p, e.message) for p, e in enumerate(chain.entries) if p >= start]

    def _create_entry(self, log: str, chain: _Chain, position: int, token: bytes,
                      message: bytes) -> bool | None:
        """Try to create entry ``position``: True if it is ours, False if another
        value holds it (learned), None if the entry before it is not known."""
        with self._lock:
            if position > len(chain.entries):
                return None
            if position < len(chain.entries):
                return chain.entries[position].token == token
            previous = chain.entries[-1]
            file_id = chain.id_of(position)
        assert file_id is not None
        _, shard = cast(tuple[str, str], self._bucket(log, False))
        mine = LogEntry(token, message, (*previous.successors[1:], self.b.reserve_ids(1)[0]))
        name = f"log {log.replace('/', '-')} {position:010d}"
        if self._create_in(file_id, {"name": name, "parents": [shard], "mimeType": OCTET},
                           mine.encode(), self._shard_path(log, shard), "append to a log on"):
            self._learn(log, chain, position, file_id, mine)
            return True
        stored = self._entry(file_id, f"log {log} entry {position}", must_exist=True)
        assert stored is not None
        self._learn(log, chain, position, file_id, stored)
        return stored.token == token

    def append(self, log: str, message: bytes) -> int:
        """Create one entry past the known end with the reserved id; while Drive says
        the id is taken (409), read that entry and try the next. Uncontended with a
        current view: one ``files.create``."""
        check_key(log)
        self.b.namespace_folder()
        token = secrets.token_bytes(_TOKEN)
        head_id, head, made = cast(tuple[str, LogEntry, bool], self._head(log, (token, message)))
        if made:
            self._chain(log, head_id, head)
            return 0
        chain = self._chain(log, head_id, head)
        while True:
            position = len(chain.entries)
            outcome = self._create_entry(log, chain, position, token, message)
            if outcome:
                return position

    def append_at(self, log: str, position: int, message: bytes) -> bool:
        """Create entry ``position`` only if the log has exactly ``position`` entries."""
        if position < 0:
            raise ValueError(f"append_at needs position >= 0, got {position}")
        check_key(log)
        self.b.namespace_folder()
        token = secrets.token_bytes(_TOKEN)
        if position == 0:
            found = self._head(log, (token, message))
            assert found is not None
            return found[2]
        found = self._head(log, None)
        if found is None:
            return False
        head_id, head, _ = found
        chain = self._chain(log, head_id, head)
        if len(chain.entries) < position:
            self._advance(log, chain, upto=position)
        if len(chain.entries) != position:
            if len(chain.entries) < position:
                return False
            return False
        return bool(self._create_entry(log, chain, position, token, message))

    def delete_log(self, log: str) -> int:
        """Not on Drive (``log_deletion`` is False): a log's first entry is a link of
        its index bucket's chain of log heads, so removing it would cut other logs off.
        Raises :class:`NotImplementedError`."""
        raise NotImplementedError(
            f"{self.b.name} keeps its logs: Google Drive logs cannot be deleted"
        )


def _read_many(get: Callable[[str | None], LogEntry | None],
               ids: builtins.list[str | None]) -> builtins.list[LogEntry | None]:
    """``get`` of each id, up to K at once; stops at the first unknown id."""
    usable: builtins.list[str | None] = []
    for i in ids:
        if i is None:
            break
        usable.append(i)
    if len(usable) <= 1:
        return [get(i) for i in usable]
    with ThreadPoolExecutor(len(usable), "metasync-gdrive-log") as pool:
        return list(pool.map(get, usable))


# --- sign-in -----------------------------------------------------------------------------


def _client_config(app_key: str, app_secret: str | None, base_url: str | None) -> dict[str, Any]:
    auth_uri = f"{base_url}/o/oauth2/auth" if base_url else GOOGLE_AUTH_URI
    token_uri = f"{base_url}/token" if base_url else GOOGLE_TOKEN_URI
    client: dict[str, Any] = {"client_id": app_key, "auth_uri": auth_uri, "token_uri": token_uri,
                              "redirect_uris": ["http://localhost"]}
    if app_secret:
        client["client_secret"] = app_secret
    return {"installed": client}


def authorize(request: AuthRequest, ui: AuthUI) -> Grant:
    """``metasync auth gdrive``: Google's installed-app flow (OAuth 2 with PKCE and a
    loopback redirect to a one-shot local server). With ``--no-browser`` nothing is
    started: the user opens the printed address anywhere and pastes back the address
    the browser was finally sent to (``http://localhost:.../?code=...``), or a code
    (``--code``)."""
    import requests
    from google_auth_oauthlib.flow import InstalledAppFlow
    from oauthlib.oauth2.rfc6749.errors import OAuth2Error

    app_key, app_secret = app_credentials("gdrive", request.app_key, request.app_secret)
    base = request.endpoint.base_url
    ca_file = request.endpoint.ca_file
    config = _client_config(app_key, app_secret, base)
    params = {"access_type": "offline", "prompt": "consent"}
    shown: dict[str, str] = {}

    class Flow(InstalledAppFlow):
        def authorization_url(self, **kwargs: Any) -> tuple[str, str]:
            url, state = super().authorization_url(**{**params, **kwargs})
            shown["state"] = state
            if request.code is None and not shown.get("announced"):
                shown["announced"] = "1"
                if request.no_browser:
                    ui.show("Visit this address in any browser, allow metasync, then paste "
                            "the address the browser ends up at (http://localhost:...; the "
                            f"page itself may fail to load):\n  {url}")
                elif ui.open_browser(url):
                    ui.show("A browser window asks you to allow metasync; if it did not "
                            f"open, visit:\n  {url}")
                else:
                    ui.show("Visit this address in a browser on this computer and allow "
                            f"metasync (it returns here by itself):\n  {url}")
            return url, state

    # Without a local server (--no-browser, --code) the code may come from another run
    # of this command (a code pasted later with --code), which cannot know this run's
    # PKCE verifier: those modes use the client secret alone, and a fixed loopback
    # address nothing listens on (port 1), so the code is bound to a known redirect.
    manual = request.no_browser or request.code is not None
    flow = Flow.from_client_config(config, list(SCOPES), autogenerate_code_verifier=not manual)
    pin_ca(flow.oauth2session, ca_file)
    if ca_file:
        flow.oauth2session.verify = ca_file
    try:
        if manual:
            flow.redirect_uri = MANUAL_REDIRECT
            flow.authorization_url()
            answer = request.code if request.code is not None else ui.prompt("Address or code: ")
            code = pasted_code(answer, shown["state"], "gdrive", "Google")
            flow.fetch_token(code=code)
        else:
            flow.run_local_server(host="localhost", port=0, open_browser=False,
                                  authorization_prompt_message=None,
                                  success_message="metasync is signed in; you may close "
                                  "this window.", timeout_seconds=600)
    except OAuth2Error as exc:
        raise UsageError(
            f"Google did not accept the sign-in ({exc.error}); run `metasync auth gdrive` "
            "again"
        ) from None
    except requests.RequestException as exc:
        raise BackendUnavailable(f"cannot reach Google to finish the sign-in: {one_line(exc)}") from None
    except AttributeError as exc:  # WSGITimeoutError: no answer from the browser
        raise UsageError(f"no answer from the browser ({exc}); sign-in cancelled") from None
    token = flow.oauth2session.token
    refresh_token = token.get("refresh_token")
    if not refresh_token:
        raise UsageError("Google returned no refresh token; the OAuth client must be of type "
                         "'Desktop app'")
    expires_at = token.get("expires_at")
    extra: dict[str, Any] = {}
    grant = Grant("gdrive", request.account, app_key, refresh_token, token.get("access_token"),
                  float(expires_at) if expires_at else None, app_secret, extra)
    with contextlib.suppress(Exception):  # the e-mail is only shown to the user
        http_ = _new_http(DEFAULT_TIMEOUT, ca_file)
        service = _build_service(http_, base)
        about = service.about().get(fields="user(emailAddress,displayName)").execute(
            http=_StaticBearer(http_, str(token.get("access_token"))))
        extra["email"] = about["user"]["emailAddress"]
    return grant


class _StaticBearer:
    def __init__(self, raw: Any, token: str) -> None:
        self.raw = raw
        self.token = token

    def request(self, uri: str, method: str = "GET", body: Any = None,
                headers: dict[str, str] | None = None, **kwargs: Any) -> Any:
        headers = {**(headers or {}), "authorization": f"Bearer {self.token}"}
        return self.raw.request(uri, method, body=body, headers=headers, **kwargs)


