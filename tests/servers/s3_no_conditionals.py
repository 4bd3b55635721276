"""An S3 endpoint that ignores ``If-None-Match``, for the tests of primitive probing.

Several S3-compatible services accept ``PutObject`` with ``If-None-Match: *`` and
simply overwrite the object (the header is not implemented). :class:`NoConditionalsS3`
is such a service built from real parts: a small HTTP proxy on loopback in front of
a real SeaweedFS S3 gateway (``tests/servers/seaweedfs.py``) that forwards every
request without its ``If-None-Match`` header. The header is part of the request's
AWS signature, so the proxy signs the forwarded request again with the test identity
(botocore's own SigV4 signer, the region taken from the client's signature).
Everything else -- listings, ranged reads, ``If-Match``, multipart uploads -- is the
real service's behaviour.

Fixture ``s3_ignoring_if_none_match`` (function-scoped, in front of the session's
``seaweedfs``): a :class:`NoConditionalsS3` with ``endpoint``, ``uri(prefix)`` and
``stripped`` (how many requests lost their ``If-None-Match``).
"""

from __future__ import annotations

import contextlib
import http.client
import re
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from tests.servers.seaweedfs import ACCESS_KEY, HOST, SECRET_KEY, SeaweedS3

#: Request headers never forwarded as they came: the signature (made again), hop-by-hop
#: headers, and the one this service "does not implement".
_DROPPED = frozenset({
    "authorization", "x-amz-date", "x-amz-content-sha256", "x-amz-security-token", "host",
    "connection", "keep-alive", "expect", "transfer-encoding", "content-length",
    "if-none-match",
})
_HOP_BY_HOP = frozenset({"connection", "keep-alive", "transfer-encoding", "content-length"})
_REGION = re.compile(r"Credential=[^/]+/[0-9]{8}/([^/]+)/s3/aws4_request")


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _ProxyServer

    def log_message(self, format: str, *args: Any) -> None:
        pass  # quiet: the tests' output is not the place for an access log

    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            parts = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                if size == 0:
                    self.rfile.readline()
                    return b"".join(parts)
                parts.append(self.rfile.read(size))
                self.rfile.readline()
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _forward(self) -> None:
        from botocore.auth import S3SigV4Auth
        from botocore.awsrequest import AWSRequest
        from botocore.credentials import Credentials

        body = self._body()
        proxy = self.server
        if "If-None-Match" in self.headers:
            with proxy.lock:
                proxy.stripped += 1
        headers = {k: v for k, v in self.headers.items() if k.lower() not in _DROPPED}
        match = _REGION.search(self.headers.get("Authorization", ""))
        request = AWSRequest(method=self.command, url=f"http://{proxy.upstream}{self.path}",
                             data=body, headers=headers)
        S3SigV4Auth(Credentials(ACCESS_KEY, SECRET_KEY), "s3",
                    match.group(1) if match else "us-east-1").add_auth(request)
        upstream = http.client.HTTPConnection(proxy.upstream, timeout=60)
        try:
            upstream.request(self.command, self.path, body=body or None,
                             headers=dict(request.headers.items()))
            answer = upstream.getresponse()
            data = answer.read()
            self.send_response(answer.status, answer.reason)
            for name, value in answer.getheaders():
                if name.lower() not in _HOP_BY_HOP and name.lower() not in ("server", "date"):
                    self.send_header(name, value)
            length = answer.getheader("Content-Length") if self.command == "HEAD" else None
            self.send_header("Content-Length", length or str(len(data)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)
        finally:
            upstream.close()

    do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _forward


class _ProxyServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, upstream: str) -> None:
        super().__init__((HOST, 0), _Handler)
        self.upstream = upstream
        self.lock = threading.Lock()
        self.stripped = 0


class NoConditionalsS3:
    """A running proxy (see the module docstring); :meth:`close` stops it."""

    def __init__(self, service: SeaweedS3) -> None:
        self.service = service
        self._server = _ProxyServer(f"{HOST}:{service.port}")
        self.port: int = self._server.server_address[1]
        self.endpoint = f"http://{HOST}:{self.port}"
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        name="s3-no-conditionals", daemon=True)
        self._thread.start()

    @property
    def stripped(self) -> int:
        """Requests whose ``If-None-Match`` header was dropped so far."""
        return self._server.stripped

    def uri(self, prefix: str, **options: str) -> str:
        """An ``s3:`` URI for ``prefix`` in the real service's bucket, through the proxy."""
        query = "".join(f"&{k}={v}" for k, v in options.items())
        return self.service.uri(prefix, endpoint=self.endpoint) + query

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(10)


@contextlib.contextmanager
def no_conditionals_s3(service: SeaweedS3) -> Iterator[NoConditionalsS3]:
    proxy = NoConditionalsS3(service)
    try:
        yield proxy
    finally:
        proxy.close()


@pytest.fixture
def s3_ignoring_if_none_match(seaweedfs: SeaweedS3) -> Iterator[NoConditionalsS3]:
    """An S3 endpoint that overwrites where ``If-None-Match: *`` should refuse."""
    with no_conditionals_s3(seaweedfs) as proxy:
        yield proxy
