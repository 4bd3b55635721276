"""The ``webdav:`` and ``webdavs:`` backends: a folder on a WebDAV server.

``webdav://user:pass@host:port/some/folder`` with namespace ``ns`` keeps every key
under ``/some/folder/ns/``; key ``a/b`` is the resource ``/some/folder/ns/a/b``.
``webdavs://`` is the same over HTTPS. ``init`` and ``backend add`` create a missing
location folder (:meth:`WebdavBackend.create_location`); :meth:`WebdavBackend.create`
makes only the namespace collection (MKCOL) in an existing one.

Requests (one HTTP/1.1 keep-alive connection pool per backend instance, httpx):

- ``put``: ``PUT <folder>/.tmp-<random>`` (streamed), then ``MOVE`` it onto the key
  with ``Overwrite: T``. A server's plain PUT writes into the target as the body
  arrives (wsgidav, Apache), so readers could see a partial object; the MOVE
  publishes the whole object at once.
- ``put_if_absent``: best effort (``conditional_create=False``): a PROPFIND, then a
  MOVE with ``Overwrite: F``. wsgidav checks the destination and then renames, so
  two racing creators can both win; logs therefore never rely on it.
- logs (``logs=locks``, the default; :class:`WebdavLockLogs`): entry *p* of log ``L`` is ``L/<p:010d>``. An
  appender uploads the message to ``.tmp-<random>`` at the namespace root, takes an
  exclusive depth-infinity WebDAV ``LOCK`` on the collection ``L/``, lists it, MOVEs
  the temp file to one past the highest entry (the MOVE carries the lock token, so
  a holder whose lock expired is refused by the server), and ``UNLOCK``s. The server
  grants each lock to one client at a time, so appends never race. Needs a class 2
  server (wsgidav, Apache mod_dav, Nextcloud/ownCloud).
- logs with ``logs=registers``: :class:`~metasync.backends.logs.RegisterLogs`
  (Disk Paxos over whole-object replaces), for servers without locks; it needs only
  that a listing or read starting after a write finished sees that write, but costs
  several times more requests.
- ``list``: ``PROPFIND Depth: 1`` per folder (``Depth: infinity`` is disabled on
  many servers).

URI options (query string): ``transfers=N`` (default 4) bounds concurrent requests
per instance; ``timeout=S`` (default 60) is the connect/read/write timeout in
seconds; ``ca=/path/ca.pem`` trusts that CA for ``webdavs:``; ``plain_http=1`` lets
a URI typed on this machine take environment credentials over plain HTTP. ``ca`` and
``plain_http`` are local options (never shared, :mod:`metasync.backends.uris`).
Credentials come from the URI only: ``METASYNC_WEBDAV_USER`` /
``METASYNC_WEBDAV_PASSWORD`` are added to a URI typed on this machine's command line
(:func:`~metasync.backends.uris.typed_uri`), never to one from the shared
configuration. The password is never part of :attr:`WebdavBackend.name` or any message.
"""

from __future__ import annotations

import builtins
import hashlib
import io
import random
import re
import secrets
import socket
import threading
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterable, Iterator
from email.utils import parsedate_to_datetime
from typing import BinaryIO, NoReturn, TypeVar
from urllib.parse import parse_qsl, quote, unquote, urlsplit

import httpx

from metasync.backends import register
from metasync.backends.base import (
    TEMP_PREFIX,
    Backend,
    Capabilities,
    TempFile,
    check_key,
    check_namespace,
    check_prefix,
    is_key_part,
    temp_path_parts,
)
from metasync.backends.logs import (
    CachedEntries,
    LogStore,
    RegisterLogs,
    entry_name,
    entry_position,
    log_children,
)
from metasync.backends.retry import (
    RetryPolicy,
    TransientError,
    parse_retry_after,
    retrying,
    silence_of,
)
from metasync.errors import (
    BackendError,
    BackendFull,
    BackendUnavailable,
    NoAnswer,
    ObjectNotFound,
    PrimitiveMissing,
    UsageError,
)
from metasync.timeouts import network_timeout

T = TypeVar("T")

#: Upload and download pieces: memory use does not grow with the object.
CHUNK_SIZE = 1 << 20
#: Immediate re-asks of a folder listing that failed with 500 (see ``_propfind``).
PROPFIND_RACE_TRIES = 10
#: Objects up to this size are hashed into their poll token (see :meth:`poll`).
POLL_HASH_LIMIT = 1 << 20
DEFAULT_TRANSFERS = 4
DEFAULT_TIMEOUT = 60.0

_DAV = "{DAV:}"
_PROPFIND_BODY = (
    b'<?xml version="1.0" encoding="utf-8"?>'
    b'<propfind xmlns="DAV:"><prop>'
    b"<resourcetype/><getcontentlength/><getetag/><getlastmodified/>"
    b"</prop></propfind>"
)
# Listings ask for the resource type only: wsgidav computes an ETag (an extra stat)
# for every entry asked for it, and a busy log folder holds thousands of names.
_LIST_BODY = (
    b'<?xml version="1.0" encoding="utf-8"?>'
    b'<propfind xmlns="DAV:"><prop><resourcetype/></prop></propfind>'
)
_RETRY_STATUSES = frozenset({408, 425, 429, 500, 502, 503, 504})


class _Entry:
    """One resource of a PROPFIND answer."""

    __slots__ = ("etag", "is_collection", "modified", "path", "size")

    def __init__(
        self, path: str, is_collection: bool, size: int | None, etag: str, modified: str
    ) -> None:
        self.path = path  # decoded, without a trailing "/"
        self.is_collection = is_collection
        self.size = size
        self.etag = etag
        self.modified = modified



class _Rewind:
    """Makes a request body replayable for retries where the source allows it."""

    def __init__(self, data: bytes | BinaryIO) -> None:
        self.data = data
        self.length: int | None = None
        self.start: int | None = None
        self.used = False
        if isinstance(data, bytes | bytearray | memoryview):
            self.length = len(data)
            return
        try:
            if data.seekable():
                self.start = data.tell()
                self.length = data.seek(0, io.SEEK_END) - self.start
                data.seek(self.start)
        except (AttributeError, OSError, ValueError):
            self.start = None

    def body(self) -> bytes | Iterator[bytes]:
        """The body for one more attempt; TransientError if it cannot be replayed."""
        if isinstance(self.data, bytes | bytearray | memoryview):
            return bytes(self.data)
        if self.used:
            if self.start is None:
                raise _NotReplayable()
            self.data.seek(self.start)
        self.used = True
        return self._chunks(self.data)

    @staticmethod
    def _chunks(stream: BinaryIO) -> Iterator[bytes]:
        while True:
            # read() may return fewer bytes than asked; only b"" is the end.
            chunk = stream.read(CHUNK_SIZE)
            if not chunk:
                return
            yield chunk


class _NotReplayable(Exception):
    """A failed upload from a non-seekable stream cannot be retried here."""


class _ResponseStream(io.RawIOBase):
    """A readable stream over a streamed httpx response (closes it when closed)."""

    def __init__(self, response: httpx.Response, backend: WebdavBackend, key: str) -> None:
        super().__init__()
        self._response = response
        self._chunks = response.iter_raw(CHUNK_SIZE)
        self._buffer = b""
        self._backend = backend
        self._key = key

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: memoryview) -> int:  # type: ignore[override]
        view = memoryview(buffer).cast("B")
        while not self._buffer:
            try:
                self._buffer = next(self._chunks)
            except StopIteration:
                return 0
            except httpx.HTTPError as exc:
                raise self._backend._transport_error(exc, f"read {self._key!r}") from exc
        n = min(len(view), len(self._buffer))
        view[:n] = self._buffer[:n]
        self._buffer = self._buffer[n:]
        return n

    def close(self) -> None:
        if not self.closed:
            self._response.close()
        super().close()


@register
class WebdavBackend(Backend):
    """A collection on a WebDAV server, URI ``webdav://[user[:pass]@]host[:port]/path``.

    Thread-safe: one instance may be used from many threads; at most ``transfers``
    requests run at once and connections are reused.
    """

    scheme = "webdav"
    capabilities = Capabilities(
        # MOVE with Overwrite: F is checked, then performed, without a lock on wsgidav.
        conditional_create=False,
        compare_and_swap=False,
        # Both log stores (locks, registers) implement append_at.
        conditional_append=True,
        range_reads=True,
        max_object_size=None,
        case_sensitive=True,
        long_poll=False,
        temp_files=True,
    )
    #: ``http`` or ``https``.
    http_scheme = "http"

    def __init__(self, uri: str, namespace: str) -> None:
        """Parse ``uri``; touches nothing on the server.

        Raises :class:`UsageError` for a malformed URI, option or namespace.
        """
        super().__init__(uri, namespace)
        parts = urlsplit(uri)
        if parts.scheme != self.scheme or not parts.hostname:
            raise UsageError(
                f"not a {self.scheme}: URI: {self._redact(uri)!r}; "
                f"use {self.scheme}://[user[:password]@]host[:port]/path"
            )
        check_namespace(namespace)
        options = dict(parse_qsl(parts.query, keep_blank_values=True))
        unknown = set(options) - {"transfers", "timeout", "ca", "logs", "plain_http"}
        if unknown:
            raise UsageError(
                f"unknown option(s) {', '.join(sorted(unknown))} in {self.name}; "
                "known: transfers, timeout, ca, logs, plain_http"
            )
        #: How logs are kept (every client of a repository uses the same URI, so the same).
        self.logs_mode = options.get("logs", "locks")
        if self.logs_mode not in ("locks", "registers"):
            raise UsageError(f"logs= must be locks or registers in {self.name}")
        try:
            transfers = int(options.get("transfers", DEFAULT_TRANSFERS))
            timeout = float(options.get("timeout", DEFAULT_TIMEOUT))
        except ValueError as exc:
            raise UsageError(f"bad transfers= or timeout= option in {self.name}") from exc
        if transfers < 1 or timeout <= 0:
            raise UsageError(f"transfers= and timeout= must be positive in {self.name}")
        #: Maximum concurrent requests of this instance.
        self.transfers = transfers
        # Only the URI's own credentials: environment passwords are added to a URI
        # typed on this machine (backends.uris.typed_uri), never to one this backend
        # is opened with from the shared configuration.
        user = unquote(parts.username) if parts.username else None
        password = unquote(parts.password) if parts.password is not None else None
        self._has_user = user is not None
        port = f":{parts.port}" if parts.port else ""
        host = parts.hostname if ":" not in parts.hostname else f"[{parts.hostname}]"
        self._origin = f"{self.http_scheme}://{host}{port}"
        # The path may be written raw ("ünï cødé") or percent-encoded; segments are
        # decoded here and encoded again for every request.
        self._base_segments = [unquote(s) for s in parts.path.split("/") if s]
        self._root_segments = [*self._base_segments, *namespace.split("/")]
        verify: bool | str = options.get("ca", True) if self.http_scheme == "https" else True
        # Streams returned by open() keep a connection beyond the transfer limit.
        limits = httpx.Limits(
            max_connections=transfers + 8, max_keepalive_connections=transfers + 8
        )
        #: Seconds one network wait may last (``timeout=``, at most ``--timeout``).
        self._timeout = network_timeout(timeout)
        self._client = httpx.Client(
            auth=httpx.BasicAuth(user, password or "") if user is not None else None,
            # --timeout bounds each connect, TLS handshake, read and write as well.
            timeout=httpx.Timeout(self._timeout),
            # Nagle's algorithm would hold a PUT's body behind its headers until the
            # server's delayed ACK (tens of ms per request).
            transport=httpx.HTTPTransport(
                verify=verify,
                socket_options=[(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)],
                limits=limits,
            ),
            follow_redirects=False,
        )
        self._slots = threading.BoundedSemaphore(transfers)
        self._policy = RetryPolicy(budget=self._timeout, silence=silence_of(self.uri))
        # Folders known to exist (saves a MKCOL chain before most writes).
        self._folders: set[str] = set()
        self._folders_lock = threading.Lock()

    # --- naming -----------------------------------------------------------------------
    @staticmethod
    def _redact(uri: str) -> str:
        parts = urlsplit(uri)
        if parts.password is None:
            return uri
        netloc = parts.netloc.rsplit("@", 1)
        return uri.replace(parts.netloc, f"{parts.username}:***@{netloc[-1]}", 1)

    @property
    def name(self) -> str:
        """The URI without its password (and without options)."""
        return self._redact(self.uri).split("?", 1)[0]

    def _url(self, segments: Iterable[str], *, folder: bool = False) -> str:
        path = "/".join(quote(s, safe="") for s in segments)
        return f"{self._origin}/{path}{'/' if folder and path else ''}"

    def _key_segments(self, key: str) -> builtins.list[str]:
        return [*self._root_segments, *key.split("/")]

    @property
    def _location_path(self) -> str:
        return "/" + "/".join(self._base_segments)

    # --- requests -------------------------------------------------------------------
    def _transport_error(self, exc: httpx.HTTPError, what: str) -> BackendError:
        """Map an httpx transport failure to the error contract."""
        if isinstance(exc, httpx.ConnectError):
            return BackendUnavailable(
                f"cannot reach {self.name} to {what} ({exc or type(exc).__name__}); "
                "is the server running and the host and port right?"
            )
        if isinstance(exc, httpx.PoolTimeout):  # our own pool had no free connection
            return TransientError(f"{what} on {self.name}: no free connection within "
                                  f"{self._timeout:g}s (too many requests at once)")
        if isinstance(exc, httpx.TimeoutException):
            return NoAnswer(
                f"{what} on {self.name}: no answer within {self._timeout:g}s (the server "
                "accepted the connection but did not reply); check the server, or allow "
                "longer with --timeout"
            )
        detail = str(exc) or type(exc).__name__
        return TransientError(f"{what} on {self.name} failed: {detail} (connection dropped)")

    def _status_error(self, response: httpx.Response, what: str) -> BackendError:
        """Map an unexpected HTTP status to the error contract (one line)."""
        status = response.status_code
        if status == 401:
            who = "the user and password" if self._has_user else "credentials"
            return BackendError(
                f"{what} on {self.name}: 401 unauthorized; check {who} "
                "(in the URI or METASYNC_WEBDAV_USER / METASYNC_WEBDAV_PASSWORD)"
            )
        if status == 403:
            return BackendError(
                f"{what} on {self.name}: 403 forbidden; the user lacks permission there"
            )
        if status == 507:
            return BackendFull.of(self.name, "507 Insufficient Storage")
        if status in _RETRY_STATUSES or status >= 500:
            return TransientError(
                f"{what} on {self.name}: HTTP {status} {response.reason_phrase}",
                retry_after=parse_retry_after(response.headers.get("Retry-After")),
            )
        return BackendError(f"{what} on {self.name}: unexpected HTTP {status} {response.reason_phrase}")

    def _send(
        self,
        method: str,
        url: str,
        what: str,
        *,
        headers: dict[str, str] | None = None,
        content: bytes | Iterator[bytes] | None = None,
        stream: bool = False,
    ) -> httpx.Response:
        """One request under the transfer limit; transport failures are mapped.

        With ``stream`` the body is not read (the caller reads or closes it).
        """
        request = self._client.build_request(method, url, headers=headers, content=content)
        with self._slots:
            try:
                response = self._client.send(request, stream=stream)
            except httpx.HTTPError as exc:
                raise self._transport_error(exc, what) from exc
        return response

    def _call(self, what: str, request: Callable[[], T]) -> T:
        return retrying(self._policy, f"{what} on {self.name}", request)

    def _propfind(self, segments: builtins.list[str], depth: str, what: str) -> builtins.list[_Entry] | None:
        """PROPFIND at ``segments``; None if it does not exist."""
        url = self._url(segments, folder=depth == "1")
        for _ in range(PROPFIND_RACE_TRIES):
            response = self._send(
                "PROPFIND",
                url,
                what,
                headers={"Depth": depth, "Content-Type": 'application/xml; charset="utf-8"'},
                content=_LIST_BODY if depth == "1" else _PROPFIND_BODY,
            )
            # wsgidav answers 500 when a member is removed or renamed between its
            # readdir and its stat of that member (another client's MOVE or DELETE in
            # the same folder); asking again at once almost always succeeds.
            if response.status_code != 500 or depth != "1":
                break
        if response.status_code == 404:
            return None
        if response.status_code != 207:
            raise self._status_error(response, what)
        try:
            return self._parse_multistatus(response.content)
        except ET.ParseError as exc:
            raise TransientError(f"{what} on {self.name}: malformed PROPFIND answer") from exc

    @staticmethod
    def _parse_multistatus(body: bytes) -> builtins.list[_Entry]:
        entries = []
        for node in ET.fromstring(body).iter(f"{_DAV}response"):
            href = node.findtext(f"{_DAV}href") or ""
            path = unquote(urlsplit(href).path).rstrip("/")
            is_collection = False
            size: int | None = None
            etag = modified = ""
            for propstat in node.iter(f"{_DAV}propstat"):
                status = propstat.findtext(f"{_DAV}status") or ""
                if " 200 " not in status + " ":
                    continue
                for prop in propstat.iter(f"{_DAV}prop"):
                    kind = prop.find(f"{_DAV}resourcetype")
                    if kind is not None and kind.find(f"{_DAV}collection") is not None:
                        is_collection = True
                    length = prop.findtext(f"{_DAV}getcontentlength")
                    if length and length.strip().isdigit():
                        size = int(length.strip())
                    etag = prop.findtext(f"{_DAV}getetag") or etag
                    modified = prop.findtext(f"{_DAV}getlastmodified") or modified
            entries.append(_Entry(path, is_collection, size, etag, modified))
        return entries

    def _stat(self, key: str, what: str) -> _Entry | None:
        """The object at ``key`` (None if missing or a folder)."""

        def request() -> _Entry | None:
            entries = self._propfind(self._key_segments(key), "0", what)
            if not entries or entries[0].is_collection:
                return None
            return entries[0]

        return self._call(what, request)

    def _not_found(self, key: str) -> ObjectNotFound:
        return ObjectNotFound(f"no object {key!r} on {self.name}")

    def _missing_root(self) -> NoReturn:
        raise BackendUnavailable(
            f"namespace folder {self.namespace!r} is missing at {self.name}; "
            "was it deleted, or is this the wrong server path?"
        )

    # --- lifecycle --------------------------------------------------------------------
    def exists(self) -> bool:
        """True if the namespace collection exists."""
        entries = self._call(
            "check namespace", lambda: self._propfind(self._root_segments, "0", "check namespace")
        )
        return entries is not None and bool(entries) and entries[0].is_collection

    def probe(self) -> None:
        """Raise unless the location collection exists (one PROPFIND; writes nothing)."""
        entries = self._call(
            "check location", lambda: self._propfind(self._base_segments, "0", "check location")
        )
        if not entries or not entries[0].is_collection:
            raise BackendUnavailable(
                f"location {self.name} does not exist on the server (or is not a folder); "
                "create that folder on the WebDAV server first"
            )

    def create_location(self) -> None:
        """MKCOL the location collection and its missing parents (``init`` and ``backend
        add``, as restic and rclone do)."""
        entries = self._call(
            "check location", lambda: self._propfind(self._base_segments, "0", "check location")
        )
        if entries:
            return
        for depth in range(1, len(self._base_segments) + 1):
            self._mkcol(self._base_segments[:depth], root=True)

    def create(self) -> None:
        """MKCOL the namespace (idempotent); the location must exist already."""
        self.probe()
        for depth in range(len(self._base_segments) + 1, len(self._root_segments) + 1):
            self._mkcol(self._root_segments[:depth], root=True)

    def _mkcol_exists(self, segments: builtins.list[str]) -> bool:
        """One MKCOL of ``segments`` (no retry): whether the folder exists now. False
        when a parent is missing (409, or a 5xx some servers answer instead)."""
        response = self._send("MKCOL", self._url(segments, folder=True), "create folder")
        response.close()
        return response.status_code in (200, 201, 204, 405)

    def _mkcol(self, segments: builtins.list[str], *, root: bool = False) -> None:
        """Create one collection; an existing one is fine. A missing parent is the
        missing location (``root``) or namespace (otherwise)."""
        url = self._url(segments, folder=True)

        def request() -> None:
            response = self._send("MKCOL", url, "create folder")
            status = response.status_code
            if status in (200, 201, 204):
                return
            if status == 405:  # already exists (as a folder, or as an object in the way)
                return
            if status == 409:
                if root:
                    raise BackendUnavailable(
                        f"location {self.name} vanished while creating the namespace"
                    )
                self._missing_root()
            raise self._status_error(response, "create folder")

        self._call("create folder", request)

    def _ensure_folders(self, parents: builtins.list[str]) -> None:
        """Make the folder ``parents`` (key parts below the namespace) exist: one MKCOL
        of it when only it is new (or it exists), else each level not known to exist.

        The namespace collection itself is never created here: a vanished namespace
        must fail, not be silently recreated empty.
        """
        if not parents:
            return
        with self._folders_lock:
            if "/".join(parents) in self._folders:
                return
        if self._mkcol_exists([*self._root_segments, *parents]):
            with self._folders_lock:
                self._folders.update("/".join(parents[:d]) for d in range(1, len(parents) + 1))
            return
        if self._propfind(self._root_segments, "0", "check namespace") is None:
            self._missing_root()
        for depth in range(1, len(parents) + 1):
            folder = "/".join(parents[:depth])
            with self._folders_lock:
                known = folder in self._folders
            if known:
                continue
            self._mkcol([*self._root_segments, *parents[:depth]])
            with self._folders_lock:
                self._folders.add(folder)

    def close(self) -> None:
        """Close every pooled connection."""
        self._client.close()

    # --- storage ----------------------------------------------------------------------
    def _key(self, key: str) -> str:
        check_key(key)
        return key

    def _upload_temp(self, key: str, data: bytes | BinaryIO) -> builtins.list[str]:
        """PUT ``data`` to a new temp name in ``key``'s folder; return its segments."""
        parents = key.split("/")[:-1]
        body = _Rewind(data)
        temp = [*self._root_segments, *parents, TEMP_PREFIX + secrets.token_hex(8)]
        url = self._url(temp)
        headers = {"Content-Type": "application/octet-stream"}
        if body.length is not None:
            headers["Content-Length"] = str(body.length)
        with self._folders_lock:
            known = "/".join(parents) in self._folders
        if parents and not known:
            # Folders are made before the first write into them: some servers answer a
            # PUT into a missing folder with 500 rather than 409 (and a large body
            # would be streamed for nothing).
            self._call("create folder", lambda: self._ensure_folders(parents))

        def request() -> None:
            try:
                content = body.body()
            except _NotReplayable:
                raise BackendError(
                    f"upload of {key!r} to {self.name} failed and its source stream "
                    "cannot be rewound; try again"
                ) from None
            response = self._send("PUT", url, f"upload {key!r}", headers=headers, content=content)
            if response.status_code == 409:  # a parent folder is missing
                with self._folders_lock:
                    for depth in range(1, len(parents) + 1):
                        self._folders.discard("/".join(parents[:depth]))
                if not parents:
                    self._missing_root()
                self._ensure_folders(parents)
                # Send again at once: a missing folder is no reason for a backoff.
                try:
                    content = body.body()
                except _NotReplayable:
                    raise BackendError(
                        f"upload of {key!r} to {self.name} needed its folder created "
                        "first and its source stream cannot be rewound; try again"
                    ) from None
                response = self._send(
                    "PUT", url, f"upload {key!r}", headers=headers, content=content
                )
            if response.status_code in (200, 201, 204):
                return
            raise self._status_error(response, f"upload {key!r}")

        self._call(f"upload {key!r}", request)
        if parents:
            with self._folders_lock:
                self._folders.add("/".join(parents))
        return temp

    def _move(self, source: builtins.list[str], key: str, *, overwrite: bool) -> bool:
        """MOVE ``source`` onto ``key``; False if ``key`` exists and not ``overwrite``."""
        url = self._url(source)
        headers = {
            "Destination": self._url(self._key_segments(key)),
            "Overwrite": "T" if overwrite else "F",
        }
        attempts = [0]

        def request() -> bool:
            attempts[0] += 1
            response = self._send("MOVE", url, f"publish {key!r}", headers=headers)
            status = response.status_code
            if status in (201, 204):
                return True
            if status == 412:
                return False
            if status == 404 and attempts[0] > 1:
                # Our random temp name is gone after a dropped connection: the earlier
                # attempt moved it.
                return True
            if status == 207:
                # Per-resource failure (wsgidav: a concurrent MOVE onto the same key).
                raise TransientError(f"publish {key!r} on {self.name}: MOVE failed (207)")
            raise self._status_error(response, f"publish {key!r}")

        return self._call(f"publish {key!r}", request)

    # --- logs ---------------------------------------------------------------------------
    def specific_logs(self) -> LogStore:
        """The logs the URI's ``logs=`` option names: :class:`WebdavLockLogs` (``locks``,
        the default) or Disk Paxos registers (``registers``, for servers without locks)."""
        if self.logs_mode == "registers":
            return RegisterLogs(self)
        return WebdavLockLogs(self)

    def _ensure_log_folder(self, log: str) -> None:
        with self._folders_lock:
            known = log in self._folders
        if not known:
            self._call("create folder", lambda: self._ensure_folders(log.split("/")))

    def _put_plain(self, segments: builtins.list[str], data: bytes, log: str) -> None:
        response = self._send(
            "PUT",
            self._url(segments),
            f"upload to log {log!r}",
            headers={"Content-Type": "application/octet-stream"},
            content=data,
        )
        if response.status_code not in (200, 201, 204):
            raise self._status_error(response, f"upload to log {log!r}")

    def _lock(self, log: str) -> tuple[str, float] | None:
        """Take the exclusive lock of the log collection: its token and the seconds the
        server granted it for, or None if another client holds it."""
        response = self._send(
            "LOCK",
            self._url(self._key_segments(log), folder=True),
            f"lock log {log!r}",
            headers={
                "Depth": "infinity",
                "Timeout": f"Second-{LOCK_TIMEOUT}",
                "Content-Type": 'application/xml; charset="utf-8"',
            },
            content=_LOCK_BODY,
        )
        if response.status_code == 423:
            return None
        token = response.headers.get("Lock-Token", "").strip().strip("<>")
        if response.status_code not in (200, 201) or not token:
            if response.status_code in (405, 501):
                raise PrimitiveMissing(
                    f"{self.name} does not support WebDAV locks; add logs=registers to the "
                    "URI's options"
                )
            raise self._status_error(response, f"lock log {log!r}")
        granted = _GRANTED.search(response.text)
        return token, min(float(granted.group(1)), LOCK_TIMEOUT) if granted else LOCK_TIMEOUT

    def _unlock(self, log: str, token: str) -> None:
        # Best effort: an unlock that fails leaves the lock to expire on its own.
        try:
            self._send(
                "UNLOCK",
                self._url(self._key_segments(log), folder=True),
                f"unlock log {log!r}",
                headers={"Lock-Token": f"<{token}>"},
            ).close()
        except BackendError:
            pass

    def _move_locked(
        self, temp: builtins.list[str], log: str, position: int, token: str, expires: float
    ) -> None:
        """MOVE the temp file to entry ``position`` of ``log`` with the lock token. A
        refusal well before the lock could expire (``expires``, a ``time.monotonic()``
        time) is not an expired lock: the server does not honour its own tokens
        (:class:`PrimitiveMissing`, not retried); near or after it, it may be (transient)."""
        key = f"{log}/{entry_name(position)}"
        headers = {
            "Destination": self._url(self._key_segments(key)),
            "Overwrite": "F",
            # Tagged with the locked collection, so the condition applies there.
            "If": f"<{self._url(self._key_segments(log), folder=True)}> (<{token}>)",
        }
        attempts = [0]

        def request() -> None:
            attempts[0] += 1
            response = self._send("MOVE", self._url(temp), f"append to log {log!r}", headers=headers)
            if response.status_code in (201, 204):
                return
            if response.status_code == 404 and attempts[0] > 1:
                return  # our temp file is gone: the earlier, dropped attempt moved it
            if response.status_code in (412, 423):
                left = expires - time.monotonic()
                if left > LOCK_MARGIN:
                    raise PrimitiveMissing(
                        f"append to log {log!r} on {self.name}: the server refused to move the "
                        f"entry in (HTTP {response.status_code}) with the token of the log's "
                        f"lock, which this client holds for {left:.0f} s more: it does not "
                        "honour its locks; add logs=registers to the URI's options"
                    )
                raise TransientError(f"append to log {log!r} on {self.name}: lost the log's lock")
            raise self._status_error(response, f"append to log {log!r}")

        self._call(f"append to log {log!r}", request)

    def _discard(self, segments: builtins.list[str]) -> None:
        # Cleanup of our own temp file; a failure must not hide the real outcome.
        try:
            self._send("DELETE", self._url(segments), "remove temp file").close()
        except BackendError:
            pass

    def put(self, key: str, data: bytes | BinaryIO) -> None:
        """PUT to a temp name, then MOVE (Overwrite: T) onto ``key``."""
        self._key(key)
        temp = self._upload_temp(key, data)
        try:
            self._move(temp, key, overwrite=True)
        except BaseException:
            self._discard(temp)
            raise

    def put_if_absent(self, key: str, data: bytes) -> bool:
        """Best effort: a PROPFIND, then a MOVE with ``Overwrite: F`` (not atomic on
        wsgidav, hence ``conditional_create=False``)."""
        self._key(key)
        if self._stat(key, f"check {key!r}") is not None:
            return False
        temp = self._upload_temp(key, data)
        try:
            created = self._move(temp, key, overwrite=False)
        except BaseException:
            self._discard(temp)
            raise
        if not created:
            self._discard(temp)
        return created

    def _get(self, key: str, headers: dict[str, str] | None = None) -> httpx.Response:
        """One streamed GET of ``key`` (no retry; the caller retries and closes it).

        ObjectNotFound if missing; a 416 answer is returned for get_range to judge.
        """
        url = self._url(self._key_segments(key))
        response = self._send("GET", url, f"read {key!r}", headers=headers, stream=True)
        if response.status_code in (200, 206, 416):
            return response
        response.close()
        status = response.status_code
        if status in (404, 405):  # 405: a folder, not an object
            raise self._not_found(key)
        if status in (301, 302, 307, 308) and response.headers.get("Location", "").endswith("/"):
            raise self._not_found(key)  # Apache redirects a folder to its "/" form
        if status == 403:
            # wsgidav (without its HTML browser) forbids GET of a folder.
            entries = self._propfind(self._key_segments(key), "0", f"read {key!r}")
            if entries and entries[0].is_collection:
                raise self._not_found(key)
        raise self._status_error(response, f"read {key!r}")

    def get(self, key: str) -> bytes:
        """The whole object at ``key``."""
        self._key(key)

        def request() -> bytes:
            response = self._get(key)
            try:
                return response.read()
            except httpx.HTTPError as exc:
                raise self._transport_error(exc, f"read {key!r}") from exc
            finally:
                response.close()

        return self._call(f"read {key!r}", request)

    def open(self, key: str) -> BinaryIO:
        """A stream of the object (holds one connection until closed)."""
        self._key(key)
        response = self._call(f"read {key!r}", lambda: self._get(key))
        if response.status_code != 200:
            response.close()
            raise BackendError(f"read {key!r} on {self.name}: unexpected HTTP {response.status_code}")
        return io.BufferedReader(_ResponseStream(response, self, key), CHUNK_SIZE)

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        """``Range: bytes=`` GET; a server ignoring the range is streamed and skipped."""
        if offset < 0 or length < 0:
            raise ValueError(f"get_range needs offset, length >= 0, got {offset}, {length}")
        self._key(key)
        if length == 0:
            if self.size(key) < offset:
                raise self.truncated_error(key, offset + length)
            return b""

        def request() -> bytes:
            headers = {"Range": f"bytes={offset}-{offset + length - 1}"}
            response = self._get(key, headers)
            try:
                if response.status_code == 416:
                    raise self.truncated_error(key, offset + length)
                if response.status_code == 206:
                    data = response.read()
                else:  # 200: the whole object; skip to the range without keeping it
                    data = b""
                    skipped = 0
                    for chunk in response.iter_raw(CHUNK_SIZE):
                        if skipped + len(chunk) > offset:
                            data += chunk[max(0, offset - skipped) :]
                        skipped += len(chunk)
                        if len(data) >= length:
                            break
                    data = data[:length]
            except httpx.HTTPError as exc:
                raise self._transport_error(exc, f"read {key!r}") from exc
            finally:
                response.close()
            if len(data) != length:
                raise self.truncated_error(key, offset + length)
            return data

        return self._call(f"read {key!r}", request)

    def size(self, key: str) -> int:
        """Size from a PROPFIND (Depth: 0)."""
        self._key(key)
        entry = self._stat(key, f"stat {key!r}")
        if entry is None:
            raise self._not_found(key)
        if entry.size is None:
            raise BackendError(f"the server reports no size for {key!r} on {self.name}")
        return entry.size

    def delete(self, key: str) -> None:
        """DELETE ``key``; a folder of other keys is not an object (never removed)."""
        self._key(key)
        if self._stat(key, f"stat {key!r}") is None:
            raise self._not_found(key)
        url = self._url(self._key_segments(key))
        attempts = [0]

        def request() -> None:
            attempts[0] += 1
            response = self._send("DELETE", url, f"delete {key!r}")
            if response.status_code in (200, 204):
                return
            if response.status_code == 404:
                if attempts[0] > 1:
                    return  # an earlier attempt whose answer was lost deleted it
                raise self._not_found(key)
            raise self._status_error(response, f"delete {key!r}")

        self._call(f"delete {key!r}", request)

    def list(self, prefix: str = "") -> Iterator[str]:
        """Every key below the folder ``prefix`` (PROPFIND Depth: 1 per folder).

        Temp names and names that are not valid key parts are skipped; a missing
        prefix folder yields nothing, a missing namespace is BackendUnavailable.
        """
        prefix = check_prefix(prefix).rstrip("/")
        return iter(self._walk(prefix))

    def _walk(self, prefix: str) -> builtins.list[str]:
        keys: builtins.list[str] = []
        stack = [prefix]
        while stack:
            rel = stack.pop()
            segments = [*self._root_segments, *(rel.split("/") if rel else [])]
            what = f"list {rel or '/'!r}"
            entries = self._call(what, lambda s=segments, w=what: self._propfind(s, "1", w))  # type: ignore[misc]
            if entries is None:
                if rel == prefix and not self.exists():
                    self._missing_root()
                continue
            own = "/" + "/".join(segments)
            if not any(e.path == own and e.is_collection for e in entries):
                continue  # an object, not a folder
            for entry in entries:
                parent, _, name = entry.path.rpartition("/")
                if parent != own or not is_key_part(name):
                    continue
                key = f"{rel}/{name}" if rel else name
                if entry.is_collection:
                    stack.append(key)
                else:
                    keys.append(key)
        return keys

    def _temp_files(self) -> Iterator[TempFile]:
        """Every ``.tmp-`` file under the namespace (PROPFIND Depth: 1 per folder, then
        Depth: 0 per temporary file for its size and Last-Modified)."""
        temps: builtins.list[builtins.list[str]] = []
        stack: builtins.list[builtins.list[str]] = [[]]
        while stack:
            rel = stack.pop()
            segments = [*self._root_segments, *rel]
            what = f"list {'/'.join(rel) or '/'!r}"
            entries = self._call(what, lambda s=segments, w=what: self._propfind(s, "1", w))  # type: ignore[misc]
            if entries is None:
                if not rel and not self.exists():
                    self._missing_root()
                continue
            own = "/" + "/".join(segments)
            for entry in entries:
                parent, _, name = entry.path.rpartition("/")
                if parent != own:
                    continue
                if name.startswith(TEMP_PREFIX):
                    if not entry.is_collection:
                        temps.append([*rel, name])
                elif entry.is_collection and is_key_part(name):
                    stack.append([*rel, name])
        found = []
        for rel in temps:
            path = "/".join(rel)
            what = f"stat temporary file {path!r}"
            stat_entries = self._call(
                what, lambda s=[*self._root_segments, *rel], w=what: self._propfind(s, "0", w))  # type: ignore[misc]
            if not stat_entries:
                continue  # published or removed by its writer meanwhile
            try:
                modified = parsedate_to_datetime(stat_entries[0].modified).timestamp()
            except (TypeError, ValueError):
                continue  # no usable date: its age is unknown, so it is left alone
            found.append(TempFile(path, stat_entries[0].size or 0, modified))
        return iter(found)

    def _remove_temp(self, path: str) -> bool:
        parts = temp_path_parts(path)
        url = self._url([*self._root_segments, *parts])
        attempts = [0]

        def request() -> bool:
            attempts[0] += 1
            response = self._send("DELETE", url, f"delete temporary file {path!r}")
            response.close()
            if response.status_code in (200, 204):
                return True
            if response.status_code == 404:
                return attempts[0] > 1  # gone: by an earlier attempt whose answer was lost?
            raise self._status_error(response, f"delete temporary file {path!r}")

        return bool(self._call(f"delete temporary file {path!r}", request))

    def poll(self, key: str) -> str | None:
        """ETag, Last-Modified and size, plus a hash of the content for objects up to
        :data:`POLL_HASH_LIMIT` (one GET): wsgidav's ETag is inode-mtime-size with
        one-second times, and inodes are reused, so a quick replace by a same-size
        object could otherwise keep the token."""
        self._key(key)

        def request() -> str | None:
            try:
                response = self._get(key)
            except ObjectNotFound:
                return None
            try:
                etag = response.headers.get("ETag", "")
                modified = response.headers.get("Last-Modified", "")
                length = response.headers.get("Content-Length", "")
                digest = ""
                if length.isdigit() and int(length) <= POLL_HASH_LIMIT:
                    digest = hashlib.sha256(response.read()).hexdigest()[:32]
            except httpx.HTTPError as exc:
                raise self._transport_error(exc, f"poll {key!r}") from exc
            finally:
                response.close()
            return f"{etag}|{modified}|{length}|{digest}"

        return self._call(f"poll {key!r}", request)


@register
class WebdavsBackend(WebdavBackend):
    """``webdavs://``: the same over HTTPS."""

    scheme = "webdavs"
    http_scheme = "https"


# --- logs under WebDAV locks -----------------------------------------------------------

_LOCK_BODY = (
    b'<?xml version="1.0" encoding="utf-8"?><D:lockinfo xmlns:D="DAV:">'
    b"<D:lockscope><D:exclusive/></D:lockscope><D:locktype><D:write/></D:locktype>"
    b"<D:owner>metasync</D:owner></D:lockinfo>"
)
#: Seconds a log lock lasts if its holder never unlocks (a crashed client).
LOCK_TIMEOUT = 60
#: How long an appender keeps asking for a held lock: longer than a lock can last.
LOCK_WAIT = LOCK_TIMEOUT + 30.0
#: A locked MOVE refused with more than this many seconds of the lock left is the
#: server not honouring its own lock, never the lock expiring.
LOCK_MARGIN = 10.0
#: The timeout a LOCK answer grants (``<D:timeout>Second-N</D:timeout>``).
_GRANTED = re.compile(r"timeout>\s*Second-([0-9]+)\s*<", re.IGNORECASE)


def _lock_pause(attempt: int) -> None:
    # Randomized, growing pauses while another client holds the log's lock.
    time.sleep(random.uniform(0, min(0.25, 0.002 * 2**attempt)))


class WebdavLockLogs(CachedEntries):
    """Logs under WebDAV locks (docs/FORMAT.md §11.3): entry *p* of log ``L`` is the
    resource ``L/<p:010d>``, moved there from a temporary upload while the appender
    holds the exclusive lock of the collection ``L/``. Needs a class 2 server."""

    primitive = "a lock the server enforces"

    def __init__(self, backend: WebdavBackend) -> None:
        super().__init__(backend)
        #: The server holding the logs (``self.backend`` with its WebDAV requests).
        self.dav = backend

    def append(self, log: str, message: bytes) -> int:
        written = self._append_locked(log, message, None)
        assert written is not None
        return written

    def append_at(self, log: str, position: int, message: bytes) -> bool:
        if position < 0:
            raise ValueError(f"append_at needs position >= 0, got {position}")
        return self._append_locked(log, message, position) is not None

    def fetch(self, log: str, start: int = 0) -> builtins.list[tuple[int, bytes]]:
        if start < 0:
            raise ValueError(f"fetch needs start >= 0, got {start}")
        check_key(log)
        positions = sorted(
            p for p in map(entry_position, log_children(self.dav, log))
            if p is not None and p >= start
        )
        return self.entries.read(log, positions, lambda p: self.dav.get(f"{log}/{entry_name(p)}"))

    def _append_locked(self, log: str, message: bytes, position: int | None) -> int | None:
        """Append under the log's lock: at the end (``position`` None) or only at
        ``position``; return the position written, or None if ``position`` was not
        the end."""
        check_key(log)
        dav = self.dav
        dav._ensure_log_folder(log)
        temp = [*dav._root_segments, TEMP_PREFIX + secrets.token_hex(8)]
        dav._call(f"upload to log {log!r}", lambda: dav._put_plain(temp, message, log))
        try:
            deadline = time.monotonic() + LOCK_WAIT
            attempt = 0
            while True:
                asked = time.monotonic()
                lock = dav._call(f"lock log {log!r}", lambda: dav._lock(log))
                if lock is not None:
                    token, expires = lock[0], asked + lock[1]
                    break
                if time.monotonic() > deadline:
                    raise TransientError(
                        f"log {log!r} on {dav.name} stayed locked for {LOCK_WAIT:.0f}s; retry"
                    )
                _lock_pause(attempt)
                attempt += 1
            try:
                positions = [p for p in map(entry_position, log_children(dav, log))
                             if p is not None]
                end = max(positions, default=-1) + 1
                if position is not None and position != end:
                    return None
                dav._move_locked(temp, log, end, token, expires)
                temp = []
                return end
            finally:
                dav._unlock(log, token)
        finally:
            if temp:
                dav._discard(temp)
