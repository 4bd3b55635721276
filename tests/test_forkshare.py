"""Jobs shared with a forked copy of the process (:mod:`metasync.forkshare`), and a
fresh clone whose files two processes write (:mod:`metasync.checkout_share`).

The copy is real (``os.fork``), as are the clones (``dir:`` backends, the CLI
where a process is killed). Nothing waits by sleeping: a process's end is seen on
its pidfd, a moment in a job on a pipe.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import METASYNC, PASSPHRASE, snapshot
from metasync import Repository
from metasync.checkout_share import MIN_SHARED_FILES
from metasync.errors import CorruptObject, ObjectUnavailable
from metasync.forkshare import ChildFailed, ForkedShare, available
from metasync.worktree import META_DIR

pytestmark = pytest.mark.skipif(not available(), reason="Linux with two cores or more only")

#: Safety net only: no test waits this long unless something is broken.
LIMIT = 60.0


def ended(pid: int, timeout: float = LIMIT) -> bool:
    """True once process ``pid`` (not necessarily a child of ours) has ended."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        return bool(select.select([fd], [], [], timeout)[0])
    finally:
        os.close(fd)


def children(pid: int) -> list[int]:
    """The child processes of ``pid`` (Linux's /proc/PID/task/*/children)."""
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(c) for c in (task / "children").read_text().split()]
    return found


class Gate:
    """A pipe one process opens (writes a byte) and another waits on, bounded."""

    def __init__(self) -> None:
        self.r, self.w = os.pipe()

    def open(self) -> None:
        os.write(self.w, b"x")

    def wait(self) -> None:
        assert select.select([self.r], [], [], LIMIT)[0], "the other process never got there"
        os.read(self.r, 1)

    def close(self) -> None:
        os.close(self.r)
        os.close(self.w)


@pytest.fixture
def gate() -> Iterator[Gate]:
    g = Gate()
    yield g
    g.close()


# ------------------------------------------------------------------- the share


def test_every_job_runs_once_in_one_of_the_two(gate: Gate) -> None:
    parent = os.getpid()
    jobs = list(range(3000))

    def work(job: int) -> tuple[int, int]:
        if os.getpid() != parent and job == 0:
            gate.open()  # the copy has a job: this process may start taking its own
        return os.getpid(), job * job

    share = ForkedShare.start(jobs, [-1, -2], work, os.getpid, lambda: None)
    assert share is not None
    try:
        gate.wait()
        mine = [work(job) for job in share.mine()]
        theirs = [(job, result, report) for job, result, report in share.theirs()]
    finally:
        share.stop()
    assert mine[:2] == [(parent, 1), (parent, 4)]  # its own jobs first
    assert all(report == share.pid and result[0] == share.pid for _, result, report in theirs)
    done = sorted([r for _, r in mine[2:]] + [result[1] for _, result, _ in theirs])
    assert done == [j * j for j in jobs], "a job ran twice, or not at all"
    assert theirs and mine[2:], "one process took every job"


def test_a_failure_in_the_copy_comes_back_after_what_it_did() -> None:
    done_here: list[int] = []

    def work(job: int) -> int:
        done_here.append(job)  # the copy's own list (this process runs none)
        if job == 7:
            raise ValueError(f"job {job} is bad")
        return job

    share = ForkedShare.start(list(range(10)), [], work, lambda: list(done_here), lambda: None)
    assert share is not None
    got: list[tuple[Any, Any, Any]] = []
    with pytest.raises(ValueError, match="job 7 is bad"):
        for item in share.theirs():
            got.append(item)
    share.stop()
    assert [job for job, _, _ in got] == [*range(7), None]
    # The last report is the failed job's: what it changed before failing.
    assert got[-1] == (None, [], list(range(8)))
    assert list(share.theirs()) == []  # each once


def test_stop_ends_the_copys_job_where_it_is_and_reports_it(gate: Gate) -> None:
    blocker_r, blocker_w = os.pipe()
    progress: list[str] = []

    def work(job: int) -> int:
        progress.append(f"start {job}")
        if job == 3:
            gate.open()
            os.read(blocker_r, 1)  # never written: only a signal ends the wait
        return job

    share = ForkedShare.start(list(range(10)), [], work, lambda: list(progress), lambda: None)
    assert share is not None
    try:
        gate.wait()
        share.stop()
        got = list(share.theirs(raising=False))
    finally:
        os.close(blocker_r)
        os.close(blocker_w)
    assert [job for job, _, _ in got] == [0, 1, 2, None]
    assert got[-1][2][-1] == "start 3"
    assert ended(share.pid, 0)


def test_a_copy_killed_from_outside_is_a_failure(gate: Gate) -> None:
    def work(job: int) -> int:
        gate.open()
        select.select([], [], [])  # waits until killed
        return job

    share = ForkedShare.start([1, 2], [], work, lambda: None, lambda: None)
    assert share is not None
    gate.wait()
    os.kill(share.pid, signal.SIGKILL)
    with pytest.raises(ChildFailed, match="second writing process"):
        list(share.theirs())
    share.stop()


def test_the_copy_dies_with_its_parent(tmp_path: Path) -> None:
    """A parent killed by SIGKILL (a crash) takes the copy with it: nothing keeps
    writing into a folder the next command will finish."""
    script = tmp_path / "parent.py"
    script.write_text(textwrap.dedent("""
        import os, select, sys
        from metasync.forkshare import ForkedShare

        def work(job):
            print(os.getpid(), flush=True)
            select.select([], [], [])  # blocks until killed

        share = ForkedShare.start([1], [], work, lambda: None, lambda: None)
        select.select([], [], [])
    """))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        copy = int(proc.stdout.readline())
        assert copy in children(proc.pid)
        proc.kill()
        proc.wait(LIMIT)
        assert ended(copy), "the copy outlived its parent"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_nothing_is_forked_for_more_jobs_than_the_queue_holds() -> None:
    from metasync.forkshare import MAX_SHARED

    assert ForkedShare.start(list(range(MAX_SHARED + 1)), [], str, list, lambda: None) is None
    assert ForkedShare.start([], [], str, list, lambda: None) is None


# ---------------------------------------------------------------- fresh clones

#: Enough for several jobs of each process (a job is at most 400 files).
FILES = max(MIN_SHARED_FILES, 3000)


@pytest.fixture(scope="module")
def pushed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, list[Path]]]:
    """A folder of many small files in folders, a file of several chunks, a link
    and an executable, pushed to three ``dir:`` backends."""
    base = tmp_path_factory.mktemp("forkshare")
    root = base / "source"
    for i in range(FILES):
        folder = root / f"d{i % 13}" / f"s{i % 5}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"f{i}.txt").write_text(f"file {i}\n" * (i % 40 + 1))
    (root / "big.bin").write_bytes(os.urandom(5 << 20))
    (root / "tool.sh").write_text("#!/bin/sh\n")
    (root / "tool.sh").chmod(0o755)
    os.symlink("d0/s0/f0.txt", root / "link")
    backends = [base / f"backend{i}" for i in range(3)]
    for b in backends:
        b.mkdir()
    with Repository.init(root, [f"dir:{b}" for b in backends], passphrase=lambda: PASSPHRASE) as repo:
        repo.push("all")
    yield root, backends


def keyed(backends: list[Path]) -> str:
    """The URI of a backend that holds the key file (a clone starts from one)."""
    return next(f"dir:{b}" for b in backends if any((b / "metasync" / "keys").iterdir()))


def spy(monkeypatch: pytest.MonkeyPatch) -> list[ForkedShare[Any]]:
    """Record each share a checkout starts, and how many jobs its copy ran."""
    from metasync import checkout_share

    started: list[ForkedShare[Any]] = []
    real = checkout_share.ForkedShare.start

    def start(*args: Any, **kwargs: Any) -> ForkedShare[Any] | None:
        share = real(*args, **kwargs)
        if share is not None:
            started.append(share)
            share.copied = 0  # type: ignore[attr-defined]
            theirs = share.theirs

            def counting(**kw: Any) -> Iterator[Any]:
                for item in theirs(**kw):
                    share.copied += item[0] is not None  # type: ignore[attr-defined]
                    yield item
            share.theirs = counting  # type: ignore[method-assign]
        return share

    monkeypatch.setattr(checkout_share.ForkedShare, "start", start)
    return started


def test_a_fresh_clone_is_written_by_two_processes(
    pushed: tuple[Path, list[Path]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root, backends = pushed
    started = spy(monkeypatch)
    with Repository.clone(keyed(backends), tmp_path / "copy",
                          passphrase=lambda: PASSPHRASE) as repo:
        assert repo.status().clean
    assert snapshot(tmp_path / "copy") == snapshot(root)
    assert len(started) == 1 and started[0].copied > 0  # type: ignore[attr-defined]
    assert ended(started[0].pid, 0)


def test_a_failed_shared_clone_leaves_nothing(
    pushed: tuple[Path, list[Path]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The small file written last is damaged in its pack on every backend: the
    clone fails once both processes wrote many files, and removes everything it
    wrote -- the copy's files too."""
    root, backends = pushed
    with Repository.open(root) as repo:
        db = repo._ctx.db
        refs = {r.ref for r in db.index_rows().values() if r.type == "file" and r.size < 1000}
        pack_id, last = max(db.locations(refs).values(), key=lambda loc: loc[1].offset)
    packs = [b / "metasync" / "objects" / pack_id[:2] / pack_id for b in backends]
    originals = {p: p.read_bytes() for p in packs if p.exists()}
    assert len(originals) == 2  # R=2
    for p, data in originals.items():
        at = last.offset + last.length // 2
        p.write_bytes(data[:at] + bytes([data[at] ^ 0xFF]) + data[at + 1:])
    started = spy(monkeypatch)
    try:
        with pytest.raises((CorruptObject, ObjectUnavailable)):
            Repository.clone(keyed(backends), tmp_path / "new",
                             passphrase=lambda: PASSPHRASE)
    finally:
        for p, data in originals.items():
            p.write_bytes(data)
    assert not (tmp_path / "new").exists()
    assert len(started) == 1 and ended(started[0].pid, 0)
    assert started[0].copied > 0  # type: ignore[attr-defined]


@pytest.mark.parametrize("how", ["SIGKILL", "Ctrl-C"])
def test_a_shared_clone_interrupted_is_finished_by_pull(
    pushed: tuple[Path, list[Path]], tmp_path: Path, how: str
) -> None:
    """Killed (the copy dies with it) or interrupted by Ctrl-C (both stop) while the
    copy is in the middle of its jobs: no process is left, nothing leaks out as
    a traceback, and ``pull`` (or the clone again, if it was undone) finishes the
    clone exactly."""
    root, backends = pushed
    folder = tmp_path / "copy"
    pause = tmp_path / "pause"
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("METASYNC_CRASH", "METASYNC_PASSPHRASE", "METASYNC_PAUSE"))}
    env.update(METASYNC_PASSPHRASE=PASSPHRASE, METASYNC_PAUSE_AT="share:sent",
               METASYNC_PAUSE_FILE=str(pause))
    proc = subprocess.Popen([METASYNC, "clone", keyed(backends), str(folder)], cwd=tmp_path,
                            env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, start_new_session=True)
    try:
        deadline = time.monotonic() + LIMIT
        while proc.poll() is None and not Path(f"{pause}.reached").exists():
            assert time.monotonic() < deadline, "the clone's copy never sent a job"
            time.sleep(0.002)
        assert proc.poll() is None, proc.communicate()[1].decode()
        copies = children(proc.pid)
        assert len(copies) == 1
        if how == "SIGKILL":
            proc.kill()  # the parent only: the copy must die with it
        else:
            os.killpg(proc.pid, signal.SIGINT)  # as a terminal sends Ctrl-C
        proc.wait(LIMIT)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.stderr is not None
    said = proc.stderr.read().decode()
    proc.stderr.close()
    assert proc.returncode != 0
    assert ended(copies[0]), "the second process outlived the clone"
    assert "Traceback" not in said, said
    env = {k: v for k, v in env.items() if not k.startswith("METASYNC_PAUSE")}
    if (folder / META_DIR).is_dir():
        subprocess.run([METASYNC, "pull"], cwd=folder, env=env, check=True,
                       capture_output=True, timeout=LIMIT * 5)
    else:  # a Ctrl-C undoes a clone: nothing of it is left
        assert not folder.exists(), list(folder.iterdir())
        with Repository.clone(keyed(backends), folder, passphrase=lambda: PASSPHRASE):
            pass
    assert snapshot(folder) == snapshot(root)
