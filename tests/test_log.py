"""History through the real command: ``log`` shows every commit of a merge (both
parents, each commit once, newest first) with the version number it became
master in, ``log --graph`` draws the merge as git does, ``restore --version N``
takes the number ``log`` shows, and ``status`` says where the folder stands
against master (behind, ahead, diverged)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import run_cli


def _init(tmp_path: Path, backends: list[Path]) -> tuple[Path, Path]:
    """A repository pushed once from ``laptop`` ("first", version 1) and cloned
    as ``desktop``."""
    laptop, desktop = tmp_path / "laptop", tmp_path / "desktop"
    laptop.mkdir()
    (laptop / "a.txt").write_text("one\n")
    args = ["init", str(laptop)]
    for b in backends:
        args += ["--backend", f"dir:{b}"]
    run_cli(*args)
    run_cli("push", "-m", "first", cwd=laptop)
    run_cli("clone", f"dir:{backends[0]}", str(desktop))
    return laptop, desktop


@pytest.fixture
def merged(tmp_path: Path, backends: list[Path]) -> tuple[Path, Path]:
    """Both machines change a different file; the laptop pushes first (version
    2), the desktop's push merges (version 3); the laptop pulls."""
    laptop, desktop = _init(tmp_path, backends)
    (laptop / "b.txt").write_text("from the laptop\n")
    run_cli("push", "-m", "laptop edit", cwd=laptop)
    (desktop / "c.txt").write_text("from the desktop\n")
    run_cli("push", "-m", "desktop edit", cwd=desktop)
    run_cli("pull", cwd=laptop)
    return laptop, desktop


def test_log_shows_both_sides_of_a_merge_with_version_numbers(
        merged: tuple[Path, Path]) -> None:
    """After a merge, the other machine's commit and message are in the log on
    both machines, each commit once, newest first, with version numbers."""
    for root in merged:
        entries = json.loads(run_cli("log", "--json", cwd=root).stdout)
        messages = [e["message"] for e in entries]
        assert "desktop edit" in messages and "laptop edit" in messages, messages
        assert len({e["commit"] for e in entries}) == len(entries)
        merge = entries[0]
        assert len(merge["parents"]) == 2
        assert merge["version"] == 3
        by_message = {e["message"]: e for e in entries}
        assert by_message["laptop edit"]["version"] == 2
        assert by_message["first"]["version"] == 1
        # The desktop's own commit was never master alone: it has no number.
        assert by_message["desktop edit"]["version"] is None
        # Children before parents.
        position = {e["commit"]: i for i, e in enumerate(entries)}
        for e in entries:
            assert all(position[p] > position[e["commit"]] for p in e["parents"])
        text = run_cli("log", cwd=root).stdout
        assert "version 3" in text and "version 2" in text and "desktop edit" in text
        assert text.count("commit ") == len(entries)


def test_log_graph_draws_both_parents_of_a_merge(merged: tuple[Path, Path]) -> None:
    """``log --graph``: the merge opens a second line (``|\\``), the side commit is
    drawn on it, and it closes (``|/``) before the common base."""
    laptop, _ = merged
    lines = run_cli("log", "--graph", "--oneline", cwd=laptop).stdout.splitlines()
    shapes = [line.split(" ", 1)[0] if line.startswith(("*", "|")) else line for line in lines]
    text = "\n".join(lines)
    assert lines[0].startswith("*   "), text
    assert lines[1].rstrip() == "|\\", text
    assert lines[-2].rstrip() == "|/", text
    assert lines[-1].startswith("* ") and "first" in lines[-1], text
    middle = lines[2:-2]
    assert sorted(line[:3] for line in middle) == ["* |", "| *"], text
    assert len(shapes) == 6
    full = run_cli("log", "--graph", cwd=laptop).stdout.splitlines()
    assert full[0].startswith("*   commit ") and full[1] == "|\\", "\n".join(full)
    assert full[2].startswith("| | Merge: ")
    assert "|/" in full and full[-5].startswith("  Device: ")  # the root: no column left


def test_log_limit_counts_commits(merged: tuple[Path, Path]) -> None:
    laptop, _ = merged
    entries = json.loads(run_cli("log", "--json", "-n", "2", cwd=laptop).stdout)
    assert len(entries) == 2 and entries[0]["version"] == 3


def test_restore_takes_the_version_number_log_shows(merged: tuple[Path, Path]) -> None:
    laptop, _ = merged
    (laptop / "a.txt").write_text("changed\n")
    run_cli("push", "-m", "change a", cwd=laptop)
    proc = run_cli("restore", "a.txt", "--version", "1", "--to", str(laptop.parent / "old"),
                   cwd=laptop)
    assert (laptop.parent / "old").read_text() == "one\n", proc.stdout
    proc = run_cli("restore", "a.txt", "--version", "99", cwd=laptop, check=False)
    assert proc.returncode != 0 and "version 99" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_status_says_behind_ahead_and_diverged(tmp_path: Path, backends: list[Path]) -> None:
    laptop, desktop = _init(tmp_path, backends)
    out = run_cli("status", cwd=desktop).stdout
    assert "behind" not in out and "ahead" not in out
    (laptop / "b.txt").write_text("b\n")
    run_cli("push", "-m", "b", cwd=laptop)
    out = run_cli("status", cwd=desktop).stdout
    assert "behind master by 1 version; run metasync pull" in out, out
    doc = json.loads(run_cli("status", "--json", cwd=desktop).stdout)
    assert doc["behind"] == 1 and doc["ahead"] == 0 and doc["latest"] == 2
    (desktop / "c.txt").write_text("c\n")
    run_cli("commit", "-m", "c", cwd=desktop)
    out = run_cli("status", cwd=desktop).stdout
    assert "diverged from master" in out and "1 local commit" in out, out
    run_cli("pull", cwd=desktop)
    (laptop / "d.txt").write_text("d\n")
    run_cli("commit", "-m", "d", cwd=laptop)
    out = run_cli("status", cwd=laptop).stdout
    assert "ahead of master by 1 local commit; run metasync push" in out, out
