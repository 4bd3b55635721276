"""wsgidav middlewares that give the test server the quirks of real WebDAV servers.

Loaded by the wsgidav process that ``tests/servers/webdav.py`` starts (named in its
``middleware_stack``, after authentication), never by the tests themselves. Each
changes one answer of the real server and nothing else:

:class:`RefuseLockedMove`
    grants ``LOCK`` as usual, but answers ``412 Precondition Failed`` to every
    ``MOVE`` whose ``If`` header carries a lock token -- the server does not honour
    its own lock tokens on a move (seen on servers that evaluate a tagged ``If``
    list against the wrong resource). metasync's locked log appends cannot work
    there, whatever the contention.
:class:`Answer500ForMissingFolder`
    answers ``500 Internal Server Error`` (instead of ``409 Conflict``) to a ``PUT``
    whose parent collection does not exist, as some servers do in their default
    configuration.
:class:`Answer507WhenFull`
    answers ``507 Insufficient Storage`` to a ``PUT`` of an object (a path with an
    ``/objects/`` part) while a file ``FULL`` exists beside the served folder: a
    server whose user's quota is used up (small records still fit).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from typing import Any

from wsgidav.mw.base_mw import BaseMiddleware

StartResponse = Callable[..., Any]


def _answer(start_response: StartResponse, status: str) -> Iterable[bytes]:
    body = f"{status}\n".encode()
    start_response(status, [("Content-Type", "text/plain"), ("Content-Length", str(len(body)))])
    return [body]


def _drain(environ: dict[str, Any]) -> None:
    """Read the request body (a client sending one must not see a reset connection)."""
    length = int(environ.get("CONTENT_LENGTH") or 0)
    stream = environ.get("wsgi.input")
    while length > 0 and stream is not None:
        piece = stream.read(min(length, 1 << 16))
        if not piece:
            break
        length -= len(piece)


class RefuseLockedMove(BaseMiddleware):  # type: ignore[misc]
    """412 to a ``MOVE`` carrying a lock token (see the module docstring)."""

    def __call__(self, environ: dict[str, Any], start_response: StartResponse) -> Any:
        if_header = environ.get("HTTP_IF", "")
        if environ.get("REQUEST_METHOD") == "MOVE" and "(<" in if_header:
            return _answer(start_response, "412 Precondition Failed")
        return self.next_app(environ, start_response)


class Answer500ForMissingFolder(BaseMiddleware):  # type: ignore[misc]
    """500 to a ``PUT`` into a missing collection (see the module docstring)."""

    def __call__(self, environ: dict[str, Any], start_response: StartResponse) -> Any:
        if environ.get("REQUEST_METHOD") == "PUT":
            root = self.config["provider_mapping"]["/"]["args"][0]
            path = environ.get("PATH_INFO", "")
            parent = os.path.dirname(os.path.join(root, path.lstrip("/")))
            if not os.path.isdir(parent):
                _drain(environ)
                return _answer(start_response, "500 Internal Server Error")
        return self.next_app(environ, start_response)


class Answer507WhenFull(BaseMiddleware):  # type: ignore[misc]
    """507 to an object ``PUT`` while ``FULL`` exists (see the module docstring)."""

    def __call__(self, environ: dict[str, Any], start_response: StartResponse) -> Any:
        if environ.get("REQUEST_METHOD") == "PUT" and "/objects/" in environ.get("PATH_INFO", ""):
            root = self.config["provider_mapping"]["/"]["args"][0]
            if os.path.exists(os.path.join(os.path.dirname(root.rstrip("/")), "FULL")):
                _drain(environ)
                return _answer(start_response, "507 Insufficient Storage")
        return self.next_app(environ, start_response)
