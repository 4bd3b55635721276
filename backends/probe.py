"""Primitives are verified, not assumed: the check a backend passes before it holds logs.

Every backend's logs rest on one atomic primitive (docs/FORMAT.md §11): an exclusive
create (S3 ``If-None-Match: *``, SFTP's link-based rename, ``link()`` on ``dir:``), a
lock the server enforces (WebDAV), whole-object writes that later reads see (Disk
Paxos registers). Several servers accept the request and do not honour it -- an S3
service that ignores ``If-None-Match``, an SFTP server whose rename overwrites, a
WebDAV server that refuses its own lock token -- and two clients then both "win" one
log position, or every append fails. :func:`verify_primitives` finds out on scratch
keys (``probe/<16 hex>/...``), through the very code the logs use, and removes them
again:

- **exclusive create** (where ``capabilities.conditional_create``): :data:`RACERS`
  threads create one new key at once with ``put_if_absent``; exactly one must
  succeed, the key must hold its bytes (the losers' must be absent), and a later
  create must fail;
- **compare-and-swap** (where ``capabilities.compare_and_swap``): :data:`RACERS`
  threads ``replace_if`` one key with the same token; exactly one must win, and the
  stale token must then be refused;
- **the logs** (every backend, through ``backend.logs``: hard links, WebDAV locks,
  registers, reserved ids, exclusive creates): racing ``append_at`` of position 0
  (where ``capabilities.conditional_append``), then racing appends; each position
  must have exactly one winner, ``fetch`` must return exactly what the winners
  wrote, and an ``append_at`` of a taken position must fail.

A backend that fails is refused with :class:`UsageError`, one line: what it lacks,
what was seen, and which option or server setting would do instead (:data:`ADVICE`).
A backend that cannot be reached raises what it raised (:class:`BackendUnavailable`).
"""

from __future__ import annotations

import builtins
import contextlib
import secrets
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import NoReturn, TypeVar

from metasync.backends.base import Backend
from metasync.errors import BackendError, BackendUnavailable, PrimitiveMissing, UsageError

T = TypeVar("T")

#: Where scratch keys go (below the namespace; no repository key starts with it).
PROBE_PREFIX = "probe"
#: Clients racing for one key or one log position.
RACERS = 3
#: Whole checks made when the service keeps failing transiently (it throttles).
ATTEMPTS = 3
#: Seconds the racing threads wait for each other at the start line.
START_TIMEOUT = 60.0

#: What to use instead, by (scheme, what failed): the option or server setting that
#: would do. What failed is ``create``, ``swap``, or the class of the log store whose
#: appends failed; ``*`` stands for any scheme.
ADVICE: dict[tuple[str, str], str] = {
    ("s3", "create"): "the service ignores If-None-Match: *; use an S3 service that "
                      "enforces conditional writes, or add logs=registers to the URI's options",
    ("s3", "swap"): "the service ignores If-Match; use an S3 service that enforces "
                    "conditional writes, or add logs=registers to the URI's options",
    ("sftp", "create"): "the server's SFTP rename replaces an existing file; use OpenSSH's "
                        "sftp-server on a filesystem with hard links, or add logs=registers "
                        "to the URI's options",
    ("webdav", "WebdavLockLogs"): "add logs=registers to the URI's options (logs that need "
                                  "no locks)",
    ("dir", "create"): "the filesystem's link() or no-replace rename does not refuse an "
                       "existing name; use a local filesystem such as ext4, NTFS or APFS",
    ("dir", "LocalLogs"): "use a local filesystem such as ext4, NTFS or APFS",
    ("*", "RegisterLogs"): "writes are not seen at once by later reads and listings here; "
                           "metasync cannot keep its logs on this service",
    ("*", "create"): "the service does not make creates exclusive; metasync cannot keep its "
                     "logs on this service",
    ("*", "swap"): "the service does not make replaces conditional; metasync cannot keep "
                   "its logs on this service",
    ("*", "logs"): "metasync cannot keep its logs on this service",
}


@dataclass(frozen=True)
class Verified:
    """What :func:`verify_primitives` found to hold on one backend."""

    #: The log construction checked (the class of ``backend.logs``), e.g. ``ObjectStoreLogs``.
    logs: str
    #: The primitives checked, e.g. ``("exclusive create", "log appends")``.
    checked: tuple[str, ...]


def verify_primitives(backend: Backend) -> Verified:
    """Check on scratch keys every atomic primitive ``backend`` declares and its log
    store relies on, exactly as the store uses them (module docstring); remove the
    scratch keys. The namespace must exist (``backend.create()``).

    Raises :class:`UsageError` (one line) naming what the backend lacks and what to
    use instead; an error of the service itself (unreachable, denied) as it is. A
    transient one that outlasted the backend's retries (a throttling service) costs
    another whole check on fresh keys, up to :data:`ATTEMPTS` in all."""
    for attempt in range(ATTEMPTS):
        try:
            return _verify_once(backend)
        except BackendError as exc:
            if (not exc.transient or isinstance(exc, BackendUnavailable)
                    or attempt + 1 == ATTEMPTS):
                raise
    raise AssertionError("unreachable")


def _verify_once(backend: Backend) -> Verified:
    scratch = f"{PROBE_PREFIX}/{secrets.token_hex(8)}"
    caps = backend.capabilities
    checked: builtins.list[str] = []
    written: builtins.list[str] = []
    log = f"{scratch}/log"
    try:
        if caps.conditional_create:
            _exclusive_create(backend, f"{scratch}/create", written)
            checked.append("exclusive create")
        if caps.compare_and_swap:
            _compare_and_swap(backend, f"{scratch}/swap", written)
            checked.append("compare-and-swap")
        _log_appends(backend, log)
        # Which primitive, where a backend chooses by probing (dir:: a hard link or a
        # no-replace rename): the record then shows what this client uses there.
        checked.append(f"log appends by {backend.logs.primitive}")
    except PrimitiveMissing as exc:
        # The backend's own message says what broke and what to do; one that names the
        # backend already is the whole line (dir:'s filesystem without a primitive).
        if str(exc).startswith(backend.name):
            raise UsageError(str(exc)) from None
        raise UsageError(
            f"{backend.name} lacks {backend.logs.primitive}: a test append failed: {exc}"
        ) from None
    finally:
        for key in written:
            with contextlib.suppress(BackendError):
                backend.delete(key)
        if caps.log_deletion:
            with contextlib.suppress(BackendError):
                backend.logs.delete_log(log)
    return Verified(type(backend.logs).__name__, tuple(checked))


def _exclusive_create(backend: Backend, key: str, written: builtins.list[str]) -> None:
    payloads = [f"probe create {i} {secrets.token_hex(8)}".encode() for i in range(RACERS)]
    written.append(key)
    won = _race(RACERS, lambda i: backend.put_if_absent(key, payloads[i]))
    winners = [i for i, w in enumerate(won) if w]
    stored = backend.get(key)
    if len(winners) != 1:
        _refuse(backend, "create",
                f"{len(winners)} of {RACERS} racing creates of one new key succeeded")
    if stored != payloads[winners[0]]:
        _refuse(backend, "create", "the key created holds another racer's bytes than the "
                                   "one create that succeeded")
    if backend.put_if_absent(key, b"probe create late") or backend.get(key) != stored:
        _refuse(backend, "create", "a create of an existing key succeeded")


def _compare_and_swap(backend: Backend, key: str, written: builtins.list[str]) -> None:
    written.append(key)
    backend.put(key, b"probe swap start")
    token = backend.poll(key)
    if token is None:
        _refuse(backend, "swap", "a key just written has no token to replace it by")
    payloads = [f"probe swap {i} {secrets.token_hex(8)}".encode() for i in range(RACERS)]
    won = _race(RACERS, lambda i: backend.replace_if(key, payloads[i], token))
    winners = [i for i, w in enumerate(won) if w]
    stored = backend.get(key)
    if len(winners) != 1:
        _refuse(backend, "swap", f"{len(winners)} of {RACERS} racing replaces with one "
                                 "token succeeded")
    if stored != payloads[winners[0]]:
        _refuse(backend, "swap", "the key holds another racer's bytes than the one replace "
                                 "that succeeded")
    if backend.replace_if(key, b"probe swap late", token):
        _refuse(backend, "swap", "a replace with a stale token succeeded")


def _log_appends(backend: Backend, log: str) -> None:
    store = backend.logs
    tag = secrets.token_hex(8)
    first = [f"probe entry 0 by {i} {tag}".encode() for i in range(RACERS)]
    if backend.capabilities.conditional_append:
        won = _race(RACERS, lambda i: store.append_at(log, 0, first[i]))
        winners = [i for i, w in enumerate(won) if w]
        if len(winners) != 1:
            _refuse(backend, "logs", f"{len(winners)} of {RACERS} racing appends at "
                                     "position 0 of a new log succeeded")
        entry0 = first[winners[0]]
    else:
        if store.append(log, first[0]) != 0:
            _refuse(backend, "logs", "the first append to a new log was not given position 0")
        entry0 = first[0]
    more = [f"probe entry by {i} {tag}".encode() for i in range(2)]
    positions = _race(2, lambda i: store.append(log, more[i]))
    if sorted(positions) != [1, 2]:
        _refuse(backend, "logs", f"two racing appends were given positions {positions}, "
                                 "not 1 and 2")
    expected = [(0, entry0), *sorted(zip(positions, more, strict=True))]
    if store.fetch(log) != expected:
        _refuse(backend, "logs", "the log read back differs from what was appended")
    if backend.capabilities.conditional_append and store.append_at(log, 1, b"probe late"):
        _refuse(backend, "logs", "an append at a taken position succeeded")


def _refuse(backend: Backend, failed: str, seen: str) -> NoReturn:
    """Raise the one-line refusal: ``failed`` is ``create``, ``swap`` or ``logs``."""
    scheme = "webdav" if backend.scheme == "webdavs" else backend.scheme
    store = backend.logs
    what = type(store).__name__ if failed == "logs" else failed
    advice = ADVICE.get((scheme, what)) or ADVICE.get(("*", what)) or ADVICE[("*", "logs")]
    lacking = {"create": "an exclusive create", "swap": "a compare-and-swap"}.get(
        failed, store.primitive)
    raise UsageError(f"{backend.name} lacks {lacking} ({seen}): {advice}")


def _race(racers: int, attempt: Callable[[int], T]) -> builtins.list[T]:
    """``[attempt(i) for i in range(racers)]``, each in its own thread, all started
    at once (a barrier); the first error raised is raised here."""
    start = threading.Barrier(racers)

    def run(i: int) -> T:
        start.wait(START_TIMEOUT)
        return attempt(i)

    with ThreadPoolExecutor(racers, "metasync-probe") as pool:
        futures = [pool.submit(run, i) for i in range(racers)]
        return [future.result() for future in futures]
