"""Losing backends loses nothing (issue 15): what a user does with the real CLI.

- A push made while one backend was away still leaves R copies of everything
  (spilled to another backend, moved home later), so any later loss of R-1
  backends keeps every pushed file.
- After a dead backend was removed, a fresh clone follows the configurations from
  the newest one it can confirm: a majority of the current configuration is
  enough, however many configurations ago the dead backends were removed.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from conftest import run_cli, snapshot

TIMEOUT = ("--timeout", "10")


def _dirs(tmp_path: Path, *names: str) -> dict[str, Path]:
    out = {}
    for name in names:
        out[name] = tmp_path / name
        out[name].mkdir()
    return out


def _away(path: Path) -> Path:
    """Take a backend folder away (an unplugged disk); return where it went."""
    hidden = path.with_name(path.name + "-away")
    path.rename(hidden)
    return hidden


@pytest.mark.parametrize("entry", ["b3", "b4"])
def test_clone_after_removing_a_dead_backend_and_losing_another(tmp_path: Path, entry: str) -> None:
    """init on b1, b2, b3; backend add b4; b2 dies; backend remove b2; a push;
    later b1 dies. The current configuration is {b1, b3, b4}, two of whose three
    backends answer: a clone from b3 or from b4 works and is the pushed tree."""
    b = _dirs(tmp_path, "b1", "b2", "b3", "b4")
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("before the changes\n")
    run_cli("init", *(f"--backend=dir:{b[n]}" for n in ("b1", "b2", "b3")), cwd=src)
    run_cli("push", cwd=src)
    early = tmp_path / "early"  # a client that sleeps through every change below
    run_cli("clone", f"dir:{b['b3']}", str(early))
    run_cli("backend", "add", f"dir:{b['b4']}", cwd=src)
    shutil.rmtree(b["b2"])
    run_cli(*TIMEOUT, "backend", "remove", f"dir:{b['b2']}", cwd=src)
    (src / "b.txt").write_text("after the removal\n")
    run_cli(*TIMEOUT, "push", cwd=src)
    shutil.rmtree(b["b1"])
    clone = tmp_path / "clone"
    run_cli(*TIMEOUT, "clone", f"dir:{b[entry]}", str(clone))
    assert snapshot(clone) == snapshot(src)
    (clone / "c.txt").write_text("pushed by the clone\n")
    run_cli(*TIMEOUT, "push", cwd=clone)
    # The sleeper's configuration lost its majority (b1 and b2): it follows the
    # hints to the configuration that replaced it, and catches up.
    run_cli(*TIMEOUT, "pull", cwd=early)
    assert snapshot(early) == snapshot(clone)
