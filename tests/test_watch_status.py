"""`metasync status` answered by the daemon watching the folder (metasync.watch_status,
metasync.watch_client, metasync.entry): the same answer as a scan after every kind
of change, made while the daemon runs; a scan when no daemon answers, when it is
busy, or when the socket is not the user's own; and a start-up that loads nothing
heavy."""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest

from conftest import METASYNC, PASSPHRASE, run_cli
from metasync.entry import fast_status_flags
from metasync.watch_client import PROTOCOL, SOCKET_NAME

DAEMON_SAYS = "metasync: status answered by the daemon"


def _wait_until(condition: Callable[[], bool], timeout: float, what: str) -> None:
    tick = threading.Event()
    for _ in range(int(timeout / 0.1) + 1):
        if condition():
            return
        tick.wait(0.1)
    raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")


def _folder(tmp_path: Path, backends: list[Path]) -> Path:
    root = tmp_path / "a"
    (root / "docs").mkdir(parents=True)
    for i in range(12):
        (root / "docs" / f"f{i}.txt").write_text(f"file {i}\n")
    (root / "keep.txt").write_text("kept\n")
    (root / ".metasyncignore").write_text("*.tmp\nbuild/\n")
    (root / "build").mkdir()
    run_cli("init", str(root), *(f"--backend=dir:{b}" for b in backends))
    run_cli("push", cwd=root)
    return root


@pytest.fixture
def watched(tmp_path: Path, backends: list[Path]) -> Iterator[Path]:
    """A pushed folder with its daemon running; the daemon never syncs local
    changes here (they settle for an hour), so status has something to show."""
    root = _folder(tmp_path, backends)
    env = {**os.environ, "METASYNC_PASSPHRASE": PASSPHRASE}
    proc = subprocess.Popen([METASYNC, "daemon", "--settle", "3600", "--poll", "3600",
                             "--rescan", "3600"],
                            cwd=root, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        sock = root / ".metasync" / SOCKET_NAME
        _wait_until(lambda: sock.exists() or proc.poll() is not None, 60, "the daemon's socket")
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        # The daemon's first sync holds the folder: then it answers "busy".
        _wait_until(lambda: DAEMON_SAYS in _status(root, "--debug")[1], 60,
                    "the daemon's first answer")
        yield root
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)


def _status(root: Path, *args: str) -> tuple[str, str, int]:
    proc = run_cli("status", *args, cwd=root, check=False)
    return proc.stdout, proc.stderr, proc.returncode


ALL_FORMS = (("--json",), (), ("--offline",), ("--json", "--offline"), ("-q",))


def _same_as_a_scan(root: Path, forms: tuple[tuple[str, ...], ...] = (("--json",), ())
                    ) -> list[str]:
    """Assert that the daemon's answer in each of ``forms`` is exactly what a scan
    prints (asked first: a scan may write the stat cache, which the daemon sees as
    a change); return how each answer was made ("scan" or "cache")."""
    fast = [_status(root, "--debug", *args) for args in forms]
    hows = []
    for args, (out, err, code) in zip(forms, fast, strict=True):
        assert err.startswith(DAEMON_SAYS), (args, err)
        hows.append(err.split("(", 1)[1].split(")", 1)[0])
        assert (out, err.split("\n", 1)[1], code) == _status(root, "--scan", *args), args
        assert code == 0
    return hows


def test_the_daemons_answer_is_a_scans_after_every_change(watched: Path) -> None:
    """Edit, create, delete, rename, chmod, a new folder, an ignored file, the
    ignore file, a local commit: after each (made while the daemon runs), the
    daemon's answer -- JSON and text, with and without --offline -- is exactly
    what a scan prints, and it answers from its cache while nothing changed."""
    root = watched
    docs = root / "docs"
    assert _same_as_a_scan(root, ALL_FORMS) == ["cache"] * 5  # nothing changed: no scan
    steps: list[tuple[str, Callable[[], object]]] = [
        ("edit", lambda: (docs / "f0.txt").write_text("edited, longer\n")),
        ("edit keeping the size", lambda: (docs / "f1.txt").write_text("FILE 1\n")),
        ("create", lambda: (root / "new.txt").write_text("new\n")),
        ("delete", lambda: (docs / "f2.txt").unlink()),
        ("rename", lambda: (docs / "f3.txt").rename(docs / "f3-renamed.txt")),
        ("rename a folder", lambda: docs.rename(root / "papers")),
        ("chmod +x", lambda: (root / "keep.txt").chmod(0o755)),
        ("new folder", lambda: (root / "empty").mkdir()),
        ("ignore file", lambda: (root / ".metasyncignore").write_text("*.tmp\nbuild/\nnew.txt\n")),
    ]
    if os.geteuid() != 0:  # root reads a file whatever its mode
        steps.append(("chmod 000", lambda: (root / "papers" / "f4.txt").chmod(0)))
    for what, change in steps:
        change()
        hows = _same_as_a_scan(root)
        assert hows[0] == "scan", (what, hows)  # the change was seen
        assert hows[1:] == ["cache"], (what, hows)
    changed = json.loads(_status(root, "--json")[0])["changes"]
    assert {"path": "papers/f3-renamed.txt", "change": "added", "type": "file"} in changed

    # A file in an ignored folder changes nothing: still answered from the cache
    # (once the daemon has seen what the scans above wrote to the stat cache). (A
    # new ignored file beside synced ones is a rescan: its folder's event counts.)
    _status(root, "--debug")
    (root / "build" / "out.o").write_text("ignored\n")
    assert _same_as_a_scan(root) == ["cache"] * 2
    # A local commit (the repository's state, not the folder) is seen too.
    run_cli("commit", "-m", "local", cwd=root)
    assert _same_as_a_scan(root, ALL_FORMS)[0] == "scan"
    assert json.loads(_status(root, "--json")[0])["ahead"] == 1


def test_a_busy_folder_or_no_daemon_is_scanned(watched: Path) -> None:
    """While a command holds the folder the daemon says busy and the command scans
    (the same output, as before); after the daemon stops, no answer, a scan."""
    import fcntl

    root = watched
    (root / "new.txt").write_text("new\n")
    with open(root / ".metasync" / "lock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        out, err, code = _status(root, "--debug", "--json")
        assert DAEMON_SAYS not in err and code == 0
        fcntl.flock(held, fcntl.LOCK_UN)
    assert out == _status(root, "--json", "--scan")[0]
    assert '"new.txt"' in out


def test_no_daemon_a_stale_socket(tmp_path: Path, backends: list[Path]) -> None:
    """No socket, or a socket nobody listens on (a daemon killed): status scans."""
    root = _folder(tmp_path, backends)
    out, err, code = _status(root, "--debug")
    assert code == 0 and DAEMON_SAYS not in err and "Nothing to commit" in out
    stale = socket.socket(socket.AF_UNIX)
    os.chdir(root / ".metasync")  # a short path: the test's folder may be long
    try:
        stale.bind(SOCKET_NAME)
    finally:
        os.chdir(tmp_path)
    stale.close()
    os.chmod(root / ".metasync" / SOCKET_NAME, 0o600)
    out, err, code = _status(root, "--debug")
    assert code == 0 and DAEMON_SAYS not in err and "Nothing to commit" in out


class _Impostor:
    """A server on ``.metasync/daemon.sock`` that answers every request with a
    made-up status (what another local user would try)."""

    ANSWER: ClassVar[dict[str, Any]] = {
        "json": '{"impostor": true}', "text": [["out", "all is well (impostor)"]], "how": "cache"}

    def __init__(self, meta: Path) -> None:
        self.sock = socket.socket(socket.AF_UNIX)
        here = os.getcwd()
        os.chdir(meta)
        try:
            self.sock.bind(SOCKET_NAME)
        finally:
            os.chdir(here)
        self.sock.listen(4)
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                conn.recv(4096)
                conn.sendall(json.dumps({"v": PROTOCOL, "ok": True,
                                         "answer": self.ANSWER}).encode())

    def close(self) -> None:
        self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()


def test_only_the_users_own_socket_is_trusted(tmp_path: Path, backends: list[Path]) -> None:
    """The answer is taken only from a socket of the user's, closed to others, in a
    .metasync no one else can write to: an impostor's answer is otherwise ignored
    and the folder scanned. (Its answer is taken when everything is the user's:
    that is what makes the refusals below mean something.)"""
    root = _folder(tmp_path, backends)
    meta = root / ".metasync"
    sock = meta / SOCKET_NAME
    impostor = _Impostor(meta)
    try:
        os.chmod(sock, 0o600)
        assert _status(root)[0] == "all is well (impostor)\n"  # the baseline
        os.chmod(sock, 0o666)  # open to other users
        assert "Nothing to commit" in _status(root)[0]
        os.chmod(sock, 0o600)
        os.chmod(meta, 0o770)  # others may plant a socket in .metasync
        assert "Nothing to commit" not in _status(root)[0]  # refused: unsafe folder
        assert "impostor" not in _status(root)[0] + _status(root)[1]
        os.chmod(meta, 0o700)
        if os.geteuid() == 0:
            os.chown(sock, 12345, 12345, follow_symlinks=False)  # another user's socket
            assert "Nothing to commit" in _status(root)[0]
            os.chown(sock, 0, 0, follow_symlinks=False)
        assert _status(root)[0] == "all is well (impostor)\n"  # everything back: taken
    finally:
        impostor.close()


def test_fast_status_flags() -> None:
    """Which command lines the console script answers before loading the CLI."""
    assert fast_status_flags(["status"]) == set()
    assert fast_status_flags(["--json", "-q", "status", "--offline"]) == {"json", "quiet",
                                                                           "offline"}
    assert fast_status_flags(["status", "--json", "--debug"]) == {"json", "debug"}
    for argv in (["status", "--scan"], ["--offline", "status"], ["status", "--help"],
                 ["--timeout", "5", "status"], ["push"], ["log"], ["status", "x"]):
        assert fast_status_flags(argv) is None, argv


def test_the_fast_path_loads_nothing_heavy() -> None:
    """What `metasync status` imports before asking the daemon: no click, no
    repository (the start-up cost the fast path is for)."""
    code = ("import sys, metasync.entry, metasync.watch_client; "
            "print(' '.join(sorted(m for m in sys.modules "
            "if m.split('.')[0] in ('metasync', 'click', 'watchdog', 'sqlite3'))))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True).stdout.split()
    assert loaded == ["metasync", "metasync.entry", "metasync.watch_client"]


def test_daemon_removes_its_socket(tmp_path: Path, backends: list[Path]) -> None:
    """The socket is 0600 while the daemon runs, and gone once it stopped."""
    root = _folder(tmp_path, backends)
    env = {**os.environ, "METASYNC_PASSPHRASE": PASSPHRASE}
    proc = subprocess.Popen([METASYNC, "daemon", "--settle", "3600", "--poll", "3600"],
                            cwd=root, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    sock = root / ".metasync" / SOCKET_NAME
    try:
        _wait_until(sock.exists, 60, "the daemon's socket")
        st = os.lstat(sock)
        assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)
    assert not sock.exists()


EXIT_WITH_THE_WATCH_RUNNING = """
import logging, sys
from pathlib import Path
from watchdog.observers import Observer
from metasync.watch_status import answer_status
root = Path(sys.argv[1])
observer = Observer()
observer.schedule(type("H", (), {"dispatch": lambda self, e: None})(), str(root), recursive=True)
observer.start()
answer_status(observer, root, lambda path: True, logging.getLogger("t"))
assert (root / ".metasync" / "daemon.sock").exists()
print("listening", flush=True)
# The process ends with the watch still running: the thread that stops the answers
# when the watch ends never gets its turn.
"""


@pytest.mark.skipif(sys.platform == "win32", reason="no status socket on Windows")
def test_the_socket_goes_when_the_process_ends_first(tmp_path: Path) -> None:
    """A process that ends before its watch does (the daemon's last steps race the
    thread that ends the answers with the watch) still removes its socket."""
    root = tmp_path / "folder"
    (root / ".metasync").mkdir(parents=True, mode=0o700)
    done = subprocess.run([sys.executable, "-c", EXIT_WITH_THE_WATCH_RUNNING, str(root)],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0 and "listening" in done.stdout, done.stderr
    assert not (root / ".metasync" / SOCKET_NAME).exists()
