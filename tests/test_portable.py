"""metasync.portable: the file locks every lock of metasync goes through (the folder
lock, the daemon's lock, the cloud backends' grant locks and upload journals), and
the process checks that replace ``os.kill(pid, 0)`` and ``SIGKILL``."""

from __future__ import annotations

import multiprocessing
import os
from multiprocessing.connection import Connection
from pathlib import Path

import pytest

from metasync.context import DAEMON_LOCK, PID_FILE, daemon_running
from metasync.daemon import Daemon, running_pid
from metasync.errors import UsageError
from metasync.portable import KILLED_EXITCODE, kill_self, lock, process_alive, try_lock
from metasync.worktree import META_DIR


def _open(path: Path) -> int:
    return os.open(path, os.O_RDWR | os.O_CREAT, 0o600)


def _try_in_child(path: str, answer: Connection) -> None:
    fd = _open(Path(path))
    answer.send(try_lock(fd))


def _hold_then_die(path: str, held: Connection) -> None:
    fd = _open(Path(path))
    assert try_lock(fd)
    held.send("held")
    kill_self()


def _other_process_can_lock(path: Path) -> bool:
    receiver, sender = multiprocessing.get_context("spawn").Pipe(duplex=False)
    child = multiprocessing.get_context("spawn").Process(target=_try_in_child,
                                                         args=(str(path), sender))
    child.start()
    sender.close()
    result = receiver.recv()
    child.join()
    return bool(result)


def test_try_lock_refuses_a_second_holder_until_the_first_closes(tmp_path: Path) -> None:
    """An exclusive lock: a second open file of the same path is refused, in this
    process and in another; closing the holder's descriptor frees it."""
    path = tmp_path / "lock"
    first = _open(path)
    assert try_lock(first)
    second = _open(path)
    try:
        assert not try_lock(second)
        assert not _other_process_can_lock(path)
    finally:
        os.close(first)
    assert try_lock(second)
    os.close(second)
    assert _other_process_can_lock(path)


def test_lock_takes_a_free_lock_that_then_excludes_others(tmp_path: Path) -> None:
    path = tmp_path / "lock"
    fd = _open(path)
    lock(fd)
    try:
        assert not _other_process_can_lock(path)
    finally:
        os.close(fd)
    assert _other_process_can_lock(path)


def test_a_holder_that_is_killed_frees_the_lock(tmp_path: Path) -> None:
    """kill_self ends the process as a crash would (the exit code the conformance
    suite expects), and its lock goes with it."""
    path = tmp_path / "lock"
    ctx = multiprocessing.get_context("spawn")
    receiver, sender = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_hold_then_die, args=(str(path), sender))
    child.start()
    sender.close()
    assert receiver.recv() == "held"
    child.join()
    assert child.exitcode == KILLED_EXITCODE
    fd = _open(path)
    assert try_lock(fd)
    os.close(fd)


def test_process_alive() -> None:
    assert process_alive(os.getpid())
    child = multiprocessing.get_context("spawn").Process(target=int)
    child.start()
    child.join()
    assert child.pid is not None and not process_alive(child.pid)


def test_the_daemon_locks_daemon_lock_and_its_pid_file_stays_readable(tmp_path: Path) -> None:
    """The daemon's lock is ``daemon.lock``; ``daemon.pid`` holds its pid and is
    never locked (a Windows lock is mandatory: a locked pid could not be read by
    ``daemon stop``). A second daemon for the folder is refused; closing the lock
    ends "running"."""
    root = tmp_path / "folder"
    (root / META_DIR).mkdir(parents=True)
    assert not daemon_running(root)
    fd = Daemon(root)._take_pid_file()
    try:
        assert daemon_running(root)
        assert running_pid(root) == os.getpid()
        pid_fd = os.open(root / META_DIR / PID_FILE, os.O_RDWR)
        try:
            assert try_lock(pid_fd), "the pid file must not be the locked file"
        finally:
            os.close(pid_fd)
        with pytest.raises(UsageError, match="a metasync daemon already runs"):
            Daemon(root)._take_pid_file()
        assert not _other_process_can_lock(root / META_DIR / DAEMON_LOCK)
    finally:
        os.close(fd)
    assert not daemon_running(root)
