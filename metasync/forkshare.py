"""Jobs shared with a forked copy of this process: a second interpreter lock.

Writing a fresh clone from local backends is bound by Python's interpreter lock,
not by the disk or the cores: every file costs some 70 µs of Python (opening,
checking, decrypting, recording), which threads of one process run in turn. A
copy of the process made by ``fork`` has an interpreter lock of its own, so on a
machine with two cores or more the two take jobs from one queue and run at once
(docs/design.md, "Writing the folder").

The queue is a pipe holding each shared job's index as 4 bytes, written before the
fork and closed for writing: both processes read it, and a read of 4 bytes from a
pipe is atomic, so each job goes to exactly one of them. The copy sends back, for
each job, what running it returned and what it changed (:data:`Report`) as one
pickled message on a second pipe, which a thread of this process reads as it comes
(the copy never waits on a full pipe). A failure in the copy ends it and is raised
here; the copy dies with this process (``PR_SET_PDEATHSIG``), so a crash or
``kill -9`` of this process never leaves it writing.

Only what is safe in a forked child may run in it: nothing that another thread of
this process might hold a lock of at the fork (the caller forks before it starts
its own jobs), no SQLite connection, no network connection, no executor made
before the fork. The caller gives the copy its own executor (``child_setup``).
"""

from __future__ import annotations

import os
import pickle
import signal
import struct
import sys
import threading
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Generic, TypeVar

from metasync.faults import pause_point

J = TypeVar("J")

#: A shared job's index in the queue pipe.
_INDEX = struct.Struct("<I")
#: A message's length on the results pipe.
_LENGTH = struct.Struct("<Q")
#: How long :meth:`ForkedShare.stop` waits for the copy to report before killing it.
STOP_WAIT = 30.0
#: Pipes hold 64 KiB on Linux by default: the queue must fit before the fork.
MAX_SHARED = 16_000


class ChildFailed(Exception):
    """The forked copy died without saying why (killed, or out of memory)."""


class Stopped(BaseException):
    """Raised in the copy by SIGTERM or SIGINT: the parent stops it, or Ctrl-C."""


#: The signals that stop the copy.
_STOPS = frozenset({signal.SIGINT, signal.SIGTERM})


def _stop(signum: int, frame: Any) -> None:
    raise Stopped(signal.Signals(signum).name)


def available() -> bool:
    """True where a share can run: Linux (fork, ``PR_SET_PDEATHSIG``) with two cores
    or more for this process."""
    return sys.platform == "linux" and len(os.sched_getaffinity(0)) >= 2


class ForkedShare(Generic[J]):
    """Jobs of which a forked copy of this process takes some: :meth:`start` forks;
    this process runs the jobs :meth:`mine` hands it, then takes the copy's results
    from :meth:`theirs`; :meth:`stop` ends the copy (call it in every case)."""

    def __init__(self, jobs: Sequence[J], own: Sequence[J], pid: int, queue: int,
                 results: int) -> None:
        self._jobs = jobs
        self._own = own
        self.pid = pid
        self._queue = queue
        self._results = results
        self._received: deque[tuple[int, Any, Any]] = deque()
        self._failure: BaseException | None = None
        self._reader = threading.Thread(target=self._read, name="metasync-share", daemon=True)
        self._reader.start()
        self._reaped = False

    @classmethod
    def start(
        cls,
        shared: Sequence[J],
        own: Sequence[J],
        work: Callable[[J], Any],
        report: Callable[[], Any],
        child_setup: Callable[[], None],
    ) -> ForkedShare[J] | None:
        """Fork a copy that runs ``work(job)`` for jobs of ``shared`` it takes, and
        after each sends ``(index, result, report())``; this process runs ``own``
        and what it takes of ``shared`` (:meth:`mine`). ``child_setup`` runs first
        in the copy. None if the copy cannot be made (the caller runs every job)."""
        if not available() or len(shared) > MAX_SHARED or not shared:
            return None
        if sys.platform == "win32":  # never: available() says so (for the type checker)
            return None
        try:
            queue_r, queue_w = os.pipe()
        except OSError:
            return None
        try:
            results_r, results_w = os.pipe()
        except OSError:
            os.close(queue_r)
            os.close(queue_w)
            return None
        try:
            os.write(queue_w, b"".join(_INDEX.pack(i) for i in range(len(shared))))
        finally:
            os.close(queue_w)
        parent = os.getpid()
        try:
            pid = os.fork()
        except OSError:
            for fd in (queue_r, results_r, results_w):
                os.close(fd)
            return None
        if pid == 0:  # the copy: never returns
            os.close(results_r)
            _child(parent, shared, queue_r, results_w, work, report, child_setup)
        os.close(results_w)
        return cls(shared, own, pid, queue_r, results_r)

    def mine(self) -> Iterator[J]:
        """The jobs this process runs: its own, then those it takes of the shared."""
        yield from self._own
        while (index := _take(self._queue)) is not None:
            yield self._jobs[index]

    def theirs(self, *, raising: bool = True) -> Iterator[tuple[J | None, Any, Any]]:
        """``(job, result, report)`` of each job the copy ran, each once, after the
        copy ended (call once :meth:`mine` is exhausted, or after :meth:`stop`);
        then, if the copy failed, ``(None, [], report)`` of the job it failed in
        (what it changed before failing) and -- with ``raising`` -- its failure."""
        self._reader.join()
        self._reap()
        while self._received:
            index, result, report = self._received.popleft()
            yield (self._jobs[index] if index >= 0 else None), result, report
        if self._failure is not None and raising:
            failure, self._failure = self._failure, None
            raise failure

    def stop(self) -> None:
        """Stop the copy if it still runs -- it ends its job where it is and reports
        what that changed -- and wait for it (then :meth:`theirs` has all it did)."""
        if sys.platform == "win32":  # never started there
            return
        if not self._reaped:
            try:
                os.kill(self.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            self._reader.join(STOP_WAIT)
            if self._reader.is_alive():  # stuck: a copy that writes no more is what counts
                os.kill(self.pid, signal.SIGKILL)
            self._reap()
        self._reader.join()
        if self._queue >= 0:
            os.close(self._queue)
            self._queue = -1

    def _reap(self) -> None:
        if self._reaped:
            return
        _, status = os.waitpid(self.pid, 0)
        self._reaped = True
        if status != 0 and self._failure is None:
            self._failure = ChildFailed(
                f"the second writing process ended with status {os.waitstatus_to_exitcode(status)}")

    def _read(self) -> None:
        """Receive the copy's messages until it closes its end."""
        fd = self._results
        try:
            while (head := _read_exactly(fd, _LENGTH.size)) is not None:
                body = _read_exactly(fd, _LENGTH.unpack(head)[0])
                if body is None:
                    break
                message = pickle.loads(body)  # from our own fork, over a private pipe
                if message[0] == "job":
                    self._received.append(message[1:])
                else:  # failed: the reason, and what the job changed until then
                    self._received.append((-1, [], message[2]))
                    self._failure = message[1]
        except BaseException as exc:  # handed to the caller by theirs()
            self._failure = exc
        finally:
            os.close(fd)


def _take(queue: int) -> int | None:
    """The next job's index from the queue pipe; None once it is empty."""
    got = os.read(queue, _INDEX.size)
    return _INDEX.unpack(got)[0] if got else None


def _read_exactly(fd: int, size: int) -> bytes | None:
    parts: list[bytes] = []
    left = size
    while left:
        got = os.read(fd, min(left, 1 << 20))
        if not got:
            return None
        parts.append(got)
        left -= len(got)
    return b"".join(parts)


def _send(fd: int, message: tuple[Any, ...]) -> None:
    body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    view = memoryview(_LENGTH.pack(len(body)) + body)
    while view:
        view = view[os.write(fd, view):]


def _die_with(parent: int) -> None:
    """Be killed when ``parent`` ends (Linux's ``PR_SET_PDEATHSIG``)."""
    if sys.platform == "win32":  # never forked there
        return
    import ctypes  # only the copy needs it

    libc = ctypes.CDLL(None, use_errno=True)
    pr_set_pdeathsig = 1
    libc.prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # it ended before the call
        os._exit(1)


def _child(parent: int, jobs: Sequence[Any], queue: int, results: int,
           work: Callable[[Any], Any], report: Callable[[], Any],
           child_setup: Callable[[], None]) -> None:
    """The copy's life: run jobs taken from the queue, send each one's result."""
    if sys.platform == "win32":  # never forked there
        return
    status = 1
    try:
        # SIGTERM (the parent stops it) or Ctrl-C end the job where it is; what it
        # wrote until then is reported (the parent's own listener is not ours).
        signal.set_wakeup_fd(-1)
        for sig in _STOPS:
            signal.signal(sig, _stop)
        _die_with(parent)
        child_setup()
        try:
            while (index := _take(queue)) is not None:
                done = work(jobs[index])
                # Not stopped halfway through a message (the pipe would be garbled).
                signal.pthread_sigmask(signal.SIG_BLOCK, _STOPS)
                _send(results, ("job", index, done, report()))
                signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOPS)
                pause_point("share:sent")  # a test holds the copy here
        except BaseException as exc:  # sent to the parent, which raises it
            signal.pthread_sigmask(signal.SIG_BLOCK, _STOPS)
            try:
                _send(results, ("failed", exc, report()))
            except Exception:  # an exception that does not pickle
                _send(results, ("failed", ChildFailed(f"{type(exc).__name__}: {exc}"), report()))
            return
        status = 0
    finally:
        os._exit(status)
