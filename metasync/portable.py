"""What differs between Linux, macOS and Windows, in one place: locks on open files,
whether a process is alive, and a process killing itself the hard way (the crash
tests). Every other module calls these instead of ``fcntl``, ``os.kill(pid, 0)``
or ``signal.SIGKILL``, so it imports and type-checks on every platform
(``mypy --platform win32`` / ``darwin`` in ``bin/test``).

Locks are ``flock`` on Linux and macOS (called directly: importing portalocker
reads every installed package's metadata, ~0.1 s of each command's start-up) and
portalocker's ``msvcrt.locking`` on Windows. Both are released when the descriptor is closed or the process dies
(however it dies), and both refuse a second open file of the same path, even in
the same process. One difference callers must respect: a Windows lock is
mandatory -- while it is held no other handle can read or write the locked bytes
-- so a lock file never holds data another process must read.
"""

from __future__ import annotations

import errno
import os
import sys
from typing import NoReturn

if sys.platform == "win32":
    def _as_os_error(exc: Exception) -> OSError:
        """A lock failure that is not contention (a filesystem without locks), as the
        OSError ``fcntl`` gives, so callers keep handling OSError."""
        cause = exc.__cause__
        if isinstance(cause, OSError):
            return cause
        return OSError(errno.ENOLCK, f"cannot lock: {exc}")

    def try_lock(fd: int) -> bool:
        """Take an exclusive lock on the open file ``fd`` without waiting. True: taken,
        held until ``fd`` is closed. False: another open file of it holds the lock.
        Raises OSError if the filesystem cannot lock at all."""
        import portalocker

        try:
            portalocker.lock(fd, portalocker.LockFlags.EXCLUSIVE | portalocker.LockFlags.NON_BLOCKING)
        except portalocker.exceptions.AlreadyLocked:
            return False
        except portalocker.exceptions.LockException as exc:
            raise _as_os_error(exc) from exc
        return True

    def lock(fd: int) -> None:
        """Take an exclusive lock on the open file ``fd``, waiting as long as another
        holds it; held until ``fd`` is closed. Raises OSError if the filesystem cannot
        lock at all."""
        import portalocker

        while True:
            try:
                portalocker.lock(fd, portalocker.LockFlags.EXCLUSIVE)
                return
            except portalocker.exceptions.AlreadyLocked:
                # msvcrt's waiting lock gives up after ten tries a second apart;
                # this waits for good, as flock does.
                continue
            except portalocker.exceptions.LockException as exc:
                raise _as_os_error(exc) from exc
else:
    import fcntl

    def try_lock(fd: int) -> bool:
        """Take an exclusive lock on the open file ``fd`` without waiting. True: taken,
        held until ``fd`` is closed. False: another open file of it holds the lock.
        Raises OSError if the filesystem cannot lock at all."""
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                return False
            raise
        return True

    def lock(fd: int) -> None:
        """Take an exclusive lock on the open file ``fd``, waiting as long as another
        holds it; held until ``fd`` is closed. Raises OSError if the filesystem cannot
        lock at all."""
        fcntl.flock(fd, fcntl.LOCK_EX)  # retried on EINTR by Python (PEP 475)


#: open() flags that exist only on POSIX, as 0 where they do not: on Windows no
#: symbolic link is followed by a plain open of a file, there are no FIFOs to block
#: on, handles are not inherited by default, and no folder opens as a file (the
#: descriptor-relative folder walk, worktree.Folders, is POSIX only).
if sys.platform == "win32":
    O_NOFOLLOW = O_DIRECTORY = O_CLOEXEC = O_NONBLOCK = 0
else:
    O_NOFOLLOW, O_DIRECTORY, O_CLOEXEC, O_NONBLOCK = (
        os.O_NOFOLLOW, os.O_DIRECTORY, os.O_CLOEXEC, os.O_NONBLOCK)

#: Whether one :func:`sync_all` makes every file written before it durable (POSIX
#: ``sync``); where it does not (Windows), each file is fsynced as it is written.
SYNC_ALL_FLUSHES_FILES = sys.platform != "win32"


def cores() -> int:
    """The cores this process may run on (its affinity, where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0)) or 1
    return os.cpu_count() or 1


def sync_all() -> None:
    """Flush every file system's written data (one call for a batch of files instead
    of an fsync each); nothing on Windows, where :data:`SYNC_ALL_FLUSHES_FILES` is
    False and writers fsync each file."""
    if sys.platform != "win32":
        os.sync()


def effective_uid() -> int | None:
    """This process's effective uid; None on Windows, which has none (ownership
    there is an ACL's, which the checks that use this leave to the OS)."""
    if sys.platform == "win32":
        return None
    return os.geteuid()


def sync_folder(path: str | os.PathLike[str]) -> None:
    """Make the folder's entries (creates, renames, unlinks) durable. Windows cannot
    open a folder as a file and NTFS journals its metadata: nothing to do there."""
    if sys.platform == "win32":
        return
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


if sys.platform == "win32":
    import ctypes

    _SYNCHRONIZE = 0x00100000
    _PROCESS_QUERY_LIMITED_INFORMATION = 0x1000
    _WAIT_TIMEOUT = 0x102

    def process_alive(pid: int) -> bool:
        """Whether process ``pid`` exists (and has not exited)."""
        # Not os.kill(pid, 0): on Windows signal 0 is CTRL_C_EVENT, sent to the
        # whole console group.
        kernel32 = ctypes.windll.kernel32
        handle = kernel32.OpenProcess(_SYNCHRONIZE | _PROCESS_QUERY_LIMITED_INFORMATION,
                                      False, pid)
        if not handle:
            # No such process, or one we may not open (then it exists).
            return bool(ctypes.GetLastError() == 5)  # ERROR_ACCESS_DENIED
        try:
            return bool(kernel32.WaitForSingleObject(handle, 0) == _WAIT_TIMEOUT)
        finally:
            kernel32.CloseHandle(handle)

    #: What :attr:`multiprocessing.Process.exitcode` is for a process that called
    #: :func:`kill_self` (TerminateProcess exits with the "signal" number).
    KILLED_EXITCODE = 15

    def kill_self() -> NoReturn:
        """End this process at once, as a crash would: no cleanup, no finally."""
        os.kill(os.getpid(), 15)  # TerminateProcess(self, 15)
        raise AssertionError("unreachable")

    class _MemoryCounters(ctypes.Structure):
        _fields_ = [("cb", ctypes.c_ulong), ("PageFaultCount", ctypes.c_ulong),
                    ("PeakWorkingSetSize", ctypes.c_size_t), ("WorkingSetSize", ctypes.c_size_t),
                    ("QuotaPeakPagedPoolUsage", ctypes.c_size_t),
                    ("QuotaPagedPoolUsage", ctypes.c_size_t),
                    ("QuotaPeakNonPagedPoolUsage", ctypes.c_size_t),
                    ("QuotaNonPagedPoolUsage", ctypes.c_size_t),
                    ("PagefileUsage", ctypes.c_size_t), ("PeakPagefileUsage", ctypes.c_size_t)]

    def peak_rss_bytes() -> int:
        """This process's peak resident memory in bytes (peak working set)."""
        counters = _MemoryCounters()
        counters.cb = ctypes.sizeof(counters)
        ctypes.windll.psapi.GetProcessMemoryInfo(ctypes.windll.kernel32.GetCurrentProcess(),
                                                 ctypes.byref(counters), counters.cb)
        return int(counters.PeakWorkingSetSize)
else:
    import signal

    def process_alive(pid: int) -> bool:
        """Whether process ``pid`` exists (a zombie counts, as ``kill -0`` says)."""
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True  # someone else's process
        return True

    #: What :attr:`multiprocessing.Process.exitcode` is for a process that called
    #: :func:`kill_self` (killed by SIGKILL).
    KILLED_EXITCODE = -signal.SIGKILL

    def kill_self() -> NoReturn:
        """End this process at once, as a crash would: no cleanup, no finally."""
        os.kill(os.getpid(), signal.SIGKILL)
        raise AssertionError("unreachable")

    def peak_rss_bytes() -> int:
        """This process's peak resident memory in bytes."""
        import resource

        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return rss if sys.platform == "darwin" else rss * 1024  # Linux reports KiB
