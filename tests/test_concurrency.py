"""Many clients, one history, through the real CLI in separate processes.

Each client is its own process running ``metasync push`` in a loop, all at the
same time against the same three ``dir:`` backends; nothing coordinates them but
pPaxos. Then every clone pulls and the trees, the histories and the contents
are compared.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from conftest import METASYNC, PASSPHRASE, run_cli, snapshot

ROUNDS = 20

#: One client's work: ROUNDS rounds of add + edit + delete in its own folder, each
#: pushed at once. Runs as a separate process; prints one JSON line per push.
WORKER = r"""
import json, os, subprocess, sys
root, name, rounds, metasync = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
mine = os.path.join(root, name)
os.makedirs(mine, exist_ok=True)
for k in range(rounds):
    with open(os.path.join(mine, f"r{k:02d}.txt"), "w") as f:
        f.write(f"{name} round {k}\n")
    with open(os.path.join(mine, "counter.txt"), "w") as f:
        f.write(f"{name} at {k}\n")
    if k >= 2:
        os.remove(os.path.join(mine, f"r{k - 2:02d}.txt"))
    proc = subprocess.run([metasync, "push", "-m", f"{name} {k}"], cwd=root,
                          capture_output=True, text=True)
    print(json.dumps({"round": k, "rc": proc.returncode, "out": proc.stdout,
                      "err": proc.stderr}), flush=True)
"""


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["METASYNC_PASSPHRASE"] = PASSPHRASE
    return env


def _setup(tmp_path: Path, backends: list[Path], clients: int) -> list[Path]:
    origin = tmp_path / "c0"
    origin.mkdir()
    (origin / "shared.txt").write_text("shared\n")
    run_cli("init", str(origin), *(f"--backend=dir:{b}" for b in backends))
    run_cli("push", "-m", "start", cwd=origin)
    roots = [origin]
    for i in range(1, clients):
        run_cli("clone", f"dir:{backends[i % len(backends)]}", str(tmp_path / f"c{i}"))
        roots.append(tmp_path / f"c{i}")
    return roots


def _run_workers(roots: list[Path], rounds: int) -> list[list[dict[str, object]]]:
    procs = [
        subprocess.Popen([sys.executable, "-c", WORKER, str(root), f"client{i}", str(rounds), METASYNC],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
        for i, root in enumerate(roots)
    ]
    results = []
    for p in procs:
        out, err = p.communicate()
        assert p.returncode == 0, err
        results.append([json.loads(line) for line in out.splitlines()])
    return results


def _expected(clients: int, rounds: int) -> dict[str, str]:
    files = {"shared.txt": "shared\n"}
    for i in range(clients):
        name = f"client{i}"
        files[f"{name}/counter.txt"] = f"{name} at {rounds - 1}\n"
        for k in (rounds - 2, rounds - 1):
            files[f"{name}/r{k:02d}.txt"] = f"{name} round {k}\n"
    return files


def _files(root: Path) -> dict[str, str]:
    out = {}
    for path in root.rglob("*"):
        rel = path.relative_to(root).as_posix()
        if rel.startswith(".metasync") or not path.is_file():
            continue
        out[rel] = path.read_text()
    return out


def _log(root: Path) -> list[dict[str, object]]:
    """``log --json`` without version numbers (each client knows those of the
    versions it synced with, so they differ between clients)."""
    entries: list[dict[str, object]] = json.loads(run_cli("log", "--json", cwd=root).stdout)
    return [{k: v for k, v in e.items() if k != "version"} for e in entries]


def _first_parents(history: list[dict[str, object]]) -> list[dict[str, object]]:
    """The entries of ``history`` (a log) from its newest along first parents:
    the versions master went through."""
    by_id = {e["commit"]: e for e in history}
    chain = [history[0]]
    while chain[-1]["parents"]:
        chain.append(by_id[chain[-1]["parents"][0]])  # type: ignore[index]
    return chain


def test_three_clients_push_concurrently_and_converge(tmp_path: Path, backends: list[Path]) -> None:
    """3 clones in separate processes push non-conflicting changes concurrently, 20
    rounds each: every push succeeds (merging with the others when master moved);
    afterwards every clone pulls, and all trees are identical, hold every change
    (adds, edits and deletes of all three), and `log` shows the same linear history
    of exactly one commit per version."""
    roots = _setup(tmp_path, backends, 3)
    results = _run_workers(roots, ROUNDS)
    for i, pushes in enumerate(results):
        assert len(pushes) == ROUNDS
        failed = [p for p in pushes if p["rc"] != 0]
        assert not failed, f"client{i}: {failed[:2]}"
    for root in roots:
        run_cli("pull", cwd=root)
    trees = [snapshot(root) for root in roots]
    assert trees[0] == trees[1] == trees[2]
    assert _files(roots[0]) == _expected(3, ROUNDS)
    for root in roots:
        assert json.loads(run_cli("status", "--json", cwd=root).stdout)["clean"]

    logs = [_log(root) for root in roots]
    assert logs[0] == logs[1] == logs[2]
    history = logs[0]
    # One version per push (3 x ROUNDS) plus the first one, along first parents.
    chain = _first_parents(history)
    assert len(chain) == 3 * ROUNDS + 1
    assert chain[-1]["parents"] == [] and history[-1] == chain[-1]
    versions = {json.loads(run_cli("status", "--json", cwd=r).stdout)["version"] for r in roots}
    assert versions == {3 * ROUNDS + 1}
    # Every client's every round is in the log (on master's line or merged into it
    # as a merge's second parent), each commit once.
    messages = {str(e["message"]) for e in history}
    assert {f"client{i} {k}" for i in range(3) for k in range(ROUNDS)} <= messages
    assert len({e["commit"] for e in history}) == len(history)


def test_conflicting_edits_keep_both_versions(tmp_path: Path, backends: list[Path]) -> None:
    """Two clones edit the same file and push at the same time: exactly one version
    keeps the name, the other is `doc (conflict DEVICE YYYY-MM-DD HHMMSS).txt`,
    and after pulling both clones hold the same tree with both texts, byte for byte."""
    a, b = _setup(tmp_path, backends, 2)
    (a / "doc.txt").write_text("base\n")
    run_cli("push", cwd=a)
    run_cli("pull", cwd=b)
    texts = {a: "edited on A\n" * 1000, b: "edited on B\n" * 1000}
    for root, text in texts.items():
        (root / "doc.txt").write_text(text)
    procs = [subprocess.Popen([METASYNC, "push"], cwd=root, env=_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for root in (a, b)]
    outs = [p.communicate() for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    for root in (a, b):
        run_cli("pull", cwd=root)
    assert snapshot(a) == snapshot(b)
    docs = sorted(p.name for p in a.iterdir() if p.name.startswith("doc"))
    assert len(docs) == 2 and "doc.txt" in docs
    copy = next(d for d in docs if d != "doc.txt")
    assert re.fullmatch(r"doc \(conflict .+ \d{4}-\d\d-\d\d \d{6}\)\.txt", copy), copy
    assert {(a / d).read_text() for d in docs} == set(texts.values())
    # The loser's push reported the conflict copy it made, once.
    reported = "".join(out + err for out, err in outs)
    assert reported.count(copy) == 1, reported


def test_pushes_survive_one_unreachable_backend_and_fail_cleanly_without_quorum(
    tmp_path: Path, backends: list[Path]
) -> None:
    """With one of three backends unreachable, concurrent pushes from 3 clients
    still succeed. With two unreachable, push fails within the configured wait
    (--timeout) with a one-line error naming them, exit status non-zero, and
    changes nothing: no local commit, no byte written to the remaining backend.
    When they return, everything converges."""
    roots = _setup(tmp_path, backends, 3)
    away = [b.with_name(b.name + "-away") for b in backends]
    backends[2].rename(away[2])
    results = _run_workers(roots, 4)
    assert all(p["rc"] == 0 for pushes in results for p in pushes), results

    backends[1].rename(away[1])
    (roots[0] / "late.txt").write_text("written while two are away\n")
    before_status = run_cli("status", "--json", cwd=roots[0]).stdout
    before_backend = snapshot(backends[0])
    proc = run_cli("--timeout", "5", "push", cwd=roots[0], check=False)
    assert proc.returncode != 0
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "only 1 of 3 backends answered" in lines[0]
    assert str(backends[1]) in lines[0] and str(backends[2]) in lines[0]
    assert run_cli("status", "--json", cwd=roots[0]).stdout == before_status
    assert snapshot(backends[0]) == before_backend

    away[1].rename(backends[1])
    away[2].rename(backends[2])
    run_cli("push", cwd=roots[0])
    for root in roots:
        run_cli("pull", cwd=root)
    assert snapshot(roots[0]) == snapshot(roots[1]) == snapshot(roots[2])
    assert (roots[2] / "late.txt").read_text() == "written while two are away\n"
    assert _files(roots[0]) == {**_expected(3, 4), "late.txt": "written while two are away\n"}
    # Each client rewrites the copies it missed while a backend was away on its
    # next push; then every copy is in place.
    for root in roots:
        run_cli("push", cwd=root)
    assert run_cli("fsck", cwd=roots[1], check=False).returncode == 0


def _tamper_logs(backend: Path, rng_seed: int) -> int:
    """A Byzantine backend: drop and reorder the entries of every log it holds
    (swap entry files, delete some). Returns how many logs it changed."""
    import random

    rng = random.Random(rng_seed)
    changed = 0
    for log in sorted((backend / "metasync" / "log").glob("*")):
        entries = sorted(log.iterdir())
        if not entries:
            continue
        contents = [e.read_bytes() for e in entries]
        rng.shuffle(contents)
        keep = contents[: max(0, len(contents) - rng.randrange(0, 2))]
        for e in entries:
            e.unlink()
        for i, data in enumerate(keep):
            (log / f"{i:010d}").write_bytes(data)
        changed += 1
    return changed


def test_bft_repository_tolerates_a_backend_that_drops_and_reorders_log_entries(
    tmp_path: Path,
) -> None:
    """`init --bft` on 4 backends (3f + 1, f = 1): with one backend dropping and
    reordering its log entries between every command, two clients keep pushing
    (concurrently) and converge on one history; --bft refuses 3 backends."""
    backends = [tmp_path / f"backend{i}" for i in range(4)]
    for b in backends:
        b.mkdir()
    few = run_cli("init", str(tmp_path / "x"), *(f"--backend=dir:{b}" for b in backends[:3]),
                  "--bft", check=False)
    assert few.returncode != 0 and "--bft needs at least 4 backends" in few.stderr
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    (a / "start.txt").write_text("start\n")
    run_cli("init", str(a), *(f"--backend=dir:{x}" for x in backends), "--bft")
    run_cli("push", cwd=a)
    run_cli("clone", f"dir:{backends[1]}", str(b))
    for k in range(4):
        assert _tamper_logs(backends[3], k) >= 1
        (a / f"a{k}.txt").write_text(f"a {k}\n")
        (b / f"b{k}.txt").write_text(f"b {k}\n")
        procs = [subprocess.Popen([METASYNC, "push"], cwd=root, env=_env(), text=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE) for root in (a, b)]
        outs = [p.communicate() for p in procs]
        assert [p.returncode for p in procs] == [0, 0], outs
    _tamper_logs(backends[3], 99)
    for root in (a, b):
        run_cli("pull", cwd=root)
    assert snapshot(a) == snapshot(b)
    assert _files(a) == {"start.txt": "start\n", **{f"a{k}.txt": f"a {k}\n" for k in range(4)},
                         **{f"b{k}.txt": f"b {k}\n" for k in range(4)}}
    assert _log(a) == _log(b) and len(_first_parents(_log(a))) == 9
