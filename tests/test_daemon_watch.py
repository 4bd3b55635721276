"""Daemon details: no watches left (it scans instead), and no echo of a pull."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path

from conftest import METASYNC, PASSPHRASE, run_cli

LIMIT = Path("/proc/sys/fs/inotify/max_user_watches")


def _wait_until(condition: Callable[[], bool], timeout: float, what: str) -> None:
    tick = threading.Event()
    for _ in range(int(timeout / 0.2) + 1):
        if condition():
            return
        tick.wait(0.2)
    raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")


def test_out_of_watches_falls_back_to_scanning(tmp_path: Path, backends: list[Path]) -> None:
    """With fewer inotify watches left than the folder has folders, the daemon
    cannot watch it: it logs that it scans instead, reports `watching: scanning`,
    and still syncs a new file to the other clone. (The real limit is lowered; on a
    kernel that ignores that, the watch is made to fail with the same error.)"""
    a = tmp_path / "a"
    for i in range(40):
        (a / f"d{i:02d}").mkdir(parents=True)
        (a / f"d{i:02d}" / "f.txt").write_text(f"{i}\n")
    run_cli("init", str(a), *(f"--backend=dir:{b}" for b in backends))
    run_cli("push", cwd=a)
    run_cli("clone", f"dir:{backends[1]}", str(tmp_path / "b"))
    env = {**os.environ, "METASYNC_PASSPHRASE": PASSPHRASE}
    writable = os.access(LIMIT, os.W_OK)  # root on Linux
    old = LIMIT.read_text() if writable else ""
    if writable:
        LIMIT.write_text("8\n")  # fewer than the 41 folders to watch
    try:
        proc = subprocess.Popen([METASYNC, "daemon", "--settle", "0.2", "--poll", "0.5"], cwd=a,
                                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    finally:
        if "proc" not in locals() and writable:
            LIMIT.write_text(old)
    try:  # whatever happens, the limit is restored and the daemon stopped
        log = a / ".metasync" / "daemon.log"
        try:
            _wait_until(lambda: log.exists() and "watching " in log.read_text(), 30,
                        "the daemon to start watching")
        finally:
            if writable:
                LIMIT.write_text(old)
        if "scanning every" not in log.read_text():
            # Some kernels (user namespaces) let the watches through despite the
            # lowered limit: then the daemon's watch is made to fail the same way.
            proc.send_signal(signal.SIGTERM)
            proc.communicate(timeout=60)
            log.unlink()
            proc = subprocess.Popen([METASYNC, "daemon", "--settle", "0.2", "--poll", "0.5"],
                                    cwd=a, env={**env, "METASYNC_FAIL_WATCH": "1"},
                                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            _wait_until(lambda: log.exists() and "watching " in log.read_text(), 30,
                        "the daemon to start")
        assert "inotify watch limit reached" in log.read_text()
        assert "scanning every 0.5s instead" in log.read_text()

        def scanning() -> bool:
            status = json.loads(run_cli("daemon", "status", "--json", cwd=a).stdout)
            return status.get("watching") == "scanning"

        _wait_until(scanning, 30, "`daemon status` to report scanning")
        (a / "d07" / "new.txt").write_text("found by a scan\n")

        def arrived() -> bool:
            run_cli("pull", cwd=tmp_path / "b", check=False)
            return (tmp_path / "b" / "d07" / "new.txt").exists()

        _wait_until(arrived, 30, "the new file to reach the other clone")
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err


def test_files_written_by_a_pull_do_not_echo_back(tmp_path: Path, backends: list[Path]) -> None:
    """A's daemon pushes 30 new files; B's daemon pulls them, which fires watch
    events for every file it writes. Those must not become a commit of B's: after
    B has synced again (twice, well after the files arrived), master is still A's
    version and no commit in history comes from B's client."""
    import time

    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    (a / "start.txt").write_text("start\n")
    run_cli("init", str(a), *(f"--backend=dir:{x}" for x in backends))
    run_cli("push", cwd=a)
    run_cli("clone", f"dir:{backends[1]}", str(b))
    env = {**os.environ, "METASYNC_PASSPHRASE": PASSPHRASE}
    args = [METASYNC, "daemon", "--settle", "0.3", "--poll", "0.5", "--rescan", "2"]
    procs = [subprocess.Popen(args, cwd=root, env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE) for root in (a, b)]
    try:
        for i in range(30):
            (a / "new" / f"{i:02d}").mkdir(parents=True)
            (a / "new" / f"{i:02d}" / "file.txt").write_text(f"file {i}\n")
        _wait_until(lambda: all((b / "new" / f"{i:02d}" / "file.txt").exists() for i in range(30)),
                    30, "B to receive the 30 files")
        arrived = time.time()

        def b_synced_twice_since() -> bool:
            status = json.loads(run_cli("daemon", "status", "--json", cwd=b).stdout)
            return (status.get("state") == "idle" and status.get("last_sync") is not None
                    and status["last_sync"] > arrived + 4.5)

        _wait_until(b_synced_twice_since, 30, "B's daemon to sync again after the pull")
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        for proc in procs:
            _, err = proc.communicate(timeout=60)
            assert proc.returncode == 0, err
    # (Without version numbers: each client knows those of the versions it synced with.)
    history_a, history_b = ([{k: v for k, v in e.items() if k != "version"}
                             for e in json.loads(run_cli("log", "--json", cwd=root).stdout)]
                            for root in (a, b))
    assert history_a == history_b
    b_status = json.loads((b / ".metasync" / "daemon.json").read_text())
    assert b_status["version"] == json.loads(run_cli("status", "--json", cwd=a).stdout)["version"]
    # Every commit is A's (the first is A's init push): B never committed its pull.
    first_client = history_a[-1]["client"]
    assert all(entry["client"] == first_client for entry in history_a), history_a
