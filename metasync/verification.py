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

import time
from concurrent.futures import ThreadPoolExecutor

from metasync.backends import Backend, public_uri
from metasync.backends.probe import verify_primitives
from metasync.errors import BackendError, UsageError
from metasync.state import LocalState, PrimitivesChecked

#: A backend's primitives are checked again when its last check is this old (7 days).
RECHECK_SECONDS = 7 * 24 * 3600.0


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


def recheck(state: LocalState, backends: dict[str, Backend], now: float | None = None) -> None:
    """Check the backends that are :func:`due` (all at once), and record those that
    hold. Raises the :class:`UsageError` of one that no longer does; a backend that
    fails to answer is left for the next command (pPaxos copes with it meanwhile)."""
    stale = due(state, backends, now)
    if not stale:
        return

    def check(backend: Backend) -> PrimitivesChecked | UsageError | None:
        try:
            return verify(backend)
        except UsageError as exc:
            return exc
        except BackendError:
            return None

    with ThreadPoolExecutor(len(stale), "metasync-verify") as pool:
        outcomes = dict(zip(stale, pool.map(check, stale.values()), strict=True))
    remember(state, {b: r for b, r in outcomes.items() if isinstance(r, PrimitivesChecked)})
    refusals = [r for r in outcomes.values() if isinstance(r, UsageError)]
    if refusals:
        raise refusals[0]
