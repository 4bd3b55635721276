"""History never silently rewinds (issue 16, scenario 3): what a user does with the
real CLI when one backend lies about its log and another has an ordinary outage.

Crash mode over three ``dir:`` backends a, b, c: X pushes while b is away
(decided on a and c); c then hides the log entry of that instance (it deletes
it: a backend that loses or hides log entries is outside crash mode's fault
model), and Y, for whom a is away, pushes and is decided on b and c. Both are
told "Pushed version 2": history forked. X's next version does not descend from
Y's version 2. Y's pull of it must keep Y's pushed file, say loudly what
happened, and Y's next push must publish it again.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import backend_dirs, run_cli
from metasync import Repository
from metasync.graph import Ancestry

TIMEOUT = ("--timeout", "10")
NAMESPACE = "metasync"
CRASH_MODE_NOTE = ("note: crash mode: a backend that loses or hides log entries can fork history; "
                   "use --bft (4+ backends) to tolerate one that lies")


def _away(path: Path) -> Path:
    """Take a backend folder away (an unplugged disk); return where it went."""
    hidden = path.with_name(path.name + "-away")
    path.rename(hidden)
    return hidden


def _hide_log(backend: Path, instance: int) -> None:
    """The lying backend: its log of ``instance`` vanishes (every entry, as if the
    instance had never been written there), so a reader sees an empty log."""
    log = backend / NAMESPACE / "log" / f"{instance:012d}"
    assert any(log.iterdir()), f"{log} has no entries to hide"
    shutil.rmtree(log)
    log.mkdir()


def _forked(tmp_path: Path, *bft: str) -> tuple[dict[str, Path], Path, Path, subprocess.CompletedProcess[str]]:
    """X and Y over a, b, c (and d with ``--bft``); X pushed ``x.txt`` while b was
    away, c hid that log entry, Y pushed ``y.txt`` while a was away. Returns the
    backends and the two folders; asserts what each push printed."""
    names = ("a", "b", "c", "d") if bft else ("a", "b", "c")
    b = backend_dirs(tmp_path, *names)
    x, y = tmp_path / "x", tmp_path / "y"
    x.mkdir()
    (x / "start.txt").write_text("start\n")
    init = run_cli("init", *bft, *(f"--backend=dir:{b[n]}" for n in names), cwd=x)
    # init says in one line what crash mode does not tolerate, and only in crash mode.
    said = [line for line in init.stdout.splitlines() if "crash mode" in line]
    assert said == ([] if bft else [CRASH_MODE_NOTE]), init.stdout
    first = run_cli(*TIMEOUT, "push", cwd=x)
    assert "Pushed version 1" in first.stdout, first.stdout
    run_cli(*TIMEOUT, "clone", f"dir:{b['a']}", str(y))

    away = _away(b["b"])
    (x / "x.txt").write_text("pushed by X\n")
    pushed_x = run_cli(*TIMEOUT, "push", cwd=x, check=False)
    away.rename(b["b"])
    _hide_log(b["c"], 2)

    away = _away(b["a"])
    (y / "y.txt").write_text("pushed by Y\n")
    pushed_y = run_cli(*TIMEOUT, "push", cwd=y, check=False)
    away.rename(b["a"])
    assert pushed_x.returncode == 0 and "Pushed version 2" in pushed_x.stdout, pushed_x
    if not bft:
        assert pushed_y.returncode == 0 and "Pushed version 2" in pushed_y.stdout, pushed_y
    return b, x, y, pushed_y


@pytest.mark.parametrize("how", ["pull", "push"])
def test_a_forked_client_keeps_its_pushed_file_and_says_why(tmp_path: Path, how: str) -> None:
    """Crash mode: X pushes version 3 on top of its version 2; Y's pull of it (or
    its next push, with a change of its own) finds that version 3 does not
    descend from the version 2 Y had. Y keeps ``y.txt`` (merged on top of
    version 3, nothing deleted) and is told in one loud line which versions
    diverged and why; the merge is published (by that push, or the next one).
    Then X, and Z -- who cloned Y's version 2 and learns the merge, which holds
    Y's version 2 as its second parent -- get every file, with no warning."""
    b, x, y, _ = _forked(tmp_path)
    z = tmp_path / "z"
    run_cli(*TIMEOUT, "clone", f"dir:{b['b']}", str(z))
    assert (z / "y.txt").exists() and not (z / "x.txt").exists()
    (x / "x2.txt").write_text("X again\n")
    pushed = run_cli(*TIMEOUT, "push", cwd=x)
    assert "Pushed version 3" in pushed.stdout, pushed.stdout

    if how == "push":
        (y / "y2.txt").write_text("Y again\n")
    synced = run_cli(*TIMEOUT, "-q", how, cwd=y)
    assert (y / "y.txt").read_text() == "pushed by Y\n", synced.stdout + synced.stderr
    assert (y / "x.txt").read_text() == "pushed by X\n"
    assert (y / "x2.txt").read_text() == "X again\n"
    # Said even with -q: one line, naming both versions, the cause and the remedies.
    assert "Traceback" not in synced.stderr
    warnings = synced.stderr.splitlines()
    assert len(warnings) == 1 and warnings[0].startswith("warning: history forked"), synced.stderr
    warning = warnings[0]
    assert "version 3" in warning and "version 2" in warning, warning
    assert "lost or hid a log entry" in warning and "fsck" in warning and "--bft" in warning

    if how == "pull":
        status = run_cli("status", cwd=y)
        assert "local commits not pushed" in status.stdout, status.stdout
        again = run_cli(*TIMEOUT, "push", cwd=y)
        assert "Pushed version 4" in again.stdout and not again.stderr, again
    else:
        status = run_cli("status", cwd=y).stdout
        assert "On version 4" in status and "not pushed" not in status, status
    expected = {"start.txt", "x.txt", "x2.txt", "y.txt"} | ({"y2.txt"} if how == "push" else set())
    for root in (x, z, y):
        out = run_cli(*TIMEOUT, "pull", cwd=root)
        assert "warning" not in out.stderr, out.stderr
        assert {p.name for p in root.iterdir() if p.name != ".metasync"} == expected, root


def test_bft_mode_tolerates_the_same_lie_and_outage(tmp_path: Path) -> None:
    """The same faults under ``init --bft`` over four backends (f = 1): c's hidden
    entry and a's outage leave Y a quorum (b, c, d) that still shows X's version 2,
    so Y's push merges with it and becomes version 3 -- no fork, nothing to
    repair, both folders end with both files."""
    _, x, y, pushed_y = _forked(tmp_path, "--bft")
    assert pushed_y.returncode == 0 and "Pushed version 3" in pushed_y.stdout, pushed_y
    assert "warning" not in pushed_y.stderr, pushed_y.stderr
    run_cli(*TIMEOUT, "pull", cwd=x)
    for root in (x, y):
        assert {p.name for p in root.iterdir() if p.name != ".metasync"} == {
            "start.txt", "x.txt", "y.txt"}


def _local_commits(tmp_path: Path, count: int) -> tuple[Repository, list[str]]:
    """A repository over one ``dir:`` backend with ``count`` local commits, oldest
    first (each a new file)."""
    backend = tmp_path / "backend"
    backend.mkdir()
    root = tmp_path / "src"
    root.mkdir()
    repo = Repository.init(root, [f"dir:{backend}"], replicas=1, encrypt=False)
    ids: list[str] = []
    for i in range(count):
        (root / f"f{i}.txt").write_text(f"{i}\n")
        made = repo.commit(f"c{i}")
        assert made is not None
        ids.append(made.commit_id)
    return repo, ids


def test_ancestry_quick_bounded_and_rewind(tmp_path: Path) -> None:
    """A descendant a few first parents ahead is found; one further ahead than the
    limit allows is undecided, not guessed; a "newer" master that is in fact an
    ancestor of the one this client had (a rewind) is not contained, and is
    itself the base to merge from; an unrelated line meets nothing."""
    repo, ids = _local_commits(tmp_path, 30)
    graph = repo.graph
    with repo:
        assert graph.ancestry(ids[-1], ids[-3]) == Ancestry(True)
        assert graph.ancestry(ids[-1], ids[0]) == Ancestry(True)  # past the quick walk
        assert graph.ancestry(ids[-1], ids[0], limit=5) == Ancestry(None)
        assert graph.ancestry(ids[10], ids[20]) == Ancestry(False, ids[10])
        assert graph.ancestry(ids[5], ids[5]) == Ancestry(True)
    (tmp_path / "other").mkdir()
    other, others = _local_commits(tmp_path / "other", 2)
    with other:
        pass
    # The other repository's commits are unknown here: a walk that cannot read
    # them is undecided (never a guess either way).
    with Repository.open(tmp_path / "src") as again:
        assert again.graph.ancestry(others[-1], ids[-1]) == Ancestry(None)
