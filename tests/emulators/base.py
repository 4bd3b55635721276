"""Shared parts of the cloud-provider REST emulators (tests/emulators/<provider>.py).

The providers cannot be reached from the test machines, so each backend is tested
through its official SDK against an emulator of the part of the provider's REST API
it uses. This module gives every emulator the same plumbing:

:class:`EmulatorServer`
    A threaded HTTP/1.1 (keep-alive) server on ``127.0.0.1`` at a free port, over
    TLS by default (SDKs that insist on ``https://`` then run unchanged; the CA is
    :func:`emulator_ca`, a throwaway CA made once per process). ``base_url``, ``ca_file``,
    ``close()``. One thread per connection.
:class:`Emulator`
    The application: subclasses declare handlers with ``@route(METHOD, REGEX)``
    (matched against the whole path), get a :class:`Request` (headers, query, JSON
    or form body, or the body streamed to a file) and return a :class:`Response`
    (bytes, JSON, or a byte range of a file, streamed). Every request first passes
    the :class:`FaultInjector` (``emulator.faults``); a fault is rendered by the
    provider's :meth:`Emulator.render_fault` in the provider's own error format.
:class:`OAuth2Server`
    Authorization codes (auto-approved, PKCE S256 checked), access tokens with a
    lifetime, refresh tokens (optionally rotating, as Box and Microsoft do),
    revocation and forced expiry; ``check(token)`` for the resource routes.
:class:`BlobStore`
    File contents on disk under a temp folder, written from a streamed request
    body, so the 100 MB conformance object never sits in memory.
:class:`EmulatorFaults`
    A ``FaultProxy`` look-alike for the conformance suite's ``faulty_location``:
    ``break_connections(reset_next=n)`` resets the open TCP connections (through a
    real FaultProxy in front of the emulator) *and* queues HTTP faults (429 with and
    without Retry-After, 503, 500, provider-specific throttling); ``injected``
    counts both.

Handlers run on many threads at once: emulators keep their state under one lock.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import ipaddress
import json
import random
import re
import secrets
import shutil
import socket
import ssl
import tempfile
import threading
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, BinaryIO, TypeVar
from urllib.parse import parse_qsl, urlsplit

from tests.servers.faultproxy import FaultProxy

#: Largest non-streamed request body an emulator accepts (a JSON argument).
MAX_SMALL_BODY = 160 << 20
COPY_CHUNK = 1 << 20


# --- TLS -------------------------------------------------------------------------------

_ca_lock = threading.Lock()
_ca: tuple[str, str, str] | None = None


def emulator_ca() -> tuple[str, str, str]:
    """``(ca_file, cert_file, key_file)``: a throwaway CA and a server certificate for
    ``127.0.0.1`` and ``localhost`` it signed, made once per process."""
    global _ca
    with _ca_lock:
        if _ca is not None:
            return _ca
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID

        folder = Path(tempfile.mkdtemp(prefix="metasync-test-ca-"))
        now = datetime.datetime.now(datetime.UTC)
        ca_key = ec.generate_private_key(ec.SECP256R1())
        ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "metasync test CA")])
        ca_cert = (
            x509.CertificateBuilder()
            .subject_name(ca_name)
            .issuer_name(ca_name)
            .public_key(ca_key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=30))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True, key_cert_sign=True, crl_sign=True,
                    content_commitment=False, key_encipherment=False, data_encipherment=False,
                    key_agreement=False, encipher_only=False, decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(
                x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False
            )
            .sign(ca_key, hashes.SHA256())
        )
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")]))
            .issuer_name(ca_name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=30))
            .add_extension(
                x509.SubjectAlternativeName(
                    [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
                ),
                critical=False,
            )
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False
            )
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
                critical=False,
            )
            .sign(ca_key, hashes.SHA256())
        )
        ca_file, cert_file, key_file = (folder / n for n in ("ca.pem", "cert.pem", "key.pem"))
        ca_file.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
        cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        key_file.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
        _ca = (str(ca_file), str(cert_file), str(key_file))
        return _ca


# --- requests and responses ---------------------------------------------------------------


class Request:
    """One HTTP request as a handler sees it."""

    def __init__(self, handler: BaseHTTPRequestHandler, match: re.Match[str] | None) -> None:
        self._handler = handler
        self.method = handler.command
        split = urlsplit(handler.path)
        self.path = split.path
        self.query: dict[str, str] = dict(parse_qsl(split.query, keep_blank_values=True))
        self.headers = handler.headers
        #: Named groups of the route's regex.
        self.params: dict[str, str] = match.groupdict() if match else {}
        self._consumed = False

    def header(self, name: str, default: str | None = None) -> str | None:
        value = self.headers.get(name)
        return default if value is None else str(value)

    def bearer(self) -> str | None:
        value = self.header("Authorization", "") or ""
        return value[7:].strip() if value.lower().startswith("bearer ") else None

    def chunks(self) -> Iterator[bytes]:
        """The body, in pieces (Content-Length or chunked transfer encoding)."""
        if self._consumed:
            return
        self._consumed = True
        rfile = self._handler.rfile
        if (self.header("Transfer-Encoding") or "").lower() == "chunked":
            while True:
                size_line = rfile.readline(65537).split(b";", 1)[0].strip()
                size = int(size_line or b"0", 16)
                if size == 0:
                    while rfile.readline(65537) not in (b"\r\n", b"\n", b""):
                        pass
                    return
                left = size
                while left:
                    piece = rfile.read(min(left, COPY_CHUNK))
                    if not piece:
                        raise ConnectionError("body ended early")
                    left -= len(piece)
                    yield piece
                rfile.readline(3)
        length = int(self.header("Content-Length", "0") or 0)
        while length > 0:
            piece = rfile.read(min(length, COPY_CHUNK))
            if not piece:
                raise ConnectionError("body ended early")
            length -= len(piece)
            yield piece

    def body(self) -> bytes:
        """The whole body (for small bodies: JSON, forms, small uploads)."""
        data = bytearray()
        for piece in self.chunks():
            data += piece
            if len(data) > MAX_SMALL_BODY:
                raise ValueError("request body too large for body(); stream it")
        return bytes(data)

    def json(self) -> Any:
        raw = self.body()
        return json.loads(raw) if raw else None

    def form(self) -> dict[str, str]:
        return dict(parse_qsl(self.body().decode(), keep_blank_values=True))

    def drain(self) -> None:
        """Read and drop any unread body (so the connection can be reused)."""
        for _ in self.chunks():
            pass


@dataclass
class Response:
    """What a handler returns: status, headers and a body (bytes, or a file range)."""

    status: int
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""
    #: Stream this file's bytes [start, end) instead of ``body``.
    file: Path | None = None
    start: int = 0
    end: int = 0
    #: An already open file object (kept by the handler across a replace of the path).
    handle: BinaryIO | None = None


def json_response(status: int, obj: Any, headers: dict[str, str] | None = None) -> Response:
    body = json.dumps(obj).encode()
    return Response(status, {"Content-Type": "application/json", **(headers or {})}, body)


def text_response(status: int, text: str, headers: dict[str, str] | None = None) -> Response:
    return Response(status, {"Content-Type": "text/plain; charset=utf-8", **(headers or {})},
                    text.encode())


# --- routing -------------------------------------------------------------------------------

Handler = Callable[[Any, Request], Response]


def route(method: str, pattern: str) -> Callable[[Handler], Handler]:
    """Declare an emulator method as the handler of ``METHOD`` on paths matching
    ``pattern`` (a regex matched against the whole path)."""

    def mark(fn: Handler) -> Handler:
        routes: list[tuple[str, str]] = getattr(fn, "_routes", [])
        routes.append((method, pattern))
        fn._routes = routes  # type: ignore[attr-defined]
        return fn

    return mark


# --- faults --------------------------------------------------------------------------------

#: Generic fault kinds every emulator renders (providers add their own names).
THROTTLE = "429"  # 429 with a Retry-After
THROTTLE_NO_RETRY_AFTER = "429-no-retry-after"
UNAVAILABLE = "503"  # 503 with a Retry-After
SERVER_ERROR = "500"
RESET = "reset"  # close the connection without answering (nothing done)
LOST_ANSWER = "lost-answer"  # do the request, then close the connection unanswered
QUOTA = "quota"  # the account is out of space: each provider's own answer for it
GENERIC_FAULTS = (THROTTLE, THROTTLE_NO_RETRY_AFTER, UNAVAILABLE, SERVER_ERROR)


class FaultInjector:
    """Decides, per request, whether to answer with a fault instead.

    On demand: :meth:`inject` queues faults for the next matching requests. On a
    schedule: :meth:`schedule` makes a seeded random fraction of requests fail (the
    same seed and request order give the same faults). ``retry_after`` is the
    Retry-After (seconds) faults carry. ``injected`` counts faults answered;
    ``log`` keeps ``(fault, method, path)`` of each.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queue: deque[str] = deque()
        self._rate = 0.0
        self._kinds: tuple[str, ...] = GENERIC_FAULTS
        self._rng = random.Random(0)
        self._only: re.Pattern[str] | None = None
        self.retry_after = 0
        self.injected = 0
        self.log: list[tuple[str, str, str]] = []

    def inject(self, *faults: str, only: str | None = None) -> None:
        """Answer the next ``len(faults)`` requests (on paths matching ``only``, a
        regex, if given) with these faults, in order."""
        with self._lock:
            self._queue.extend(faults)
            self._only = re.compile(only) if only else None

    def schedule(self, rate: float, seed: int, kinds: tuple[str, ...] = GENERIC_FAULTS) -> None:
        """From now on fail a ``rate`` fraction of requests with one of ``kinds``."""
        with self._lock:
            self._rate = rate
            self._kinds = kinds
            self._rng = random.Random(seed)

    def clear(self) -> None:
        with self._lock:
            self._queue.clear()
            self._rate = 0.0

    def pending(self) -> int:
        with self._lock:
            return len(self._queue)

    def take(self, method: str, path: str) -> str | None:
        with self._lock:
            fault: str | None = None
            if self._queue and (self._only is None or self._only.search(path)):
                fault = self._queue.popleft()
            elif self._rate and self._rng.random() < self._rate:
                fault = self._rng.choice(self._kinds)
            if fault is not None:
                self.injected += 1
                self.log.append((fault, method, path))
            return fault


# --- OAuth 2 -------------------------------------------------------------------------------


class OAuthError(Exception):
    """An OAuth error answer: ``error`` code and HTTP status."""

    def __init__(self, error: str, status: int = 400, description: str = "") -> None:
        super().__init__(error)
        self.error = error
        self.status = status
        self.description = description


@dataclass
class _Token:
    account: str
    client_id: str
    expires_at: float
    #: The refresh token whose grant this access token belongs to.
    grant: str = ""


class OAuth2Server:
    """The authorization server part of an emulator (RFC 6749 + PKCE, RFC 7636).

    ``clients`` maps client ids to their secret (None: a public client that must use
    PKCE). Every authorization is approved at once for ``account``. Access tokens last
    ``access_lifetime`` seconds; ``rotate_refresh_tokens`` replaces the refresh token
    on every refresh (the old one then fails with ``invalid_grant``).
    """

    def __init__(
        self,
        clients: dict[str, str | None],
        account: str = "dbid:emulated-user",
        *,
        access_lifetime: float = 14400.0,
        rotate_refresh_tokens: bool = False,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.clients = dict(clients)
        self.account = account
        self.access_lifetime = access_lifetime
        self.rotate_refresh_tokens = rotate_refresh_tokens
        self.clock = clock
        self._lock = threading.Lock()
        self._codes: dict[str, tuple[str, str | None, str | None, str | None]] = {}
        self._access: dict[str, _Token] = {}
        self._refresh: dict[str, tuple[str, str]] = {}
        #: Counters for tests.
        self.refreshes = 0
        self.codes_issued = 0

    def approve(self, params: dict[str, str]) -> str:
        """The user approves an authorization request: return the code."""
        client_id = params.get("client_id", "")
        if client_id not in self.clients:
            raise OAuthError("invalid_client", 400, f"unknown client {client_id!r}")
        if params.get("response_type") != "code":
            raise OAuthError("unsupported_response_type")
        challenge = params.get("code_challenge")
        if challenge and params.get("code_challenge_method", "plain") != "S256":
            raise OAuthError("invalid_request", 400, "only S256 challenges")
        if not challenge and self.clients[client_id] is None:
            raise OAuthError("invalid_request", 400, "public clients must use PKCE")
        code = secrets.token_urlsafe(24)
        with self._lock:
            self._codes[code] = (client_id, challenge, params.get("redirect_uri"),
                                 params.get("scope"))
            self.codes_issued += 1
        return code

    def _check_client(self, form: dict[str, str], client_id: str, pkce: bool) -> None:
        secret = self.clients.get(client_id, "\0missing")
        if secret == "\0missing":
            raise OAuthError("invalid_client", 401)
        if secret is not None and not pkce and form.get("client_secret") != secret:
            raise OAuthError("invalid_client", 401, "bad client secret")

    def _issue(self, account: str, client_id: str, grant: str) -> dict[str, Any]:
        access = "sl." + secrets.token_urlsafe(32)
        self._access[access] = _Token(
            account, client_id, self.clock() + self.access_lifetime, grant
        )
        return {
            "access_token": access,
            "token_type": "bearer",
            "expires_in": int(self.access_lifetime),
        }

    def token(self, form: dict[str, str]) -> dict[str, Any]:
        """The token endpoint: exchange a code, or refresh. Raises OAuthError."""
        grant_type = form.get("grant_type")
        with self._lock:
            if grant_type == "authorization_code":
                entry = self._codes.pop(form.get("code", ""), None)
                if entry is None:
                    raise OAuthError("invalid_grant", 400, "code doesn't exist or has expired")
                client_id, challenge, redirect_uri, scope = entry
                if form.get("client_id") != client_id:
                    raise OAuthError("invalid_grant", 400, "code was issued to another client")
                if challenge is not None:
                    verifier = form.get("code_verifier", "")
                    if pkce_challenge(verifier) != challenge:
                        raise OAuthError("invalid_grant", 400, "invalid code verifier")
                self._check_client(form, client_id, pkce=challenge is not None)
                if redirect_uri is not None and form.get("redirect_uri") != redirect_uri:
                    raise OAuthError("invalid_grant", 400, "redirect_uri mismatch")
                refresh = secrets.token_urlsafe(32)
                answer = self._issue(self.account, client_id, refresh)
                self._refresh[refresh] = (self.account, client_id)
                answer["refresh_token"] = refresh
                if scope:
                    answer["scope"] = scope
                return answer
            if grant_type == "refresh_token":
                refresh = form.get("refresh_token", "")
                owner = self._refresh.get(refresh)
                if owner is None:
                    raise OAuthError("invalid_grant", 400, "refresh token is invalid or revoked")
                account, client_id = owner
                if form.get("client_id") != client_id:
                    raise OAuthError("invalid_client", 401)
                self._check_client(form, client_id, pkce=self.clients[client_id] is None)
                if self.rotate_refresh_tokens:
                    del self._refresh[refresh]
                    new = secrets.token_urlsafe(32)
                    self._refresh[new] = owner
                    for entry in self._access.values():
                        if entry.grant == refresh:
                            entry.grant = new
                    answer = self._issue(account, client_id, new)
                    answer["refresh_token"] = new
                else:
                    answer = self._issue(account, client_id, refresh)
                self.refreshes += 1
                return answer
        raise OAuthError("unsupported_grant_type")

    def check(self, token: str | None) -> tuple[str | None, str]:
        """``(account, "")`` for a valid access token, else ``(None, reason)`` with
        reason ``"missing"``, ``"invalid"`` or ``"expired"``."""
        if not token:
            return None, "missing"
        with self._lock:
            entry = self._access.get(token)
            if entry is None:
                return None, "invalid"
            if entry.expires_at <= self.clock():
                return None, "expired"
            return entry.account, ""

    def revoke(self, token: str) -> None:
        """Revoke an access token, or a refresh token and every access token it made."""
        with self._lock:
            self._access.pop(token, None)
            if self._refresh.pop(token, None) is not None:
                for access in [t for t, e in self._access.items() if e.grant == token]:
                    del self._access[access]

    def revoke_all(self) -> None:
        """Revoke every grant (the user removed the app)."""
        with self._lock:
            self._access.clear()
            self._refresh.clear()

    def expire_access_tokens(self) -> None:
        """Make every access token expired now (refresh tokens stay valid)."""
        with self._lock:
            for entry in self._access.values():
                entry.expires_at = 0.0


# --- blobs ---------------------------------------------------------------------------------


class BlobStore:
    """Immutable file contents on disk, one file per blob id."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)

    def path(self, blob_id: str) -> Path:
        return self.folder / blob_id

    def write(
        self, chunks: Iterator[bytes] | list[bytes], hashers: tuple[Any, ...] = ()
    ) -> tuple[str, int]:
        """Store the concatenated ``chunks`` as a new blob; ``(blob id, size)``.
        Each hasher in ``hashers`` is fed the bytes."""
        blob_id = secrets.token_hex(12)
        size = 0
        with open(self.path(blob_id), "wb") as fh:
            for piece in chunks:
                fh.write(piece)
                size += len(piece)
                for hasher in hashers:
                    hasher.update(piece)
        return blob_id, size

    def append(self, blob_id: str, chunks: Iterator[bytes], hashers: tuple[Any, ...] = ()) -> int:
        """Append to an existing blob (an upload session); return bytes added."""
        added = 0
        with open(self.path(blob_id), "ab") as fh:
            for piece in chunks:
                fh.write(piece)
                added += len(piece)
                for hasher in hashers:
                    hasher.update(piece)
        return added

    def open(self, blob_id: str) -> BinaryIO:
        return open(self.path(blob_id), "rb")

    def delete(self, blob_id: str) -> None:
        # An open download keeps reading the unlinked file (POSIX).
        with contextlib.suppress(FileNotFoundError):
            self.path(blob_id).unlink()

    def close(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


# --- the application -------------------------------------------------------------------------


class Emulator:
    """Base of a provider emulator: routing, fault injection, request counting."""

    #: Provider name, for messages.
    name = "emulator"

    def __init__(self) -> None:
        self.faults = FaultInjector()
        self.requests = 0
        self._count_lock = threading.Lock()
        self._routes: list[tuple[str, re.Pattern[str], Callable[[Request], Response]]] = []
        for attr in dir(type(self)):
            fn = getattr(type(self), attr, None)
            for method, pattern in getattr(fn, "_routes", ()):
                self._routes.append((method, re.compile(pattern), getattr(self, attr)))
        #: Set by EmulatorServer: where the emulator is reached.
        self.base_url = ""

    def render_fault(self, fault: str, request: Request) -> Response | None:
        """The provider's answer for ``fault`` (None: reset the connection)."""
        retry = str(self.faults.retry_after)
        if fault == THROTTLE:
            return text_response(429, "Too Many Requests", {"Retry-After": retry})
        if fault == THROTTLE_NO_RETRY_AFTER:
            return text_response(429, "Too Many Requests")
        if fault == UNAVAILABLE:
            return text_response(503, "Service Unavailable", {"Retry-After": retry})
        if fault == SERVER_ERROR:
            return text_response(500, "Internal Server Error")
        return None

    def not_found(self, request: Request) -> Response:
        return text_response(404, f"no route for {request.method} {request.path}")

    def dispatch(self, handler: BaseHTTPRequestHandler) -> Response | None:
        with self._count_lock:
            self.requests += 1
        path = urlsplit(handler.path).path
        for method, pattern, fn in self._routes:
            match = pattern.fullmatch(path)
            if match and method == handler.command:
                request = Request(handler, match)
                fault = self.faults.take(handler.command, path)
                if fault == LOST_ANSWER:
                    try:
                        fn(request)  # it takes effect; the client never hears of it
                    finally:
                        request.drain()
                    return None
                if fault is not None:
                    request.drain()
                    return self.render_fault(fault, request)
                try:
                    return fn(request)
                finally:
                    request.drain()
        request = Request(handler, None)
        request.drain()
        return self.not_found(request)

    def close(self) -> None:
        """Release the emulator's storage."""


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:
        pass  # quiet: tests print failures themselves

    def _serve(self) -> None:
        try:
            response = self.server.emulator.dispatch(self)
        except (ConnectionError, ssl.SSLError, TimeoutError):
            self.close_connection = True
            return
        if response is None:  # RESET or LOST_ANSWER: drop the connection unanswered
            self.close_connection = True
            with contextlib.suppress(OSError):
                self.connection.setsockopt(
                    socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00"
                )
            return
        self._write(response)

    def _write(self, response: Response) -> None:
        handle = response.handle
        if handle is None and response.file is not None:
            handle = open(response.file, "rb")  # noqa: SIM115 - closed in finally
        try:
            length = response.end - response.start if handle is not None else len(response.body)
            self.send_response(response.status)
            for name, value in response.headers.items():
                self.send_header(name, value)
            self.send_header("Content-Length", str(length))
            self.end_headers()
            if self.command == "HEAD":
                return
            if handle is None:
                self.wfile.write(response.body)
                return
            handle.seek(response.start)
            left = length
            while left > 0:
                piece = handle.read(min(left, COPY_CHUNK))
                if not piece:
                    raise ConnectionError("blob shorter than its metadata")
                self.wfile.write(piece)
                left -= len(piece)
        except (ConnectionError, ssl.SSLError, TimeoutError, OSError):
            self.close_connection = True
        finally:
            if handle is not None:
                handle.close()

    do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = do_HEAD = do_OPTIONS = _serve


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128

    def __init__(self, emulator: Emulator, context: ssl.SSLContext | None) -> None:
        self.emulator = emulator
        self.context = context
        self._connections: set[socket.socket] = set()
        self._conn_lock = threading.Lock()
        super().__init__(("127.0.0.1", 0), _Handler)

    def finish_request(self, request: Any, client_address: Any) -> None:
        # The TLS handshake runs here, on the connection's own thread, so a slow or
        # broken client never blocks accept().
        with self._conn_lock:
            self._connections.add(request)
        # Headers and body go out in separate writes: without TCP_NODELAY the body
        # waits for the client's delayed ACK (~40 ms per response).
        with contextlib.suppress(OSError):
            request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            if self.context is not None:
                try:
                    request.settimeout(30)
                    request = self.context.wrap_socket(request, server_side=True)
                    request.settimeout(None)
                except (ssl.SSLError, OSError):
                    return
            super().finish_request(request, client_address)
        except (ConnectionError, ssl.SSLError, OSError):
            pass

    def shutdown_request(self, request: Any) -> None:
        with self._conn_lock:
            self._connections.discard(request)
        super().shutdown_request(request)

    def close_all(self) -> None:
        with self._conn_lock:
            victims = list(self._connections)
        for sock in victims:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)


class EmulatorServer:
    """Serve ``emulator`` on ``127.0.0.1`` at a free port (TLS unless ``tls=False``)."""

    def __init__(self, emulator: Emulator, *, tls: bool = True) -> None:
        self.emulator = emulator
        context = None
        self.ca_file: str | None = None
        if tls:
            ca_file, cert_file, key_file = emulator_ca()
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(cert_file, key_file)
            self.ca_file = ca_file
        self._server = _Server(emulator, context)
        self.host = "127.0.0.1"
        self.port: int = self._server.server_address[1]
        self.scheme = "https" if tls else "http"
        emulator.base_url = self.base_url
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.1},
            name=f"{emulator.name}-emulator", daemon=True,
        )
        self._thread.start()

    @property
    def base_url(self) -> str:
        return f"{self.scheme}://{self.host}:{self.port}"

    def url_via(self, port: int) -> str:
        """The base URL through another local port (a FaultProxy in front)."""
        return f"{self.scheme}://{self.host}:{port}"

    def close(self) -> None:
        self._server.shutdown()
        self._server.close_all()
        self._server.server_close()
        self.emulator.close()


@contextlib.contextmanager
def serve(emulator: Emulator, *, tls: bool = True) -> Iterator[EmulatorServer]:
    """Run ``emulator`` until the block exits."""
    server = EmulatorServer(emulator, tls=tls)
    try:
        yield server
    finally:
        server.close()


class EmulatorFaults:
    """A FaultProxy look-alike for the conformance suite's ``faulty_location``: TCP
    resets through a real :class:`FaultProxy` plus HTTP faults from the emulator.

    ``break_connections(reset_next=n)`` resets every open connection, resets the next
    ``n // 2`` new connections as they open, and answers the next ``n - n // 2``
    requests with faults taken in turn from ``http_faults`` (the provider's throttling
    and server errors). ``injected`` counts resets and HTTP faults.
    """

    def __init__(self, server: EmulatorServer, http_faults: tuple[str, ...]) -> None:
        self.proxy = FaultProxy(server.host, server.port)
        self.port = self.proxy.port
        self.base_url = server.url_via(self.proxy.port)
        self._emulator = server.emulator
        self._http_faults = http_faults
        self._next = 0
        self._base_injected = server.emulator.faults.injected

    @property
    def injected(self) -> int:
        return self.proxy.injected + (self._emulator.faults.injected - self._base_injected)

    def break_connections(self, *, reset_next: int = 0) -> None:
        self.proxy.break_connections(reset_next=reset_next // 2)
        faults = []
        for _ in range(reset_next - reset_next // 2):
            faults.append(self._http_faults[self._next % len(self._http_faults)])
            self._next += 1
        self._emulator.faults.clear()
        if faults:
            self._emulator.faults.inject(*faults)

    def close(self) -> None:
        self._emulator.faults.clear()
        self.proxy.close()


def pkce_challenge(verifier: str) -> str:
    """The S256 PKCE code challenge of ``verifier`` (RFC 7636 §4.2)."""
    import base64

    digest = hashlib.sha256(verifier.encode()).digest()
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


def parse_range(spec: str, size: int) -> tuple[int, int] | None:
    """``[start, end)`` of a single ``bytes=a-b`` / ``bytes=a-`` / ``bytes=-n`` range of
    an object of ``size`` bytes; None if ``spec`` is not one such range or is outside
    the object (the services then answer the whole object or 416)."""
    unit, _, value = spec.partition("=")
    if unit.strip() != "bytes" or "," in value:
        return None
    first, _, last = value.strip().partition("-")
    try:
        if first == "":
            n = int(last)
            return (max(0, size - n), size) if n > 0 and size > 0 else None
        start = int(first)
        end = min(size, int(last) + 1) if last else size
    except ValueError:
        return None
    if start >= size or end <= start:
        return None
    return start, end


# --- running a provider's emulator for tests ----------------------------------------------

E = TypeVar("E", bound=Emulator)
S = TypeVar("S", bound="EmulatorService")


@dataclass
class EmulatorService(ABC):
    """A running emulator plus what clients need to reach it. Each provider's
    subclass narrows ``emulator`` and says how to aim clients at it (:meth:`env`), how
    to sign an account in (:meth:`sign_in`) and which HTTP faults its
    :meth:`faults_via_proxy` injects."""

    server: EmulatorServer
    emulator: Emulator

    @property
    def base_url(self) -> str:
        return self.server.base_url

    @property
    def ca_file(self) -> str:
        assert self.server.ca_file is not None
        return self.server.ca_file

    @abstractmethod
    def env(self) -> dict[str, str]:
        """Environment aiming `metasync` (and the backend) at this emulator."""

    @abstractmethod
    def sign_in(self, account: str = "default") -> None:
        """Keep a grant for ``account`` in the test token store (as `metasync auth`
        would after the user approved)."""


@contextlib.contextmanager
def emulator_server(
    provider: str, make_emulator: Callable[[Path], E]
) -> Iterator[tuple[EmulatorServer, E]]:
    """An emulator made by ``make_emulator(folder)`` (a fresh temporary folder for its
    blobs) served over TLS until the block ends."""
    folder = Path(tempfile.mkdtemp(prefix=f"metasync-{provider}-emulator-"))
    emulator = make_emulator(folder)
    server = EmulatorServer(emulator)
    try:
        yield server, emulator
    finally:
        server.close()


def serve_for_session(service: S) -> Iterator[S]:
    """The body of a provider's session fixture (``yield from``): aims the process
    environment at ``service`` (child processes inherit it), signs the default account
    in, yields ``service``, and afterwards restores the environment as it was."""
    import os

    saved = {k: os.environ.get(k) for k in service.env()}
    os.environ.update(service.env())
    try:
        service.sign_in()
        yield service
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def environment_for(provider: str, server: EmulatorServer) -> dict[str, str]:
    """The environment variables that aim ``provider``'s backend at ``server``."""
    prefix = f"METASYNC_{provider.upper()}_"
    env = {prefix + "API_URL": server.base_url}
    if server.ca_file:
        env[prefix + "CA_FILE"] = server.ca_file
    return env


__all__ = [
    "GENERIC_FAULTS",
    "LOST_ANSWER",
    "RESET",
    "SERVER_ERROR",
    "THROTTLE",
    "THROTTLE_NO_RETRY_AFTER",
    "UNAVAILABLE",
    "BlobStore",
    "Emulator",
    "EmulatorFaults",
    "EmulatorServer",
    "EmulatorService",
    "FaultInjector",
    "OAuth2Server",
    "OAuthError",
    "Request",
    "Response",
    "emulator_ca",
    "emulator_server",
    "environment_for",
    "free_port",
    "json_response",
    "parse_range",
    "pkce_challenge",
    "route",
    "serve",
    "serve_for_session",
    "text_response",
]
