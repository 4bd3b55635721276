"""Bad input through the real command: one line on stderr, a non-zero exit, no
traceback, and nothing written."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from conftest import run_cli, snapshot


def _tree_state(*roots: Path) -> dict[str, object]:
    """Every path (with content) under the given roots, to prove nothing changed."""
    state: dict[str, object] = {}
    for root in roots:
        if not root.exists():
            state[str(root)] = None
            continue
        for dirpath, dirnames, filenames in os.walk(root):
            for name in dirnames + filenames:
                path = Path(dirpath) / name
                state[str(path)] = path.read_bytes() if path.is_file() else "dir"
    return state


def _assert_clean_failure(proc: object, *needles: str) -> None:
    import subprocess

    assert isinstance(proc, subprocess.CompletedProcess)
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("metasync: error: ")
    assert "Traceback" not in proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


@pytest.fixture
def repo(tmp_path: Path, backends: list[Path]) -> Path:
    src = tmp_path / "src"
    src.mkdir()
    (src / "hello.txt").write_text("hello\n")
    args = ["init", str(src)]
    for b in backends:
        args += ["--backend", f"dir:{b}"]
    run_cli(*args)
    run_cli("push", cwd=src)
    return src


def test_wrong_passphrase_on_clone(tmp_path: Path, repo: Path, backends: list[Path]) -> None:
    """A wrong passphrase: one-line error naming it, non-zero exit, no folder made,
    and the backends untouched."""
    before = _tree_state(*backends)
    target = tmp_path / "clone"
    proc = run_cli("clone", f"dir:{backends[0]}", str(target), passphrase="wrong", check=False)
    _assert_clean_failure(proc, "wrong passphrase")
    assert not target.exists()
    assert _tree_state(*backends) == before
    empty = tmp_path / "empty"
    empty.mkdir()
    proc = run_cli("clone", f"dir:{backends[0]}", str(empty), passphrase="wrong", check=False)
    _assert_clean_failure(proc, "wrong passphrase")
    assert list(empty.iterdir()) == []


def test_clone_without_passphrase_says_how(tmp_path: Path, repo: Path, backends: list[Path]) -> None:
    """No passphrase source and no terminal: the error names the two ways to give one."""
    proc = run_cli("clone", f"dir:{backends[0]}", str(tmp_path / "c"), passphrase=None, check=False)
    _assert_clean_failure(proc, "METASYNC_PASSPHRASE", "--passphrase-file")
    assert not (tmp_path / "c").exists()


def test_unknown_scheme(tmp_path: Path) -> None:
    """An unknown URI scheme is named, with the known ones."""
    proc = run_cli("init", str(tmp_path / "r"), "--backend", "ftp://x/y", check=False)
    _assert_clean_failure(proc, "unknown backend scheme", "dir:")
    assert not (tmp_path / "r").exists()


def test_missing_backend_folder(tmp_path: Path, backends: list[Path]) -> None:
    """A backend folder that does not exist is named; nothing is created anywhere."""
    before = _tree_state(*backends)
    missing = tmp_path / "nope"
    proc = run_cli(
        "init", str(tmp_path / "r"), "--backend", f"dir:{backends[0]}", "--backend", f"dir:{missing}",
        check=False,
    )
    _assert_clean_failure(proc, str(missing))
    assert not missing.exists() and not (tmp_path / "r").exists()
    assert _tree_state(*backends) == before


def test_relative_backend_path(tmp_path: Path) -> None:
    """A relative dir: path is refused with the fix."""
    proc = run_cli("init", str(tmp_path / "r"), "--backend", "dir:relative/path", check=False)
    _assert_clean_failure(proc, "absolute")


def test_not_a_repository(tmp_path: Path) -> None:
    """Commands outside a repository say so and how to make one."""
    for command in (["status"], ["push"], ["pull"], ["log"], ["fsck"], ["commit"]):
        proc = run_cli(*command, cwd=tmp_path, check=False)
        _assert_clean_failure(proc, "not inside a metasync repository")
    assert list(tmp_path.iterdir()) == []


def test_clone_of_something_that_is_not_a_repository(tmp_path: Path, backends: list[Path]) -> None:
    """Cloning an empty folder, or one that does not exist, fails cleanly."""
    proc = run_cli("clone", f"dir:{backends[0]}", str(tmp_path / "c"), check=False)
    _assert_clean_failure(proc)
    proc = run_cli("clone", f"dir:{tmp_path / 'missing'}", str(tmp_path / "c"), check=False)
    _assert_clean_failure(proc)
    assert not (tmp_path / "c").exists()
    assert list(backends[0].iterdir()) == []


def test_clone_into_non_empty_folder(tmp_path: Path, repo: Path, backends: list[Path]) -> None:
    """DIR not empty: refused, and its contents are left exactly as they were."""
    target = tmp_path / "busy"
    target.mkdir()
    (target / "mine.txt").write_text("mine\n")
    before = _tree_state(target)
    proc = run_cli("clone", f"dir:{backends[1]}", str(target), check=False)
    _assert_clean_failure(proc, "not empty")
    assert _tree_state(target) == before


def test_init_twice_and_backend_taken(tmp_path: Path, repo: Path, backends: list[Path]) -> None:
    """init in a repository, or on a backend that already holds one, is refused."""
    proc = run_cli("init", str(repo), "--backend", f"dir:{tmp_path}", check=False)
    _assert_clean_failure(proc, "already a metasync repository")
    other = tmp_path / "other"
    proc = run_cli("init", str(other), "--backend", f"dir:{backends[0]}", check=False)
    _assert_clean_failure(proc, "already holds a metasync repository", "clone")
    assert not other.exists()


def test_bad_replicas(tmp_path: Path, backends: list[Path]) -> None:
    """R larger than the number of backends is refused before anything is written."""
    proc = run_cli("init", str(tmp_path / "r"), "--backend", f"dir:{backends[0]}",
                   "--replicas", "3", check=False)
    _assert_clean_failure(proc, "--replicas")
    assert list(backends[0].iterdir()) == []


def test_unencrypted_repository(tmp_path: Path, backends: list[Path]) -> None:
    """--no-encrypt needs no passphrase anywhere and round-trips (a clone of an
    unencrypted repository needs --no-encrypt too)."""
    src = tmp_path / "plain"
    src.mkdir()
    (src / "a.txt").write_text("plain text\n")
    run_cli("init", str(src), "--no-encrypt", "--backend", f"dir:{backends[0]}",
            "--backend", f"dir:{backends[1]}", passphrase=None)
    run_cli("push", cwd=src, passphrase=None)
    run_cli("clone", f"dir:{backends[1]}", str(tmp_path / "c"), "--no-encrypt", passphrase=None)
    assert snapshot(tmp_path / "c") == snapshot(src)


def test_status_json_and_commit(tmp_path: Path, repo: Path) -> None:
    """status --json lists changes; commit records them locally; log shows both."""
    import json

    (repo / "new.txt").write_text("new\n")
    status = json.loads(run_cli("status", "--json", cwd=repo).stdout)
    assert status["changes"] == [{"path": "new.txt", "change": "added", "type": "file"}]
    run_cli("commit", "-m", "local", cwd=repo)
    status = json.loads(run_cli("status", "--json", cwd=repo).stdout)
    assert status["changes"] == [] and status["unpushed"]
    log = json.loads(run_cli("log", "--json", cwd=repo).stdout)
    assert [e["message"] for e in log] == ["local", ""]
    run_cli("push", cwd=repo)
    status = json.loads(run_cli("status", "--json", cwd=repo).stdout)
    assert status["clean"]


def test_debug_shows_traceback(tmp_path: Path) -> None:
    """--debug is the one way to get a traceback."""
    proc = run_cli("--debug", "status", cwd=tmp_path, check=False)
    assert proc.returncode != 0 and "Traceback" in proc.stderr
