"""Keys: the names a backend stores objects and logs under.

A key is relative to a backend's namespace: ``/``-separated parts, each matching
``[A-Za-z0-9._-]+`` and not ``.`` or ``..``, so that a key can never escape the
namespace. :func:`check_key` enforces this; every backend operation and every log
store calls it before touching the service.
"""

from __future__ import annotations

import re

from metasync.errors import InvalidKey, UsageError

_KEY_PART = re.compile(r"^[A-Za-z0-9._-]+\Z")
#: Prefix of names of in-progress writes: never a key part, never listed.
TEMP_PREFIX = ".tmp-"


def check_key(key: str) -> str:
    """Return ``key`` if it is a safe relative key, else raise :class:`InvalidKey`."""
    if not key or key.startswith("/") or key.endswith("/"):
        raise InvalidKey(f"invalid backend key {key!r}")
    for part in key.split("/"):
        # ".tmp-" names are reserved for in-progress writes, which are never listed.
        if part in (".", "..") or part.startswith(TEMP_PREFIX) or not _KEY_PART.match(part):
            raise InvalidKey(f"invalid backend key {key!r}")
    return key


def temp_path_parts(path: str) -> list[str]:
    """The parts of ``path``, a temporary upload file as a backend's sweep named it
    (relative, its last part starting with ``.tmp-``, no empty, ``.`` or ``..`` part);
    else :class:`InvalidKey`: a removal never reaches outside the namespace or a key."""
    parts = path.split("/")
    if not parts[-1].startswith(TEMP_PREFIX) or any(p in ("", ".", "..") for p in parts):
        raise InvalidKey(f"not a temporary file: {path!r}")
    return parts


def check_namespace(namespace: str) -> str:
    """Return ``namespace`` if it is a valid repository namespace (one safe key, see
    :func:`check_key`), else raise :class:`UsageError` saying which characters to use.
    Backends call it when bound, before touching the service."""
    try:
        return check_key(namespace)
    except InvalidKey as exc:
        raise UsageError(
            f"invalid repository namespace {namespace!r}: use letters, digits, '.', '_', '-'"
        ) from exc


def is_key_part(name: str) -> bool:
    """True if ``name`` may be one part of a listed key (so not a temporary file)."""
    try:
        check_key(name)
    except InvalidKey:
        return False
    return True


def check_prefix(prefix: str) -> str:
    """Like :func:`check_key` for a listing prefix; ``""`` (everything) is allowed."""
    if prefix == "":
        return prefix
    return check_key(prefix.rstrip("/"))
