"""Benchmark metasync against restic and git on the Linux-source workload.

Every tool works on the same prepared tree (see ``linux_workload.py``) in one
run.  Caches are not dropped between runs: every tool runs on the same warm
tree, which is what this benchmark compares.

Timed, each with ``time.perf_counter`` around ``subprocess.run``:

* metasync: ``init`` + ``push`` of a copy of the tree to three ``dir:``
  backends with two replicas (encrypted), ``clone dir:B1``, and ``status`` with
  no changes (run twice, the second run reported).
* restic: ``init`` + ``backup`` of the tree to a local repository, and
  ``restore latest``.
* git: ``status`` with no changes in a committed copy of the tree (run twice,
  the second run reported); ``init``/``add``/``commit`` are not timed.

Copies, clean-up and an ``os.sync`` before each command are not timed.  Clones and restores are checked against
the workload (paths, sizes and SHA-256 of every file).  Results go to
``bench/results/linux-<timestamp>.json``.

    python bench/linux_bench.py [--work DIR] [--skip TOOL] [--keep]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from linux_workload import DEFAULT_WORK, Workload, WorkloadError, count_tree, prepare

BENCH_DIR = Path(__file__).resolve().parent
ROOT = BENCH_DIR.parent
#: Where results go; ``bin/bench --quick`` points it elsewhere so smoke runs never
#: become the latest results.
RESULTS_DIR = Path(os.environ.get("METASYNC_BENCH_RESULTS") or BENCH_DIR / "results")
DEFAULT_METASYNC = ROOT / ".venv" / "bin" / "metasync"
PASSPHRASE = "metasync-linux-bench"
TOOLS = ("metasync", "restic", "git")
CACHE_NOTE = "caches not dropped: every tool runs on the same warm tree"

# (numerator, denominator, label) of the ratios to report.
RATIOS: tuple[tuple[str, str, str], ...] = (
    ("metasync.push", "restic.backup", "metasync push / restic backup"),
    ("metasync.clone", "restic.restore", "metasync clone / restic restore"),
    ("metasync.status", "git.status", "metasync status / git status"),
)


class BenchError(RuntimeError):
    """Raised when a benchmarked or helper command fails."""


@dataclass
class Timing:
    """Wall-clock and child CPU time of one or more commands."""

    wall: float = 0.0
    user: float = 0.0
    sys: float = 0.0
    commands: list[str] = field(default_factory=list)

    def add(self, other: Timing) -> None:
        """Accumulate ``other`` into this timing."""
        self.wall += other.wall
        self.user += other.user
        self.sys += other.sys
        self.commands.extend(other.commands)

    def as_dict(self) -> dict[str, Any]:
        """Return a JSON-ready dict."""
        return {
            "wall_s": round(self.wall, 4),
            "user_s": round(self.user, 4),
            "sys_s": round(self.sys, 4),
            "commands": self.commands,
        }


def log(msg: str) -> None:
    """Print a progress message to stderr."""
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def run(
    cmd: Sequence[str | Path],
    cwd: Path,
    env: Mapping[str, str] | None = None,
) -> tuple[Timing, subprocess.CompletedProcess[str]]:
    """Run ``cmd`` and time it; raise ``BenchError`` with its output if it fails.

    Dirty pages are flushed first (``os.sync``, not timed) so that one step's
    pending writes are not billed to the next; the page cache is kept.
    """
    argv = [str(c) for c in cmd]
    full_env = {**os.environ, **(env or {})}
    os.sync()
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run(argv, cwd=cwd, env=full_env, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise BenchError(
            f"command failed (exit {proc.returncode}) in {cwd}: {' '.join(argv)}\n"
            f"--- stdout ---\n{proc.stdout[-4000:]}\n--- stderr ---\n{proc.stderr[-8000:]}"
        )
    timing = Timing(
        wall=wall,
        user=after.ru_utime - before.ru_utime,
        sys=after.ru_stime - before.ru_stime,
        commands=[" ".join(argv)],
    )
    return timing, proc


def copy_tree(src: Path, dst: Path) -> None:
    """Copy ``src`` to ``dst`` (not timed), keeping modification times."""
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst, symlinks=True)


def manifest(root: Path) -> dict[str, tuple[int, str]]:
    """Map each file's relative path under ``root`` to (size, sha256).

    Top-level entries starting with a dot (tool metadata such as ``.git``) are
    skipped; the workload has none.
    """
    out: dict[str, tuple[int, str]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = Path(dirpath).relative_to(root)
        if rel_dir == Path("."):
            dirnames[:] = [d for d in dirnames if not d.startswith(".")]
            filenames = [f for f in filenames if not f.startswith(".")]
        for name in filenames:
            path = Path(dirpath) / name
            digest = hashlib.sha256(path.read_bytes()).hexdigest()
            out[(rel_dir / name).as_posix()] = (path.stat().st_size, digest)
    return out


def verify_copy(expected: dict[str, tuple[int, str]], root: Path, what: str) -> None:
    """Raise ``BenchError`` unless ``root`` holds exactly the files in ``expected``."""
    got = manifest(root)
    if got == expected:
        log(f"verified {what}: {len(got)} files identical to the workload")
        return
    missing = sorted(set(expected) - set(got))
    extra = sorted(set(got) - set(expected))
    differ = sorted(p for p in set(expected) & set(got) if expected[p] != got[p])
    raise BenchError(
        f"{what} differs from the workload: {len(missing)} missing, {len(extra)} extra, "
        f"{len(differ)} different; e.g. missing {missing[:3]}, extra {extra[:3]}, "
        f"different {differ[:3]}"
    )


def dir_bytes(root: Path) -> int:
    """Return the apparent size of all files under ``root``."""
    return count_tree(root)[1]


def bench_metasync(
    workload: Workload,
    expected: dict[str, tuple[int, str]],
    scratch: Path,
    metasync: Path,
) -> tuple[dict[str, Timing], dict[str, Any]]:
    """Time metasync init+push, clone and no-change status."""
    base = scratch / "metasync"
    base.mkdir(parents=True)
    repo = base / "repo"
    clone = base / "clone"
    backends = [base / f"B{i}" for i in (1, 2, 3)]
    for b in backends:
        b.mkdir()
    env = {"METASYNC_PASSPHRASE": PASSPHRASE}
    log("metasync: copying the workload (not timed)")
    copy_tree(workload.path, repo)

    timings: dict[str, Timing] = {}
    backend_args: list[str] = []
    for b in backends:
        backend_args += ["--backend", f"dir:{b}"]
    log("metasync: init + push")
    quiet: list[str | Path] = [metasync, "--quiet"]
    init, _ = run([*quiet, "init", repo, *backend_args, "--replicas", "2"], repo, env)
    push, _ = run([*quiet, "push"], repo, env)
    timings["init"] = init
    timings["push_only"] = push
    timings["push"] = Timing()
    timings["push"].add(init)
    timings["push"].add(push)

    log("metasync: clone")
    timings["clone"], _ = run([*quiet, "clone", f"dir:{backends[0]}", clone], base, env)
    verify_copy(expected, clone, "metasync clone")

    log("metasync: status (twice, second reported)")
    timings["status_first"], _ = run([*quiet, "status", "--offline"], repo, env)
    timings["status"], _ = run([*quiet, "status", "--offline"], repo, env)
    _, status = run([metasync, "status", "--json"], repo, env)
    state = json.loads(status.stdout)
    if not state.get("clean") or state.get("unpushed"):
        raise BenchError(f"metasync status is not clean after push:\n{status.stdout[:2000]}")

    extra = {
        "backend_bytes": {b.name: dir_bytes(b) for b in backends},
        "version": state.get("version"),
    }
    return timings, extra


def bench_restic(
    workload: Workload, expected: dict[str, tuple[int, str]], scratch: Path
) -> tuple[dict[str, Timing], dict[str, Any]]:
    """Time restic init+backup to a local repository and restore."""
    base = scratch / "restic"
    base.mkdir(parents=True)
    repo = base / "repo"
    target = base / "restore"
    env = {
        "RESTIC_PASSWORD": PASSPHRASE,
        "RESTIC_REPOSITORY": str(repo),
        "RESTIC_CACHE_DIR": str(base / "cache"),
    }
    timings: dict[str, Timing] = {}
    log("restic: init + backup")
    init, _ = run(["restic", "init", "--quiet"], base, env)
    backup, _ = run(["restic", "backup", "--quiet", "."], workload.path, env)
    timings["init"] = init
    timings["backup_only"] = backup
    timings["backup"] = Timing()
    timings["backup"].add(init)
    timings["backup"].add(backup)

    log("restic: restore")
    timings["restore"], _ = run(
        ["restic", "restore", "latest", "--target", str(target), "--quiet"], base, env
    )
    verify_copy(expected, target, "restic restore")
    _, cfg = run(["restic", "cat", "config"], base, env)
    extra = {
        "repo_bytes": dir_bytes(repo),
        "repository_version": json.loads(cfg.stdout).get("version"),
    }
    return timings, extra


def bench_git(workload: Workload, scratch: Path) -> tuple[dict[str, Timing], dict[str, Any]]:
    """Commit a copy of the tree (not timed) and time a no-change ``git status``."""
    work = scratch / "git"
    log("git: copying the workload, init, add, commit (not timed)")
    copy_tree(workload.path, work)
    ident = ["-c", "user.name=bench", "-c", "user.email=bench@localhost"]
    run(["git", "init", "--quiet"], work)
    run(["git", "add", "-A"], work)
    run(["git", *ident, "commit", "--quiet", "-m", "workload"], work)

    log("git: status (twice, second reported)")
    timings: dict[str, Timing] = {}
    timings["status_first"], _ = run(["git", "status"], work)
    timings["status"], _ = run(["git", "status"], work)
    _, porcelain = run(["git", "status", "--porcelain"], work)
    if porcelain.stdout.strip():
        raise BenchError(f"git status is not clean:\n{porcelain.stdout[:2000]}")
    return timings, {"git_dir_bytes": dir_bytes(work / ".git")}


def tool_version(cmd: Sequence[str | Path]) -> str:
    """Return the first output line of a version command, or why it failed."""
    try:
        proc = subprocess.run(
            [str(c) for c in cmd], capture_output=True, text=True, check=False, timeout=60
        )
    except OSError as exc:
        return f"unavailable ({exc})"
    text = (proc.stdout or proc.stderr).strip()
    first = text.splitlines()[0] if text else ""
    return first if proc.returncode == 0 else f"unavailable (exit {proc.returncode}: {first})"


def metasync_version(metasync: Path) -> str:
    """Return metasync's version from ``--version`` or its installed metadata."""
    version = tool_version([metasync, "--version"])
    if not version.startswith("unavailable"):
        return version
    python = metasync.parent / "python"
    script = "import importlib.metadata as m; print(m.version('metasync'))"
    return tool_version([python if python.exists() else sys.executable, "-c", script])


def machine_info(metasync: Path) -> dict[str, Any]:
    """Collect machine and tool information for the results file."""
    mem_kib = 0
    with open("/proc/meminfo") as fh:
        for line in fh:
            if line.startswith("MemTotal:"):
                mem_kib = int(line.split()[1])
    cpu_model = ""
    with open("/proc/cpuinfo") as fh:
        for line in fh:
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    return {
        "nproc": len(os.sched_getaffinity(0)),
        "loadavg_end": [round(x, 2) for x in os.getloadavg()],
        "cpu_count": os.cpu_count(),
        "cpu_model": cpu_model,
        "memory_bytes": mem_kib * 1024,
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "tools": {
            "metasync": metasync_version(metasync),
            "restic": tool_version(["restic", "version"]),
            "git": tool_version(["git", "--version"]),
        },
    }


def print_report(results: dict[str, dict[str, Timing]], ratios: dict[str, float]) -> None:
    """Print the timing table and ratios."""
    rows = [
        ("metasync", "init+push", "push"),
        ("metasync", "clone", "clone"),
        ("metasync", "status (2nd run)", "status"),
        ("restic", "init+backup", "backup"),
        ("restic", "restore", "restore"),
        ("git", "status (2nd run)", "status"),
    ]
    print()
    print(f"{'tool':<10} {'operation':<18} {'wall s':>9} {'user s':>9} {'sys s':>9}")
    print("-" * 59)
    for tool, label, key in rows:
        t = results.get(tool, {}).get(key)
        if t is not None:
            print(f"{tool:<10} {label:<18} {t.wall:>9.3f} {t.user:>9.3f} {t.sys:>9.3f}")
    print()
    for label, value in ratios.items():
        print(f"{label:<34} {value:>7.2f}x")
    if not ratios:
        print("no ratios: each needs metasync and the tool it is compared with")
    print(f"\n({CACHE_NOTE}; status figures are the second of two runs)")


def compute_ratios(results: dict[str, dict[str, Timing]]) -> dict[str, float]:
    """Return the wall-time ratios that can be computed from ``results``."""
    out: dict[str, float] = {}
    for num, den, label in RATIOS:
        ntool, nkey = num.split(".")
        dtool, dkey = den.split(".")
        n = results.get(ntool, {}).get(nkey)
        d = results.get(dtool, {}).get(dkey)
        if n is not None and d is not None and d.wall > 0:
            out[label] = n.wall / d.wall
    return out


def quick_workload(work: Path) -> Workload:
    """The generated 'paper' workload (``workloads.py``), for a smoke test."""
    from workloads import prepare as prepare_generated

    tree = prepare_generated("paper", work)
    files, size, disk = count_tree(tree.path)
    return Workload(tree.path, files, size, disk, "n/a", "paper workload (--quick)")


def workload_for(work: Path, quick: bool) -> Workload | None:
    """The Linux workload (or with ``quick`` the small generated one) prepared in
    ``work``; None, with the reason printed, if it cannot be."""
    try:
        return quick_workload(work) if quick else prepare(work)
    except WorkloadError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return None


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=DEFAULT_WORK, help="workload cache folder")
    parser.add_argument(
        "--scratch", type=Path, default=None, help="folder for copies (default WORK/run)"
    )
    parser.add_argument("--results", type=Path, default=RESULTS_DIR, help="results folder")
    parser.add_argument("--metasync", type=Path, default=DEFAULT_METASYNC, help="metasync binary")
    parser.add_argument(
        "--skip", action="append", choices=TOOLS, default=[], help="skip a tool (repeatable)"
    )
    parser.add_argument("--keep", action="store_true", help="keep the scratch folder")
    parser.add_argument("--quick", action="store_true",
                        help="smoke test on the small 'paper' workload instead of Linux")
    args = parser.parse_args(argv)

    workload = workload_for(args.work, args.quick)
    if workload is None:
        return 1
    log(f"workload {workload.describe()}")
    log(CACHE_NOTE)
    load_start = [round(x, 2) for x in os.getloadavg()]
    log(f"load average at start: {load_start}")
    scratch = (args.scratch or args.work / "run").resolve()
    if scratch.exists():
        shutil.rmtree(scratch)
    scratch.mkdir(parents=True)

    results: dict[str, dict[str, Timing]] = {}
    extras: dict[str, dict[str, Any]] = {}
    try:
        expected = manifest(workload.path)  # also warms the page cache for every tool
        if "metasync" not in args.skip:
            results["metasync"], extras["metasync"] = bench_metasync(
                workload, expected, scratch, args.metasync.resolve()
            )
            if not args.keep:
                shutil.rmtree(scratch / "metasync")
        if "restic" not in args.skip:
            results["restic"], extras["restic"] = bench_restic(workload, expected, scratch)
            if not args.keep:
                shutil.rmtree(scratch / "restic")
        if "git" not in args.skip:
            results["git"], extras["git"] = bench_git(workload, scratch)
    except BenchError as exc:
        print(f"\nerror: {exc}", file=sys.stderr)
        return 1
    finally:
        if not args.keep:
            shutil.rmtree(scratch, ignore_errors=True)

    ratios = compute_ratios(results)
    print_report(results, ratios)

    now = datetime.now(UTC)
    record = {
        "benchmark": "linux-quick" if args.quick else "linux",
        "timestamp": now.isoformat(timespec="seconds"),
        "note": f"{CACHE_NOTE}; status figures are the second of two runs",
        "workload": {
            "path": str(workload.path),
            "files": workload.files,
            "bytes": workload.bytes,
            "disk_bytes": workload.disk_bytes,
            "package": "linux-source-6.1",
            "package_version": workload.package_version,
            "subset": workload.subset,
        },
        "machine": {**machine_info(args.metasync.resolve()), "loadavg_start": load_start},
        "results": {
            tool: {key: t.as_dict() for key, t in timings.items()}
            for tool, timings in results.items()
        },
        "extra": extras,
        "ratios": {label: round(value, 3) for label, value in ratios.items()},
        "skipped": sorted(set(args.skip)),
    }
    args.results.mkdir(parents=True, exist_ok=True)
    kind = "linux-quick" if args.quick else "linux"
    out = args.results / f"{kind}-{now.strftime('%Y%m%dT%H%M%SZ')}.json"
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    tmp.replace(out)
    print(f"results written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
