"""The ``s3:`` backend: Amazon S3 and S3-compatible object stores (SeaweedFS, MinIO,
Ceph RGW, Cloudflare R2, ...), through boto3.

URI: ``s3://BUCKET/PREFIX?endpoint=URL&region=R&profile=NAME&transfers=N&timeout=S&logs=M``. With
namespace ``ns`` every key ``k`` is the object ``PREFIX/ns/k`` of ``BUCKET`` (just
``ns/k`` without a prefix). The prefix is taken literally (no percent-decoding),
so it may contain spaces and any Unicode.

What the service guarantees and this module relies on:

- a ``PutObject`` is atomic for readers (they see the old or the whole new object),
  so no temporary names are needed;
- ``If-None-Match: *`` on ``PutObject`` is an atomic exclusive create (412 if the
  key exists): ``put_if_absent``, hence the logs of :class:`ObjectStoreLogs`;
- ``If-Match: <etag>`` is a compare-and-swap on the ETag: ``replace_if``.

Every request goes through :func:`retrying`; botocore's own retries are switched
off, because a conditional write that botocore silently resends after a dropped
connection could report "precondition failed" for its own first attempt. Our
retries know which requests are conditional and check the outcome instead.
"""

from __future__ import annotations

import builtins
import contextlib
import io
import threading
from collections.abc import Callable, Iterator
from typing import Any, BinaryIO, TypeVar, cast
from urllib.parse import parse_qsl

from metasync.backends import register
from metasync.backends.base import (
    Backend,
    Capabilities,
    ObjectReader,
    TempFile,
    check_key,
    check_namespace,
    check_prefix,
    one_line,
    read_full,
)
from metasync.backends.capabilities import LOGS_MODES, logs_mode_capabilities
from metasync.backends.retry import (
    RetryMark,
    RetryPolicy,
    TransientError,
    describe,
    retrying,
    silence_of,
    translated,
)
from metasync.errors import (
    BackendError,
    BackendFull,
    BackendUnavailable,
    InvalidKey,
    NoAnswer,
    ObjectNotFound,
    UsageError,
)
from metasync.timeouts import network_timeout

T = TypeVar("T")

#: Part size of multipart uploads, and the most ``put`` of a stream holds in memory.
CHUNK_SIZE = 8 << 20
#: S3 allows at most this many parts per multipart upload.
MAX_PARTS = 10_000
#: The object ``create`` writes so that ``exists`` can tell an empty namespace from
#: none (S3 has no folders). ``~`` is not allowed in keys, so it never collides with
#: one, and ``list`` skips it like any other name that is not a valid key.
NAMESPACE_MARKER = "~metasync-namespace"
#: Default bound on concurrent requests of one backend instance.
DEFAULT_TRANSFERS = 4
#: Seconds to wait for a connection.
CONNECT_TIMEOUT = 10.0
#: Default seconds to wait for the next bytes of an answer (option ``timeout``).
READ_TIMEOUT = 60.0

_OPTIONS = ("endpoint", "region", "profile", "transfers", "timeout", "logs")

# Error codes of a service out of space or over a quota (MinIO, Ceph RGW, Garage,
# SeaweedFS and others use these; AWS itself has no bucket quota).
_FULL_CODES = frozenset(
    {"QuotaExceeded", "XMinioStorageFull", "XMinioAdminBucketQuotaExceeded",
     "InsufficientStorage", "StorageFull"}
)

# Error codes a retry may cure: throttling, server trouble, a conditional write
# racing another one on the same key (409 ConditionalRequestConflict).
_TRANSIENT_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "RequestTimeout",
        "RequestTimeTooSkewed",
        "InternalError",
        "ServiceUnavailable",
        "ConditionalRequestConflict",
        "OperationAborted",
        "RequestLimitExceeded",
    }
)
_NOT_FOUND_CODES = frozenset({"NoSuchKey", "NotFound", "404"})
_AUTH_CODES = frozenset(
    {
        "AccessDenied",
        "403",
        "Forbidden",
        "SignatureDoesNotMatch",
        "InvalidAccessKeyId",
        "InvalidToken",
        "ExpiredToken",
        "TokenRefreshRequired",
        "AuthorizationHeaderMalformed",
    }
)


def _parse_uri(uri: str) -> tuple[str, str, dict[str, str]]:
    """``(bucket, prefix, options)`` of an ``s3://`` URI; :class:`UsageError` if bad."""
    if not uri.startswith("s3://"):
        raise UsageError(f"not an s3 URI: {uri!r}; use s3://BUCKET/PREFIX?endpoint=URL")
    rest, _, query = uri[len("s3://") :].partition("?")
    bucket, _, prefix = rest.partition("/")
    if not bucket:
        raise UsageError(f"no bucket in {uri!r}; use s3://BUCKET/PREFIX")
    options: dict[str, str] = {}
    for name, value in parse_qsl(query, keep_blank_values=True):
        if name not in _OPTIONS:
            known = ", ".join(_OPTIONS)
            raise UsageError(f"unknown option {name!r} in {uri!r}; known options: {known}")
        options[name] = value
    return bucket, prefix.strip("/"), options


def _client_error_parts(exc: BaseException) -> tuple[str, int, dict[str, str]] | None:
    """``(error code, HTTP status, response headers)`` of a botocore ClientError (an
    error with a service answer), None for any other exception."""
    response = getattr(exc, "response", None)
    if not isinstance(response, dict):
        return None
    code = str(response.get("Error", {}).get("Code", ""))
    meta = response.get("ResponseMetadata", {})
    status = int(meta.get("HTTPStatusCode", 0) or 0)
    headers = {str(k).lower(): str(v) for k, v in (meta.get("HTTPHeaders") or {}).items()}
    return code, status, headers


def _retry_after(headers: dict[str, str]) -> float | None:
    value = headers.get("retry-after")
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        return None  # an HTTP date: rare for S3; fall back to our own backoff


def _precondition_failed(exc: BaseException) -> bool:
    parts = _client_error_parts(exc)
    return parts is not None and (parts[1] == 412 or parts[0] == "PreconditionFailed")


def _invalid_range(exc: BaseException) -> bool:
    parts = _client_error_parts(exc)
    return parts is not None and (parts[1] == 416 or parts[0] == "InvalidRange")


@register
class S3Backend(Backend):
    """An S3 bucket (optionally below a key prefix), URI ``s3://BUCKET/PREFIX?...``.

    Options: ``endpoint`` (URL of an S3-compatible service; path-style addressing is
    then used), ``region`` (default: the AWS configuration's, else ``us-east-1``),
    ``profile`` (a profile of ``~/.aws/config``), ``transfers`` (concurrent requests
    per instance, default 4), ``timeout`` (seconds without an answer before a request
    is retried, default 60), ``logs`` (``creates``, the default: exclusive creates with
    ``If-None-Match: *``; ``registers``: for a service that accepts conditional writes
    without enforcing them, logs of whole-object writes, and no conditional request is
    relied on). Credentials come from the standard AWS chain.

    Thread-safe: one boto3 client (itself thread-safe) with a connection pool is
    shared by all threads; a semaphore bounds concurrent requests to ``transfers``.
    """

    scheme = "s3"
    capabilities = Capabilities(
        conditional_create=True,
        compare_and_swap=True,
        conditional_append=True,
        range_reads=True,
        # Multipart parts of CHUNK_SIZE, at most MAX_PARTS of them.
        max_object_size=MAX_PARTS * CHUNK_SIZE,
        case_sensitive=True,
        long_poll=False,
        # A put killed mid-upload leaves an unfinished multipart upload (billed).
        temp_files=True,
    )

    def __init__(self, uri: str, namespace: str) -> None:
        """Parse the URI and build the client. Sends no request.

        Raises :class:`UsageError` for a malformed URI, an unknown option or an
        invalid namespace.
        """
        # Imported here: boto3 takes a while to import, and most commands of a
        # repository without s3: backends never need it.
        import boto3
        import botocore.exceptions
        from botocore.config import Config

        super().__init__(uri, namespace)
        self.bucket, self.prefix, options = _parse_uri(uri)
        check_namespace(namespace)
        try:
            self.transfers = int(options.get("transfers", DEFAULT_TRANSFERS))
        except ValueError:
            self.transfers = 0
        if self.transfers < 1:
            raise UsageError(f"transfers must be a whole number >= 1 in {uri!r}")
        try:
            self.timeout = float(options.get("timeout", READ_TIMEOUT))
        except ValueError:
            self.timeout = 0.0
        if not self.timeout > 0:
            raise UsageError(f"timeout must be a number of seconds > 0 in {uri!r}")
        # --timeout bounds every wait (connect, TLS handshake, read) and the retries.
        self.timeout = network_timeout(self.timeout)
        #: How logs are kept: ``creates`` (``If-None-Match: *``) or ``registers`` (for a
        #: service that ignores conditional writes; every client uses the same URI).
        self.logs_mode = options.get("logs", "creates")
        if self.logs_mode not in LOGS_MODES:
            raise UsageError(f"logs= must be creates or registers in {uri!r}")
        self.capabilities = logs_mode_capabilities(type(self).capabilities, self.logs_mode)
        self.endpoint: str | None = options.get("endpoint") or None
        #: Every key of the namespace starts with this (ends in "/").
        self.base = f"{self.prefix}/{namespace}/" if self.prefix else f"{namespace}/"
        self.policy = RetryPolicy(budget=self.timeout, silence=silence_of(self.uri))
        self._slots = threading.BoundedSemaphore(self.transfers)
        try:
            session = boto3.session.Session(profile_name=options.get("profile") or None)
        except botocore.exceptions.ProfileNotFound as exc:
            raise UsageError(f"{exc}; check the profile option of {uri!r}") from exc
        region = options.get("region") or session.region_name or "us-east-1"
        config = Config(
            region_name=region,
            connect_timeout=min(CONNECT_TIMEOUT, self.timeout),
            read_timeout=self.timeout,
            # One attempt: ``retrying`` retries, knowing which writes are conditional.
            retries={"mode": "standard", "total_max_attempts": 1},
            # Room for ``transfers`` requests plus streams handed out by ``open``.
            max_pool_connections=self.transfers + 4,
            s3={"addressing_style": "path" if self.endpoint else "auto"},
            # Objects carry their own hashes and MACs; extra checksums only cost CPU
            # and trip up some S3-compatible services.
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        )
        self._client = session.client("s3", endpoint_url=self.endpoint, config=config)

    # --- helpers -------------------------------------------------------------------
    def _location(self) -> str:
        where = f"bucket {self.bucket!r}"
        if self.endpoint:
            where += f" at {self.endpoint}"
        return where

    def _object(self, key: str) -> str:
        return self.base + check_key(key)

    def _translate(self, exc: BaseException, key: str | None, action: str) -> BaseException:
        """The backend-contract error for ``exc`` raised while ``action`` on ``key``."""
        import botocore.exceptions as bexc

        what = describe(action, key, self.name)
        parts = _client_error_parts(exc)
        if parts is not None:
            code, status, headers = parts
            if code == "NoSuchBucket":
                return BackendError(
                    f"cannot {what}: {self._location()} does not exist; create the bucket "
                    "(or fix the URI)"
                )
            if code in _NOT_FOUND_CODES or status == 404:
                return ObjectNotFound(f"no object {key!r} on {self.name}")
            if code in _AUTH_CODES or status in (401, 403):
                return BackendError(
                    f"cannot {what}: access denied ({code or status}); check the AWS "
                    "credentials (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or profile) and "
                    f"their permissions on {self._location()}"
                )
            if code in _FULL_CODES or status == 507:
                return BackendFull.of(self.name, code or f"HTTP {status}")
            if code in _TRANSIENT_CODES or status == 429 or status >= 500:
                return TransientError(
                    f"cannot {what}: the service answered {code or status}",
                    retry_after=_retry_after(headers),
                )
            return BackendError(f"cannot {what}: {code or status}: {one_line(exc)}")
        if isinstance(exc, bexc.NoCredentialsError | bexc.PartialCredentialsError):
            return BackendError(
                f"cannot {what}: no AWS credentials found; set AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY, or use ?profile=NAME"
            )
        if isinstance(exc, bexc.ConnectTimeoutError):
            return NoAnswer(
                f"cannot {what}: no answer from {self.endpoint or 'S3'} within {self.timeout:g}s "
                f"to a connection ({one_line(exc)}); is the endpoint right and the service "
                "running? (or allow longer with --timeout)"
            )
        if isinstance(exc, bexc.EndpointConnectionError):
            # Connection refused, unknown host, no route: the service is not there.
            return BackendUnavailable(
                f"cannot {what}: {self.endpoint or 'S3'} cannot be reached ({one_line(exc)}); "
                "is the endpoint right and the service running?"
            )
        # Failures after the connection was made (reset, closed, timed out, a body
        # cut short): retry.
        if isinstance(
            exc,
            bexc.HTTPClientError
            | bexc.ConnectionError
            | bexc.IncompleteReadError
            | bexc.ResponseStreamingError
            | OSError,
        ):
            if isinstance(exc, bexc.ReadTimeoutError | TimeoutError):
                return NoAnswer(
                    f"cannot {what}: no answer from {self.endpoint or 'S3'} within "
                    f"{self.timeout:g}s (it accepted the connection but did not reply); "
                    "check the service, or allow longer with --timeout"
                )
            return TransientError(f"cannot {what}: connection failed ({one_line(exc)})")
        if isinstance(exc, bexc.BotoCoreError):
            return BackendError(f"cannot {what}: {one_line(exc)}")
        return exc

    def _call(
        self,
        key: str | None,
        action: str,
        fn: Callable[[], T],
        on_retry: Callable[[BaseException], None] | None = None,
    ) -> T:
        """``fn`` with retries of transient failures (``fn`` must be safe to repeat),
        each attempt in a transfer slot with errors translated (:func:`translated`)."""
        return retrying(
            self.policy,
            describe(action, key, self.name),
            lambda: translated(self._slots, fn, lambda exc: self._translate(exc, key, action)),
            on_retry=on_retry,
        )

    def _head(self, key: str) -> dict[str, Any]:
        full = self._object(key)
        return self._call(
            key,
            "stat",
            lambda: cast(dict[str, Any], self._client.head_object(Bucket=self.bucket, Key=full)),
        )

    # --- lifecycle -----------------------------------------------------------------
    def probe(self) -> None:
        """Check that the bucket exists and the credentials may use it. Never writes.

        Raises :class:`BackendUnavailable` if the endpoint cannot be reached and
        :class:`BackendError` for a missing bucket or denied access.
        """

        def head_bucket() -> None:
            try:
                self._client.head_bucket(Bucket=self.bucket)
            except Exception as exc:
                parts = _client_error_parts(exc)
                if parts is not None and (
                    parts[1] == 404 or parts[0] in ("NoSuchBucket", "NotFound", "404")
                ):
                    raise BackendError(
                        f"{self._location()} of {self.name} does not exist; create the bucket "
                        "(or fix the URI)"
                    ) from exc
                raise

        self._call(None, "reach", head_bucket)

    def exists(self) -> bool:
        """True if the namespace's marker object (written by :meth:`create`) or any
        other object exists below ``PREFIX/namespace/``."""
        try:
            self._call(
                None,
                "check",
                lambda: self._client.head_object(
                    Bucket=self.bucket, Key=self.base + NAMESPACE_MARKER
                ),
            )
            return True
        except ObjectNotFound:
            pass
        page = self._call(
            None,
            "list",
            lambda: self._client.list_objects_v2(Bucket=self.bucket, Prefix=self.base, MaxKeys=1),
        )
        return bool(page.get("Contents"))

    def create(self) -> None:
        """Write the namespace marker (idempotent). The bucket must already exist:
        a missing one is a :class:`BackendError` asking to create it."""
        self.probe()
        self._call(
            None,
            "create the namespace on",
            lambda: self._client.put_object(
                Bucket=self.bucket, Key=self.base + NAMESPACE_MARKER, Body=b""
            ),
        )

    def close(self) -> None:
        """Close the client's connection pool."""
        with contextlib.suppress(Exception):
            self._client.close()

    # --- storage -------------------------------------------------------------------
    def put(self, key: str, data: bytes | BinaryIO) -> None:
        """Store ``data`` at ``key``; a PutObject (or completed multipart upload)
        replaces the object atomically for readers.

        A file-like is read in :data:`CHUNK_SIZE` pieces: one piece or less is sent
        as one PutObject, more as a multipart upload of one part at a time (so at
        most one piece is in memory, and each part can be resent on its own).
        """
        full = self._object(key)
        if isinstance(data, bytes | bytearray | memoryview):
            body = bytes(data)
            self._put_bytes(key, full, body)
            return
        first = read_full(data, CHUNK_SIZE)
        if len(first) < CHUNK_SIZE:
            self._put_bytes(key, full, first)
            return
        second = read_full(data, CHUNK_SIZE)
        if not second:
            self._put_bytes(key, full, first)
            return
        self._put_multipart(key, full, first, second, data)

    def _put_bytes(self, key: str, full: str, body: bytes) -> None:
        self._call(
            key, "write", lambda: self._client.put_object(Bucket=self.bucket, Key=full, Body=body)
        )

    def _put_multipart(
        self, key: str, full: str, first: bytes, second: bytes, rest: BinaryIO
    ) -> None:
        created = self._call(
            key,
            "start upload of",
            lambda: self._client.create_multipart_upload(Bucket=self.bucket, Key=full),
        )
        upload_id = str(created["UploadId"])
        parts: builtins.list[dict[str, Any]] = []
        total = 0
        completed = False
        try:
            piece = first
            following: bytes | None = second
            while piece:
                number = len(parts) + 1
                if number > MAX_PARTS:
                    raise BackendError(
                        f"cannot write {key!r} on {self.name}: larger than "
                        f"{MAX_PARTS * CHUNK_SIZE} bytes, the most this backend uploads"
                    )

                def upload(body: bytes = piece, number: int = number) -> Any:
                    return self._client.upload_part(
                        Bucket=self.bucket,
                        Key=full,
                        UploadId=upload_id,
                        PartNumber=number,
                        Body=body,
                    )

                answer = self._call(key, "upload part of", upload)
                parts.append({"PartNumber": number, "ETag": answer["ETag"]})
                total += len(piece)
                piece = following if following is not None else read_full(rest, CHUNK_SIZE)
                following = None
            self._complete(key, full, upload_id, parts, total)
            completed = True
        finally:
            if not completed:
                # Best effort: parts of an abandoned upload cost storage until aborted.
                with contextlib.suppress(Exception):
                    self._client.abort_multipart_upload(
                        Bucket=self.bucket, Key=full, UploadId=upload_id
                    )

    def _complete(
        self, key: str, full: str, upload_id: str, parts: builtins.list[dict[str, Any]], total: int
    ) -> None:
        retried = RetryMark()

        try:
            self._call(
                key,
                "finish upload of",
                lambda: self._client.complete_multipart_upload(
                    Bucket=self.bucket,
                    Key=full,
                    UploadId=upload_id,
                    MultipartUpload={"Parts": parts},
                ),
                on_retry=retried,
            )
        except ObjectNotFound:
            # NoSuchUpload: if an earlier attempt completed the upload before its
            # answer was lost, the object is there with our size.
            if not retried.marked or self.size(key) != total:
                raise BackendError(
                    f"cannot write {key!r} on {self.name}: the multipart upload vanished"
                ) from None

    def _conditional_put(self, key: str, data: bytes, action: str, **condition: str) -> bool:
        """PutObject with an If-* ``condition``; False on 412 (nothing written).

        If a retry follows a failure whose request may have taken effect, a 412 may
        be our own earlier write: then the stored bytes tell.
        """
        full = self._object(key)
        retried = RetryMark()

        def attempt() -> bool:
            try:
                self._client.put_object(Bucket=self.bucket, Key=full, Body=data, **condition)
            except Exception as exc:
                if _precondition_failed(exc):
                    return False
                raise
            return True

        try:
            if self._call(key, action, attempt, on_retry=retried):
                return True
        except ObjectNotFound:
            return False  # If-Match on a missing key: some services answer 404
        if not retried.marked:
            return False
        try:
            return self.get(key) == data
        except ObjectNotFound:
            return False

    def put_if_absent(self, key: str, data: bytes) -> bool:
        """PutObject with ``If-None-Match: *``: atomic on the service; False if ``key``
        existed (412 Precondition Failed)."""
        return self._conditional_put(key, data, "create", IfNoneMatch="*")

    def replace_if(self, key: str, data: bytes, token: str) -> bool:
        """PutObject with ``If-Match: <token>`` (the ETag :meth:`poll` returned):
        False if the object changed or is gone."""
        return self._conditional_put(key, data, "replace", IfMatch=token)

    def get(self, key: str) -> bytes:
        """The whole object (read in one request, retried whole on failure)."""
        full = self._object(key)

        def read() -> bytes:
            answer = self._client.get_object(Bucket=self.bucket, Key=full)
            with contextlib.closing(answer["Body"]) as body:
                return cast(bytes, body.read())

        return self._call(key, "read", read)

    def open(self, key: str) -> BinaryIO:
        """A buffered stream of the object; a connection lost while reading is resumed
        with a ranged GET of the same version (``If-Match`` on its ETag)."""
        full = self._object(key)
        answer = self._call(
            key,
            "read",
            lambda: cast(dict[str, Any], self._client.get_object(Bucket=self.bucket, Key=full)),
        )
        raw = _ObjectReader(self, key, full, answer)
        return cast(BinaryIO, io.BufferedReader(raw, buffer_size=1 << 20))

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        """``length`` bytes at ``offset`` with a ranged GET. :class:`BackendError` if
        the object is shorter than ``offset + length`` (a truncated copy)."""
        if offset < 0 or length < 0:
            raise ValueError(f"get_range needs offset >= 0 and length >= 0, got {offset}, {length}")
        full = self._object(key)
        if length == 0:
            size = self.size(key)
            if size < offset:
                raise self.truncated_error(key, offset, size)
            return b""

        def read() -> tuple[bytes, int | None]:
            try:
                answer = self._client.get_object(
                    Bucket=self.bucket, Key=full, Range=f"bytes={offset}-{offset + length - 1}"
                )
            except Exception as exc:
                if _invalid_range(exc):
                    return b"", None
                raise
            with contextlib.closing(answer["Body"]) as body:
                data = cast(bytes, body.read())
            # Content-Range "bytes a-b/size" names the object's size.
            total = str(answer.get("ContentRange", "")).rpartition("/")[2]
            return data, int(total) if total.isdigit() else None

        data, total = self._call(key, "read", read)
        if len(data) != length:
            raise self.truncated_error(key, offset + length, total)
        return data

    def size(self, key: str) -> int:
        """Size in bytes (HEAD)."""
        return int(self._head(key)["ContentLength"])

    def delete(self, key: str) -> None:
        """Remove ``key``; S3 deletes are idempotent, so a HEAD first tells a missing
        key (:class:`ObjectNotFound`)."""
        full = self._object(key)
        self._head(key)
        self._call(key, "delete", lambda: self._client.delete_object(Bucket=self.bucket, Key=full))

    def _temp_files(self) -> Iterator[TempFile]:
        """Every unfinished multipart upload under the namespace, as
        ``<key>#<upload id>``: its parts' total size, and when its last part was
        written (when it started, without parts). Invisible to listings, they cost
        storage until aborted."""
        found: builtins.list[TempFile] = []
        marker: dict[str, Any] = {}
        while True:
            kwargs = {"Bucket": self.bucket, "Prefix": self.base, **marker}
            page: dict[str, Any] = self._call(
                None, "list unfinished uploads",
                lambda k=kwargs: cast(dict[str, Any], self._client.list_multipart_uploads(**k)))  # type: ignore[misc]
            for upload in page.get("Uploads") or []:
                full, upload_id = str(upload["Key"]), str(upload["UploadId"])
                try:
                    size, written = self._parts(full, upload_id, upload["Initiated"].timestamp())
                except ObjectNotFound:
                    continue  # finished or aborted since the listing
                found.append(TempFile(f"{full[len(self.base):]}#{upload_id}", size, written))
            if not page.get("IsTruncated"):
                return iter(found)
            marker = {"KeyMarker": page.get("NextKeyMarker", ""),
                      "UploadIdMarker": page.get("NextUploadIdMarker", "")}

    def _parts(self, full: str, upload_id: str, initiated: float) -> tuple[int, float]:
        """The total size of an unfinished upload's parts and when the last was
        written (``initiated`` without parts), over every page of its parts."""
        size, written = 0, initiated
        marker: dict[str, Any] = {}
        while True:
            kwargs = {"Bucket": self.bucket, "Key": full, "UploadId": upload_id, **marker}
            page: dict[str, Any] = self._call(
                None, "list parts",
                lambda k=kwargs: cast(dict[str, Any], self._client.list_parts(**k)))  # type: ignore[misc]
            for part in page.get("Parts") or []:
                size += int(part.get("Size", 0))
                written = max(written, part["LastModified"].timestamp())
            if not page.get("IsTruncated"):
                return size, written
            marker = {"PartNumberMarker": page.get("NextPartNumberMarker", 0)}

    def _remove_temp(self, path: str) -> bool:
        key, _, upload_id = path.rpartition("#")
        full = self.base + key
        try:
            self._call(key, "abort unfinished upload of", lambda: self._client.abort_multipart_upload(
                Bucket=self.bucket, Key=full, UploadId=upload_id))
        except ObjectNotFound:
            return False  # NoSuchUpload: finished or aborted meanwhile
        return True

    def list(self, prefix: str = "") -> Iterator[str]:
        """Every key below the folder ``prefix``, one ListObjectsV2 page at a time
        (each page retried on its own). Names that are not valid keys (the namespace
        marker, objects written by other tools) are skipped."""
        return (key for key, _ in self.list_sizes(prefix))

    def list_sizes(self, prefix: str = "") -> Iterator[tuple[str, int]]:
        check_prefix(prefix)
        folder = prefix.rstrip("/")
        return self._list(self.base + (folder + "/" if folder else ""))

    def _list(self, full_prefix: str) -> Iterator[tuple[str, int]]:
        token: str | None = None
        while True:
            kwargs: dict[str, Any] = {"Bucket": self.bucket, "Prefix": full_prefix}
            if token is not None:
                kwargs["ContinuationToken"] = token
            page: dict[str, Any] = self._call(None, "list", self._lister(kwargs))
            for item in page.get("Contents") or []:
                key = str(item["Key"])[len(self.base) :]
                try:
                    check_key(key)
                except InvalidKey:
                    continue
                yield key, int(item.get("Size", 0))
            token = page.get("NextContinuationToken")
            if not page.get("IsTruncated") or not token:
                return

    def _lister(self, kwargs: dict[str, Any]) -> Callable[[], dict[str, Any]]:
        return lambda: cast(dict[str, Any], self._client.list_objects_v2(**kwargs))

    def poll(self, key: str) -> str | None:
        """The object's ETag (quoted, as ``If-Match`` wants it), or None if missing.

        The ETag changes whenever the content does; rewriting identical bytes keeps
        it, which is fine for a client deciding whether to re-read."""
        try:
            return str(self._head(key)["ETag"])
        except ObjectNotFound:
            return None


class _ObjectReader(ObjectReader):
    """The body of one GET, resumed at the current position if the connection fails.

    A resumed GET asks for the same version (``If-Match`` on the first answer's
    ETag), so a stream never mixes two versions of an overwritten object.
    """

    _backend: S3Backend

    def __init__(self, backend: S3Backend, key: str, full: str, answer: dict[str, Any]) -> None:
        super().__init__(backend, key, int(answer.get("ContentLength", 0)))
        self._full = full
        self._etag = str(answer.get("ETag", ""))
        self._body: Any = answer["Body"]

    def _next_piece(self, wanted: int) -> bytes:
        return self._backend._call(self._key, "read", lambda: self._read(wanted))

    def _read(self, want: int) -> bytes:
        if self._body is None:
            try:
                answer = self._backend._client.get_object(
                    Bucket=self._backend.bucket,
                    Key=self._full,
                    Range=f"bytes={self._pos}-",
                    IfMatch=self._etag,
                )
            except Exception as exc:
                if _precondition_failed(exc):
                    raise BackendError(
                        f"object {self._key!r} on {self._backend.name} was replaced while "
                        "being read; read it again"
                    ) from exc
                raise
            self._body = answer["Body"]
        try:
            data = cast(bytes, self._body.read(want))
        except BaseException:
            self._drop_body()
            raise
        if not data:
            # The connection ended early: resume from here on the next attempt.
            self._drop_body()
            raise self._ended_early()
        return data

    def _drop_body(self) -> None:
        body, self._body = self._body, None
        if body is not None:
            with contextlib.suppress(Exception):
                body.close()

    def close(self) -> None:
        self._drop_body()
        super().close()

