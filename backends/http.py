"""What the cloud-provider backends that talk through the ``requests`` library (the
Dropbox and Box SDKs, OneDrive's Graph calls, the sign-ins of Google and Microsoft)
share: sessions that trust the configured CA file, the contract errors for a failed
connection, and readers of streamed responses.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

from metasync.backends.base import Backend, ObjectReader, one_line
from metasync.backends.retry import TransientError
from metasync.errors import BackendError, BackendUnavailable, NoAnswer


def pin_ca(session: Any, ca_file: str | None) -> Any:
    """Make a requests ``session`` verify TLS against ``ca_file`` (if given) even when
    ``REQUESTS_CA_BUNDLE``/``CURL_CA_BUNDLE`` are set: requests lets those variables
    override ``session.verify``, so the SDK's ``ca_certs`` alone would be ignored."""
    if ca_file is None:
        return session
    merge = session.merge_environment_settings

    def merge_pinned(url: Any, proxies: Any, stream: Any, verify: Any, cert: Any) -> Any:
        settings = merge(url, proxies, stream, verify, cert)
        settings["verify"] = ca_file
        return settings

    session.merge_environment_settings = merge_pinned
    return session


def pooled_session(ca_file: str | None, pool: int) -> Any:
    """A requests session keeping up to ``pool`` connections per host, trusting
    ``ca_file`` (if given, pinned as :func:`pin_ca` does) and never retrying on its
    own: every request goes through :func:`~metasync.backends.retry.retrying`, which
    knows which writes are safe to repeat."""
    import requests
    from requests.adapters import HTTPAdapter

    session = requests.Session()
    adapter = HTTPAdapter(pool_connections=4, pool_maxsize=pool, max_retries=0)
    session.mount("https://", adapter)
    session.mount("http://", adapter)
    if ca_file is not None:
        session.verify = ca_file
    return pin_ca(session, ca_file)


def requests_failure(
    exc: BaseException, what: str, service: str, base_url: str
) -> BackendError | None:
    """The error to raise for ``exc`` if it is a failure of the ``requests`` library
    (which the Dropbox, Box and OneDrive SDKs send through) or of the OS while doing
    ``what`` (e.g. ``"read 'k' on dropbox:/a"``); None if it is neither.

    - a failed TLS certificate or host name check: :class:`BackendError` (a retry
      cannot help);
    - a connect or read timeout: :class:`NoAnswer` (saying ``service``, the
      provider's name, cannot be reached, or did not answer in time);
    - a host name that does not resolve, a refused connection: :class:`BackendUnavailable`
      naming ``base_url`` (where the API is);
    - any other TLS, connection or OS failure: :class:`TransientError` (retried)."""
    import requests.exceptions as rexc

    if isinstance(exc, rexc.SSLError):
        text = one_line(exc)
        if "certificate" in text.lower() or "hostname" in text.lower():
            return BackendError(f"cannot {what}: TLS certificate check failed ({text})")
        return TransientError(f"cannot {what}: TLS connection failed ({text})")
    if isinstance(exc, rexc.ConnectTimeout):
        return NoAnswer(f"cannot {what}: {service} cannot be reached (timed out)")
    if isinstance(exc, rexc.ReadTimeout | TimeoutError):
        return NoAnswer(f"cannot {what}: no answer from {service} in time ({one_line(exc)}); "
                        "check the network, or allow longer with --timeout")
    if isinstance(exc, rexc.ConnectionError):
        from urllib3.exceptions import NameResolutionError, NewConnectionError

        reason = getattr(exc.args[0] if exc.args else None, "reason", None)
        if isinstance(reason, NameResolutionError | NewConnectionError):
            return BackendUnavailable(
                f"cannot {what}: {base_url} cannot be reached ({one_line(reason)}); is the "
                "network up?"
            )
    if isinstance(exc, rexc.RequestException | OSError):
        return TransientError(f"cannot {what}: connection failed ({one_line(exc)})")
    return None


class ResponseReader(ObjectReader):
    """An :class:`ObjectReader` over a streamed ``requests`` response (what Dropbox's
    SDK and Graph's download URLs give). A subclass's ``_next_piece`` reopens the
    download at ``_pos`` (:meth:`_open`) when ``_chunks`` is None, then takes
    :meth:`_next_chunk`. A response that fails or ends before the object is dropped
    (its connection closed), so the retry reopens it."""

    def __init__(self, backend: Backend, key: str, size: int, response: Any) -> None:
        super().__init__(backend, key, size)
        self._response: Any = None
        self._chunks: Iterator[bytes] | None = None
        self._open(response)

    def _open(self, response: Any) -> None:
        """Read on from ``response`` (a download from ``_pos`` on)."""
        self._response = response
        self._chunks = response.iter_content(1 << 20)

    def _next_chunk(self) -> bytes:
        """The next chunk of the open response; raises (dropping the response) if
        reading it fails or it ends before the object does."""
        assert self._chunks is not None
        try:
            piece = next(self._chunks, b"")
        except BaseException:
            self._drop()
            raise
        if not piece:
            self._drop()
            raise self._ended_early()
        return piece

    def _drop(self) -> None:
        response, self._response, self._chunks = self._response, None, None
        if response is not None:
            with contextlib.suppress(Exception):
                response.close()

    def close(self) -> None:
        self._drop()
        super().close()


def range_of_chunks(chunks: Iterable[bytes], offset: int, length: int) -> bytes:
    """The ``length`` bytes from ``offset`` of a whole object given as ``chunks`` (what
    a service sends when it ignores a ``Range`` header), fewer if it ends first; stops
    reading once it has them."""
    data = b""
    seen = 0
    for chunk in chunks:
        if seen + len(chunk) > offset:
            data += chunk[max(0, offset - seen) :]
        seen += len(chunk)
        if len(data) >= length:
            break
    return data[:length]
