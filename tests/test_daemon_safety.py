"""The daemon against the accidents of real life, with real daemon processes.

Two clones of one repository on three ``dir:`` backends, each with its own
``metasync daemon`` process (foreground, fast timings) or one started with
``metasync daemon start``. Backends vanish and come back, a whole folder is
moved away as an unmounted disk would be, most files are deleted at once, an
ignore file keeps things local -- and the daemons must neither lose nor delete
anything they should not, and catch up once things are back.

Nothing here sleeps to synchronise: every wait polls a condition with a deadline
(:func:`wait_until`). The only fixed wait is the 30 s a backend stays away, which
is the scenario itself.
"""

from __future__ import annotations

import configparser
import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import METASYNC, PASSPHRASE, run_cli, snapshot, wait_until

FAST = ["--settle", "0.5", "--poll", "0.5", "--rescan", "5"]


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["METASYNC_PASSPHRASE"] = PASSPHRASE
    env.update(extra)
    return env




def _files(root: Path) -> dict[str, bytes]:
    """Regular files under ``root`` (``.metasync`` excluded), by relative path."""
    out = {}
    for path in root.rglob("*"):
        rel = path.relative_to(root).as_posix()
        if rel == ".metasync" or rel.startswith(".metasync/") or not path.is_file():
            continue
        out[rel] = path.read_bytes()
    return out


def _status_file(root: Path) -> dict[str, Any]:
    """The daemon's status as written to ``.metasync/daemon.json`` (cheap to poll)."""
    doc: dict[str, Any] = json.loads((root / ".metasync" / "daemon.json").read_text())
    return doc


def _status_cli(root: Path) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(run_cli("daemon", "status", "--json", cwd=root).stdout)
    return doc


def _setup(tmp_path: Path, backends: list[Path], files: dict[str, str] | None = None
           ) -> tuple[Path, Path]:
    """Repository A (initialised with ``files``, pushed) and its clone B."""
    a = tmp_path / "A"
    a.mkdir()
    for name, text in (files or {"shared.txt": "shared\n"}).items():
        (a / name).parent.mkdir(parents=True, exist_ok=True)
        (a / name).write_text(text)
    run_cli("init", str(a), *(f"--backend=dir:{b}" for b in backends))
    run_cli("push", "-m", "start", cwd=a)
    b = tmp_path / "B"
    run_cli("clone", f"dir:{backends[1]}", str(b))
    return a, b


class Daemons:
    """Foreground ``metasync daemon`` processes, stopped with SIGTERM at the end."""

    def __init__(self) -> None:
        self.procs: list[tuple[subprocess.Popen[bytes], Path]] = []

    def start(self, root: Path, *extra: str) -> subprocess.Popen[bytes]:
        log = open(root.parent / f"{root.name}-daemon.out", "ab")  # noqa: SIM115
        proc = subprocess.Popen([METASYNC, "daemon", *FAST, *extra], cwd=root, env=_env(),
                                stdin=subprocess.DEVNULL, stdout=log, stderr=log)
        log.close()
        self.procs.append((proc, root))
        # Ready once its first sync is done (a daemon starts with a full check).
        wait_until(lambda: proc.poll() is None and _status_file(root).get("pid") == proc.pid
                   and _status_file(root).get("last_sync"), 30,
                   f"the daemon in {root} to finish its first sync")
        return proc

    def stop_all(self) -> list[str]:
        problems = []
        for proc, root in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            try:
                code = proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                code = -9
            if code != 0:
                out = (root.parent / f"{root.name}-daemon.out").read_text(errors="replace")
                problems.append(f"daemon for {root} exited {code}:\n{out[-2000:]}")
        return problems


@pytest.fixture
def daemons() -> Iterator[Daemons]:
    d = Daemons()
    yield d
    problems = d.stop_all()
    assert not problems, "\n".join(problems)


def _running(pid: int) -> bool:
    """True if process ``pid`` exists and is not a zombie (a daemon from `daemon start`
    is reparented to whichever process reaps orphans here, maybe late)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return False
    return fields[0] != "Z"


def _same_trees(a: Path, b: Path) -> bool:
    return snapshot(a) == snapshot(b)


def _fsck_ok(root: Path) -> bool:
    # The daemon holds the folder while it syncs: a busy answer just means "again".
    return run_cli("fsck", cwd=root, check=False).returncode == 0


def _synced_since(root: Path, when: float) -> bool:
    doc = _status_file(root)
    return doc.get("state") == "idle" and (doc.get("last_sync") or 0) > when


# ============================================================== backends away
def test_one_backend_away_30s_both_daemons_go_on_and_heal(
        tmp_path: Path, backends: list[Path], daemons: Daemons) -> None:
    """One of three backend folders vanishes for 30 s while both sides change files:
    both daemons keep syncing through the other two (every change of either side
    reaches the other during the outage); once it is back the trees are identical
    with every change, and after each side has synced again (a further change on each)
    `metasync fsck` passes on both: the copies missed while it was away were
    rewritten by the clients that missed them."""
    a, b = _setup(tmp_path, backends)
    daemons.start(a)
    daemons.start(b)
    away = backends[2].with_name("backend2-away")
    os.rename(backends[2], away)
    try:
        (a / "during-a.txt").write_text("written on A while backend2 was away\n")
        (b / "during-b.txt").write_text("written on B while backend2 was away\n")
        (a / "shared.txt").write_text("edited on A during the outage\n")
        wait_until(lambda: (b / "during-a.txt").exists() and (a / "during-b.txt").exists()
                   and (b / "shared.txt").read_text() == "edited on A during the outage\n",
                   30, "both sides' changes to cross while backend2 is away")
        (b / "late-b.txt").write_text("B, later in the outage\n")
        (a / "during-a.txt").unlink()
        wait_until(lambda: (a / "late-b.txt").exists() and not (b / "during-a.txt").exists(),
                   30, "a second round of changes to cross while backend2 is away")
        for root in (a, b):
            # Idle, not paused or offline (it may be between syncs when first read).
            wait_until(lambda r=root: _status_file(r)["state"] == "idle", 30,
                       f"{root.name}'s daemon to be idle while backend2 is away")
        # Its health is reported as not ok, the two others as ok.
        health = wait_until(lambda: (h := _status_cli(a)["backends"]).get(f"dir:{backends[2]}",
                                                                         "ok") != "ok" and h,
                            30, "A's status to report backend2 unhealthy")
        assert health[f"dir:{backends[0]}"] == health[f"dir:{backends[1]}"] == "ok", health
        # The scenario: the backend stays away for 30 s in all (not a synchronisation wait).
        threading.Event().wait(30)
    finally:
        os.rename(away, backends[2])
    expected = {
        "shared.txt": b"edited on A during the outage\n",
        "during-b.txt": b"written on B while backend2 was away\n",
        "late-b.txt": b"B, later in the outage\n",
    }
    wait_until(lambda: _same_trees(a, b) and _files(a) == expected, 30,
               "both trees identical with every change after backend2 returned")
    # Each side syncs again after the return: its next push rewrites what it missed.
    back = time.time()
    (a / "after-a.txt").write_text("A after the return\n")
    wait_until(lambda: (b / "after-a.txt").exists() and _synced_since(b, back), 30,
               "A's change after the return to reach B")
    second = time.time()
    (b / "after-b.txt").write_text("B after the return\n")
    wait_until(lambda: (a / "after-b.txt").exists() and _synced_since(a, second)
               and _same_trees(a, b), 30, "B's change after the return to reach A")
    wait_until(lambda: _fsck_ok(a) and _fsck_ok(b), 60,
               "`metasync fsck` to pass on A and B once each side synced again")


def test_daemon_heals_missed_copies_without_further_changes(
        tmp_path: Path, backends: list[Path], daemons: Daemons) -> None:
    """After a backend that was away returns, the daemon's own full check (every
    --rescan seconds) restores the copies it missed, with no further change: once
    both daemons have completed a full check after the return, `metasync fsck` passes.
    (A manual `metasync push` does heal: it repairs even when up to date.)"""
    a, b = _setup(tmp_path, backends)
    daemons.start(a)
    daemons.start(b)
    away = backends[2].with_name("backend2-away")
    os.rename(backends[2], away)
    try:
        (a / "while-away.txt").write_text("written while backend2 was away\n")
        wait_until(lambda: (b / "while-away.txt").exists(), 30, "the change to reach B")
    finally:
        os.rename(away, backends[2])
    back = time.time()
    wait_until(lambda: _synced_since(a, back + 5.5) and _synced_since(b, back + 5.5), 30,
               "both daemons to complete a full check after backend2 returned")
    assert set(_status_cli(a)["backends"].values()) == {"ok"}
    fsck = run_cli("fsck", cwd=a, check=False)
    assert fsck.returncode == 0, fsck.stdout + fsck.stderr


def test_two_backends_away_commits_locally_then_syncs(
        tmp_path: Path, backends: list[Path], daemons: Daemons) -> None:
    """With two of three backends gone (no quorum) a change on A is committed
    locally: `daemon status --json` says "offline" and reports the unpushed local
    commit, and nothing reaches B; when the backends return, A's daemon pushes it
    on its own and B's daemon brings it to B."""
    a, b = _setup(tmp_path, backends)
    daemons.start(a)
    daemons.start(b)
    moved = [(d, d.with_name(d.name + "-away")) for d in backends[1:]]
    for here, there in moved:
        os.rename(here, there)
    try:
        (a / "offline.txt").write_text("made while two backends were away\n")
        doc = wait_until(lambda: (d := _status_cli(a))["state"] == "offline" and d["unpushed"]
                         and d, 30, "A's daemon to report offline with an unpushed commit")
        assert doc["pending_changes"] == 0, doc  # committed locally, nothing left loose
        assert doc["reason"], doc
        # The daemon retries its push now and then, holding the folder's lock while it
        # does; `log` reads beside it (tests/test_interrupt.py), but may come before
        # the offline commit: ask again.
        listed = wait_until(lambda: (p := run_cli("log", "--json", cwd=a, check=False)).returncode
                            == 0 and p, 30, "`metasync log` to get the folder between retries")
        log = json.loads(listed.stdout)
        assert any(e.get("message", "").endswith("changed on " + e["device"]
                                                  + ": offline.txt (offline)") for e in log), log
        assert not (b / "offline.txt").exists()
    finally:
        for here, there in moved:
            os.rename(there, here)
    wait_until(lambda: (b / "offline.txt").exists(), 30,
               "the offline commit to reach B once the backends are back")
    assert (b / "offline.txt").read_text() == "made while two backends were away\n"
    wait_until(lambda: (d := _status_cli(a))["state"] == "idle" and not d["unpushed"], 30,
               "A's daemon to report idle with nothing unpushed")
    wait_until(lambda: _same_trees(a, b), 30, "identical trees")


# ============================================================== folder away
@pytest.mark.parametrize("leave_mount_point", [False, True], ids=["gone", "empty-mount-point"])
def test_folder_moved_away_pauses_and_deletes_nothing(
        tmp_path: Path, backends: list[Path], daemons: Daemons, leave_mount_point: bool) -> None:
    """Moving A's whole folder away while its daemon runs (an unmounted disk; with
    ``empty-mount-point`` an empty folder is left at its place, as a mount point
    is) is not "the user deleted everything": A's daemon pauses (its log, which
    moved along, says so) and B -- whose daemon keeps syncing -- loses nothing. Moved
    back, A's daemon resumes by itself and a new file on A reaches B."""
    files = {f"docs/f{i:02d}.txt": f"file {i}\n" for i in range(12)}
    a, b = _setup(tmp_path, backends, files)
    daemons.start(a)
    daemons.start(b)
    before = snapshot(b)
    away = tmp_path / "A-away"
    moved_at = time.time()
    os.rename(a, away)
    if leave_mount_point:
        a.mkdir()
    try:
        wait_until(lambda: "paused" in (away / ".metasync" / "daemon.log").read_text(), 30,
                   "A's daemon to log that it paused")
        # B syncs again after the move (poll and rescan) and still has everything.
        wait_until(lambda: _synced_since(b, moved_at + 5.5), 30,
                   "B's daemon to complete a full check after the move")
        assert snapshot(b) == before
        assert (away / "docs" / "f00.txt").exists()
        if leave_mount_point:
            assert os.listdir(a) == []  # the paused daemon wrote nothing into it
    finally:
        if leave_mount_point:
            a.rmdir()
        os.rename(away, a)
    wait_until(lambda: "is back" in (a / ".metasync" / "daemon.log").read_text(), 30,
               "A's daemon to notice its folder is back")
    (a / "after-return.txt").write_text("A is back\n")
    wait_until(lambda: (b / "after-return.txt").exists(), 30,
               "a new file on A to reach B after the folder returned")
    wait_until(lambda: _same_trees(a, b), 30, "identical trees")
    assert set(files) <= set(_files(b))


# ============================================================== mass deletion
def test_mass_deletion_pauses_until_resumed(
        tmp_path: Path, backends: list[Path], daemons: Daemons) -> None:
    """Deleting 20 of 25 files at once on A pauses A's daemon ("paused", the reason
    naming the deletion) and B keeps every file. `metasync daemon resume` on A syncs
    the deletion; B's daemon, seeing a remote version that deletes most of its
    files, pauses in turn (the guard works in both directions) until it is resumed
    too -- then B loses exactly those files."""
    files = {f"f{i:02d}.txt": f"file {i}\n" for i in range(25)}
    a, b = _setup(tmp_path, backends, files)
    daemons.start(a)
    daemons.start(b)
    doomed = sorted(files)[:20]
    for name in doomed:
        (a / name).unlink()
    doc = wait_until(lambda: (d := _status_cli(a))["state"] == "paused" and d, 30,
                     "A's daemon to pause on the mass deletion")
    assert "20 of 25 files were deleted" in doc["reason"], doc
    assert "resume" in doc["reason"], doc
    # B keeps syncing meanwhile and still has every file.
    paused_at = time.time()
    wait_until(lambda: _synced_since(b, paused_at), 30, "B's daemon to sync after A paused")
    assert set(files) <= set(_files(b))
    assert "paused" in run_cli("daemon", "status", cwd=a).stdout

    out = run_cli("daemon", "resume", cwd=a)
    assert out.returncode == 0
    wait_until(lambda: _status_file(a)["state"] == "idle", 30, "A's daemon to sync after resume")
    doc_b = wait_until(lambda: (d := _status_cli(b))["state"] == "paused" and d, 30,
                       "B's daemon to pause on the remote mass deletion")
    assert "deletes 20 of 25 files" in doc_b["reason"], doc_b
    assert set(files) <= set(_files(b))
    run_cli("daemon", "resume", cwd=b)
    wait_until(lambda: not any((b / n).exists() for n in doomed), 30,
               "B to lose the deleted files after resume")
    assert set(_files(b)) == set(files) - set(doomed)
    wait_until(lambda: _same_trees(a, b), 30, "identical trees")


# ============================================================== start/status/stop
def test_daemon_start_status_stop_through_the_cli(tmp_path: Path, backends: list[Path]) -> None:
    """`daemon start` runs it in the background, `status` and `status --json` show
    its state (with last_sync, pending_changes, conflicts and per-backend health),
    a second `start` fails with a one-line error, `stop` stops it and `status`
    then says "stopped"."""
    a, b = _setup(tmp_path, backends)
    try:
        out = run_cli("daemon", "start", *FAST, cwd=a)
        assert "started" in out.stdout + out.stderr
        doc = wait_until(lambda: (d := _status_cli(a)).get("last_sync") and d, 30,
                         "the started daemon's first sync")
        assert doc["state"] in {"idle", "syncing"}, doc
        for key in ("state", "last_sync", "pending_changes", "conflicts", "backends"):
            assert key in doc, (key, doc)
        assert isinstance(doc["pending_changes"], int) and isinstance(doc["conflicts"], list)
        assert len(doc["backends"]) == 3, doc["backends"]
        assert set(doc["backends"].values()) == {"ok"}, doc["backends"]
        assert all(str(bk) in " ".join(doc["backends"]) for bk in backends), doc["backends"]
        pid = doc["pid"]
        # It syncs: a new file reaches the clone.
        (a / "bg.txt").write_text("from the background daemon\n")
        wait_until(lambda: (d := _status_file(a))["state"] == "idle"
                   and d["last_sync"] > doc["last_sync"] and "bg.txt" in _files(a), 30,
                   "the background daemon to sync a new file")
        run_cli("pull", cwd=b)
        assert (b / "bg.txt").read_text() == "from the background daemon\n"

        text = run_cli("daemon", "status", cwd=a).stdout
        assert text.startswith("state:        idle"), text
        assert "last sync:" in text and "never" not in text, text
        assert text.count("backend:") == 3, text

        again = run_cli("daemon", "start", *FAST, cwd=a, check=False)
        assert again.returncode != 0
        err = again.stderr.strip()
        assert len(err.splitlines()) == 1, err
        assert "already runs" in err, err
        assert _status_cli(a)["pid"] == pid  # the first one is untouched
    finally:
        stop = run_cli("daemon", "stop", cwd=a, check=False)
    assert stop.returncode == 0, stop.stderr
    assert "stopped" in stop.stdout + stop.stderr
    assert _status_cli(a)["state"] == "stopped"
    assert run_cli("daemon", "status", cwd=a).stdout.startswith("state:        stopped")
    assert not _running(pid)
    # Stopping again is harmless.
    again_stop = run_cli("daemon", "stop", cwd=a)
    assert "no metasync daemon" in again_stop.stdout + again_stop.stderr


# ============================================================== install-service
def test_install_service_without_systemctl(tmp_path: Path, backends: list[Path]) -> None:
    """`daemon install-service` without systemctl on PATH still writes a valid
    systemd user unit under $XDG_CONFIG_HOME (ExecStart runs `daemon`, in the
    folder), then exits non-zero with one line saying systemctl is not available
    and how to enable the unit."""
    a, _ = _setup(tmp_path, backends)
    config = tmp_path / "xdg"
    empty_bin = tmp_path / "bin"
    empty_bin.mkdir()
    proc = subprocess.run([METASYNC, "daemon", "install-service"], cwd=a,
                          env=_env(XDG_CONFIG_HOME=str(config), PATH=str(empty_bin)),
                          capture_output=True, text=True, stdin=subprocess.DEVNULL)
    assert proc.returncode != 0, proc
    err = proc.stderr.strip()
    assert len(err.splitlines()) == 1, err
    assert "systemctl is not available" in err, err
    assert "systemctl --user enable --now metasync-" in err, err
    units = list((config / "systemd" / "user").glob("*.service"))
    assert len(units) == 1, units
    assert units[0].name in err
    parser = configparser.ConfigParser(interpolation=None, strict=True)
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    parser.read_string(units[0].read_text())
    assert {"Unit", "Service", "Install"} <= set(parser.sections())
    service = parser["Service"]
    exec_start = service["ExecStart"].split()
    assert "daemon" in exec_start[1:], exec_start
    assert Path(exec_start[0]).is_absolute() and os.access(exec_start[0], os.X_OK), exec_start
    assert Path(service["WorkingDirectory"]).resolve() == a.resolve()
    assert parser["Install"]["WantedBy"] == "default.target"


# ============================================================== .metasyncignore
def test_ignored_files_never_leave(tmp_path: Path, backends: list[Path], daemons: Daemons) -> None:
    """With a `.metasyncignore` on A, a file matching it that A's daemon sees
    created never reaches B, while the ignore file itself and the files created
    with it do."""
    a, b = _setup(tmp_path, backends)
    daemons.start(a)
    daemons.start(b)
    (a / ".metasyncignore").write_text("*.secret\nbuild/\n")
    wait_until(lambda: (b / ".metasyncignore").exists(), 30, "the ignore file to reach B")
    assert (b / ".metasyncignore").read_text() == "*.secret\nbuild/\n"
    (a / "password.secret").write_text("hunter2\n")
    (a / "build").mkdir()
    (a / "build" / "out.o").write_bytes(b"\x7fELF")
    (a / "notes.txt").write_text("not secret\n")
    wait_until(lambda: (b / "notes.txt").exists(), 30, "the unignored file to reach B")
    # A later, separate sync too: the ignored files stay out of every commit.
    (a / "more.secret").write_text("also local\n")
    (a / "marker.txt").write_text("after\n")
    wait_until(lambda: (b / "marker.txt").exists(), 30, "the second unignored file to reach B")
    rescanned = time.time()
    wait_until(lambda: _synced_since(a, rescanned + 5.5) and _synced_since(b, rescanned + 5.5),
               30, "both daemons to complete a full check")
    assert set(_files(b)) == {"shared.txt", ".metasyncignore", "notes.txt", "marker.txt"}
    assert not (b / "build").exists()
    assert (a / "password.secret").read_text() == "hunter2\n"  # still here, just local
