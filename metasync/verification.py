"""When backends' atomic primitives are verified, and where the result is kept.

:func:`metasync.backends.probe.verify_primitives` checks, on scratch keys, that a
backend honours the primitive its logs rest on (an exclusive create, a
compare-and-swap, a lock, whole-object writes): a server that accepts the request
and does not honour it would let two clients both win one log position. This module
decides when that check runs:

- ``init`` and ``backend add`` check every backend they are given before writing
  anything of the repository there; ``clone`` checks the backends of the
  configuration before its first pull. A backend that fails is refused with one line
  (:class:`UsageError`) naming what it lacks and what to use instead.
- Afterwards, ``push`` and ``pull`` (and so the daemon) check again each backend of
  the configuration whose last check is older than :data:`RECHECK_SECONDS`, or went
  through another URI than this client uses now: at most once per backend per
  period, in commands that talk to the backends anyway. ``status`` and ``commit``
  never do (they do no backend I/O). A backend that cannot be reached then is left
  to the next command; one that no longer holds fails the command with the refusal.

Each success is recorded as a typed setting of :class:`~metasync.state.LocalState`
(``primitives_checked``: backend id -> :class:`~metasync.state.PrimitivesChecked`).
"""

from __future__ import annotations

import threading
import time

from metasync.backends import Backend, public_uri
from metasync.backends.probe import verify_primitives
from metasync.errors import BackendError, UsageError
from metasync.state import LocalState, PrimitivesChecked

#: A backend's primitives are checked again when its last check is this old (7 days).
RECHECK_SECONDS = 7 * 24 * 3600.0
#: The longest a push or pull waits for its rechecks; a backend not done by then is
#: checked by a later command.
RECHECK_WAIT = 20.0
#: Within one process, a recheck that did not succeed is not tried again for this long.
RETRY_SECONDS = 3600.0

#: (backend id, URI) -> when (``time.monotonic()``) this process last tried a recheck
#: that did not succeed.
_attempted: dict[tuple[str, str], float] = {}


def verify(backend: Backend) -> PrimitivesChecked:
    """Check ``backend``'s primitives now (its namespace must exist); the record to
    keep. :class:`UsageError` if it lacks one."""
    verified = verify_primitives(backend)
    return PrimitivesChecked(public_uri(backend.uri), verified.logs, verified.checked,
                             time.time())


def remember(state: LocalState, records: dict[str, PrimitivesChecked]) -> None:
    """Record successful checks, by backend id."""
    if records:
        with state.transaction():
            state.primitives_checked = {**state.primitives_checked, **records}


def due(state: LocalState, backends: dict[str, Backend],
        now: float | None = None) -> dict[str, Backend]:
    """The backends (by id) whose check is missing, older than
    :data:`RECHECK_SECONDS`, or made through another URI than the one used now."""
    now = time.time() if now is None else now
    records = state.primitives_checked
    stale = {}
    for backend_id, backend in backends.items():
        record = records.get(backend_id)
        if (record is None or record.uri != public_uri(backend.uri)
                or not 0 <= now - record.at < RECHECK_SECONDS):
            stale[backend_id] = backend
    return stale


def recheck(state: LocalState, backends: dict[str, Backend], now: float | None = None,
            wait: float = RECHECK_WAIT) -> None:
    """Check the backends that are :func:`due` (all at once, for at most ``wait``
    seconds), and record those that hold. Raises the :class:`UsageError` of one that
    no longer does. A backend that fails to answer, or takes longer, is left for the
    next command (pPaxos copes with it meanwhile), and within this process is not
    tried again for :data:`RETRY_SECONDS` (a daemon runs many pushes)."""
    stale = {b: backend for b, backend in due(state, backends, now).items()
             if not _tried_lately(b, backend)}
    if not stale:
        return
    outcomes: dict[str, PrimitivesChecked | UsageError] = {}
    lock = threading.Lock()

    def check(backend_id: str, backend: Backend) -> None:
        try:
            outcome: PrimitivesChecked | UsageError = verify(backend)
        except UsageError as exc:
            outcome = exc
        except BackendError:
            return
        with lock:
            outcomes[backend_id] = outcome

    # Daemon threads: a backend that never answers must not hold up the command.
    threads = [threading.Thread(target=check, args=item, name="metasync-verify", daemon=True)
               for item in stale.items()]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + wait
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    with lock:
        done = dict(outcomes)
    for backend_id, backend in stale.items():
        if backend_id not in done:  # did not answer (in time): not a refusal
            _attempted[(backend_id, public_uri(backend.uri))] = time.monotonic()
    remember(state, {b: r for b, r in done.items() if isinstance(r, PrimitivesChecked)})
    refusals = [r for r in done.values() if isinstance(r, UsageError)]
    if refusals:
        raise refusals[0]


def _tried_lately(backend_id: str, backend: Backend) -> bool:
    tried = _attempted.get((backend_id, public_uri(backend.uri)))
    return tried is not None and time.monotonic() - tried < RETRY_SECONDS
