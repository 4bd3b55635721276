"""Crash points: named places where a test can make the process die like ``kill -9``.

``METASYNC_CRASH_AT=NAME`` (or ``NAME:N``) makes the N-th (default first) arrival
at :func:`crash_point` ``NAME`` end the process at once with ``os._exit``: no
cleanup, no flushing, no ``finally`` -- exactly what a power cut or ``kill -9``
leaves. The crash tests walk every point to show the next command completes or
rolls forward. Unset (always, outside tests) it costs one dictionary lookup.

``METASYNC_FAIL_WATCH=1`` makes the daemon's watch fail as it does when the OS has
no inotify watches left (``ENOSPC``), for kernels where the test cannot lower the
real limit. ``METASYNC_FAIL_FEEDS=N`` makes the first N openings of each of the
daemon's change feeds fail as an unreachable backend does.
"""

from __future__ import annotations

import os

#: Exit status of a simulated crash (128 + SIGKILL, as a shell reports kill -9).
CRASH_STATUS = 137

_spec = os.environ.get("METASYNC_CRASH_AT")
# Point names contain colons ("push:learned"): only a numeric last part is a count.
_head, _, _tail = (_spec or "").rpartition(":")
_target, _remaining = (_head, int(_tail)) if _head and _tail.isdigit() else (_spec or "", 1)
_counts: dict[str, int] = {}


def crash_point(name: str) -> None:
    """Die here if the environment asks for a crash at this arrival of ``name``."""
    global _remaining
    if not _spec:
        return
    _counts[name] = _counts.get(name, 0) + 1
    if os.environ.get("METASYNC_CRASH_TRACE"):
        with open(os.environ["METASYNC_CRASH_TRACE"], "a") as trace:
            trace.write(f"{name}\n")
    if name == _target:
        _remaining -= 1
        if _remaining == 0:
            os._exit(CRASH_STATUS)


def watch_failure() -> OSError | None:
    """The error a test asks the daemon's watch to fail with, if any."""
    if os.environ.get("METASYNC_FAIL_WATCH"):
        import errno

        return OSError(errno.ENOSPC, "inotify watch limit reached (METASYNC_FAIL_WATCH)")
    return None


def feed_failures() -> int:
    """How many openings of each change feed a test asks to fail (0: none)."""
    value = os.environ.get("METASYNC_FAIL_FEEDS", "")
    return int(value) if value.isdigit() else 0


def pause_point(name: str) -> None:
    """Wait here if the environment asks (``METASYNC_PAUSE_AT=NAME`` and
    ``METASYNC_PAUSE_FILE=PATH``): create ``PATH.reached``, then go on once a test
    creates ``PATH.release`` (or after a minute). Lets a test hold a process in the
    middle of a step, and act while it is there, without sleeping. Unset (always,
    outside tests) it costs one dictionary lookup."""
    if os.environ.get("METASYNC_PAUSE_AT") != name:
        return
    import time

    path = os.environ["METASYNC_PAUSE_FILE"]
    with open(f"{path}.reached", "w"):
        pass
    deadline = time.monotonic() + 60
    while not os.path.exists(f"{path}.release") and time.monotonic() < deadline:
        time.sleep(0.02)
