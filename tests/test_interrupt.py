"""Ctrl-C (SIGINT, and SIGTERM alike) through the CLI: a push, a clone stops its
transfers, says what it kept and exits 130; a second Ctrl-C quits at once; the next
command finishes the job; read-only commands work while a push holds the folder.

The backends are two folders on the test's OpenSSH server reached through a
:class:`Valve`, a loopback proxy that slows the link (as a real uplink is slow) or
holds it shut (a backend call stuck in the network). Nothing here waits a fixed
time or asserts on timing: each step waits for an observable event (a temporary
file on the server, a line on stderr, bytes through the proxy) with a generous
deadline, and a command that does not stop within the subprocess timeout fails.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import queue
import random
import re
import signal
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from metasync import Repository
from metasync.errors import FolderBusy
from tests.conftest import METASYNC, PASSPHRASE, run_cli, snapshot
from tests.servers.sshd import SshServer

#: Longest any step may take before the test fails (never a measured bound).
DEADLINE = 30.0


class Valve:
    """A TCP proxy to ``port`` whose two directions share one link each: ``up``
    (client to server) and ``down`` bytes per second (None: unlimited), and the
    upward one can be held shut (:meth:`hold`) and opened again (:meth:`release`)."""

    def __init__(self, port: int) -> None:
        self.target = ("127.0.0.1", port)
        self.rate: dict[str, float | None] = {"up": None, "down": None}
        self.moved = {"up": 0, "down": 0}
        self._free_at = {"up": 0.0, "down": 0.0}
        self._lock = threading.Lock()
        self._open = threading.Event()
        self._open.set()
        self._sockets: list[socket.socket] = []
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def hold(self) -> None:
        self._open.clear()

    def release(self) -> None:
        self._open.set()

    def _serve(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.target)
            with self._lock:
                self._sockets += [client, server]
            threading.Thread(target=self._pump, args=(client, server, "up"), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, "down"), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, way: str) -> None:
        try:
            while data := src.recv(16384):
                if way == "up":
                    self._open.wait()
                rate = self.rate[way]
                if rate:
                    with self._lock:
                        start = max(time.monotonic(), self._free_at[way])
                        self._free_at[way] = done_at = start + len(data) / rate
                    pause = done_at - time.monotonic()
                    if pause > 0:
                        time.sleep(pause)  # emulating a slow link, not synchronising
                dst.sendall(data)
                with self._lock:
                    self.moved[way] += len(data)
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    def close(self) -> None:
        self._open.set()
        self._listener.close()
        with self._lock:
            for sock in self._sockets:
                with contextlib.suppress(OSError):
                    sock.close()


class Running:
    """A ``metasync`` command started in the background, its stderr read line by line."""

    def __init__(self, args: list[str], cwd: Path, env: dict[str, str]) -> None:
        self.proc = subprocess.Popen([METASYNC, *args], cwd=cwd, env=env, text=True,
                                     stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE)
        self.lines: queue.Queue[str] = queue.Queue()
        self.err: list[str] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.err.append(line)
            self.lines.put(line)

    def wait_for_line(self, pattern: str) -> str:
        deadline = time.monotonic() + DEADLINE
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=deadline - time.monotonic())
            except queue.Empty:
                break
            if re.search(pattern, line):
                return line
        raise AssertionError(f"no line matching {pattern!r} on stderr: {''.join(self.err)}")

    def interrupt(self, sig: int = signal.SIGINT) -> None:
        self.proc.send_signal(sig)

    def interrupt_a_worker_thread(self, sig: int = signal.SIGINT) -> None:
        """Send ``sig`` to one of the command's threads other than its main one, as
        the kernel may when a process-wide signal arrives (tgkill(2))."""
        pid = self.proc.pid
        workers = sorted(int(t) for t in os.listdir(f"/proc/{pid}/task") if int(t) != pid)
        assert workers, "the command runs no other thread"
        if ctypes.CDLL(None, use_errno=True).tgkill(pid, workers[0], sig) != 0:
            raise OSError(ctypes.get_errno(), "tgkill failed")

    def finish(self) -> tuple[int, str]:
        """Exit code and stderr; fails if the command does not end within the deadline."""
        try:
            self.proc.wait(timeout=DEADLINE)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"still running {DEADLINE:g} s after the signal: "
                                 f"{''.join(self.err)}") from None
        assert self.proc.stdout is not None
        self.proc.stdout.read()
        self.reader.join(DEADLINE)  # stderr is read to its end
        return self.proc.returncode, "".join(self.err)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def wait_until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + DEADLINE
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def temp_files(folder: Path) -> list[Path]:
    return [p for p in folder.rglob(".tmp-*")]


class Setup:
    def __init__(self, tmp_path: Path, sshd: SshServer, valve: Valve) -> None:
        self.tmp = tmp_path
        self.valve = valve
        tag = uuid.uuid4().hex[:8]
        self.stores = [sshd.root_dir / f"interrupt-{tag}-{i}" for i in range(2)]
        known = sshd.known_hosts_for(valve.port, tmp_path / "known_hosts")
        self.uris = [sshd.uri(s, port=valve.port, known_hosts=known) for s in self.stores]
        self.work = tmp_path / "work"
        self.env = {k: v for k, v in os.environ.items() if k != "METASYNC_PASSPHRASE"}
        self.env["METASYNC_PASSPHRASE"] = PASSPHRASE
        # Many objects, so an interrupted push has finished some and not others.
        self.env["METASYNC_PACK_SIZE"] = str(256 * 1024)
        self.pause = tmp_path / "pause"

    def cli(self, *args: str, cwd: Path | None = None, check: bool = True
            ) -> subprocess.CompletedProcess[str]:
        return run_cli(*args, cwd=cwd or self.work, check=check,
                       env_extra={"METASYNC_PACK_SIZE": self.env["METASYNC_PACK_SIZE"]})

    def start(self, *args: str, cwd: Path | None = None, held_in_flush: bool = False
              ) -> Running:
        """Run a command in the background; ``held_in_flush``: a push holds at the
        start of its flush until :meth:`flushing` sees it there."""
        env = self.env
        if held_in_flush:
            env = {**env, "METASYNC_PAUSE_AT": "upload:flush",
                   "METASYNC_PAUSE_FILE": str(self.pause)}
        return Running(list(args), cwd or self.work, env)

    def interrupt_when(self, run: Running, ready: Callable[[], bool], what: str) -> str:
        """Once ``ready()``, Ctrl-C ``run``; check it exits 130 without a traceback and
        return its stderr."""
        try:
            wait_until(ready, what)
            run.interrupt()
            code, err = run.finish()
        finally:
            run.kill()
        assert code == 130, err
        assert "Traceback" not in err
        return err

    def downloaded_over(self, count: int) -> Callable[[], bool]:
        """A condition: more than ``count`` bytes came down the link from now on."""
        before = self.valve.moved["down"]
        return lambda: self.valve.moved["down"] - before > count

    def fill(self, megabytes: int, seed: int = 1) -> None:
        rng = random.Random(seed)
        folder = self.work / f"data-{seed}"
        folder.mkdir()
        for i in range(megabytes * 2):
            (folder / f"f{i:03d}.bin").write_bytes(rng.randbytes(512 * 1024))

    def uploading(self) -> bool:
        """True once an object's upload has begun (its temporary file is there)."""
        return any(p.parent.parent.name == "objects" for s in self.stores if s.exists()
                   for p in temp_files(s))

    def stored(self) -> dict[Path, int]:
        """Every whole object (not a temporary file) on the backends, with its inode
        (an object uploaded again is a new file)."""
        return {p: p.stat().st_ino for s in self.stores if s.exists() for p in s.rglob("*")
                if p.parent.parent.name == "objects" and not p.name.startswith(".tmp-")}

    def on_both(self, stored: dict[Path, int] | None = None) -> set[str]:
        """The objects whole on both backends (of ``stored``, default: now)."""
        stored = self.stored() if stored is None else stored
        names = [{p.name for p in stored if s in p.parents} for s in self.stores]
        return names[0] & names[1]

    def flushing(self) -> bool:
        """True once a push (started ``held_in_flush``) is in its flush, where a
        Ctrl-C says how much it kept; it is let go on from there, its early uploads
        running. No file on the backends can say so: the commit is recorded while
        packs still upload, and a signal landing in the few steps between the two
        reports "the push stopped" instead (CI saw it)."""
        if not self.pause.with_suffix(".reached").exists():
            return False
        self.pause.with_suffix(".release").touch()
        return True


@pytest.fixture
def setup(tmp_path: Path, sshd_server: SshServer) -> Iterator[Setup]:
    valve = Valve(sshd_server.port)
    s = Setup(tmp_path, sshd_server, valve)
    run_cli("init", str(s.work), "--backend", s.uris[0], "--backend", s.uris[1], cwd=tmp_path)
    try:
        yield s
    finally:
        valve.close()


def test_ctrl_c_stops_a_push_and_the_next_push_finishes(setup: Setup) -> None:
    """Ctrl-C during a push on a slow link stops the transfers in flight, says how
    many objects were kept, exits 130 without a traceback and leaves no temporary
    file. What it kept stays announced to gc: after a pull (which announces this
    client's state again) and another client's gc that collects other garbage, the
    next push leaves the kept objects as they are (neither collected nor uploaded
    again), fsck finds every copy, a clone is identical."""
    (setup.work / "old.bin").write_bytes(random.Random(9).randbytes(300_000))
    setup.cli("push", "-m", "old")
    (setup.work / "old.bin").unlink()
    setup.cli("push", "-m", "without old")  # old.bin's pack is garbage at retention 0
    other = setup.tmp / "other"  # another client, which cannot read this one's new commit
    setup.cli("clone", setup.uris[0], str(other), "--backend", setup.uris[1], cwd=setup.tmp)
    setup.fill(24)  # 24 MB, 48 MB of copies: far longer than the deadline at 1 MB/s
    setup.valve.rate["up"] = 1_000_000
    push = setup.start("push", "-m", "big", held_in_flush=True)
    # Interrupted while the flush waits for the packs it began uploading as it
    # committed (most of a push on a slow link), once some are on both backends (the
    # third: the first has long been recorded as placed).
    before = setup.stored()
    err = setup.interrupt_when(
        push, lambda: len(setup.on_both()) >= len(before) // 2 + 3 and setup.flushing(),
        "the push to commit and upload three objects")
    now = setup.stored()
    new = setup.on_both(now) - {p.name for p in before}
    went_up = {p: ino for p, ino in now.items() if p.name in new}
    kept = re.search(r"metasync: interrupted: (\d+) of (\d+) objects uploaded; the next push "
                     r"continues", err)
    assert kept, err
    uploaded, total = int(kept.group(1)), int(kept.group(2))
    assert 0 < uploaded < total, err  # what went up is kept ...
    assert not [p for s in setup.stores for p in temp_files(s)]
    setup.valve.rate["up"] = None
    setup.cli("config", "retention", "0", cwd=other)  # a new version ...
    assert "Updated to version" in setup.cli("pull").stdout  # ... pulled: announced anew
    assert "collected" in setup.cli("gc", cwd=other).stdout
    setup.cli("push")
    after = setup.stored()
    assert {p: after.get(p) for p in went_up} == went_up  # ... neither collected nor sent again
    assert "ok:" in setup.cli("fsck").stdout
    clone = setup.tmp / "clone"
    setup.cli("clone", setup.uris[1], str(clone), "--backend", setup.uris[0], cwd=setup.tmp)
    assert snapshot(clone) == snapshot(setup.work)


def test_the_next_push_sends_no_copy_an_interrupted_push_finished(setup: Setup) -> None:
    """An object of an interrupted push that got its copy on one backend but not yet
    on the other stays queued (it is not placed); the next push sends it only to the
    backend that lacks it, not again to the one that holds it whole (before, such
    objects -- every one in flight at the Ctrl-C -- were sent again to every holder).
    fsck finds every copy, a clone is identical."""
    setup.fill(8)  # 8 MB, 16 MB of copies at 1 MB/s
    setup.valve.rate["up"] = 1_000_000
    push = setup.start("push", "-m", "big", held_in_flush=True)

    def one_only() -> set[str]:
        stored = setup.stored()
        names = [{p.name for p in stored if s in p.parents} for s in setup.stores]
        return names[0] ^ names[1]

    setup.interrupt_when(push, lambda: setup.flushing() and len(one_only()) >= 2,
                         "the push to upload the first copies of two objects")
    stored = setup.stored()
    partial = {p: ino for p, ino in stored.items() if p.name in one_only()}
    assert partial, "no object was left with one copy"
    setup.valve.rate["up"] = None
    setup.cli("push")
    after = setup.stored()
    assert {p: after.get(p) for p in partial} == partial  # not sent again
    assert {p.name for p in partial} <= setup.on_both(after)  # the other copy made
    assert "ok:" in setup.cli("fsck").stdout
    clone = setup.tmp / "clone"
    setup.cli("clone", setup.uris[1], str(clone), "--backend", setup.uris[0], cwd=setup.tmp)
    assert snapshot(clone) == snapshot(setup.work)


def test_sigterm_stops_a_push_like_ctrl_c(setup: Setup) -> None:
    """SIGTERM is handled as Ctrl-C is."""
    setup.fill(24)
    setup.valve.rate["up"] = 1_000_000
    push = setup.start("push", held_in_flush=True)
    try:
        wait_until(setup.flushing, "the push to commit and upload")
        push.interrupt(signal.SIGTERM)
        code, err = push.finish()
    finally:
        push.kill()
    assert code == 130, err
    assert "objects uploaded; the next push continues" in err and "Traceback" not in err, err


def test_a_second_ctrl_c_quits_at_once(setup: Setup) -> None:
    """While the first Ctrl-C waits for an upload stuck in a backend call (the link
    is held shut: the call never returns to check), a second one exits at once; the
    next push, once the link is back, finishes and fsck is clean. Both signals go to
    a worker thread, not the main one, which waits on the stuck upload: the kernel
    may deliver a process-wide signal to any thread (before the fix, the push then
    said nothing and the second Ctrl-C did nothing)."""
    setup.fill(8)
    setup.valve.rate["up"] = 1_000_000
    push = setup.start("push")
    try:
        wait_until(setup.uploading, "the push to start uploading")
        setup.valve.hold()
        push.interrupt_a_worker_thread()
        push.wait_for_line(r"stopping transfers .*Ctrl-C again")
        push.interrupt_a_worker_thread()
        code, err = push.finish()
    finally:
        push.kill()
        setup.valve.release()
    assert code == 130, err
    assert "interrupted again: stopped at once" in err and "Traceback" not in err
    setup.valve.rate["up"] = None
    setup.cli("push")
    assert "ok:" in setup.cli("fsck").stdout


def test_ctrl_c_stops_a_clone_and_pull_finishes_it(setup: Setup) -> None:
    """A clone interrupted while downloading exits 130 saying how to finish it; a
    pull in the clone then finishes it, identical to the original."""
    setup.fill(24)
    setup.cli("push")
    clone = setup.tmp / "clone"
    setup.valve.rate["down"] = 1_000_000
    run = setup.start("clone", setup.uris[0], str(clone), "--backend", setup.uris[1],
                      cwd=setup.tmp)
    err = setup.interrupt_when(run, setup.downloaded_over(2_000_000), "the clone to download")
    assert f"interrupted: the clone stopped; `metasync pull` in {clone} finishes it" in err
    setup.valve.rate["down"] = None
    setup.cli("pull", cwd=clone)
    assert snapshot(clone) == snapshot(setup.work)


def test_read_only_commands_work_while_a_push_holds_the_folder(setup: Setup) -> None:
    """status, log, backend list, snapshot (listing) and daemon status answer while
    a push is uploading; a command that writes is still refused."""
    setup.fill(1)
    setup.cli("push", "-m", "first")
    setup.fill(24, seed=2)
    setup.valve.rate["up"] = 1_000_000
    push = setup.start("push", "-m", "second", held_in_flush=True)
    try:
        wait_until(setup.flushing, "the push to commit and upload")
        status = setup.cli("--timeout", "10", "status", check=False)
        assert status.returncode == 0, status.stderr
        # The push committed before uploading: the folder is its commit.
        assert "On version 1 (local commits not pushed)" in status.stdout
        log = setup.cli("--timeout", "10", "log", check=False)
        assert log.returncode == 0, log.stderr
        assert "first" in log.stdout
        listing = setup.cli("--timeout", "10", "backend", "list", check=False)
        assert listing.returncode == 0, listing.stderr
        assert "2 replica(s)" in listing.stdout
        snaps = setup.cli("--timeout", "10", "snapshot", check=False)
        assert snaps.returncode == 0, snaps.stderr
        daemon = setup.cli("--timeout", "10", "daemon", "status", check=False)
        assert daemon.returncode == 0, daemon.stderr
        writer = setup.cli("--timeout", "1", "commit", check=False)
        assert writer.returncode == 2 and "is using" in writer.stderr, writer.stderr
        assert setup.uploading() or push.proc.poll() is None
        push.interrupt()
        code, err = push.finish()
    finally:
        push.kill()
    assert code == 130, err
    setup.valve.rate["up"] = None
    setup.cli("push")
    assert "ok:" in setup.cli("fsck").stdout


def test_ctrl_c_stops_a_pull_and_the_next_pull_finishes(setup: Setup) -> None:
    """A pull interrupted while downloading a new version exits 130 saying the next
    pull finishes it; that pull does, identical to the original."""
    setup.fill(1)
    setup.cli("push")
    clone = setup.tmp / "clone"
    setup.cli("clone", setup.uris[0], str(clone), "--backend", setup.uris[1], cwd=setup.tmp)
    setup.fill(24, seed=2)
    setup.cli("push")
    setup.valve.rate["down"] = 1_000_000
    err = setup.interrupt_when(setup.start("pull", cwd=clone), setup.downloaded_over(2_000_000),
                               "the pull to download")
    assert "interrupted: the pull stopped; files already written are kept and `metasync pull` " \
           "finishes it" in err
    setup.valve.rate["down"] = None
    assert "Updated to version 2" in setup.cli("pull", cwd=clone).stdout
    assert snapshot(clone) == snapshot(setup.work)


def test_stopping_the_daemon_stops_its_push(setup: Setup) -> None:
    """SIGTERM (what `daemon stop` sends) to a daemon in the middle of a slow push
    stops the push's transfers too, so the daemon exits without uploading the rest;
    while it held the folder, status and daemon status answered. The next push
    finishes."""
    setup.fill(24)
    setup.valve.rate["up"] = 1_000_000
    run = setup.start("daemon", "--settle", "0", "--poll", "3600", held_in_flush=True)
    try:
        wait_until(setup.flushing, "the daemon to commit and upload")
        status = setup.cli("--timeout", "10", "status", check=False)
        assert status.returncode == 0, status.stderr
        state = setup.cli("--timeout", "10", "daemon", "status", check=False)
        assert state.returncode == 0 and "syncing" in state.stdout, state.stdout + state.stderr
        run.interrupt(signal.SIGTERM)
        code, err = run.finish()
    finally:
        run.kill()
    assert code == 0, err
    assert "Traceback" not in err
    log = (setup.work / ".metasync" / "daemon.log").read_text()
    assert "stopped during a sync" in log and "objects uploaded" in log, log
    setup.valve.rate["up"] = None
    setup.cli("push")
    assert "ok:" in setup.cli("fsck").stdout


def test_a_read_only_open_beside_a_writer_reads_what_it_committed(
    tmp_path: Path, backends: list[Path], passphrase: Callable[[], str]
) -> None:
    """With the folder held by an open repository, ``Repository.open(read_only=True)``
    opens at once (a plain open would wait and fail), sees the holder's committed
    state, and its status writes nothing (the index stays as the holder left it)."""
    work = tmp_path / "a"
    work.mkdir()
    (work / "doc.txt").write_text("v1\n")
    holder = Repository.init(work, [f"dir:{b}" for b in backends], passphrase=passphrase)
    try:
        holder.push("first")
        (work / "new.txt").write_text("new\n")
        holder.commit("second")
        db = work / ".metasync" / "state.db"
        before = db.stat().st_mtime_ns, (work / ".metasync" / "state.db-wal").stat().st_size
        with pytest.raises(FolderBusy):
            Repository.open(work, wait=0)
        with Repository.open(work, read_only=True) as reader:
            st = reader.status()
            assert st.version == 1 and st.unpushed and not st.changes
            assert [e.message for e in reader.log()] == ["second", "first"]
        after = db.stat().st_mtime_ns, (work / ".metasync" / "state.db-wal").stat().st_size
        assert after == before
    finally:
        holder.close()
