"""Change feeds (issue 19): how a daemon learns that another client pushed.

- the ``dir:`` feed (inotify on the namespace and log folders) fires when another
  client pushes, and not before; also on a FUSE exFAT stick (tests/servers/fsimages.py);
- two daemons on ``dir:`` backends with a poll interval of an hour: a file written in
  one reaches the other, which only its feeds can make happen;
- :class:`PollSchedule`: longer while idle, short right after a change (its logic,
  not the clock); :class:`PollingFeed` follows it;
- a feed that fails is retried with backoff, said once in the log, and the daemon
  stays up and syncs when it works again;
- a new acceptor set restarts the feeds.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import pytest
from test_daemon_sync import Daemons, _daemon_log, _diff, _setup, wait_until
from test_daemon_sync import daemons as daemons  # the fixture

from conftest import run_cli
from metasync import Repository
from metasync.backends import open_backend
from metasync.backends.dirfeed import DirFeed, watchable
from metasync.backends.faulty import FaultyBackend
from metasync.backends.feeds import ChangeFeed, PollingFeed, PollSchedule
from metasync.backends.memory import MemoryBackend
from metasync.errors import BackendUnavailable
from metasync.layout import HINT_KEY
from metasync.remote_watch import RemoteWatch, backoff_delay

#: The daemons below look at the backends only through their feeds.
NO_POLL = ("--poll", "3600", "--rescan", "3600")
FEED_DEADLINE = 60


def _namespace_root(work: Path) -> tuple[str, str]:
    """The URI and namespace of one of ``work``'s dir: acceptors."""
    backend0 = work.parent / "backend0"
    return f"dir:{backend0}", "metasync"


# ============================================================== the dir: feed
def test_dir_feed_fires_when_another_client_pushes(tmp_path: Path) -> None:
    a, b = _setup(tmp_path)
    uri, namespace = _namespace_root(a)
    backend = open_backend(uri, namespace)
    feed = backend.change_feed(HINT_KEY)
    assert feed is not None and feed.kind == "notify", feed
    try:
        assert feed.wait(0) is False  # the starting point
        assert feed.wait(0.3) is False, "fired with nothing pushed"
        (b / "new.txt").write_text("from B\n")
        run_cli("push", "-m", "from B", cwd=b)
        assert feed.wait(FEED_DEADLINE) is True, "no event for another client's push"
    finally:
        feed.close()
        backend.close()


def test_dir_feed_returns_promptly_after_close(tmp_path: Path) -> None:
    a, _ = _setup(tmp_path)
    backend = open_backend(*_namespace_root(a))
    feed = backend.change_feed(HINT_KEY)
    assert feed is not None
    feed.wait(0)
    answers: list[bool] = []
    waiter = threading.Thread(target=lambda: answers.append(feed.wait(600)))
    waiter.start()
    feed.close()
    waiter.join(FEED_DEADLINE)
    assert not waiter.is_alive() and answers == [False]


@pytest.mark.parametrize("kind", ["exfat", "fat", "ntfs"])
def test_dir_feed_on_a_plugged_disk_sees_another_process_write(
    fs_images: dict[str, Path], kind: str
) -> None:
    """FUSE drivers of a device (exfat-fuse, ntfs-3g, our FAT driver): writes by
    another process pass through this kernel's VFS, so inotify reports them (the
    FUSE limit is writes made behind the kernel's back, by another machine:
    network filesystems are polled instead)."""
    folder = fs_images[kind] / f"feed-{uuid.uuid4().hex[:8]}"
    folder.mkdir()
    assert watchable(str(folder))
    backend = open_backend(f"dir:{folder}", "metasync")
    backend.create()
    feed = backend.change_feed(HINT_KEY)
    assert isinstance(feed, DirFeed)
    try:
        feed.wait(0)
        assert feed.wait(0.3) is False
        other = f"dir:{folder}"
        run_python = (
            "from metasync.backends import open_backend; "
            f"b = open_backend({other!r}, 'metasync'); b.put({HINT_KEY!r}, b'x'); b.close()")
        subprocess.run([sys.executable, "-c", run_python], check=True, timeout=60)
        assert feed.wait(FEED_DEADLINE) is True
    finally:
        feed.close()
        backend.close()


# ============================================================== the polling feed
def test_poll_schedule_grows_while_idle_and_is_short_after_a_change() -> None:
    schedule = PollSchedule(short=2, cap=60, hot=3)
    assert schedule.interval == 2
    idle = [schedule.saw_nothing() for _ in range(10)]
    # Short for the burst that may follow a change, then longer and longer.
    assert idle == [2, 2, 2, 4, 8, 16, 32, 60, 60, 60]
    assert schedule.saw_change() == 2
    assert [schedule.saw_nothing() for _ in range(4)] == [2, 2, 2, 4]
    # An idle hour costs at most 60 looks plus the minute of short ones and the climb.
    looks, spent = 0, 0.0
    schedule = PollSchedule()
    while spent < 3600:
        spent += schedule.saw_nothing()
        looks += 1
    assert looks <= 95
    with pytest.raises(ValueError, match="short <= cap"):
        PollSchedule(short=10, cap=5)


def test_polling_feed_follows_its_schedule() -> None:
    backend = MemoryBackend(f"memory:feed-{uuid.uuid4().hex[:6]}", "ns")
    backend.create()
    schedule = PollSchedule(short=0.01, cap=0.04, hot=0)
    feed = PollingFeed(backend, HINT_KEY, schedule)
    assert feed.wait(0) is False
    assert feed.wait(0.2) is False  # a few looks, nothing changed
    assert schedule.interval == 0.04
    backend.put(HINT_KEY, b"1")
    assert feed.wait(FEED_DEADLINE) is True
    assert schedule.interval == 0.01
    feed.close()
    assert feed.wait(600) is False  # closed: at once
    # The default feed of a backend without notification is this one, on the key given.
    default = backend.change_feed(HINT_KEY)
    assert isinstance(default, PollingFeed) and default.key == HINT_KEY
    assert backend.change_feed() is None


# ============================================================== the watch
class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _watch(opener: object = open_backend, **kw: object) -> tuple[RemoteWatch, _Lines, threading.Event]:
    log = logging.getLogger(f"test.remote_watch.{uuid.uuid4().hex}")
    log.propagate = False
    log.setLevel(logging.INFO)
    lines = _Lines()
    log.addHandler(lines)
    wake = threading.Event()
    kw.setdefault("enabled", True)
    return RemoteWatch(wake, log, HINT_KEY, opener=opener, **kw), lines, wake  # type: ignore[arg-type]


def test_backoff_doubles_to_its_cap() -> None:
    assert [backoff_delay(n, 2, 300) for n in range(1, 11)] == \
        [2, 4, 8, 16, 32, 64, 128, 256, 300, 300]


def test_a_failing_feed_is_retried_with_backoff_and_said_once() -> None:
    memory = MemoryBackend(f"memory:feedfail-{uuid.uuid4().hex[:6]}", "ns")
    memory.create()
    faulty = FaultyBackend(memory)
    faulty.faults.refuse("poll", HINT_KEY, times=4, error=BackendUnavailable)

    watch, lines, _ = _watch(lambda uri, ns: faulty, backoff_start=0.01)
    watch.restart({"b1": "memory:x"}, "ns")
    try:
        feed = watch.feeds["b1"]
        wait_until(lambda: feed.kind == "poll", FEED_DEADLINE, "the feed works again")
        assert feed.delays == [0.01, 0.02, 0.04, 0.08]
        failed = [line for line in lines.lines if "failed" in line]
        assert len(failed) == 1, lines.lines
        assert "works again" in " ".join(lines.lines)
        # Its recovery is a look: what changed meanwhile is not lost.
        assert watch.take_fired()
        # While it failed the daemon polled that acceptor; now it does not.
        assert watch.unwatched({"b1": faulty}) == {}
    finally:
        watch.stop()
    assert not feed.thread.is_alive()


def test_a_new_acceptor_set_restarts_the_feeds(tmp_path: Path) -> None:
    folders = {name: tmp_path / name for name in ("b1", "b2", "b3")}
    for folder in folders.values():
        backend = open_backend(f"dir:{folder}", "ns")
        folder.mkdir()
        backend.create()
        backend.close()
    uris = {name: f"dir:{folder}" for name, folder in folders.items()}
    watch, lines, _ = _watch()
    try:
        watch.restart({k: uris[k] for k in ("b1", "b2")}, "ns")
        first = dict(watch.feeds)
        wait_until(lambda: all(f.kind == "notify" for f in first.values()), FEED_DEADLINE,
                   "both feeds run")
        watch.restart({k: uris[k] for k in ("b1", "b2")}, "ns")
        assert watch.feeds == first, "the same acceptors restarted their feeds"
        watch.restart({k: uris[k] for k in ("b2", "b3")}, "ns")
        assert not any(f.thread.is_alive() for f in first.values())
        assert set(watch.feeds) == {"b2", "b3"}
        wait_until(lambda: all(f.started.is_set() for f in watch.feeds.values()),
                   FEED_DEADLINE, "the new feeds run")
        assert all(f.kind == "notify" for f in watch.feeds.values())
        watch.take_fired()  # their start's (test_a_feed_fires_once_when_it_has_started)
        b3 = open_backend(uris["b3"], "ns")
        b3.put(HINT_KEY, b"moved")
        b3.close()
        wait_until(watch.take_fired, FEED_DEADLINE, "the new acceptor's feed fired")
    finally:
        watch.stop()
    assert len([line for line in lines.lines if line.startswith("watching")]) == 2


# ============================================================== two daemons
def test_a_push_reaches_the_other_daemon_through_the_feeds(tmp_path: Path, daemons: Daemons) -> None:
    """Polls an hour apart: only the feeds can bring A's file to B in time."""
    a, b = _setup(tmp_path)
    daemons.start(a, *NO_POLL)
    daemons.start(b, *NO_POLL)
    for i in range(3):
        (a / f"from-a-{i}.txt").write_text(f"written in A, {i}\n")
        wait_until(lambda i=i: (b / f"from-a-{i}.txt").is_file()
                   and (b / f"from-a-{i}.txt").read_text() == f"written in A, {i}\n",
                   FEED_DEADLINE, f"A's file {i} in B", _diff(a, b))
    (b / "from-b.txt").write_text("written in B\n")
    wait_until(lambda: (a / "from-b.txt").is_file(), FEED_DEADLINE, "B's file in A", _diff(a, b))


def test_a_push_seen_while_a_command_has_the_folder_is_pulled_once_it_is_done(
        tmp_path: Path, daemons: Daemons) -> None:
    """A feed fires while a command has A's folder (as the service's API has it,
    reading, many times a second while a page watches): A's sync finds the folder
    busy and runs again once it is free -- and that sync still pulls. (It looked at
    nothing but the folder, so B's version waited for another push or the
    half-hourly check: a conflict was never listed on A.)"""
    a, b = _setup(tmp_path)
    daemons.start(a, *NO_POLL)
    (b / "first.txt").write_text("first\n")
    run_cli("push", "-m", "first", cwd=b)
    wait_until(lambda: (a / "first.txt").is_file(), FEED_DEADLINE, "B's first file in A", _diff(a, b))
    held = Repository.open(a, wait=FEED_DEADLINE)
    try:
        (b / "second.txt").write_text("second\n")
        run_cli("push", "-m", "second", cwd=b)
        wait_until(lambda: "another command is using" in _daemon_log(a), FEED_DEADLINE,
                   "A's sync finding its folder in use", lambda: _daemon_log(a))
    finally:
        held.close()
    wait_until(lambda: (a / "second.txt").is_file(), FEED_DEADLINE, "B's second file in A",
               lambda: _diff(a, b)() + "\n" + _daemon_log(a))


def test_the_daemon_stays_up_while_feeds_fail_and_syncs_once_they_work(
    tmp_path: Path, daemons: Daemons
) -> None:
    a, b = _setup(tmp_path)
    daemons.start(a, *NO_POLL)
    daemons.start(b, *NO_POLL, METASYNC_FAIL_FEEDS="3")
    wait_until(lambda: _daemon_log(b).count("works again") >= 3, FEED_DEADLINE,
               "B's feeds work again", lambda: _daemon_log(b))
    log = _daemon_log(b)
    # Three acceptors, each failing three times: one line each, not one per attempt.
    assert log.count("change feed of") - log.count("works again") == 3, log
    (a / "after.txt").write_text("after the failures\n")
    wait_until(lambda: (b / "after.txt").is_file(), FEED_DEADLINE, "A's file in B", _diff(a, b))


def test_a_feed_fires_once_when_it_has_started() -> None:
    """A feed starts after the daemon's last look at the backends (its first sync, or
    the sync that found a new configuration): a push in between fires nothing, so
    the feed fires once its starting point is set, and then only on changes."""
    made: list[_QuietFeed] = []

    class Opened:
        def change_feed(self, key: str | None = None) -> ChangeFeed:
            made.append(_QuietFeed())
            return made[-1]

        def close(self) -> None:
            pass

    watch, _, wake = _watch(lambda uri, ns: Opened())
    watch.restart({"b1": "memory:x"}, "ns")
    try:
        feed = watch.feeds["b1"]
        wait_until(feed.started.is_set, FEED_DEADLINE, "the feed started")
        assert watch.take_fired() and wake.is_set()
        wait_until(lambda: made[0].waits >= 2, FEED_DEADLINE, "the feed waiting for changes")
        assert not watch.take_fired()  # once: the feed itself saw nothing
        assert len(made) == 1
    finally:
        watch.stop()
    assert not feed.thread.is_alive()


class _QuietFeed(ChangeFeed):
    """A feed that sees no change: its first wait sets its starting point at once,
    the others last until it is closed."""

    kind = "notify"

    def __init__(self) -> None:
        self.waits = 0
        self.closed = threading.Event()

    def wait(self, timeout: float) -> bool:
        self.waits += 1
        if self.waits > 1:
            self.closed.wait(timeout)
        return False

    def close(self) -> None:
        self.closed.set()


def test_acceptors_without_a_working_feed_have_their_hint_read() -> None:
    """Feeds off (``METASYNC_CHANGE_FEEDS=0``) or failing: the daemon reads hints."""
    memory = MemoryBackend(f"memory:hints-{uuid.uuid4().hex[:6]}", "ns")
    memory.create()
    watch, _, _ = _watch(enabled=False)
    watch.restart({"b1": "memory:x"}, "ns")
    assert watch.feeds == {}  # off: no threads
    heard: list[tuple[str, str | None]] = []

    def on_poll(backend_id: str, seconds: float, error: str | None) -> None:
        heard.append((backend_id, error))

    acceptors = {"b1": memory}
    assert watch.hints_moved(acceptors, on_poll) is True  # never looked at
    assert watch.hints_moved(acceptors, on_poll) is False
    memory.put(HINT_KEY, b"2")
    assert watch.hints_moved(acceptors, on_poll) is True
    assert heard == [("b1", None)] * 3
    assert watch.full_check_due() and watch.full_check_due()  # every rescan, as before
