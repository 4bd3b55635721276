"""``metasync status`` answered by a running service against ``git status``, on the
Linux-source workload (issue 19: at most 2x ``git status``, same run).

Set-up as ``linux_bench.py`` (not timed): a copy of the tree pushed to three
``dir:`` backends with two replicas (encrypted), registered with ``metasync
add-folder`` and run by ``metasync service`` (its folder's watch is a daemon's),
waited for until it answers ``status``; a committed git copy of the
tree. Then ``--pairs`` rounds, each timing (``time.perf_counter`` around
``subprocess.run``, nothing changed in either tree) ``metasync status``, ``git
status``, ``metasync status --offline`` and ``metasync status --scan`` (the scan
without the daemon's help, as without a daemon), the order of the first two
alternating from round to round. Reported: each one's median, and the median of
the per-round ratios to ``git status``. The daemon's answer is checked first to be
the scan's (``--json``, both forms) and to come from the daemon (``--debug``).

    python bench/status_bench.py [--work DIR] [--pairs N] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from benchlib import write_results
from linux_bench import (
    DEFAULT_METASYNC,
    PASSPHRASE,
    RESULTS_DIR,
    BenchError,
    compile_bytecode,
    copy_tree,
    log,
    machine_info,
    run,
    workload_for,
)
from linux_workload import DEFAULT_WORK

#: The commands timed each round, by name.
COMMANDS = ("metasync status", "git status", "metasync status --offline",
            "metasync status --scan")


def _time(argv: list[str], cwd: Path, env: dict[str, str]) -> float:
    start = time.perf_counter()
    proc = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, check=False)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise BenchError(f"{' '.join(argv)} failed (exit {proc.returncode}): "
                         f"{proc.stderr.decode(errors='replace')[-2000:]}")
    return wall


def _wait_for_answer(metasync: str, repo: Path, env: dict[str, str], limit: float) -> None:
    """Until the daemon answers ``status`` (its first answer scans the folder)."""
    tick = threading.Event()
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        proc = subprocess.run([metasync, "--debug", "status", "--offline"], cwd=repo, env=env,
                              capture_output=True, text=True, check=False)
        if "answered by the daemon" in proc.stderr:
            return
        tick.wait(0.5)
    log_tail = (repo / ".metasync" / "daemon.log").read_text().splitlines()[-15:]
    raise BenchError(f"the daemon did not answer `status` within {limit:g} s; the last "
                     f"status said: {proc.stderr}\nthe daemon's log ends:\n" + "\n".join(log_tail))


def bench(tree: Path, scratch: Path, metasync: str, pairs: int) -> dict[str, Any]:
    """Set up both trees and the daemon, and time ``pairs`` rounds."""
    env = {**os.environ, "METASYNC_PASSPHRASE": PASSPHRASE}
    repo, git = scratch / "metasync", scratch / "git"
    backends = [scratch / f"B{i}" for i in (1, 2, 3)]
    for b in backends:
        b.mkdir(parents=True)
    log("copying the workload twice, metasync init + push, git init + commit (not timed)")
    copy_tree(tree, repo)
    copy_tree(tree, git)
    uris = [a for b in backends for a in ("--backend", f"dir:{b}")]
    run([metasync, "-q", "init", repo, *uris, "--replicas", "2"], repo, env)
    run([metasync, "-q", "push"], repo, env)
    ident = ["-c", "user.name=bench", "-c", "user.email=bench@localhost"]
    run(["git", "init", "--quiet"], git)
    run(["git", "add", "-A"], git)
    run(["git", *ident, "commit", "--quiet", "-m", "workload"], git)
    run(["git", "status"], git)  # the index's stat data refreshed once, as a user's is

    # The service, as a user runs it (issue 19): the folder registered in a config
    # folder of the bench's own, one `metasync service` running every folder.
    log("starting the service (metasync add-folder, metasync service)")
    env["XDG_CONFIG_HOME"] = str(scratch / "xdg")
    run([metasync, "add-folder", str(repo)], repo, env)
    daemon = subprocess.Popen([metasync, "service", "--listen", "127.0.0.1:0"], cwd=repo,
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_for_answer(metasync, repo, env, 300)
        fast = subprocess.run([metasync, "status", "--json"], cwd=repo, env=env,
                              capture_output=True, text=True, check=True).stdout
        scan = subprocess.run([metasync, "status", "--json", "--scan"], cwd=repo, env=env,
                              capture_output=True, text=True, check=True).stdout
        if fast != scan or not json.loads(fast)["clean"]:
            raise BenchError(f"the daemon's answer differs from a scan's:\n{fast}\n{scan}")
        argv = {
            "metasync status": [metasync, "status"],
            "git status": ["git", "status"],
            "metasync status --offline": [metasync, "status", "--offline"],
            "metasync status --scan": [metasync, "status", "--scan"],
        }
        cwd = {name: git if name.startswith("git") else repo for name in COMMANDS}
        times: dict[str, list[float]] = {name: [] for name in COMMANDS}
        for i in range(pairs):
            order = list(COMMANDS)
            if i % 2:
                order[0], order[1] = order[1], order[0]
            for name in order:
                times[name].append(_time(argv[name], cwd[name], env))
        answered = subprocess.run([metasync, "--debug", "status"], cwd=repo, env=env,
                                  capture_output=True, text=True, check=True).stderr
        if "answered by the daemon (cache)" not in answered:
            raise BenchError(f"the last status was not answered from the cache: {answered}")
    finally:
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(timeout=120)
    git_times = times["git status"]
    return {
        "times_s": {k: [round(t, 4) for t in v] for k, v in times.items()},
        "median_s": {k: round(statistics.median(v), 4) for k, v in times.items()},
        "median_ratio_to_git": {
            k: round(statistics.median(t / g for t, g in zip(v, git_times, strict=True)), 3)
            for k, v in times.items() if k != "git status"},
    }


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=DEFAULT_WORK, help="workload cache folder")
    parser.add_argument("--results", type=Path, default=RESULTS_DIR, help="results folder")
    parser.add_argument("--metasync", type=Path, default=DEFAULT_METASYNC, help="metasync binary")
    parser.add_argument("--pairs", type=int, default=21, help="rounds timed (default 21)")
    parser.add_argument("--quick", action="store_true",
                        help="smoke test on the small 'paper' workload, 5 rounds")
    args = parser.parse_args(argv)
    workload = workload_for(args.work, args.quick)
    if workload is None:
        return 1
    pairs = 5 if args.quick else args.pairs
    log(f"workload {workload.describe()}")
    load_start = [round(x, 2) for x in os.getloadavg()]
    scratch = (args.work / "status-run").resolve()
    shutil.rmtree(scratch, ignore_errors=True)
    try:
        compile_bytecode(args.metasync.resolve())
        result = bench(workload.path, scratch, str(args.metasync.resolve()), pairs)
    except BenchError as exc:
        print(f"\nerror: {exc}", file=sys.stderr)
        return 1
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    print(f"\n{'command':<28} {'median s':>9} {'/ git status':>13}   ({pairs} rounds)")
    for name in COMMANDS:
        ratio = result["median_ratio_to_git"].get(name)
        shown = f"{ratio:>12.2f}x" if ratio is not None else f"{'':>13}"
        print(f"{name:<28} {result['median_s'][name]:>9.3f} {shown}")
    kind = "status-quick" if args.quick else "status"
    out = write_results(kind, {
        "workload": {"path": str(workload.path), "files": workload.files,
                     "bytes": workload.bytes, "subset": workload.subset},
        "rounds": pairs,
        "machine": {**machine_info(args.metasync.resolve()), "loadavg_start": load_start},
        **result,
    }, args.results)
    print(f"results written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
