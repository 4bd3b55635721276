"""The ``dropbox:`` backend: a folder in a Dropbox account, through the official
``dropbox`` SDK (API v2).

URI: ``dropbox:PATH?account=NAME&transfers=N&timeout=S`` (and, for tests and
emulators, ``api=https://HOST:PORT&ca=FILE``). ``PATH`` is a folder below the root
the app sees (the app folder ``/Apps/<app name>`` for an "App folder" app, the whole
Dropbox for a "Full Dropbox" app); ``dropbox:`` alone is that root. With namespace
``ns``, key ``a/b`` is the file ``/PATH/ns/a/b``. The sign-in is this client's grant
for ``NAME`` (default ``default``), made by ``metasync auth dropbox``.

What Dropbox guarantees and this module relies on:

- an upload commits atomically: readers see the old file or the whole new one;
- ``WriteMode.add`` with ``autorename=False`` and ``strict_conflict=True`` is an
  atomic exclusive create (``path/conflict``), hence ``put_if_absent`` and the logs of
  :class:`ObjectStoreLogs`. (Without ``strict_conflict`` an upload of identical bytes
  onto an existing file "succeeds", so two appenders of equal messages would both win.)
- ``WriteMode.update(rev)`` with ``strict_conflict=True`` is a compare-and-swap on the
  file's ``rev``, which changes with every new content: ``replace_if`` and ``poll``;
- every file's metadata carries its ``content_hash`` (documented algorithm), so an
  upload is verified end to end, and a write whose answer was lost is recognised as
  ours without downloading it;
- paths are case-insensitive (``case_sensitive=False``).

The SDK's own retries are off (``max_retries_on_error=0``,
``max_retries_on_rate_limit=0``): every request goes through :func:`retrying`, which
knows which writes are conditional. Access tokens come from a
:class:`~metasync.backends.cloud.TokenSource` (refreshed and saved by the shared
framework); the SDK never sees the refresh token.
"""

from __future__ import annotations

import builtins
import contextlib
import datetime
import hashlib
import io
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any, BinaryIO, cast

from metasync.backends import register
from metasync.backends.base import (
    Backend,
    Capabilities,
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
)
from metasync.backends.cloudfeeds import LongPollFeed, PollAnswer
from metasync.backends.feeds import ChangeFeed
from metasync.backends.http import ResponseReader, pin_ca, range_of_chunks, requests_failure
from metasync.backends.retry import RetryMark, TransientError
from metasync.backends.uploads import NO_JOURNAL, PendingUpload, UploadJournal
from metasync.errors import (
    AuthorizationRequired,
    BackendError,
    BackendFull,
    BackendUnavailable,
    ObjectNotFound,
    UsageError,
)

log = logging.getLogger("metasync.backends")

#: Streams are read and uploaded in pieces of this size (a multiple of 4 MiB, as
#: Dropbox asks of upload-session appends).
CHUNK_SIZE = 8 << 20
#: Largest body of one upload request; larger objects need an upload session.
SINGLE_UPLOAD_LIMIT = 150 * 1024 * 1024
#: Largest file an upload session can make (Dropbox's limit for API uploads).
MAX_FILE_SIZE = 350 * (1 << 30)
#: Entries asked for per listing page (Dropbox's maximum).
LIST_LIMIT = 2000
#: The ``timeout`` of a ``files/list_folder/longpoll`` (seconds): Dropbox's longest
#: (it takes 30..480), so an idle namespace costs 7.5 requests an hour; and the random
#: delay of up to this many seconds Dropbox adds to spread clients out.
LONGPOLL_SECONDS = 480
LONGPOLL_JITTER = 90
#: The real service's token endpoint and hosts.
DROPBOX_API = "https://api.dropboxapi.com"
#: Scopes metasync asks for when signing in (the app must have them enabled).
SCOPES = (
    "account_info.read",
    "files.metadata.read",
    "files.content.read",
    "files.content.write",
    "sharing.write",
)


def _parse_uri(uri: str) -> tuple[str, dict[str, str]]:
    """``(location path, options)``: the path is ``""`` (the root) or ``/a/b``."""
    parts, options = parse_cloud_uri("dropbox", uri)
    return ("/" + "/".join(parts)) if parts else "", options


def _tags(value: Any) -> builtins.list[str]:
    """The chain of union tags of an SDK error, e.g. ``["path", "conflict", "file"]``
    (structs with a ``reason`` field, such as UploadWriteFailed, are followed)."""
    tags: builtins.list[str] = []
    for _ in range(8):
        if value is None:
            break
        tag = getattr(value, "_tag", None)
        if isinstance(tag, str):
            tags.append(tag)
            value = getattr(value, "_value", None)
            continue
        reason = getattr(value, "reason", None) if hasattr(value, "_all_field_names_") else None
        if reason is not None and "reason" in getattr(value, "_all_field_names_", ()):
            value = reason
            continue
        break
    return tags


def _find(value: Any, tag: str) -> Any:
    """The value under union tag ``tag`` anywhere in the chain, or None."""
    for _ in range(8):
        if value is None:
            return None
        if getattr(value, "_tag", None) == tag:
            return getattr(value, "_value", None)
        inner = getattr(value, "_value", None)
        if inner is None and "reason" in getattr(value, "_all_field_names_", ()):
            inner = value.reason
        value = inner
    return None


def _content_hash(data: bytes) -> str:
    from dropbox.content_hash import DropboxContentHasher

    hasher = DropboxContentHasher()
    hasher.update(data)
    return str(hasher.hexdigest())


def _sdk_hosts(base_url: str | None) -> dict[str, str] | None:
    """The SDK's host map for an API base URL (None: the real hosts). The SDK speaks
    only ``https://{host}/2/...``, so the base must be https."""
    if base_url is None:
        return None
    if not base_url.startswith("https://"):
        raise UsageError(
            f"the Dropbox SDK speaks only https; {base_url!r} must start with https://"
        )
    host = base_url[len("https://") :]
    from dropbox.session import HOST_API, HOST_CONTENT, HOST_NOTIFY

    return {HOST_API: host, HOST_CONTENT: host, HOST_NOTIFY: host}


def _client_class() -> type:
    import dropbox

    class Client(dropbox.Dropbox):
        """The SDK client, minus its own token refresh: the TokenSource refreshes (and
        saves) grants; the SDK never holds a refresh token. Without this the SDK logs
        a warning and sends the request a second time before giving up."""

        def refresh_access_token(self, host: Any = None, scope: Any = None) -> None:
            raise SdkTokenRefresh("expired_access_token")

    return Client


def _make_client(
    token: str, session: Any, timeout: float, hosts: dict[str, str] | None
) -> Any:
    client = _client_class()(
        oauth2_access_token=token,
        # One attempt each: ``retrying`` retries, knowing which writes are conditional.
        max_retries_on_error=0,
        max_retries_on_rate_limit=0,
        user_agent="metasync",
        session=session,
        timeout=timeout,
    )
    if hosts is not None:
        # The SDK reads its hosts from DROPBOX_API_HOST & co. once, at import; a
        # per-client map lets one process use several endpoints (tests: an emulator
        # directly and through a fault proxy). ``_host_map`` is what it consults.
        client._host_map = dict(hosts)
    return client


def refresher(base_url: str | None, ca_file: str | None) -> Callable[[Grant], Grant]:
    """The refresh function of Dropbox grants (OAuth 2 at ``/oauth2/token``)."""
    token_url = f"{base_url or DROPBOX_API}/oauth2/token"
    return lambda grant: oauth2_refresh(token_url, grant, ca_file=ca_file)


@register
class DropboxBackend(CloudAccess, Backend):
    """A folder in Dropbox, URI ``dropbox:PATH?account=NAME`` (see the module docstring).

    Thread-safe: one requests session (connection pool) shared by all threads, at
    most ``transfers`` requests at once.
    """

    scheme = "dropbox"
    capabilities = Capabilities(
        conditional_create=True,
        compare_and_swap=True,
        conditional_append=True,
        range_reads=True,
        max_object_size=MAX_FILE_SIZE,
        case_sensitive=False,
        long_poll=False,
        change_feed="longpoll",
        sharing=True,
    )

    def __init__(self, uri: str, namespace: str) -> None:
        """Parse the URI; sends no request (the sign-in is read on first use).

        Raises :class:`UsageError` for a malformed URI, option or namespace."""
        super().__init__(uri, namespace)
        self.location, options = _parse_uri(uri)
        self._bind_account("dropbox", uri, namespace, options, refresher)
        self._hosts = _sdk_hosts(self._base_url)
        #: The namespace folder; every key lives below it.
        self.root = f"{self.location}/{namespace}"
        self._clients = SdkClients(
            self.tokens,
            self._http_session,
            lambda session, token: _make_client(token, session, self.timeout, self._hosts),
        )

    @property
    def name(self) -> str:
        """``dropbox:PATH`` (with ``?account=`` if not the default account)."""
        return self._named(f"dropbox:{self.location or '/'}")

    # --- plumbing ------------------------------------------------------------------
    def _http_session(self) -> Any:
        """The SDK's requests session (``transfers`` + 4 pooled connections), trusting
        the configured CA file."""
        import dropbox

        return pin_ca(
            dropbox.create_session(max_connections=self.transfers + 4, ca_certs=self._ca_file),
            self._ca_file,
        )

    def _connect(self) -> tuple[Any, str]:
        """A client holding a fresh access token, and that token."""
        return self._clients.connect()

    def _path(self, key: str) -> str:
        return f"{self.root}/{check_key(key)}"

    def _translate(
        self, exc: Exception, key: str | None, action: str, token: str | None
    ) -> BaseException:
        """The backend-contract error for an SDK or transport exception."""
        import dropbox.exceptions as dexc

        what = self._what(action, key)
        if isinstance(exc, dexc.ApiError):
            tags = _tags(exc.error)
            summary = "/".join(tags) or one_line(exc)
            if {"not_found", "not_file", "not_folder"} & set(tags):
                return ObjectNotFound(f"no object {key!r} on {self.name}")
            if "too_many_write_operations" in tags:
                return TransientError(f"cannot {what}: Dropbox is busy ({summary})")
            if "content_hash_mismatch" in tags:
                return TransientError(f"cannot {what}: the data was damaged in transit")
            if "insufficient_space" in tags:
                return BackendFull.of(self.name, "the Dropbox account is out of space")
            if "no_write_permission" in tags or "no_permission" in tags:
                return BackendError(f"cannot {what}: no permission to write there")
            return BackendError(f"cannot {what}: {summary}")
        if isinstance(exc, dexc.AuthError):
            error = exc.error
            if error is not None and error.is_missing_scope():
                scope = error.get_missing_scope().required_scope
                return AuthorizationRequired(
                    f"cannot {what}: the Dropbox app lacks the permission {scope!r}; enable "
                    f"it in the app console, then {auth_hint('dropbox', self.account)}"
                )
            tags = _tags(error)
            if {"expired_access_token", "invalid_access_token"} & set(tags) and token is not None:
                # Refresh and retry; refused again after a refresh: sign in again.
                return self.tokens.rejected(token, "/".join(tags))
            return AuthorizationRequired(
                f"cannot {what}: Dropbox refused the sign-in of account {self.account!r} "
                f"({'/'.join(tags) or 'unauthorized'}); {auth_hint('dropbox', self.account)}"
            )
        if isinstance(exc, dexc.RateLimitError):
            reason = "/".join(_tags(getattr(exc.error, "reason", None))) or "too_many_requests"
            return TransientError(
                f"cannot {what}: Dropbox is throttling ({reason})", retry_after=exc.backoff
            )
        if isinstance(exc, dexc.InternalServerError):
            return TransientError(f"cannot {what}: Dropbox answered {exc.status_code}")
        if isinstance(exc, dexc.BadInputError):
            return BackendError(f"cannot {what}: Dropbox rejected the request: {exc.message}")
        if isinstance(exc, dexc.HttpError):
            if exc.status_code in (408, 425, 429) or exc.status_code >= 500:
                return TransientError(f"cannot {what}: HTTP {exc.status_code}")
            return BackendError(f"cannot {what}: HTTP {exc.status_code}: {one_line(exc)}")
        return requests_failure(exc, what, "Dropbox", self._base_url or DROPBOX_API) or exc

    def _metadata(self, path: str, key: str | None, action: str = "stat") -> Any:
        """Metadata of ``path`` (ObjectNotFound if missing)."""
        return self._call(key, action, lambda c: c.files_get_metadata(path))

    def _file(self, key: str) -> Any:
        """FileMetadata of ``key``; a folder is not an object (ObjectNotFound)."""
        import dropbox.files as df

        meta = self._metadata(self._path(key), key)
        if not isinstance(meta, df.FileMetadata):
            raise ObjectNotFound(f"no object {key!r} on {self.name}")
        return meta

    # --- lifecycle -----------------------------------------------------------------
    def probe(self) -> None:
        """Check the sign-in and that the location folder exists. Never writes."""
        import dropbox.files as df

        if not self.location:
            self._call(None, "reach", lambda c: c.users_get_current_account())
            return
        try:
            meta = self._metadata(self.location, None, "reach")
        except ObjectNotFound:
            meta = None
        if not isinstance(meta, df.FolderMetadata):
            raise BackendUnavailable(
                f"the folder {self.location!r} does not exist in Dropbox ({self.name}); "
                "create it there first (or fix the URI)"
            )

    def exists(self) -> bool:
        import dropbox.files as df

        try:
            meta = self._metadata(self.root, None, "check")
        except ObjectNotFound:
            return False
        return isinstance(meta, df.FolderMetadata)

    def create(self) -> None:
        """Create the namespace folder (idempotent); the location must exist."""
        import dropbox.exceptions as dexc

        self.probe()

        def make(client: Any) -> None:
            try:
                client.files_create_folder_v2(self.root, autorename=False)
            except dexc.ApiError as exc:
                tags = _tags(exc.error)
                if "conflict" in tags and "folder" in tags:
                    return  # exists already (perhaps our own earlier attempt)
                raise

        self._call(None, "create the namespace on", make)

    def close(self) -> None:
        self._clients.close()

    # --- writes --------------------------------------------------------------------
    def _write_mode(self, mode: str, rev: str | None = None) -> Any:
        import dropbox.files as df

        if mode == "add":
            return df.WriteMode.add
        if mode == "update":
            return df.WriteMode.update(rev)
        return df.WriteMode.overwrite

    def _upload(self, key: str, data: bytes, mode: Any, digest: str) -> bool:
        """One ``files/upload`` of ``data`` with ``mode``; False if a conditional mode
        found a conflict. A conflict after a retried attempt whose answer was lost is
        ours if the file now holds our content hash."""
        import dropbox.exceptions as dexc

        path = self._path(key)
        retried = RetryMark()

        def attempt(client: Any) -> bool:
            try:
                meta = client.files_upload(
                    data, path, mode=mode, autorename=False, mute=True, strict_conflict=True
                )
            except dexc.ApiError as exc:
                if "conflict" in _tags(exc.error):
                    return False
                raise
            if meta.content_hash != digest:
                raise BackendError(f"Dropbox stored other bytes than sent for {key!r}")
            return True

        if self._call(key, "write", attempt, on_retry=retried):
            return True
        if not retried.marked:
            return False
        try:
            return bool(self._file(key).content_hash == digest)
        except ObjectNotFound:
            return False

    def put(self, key: str, data: bytes | BinaryIO) -> None:
        """Store ``data`` at ``key`` (``WriteMode.overwrite``, committed atomically).

        Bytes up to 150 MiB are one ``files/upload``; a stream is read in
        :data:`CHUNK_SIZE` pieces: one piece or less is one upload, more go through
        an upload session (one piece in memory at a time)."""
        path = self._path(key)
        mode = self._write_mode("overwrite")
        if isinstance(data, bytes | bytearray | memoryview):
            body = bytes(data)
            if len(body) <= SINGLE_UPLOAD_LIMIT:
                self._upload(key, body, mode, _content_hash(body))
                return
            stream = io.BytesIO(body)
            self._upload_session(key, path, stream.read(CHUNK_SIZE), stream, mode)
            return
        first = read_full(data, CHUNK_SIZE)
        if len(first) < CHUNK_SIZE:
            self._upload(key, first, mode, _content_hash(first))
            return
        self._upload_session(key, path, first, data, mode)

    def _upload_session(
        self, key: str, path: str, first: bytes, rest: BinaryIO, mode: Any
    ) -> None:
        """Upload ``first`` + ``rest`` through an upload session, then commit it.

        Each append is resent on its own after a failure; a resend that Dropbox
        answers with ``incorrect_offset`` tells whether the earlier attempt arrived
        (``correct_offset`` past the piece: it did). The committed file's content hash
        must equal the one computed while streaming.

        A seekable source (every object metasync pushes comes from a file) is also
        journaled (:class:`UploadJournal`): a later ``put`` of the same key after an
        interruption — the source failing, retries running out, the process killed —
        re-reads and checks (SHA-256) the part Dropbox already has and continues the
        same session instead of sending it again; a changed source or an expired
        session starts over."""
        import dropbox.exceptions as dexc
        import dropbox.files as df
        from dropbox.content_hash import DropboxContentHasher

        try:
            start: int | None = rest.tell() - len(first) if rest.seekable() else None
        except (AttributeError, OSError, ValueError):
            start = None
        target = f"{self._base_url or DROPBOX_API}|{self.account}|{path.lower()}"
        with UploadJournal("dropbox", target) as journal:
            if start is None:
                journal = NO_JOURNAL
            resumed = self._resume(key, journal, first, rest, cast(int, start))
            if resumed is None:
                if start is not None and rest.tell() != start + len(first):
                    rest.seek(start)
                    first = read_full(rest, CHUNK_SIZE)
                hasher, sha = DropboxContentHasher(), hashlib.sha256()
                hasher.update(first)
                sha.update(first)
                session_id: str = self._call(
                    key, "start upload of", lambda c: c.files_upload_session_start(first).session_id
                )
                offset = len(first)
                started = time.time()
                journal.record(PendingUpload(session_id, offset, sha.hexdigest(), started))
            else:
                session_id, offset, hasher, sha, started = resumed
            while True:
                piece = read_full(rest, CHUNK_SIZE)
                if not piece:
                    break
                if offset + len(piece) > MAX_FILE_SIZE:
                    raise BackendError(
                        f"cannot write {key!r} on {self.name}: larger than {MAX_FILE_SIZE} "
                        "bytes, the most Dropbox accepts through its API"
                    )
                hasher.update(piece)
                sha.update(piece)

                def append(client: Any, piece: bytes = piece, at: int = offset) -> None:
                    cursor = df.UploadSessionCursor(session_id, at)
                    try:
                        client.files_upload_session_append_v2(piece, cursor)
                    except dexc.ApiError as exc:
                        correct = _find(exc.error, "incorrect_offset")
                        if correct is not None and correct.correct_offset == at + len(piece):
                            return  # an earlier attempt arrived; its answer was lost
                        raise

                self._call(key, "upload part of", append)
                offset += len(piece)
                journal.record(PendingUpload(session_id, offset, sha.hexdigest(), started))
            self._finish_session(key, path, session_id, offset, hasher.hexdigest(), mode)
            journal.clear()

    def _resume(
        self, key: str, journal: UploadJournal, first: bytes, rest: BinaryIO, start: int
    ) -> tuple[str, int, Any, Any, float] | None:
        """Continue the journaled session of this key if the source's first bytes are
        the ones Dropbox has and the session is still open; else None (and the caller
        rewinds the source and starts over)."""
        import dropbox.files as df
        from dropbox.content_hash import DropboxContentHasher

        pending = journal.pending()
        if pending is None:
            return None
        journal.clear()  # used now; re-recorded as the upload goes on
        hasher, sha = DropboxContentHasher(), hashlib.sha256()
        hasher.update(first)
        sha.update(first)
        have = len(first)
        while have < pending.offset:
            piece = read_full(rest, min(CHUNK_SIZE, pending.offset - have))
            if not piece:
                break
            hasher.update(piece)
            sha.update(piece)
            have += len(piece)
        if have != pending.offset or sha.hexdigest() != pending.prefix_sha256:
            rest.seek(start)
            return None
        cursor = df.UploadSessionCursor(pending.session, pending.offset)
        try:  # an empty append: is the session open, at this offset?
            self._call(key, "resume upload of",
                       lambda c: c.files_upload_session_append_v2(b"", cursor))
        except BackendError:
            rest.seek(start)
            return None
        log.info("resuming the upload of %r on %s at byte %d", key, self.name, pending.offset)
        return pending.session, pending.offset, hasher, sha, pending.started

    def _finish_session(
        self, key: str, path: str, session_id: str, offset: int, digest: str, mode: Any
    ) -> None:
        """Commit an upload session at ``path``; a retried finish whose first attempt
        committed (``lookup_failed/not_found``) is recognised by the content hash."""
        import dropbox.files as df

        commit = df.CommitInfo(path, mode=mode, autorename=False, mute=True, strict_conflict=True)

        def finish(client: Any) -> Any:
            return client.files_upload_session_finish(
                b"", df.UploadSessionCursor(session_id, offset), commit
            )

        retried = RetryMark()

        try:
            meta = self._call(key, "finish upload of", finish, on_retry=retried)
        except ObjectNotFound:
            if not retried.marked or self._file(key).content_hash != digest:
                raise BackendError(
                    f"cannot write {key!r} on {self.name}: the upload session vanished"
                ) from None
            return
        if meta.content_hash != digest or meta.size != offset:
            raise BackendError(f"Dropbox stored other bytes than sent for {key!r}")

    def put_if_absent(self, key: str, data: bytes) -> bool:
        """``files/upload`` in ``add`` mode with ``strict_conflict``: atomic on Dropbox;
        False if ``key`` existed (``path/conflict``)."""
        return self._upload(key, bytes(data), self._write_mode("add"), _content_hash(data))

    def replace_if(self, key: str, data: bytes, token: str) -> bool:
        """``files/upload`` in ``update(rev)`` mode with ``strict_conflict``: False if
        the file's rev is no longer ``token`` (changed, or deleted)."""
        return self._upload(key, bytes(data), self._write_mode("update", token), _content_hash(data))

    def delete(self, key: str) -> None:
        """Remove the file at ``key`` (a folder is never removed as a key):
        ``files/get_metadata`` then ``files/delete_v2`` with its ``parent_rev``."""
        import dropbox.exceptions as dexc

        path = self._path(key)
        for _ in range(8):
            rev = self._file(key).rev
            attempts = [0]

            def remove(client: Any, rev: str = rev, attempts: builtins.list[int] = attempts) -> bool:
                attempts[0] += 1
                try:
                    client.files_delete_v2(path, parent_rev=rev)
                except dexc.ApiError as exc:
                    tags = _tags(exc.error)
                    if "conflict" in tags:
                        return False  # replaced meanwhile: look again
                    if "not_found" in tags and attempts[0] > 1:
                        return True  # an earlier attempt whose answer was lost deleted it
                    raise
                return True

            if self._call(key, "delete", remove):
                return
        raise TransientError(f"cannot delete {key!r} on {self.name}: it keeps changing")

    # --- reads ---------------------------------------------------------------------
    def _download(self, client: Any, path: str, headers: dict[str, str] | None = None) -> Any:
        meta, response = client.files_download(path, extra_headers=headers)
        return meta, response

    def get(self, key: str) -> bytes:
        """The whole file (one ``files/download``, retried whole)."""
        path = self._path(key)

        def read(client: Any) -> bytes:
            meta, response = self._download(client, path)
            with contextlib.closing(response):
                data = cast(bytes, response.content)
            if len(data) != meta.size:
                raise TransientError(f"reading {key!r} on {self.name} ended early")
            return data

        return self._call(key, "read", read)

    def open(self, key: str) -> BinaryIO:
        """A stream of the file; a connection lost while reading is resumed with a
        ranged download of the same revision (``rev:``), so versions never mix."""
        path = self._path(key)
        meta, response = self._call(key, "read", lambda c: self._download(c, path))
        return cast(BinaryIO, io.BufferedReader(_DropboxReader(self, key, meta, response), 1 << 20))

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        """``length`` bytes at ``offset``: ``files/download`` with a ``Range`` header."""
        import dropbox.exceptions as dexc

        if offset < 0 or length < 0:
            raise ValueError(f"get_range needs offset >= 0 and length >= 0, got {offset}, {length}")
        path = self._path(key)
        if length == 0:
            size = self.size(key)
            if size < offset:
                raise self.truncated_error(key, offset, size)
            return b""

        def read(client: Any) -> tuple[bytes, int | None]:
            try:
                meta, response = self._download(
                    client, path, {"Range": f"bytes={offset}-{offset + length - 1}"}
                )
            except dexc.HttpError as exc:
                if exc.status_code == 416:
                    return b"", None
                raise
            with contextlib.closing(response):
                if response.status_code == 206:
                    data = cast(bytes, response.content)
                else:  # the whole file: keep only the range
                    data = range_of_chunks(response.iter_content(1 << 20), offset, length)
            return data, int(meta.size)

        data, total = self._call(key, "read", read)
        if len(data) != length:
            raise self.truncated_error(key, offset + length, total)
        return data

    def size(self, key: str) -> int:
        return int(self._file(key).size)

    def list(self, prefix: str = "") -> Iterator[str]:
        """Every key below the folder ``prefix``: ``files/list_folder`` (recursive)
        and ``/continue`` while ``has_more``, each page retried on its own. Keys are
        rebuilt from each folder's own cased name; names that are not valid key parts
        (files other tools put there) are skipped."""
        check_prefix(prefix)
        folder = prefix.rstrip("/")
        return iter(self._walk(folder))

    def _walk(self, folder: str) -> builtins.list[str]:
        import dropbox.files as df

        top = f"{self.root}/{folder}" if folder else self.root
        try:
            page = self._call(
                None, "list", lambda c: c.files_list_folder(top, recursive=True, limit=LIST_LIMIT)
            )
        except ObjectNotFound:
            return []  # no such folder (or a file): nothing below it
        entries = builtins.list(page.entries)
        while page.has_more:
            cursor = page.cursor
            page = self._call(None, "list", self._continuer(cursor))
            entries.extend(page.entries)
        base = self.root.lower() + "/"
        names = {
            e.path_lower: e.name for e in entries if isinstance(e, df.FolderMetadata) and e.path_lower
        }
        keys = []
        for entry in entries:
            if not isinstance(entry, df.FileMetadata) or not entry.path_lower.startswith(base):
                continue
            parts = entry.path_lower[len(base) :].split("/")
            display = (entry.path_display or "").split("/")[-len(parts) :]
            named = []
            for i in range(len(parts) - 1):
                lower = base + "/".join(parts[: i + 1])
                named.append(names.get(lower) or (display[i] if i < len(display) else parts[i]))
            named.append(entry.name)
            if all(is_key_part(n) for n in named):
                keys.append("/".join(named))
        return keys

    @staticmethod
    def _continuer(cursor: str) -> Callable[[Any], Any]:
        return lambda client: client.files_list_folder_continue(cursor)

    def poll(self, key: str) -> str | None:
        """The file's ``rev`` (changes with every new content), None if missing."""
        try:
            return str(self._file(key).rev)
        except ObjectNotFound:
            return None

    # --- change feed ---------------------------------------------------------------
    def change_feed(self, watch_key: str | None = None) -> ChangeFeed:
        """A :class:`DropboxFeed` on the namespace folder (recursive): Dropbox itself
        reports only changes below it."""
        return DropboxFeed(self)

    def latest_cursor(self) -> str:
        """``files/list_folder/get_latest_cursor`` of the namespace folder (recursive):
        a cursor of "now", no listing. Raises :class:`BackendError` if the folder is
        missing."""
        try:
            result = self._call(
                None, "watch",
                lambda c: c.files_list_folder_get_latest_cursor(self.root, recursive=True),
            )
        except ObjectNotFound:
            raise BackendError(
                f"cannot watch {self.name}: the namespace folder {self.root!r} is missing"
            ) from None
        return str(result.cursor)

    def longpoll(self, cursor: str, seconds: int) -> tuple[bool, float] | None:
        """``files/list_folder/longpoll`` (notify host, no sign-in sent): ``(changes,
        backoff seconds)`` after at most ``seconds`` (30..480) plus Dropbox's jitter;
        None if Dropbox reset the cursor. The socket waits that long plus the
        backend's timeout, and the request holds no transfer slot."""
        import dropbox.exceptions as dexc
        import dropbox.files as df

        arg = df.ListFolderLongpollArg(cursor, seconds)

        def poll(client: Any) -> tuple[bool, float] | None:
            try:
                result = client.request(
                    df.list_folder_longpoll, "files", arg, None,
                    timeout=seconds + LONGPOLL_JITTER + self.timeout,
                )
            except dexc.ApiError as exc:
                if "reset" in _tags(exc.error):
                    return None
                raise
            return bool(result.changes), float(result.backoff or 0)

        return self._call(None, "watch", poll, slotted=False)

    def cursor_after(self, cursor: str) -> str | None:
        """The cursor past every change since ``cursor`` (``files/list_folder/
        continue`` while ``has_more``); None if Dropbox reset the cursor."""
        import dropbox.exceptions as dexc

        while True:
            def step(client: Any, cursor: str = cursor) -> Any:
                try:
                    return client.files_list_folder_continue(cursor)
                except dexc.ApiError as exc:
                    if "reset" in _tags(exc.error):
                        return None
                    raise

            page = self._call(None, "watch", step)
            if page is None:
                return None
            cursor = str(page.cursor)
            if not page.has_more:
                return cursor

    # --- sharing -------------------------------------------------------------------
    def share(self, email: str) -> str:
        """Share the namespace folder (``sharing/share_folder``, once) and invite
        ``email`` as an editor (``sharing/add_folder_member``). The invitee adds the
        folder to their Dropbox and uses it as their own ``dropbox:`` location."""
        import dropbox.exceptions as dexc
        import dropbox.files as df
        import dropbox.sharing as ds

        meta = self._metadata(self.root, None, "share")
        if not isinstance(meta, df.FolderMetadata):
            raise BackendError(f"{self.name}: the namespace folder {self.root!r} is missing")
        folder_id = meta.shared_folder_id

        if folder_id is None:
            def share_folder(client: Any) -> str | None:
                try:
                    launch = client.sharing_share_folder(self.root, force_async=False)
                except dexc.ApiError as exc:
                    shared = _find(exc.error, "already_shared")
                    if shared is not None:
                        return str(shared.shared_folder_id)
                    raise
                if launch.is_complete():
                    return str(launch.get_complete().shared_folder_id)
                job = launch.get_async_job_id()
                for _ in range(60):
                    status = client.sharing_check_share_job_status(job)
                    if status.is_complete():
                        return str(status.get_complete().shared_folder_id)
                    if status.is_failed():
                        raise BackendError(f"Dropbox could not share {self.root!r}: {status}")
                    time.sleep(1.0)  # Dropbox finishes the job on its side; ask again
                raise TransientError(f"sharing {self.root!r} is still in progress; run it again")

            folder_id = self._call(None, "share", share_folder)
        member = ds.AddMember(ds.MemberSelector.email(email), ds.AccessLevel.editor)

        def invite(client: Any) -> None:
            try:
                client.sharing_add_folder_member(folder_id, [member], quiet=False)
            except dexc.ApiError as exc:
                tags = _tags(exc.error)
                if "bad_member" in tags:
                    raise UsageError(f"Dropbox refused {email!r} as a member ({'/'.join(tags)})") from None
                raise

        self._call(None, "share", invite)
        return f"invited {email} to edit the Dropbox folder {self.root}"


class DropboxFeed(LongPollFeed):
    """The namespace's changes through ``files/list_folder/longpoll`` on a cursor of
    the namespace folder (recursive): long-polls of the longest timeout Dropbox takes
    (:data:`LONGPOLL_SECONDS`), each ``backoff`` honoured; on a change,
    ``list_folder/continue`` moves the cursor past it. A reset cursor is replaced by a
    new one and counts as a change (a false alarm at worst). Idle, it costs one
    request per long-poll: 7.5 an hour."""

    round_seconds = float(LONGPOLL_SECONDS)

    def __init__(self, backend: DropboxBackend) -> None:
        super().__init__(backend.name)
        self._backend = backend
        self._cursor = ""

    def _begin(self) -> None:
        self._cursor = self._backend.latest_cursor()

    def _poll_round(self) -> PollAnswer:
        answer = self._backend.longpoll(self._cursor, LONGPOLL_SECONDS)
        if answer is None:
            self._cursor = self._backend.latest_cursor()
            return PollAnswer(True)
        changes, backoff = answer
        if changes:
            after = self._backend.cursor_after(self._cursor)
            self._cursor = after if after is not None else self._backend.latest_cursor()
        return PollAnswer(changes, backoff)


class _DropboxReader(ResponseReader):
    """The body of one download, resumed at the current position (same ``rev``) if
    the connection fails."""

    _backend: DropboxBackend

    def __init__(self, backend: DropboxBackend, key: str, meta: Any, response: Any) -> None:
        super().__init__(backend, key, int(meta.size), response)
        self._rev = str(meta.rev)

    def _next_piece(self, wanted: int) -> bytes:
        return self._backend._call(self._key, "read", lambda c: self._next(c))

    def _next(self, client: Any) -> bytes:
        if self._chunks is None:
            _, response = client.files_download(
                f"rev:{self._rev}", extra_headers={"Range": f"bytes={self._pos}-"}
            )
            self._open(response)
        return self._next_chunk()


# --- sign-in -----------------------------------------------------------------------------


def authorize(request: AuthRequest, ui: AuthUI) -> Grant:
    """``metasync auth dropbox``: OAuth 2 with PKCE and no redirect (the user copies
    a code from Dropbox's page), asking for a refresh token ("offline" access)."""
    import dropbox
    import requests
    from dropbox.oauth import DropboxOAuth2FlowNoRedirect

    app_key, app_secret = app_credentials("dropbox", request.app_key, request.app_secret)
    base = request.endpoint.base_url
    hosts = _sdk_hosts(base)

    class Flow(DropboxOAuth2FlowNoRedirect):
        # The SDK builds its URLs from hosts fixed at import; aim them at ``base``.
        def build_url(self, target: str, params: Any = None, host: Any = None) -> str:
            if base is None:
                if host is None:
                    return str(super().build_url(target, params))
                return str(super().build_url(target, params, host))
            return f"{base}{self.build_path(target, params)}"

    flow = Flow(
        app_key,
        consumer_secret=app_secret,
        token_access_type="offline",
        scope=list(SCOPES),
        use_pkce=True,
        ca_certs=request.endpoint.ca_file,
        timeout=DEFAULT_TIMEOUT,
    )
    pin_ca(flow.requests_session, request.endpoint.ca_file)
    url = flow.start()
    if request.code is None:
        if not request.no_browser and ui.open_browser(url):
            ui.show(f"A browser window asks you to allow metasync; if it did not open, visit:\n  {url}")
        else:
            ui.show(f"Visit this address, allow metasync and copy the code it shows:\n  {url}")
    code = request.code or ui.prompt("Code: ")
    if not code.strip():
        raise UsageError("no code given; sign-in cancelled")
    try:
        result = flow.finish(code.strip())
    except requests.HTTPError as exc:
        status = exc.response.status_code if exc.response is not None else "?"
        raise UsageError(
            f"Dropbox did not accept the code (HTTP {status}); run `metasync auth dropbox` "
            "again and paste the new code"
        ) from None
    except requests.RequestException as exc:
        raise BackendUnavailable(f"cannot reach Dropbox to finish the sign-in: {one_line(exc)}") from None
    if not result.refresh_token:
        raise UsageError("Dropbox returned no refresh token; the app must allow offline access")
    extra: dict[str, Any] = {"account_id": result.account_id}
    session = pin_ca(dropbox.create_session(ca_certs=request.endpoint.ca_file),
                     request.endpoint.ca_file)
    try:
        client = _make_client(result.access_token, session, DEFAULT_TIMEOUT, hosts)
        with contextlib.suppress(Exception):  # the e-mail is only shown to the user
            extra["email"] = client.users_get_current_account().email
    finally:
        session.close()
    expires = result.expires_at
    expires_at = (
        expires.replace(tzinfo=datetime.UTC).timestamp()
        if isinstance(expires, datetime.datetime)
        else None
    )
    return Grant(
        "dropbox",
        request.account,
        app_key,
        result.refresh_token,
        result.access_token,
        expires_at,
        app_secret,
        extra,
    )
