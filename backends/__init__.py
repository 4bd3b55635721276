"""Storage backends, one module per service, found by URI scheme.

``open_backend("dir:/srv/a", "metasync")`` returns a :class:`Backend` bound to the
namespace ``metasync`` at that location. A bare absolute path means ``dir:``.
"""

from __future__ import annotations

import importlib

from metasync.backends.base import Backend, Capabilities, check_key, check_prefix
from metasync.backends.uris import (
    AUTOMATIC_SCHEMES,
    LOCAL_OPTIONS,
    local_options,
    public_uri,
    scheme_of,
    typed_uri,
    without_local_options,
)
from metasync.errors import UsageError

_REGISTRY: dict[str, type[Backend]] = {}


def register(cls: type[Backend]) -> type[Backend]:
    """Class decorator: make ``cls`` handle URIs of ``cls.scheme``."""
    _REGISTRY[cls.scheme] = cls
    return cls


def normalize_uri(uri: str) -> str:
    """Canonical form of a backend URI (``/x`` becomes ``dir:/x``)."""
    return f"dir:{uri}" if uri.startswith("/") else uri


#: The built-in backends: URI scheme -> module of this package that registers it.
#: Modules are imported on first use, so a command pays only for the SDKs it needs.
BUILTIN_SCHEMES: dict[str, str] = {
    "dir": "local",
    "s3": "s3",
    "sftp": "sftp",
    "webdav": "webdav",
    "webdavs": "webdav",
    "rclone": "rclone",
    "dropbox": "dropbox",
    "box": "box",
    "onedrive": "onedrive",
    "gdrive": "gdrive",
    "memory": "memory",
}


#: Cloud providers ``metasync auth PROVIDER`` signs in to: name -> module of this
#: package with its ``authorize`` (imported only when the command runs).
AUTH_PROVIDERS: dict[str, str] = {
    "dropbox": "dropbox",
    "box": "box",
    "onedrive": "onedrive",
    "gdrive": "gdrive",
}


def open_backend(uri: str, namespace: str) -> Backend:
    """Open the backend for ``uri`` bound to ``namespace``. Does not touch the service."""
    scheme = scheme_of(uri)
    if scheme not in _REGISTRY and scheme in BUILTIN_SCHEMES:
        importlib.import_module(f"metasync.backends.{BUILTIN_SCHEMES[scheme]}")
    cls = _REGISTRY.get(scheme)
    if cls is None:
        known = ", ".join(sorted(f"{s}:" for s in set(_REGISTRY) | set(BUILTIN_SCHEMES)))
        raise UsageError(f"unknown backend scheme {scheme!r} in {uri!r}; known schemes: {known}")
    return cls(normalize_uri(uri), namespace)


__all__ = [
    "AUTOMATIC_SCHEMES",
    "LOCAL_OPTIONS",
    "Backend",
    "Capabilities",
    "check_key",
    "check_prefix",
    "local_options",
    "normalize_uri",
    "open_backend",
    "public_uri",
    "register",
    "scheme_of",
    "typed_uri",
    "without_local_options",
]
