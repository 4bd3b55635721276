"""The ``box:`` backend: a folder in a Box account, through Box's official Python SDK
(``boxsdk`` 10, the generated SDK formerly published as ``box-sdk-gen``; module
``box_sdk_gen``).

URI: ``box:PATH?account=NAME&transfers=N&timeout=S`` (and, for tests and emulators,
``api=https://HOST:PORT&ca=FILE``). ``PATH`` is a folder path below the account's
root ("All Files", folder id ``0``); ``box:`` alone is the root. With namespace ``ns``,
key ``a/b`` is the file ``/PATH/ns/a/b``. The sign-in is this client's grant for
``NAME`` (default ``default``), made by ``metasync auth box``.

Box addresses every file and folder by id, so the backend keeps a path → id cache per
instance (folders found by listing their parent, created by ``POST /folders`` whose
``409`` names the existing folder; files learnt from listings, uploads and the
preflight check). A cached id that has gone (``404``: the file was deleted, perhaps
re-created under a new id by another client) is dropped and looked up again.

What Box guarantees and this module relies on:

- an upload (``POST /files/content``, a new version, a chunked-upload commit) becomes
  visible atomically: readers get the old version or the whole new one;
- names are unique per folder among files and folders, compared case-insensitively:
  uploading a new file whose name exists fails with ``409 item_name_in_use`` (the
  existing file in ``context_info.conflicts``). That is an atomic exclusive create,
  hence ``put_if_absent`` and the logs of :class:`ObjectStoreLogs`; a second upload of a
  name while the first is still running gets ``409 name_temporarily_reserved`` and is
  retried until the first one's outcome shows;
- ``POST /files/{id}/content`` with ``If-Match: <etag>`` is a compare-and-swap: ``412``
  if the file changed (its ``etag`` goes up with every version) — ``replace_if``, with
  ``poll`` tokens ``<file id>:<etag>`` (the id too, since a re-created file starts
  again at etag ``0``);
- every file carries the SHA-1 of its content, and uploads carry it too
  (``Content-MD5``, ``Digest``): Box checks what arrived, the backend checks what Box
  stored, and a write whose answer was lost is recognised as ours by its SHA-1;
- names are case-insensitive (``case_sensitive=False``).

The SDK's own retries are off (a retry strategy that never retries): every request
goes through :func:`retrying`, which knows which writes are conditional. Access tokens
come from a :class:`~metasync.backends.cloud.TokenSource`; the SDK never sees the
refresh token (Box rotates refresh tokens: each is good for one refresh).
"""

from __future__ import annotations

import base64
import builtins
import contextlib
import functools
import hashlib
import html
import io
import logging
import os
import secrets
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any, BinaryIO, TypeVar, cast
from urllib.parse import urlsplit

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
    SdkClients,
    SdkTokenRefresh,
    app_credentials,
    auth_hint,
    oauth2_refresh,
    parse_cloud_uri,
    parse_retry_after,
    pasted_code,
    redirect_code,
    redirect_query,
)
from metasync.backends.cloudfeeds import LongPollFeed, PollAnswer
from metasync.backends.feeds import ChangeFeed
from metasync.backends.http import pooled_session, requests_failure
from metasync.backends.logs import LogStore, ObjectStoreLogs
from metasync.backends.retry import RetryMark, TransientError
from metasync.backends.uploads import PendingUpload, UploadJournal
from metasync.errors import (
    AuthorizationRequired,
    BackendError,
    BackendFull,
    BackendUnavailable,
    ObjectNotFound,
    UsageError,
)

T = TypeVar("T")

log = logging.getLogger("metasync.backends")

#: Box's hosts (the SDK's ``BaseUrls``): API, uploads, sign-in pages.
BOX_API = "https://api.box.com"
BOX_UPLOAD = "https://upload.box.com/api"
BOX_OAUTH = "https://account.box.com/api/oauth2"
#: Streams are read in pieces of this size; an object up to one piece is one upload.
CHUNK_SIZE = 8 << 20
#: Largest object sent in one upload request; larger ones go through a chunked
#: upload session (Box: direct uploads up to 50 MB, sessions from 20 MB).
SINGLE_UPLOAD_LIMIT = 50_000_000
#: Entries asked for per listing page (Box's maximum).
LIST_LIMIT = 1000
#: What Box's realtime servers answer when ``OPTIONS /events`` leaves it out: the
#: seconds a long-poll may go unanswered (``retry_timeout``) and the long-polls one
#: server URL serves before ``OPTIONS /events`` is asked again (``max_retries``).
REALTIME_RETRY_TIMEOUT = 610.0
REALTIME_MAX_RETRIES = 10
#: Events asked for per ``GET /events`` page (Box's most).
EVENTS_LIMIT = 500
#: Read size on download streams (the SDK's stream concatenates 1 KiB pieces up to it).
READ_PIECE = 16 << 10
#: The loopback address Box sends the browser back to after sign-in; it must be one
#: of the app's redirect URIs (``METASYNC_BOX_REDIRECT_URI`` replaces it).
DEFAULT_REDIRECT_URI = "http://127.0.0.1:53687/"
#: How long `metasync auth box` waits for the browser to come back.
AUTH_TIMEOUT = 300.0


def _parse_uri(uri: str) -> tuple[builtins.list[str], dict[str, str]]:
    """``(location folder names, options)``."""
    return parse_cloud_uri("box", uri, bad_folder_name=_bad_folder_name)


def _bad_folder_name(name: str) -> bool:
    """Box's own limits on folder names: at most 255 characters, no control characters."""
    return len(name) > 255 or any(ord(c) < 32 for c in name)


def _sha1_b64(hex_digest: str) -> str:
    return base64.b64encode(bytes.fromhex(hex_digest)).decode()


def _header(headers: Any, name: str) -> str | None:
    for key, value in dict(headers or {}).items():
        if str(key).lower() == name.lower():
            return str(value)
    return None


class _NotApplied(TransientError):
    """A transient answer that says the request did nothing (throttled, or the name
    briefly reserved by another upload): a conflict on the retry is not our own."""


class _Conflict(Exception):
    """``409 item_name_in_use``: the item already there (type, id, etag, sha1)."""

    def __init__(self, item: dict[str, Any]) -> None:
        super().__init__(str(item.get("id")))
        self.item = item

    @property
    def id(self) -> str:
        return str(self.item.get("id"))

    @property
    def is_file(self) -> bool:
        return self.item.get("type") == "file"


def _conflict_of(exc: Any) -> _Conflict | None:
    """The item named in a ``409 item_name_in_use`` SDK error, else None. Box gives
    ``context_info.conflicts`` as one object for uploads (its docs say a list, which
    folder creation uses): both are read."""
    info = getattr(exc, "response_info", None)
    if info is None or info.status_code != 409 or info.code != "item_name_in_use":
        return None
    conflicts = (info.context_info or {}).get("conflicts")
    if isinstance(conflicts, list):
        conflicts = conflicts[0] if conflicts else None
    return _Conflict(conflicts) if isinstance(conflicts, dict) and conflicts.get("id") else None


def _status(exc: BaseException) -> int | None:
    info = getattr(exc, "response_info", None)
    return int(info.status_code) if info is not None else None


def _box_code(exc: BaseException) -> str | None:
    info = getattr(exc, "response_info", None)
    return str(info.code) if info is not None and info.code else None


@functools.cache
def _sdk_classes() -> dict[str, Any]:
    """SDK classes, imported on first use (the SDK is large), defined once."""
    from box_sdk_gen.client import BoxClient
    from box_sdk_gen.networking.auth import Authentication
    from box_sdk_gen.networking.base_urls import BaseUrls
    from box_sdk_gen.networking.box_network_client import BoxNetworkClient
    from box_sdk_gen.networking.network import NetworkSession
    from box_sdk_gen.networking.retries import RetryStrategy
    from box_sdk_gen.networking.timeout_config import TimeoutConfig
    from box_sdk_gen.schemas.access_token import AccessToken

    class BearerAuth(Authentication):
        """A fixed access token; refreshing is the TokenSource's job, not the SDK's."""

        def __init__(self, token: str) -> None:
            super().__init__()
            self.token = token

        def retrieve_token(self, *, network_session: Any = None) -> Any:
            return AccessToken(access_token=self.token)

        def refresh_token(self, *, network_session: Any = None) -> Any:
            raise SdkTokenRefresh("invalid_token")

        def retrieve_authorization_header(self, *, network_session: Any = None) -> str:
            return f"Bearer {self.token}"

        def revoke_token(self, *, network_session: Any = None) -> None:
            return None

        def downscope_token(self, scopes: Any, *, resource: Any = None,
                            shared_link: Any = None, network_session: Any = None) -> Any:
            raise NotImplementedError("metasync does not downscope tokens")

    class NoRetries(RetryStrategy):
        """One attempt per call: ``retrying`` retries, knowing what is safe to repeat
        (the SDK's own strategy would resend conditional writes and sleep on 429s)."""

        def should_retry(self, fetch_options: Any, fetch_response: Any,
                         attempt_number: int) -> bool:
            return False

        def retry_after(self, fetch_options: Any, fetch_response: Any,
                        attempt_number: int) -> float:
            return 0.0

    return {
        "BoxClient": BoxClient, "BearerAuth": BearerAuth, "BaseUrls": BaseUrls,
        "BoxNetworkClient": BoxNetworkClient, "NetworkSession": NetworkSession,
        "NoRetries": NoRetries, "TimeoutConfig": TimeoutConfig,
    }


def _base_urls(base_url: str | None) -> Any:
    """The SDK's BaseUrls for an API base (None: Box itself). An emulator serves all
    three hosts on one address, at Box's paths."""
    classes = _sdk_classes()
    if base_url is None:
        return classes["BaseUrls"]()
    return classes["BaseUrls"](base_url=base_url, upload_url=f"{base_url}/api",
                               oauth_2_url=f"{base_url}/api/oauth2")


def _network_session(session: Any, base_url: str | None, timeout: float) -> Any:
    classes = _sdk_classes()
    return classes["NetworkSession"](
        network_client=classes["BoxNetworkClient"](session),
        retry_strategy=classes["NoRetries"](),
        base_urls=_base_urls(base_url),
        timeout_config=classes["TimeoutConfig"](
            connection_timeout_ms=int(min(timeout, 10.0) * 1000),
            read_timeout_ms=int(timeout * 1000)),
    )


def refresher(base_url: str | None, ca_file: str | None) -> Callable[[Grant], Grant]:
    """The refresh function of Box grants (OAuth 2 at ``/oauth2/token`` on the API
    host; the grant's app secret is sent, as Box requires)."""
    token_url = f"{base_url or BOX_API}/oauth2/token"
    return lambda grant: oauth2_refresh(token_url, grant, ca_file=ca_file)


@register
class BoxBackend(CloudAccess, Backend):
    """A folder in Box, URI ``box:PATH?account=NAME`` (see the module docstring).

    Thread-safe: one requests session (connection pool) shared by all threads, at most
    ``transfers`` requests at once.
    """

    scheme = "box"
    capabilities = Capabilities(
        conditional_create=True,
        compare_and_swap=True,
        conditional_append=True,
        range_reads=True,
        # Box's largest file depends on the account (250 MB free, 5 GB and more on
        # paid plans): a too-large object fails with a clear error instead.
        max_object_size=None,
        case_sensitive=False,
        long_poll=False,
        change_feed="longpoll",
        sharing=True,
    )

    #: Objects larger than this go through a chunked upload session (Box accepts
    #: sessions for files from 20 MB; tests lower it to move less data).
    single_upload_limit = SINGLE_UPLOAD_LIMIT

    def __init__(self, uri: str, namespace: str) -> None:
        """Parse the URI; sends no request (the sign-in is read on first use).

        Raises :class:`UsageError` for a malformed URI, option or namespace."""
        super().__init__(uri, namespace)
        self.location, options = _parse_uri(uri)
        self._bind_account("box", uri, namespace, options, refresher)
        self._clients = SdkClients(
            self.tokens, lambda: pooled_session(self._ca_file, self.transfers + 4), self._new_client
        )
        #: Path (lower-cased names from the root) -> folder id / file id.
        self._folders: dict[tuple[str, ...], str] = {(): "0"}
        self._files: dict[tuple[str, ...], str] = {}
        self._cache_lock = threading.Lock()
        #: The namespace folder's path from the root.
        self.root = (*self.location, namespace)

    @property
    def name(self) -> str:
        """``box:/PATH`` (with ``?account=`` if not the default account)."""
        return self._named("box:/" + "/".join(self.location))

    # --- plumbing ------------------------------------------------------------------
    def _new_client(self, session: Any, token: str) -> Any:
        """An SDK client sending ``token`` over the requests ``session``."""
        classes = _sdk_classes()
        return classes["BoxClient"](
            classes["BearerAuth"](token),
            network_session=_network_session(session, self._base_url, self.timeout),
        )

    def _connect(self) -> tuple[Any, str]:
        """An SDK client holding a fresh access token, and that token."""
        return self._clients.connect()

    def _translate(self, exc: Exception, key: str | None, action: str,
                   token: str | None) -> BaseException:
        """The backend-contract error for an SDK or transport exception."""
        from box_sdk_gen.box.errors import BoxAPIError, BoxSDKError

        what = self._what(action, key)
        if isinstance(exc, BoxAPIError):
            info = exc.response_info
            status, code = int(info.status_code), str(info.code or "")
            message = str((info.body or {}).get("message") or "") if isinstance(info.body, dict) else ""
            retry_after = parse_retry_after(_header(info.headers, "Retry-After"))
            summary = f"{status} {code}".strip() + (f": {message}" if message else "")
            if status == 401 and token is not None:
                challenge = _header(info.headers, "WWW-Authenticate") or ""
                detail = "invalid_token" if "invalid_token" in challenge else "unauthorized"
                return self.tokens.rejected(token, detail)
            if status == 404:
                return ObjectNotFound(f"no object {key!r} on {self.name}")
            if status == 429:
                return _NotApplied(f"cannot {what}: Box is throttling ({code or 'rate limit'})",
                                   retry_after=retry_after)
            if status == 409 and code in ("name_temporarily_reserved",
                                          "operation_blocked_temporary"):
                return _NotApplied(f"cannot {what}: Box is busy with that name ({code})")
            if status >= 500 or status in (408, 425):
                return TransientError(f"cannot {what}: Box answered {summary}",
                                      retry_after=retry_after)
            if status == 403 and code == "storage_limit_exceeded":
                return BackendFull.of(self.name, "the Box account's storage limit is reached")
            if status == 403 and code == "file_size_limit_exceeded":
                return BackendError(
                    f"cannot {what}: larger than the Box account accepts (free accounts: 250 MB)")
            if status == 403 and code in ("insufficient_scope",
                                          "access_denied_insufficient_permissions"):
                return AuthorizationRequired(
                    f"cannot {what}: Box refused it ({code}); give the app the scope \"Write all "
                    f"files and folders\", then {auth_hint('box', self.account)}")
            return BackendError(f"cannot {what}: Box answered {summary}")
        inner: BaseException = exc
        if isinstance(exc, BoxSDKError):
            if exc.error is None:
                return BackendError(f"cannot {what}: {one_line(Exception(exc.message))}")
            inner = exc.error
        failure = requests_failure(inner, what, "Box", self._base_url or BOX_API)
        if failure is not None:
            return failure
        from urllib3.exceptions import HTTPError as Urllib3Error

        if isinstance(inner, Urllib3Error):
            return TransientError(f"cannot {what}: connection failed ({one_line(inner)})")
        return exc

    # --- paths and ids ---------------------------------------------------------------
    def _key_path(self, key: str) -> tuple[builtins.list[str], str]:
        """(folder names from the root, file name) of ``key``."""
        parts = check_key(key).split("/")
        return [*self.root, *parts[:-1]], parts[-1]

    @staticmethod
    def _lower(names: builtins.list[str] | tuple[str, ...]) -> tuple[str, ...]:
        return tuple(n.lower() for n in names)

    def _remember(self, folder: tuple[str, ...], entries: builtins.list[Any]) -> None:
        """Cache the ids of a folder's listed children."""
        with self._cache_lock:
            for entry in entries:
                name = str(getattr(entry, "name", "") or "")
                if not name:
                    continue
                path = (*folder, name.lower())
                if getattr(entry, "type", None) is not None and str(
                        getattr(entry.type, "value", entry.type)) == "folder":
                    self._folders[path] = str(entry.id)
                else:
                    self._files[path] = str(entry.id)

    def _forget_file(self, path: tuple[str, ...], file_id: str | None = None) -> None:
        with self._cache_lock:
            if file_id is None or self._files.get(path) == file_id:
                self._files.pop(path, None)

    def _forget_folders(self) -> None:
        """Drop every cached folder id (a folder was found gone)."""
        with self._cache_lock:
            self._folders = {(): "0"}
            self._files.clear()

    def _items(self, folder_id: str, what: str) -> builtins.list[Any]:
        """Every entry of a folder (marker paging, each page retried on its own)."""
        entries: builtins.list[Any] = []
        marker: str | None = None
        while True:
            def page(client: Any, marker: str | None = marker) -> Any:
                return client.folders.get_folder_items(
                    folder_id, fields=["name", "type", "id"], usemarker=True,
                    marker=marker, limit=LIST_LIMIT)

            items = self._call(None, what, page)
            entries.extend(items.entries or [])
            marker = getattr(items, "next_marker", None)
            if not marker:
                return entries

    def _folder_id(self, names: builtins.list[str], *, create: bool) -> str | None:
        """The id of the folder at ``names`` (from the root); None if it does not exist
        (or is a file) and ``create`` is false. With ``create``, missing folders are
        made (a ``409`` names a folder another client made meanwhile)."""
        lower = self._lower(names)
        with self._cache_lock:
            known = self._folders.get(lower)
        if known is not None:
            return known
        depth = len(lower)
        with self._cache_lock:
            while depth > 0 and lower[:depth] not in self._folders:
                depth -= 1
            current = self._folders[lower[:depth]]
        for i in range(depth, len(names)):
            path = lower[: i + 1]
            if create:
                current = self._make_folder(current, names[i], names[: i + 1])
            else:
                entries = self._items(current, "list")
                self._remember(lower[:i], entries)
                with self._cache_lock:
                    found = self._folders.get(path)
                if found is None:
                    return None
                current = found
            with self._cache_lock:
                self._folders[path] = current
        return current

    def _make_folder(self, parent_id: str, name: str, names: builtins.list[str]) -> str:
        from box_sdk_gen.managers.folders import CreateFolderParent

        def make(client: Any) -> str:
            try:
                return str(client.folders.create_folder(
                    name, CreateFolderParent(id=parent_id), fields=["id"]).id)
            except Exception as exc:
                conflict = _conflict_of(exc)
                if conflict is None:
                    raise
                if conflict.is_file:
                    raise BackendError(
                        f"cannot write below {'/'.join(names)!r} on {self.name}: a file has "
                        "the name of a folder there") from None
                return conflict.id  # another client made it (or our earlier attempt did)

        return self._call(None, "create a folder on", make)

    def _file_id(self, key: str, *, fresh: bool = False) -> tuple[str, tuple[str, ...]]:
        """``(file id, cache path)`` of ``key``: from the cache, else one preflight
        check (``OPTIONS /files/content``), whose ``409`` names the existing file."""
        folders, name = self._key_path(key)
        path = self._lower([*folders, name])
        if not fresh:
            with self._cache_lock:
                known = self._files.get(path)
            if known is not None:
                return known, path
        conflict = self._preflight(key, folders, name)
        if conflict is None or not conflict.is_file:
            raise ObjectNotFound(f"no object {key!r} on {self.name}")
        with self._cache_lock:
            self._files[path] = conflict.id
        return conflict.id, path

    def _preflight(self, key: str, folders: builtins.list[str], name: str) -> _Conflict | None:
        """The item named ``name`` in the folder ``folders`` (one preflight check), or
        None if there is none (or no such folder)."""
        from box_sdk_gen.managers.uploads import PreflightFileUploadCheckParent

        for attempt in range(2):
            folder_id = self._folder_id(folders, create=False)
            if folder_id is None:
                return None

            def check(client: Any, folder_id: str = folder_id) -> _Conflict | None:
                try:
                    client.uploads.preflight_file_upload_check(
                        name=name, size=0, parent=PreflightFileUploadCheckParent(id=folder_id))
                except Exception as exc:
                    conflict = _conflict_of(exc)
                    if conflict is None:
                        raise
                    return conflict
                return None

            try:
                return self._call(key, "look up", check)
            except ObjectNotFound:
                if attempt:
                    return None
                self._forget_folders()  # the folder went away: look it up again
        return None

    def _with_file(self, key: str, action: str, fn: Callable[[Any, str], T],
                   on_retry: Callable[[BaseException], None] | None = None) -> T:
        """``fn(client, file_id)`` for the file at ``key``; a cached id that is gone
        (``404``) is dropped and the file looked up again once."""
        file_id, path = self._file_id(key)
        try:
            return self._call(key, action, lambda c: fn(c, file_id), on_retry)
        except ObjectNotFound:
            self._forget_file(path, file_id)
            fresh_id, _ = self._file_id(key, fresh=True)
            if fresh_id == file_id:
                raise
            return self._call(key, action, lambda c: fn(c, fresh_id), on_retry)

    def _file_info(self, key: str, fields: builtins.list[str]) -> Any:
        return self._with_file(key, "stat", lambda c, fid: c.files.get_file_by_id(
            fid, fields=fields))

    # --- lifecycle -----------------------------------------------------------------
    def probe(self) -> None:
        """Check the sign-in and that the location folder exists. Never writes."""
        if not self.location:
            self._call(None, "reach", lambda c: c.users.get_user_me(fields=["id"]))
            return
        if self._folder_id(self.location, create=False) is None:
            raise BackendUnavailable(
                f"the folder {'/' + '/'.join(self.location)!r} does not exist in Box "
                f"({self.name}); create it there first (or fix the URI)")

    def exists(self) -> bool:
        return self._folder_id(list(self.root), create=False) is not None

    def create(self) -> None:
        """Create the namespace folder (idempotent); the location must exist."""
        self.probe()
        self._folder_id(list(self.root), create=True)

    def close(self) -> None:
        self._clients.close()

    # --- change feed -----------------------------------------------------------------
    def change_feed(self, watch_key: str | None = None) -> ChangeFeed:
        """A :class:`BoxFeed`: the account's event stream, long-polled, keeping the
        events below the namespace folder."""
        return BoxFeed(self)

    def namespace_folder_id(self) -> str:
        """The namespace folder's id; :class:`BackendError` if it is missing."""
        folder = self._folder_id(list(self.root), create=False)
        if folder is None:
            raise BackendError(
                f"cannot watch {self.name}: the namespace folder "
                f"{'/' + '/'.join(self.root)!r} is missing")
        return folder

    def events_since(self, position: str) -> tuple[builtins.list[dict[str, Any]], str]:
        """``GET /events?stream_type=changes&stream_position=P`` page after page: the
        events after ``position`` (raw JSON; ``now``: none) and the position after
        them."""
        from box_sdk_gen.managers.events import GetEventsStreamType

        events: builtins.list[dict[str, Any]] = []
        while True:
            def page(client: Any, position: str = position) -> Any:
                return client.events.get_events(
                    stream_type=GetEventsStreamType.CHANGES, stream_position=position,
                    limit=EVENTS_LIMIT)

            answer = self._call(None, "watch", page)
            raw = answer.raw_data if isinstance(answer.raw_data, dict) else {}
            entries = [e for e in raw.get("entries") or [] if isinstance(e, dict)]
            events.extend(entries)
            following = answer.next_stream_position
            if following is None or str(following) == position:
                return events, position
            position = str(following)
            if len(entries) < EVENTS_LIMIT:
                return events, position

    def realtime_server(self) -> tuple[str, float, int]:
        """``OPTIONS /events``: a realtime server's long-poll URL, its
        ``retry_timeout`` (seconds) and ``max_retries``."""
        answer = self._call(None, "watch", lambda c: c.events.get_events_with_long_polling())
        for server in answer.entries or []:
            if getattr(server, "type", None) == "realtime_server" and server.url:
                try:
                    retry_timeout = float(server.retry_timeout or REALTIME_RETRY_TIMEOUT)
                    retries = int(server.max_retries or REALTIME_MAX_RETRIES)
                except (TypeError, ValueError):
                    retry_timeout, retries = REALTIME_RETRY_TIMEOUT, REALTIME_MAX_RETRIES
                return str(server.url), max(1.0, retry_timeout), max(1, retries)
        raise TransientError(f"cannot watch {self.name}: Box named no realtime server")

    def realtime_poll(self, url: str, position: str, retry_timeout: float) -> str:
        """One long-poll of the realtime server ``url`` from ``position``: its message
        (``new_change``, ``reconnect``, or another). Sent without the access token.
        The socket waits ``retry_timeout`` plus the backend's timeout; no transfer
        slot is held."""
        from box_sdk_gen.networking.fetch_options import FetchOptions, ResponseFormat

        separator = "&" if "?" in url else "?"
        target = f"{url}{separator}stream_position={position}"
        classes = _sdk_classes()

        def poll(client: Any) -> str:
            session = client.events.network_session.with_timeout_config(
                classes["TimeoutConfig"](
                    connection_timeout_ms=int(min(self.timeout, 10.0) * 1000),
                    read_timeout_ms=int((retry_timeout + self.timeout) * 1000)))
            # No sign-in: the realtime server needs none, and the access token goes
            # to no host but the API's.
            response = session.network_client.fetch(FetchOptions(
                url=target, method="GET", response_format=ResponseFormat.JSON,
                auth=None, network_session=session))
            data = response.data
            message = data.get("message") if isinstance(data, dict) else None
            return str(message or "")

        return self._call(None, "watch", poll, slotted=False)

    # --- writes --------------------------------------------------------------------
    def _upload_new(self, client: Any, folder_id: str, name: str, source: BinaryIO,
                    start: int, sha1: str) -> Any:
        from box_sdk_gen.managers.uploads import (
            UploadFileAttributes,
            UploadFileAttributesParentField,
        )

        source.seek(start)
        files = client.uploads.upload_file(
            UploadFileAttributes(name, UploadFileAttributesParentField(id=folder_id)),
            source, file_file_name=name, content_md_5=sha1)
        return files.entries[0]

    def _upload_version(self, client: Any, file_id: str, name: str, source: BinaryIO,
                        start: int, sha1: str, etag: str | None = None) -> Any:
        from box_sdk_gen.managers.uploads import UploadFileVersionAttributes

        source.seek(start)
        files = client.uploads.upload_file_version(
            file_id, UploadFileVersionAttributes(name), source, file_file_name=name,
            if_match=etag, content_md_5=sha1)
        return files.entries[0]

    def _check_stored(self, key: str, entry: Any, sha1: str, size: int) -> None:
        if str(getattr(entry, "sha_1", "") or "").lower() != sha1 or (
                getattr(entry, "size", None) is not None and int(entry.size) != size):
            raise BackendError(f"Box stored other bytes than sent for {key!r} on {self.name}")

    def _put_whole(self, key: str, source: BinaryIO, start: int, size: int, sha1: str) -> None:
        """Store ``size`` bytes of ``source`` from ``start`` in one upload: a new
        version of the cached or existing file, else a new file (whose ``409`` names the
        existing one, then a new version of that)."""
        folders, name = self._key_path(key)
        path = self._lower([*folders, name])
        for _ in range(3):
            with self._cache_lock:
                known = self._files.get(path)
            if known is not None:
                def version(client: Any, file_id: str = known) -> Any:
                    return self._upload_version(client, file_id, name, source, start, sha1)

                try:
                    entry = self._call(key, "write", version)
                except ObjectNotFound:
                    self._forget_file(path, known)
                    continue
                self._check_stored(key, entry, sha1, size)
                return
            folder_id = self._folder_id(folders, create=True)
            assert folder_id is not None

            def create(client: Any, folder_id: str = folder_id) -> Any:
                try:
                    return self._upload_new(client, folder_id, name, source, start, sha1)
                except Exception as exc:
                    conflict = _conflict_of(exc)
                    if conflict is None:
                        raise
                    return conflict

            try:
                result = self._call(key, "write", create)
            except ObjectNotFound:
                self._forget_folders()  # the folder vanished: make it again
                continue
            if isinstance(result, _Conflict):
                if not result.is_file:
                    raise BackendError(
                        f"cannot write {key!r} on {self.name}: a folder has that name")
                with self._cache_lock:
                    self._files[path] = result.id
                continue
            with self._cache_lock:
                self._files[path] = str(result.id)
            self._check_stored(key, result, sha1, size)
            return
        raise TransientError(f"cannot write {key!r} on {self.name}: it keeps changing")

    def put(self, key: str, data: bytes | BinaryIO) -> None:
        """Store ``data`` at ``key``, replacing it atomically (a new file version).

        Up to 50 MB is one upload request; more goes through a chunked upload session.
        A stream is read in :data:`CHUNK_SIZE` pieces: a short one is uploaded from
        memory; a longer one is uploaded from the source itself when it is seekable
        (every object a push sends comes from a file) and otherwise first copied to a
        temporary file, since Box needs the size and SHA-1 of a file before it is
        committed. Memory stays at about one piece."""
        self._key_path(key)
        if isinstance(data, bytes | bytearray | memoryview):
            body = bytes(data)
            self._put_source(key, io.BytesIO(body), 0, len(body), seekable=True)
            return
        first = read_full(data, CHUNK_SIZE)
        if len(first) < CHUNK_SIZE:
            self._put_source(key, io.BytesIO(first), 0, len(first), seekable=True)
            return
        start: int | None = None
        try:
            if data.seekable():
                start = data.tell() - len(first)
                end = data.seek(0, io.SEEK_END)
                data.seek(start)
        except (AttributeError, OSError, ValueError):
            start = None
        if start is not None:
            self._put_source(key, data, start, end - start, seekable=True)
            return
        with tempfile.TemporaryFile(prefix="metasync-box-") as spool:
            spool.write(first)
            while True:
                piece = read_full(data, CHUNK_SIZE)
                if not piece:
                    break
                spool.write(piece)
            size = spool.tell()
            spool.seek(0)
            self._put_source(key, cast(BinaryIO, spool), 0, size, seekable=False)

    def _put_source(self, key: str, source: BinaryIO, start: int, size: int, *,
                    seekable: bool) -> None:
        if size > self.single_upload_limit:
            self._upload_session(key, source, start, size, journaled=seekable)
            return
        hasher = hashlib.sha1()
        source.seek(start)
        left = size
        while left:
            piece = source.read(min(left, CHUNK_SIZE))
            if not piece:
                raise BackendError(f"the data for {key!r} ended early")
            hasher.update(piece)
            left -= len(piece)
        self._put_whole(key, source, start, size, hasher.hexdigest())

    def put_if_absent(self, key: str, data: bytes) -> bool:
        """One ``POST /files/content``: atomic on Box; False on ``409 item_name_in_use``.

        After a retry that may have taken effect (a lost answer, a dropped connection,
        a 5xx), a conflict with a file holding exactly our bytes (same SHA-1) is our own
        earlier attempt: True."""
        folders, name = self._key_path(key)
        path = self._lower([*folders, name])
        body = bytes(data)
        sha1 = hashlib.sha1(body).hexdigest()
        source = io.BytesIO(body)
        maybe_ours = RetryMark(_NotApplied)

        for attempt in range(2):
            folder_id = self._folder_id(folders, create=True)
            assert folder_id is not None

            def create(client: Any, folder_id: str = folder_id) -> Any:
                try:
                    return self._upload_new(client, folder_id, name, source, 0, sha1)
                except Exception as exc:
                    conflict = _conflict_of(exc)
                    if conflict is None:
                        raise
                    return conflict

            try:
                result = self._call(key, "create", create, on_retry=maybe_ours)
            except ObjectNotFound:
                if attempt:
                    raise
                self._forget_folders()
                continue
            if isinstance(result, _Conflict):
                if result.is_file:
                    with self._cache_lock:
                        self._files[path] = result.id
                return maybe_ours.marked and result.is_file and str(
                    result.item.get("sha1", "")).lower() == sha1
            with self._cache_lock:
                self._files[path] = str(result.id)
            self._check_stored(key, result, sha1, len(body))
            return True
        return False

    def replace_if(self, key: str, data: bytes, token: str) -> bool:
        """``POST /files/{id}/content`` with ``If-Match: <etag>`` (Box's
        compare-and-swap): False on ``412`` (changed) or ``404`` (deleted). A
        ``412`` after a retry that may have taken effect is ours if the file now holds
        our bytes and its etag moved exactly one version on."""
        file_id, _, etag = token.partition(":")
        if not file_id or not etag:
            return False
        folders, name = self._key_path(key)
        body = bytes(data)
        sha1 = hashlib.sha1(body).hexdigest()
        source = io.BytesIO(body)
        maybe_ours = RetryMark(_NotApplied)

        def swap(client: Any) -> Any:
            try:
                return self._upload_version(client, file_id, name, source, 0, sha1, etag)
            except Exception as exc:
                if _status(exc) == 412:
                    return None
                raise

        try:
            entry = self._call(key, "write", swap, on_retry=maybe_ours)
        except ObjectNotFound:
            return False
        if entry is None:
            if not maybe_ours.marked:
                return False
            try:
                info = self._call(key, "stat", lambda c: c.files.get_file_by_id(
                    file_id, fields=["sha1", "etag"]))
            except ObjectNotFound:
                return False
            return bool(str(info.sha_1).lower() == sha1 and etag.isdigit()
                        and str(info.etag) == str(int(etag) + 1))
        self._check_stored(key, entry, sha1, len(body))
        with self._cache_lock:
            self._files[self._lower([*folders, name])] = file_id
        return True

    def delete(self, key: str) -> None:
        """``DELETE /files/{id}`` (to Box's trash, kept there 30 days by default)."""
        attempts = [0]

        def remove(client: Any, file_id: str) -> None:
            attempts[0] += 1
            try:
                client.files.delete_file_by_id(file_id)
            except Exception as exc:
                if _status(exc) == 404 and attempts[0] > 1:
                    return  # an earlier attempt whose answer was lost deleted it
                raise

        self._with_file(key, "delete", remove)
        folders, name = self._key_path(key)
        self._forget_file(self._lower([*folders, name]))

    # --- chunked uploads ---------------------------------------------------------------
    def _upload_session(self, key: str, source: BinaryIO, start: int, size: int, *,
                        journaled: bool) -> None:
        """Upload ``size`` bytes of ``source`` from ``start`` through a chunked upload
        session: create it (for a new file, or a new version of the existing one), send
        the parts in Box's ``part_size`` with each part's SHA-1 (``Digest``), commit
        with the list of parts and the whole file's SHA-1.

        A part resent after a failure that Box already has (``409``/``416``) is checked
        against the session's part list. The session is journaled on this client
        (:class:`UploadJournal`): a later ``put`` of the same key after an interruption
        re-reads the source, checks it against the parts Box has (their SHA-1s, and the
        journal's SHA-256 of the prefix) and uploads only the missing parts; a changed
        source or an expired session starts over."""
        folders, name = self._key_path(key)
        target = f"{self._base_url or BOX_API}|{self.account}|{'/'.join(self._lower([*folders, name]))}"
        with UploadJournal("box", target) as journal:
            resumed = self._resume(key, journal, source, start, size) if journaled else None
            parts: builtins.list[Any] = []
            if resumed is None:
                session = self._new_session(key, folders, name, size)
                started = time.time()
                if journaled:
                    journal.record(PendingUpload(session.id, 0, hashlib.sha256().hexdigest(),
                                                 started))
            else:
                session, parts, started = resumed
            sha1 = hashlib.sha1()
            sha256 = hashlib.sha256()
            part_size = int(session.part_size)
            offset = 0
            source.seek(start)
            have = {int(p.offset): p for p in parts}
            kept = []
            while offset < size:
                piece = read_full(source, min(part_size, size - offset))
                if len(piece) != min(part_size, size - offset):
                    raise BackendError(f"the data for {key!r} ended early")
                sha1.update(piece)
                sha256.update(piece)
                known = have.get(offset)
                piece_sha1 = hashlib.sha1(piece).hexdigest()
                if known is not None and str(known.sha_1).lower() == piece_sha1:
                    kept.append(known)
                else:
                    kept.append(self._send_part(key, session, piece, offset, size, piece_sha1))
                offset += len(piece)
                if journaled:
                    journal.record(PendingUpload(session.id, offset, sha256.hexdigest(), started))
            self._commit(key, session, kept, sha1.hexdigest(), size, folders, name, source,
                         start)
            journal.clear()

    def _new_session(self, key: str, folders: builtins.list[str], name: str, size: int) -> Any:
        """A session for a new file named ``name``, or for a new version of the file of
        that name (whose id the ``409`` gives)."""
        path = self._lower([*folders, name])
        with self._cache_lock:
            known = self._files.get(path)
        if known is not None:
            try:
                return self._call(key, "start upload of", lambda c: c.chunked_uploads.
                                  create_file_upload_session_for_existing_file(known, size))
            except ObjectNotFound:
                self._forget_file(path, known)
        folder_id = self._folder_id(folders, create=True)
        assert folder_id is not None

        def start(client: Any) -> Any:
            try:
                return client.chunked_uploads.create_file_upload_session(folder_id, size, name)
            except Exception as exc:
                conflict = _conflict_of(exc)
                if conflict is None:
                    raise
                if not conflict.is_file:
                    raise BackendError(
                        f"cannot write {key!r} on {self.name}: a folder has that name") from None
                return client.chunked_uploads.create_file_upload_session_for_existing_file(
                    conflict.id, size)

        return self._call(key, "start upload of", start)

    def _send_part(self, key: str, session: Any, piece: bytes, offset: int, size: int,
                   piece_sha1: str) -> Any:
        """Upload one part; a resend Box refuses as overlapping is checked against the
        part list (an earlier attempt whose answer was lost may have arrived)."""
        content_range = f"bytes {offset}-{offset + len(piece) - 1}/{size}"
        digest = f"sha={_sha1_b64(piece_sha1)}"

        def send(client: Any) -> Any:
            try:
                return client.chunked_uploads.upload_file_part(
                    session.id, io.BytesIO(piece), digest, content_range).part
            except Exception as exc:
                if _status(exc) in (409, 416):
                    for part in self._parts(client, session.id):
                        if int(part.offset) == offset and str(part.sha_1).lower() == piece_sha1:
                            return part
                if _status(exc) == 412:  # damaged in transit: send it again
                    raise TransientError(f"a part of {key!r} was damaged in transit") from None
                raise

        part = self._call(key, "upload part of", send)
        if str(part.sha_1).lower() != piece_sha1 or int(part.size) != len(piece):
            raise BackendError(f"Box stored another part than sent for {key!r}")
        return part

    @staticmethod
    def _parts(client: Any, session_id: str) -> builtins.list[Any]:
        """Every part Box has of a session (offset paging)."""
        parts: builtins.list[Any] = []
        while True:
            page = client.chunked_uploads.get_file_upload_session_parts(
                session_id, offset=len(parts), limit=1000)
            entries = page.entries or []
            parts.extend(entries)
            if not entries or len(parts) >= int(page.total_count or 0):
                return parts

    def _commit(self, key: str, session: Any, parts: builtins.list[Any], sha1: str, size: int,
                folders: builtins.list[str], name: str, source: BinaryIO, start: int) -> None:
        """Commit the session; ``202`` (parts still processing) is asked again. A
        commit whose answer was lost (the session then is gone: ``404``) is recognised
        by the file's SHA-1; a name taken meanwhile by another writer (``409``) holding
        the same bytes is as good as ours, else the object is uploaded again as a new
        version of that file."""
        from box_sdk_gen.schemas.upload_part import UploadPart

        listed = [UploadPart(part_id=p.part_id, offset=int(p.offset), size=int(p.size),
                             sha_1=p.sha_1) for p in sorted(parts, key=lambda p: int(p.offset))]
        digest = f"sha={_sha1_b64(sha1)}"
        path = self._lower([*folders, name])
        maybe_ours = RetryMark(_NotApplied)

        def commit(client: Any) -> Any:
            try:
                return client.chunked_uploads.create_file_upload_session_commit(
                    session.id, listed, digest)
            except Exception as exc:
                conflict = _conflict_of(exc)
                if conflict is None:
                    raise
                return conflict

        for round_number in range(60):
            try:
                result = self._call(key, "finish upload of", commit, on_retry=maybe_ours)
            except ObjectNotFound:
                if maybe_ours.marked:
                    info = self._file_info(key, ["sha1", "size"])
                    if str(info.sha_1).lower() == sha1 and int(info.size) == size:
                        return
                raise BackendError(
                    f"cannot write {key!r} on {self.name}: the upload session vanished") from None
            if result is None:  # 202: Box is still processing the parts
                time.sleep(self.policy.delay(min(round_number, 5), None))  # backoff
                continue
            if isinstance(result, _Conflict):
                if result.is_file and str(result.item.get("sha1", "")).lower() == sha1:
                    with self._cache_lock:
                        self._files[path] = result.id
                    return  # the same bytes are there already
                with contextlib.suppress(BackendError):
                    self._call(key, "abort upload of", lambda c: c.chunked_uploads.
                               delete_file_upload_session_by_id(session.id))
                if not result.is_file:
                    raise BackendError(f"cannot write {key!r} on {self.name}: a folder has "
                                       "that name")
                with self._cache_lock:
                    self._files[path] = result.id
                self._upload_session(key, source, start, size, journaled=False)
                return
            entry = result.entries[0]
            with self._cache_lock:
                self._files[path] = str(entry.id)
            self._check_stored(key, entry, sha1, size)
            return
        raise TransientError(f"Box kept processing the upload of {key!r}; try again")

    def _resume(self, key: str, journal: UploadJournal, source: BinaryIO, start: int,
                size: int) -> tuple[Any, builtins.list[Any], float] | None:
        """The journaled session of this key and the parts Box has, if the session is
        still open for a file of this size and the source's bytes are the ones
        uploaded (journal prefix SHA-256); else None (the old session is aborted)."""
        pending = journal.pending()
        if pending is None:
            return None
        journal.clear()  # used now; re-recorded as the upload goes on
        try:
            session = self._call(key, "resume upload of", lambda c: c.chunked_uploads.
                                 get_file_upload_session_by_id(pending.session))
            parts = self._call(key, "resume upload of", lambda c: self._parts(c, pending.session))
        except BackendError:
            return None  # expired (410) or gone (404): start over
        total = int(getattr(session, "total_parts", 0) or 0)
        part_size = int(session.part_size)
        if total != max(1, -(-size // part_size)) or pending.offset > size:
            self._abort(key, pending.session)
            return None
        sha256 = hashlib.sha256()
        source.seek(start)
        left = pending.offset
        while left:
            piece = source.read(min(left, CHUNK_SIZE))
            if not piece:
                break
            sha256.update(piece)
            left -= len(piece)
        if left or sha256.hexdigest() != pending.prefix_sha256:
            self._abort(key, pending.session)
            return None
        log.info("resuming the upload of %r on %s: Box has %d of %d parts", key, self.name,
                 len(parts), total)
        return session, parts, pending.started

    def _abort(self, key: str, session_id: str) -> None:
        with contextlib.suppress(BackendError):
            self._call(key, "abort upload of",
                       lambda c: c.chunked_uploads.delete_file_upload_session_by_id(session_id))

    # --- reads ---------------------------------------------------------------------
    @staticmethod
    def _read_stream(stream: Any, limit: int | None = None) -> bytes:
        parts: builtins.list[bytes] = []
        have = 0
        while limit is None or have < limit:
            piece = stream.read(READ_PIECE)
            if not piece:
                break
            parts.append(piece)
            have += len(piece)
        return b"".join(parts)

    def get(self, key: str) -> bytes:
        """The whole file: ``GET /files/{id}/content`` (a redirect to the download
        host, followed by the SDK), retried whole."""
        return self._with_file(key, "read", lambda c, fid: self._read_stream(
            self._download(c, fid)))

    @staticmethod
    def _download(client: Any, file_id: str, version: str | None = None,
                  byte_range: str | None = None) -> Any:
        stream = client.downloads.download_file(file_id, version=version, range=byte_range)
        if stream is None:  # 202: not ready yet (a file uploaded just now)
            raise _NotApplied("the file is not ready for download yet")
        return stream

    def open(self, key: str) -> BinaryIO:
        """A stream of the file's current version (``GET /files/{id}`` for its size and
        version id, then the download). A connection lost while reading is resumed
        with a ranged download of the same version (``?version=``), so versions never
        mix even if the file is replaced meanwhile."""
        info = self._file_info(key, ["size", "file_version", "sha1"])
        file_id = str(info.id)
        version = str(info.file_version.id) if getattr(info, "file_version", None) else None
        stream = self._call(key, "read", lambda c: self._download(c, file_id, version))
        reader = _BoxReader(self, key, file_id, version, int(info.size), stream)
        return cast(BinaryIO, io.BufferedReader(reader, 1 << 20))

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        """``length`` bytes at ``offset``: a download with ``Range``. A server that
        ignored the range (whole body) is cut to the range; fewer bytes than asked mean
        a truncated copy."""
        if offset < 0 or length < 0:
            raise ValueError(f"get_range needs offset >= 0 and length >= 0, got {offset}, {length}")
        if length == 0:
            size = self.size(key)
            if size < offset:
                raise self.truncated_error(key, offset, size)
            return b""

        def read(client: Any, file_id: str) -> bytes | None:
            try:
                stream = self._download(client, file_id,
                                        byte_range=f"bytes={offset}-{offset + length - 1}")
            except Exception as exc:
                if _status(exc) == 416:
                    return None
                raise
            data = self._read_stream(stream, length + 1)
            if len(data) > length:  # the whole file came: skip to the range
                data += self._read_stream(stream, offset + length - len(data))
                data = data[offset:offset + length]
            return data

        data = self._with_file(key, "read", read)
        if data is None or len(data) != length:
            raise self.truncated_error(key, offset + length,
                                       None if data is None else self.size(key))
        return data

    def size(self, key: str) -> int:
        return int(self._file_info(key, ["size"]).size)

    def list(self, prefix: str = "") -> Iterator[str]:
        """Every key below the folder ``prefix``: ``GET /folders/{id}/items`` (marker
        paging, 1,000 a page) for each folder, up to ``transfers`` folders at once.
        Keys keep the names' case as stored; names that are not valid key parts
        (files other tools put there) are skipped."""
        check_prefix(prefix)
        folder = [p for p in prefix.rstrip("/").split("/") if p]
        try:
            return iter(self._walk(folder))
        except ObjectNotFound:  # a cached folder id has gone: look the path up again
            self._forget_folders()
            return iter(self._walk(folder))

    def _walk(self, folder: builtins.list[str]) -> builtins.list[str]:
        top = self._folder_id([*self.root, *folder], create=False)
        if top is None:
            return []
        keys: builtins.list[str] = []
        level: builtins.list[tuple[str, builtins.list[str]]] = [(top, folder)]
        pool: ThreadPoolExecutor | None = None
        try:
            while level:
                if len(level) == 1:  # a log folder: no threads needed
                    pages = [self._items(level[0][0], "list")]
                else:
                    pool = pool or ThreadPoolExecutor(self.transfers, "metasync-box-list")
                    pages = builtins.list(pool.map(lambda f: self._items(f[0], "list"), level))
                following: builtins.list[tuple[str, builtins.list[str]]] = []
                for (_, names), entries in zip(level, pages, strict=True):
                    self._remember(self._lower([*self.root, *names]), entries)
                    for entry in entries:
                        name = str(entry.name)
                        kind = str(getattr(entry.type, "value", entry.type))
                        if not is_key_part(name):
                            continue
                        if kind == "folder":
                            following.append((str(entry.id), [*names, name]))
                        elif kind == "file":
                            keys.append("/".join([*names, name]))
                level = following
        finally:
            if pool is not None:
                pool.shutdown()
        return keys

    def poll(self, key: str) -> str | None:
        """``<file id>:<etag>`` from one preflight check (the etag goes up with every
        version; the id changes if the file is re-created), None if missing."""
        folders, name = self._key_path(key)
        conflict = self._preflight(key, folders, name)
        if conflict is None or not conflict.is_file:
            return None
        with self._cache_lock:
            self._files[self._lower([*folders, name])] = conflict.id
        return f"{conflict.id}:{conflict.item.get('etag')}"

    # --- logs ----------------------------------------------------------------------
    def specific_logs(self) -> LogStore:
        """The logs of exclusive creates (:class:`BoxLogs`), checking entries without
        the cache of file ids."""
        return BoxLogs(self)

    # --- sharing -------------------------------------------------------------------
    def share(self, email: str) -> str:
        """Invite ``email`` to the namespace folder as an editor (``POST
        /collaborations``); a user who is a collaborator already is fine."""
        from box_sdk_gen.managers.user_collaborations import (
            CreateCollaborationAccessibleBy,
            CreateCollaborationAccessibleByTypeField,
            CreateCollaborationItem,
            CreateCollaborationItemTypeField,
            CreateCollaborationRole,
        )

        folder_id = self._folder_id(list(self.root), create=False)
        if folder_id is None:
            raise BackendError(f"{self.name}: the namespace folder {self.namespace!r} is missing")

        def invite(client: Any) -> str:
            try:
                client.user_collaborations.create_collaboration(
                    CreateCollaborationItem(type=CreateCollaborationItemTypeField.FOLDER,
                                            id=folder_id),
                    CreateCollaborationAccessibleBy(
                        CreateCollaborationAccessibleByTypeField.USER, login=email),
                    CreateCollaborationRole.EDITOR, notify=True)
            except Exception as exc:
                code = _box_code(exc)
                if code == "user_already_collaborator":
                    return "already"
                if _status(exc) == 400:
                    raise UsageError(f"Box refused {email!r} as a collaborator ({code})") from None
                raise
            return "invited"

        result = self._call(None, "share", invite)
        where = "/" + "/".join(self.root)
        if result == "already":
            return f"{email} is already a collaborator on the Box folder {where}"
        return f"invited {email} to edit the Box folder {where}"


def _inside(event: dict[str, Any], folder_id: str) -> bool:
    """Whether an event may concern the folder ``folder_id`` or what is below it: its
    source is the folder, or has it as parent or in its path; an event whose source
    says nothing of where it is counts (a false alarm, never a miss)."""
    source = event.get("source")
    if not isinstance(source, dict):
        return True
    if source.get("id") == folder_id:
        return True
    parent = source.get("parent")
    collection = source.get("path_collection")
    if not isinstance(collection, dict) and not isinstance(parent, dict):
        return True
    if isinstance(parent, dict) and parent.get("id") == folder_id:
        return True
    entries = collection.get("entries") if isinstance(collection, dict) else None
    return any(isinstance(e, dict) and e.get("id") == folder_id for e in entries or [])


class BoxFeed(LongPollFeed):
    """The namespace's changes through Box's event stream: the position of "now"
    (``GET /events?stream_position=now``), then long-polls of a realtime server
    (``OPTIONS /events``; a new one after ``reconnect`` or ``max_retries`` polls, each
    waiting up to ``retry_timeout``); on ``new_change``, the events since the saved
    position (``stream_type=changes``) are read and those below the namespace folder
    fire. Idle, it costs about two requests per ``retry_timeout`` (610 s on Box)."""

    def __init__(self, backend: BoxBackend) -> None:
        super().__init__(backend.name)
        self._backend = backend
        self._folder = ""
        self._position = "now"
        self._server: tuple[str, float, int] | None = None
        self._polls = 0

    @property
    def round_seconds(self) -> float:
        """The realtime server's ``retry_timeout`` (Box's default until one is known)."""
        return self._server[1] if self._server is not None else REALTIME_RETRY_TIMEOUT

    def _begin(self) -> None:
        self._folder = self._backend.namespace_folder_id()
        _, self._position = self._backend.events_since("now")

    def _poll_round(self) -> PollAnswer:
        if self._server is None or self._polls >= self._server[2]:
            self._server = self._backend.realtime_server()
            self._polls = 0
        url, retry_timeout, _ = self._server
        self._polls += 1
        message = self._backend.realtime_poll(url, self._position, retry_timeout)
        if message == "reconnect":
            self._server = None
            return PollAnswer(False)
        if message != "new_change":
            return PollAnswer(False)
        events, self._position = self._backend.events_since(self._position)
        return PollAnswer(any(_inside(event, self._folder) for event in events))


class BoxLogs(ObjectStoreLogs):
    """:class:`ObjectStoreLogs` on Box, whose ``append_at`` checks entry *p − 1* with
    one preflight check (which never goes by a cached file id) rather than ``size``
    (which does)."""

    def __init__(self, backend: BoxBackend) -> None:
        super().__init__(backend)
        #: The Box backend (``self.backend``, with its preflight check).
        self.box = backend

    def has_entry(self, key: str) -> bool:
        return self.box.poll(key) is not None


class _BoxReader(ObjectReader):
    """The body of one download, resumed at the current position (same version) if
    the connection fails."""

    _backend: BoxBackend

    def __init__(self, backend: BoxBackend, key: str, file_id: str, version: str | None,
                 size: int, stream: Any) -> None:
        super().__init__(backend, key, size)
        self._file_id = file_id
        self._version = version
        self._stream: Any = stream

    def _next_piece(self, wanted: int) -> bytes:
        return self._backend._call(self._key, "read", lambda c: self._next(c, wanted))

    def _next(self, client: Any, wanted: int) -> bytes:
        if self._stream is None:
            self._stream = BoxBackend._download(client, self._file_id, self._version,
                                                f"bytes={self._pos}-")
        try:
            piece = cast(bytes, self._stream.read(min(wanted, READ_PIECE, self._size - self._pos)))
        except BaseException:
            self._stream = None
            raise
        if not piece:
            self._stream = None
            raise self._ended_early()
        return piece

    def close(self) -> None:
        self._stream = None
        super().close()


# --- sign-in -----------------------------------------------------------------------------


def redirect_uri() -> str:
    """The loopback redirect URI (``METASYNC_BOX_REDIRECT_URI``, else the default)."""
    uri = os.environ.get("METASYNC_BOX_REDIRECT_URI") or DEFAULT_REDIRECT_URI
    parts = urlsplit(uri)
    if parts.scheme != "http" or parts.hostname not in ("127.0.0.1", "localhost") or not parts.port:
        raise UsageError(
            f"METASYNC_BOX_REDIRECT_URI={uri!r} must be http://127.0.0.1:PORT/ (a loopback "
            "address with a port, listed as a redirect URI of your Box app)")
    return uri


class _Callback(BaseHTTPRequestHandler):
    """The loopback page Box sends the browser to: records the query once."""

    server: _CallbackServer

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        split = urlsplit(self.path)
        if split.path.rstrip("/") != self.server.path.rstrip("/"):
            self.send_error(404)
            return
        query = redirect_query(split.query)
        ok = "code" in query
        text = ("metasync is signed in to Box; you can close this window." if ok else
                f"Box did not sign metasync in ({html.escape(query.get('error', 'no code'))}).")
        body = f"<!doctype html><title>metasync</title><p>{text}</p>".encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/html; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
        self.server.answer = self.server.answer or query
        self.server.done.set()


class _CallbackServer(HTTPServer):
    def __init__(self, host: str, port: int, path: str) -> None:
        self.path = path or "/"
        self.answer: dict[str, str] | None = None
        self.done = threading.Event()
        super().__init__((host, port), _Callback)


def authorize(request: AuthRequest, ui: AuthUI) -> Grant:
    """``metasync auth box``: Box's OAuth 2 with a loopback redirect. metasync listens
    on the redirect URI, opens the authorize page in a browser and takes the code from
    Box's redirect. Without a browser (``--no-browser``, or none starts) it prints the
    address; the user signs in anywhere and pastes back the address the browser ended
    on (which fails to load there) or the code (valid 30 seconds)."""
    from box_sdk_gen.box.oauth import BoxOAuth, GetAuthorizeUrlOptions, OAuthConfig

    app_key, app_secret = app_credentials("box", request.app_key, request.app_secret)
    if not app_secret:
        raise UsageError(
            "Box needs the app's client secret too: pass --app-secret SECRET or set "
            "METASYNC_BOX_APP_SECRET (see docs/backends.md, section box:)")
    base = request.endpoint.base_url
    redirect = redirect_uri()
    state = secrets.token_urlsafe(16)
    oauth = BoxOAuth(OAuthConfig(app_key, app_secret))
    url = oauth.get_authorize_url(options=GetAuthorizeUrlOptions(
        redirect_uri=redirect, state=state, response_type="code"))
    if base is not None:
        # The SDK writes Box's sign-in host into the address; BaseUrls.oauth_2_url
        # names the one configured (an emulator).
        url = url.replace(BOX_OAUTH, f"{base}/api/oauth2", 1)
    code = request.code
    if code is None:
        code = _browser_code(request, ui, url, redirect, state)
    session = pooled_session(request.endpoint.ca_file, 4)
    try:
        network = _network_session(session, base, DEFAULT_TIMEOUT)
        try:
            token = oauth.get_tokens_authorization_code_grant(code, network_session=network)
        except Exception as exc:
            from box_sdk_gen.box.errors import BoxAPIError

            if isinstance(exc, BoxAPIError):
                detail = (exc.response_info.body or {}).get("error") or exc.response_info.status_code
                raise UsageError(
                    f"Box did not accept the code ({detail}; codes are valid 30 seconds); run "
                    "`metasync auth box` again") from None
            raise BackendUnavailable(
                f"cannot reach Box to finish the sign-in: {one_line(exc)}") from None
        if not token.refresh_token or not token.access_token:
            raise UsageError("Box returned no refresh token; sign-in cancelled")
        extra: dict[str, Any] = {}
        classes = _sdk_classes()
        client = classes["BoxClient"](classes["BearerAuth"](token.access_token),
                                      network_session=network)
        with contextlib.suppress(Exception):  # the e-mail is only shown to the user
            me = client.users.get_user_me(fields=["id", "login"])
            extra = {"user_id": str(me.id), "email": str(me.login)}
    finally:
        session.close()
    expires_at = time.time() + float(token.expires_in) if token.expires_in else None
    return Grant("box", request.account, app_key, token.refresh_token, token.access_token,
                 expires_at, app_secret, extra)


def _browser_code(request: AuthRequest, ui: AuthUI, url: str, redirect: str, state: str) -> str:
    """Run the sign-in page in a browser and take the code from the loopback redirect;
    fall back to pasting when no browser starts."""
    split = urlsplit(redirect)
    server: _CallbackServer | None = None
    if not request.no_browser:
        try:
            server = _CallbackServer(split.hostname or "127.0.0.1", int(split.port or 0),
                                     split.path or "/")
        except OSError as exc:
            ui.show(f"(cannot listen on {redirect}: {exc.strerror}; continuing without it)")
    if server is not None:
        thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1},
                                  name="metasync-box-auth", daemon=True)
        thread.start()
        try:
            if ui.open_browser(url):
                ui.show(f"A browser window asks you to allow metasync; if it did not open, "
                        f"visit:\n  {url}")
                if not server.done.wait(AUTH_TIMEOUT):
                    raise UsageError("no answer from the browser; run `metasync auth box` "
                                     "again (or with --no-browser)")
                return redirect_code(server.answer or {}, state, "box", "Box")
        finally:
            server.shutdown()
            server.server_close()
    ui.show(
        "Visit this address, sign in to Box and allow metasync:\n"
        f"  {url}\n"
        f"Your browser is then sent to {redirect}... (which may not load on this machine):\n"
        "copy that whole address from the address bar and paste it here within 30 seconds."
    )
    return pasted_code(ui.prompt("Address (or code): "), state, "box", "Box")


__all__ = ["BoxBackend", "authorize", "redirect_uri", "refresher"]
