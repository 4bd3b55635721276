"""How long metasync waits: the one bound on every wait for another party.

``--timeout SECONDS`` (``METASYNC_TIMEOUT``) bounds every wait: for backends to
agree on a version, and for the folder lock another process (the daemon's sync
step, another command) holds. Without it, :data:`DEFAULT_TIMEOUT` applies.
"""

from __future__ import annotations

import os

from metasync.errors import UsageError

#: Seconds any wait lasts at most unless ``--timeout`` says otherwise.
DEFAULT_TIMEOUT = 30.0


def parse_timeout(raw: object) -> float | None:
    """``raw`` (a setting or ``METASYNC_TIMEOUT``) as positive seconds, None if
    unset; :class:`UsageError` for anything else."""
    if raw is None or raw == "":
        return None
    try:
        value = float(raw)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise UsageError(f"timeout {raw!r} is not a number of seconds") from None
    if not value > 0:
        raise UsageError(f"timeout must be positive, got {raw!r}")
    return value


def wait_bound() -> float:
    """The ``--timeout`` if one was given, else :data:`DEFAULT_TIMEOUT`."""
    return parse_timeout(os.environ.get("METASYNC_TIMEOUT")) or DEFAULT_TIMEOUT
