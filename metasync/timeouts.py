"""How long metasync waits: the one bound on every wait for another party.

``--timeout SECONDS`` (``METASYNC_TIMEOUT``) bounds every wait: for backends to
agree on a version, for the folder lock another process (the daemon's sync
step, another command) holds, and for a backend's server (each TCP connect,
read, TLS or SSH handshake, banner and sign-in: :func:`network_timeout`; and a
request's retries, which stop once that long has passed since its first
attempt). Without it, :data:`DEFAULT_TIMEOUT` applies to the waits for agreement
and for the lock, and each backend's own ``timeout=`` option (default 60 s) to
its network waits.
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


def given_timeout() -> float | None:
    """The ``--timeout`` (``METASYNC_TIMEOUT``) if one was given, else None."""
    return parse_timeout(os.environ.get("METASYNC_TIMEOUT"))


def wait_bound() -> float:
    """The ``--timeout`` if one was given, else :data:`DEFAULT_TIMEOUT`."""
    return given_timeout() or DEFAULT_TIMEOUT


def network_timeout(own: float) -> float:
    """Seconds one network wait of a backend may last: the backend's own ``own``
    (its ``timeout=`` option or default), never more than ``--timeout``. A backend
    reads this once, when it is constructed (after the CLI has set the option)."""
    given = given_timeout()
    return own if given is None else min(own, given)
