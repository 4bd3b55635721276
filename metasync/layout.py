"""Where things live on a backend: every key of docs/FORMAT.md §2, in one place.

Nothing else spells a key. The names a backend *returns* (listings) are
untrusted: the ``parse_*`` functions accept exactly what the matching key
function makes and nothing else, so a hostile listing can never name a path,
an id or an instance that metasync would not have written itself.

Also here: the repository descriptor (``metasync.json``, FORMAT.md §8.1), the
one key a clone reads before it knows anything else, and the checks that a
backend is free for a new repository.
"""

from __future__ import annotations

import hmac
import json
import re
from typing import Any

from metasync.backends import Backend
from metasync.backends.base import check_namespace as check_backend_namespace
from metasync.errors import (
    BackendUnavailable,
    FormatError,
    MetasyncError,
    NotARepository,
    NotTrusted,
    ObjectNotFound,
    UsageError,
)
from metasync.keys import Keyring, descriptor_mac, repository_id
from metasync.keyslots import is_slot_id
from metasync.objects import MAX_FRAGMENTS, READABLE_FORMATS, Config, is_object_id

#: The repository descriptor: plain JSON, the last key written at init (§8.1).
DESCRIPTOR_KEY = "metasync.json"
#: Key files (§8.2): one slot per passphrase, ``keys/<slot id>``.
KEYS_PREFIX = "keys"
#: The legacy key file: a master secret under one passphrase (read, never written).
KEYFILE_KEY = "keys/master"
#: Configurations, by id (§8.3).
CONFIG_PREFIX = "config"
#: Packs, indexes, commits and erasure-coded fragments, fanned out by id (§2, §15).
OBJECTS_PREFIX = "objects"
#: Per-client state (head, prev, announced uploads).
CLIENTS_PREFIX = "clients"
#: Records of copies written away from their holders (hinted hand-off, §7.1).
SPILLS_PREFIX = "spills"
#: pPaxos acceptor logs, one per instance (§9).
LOG_PREFIX = "log"
#: The ``latest`` hint every acceptor carries (§9).
HINT_KEY = "latest"
#: Log compaction floors and marks (§9.1).
FLOOR_PREFIX = "floor"

DEFAULT_NAMESPACE = "metasync"

_FRAGMENT_KEY = re.compile(r"^objects/([0-9a-f]{2})/([0-9a-f]{64})\.f(0|[1-9][0-9]?)\Z")


# --- objects ---------------------------------------------------------------------------
def object_key(stored_id: str) -> str:
    """Key of a stored object (fanned out by the first two hex digits of its id)."""
    return f"{OBJECTS_PREFIX}/{stored_id[:2]}/{stored_id}"


def parse_object_key(key: str) -> str | None:
    """The stored id of ``objects/<id[:2]>/<id>``, or None for any other name (a
    backend's listing is untrusted: a name must be exactly a well-formed id)."""
    parts = key.split("/")
    if len(parts) != 3 or parts[0] != OBJECTS_PREFIX or not is_object_id(parts[2]):
        return None
    return parts[2] if parts[1] == parts[2][:2] else None


def fragment_key(stored_id: str, index: int) -> str:
    """Key of fragment ``index`` of ``stored_id``: ``objects/<id[:2]>/<id>.f<index>``."""
    if not is_object_id(stored_id) or not 0 <= index < MAX_FRAGMENTS:
        raise ValueError(f"no fragment key for {stored_id!r} #{index}")
    return f"{object_key(stored_id)}.f{index}"


def parse_fragment_key(key: str) -> tuple[str, int] | None:
    """``(stored_id, index)`` if ``key`` is exactly what :func:`fragment_key` makes,
    else ``None`` (a replicated object, or anything else found when listing)."""
    match = _FRAGMENT_KEY.match(key)
    if not match or match.group(1) != match.group(2)[:2]:
        return None
    index = int(match.group(3))
    return (match.group(2), index) if index < MAX_FRAGMENTS else None


def spill_key(stored_id: str) -> str:
    """Key of the record that some copy of ``stored_id`` is away from its holders."""
    return f"{SPILLS_PREFIX}/{stored_id}"


def parse_spill_key(key: str) -> str | None:
    """The stored id of ``spills/<id>``, or None for any other name."""
    parts = key.split("/")
    if len(parts) != 2 or parts[0] != SPILLS_PREFIX or not is_object_id(parts[1]):
        return None
    return parts[1]


# --- key files -----------------------------------------------------------------------------
def slot_key(slot_id: str) -> str:
    """Key of slot ``slot_id``'s file: ``keys/<16 hex digits>``."""
    if not is_slot_id(slot_id):
        raise ValueError(f"no slot key for {slot_id!r}")
    return f"{KEYS_PREFIX}/{slot_id}"


def parse_slot_key(key: str) -> str | None:
    """The slot id of ``keys/<slot id>``, or None for any other name."""
    parts = key.split("/")
    if len(parts) == 2 and parts[0] == KEYS_PREFIX and is_slot_id(parts[1]):
        return parts[1]
    return None


def key_file_keys(backend: Backend) -> list[str]:
    """The key files ``backend`` lists: every slot file and the legacy key file
    (only names :func:`slot_key` makes, or :data:`KEYFILE_KEY`)."""
    return sorted(k for k in backend.list(KEYS_PREFIX)
                  if k == KEYFILE_KEY or parse_slot_key(k) is not None)


def read_slot_files(backend: Backend) -> dict[str, bytes]:
    """Every slot file on ``backend``, by slot id (unparsed: untrusted bytes)."""
    out = {}
    for key in key_file_keys(backend):
        slot_id = parse_slot_key(key)
        if slot_id is not None:
            try:
                out[slot_id] = backend.get(key)
            except ObjectNotFound:
                continue
    return out


def delete_key_files(backend: Backend) -> list[str]:
    """Delete every key file from ``backend`` (best effort: a backend being removed);
    return the keys it could not delete."""
    try:
        keys = key_file_keys(backend)
    except MetasyncError:
        return [KEYS_PREFIX]
    failed = []
    for key in keys:
        try:
            backend.delete(key)
        except ObjectNotFound:
            continue
        except MetasyncError:
            failed.append(key)
    return failed


# --- configurations and clients ------------------------------------------------------
def config_key(config_id: str) -> str:
    return f"{CONFIG_PREFIX}/{config_id}"


def client_key(client_id: str) -> str:
    return f"{CLIENTS_PREFIX}/{client_id}"


# --- pPaxos -------------------------------------------------------------------------------
def log_key(instance: int) -> str:
    return f"{LOG_PREFIX}/{instance:012d}"


def floor_key(below: int) -> str:
    return f"{FLOOR_PREFIX}/{below:012d}"


def mark_key(number: int) -> str:
    return f"{FLOOR_PREFIX}/mark-{number:012d}"


def retired_key(config_id: str) -> str:
    """Key of the mark ``metasync recover`` leaves for configuration ``config_id``
    (which lost its majority for good) on the backends that survived (§9.2)."""
    return f"{FLOOR_PREFIX}/retired-{config_id}"


def instance_of_log(key: str) -> int | None:
    """The instance of a key ``log/<12 digits>/...``, else None."""
    parts = key.split("/")
    if len(parts) >= 2 and parts[0] == LOG_PREFIX and len(parts[1]) == 12 and parts[1].isdigit():
        return int(parts[1])
    return None


def floor_of_key(key: str, kind: str = "") -> int | None:
    """The number in ``floor/<kind><12 digits>`` (a floor, or with ``kind="mark-"`` a
    mark), else None."""
    head = f"{FLOOR_PREFIX}/{kind}"
    name = key[len(head):] if key.startswith(head) else ""
    return int(name) if len(name) == 12 and name.isdigit() else None


def record_context(key: str) -> tuple[str, str] | None:
    """The chain context ``(kind, id)`` (§4) of the record stored at ``key`` if it is
    one that is not an object -- a configuration, the hint, a client state, a spill
    record, a floor, mark or recovery mark -- else None (objects, the descriptor, key
    files, logs, scratch keys)."""
    head = key.split("/", 1)[0]
    if key == HINT_KEY:
        return "hint", HINT_KEY
    if head == CONFIG_PREFIX:
        config_id = key[len(CONFIG_PREFIX) + 1:]
        return ("config", config_id) if is_object_id(config_id) else None
    if head in (CLIENTS_PREFIX, SPILLS_PREFIX):
        return ("client" if head == CLIENTS_PREFIX else "spill"), key
    if head == FLOOR_PREFIX:
        return ("retired" if key.startswith(f"{FLOOR_PREFIX}/retired-") else "floor"), key
    return None


# --- the descriptor -----------------------------------------------------------------------
def _descriptor_body(doc: dict[str, Any]) -> bytes:
    body = {k: v for k, v in doc.items() if k != "mac"}
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def descriptor(config: Config, config_id: str, backend_id: str, ring: Keyring | None) -> bytes:
    """The bytes of ``metasync.json`` for backend ``backend_id`` (§8.1). With the
    repository's keyring (encrypted repositories) it names the repository id and
    carries a MAC under the id key over every other field."""
    doc: dict[str, Any] = {
        "format": config.format,
        "encryption": config.encryption,
        "config": config_id,
        "backend": backend_id,
    }
    if ring is not None:
        doc["repository"] = repository_id(ring)
        doc["mac"] = descriptor_mac(ring, _descriptor_body(doc))
    return json.dumps(doc, indent=2, sort_keys=True).encode() + b"\n"


def check_descriptor(desc: dict[str, Any], ring: Keyring, uri: str) -> None:
    """Raise :class:`NotTrusted` unless descriptor ``desc`` (from ``uri``) names
    ``ring``'s repository and its MAC verifies under ``ring``'s id key."""
    if desc.get("repository") != repository_id(ring) or not hmac.compare_digest(
            str(desc.get("mac", "")), descriptor_mac(ring, _descriptor_body(desc))):
        raise NotTrusted(
            f"the descriptor on {uri} is not authenticated by this repository's key (the "
            "backend changed it); clone from another backend"
        )


def parse_descriptor(raw: bytes, uri: str) -> dict[str, Any]:
    """A descriptor read from ``uri``, checked field by field; raises
    :class:`NotARepository` if it is damaged, :class:`FormatError` if its format
    is not this metasync's."""
    try:
        doc = json.loads(raw)
        fmt = doc["format"]
        ok = (
            isinstance(fmt, int)
            and doc["encryption"] in ("none", "aes-256-gcm")
            and is_object_id(doc["config"])
            and isinstance(doc["backend"], str)
            # Written by this metasync for encrypted repositories, absent from older ones.
            and set(doc) in ({"format", "encryption", "config", "backend"},
                             {"format", "encryption", "config", "backend", "repository", "mac"})
            and all(isinstance(doc.get(k, ""), str) for k in ("repository", "mac"))
        )
    except (ValueError, KeyError, TypeError, RecursionError):
        ok = False
    if not ok:
        raise NotARepository(f"{uri} holds a damaged {DESCRIPTOR_KEY}; clone from another backend")
    check_format(doc["format"])
    result: dict[str, Any] = doc
    return result


def check_format(fmt: int) -> None:
    """Raise :class:`FormatError` unless ``fmt`` is the format this metasync reads."""
    if fmt not in READABLE_FORMATS:
        raise FormatError(
            f"repository format {fmt} is not supported (this metasync reads "
            f"{' and '.join(map(str, READABLE_FORMATS))}); "
            "upgrade metasync"
        )


def check_namespace(namespace: str) -> None:
    """Raise :class:`UsageError` unless ``namespace`` is one safe key part."""
    check_backend_namespace(namespace)
    if "/" in namespace:
        raise UsageError(f"invalid namespace {namespace!r}; it cannot contain '/'")


def check_backend_free(backend: Backend) -> None:
    """Raise :class:`UsageError` if ``backend`` cannot be reached or already holds a
    repository in its namespace (writes nothing)."""
    try:
        backend.probe()
        taken = backend.exists() and has_descriptor(backend)
    except BackendUnavailable as exc:
        raise UsageError(str(exc)) from None
    if taken:
        raise UsageError(
            f"{backend.name} already holds a metasync repository (namespace "
            f"{backend.namespace!r}); use `metasync clone {backend.name}` or another --namespace"
        )


def has_descriptor(backend: Backend) -> bool:
    try:
        backend.size(DESCRIPTOR_KEY)
        return True
    except ObjectNotFound:
        return False
