"""What a new user hits in the first hour (issue 17), through the real command:
the README's Python example as written, ``Repository.open`` on a missing path,
global options after the subcommand, ``--json`` on push, pull, fsck and clone,
the wording of push's summary, conflicts said once, an empty passphrase, help
texts, the daemon's commit messages and log lines, and an unexpected error."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import METASYNC, PASSPHRASE, one_line_error, run_cli
from metasync.errors import MetasyncError
from metasync.repository import Repository

README = Path(__file__).resolve().parent.parent / "README.md"


def _init(root: Path, backends: list[Path]) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "hello.txt").write_text("hello\n")
    args = ["init", str(root)]
    for b in backends:
        args += ["--backend", f"dir:{b}"]
    run_cli(*args)
    return root


@pytest.fixture
def pushed(tmp_path: Path, backends: list[Path]) -> Path:
    root = _init(tmp_path / "src", backends)
    run_cli("push", "-m", "first", cwd=root)
    return root


# --------------------------------------------------------------- point 9: Python API
def _readme_python_example() -> str:
    """The first ```python block of README.md, as written."""
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert blocks, "README.md has no python example"
    code: str = blocks[0]
    return code


def test_readme_python_example_runs_as_written(tmp_path: Path, backends: list[Path]) -> None:
    """The README's example opens ``~/Sync``: ``~`` is the user's home."""
    code = _readme_python_example()
    assert 'Repository.open("~/Sync")' in code
    home = tmp_path / "home"
    sync = _init(home / "Sync", backends)
    (sync / "new.txt").write_text("new\n")
    env = {**os.environ, "HOME": str(home), "METASYNC_PASSPHRASE": PASSPHRASE}
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env,
                          capture_output=True, text=True, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr
    assert "new.txt" in proc.stdout
    log = json.loads(run_cli("log", "--json", cwd=sync).stdout)
    assert log[0]["message"] == "from a script"


def test_open_refuses_a_path_that_does_not_exist(pushed: Path) -> None:
    """A missing path inside a repository is not the repository around it."""
    missing = pushed / "no" / "such" / "folder"
    with pytest.raises(MetasyncError, match="does not exist") as info:
        Repository.open(missing)
    assert str(missing) in str(info.value)


# --------------------------------------------------- global options after the command
def test_global_options_after_the_subcommand(pushed: Path, tmp_path: Path) -> None:
    proc = run_cli("pull", "-q", cwd=pushed)
    assert proc.stdout == "" and proc.stderr == ""
    proc = run_cli("status", "--quiet", cwd=pushed)
    assert proc.stdout == ""
    (pushed / "x.txt").write_text("x\n")
    proc = run_cli("push", "--timeout", "20", "-q", "-m", "x", cwd=pushed)
    assert proc.stdout == ""
    assert json.loads(run_cli("log", "--json", cwd=pushed).stdout)[0]["message"] == "x"
    # Before the subcommand still works, and --debug after it shows a traceback.
    assert run_cli("-q", "pull", cwd=pushed).stdout == ""
    proc = run_cli("restore", "nothing-here", "--debug", cwd=pushed, check=False)
    assert proc.returncode != 0 and "Traceback" in proc.stderr


# ------------------------------------------------------------------------- --json
def test_json_on_push_pull_fsck_clone(tmp_path: Path, backends: list[Path]) -> None:
    root = _init(tmp_path / "src", backends)
    doc = json.loads(run_cli("push", "--json", "-m", "first", cwd=root).stdout)
    assert doc["version"] == 1 and doc["up_to_date"] is False
    assert doc["commit"] and doc["objects_uploaded"] >= 1 and doc["bytes_uploaded"] > 0
    assert doc["conflicts"] == [] and doc["warnings"] == [] and doc["skipped"] == []
    clone = tmp_path / "clone"
    doc = json.loads(run_cli("clone", f"dir:{backends[1]}", str(clone), "--json").stdout)
    assert doc["version"] == 1 and doc["root"] == str(clone) and doc["fingerprint"]
    (root / "hello.txt").write_text("changed\n")
    run_cli("push", cwd=root)
    doc = json.loads(run_cli("pull", "--json", cwd=clone).stdout)
    assert doc == {"version": 2, "up_to_date": False, "written": 1, "deleted": 0,
                   "conflicts": [], "warnings": []}
    doc = json.loads(run_cli("--json", "push", cwd=clone).stdout)  # before it too
    assert doc["up_to_date"] is True and doc["version"] == 2
    assert json.loads(run_cli("--json", "backend", "list", cwd=clone).stdout)["backends"]
    doc = json.loads(run_cli("fsck", "--json", cwd=clone).stdout)
    assert doc["ok"] is True and doc["problems"] == [] and doc["objects"] >= 1
    # Damage one copy: fsck --json lists it and exits 1.
    victim = next(p for p in backends[0].rglob("objects/*/*") if p.is_file())
    victim.write_bytes(b"garbage")
    proc = run_cli("fsck", "--json", cwd=clone, check=False)
    assert proc.returncode == 1
    doc = json.loads(proc.stdout)
    assert doc["ok"] is False and len(doc["problems"]) == 1
    assert doc["problems"][0]["object"] in victim.name


# ------------------------------------------------------------------ push and pull text
def test_push_does_not_say_everything_up_to_date_after_skipping(pushed: Path) -> None:
    """A file push cannot read is not "up to date"."""
    if os.geteuid() == 0 and shutil.which("setpriv") is None:
        pytest.skip("needs setpriv to read as root without CAP_DAC_OVERRIDE")
    secret = pushed / "secret.txt"
    secret.write_text("secret\n")
    secret.chmod(0)
    prefix = (["setpriv", "--bounding-set", "-dac_override,-dac_read_search"]
              if os.geteuid() == 0 else [])
    env = {**os.environ, "METASYNC_PASSPHRASE": PASSPHRASE}
    proc = subprocess.run([*prefix, METASYNC, "push"], cwd=pushed, env=env,
                          capture_output=True, text=True, stdin=subprocess.DEVNULL)
    assert "secret.txt" in proc.stderr
    assert "Everything up to date" not in proc.stdout
    assert "1 file skipped" in proc.stdout + proc.stderr


def test_each_conflict_is_said_once(pushed: Path, tmp_path: Path, backends: list[Path]) -> None:
    other = tmp_path / "other"
    run_cli("clone", f"dir:{backends[0]}", str(other))
    (pushed / "hello.txt").write_text("laptop\n")
    run_cli("push", cwd=pushed)
    (other / "hello.txt").write_text("desktop\n")
    proc = run_cli("push", cwd=other)
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if "conflict" in line]
    assert len(lines) == 1, proc.stdout + proc.stderr


def test_an_empty_passphrase_is_said_to_be_empty(pushed: Path, tmp_path: Path,
                                                 backends: list[Path]) -> None:
    proc = run_cli("clone", f"dir:{backends[0]}", str(tmp_path / "c"), passphrase="",
                   check=False)
    one_line_error(proc, "METASYNC_PASSPHRASE is empty")


def test_clone_namespace_has_help() -> None:
    out = run_cli("clone", "--help").stdout
    option = out[out.index("--namespace"):]
    assert "Folder name of the repository on the backend" in " ".join(option.split()[:12])


def test_unexpected_error_is_one_line_with_a_hint(pushed: Path) -> None:
    """A bug (here: a damaged local database row nothing expects) is one line
    naming it and the --debug hint, not a traceback."""
    import sqlite3

    db = sqlite3.connect(pushed / ".metasync" / "state.db")
    with db:
        db.execute("UPDATE settings SET value='[1, 2]' WHERE key='head'")
    db.close()
    proc = run_cli("status", cwd=pushed, check=False)
    line = one_line_error(proc, "--debug")
    assert "unexpected" in line


# ------------------------------------------------------------------------- daemon
def test_daemon_commits_name_the_files_and_its_log_too(pushed: Path) -> None:
    from test_daemon_sync import wait_until

    env = {k: v for k, v in os.environ.items() if not k.startswith("METASYNC_")}
    env["METASYNC_PASSPHRASE"] = PASSPHRASE
    daemon = subprocess.Popen([METASYNC, "daemon", "--settle", "0.3", "--poll", "0.5",
                               "--rescan", "5"], cwd=pushed, env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    log_file = pushed / ".metasync" / "daemon.log"
    try:
        wait_until(lambda: "synced" not in log_file.read_text() and "idle"
                   in (pushed / ".metasync" / "daemon.json").read_text(), 30, "daemon idle")
        (pushed / "a.txt").write_text("a\n")
        (pushed / "b.txt").write_text("b\n")
        wait_until(lambda: "synced version 2" in log_file.read_text(), 30, "a sync",
                   lambda: log_file.read_text())
    finally:
        daemon.send_signal(signal.SIGTERM)
        _, err = daemon.communicate(timeout=30)
    assert daemon.returncode == 0, err
    line = next(x for x in log_file.read_text().splitlines() if "synced version 2" in x)
    assert "a.txt" in line and "b.txt" in line, line
    entry = json.loads(run_cli("log", "--json", "-n", "1", cwd=pushed).stdout)[0]
    assert entry["message"] == f"2 files changed on {entry['device']}: a.txt, b.txt"
