"""Benchmark metasync against restic and git on the Linux-source workload.

Every tool works on the same prepared tree (see ``linux_workload.py``) in one
run.  Caches are not dropped between runs: every tool runs on the same warm
tree, which is what this benchmark compares.

Three figures, each metasync against its peer:

* push: metasync ``init`` + ``push`` of a copy of the tree to three ``dir:``
  backends with two replicas (encrypted), against restic ``init`` + ``backup``
  of the tree to a local repository;
* clone: ``metasync clone dir:B1`` against ``restic restore latest``;
* status: ``metasync status --offline`` with no changes against ``git status``
  in a committed copy of the tree (each run once untimed just before).

After one warm-up pair (not counted), ``--pairs`` pairs (default 5) are timed:
in each pair both tools run back to back on the same warm tree, the order
alternating from pair to pair.  Each pair starts afresh: metasync's
``.metasync`` folder and backends and restic's repository are deleted (the copy
of the tree is made once), and the previous clone and restore.  Every command
runs as its own process after an ``os.sync`` (not timed), spawned by a small
launcher (``LAUNCHER``): its wall time is ``time.perf_counter`` around it, its
CPU time and peak memory (maximum resident set size, of that process alone)
come from ``os.wait4``.  Reported per figure:
each tool's median, min-max wall time and median peak memory, the per-pair
ratios (their median and the highest), and whether issue 21's targets are met.

Everything a tool writes -- copies of the tree, backends, repositories, clones --
is on a fresh ext4 made for the run (``mkfs.ext4`` defaults, a loop device; needs
root; ``--fs host`` uses a folder of the host instead): what creating files costs
on the host's own file system can depend on where a folder lands
(``benchlib.scratch_fs``). The clone and the restore write into one folder.

The metasync timed is this checkout as a user installs it: built as a wheel and
installed into a virtualenv of its own (``benchlib.installed_copy``; not timed),
not the development virtualenv's editable install, whose import finder costs every
command ~20 ms of start-up (``--metasync PATH`` times another program).

Clones and restores are checked against the workload (paths, sizes and SHA-256
of every file) and both statuses to be clean in the warm-up and the first timed
pair (``--verify-all``: in every pair).  Results go to
``bench/results/linux-<timestamp>.json``.

    python bench/linux_bench.py [--pairs N] [--work DIR] [--skip TOOL] [--fs ext4|host]
                                [--keep] [--quick]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchlib import SCRATCH_FS, BenchError, installed_copy, scratch_fs, write_results
from linux_workload import DEFAULT_WORK, Workload, WorkloadError, count_tree, prepare

BENCH_DIR = Path(__file__).resolve().parent
ROOT = BENCH_DIR.parent
#: Where results go; ``bin/bench --quick`` points it elsewhere so smoke runs never
#: become the latest results.
RESULTS_DIR = Path(os.environ.get("METASYNC_BENCH_RESULTS") or BENCH_DIR / "results")
DEFAULT_METASYNC = ROOT / ".venv" / "bin" / "metasync"
PASSPHRASE = "metasync-linux-bench"
#: The one folder both the clone and the restore write into (each deletes the
#: other's first, not timed): where a folder lands can decide what creating files in
#: it costs (``benchlib.scratch_fs``), so both tools write to the same place.
OUTPUT = "out"
TOOLS = ("metasync", "restic", "git")
DEFAULT_PAIRS = 5
QUICK_PAIRS = 3
CACHE_NOTE = "caches not dropped: every tool runs on the same warm tree"

#: The figures: name -> (metasync's label, peer tool, peer's label).
FIGURES: dict[str, tuple[str, str, str]] = {
    "push": ("init+push", "restic", "init+backup"),
    "clone": ("clone", "restic", "restore"),
    "status": ("status --offline", "git", "status"),
}

#: Issue 21's Done-when targets: (figure, "time" or "memory", at most this ratio at the
#: median, at most this ratio in any single pair or None, what).
TARGETS: tuple[tuple[str, str, float, float | None, str], ...] = (
    ("clone", "time", 0.8, 1.0, "clone <= 0.8x restic restore (median), no pair > 1.0x"),
    ("push", "time", 0.6, None, "push (init+push) <= 0.6x restic init+backup (median)"),
    ("status", "time", 3.0, None, "status --offline <= 3x git status (median)"),
    ("push", "memory", 1.2, None, "push peak memory <= 1.2x restic backup's"),
    ("clone", "memory", 1.2, None, "clone peak memory <= 1.2x restic restore's"),
)


@dataclass
class Timing:
    """Wall-clock and CPU time, and peak memory, of one or more commands."""

    wall: float = 0.0
    user: float = 0.0
    sys: float = 0.0
    max_rss_kib: int = 0
    commands: list[str] = field(default_factory=list)

    def add(self, other: Timing) -> None:
        """Accumulate ``other`` into this timing (times add up, memory is the peak)."""
        self.wall += other.wall
        self.user += other.user
        self.sys += other.sys
        self.max_rss_kib = max(self.max_rss_kib, other.max_rss_kib)
        self.commands.extend(other.commands)

    @property
    def max_rss_mib(self) -> float:
        """Peak memory in MiB."""
        return self.max_rss_kib / 1024

    def as_dict(self) -> dict[str, Any]:
        """Return a JSON-ready dict."""
        return {
            "wall_s": round(self.wall, 4),
            "user_s": round(self.user, 4),
            "sys_s": round(self.sys, 4),
            "max_rss_mib": round(self.max_rss_mib, 1),
            "commands": self.commands,
        }


def log(msg: str) -> None:
    """Print a progress message to stderr."""
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


#: Runs one command (argv after the report fd) and writes to that fd its wall time,
#: user and system time, peak memory (KiB) and exit code. A command's ``ru_maxrss``
#: includes the peak resident set of the process it was spawned from (Linux keeps
#: the old image's high-water mark across fork and exec), so spawned straight from
#: the bench (which holds the workload's manifest) every command would read at
#: least the bench's own peak. Spawned from this small interpreter instead, a
#: command's figure is exact down to ~9 MiB (the launcher's own size).
LAUNCHER = """
import os, sys, time
fd, argv = int(sys.argv[1]), sys.argv[2:]
start = time.perf_counter()
pid = os.posix_spawnp(argv[0], argv, os.environ)
_, status, usage = os.wait4(pid, 0)
wall = time.perf_counter() - start
code = os.waitstatus_to_exitcode(status)
os.write(fd, f"{wall} {usage.ru_utime} {usage.ru_stime} {usage.ru_maxrss} {code}".encode())
sys.exit(1 if code else 0)
"""


def run(
    cmd: Sequence[str | Path],
    cwd: Path,
    env: Mapping[str, str] | None = None,
) -> tuple[Timing, subprocess.CompletedProcess[str]]:
    """Run ``cmd`` and time it; raise ``BenchError`` with its output if it fails.

    Dirty pages are flushed first (``os.sync``, not timed) so that one step's
    pending writes are not billed to the next; the page cache is kept.  The
    command is spawned by ``LAUNCHER`` and reaped with ``os.wait4``: its wall
    time is measured around it there, and its rusage is that process's own (and
    its waited-for children's), so ``ru_maxrss`` is its peak resident set.
    """
    argv = [str(c) for c in cmd]
    full_env = {**os.environ, **(env or {})}
    launcher = [sys.executable, "-I", "-S", "-c", LAUNCHER]
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        report_r, report_w = os.pipe()
        os.sync()
        try:
            proc = subprocess.Popen([*launcher, str(report_w), *argv], cwd=cwd, env=full_env,
                                    stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                    pass_fds=(report_w,))
        finally:
            os.close(report_w)
        with os.fdopen(report_r, "rb") as report:
            fields = report.read().split()
        proc.wait()
        out.seek(0)
        err.seek(0)
        stdout = out.read().decode(errors="replace")
        stderr = err.read().decode(errors="replace")
    returncode = int(fields[4]) if len(fields) == 5 else proc.returncode or 1
    if returncode != 0:
        raise BenchError(
            f"command failed (exit {returncode}) in {cwd}: {' '.join(argv)}\n"
            f"--- stdout ---\n{stdout[-4000:]}\n--- stderr ---\n{stderr[-8000:]}"
        )
    timing = Timing(wall=float(fields[0]), user=float(fields[1]), sys=float(fields[2]),
                    max_rss_kib=int(fields[3]), commands=[" ".join(argv)])
    return timing, subprocess.CompletedProcess(argv, returncode, stdout, stderr)


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


def fresh_dir(path: Path) -> Path:
    """Delete ``path`` if it exists (not timed) and return it."""
    if path.exists():
        shutil.rmtree(path)
    return path


class MetasyncSide:
    """metasync's side: one copy of the tree, three ``dir:`` backends, a clone.

    ``push`` starts afresh each time (the ``.metasync`` folder and the backends are
    deleted, the copy of the tree is kept).
    """

    tool = "metasync"

    def __init__(self, workload: Workload, scratch: Path, metasync: Path) -> None:
        self.workload = workload
        self.base = scratch / "metasync"
        self.repo = self.base / "repo"
        self.target = scratch / OUTPUT
        self.backends = [self.base / f"B{i}" for i in (1, 2, 3)]
        self.env = {"METASYNC_PASSPHRASE": PASSPHRASE}
        self.quiet: list[str | Path] = [metasync, "--quiet"]
        self.metasync = metasync

    def setup(self) -> None:
        """Copy the workload (not timed)."""
        self.base.mkdir(parents=True, exist_ok=True)
        log("metasync: copying the workload (not timed)")
        copy_tree(self.workload.path, self.repo)

    def push(self) -> Timing:
        """``init`` + ``push`` to fresh backends."""
        fresh_dir(self.repo / ".metasync")
        backend_args: list[str] = []
        for b in self.backends:
            fresh_dir(b).mkdir()
            backend_args += ["--backend", f"dir:{b}"]
        timing, _ = run([*self.quiet, "init", self.repo, *backend_args, "--replicas", "2"],
                        self.repo, self.env)
        push, _ = run([*self.quiet, "push"], self.repo, self.env)
        timing.add(push)
        return timing

    def clone_cmd(self) -> list[str | Path]:
        """The clone command (run in ``self.base``, into a fresh ``self.target``)."""
        return [*self.quiet, "clone", f"dir:{self.backends[0]}", self.target]

    def clone(self) -> Timing:
        """``clone`` from the first backend into a fresh folder."""
        fresh_dir(self.target)
        return run(self.clone_cmd(), self.base, self.env)[0]

    def status(self) -> Timing:
        """A no-change ``status --offline`` (after one untimed run)."""
        run([*self.quiet, "status", "--offline"], self.repo, self.env)
        return run([*self.quiet, "status", "--offline"], self.repo, self.env)[0]

    def check_status(self) -> dict[str, Any]:
        """Raise unless ``status`` is clean and nothing is unpushed; return its JSON."""
        _, status = run([self.metasync, "status", "--json"], self.repo, self.env)
        state: dict[str, Any] = json.loads(status.stdout)
        if not state.get("clean") or state.get("unpushed"):
            raise BenchError(f"metasync status is not clean after push:\n{status.stdout[:2000]}")
        return state

    def extra(self) -> dict[str, Any]:
        """Facts for the results file."""
        return {"backend_bytes": {b.name: dir_bytes(b) for b in self.backends}}


class ResticSide:
    """restic's side: a local repository (made afresh by each ``push``) and a restore."""

    tool = "restic"

    def __init__(self, workload: Workload, scratch: Path) -> None:
        self.workload = workload
        self.base = scratch / "restic"
        self.repo = self.base / "repo"
        self.target = scratch / OUTPUT
        self.env = {
            "RESTIC_PASSWORD": PASSPHRASE,
            "RESTIC_REPOSITORY": str(self.repo),
            "RESTIC_CACHE_DIR": str(self.base / "cache"),
        }

    def setup(self) -> None:
        """Make the scratch folder."""
        self.base.mkdir(parents=True, exist_ok=True)

    def push(self) -> Timing:
        """``init`` + ``backup`` to a fresh repository."""
        fresh_dir(self.repo)
        fresh_dir(self.base / "cache")
        timing, _ = run(["restic", "init", "--quiet"], self.base, self.env)
        backup, _ = run(["restic", "backup", "--quiet", "."], self.workload.path, self.env)
        timing.add(backup)
        return timing

    def clone_cmd(self) -> list[str | Path]:
        """The restore command (run in ``self.base``, into a fresh ``self.target``)."""
        return ["restic", "restore", "latest", "--target", self.target, "--quiet"]

    def clone(self) -> Timing:
        """``restore latest`` into a fresh folder."""
        fresh_dir(self.target)
        return run(self.clone_cmd(), self.base, self.env)[0]

    def extra(self) -> dict[str, Any]:
        """Facts for the results file."""
        _, cfg = run(["restic", "cat", "config"], self.base, self.env)
        return {"repo_bytes": dir_bytes(self.repo),
                "repository_version": json.loads(cfg.stdout).get("version")}


class GitSide:
    """git's side: a committed copy of the tree (not timed) and ``git status``."""

    tool = "git"

    def __init__(self, workload: Workload, scratch: Path) -> None:
        self.workload = workload
        self.work = scratch / "git"

    def setup(self) -> None:
        """Copy the tree and commit it (not timed)."""
        log("git: copying the workload, init, add, commit (not timed)")
        copy_tree(self.workload.path, self.work)
        ident = ["-c", "user.name=bench", "-c", "user.email=bench@localhost"]
        run(["git", "init", "--quiet"], self.work)
        run(["git", "add", "-A"], self.work)
        run(["git", *ident, "commit", "--quiet", "-m", "workload"], self.work)

    def status(self) -> Timing:
        """A no-change ``git status`` (after one untimed run)."""
        run(["git", "status"], self.work)
        return run(["git", "status"], self.work)[0]

    def check_status(self) -> None:
        """Raise unless the copy is clean."""
        _, porcelain = run(["git", "status", "--porcelain"], self.work)
        if porcelain.stdout.strip():
            raise BenchError(f"git status is not clean:\n{porcelain.stdout[:2000]}")

    def extra(self) -> dict[str, Any]:
        """Facts for the results file."""
        return {"git_dir_bytes": dir_bytes(self.work / ".git")}


def run_pair(
    index: int,
    sides: dict[str, Any],
    expected: dict[str, tuple[int, str]],
    verify: bool,
) -> dict[str, dict[str, Timing]]:
    """One pair of every figure: both tools back to back, metasync first in odd
    pairs (the warm-up is pair 0), its peer first in even ones."""
    ms, restic, git = sides.get("metasync"), sides.get("restic"), sides.get("git")
    order = ["metasync", "peer"] if index % 2 else ["peer", "metasync"]
    steps: dict[str, dict[str, Any]] = {
        "push": {"metasync": ms and ms.push, "peer": restic and restic.push},
        "clone": {"metasync": ms and ms.clone, "peer": restic and restic.clone},
        "status": {"metasync": ms and ms.status, "peer": git and git.status},
    }
    out: dict[str, dict[str, Timing]] = {}
    for figure, step in steps.items():
        _, peer, _ = FIGURES[figure]
        out[figure] = {}
        for who in order:
            if step[who] is not None:
                out[figure][peer if who == "peer" else "metasync"] = step[who]()
                # Checked at once: the other tool's clone replaces this one (OUTPUT).
                if figure == "clone" and verify and who == "metasync" and ms is not None:
                    verify_copy(expected, ms.target, "metasync clone")
                if figure == "clone" and verify and who == "peer" and restic is not None:
                    verify_copy(expected, restic.target, "restic restore")
        if figure == "status" and verify:
            if ms is not None:
                ms.check_status()
            if git is not None:
                git.check_status()
    return out


def summarize(pairs: list[dict[str, dict[str, Timing]]]) -> dict[str, Any]:
    """Per figure: each tool's median, spread and peak memory; the per-pair ratios."""
    out: dict[str, Any] = {}
    for figure, (_, peer, _) in FIGURES.items():
        fig: dict[str, Any] = {}
        for tool in ("metasync", peer):
            runs = [p[figure][tool] for p in pairs if tool in p.get(figure, {})]
            if not runs:
                continue
            walls = [t.wall for t in runs]
            fig[tool] = {
                "wall_s": [round(w, 4) for w in walls],
                "median_wall_s": round(statistics.median(walls), 4),
                "min_wall_s": round(min(walls), 4),
                "max_wall_s": round(max(walls), 4),
                "median_user_s": round(statistics.median(t.user for t in runs), 4),
                "median_sys_s": round(statistics.median(t.sys for t in runs), 4),
                "max_rss_mib": [round(t.max_rss_mib, 1) for t in runs],
                "median_max_rss_mib": round(statistics.median(t.max_rss_mib for t in runs), 1),
            }
        if "metasync" in fig and peer in fig:
            ratios = [p[figure]["metasync"].wall / p[figure][peer].wall for p in pairs]
            fig["ratios"] = [round(r, 3) for r in ratios]
            fig["median_ratio"] = round(statistics.median(ratios), 3)
            fig["max_ratio"] = round(max(ratios), 3)
            fig["memory_ratio"] = round(
                fig["metasync"]["median_max_rss_mib"] / fig[peer]["median_max_rss_mib"], 3)
        out[figure] = fig
    return out


def check_targets(figures: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 21's targets against ``figures``: each one's figures and whether it is met
    (None when a tool was skipped)."""
    out: list[dict[str, Any]] = []
    for figure, kind, median_max, pair_max, what in TARGETS:
        fig = figures.get(figure, {})
        entry: dict[str, Any] = {"target": what, "figure": figure, "kind": kind,
                                 "limit": median_max}
        if "median_ratio" not in fig:
            entry["met"] = None
        elif kind == "time":
            entry["median_ratio"] = fig["median_ratio"]
            entry["max_pair_ratio"] = fig["max_ratio"]
            met = fig["median_ratio"] <= median_max
            if pair_max is not None:
                entry["pair_limit"] = pair_max
                met = met and fig["max_ratio"] <= pair_max
            entry["met"] = met
        else:
            peer = FIGURES[figure][1]
            entry["metasync_mib"] = fig["metasync"]["median_max_rss_mib"]
            entry["peer_mib"] = fig[peer]["median_max_rss_mib"]
            entry["ratio"] = fig["memory_ratio"]
            entry["met"] = fig["memory_ratio"] <= median_max
        out.append(entry)
    return out


def print_report(figures: dict[str, Any], targets: list[dict[str, Any]], pairs: int) -> None:
    """Print each figure's medians, spreads, memory and ratios, then the targets."""
    print()
    print(f"{pairs} pairs after one warm-up pair; {CACHE_NOTE}")
    print(f"{'figure':<7} {'tool':<8} {'operation':<17} {'median s':>9} {'min-max s':>15} "
          f"{'user s':>7} {'sys s':>7} {'peak MiB':>9}")
    print("-" * 86)
    for figure, (ms_label, peer, peer_label) in FIGURES.items():
        fig = figures.get(figure, {})
        for tool, label in (("metasync", ms_label), (peer, peer_label)):
            t = fig.get(tool)
            if t is None:
                continue
            spread = f"{t['min_wall_s']:.3f}-{t['max_wall_s']:.3f}"
            print(f"{figure:<7} {tool:<8} {label:<17} {t['median_wall_s']:>9.3f} {spread:>15} "
                  f"{t['median_user_s']:>7.2f} {t['median_sys_s']:>7.2f} "
                  f"{t['median_max_rss_mib']:>9.1f}")
        if "ratios" in fig:
            each = " ".join(f"{r:.2f}" for r in fig["ratios"])
            print(f"{'':<7} ratio per pair: {each}; median {fig['median_ratio']:.2f}x, "
                  f"highest {fig['max_ratio']:.2f}x; peak memory {fig['memory_ratio']:.2f}x")
    print()
    print("targets (issue 21):")
    for t in targets:
        if t["met"] is None:
            shown, verdict = "(a tool skipped)", "n/a"
        elif t["kind"] == "time":
            shown = f"median {t['median_ratio']:.2f}x"
            if "pair_limit" in t:
                shown += f", highest pair {t['max_pair_ratio']:.2f}x"
            verdict = "met" if t["met"] else "NOT MET"
        else:
            shown = f"{t['metasync_mib']:.0f} / {t['peer_mib']:.0f} MiB = {t['ratio']:.2f}x"
            verdict = "met" if t["met"] else "NOT MET"
        print(f"  {t['target']:<56} {shown:<36} {verdict}")


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


def compile_bytecode(metasync: Path) -> None:
    """Compile metasync's modules to bytecode (not timed), as installing a wheel does.
    Run from a source checkout (an editable install) under PYTHONDONTWRITEBYTECODE --
    this machine's environment sets it -- every command would otherwise compile every
    module it imports again, each time: a cost no installed copy pays."""
    python = metasync.parent / "python"
    script = ("import compileall, importlib, os, sys\n"
              "for name in ('metasync', 'metasync.backends', 'metasync.translators'):\n"
              "    path = os.path.dirname(importlib.import_module(name).__file__)\n"
              "    compileall.compile_dir(path, quiet=1, workers=0) or sys.exit(1)\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    proc = subprocess.run([str(python if python.exists() else sys.executable), "-c", script],
                          env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise BenchError(f"compiling metasync's bytecode failed:\n{proc.stdout}{proc.stderr}")


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
    commit = tool_version(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"])
    return {
        "nproc": len(os.sched_getaffinity(0)),
        "loadavg_end": [round(x, 2) for x in os.getloadavg()],
        "cpu_count": os.cpu_count(),
        "cpu_model": cpu_model,
        "memory_bytes": mem_kib * 1024,
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "tools": {
            "metasync": f"{metasync_version(metasync)} (commit {commit})",
            "restic": tool_version(["restic", "version"]),
            "git": tool_version(["git", "--version"]),
        },
    }


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


def workload_record(workload: Workload) -> dict[str, Any]:
    """The workload's facts for a results file."""
    return {
        "path": str(workload.path),
        "files": workload.files,
        "bytes": workload.bytes,
        "disk_bytes": workload.disk_bytes,
        "package": "linux-source-6.1",
        "package_version": workload.package_version,
        "subset": workload.subset,
    }


def make_scratch(args: argparse.Namespace, name: str = "run", where: Path | None = None) -> Path:
    """A fresh scratch folder (``--scratch``, or ``name`` in ``where`` or WORK)."""
    scratch: Path = (args.scratch or (where or args.work) / name).resolve()
    if scratch.exists():
        shutil.rmtree(scratch)
    scratch.mkdir(parents=True)
    return scratch


def run_pairs(args: argparse.Namespace, workload: Workload, scratch: Path, pairs: int
              ) -> tuple[list[dict[str, dict[str, Timing]]], dict[str, dict[str, Timing]],
                         dict[str, dict[str, Any]], list[float], Path] | None:
    """The warm-up and the timed pairs in ``scratch``; None if a command failed."""
    load_start = [round(x, 2) for x in os.getloadavg()]
    log(f"load average at start: {load_start}")
    metasync = (args.metasync or DEFAULT_METASYNC).resolve()
    if "metasync" not in args.skip:
        try:
            if args.metasync is None:  # pip compiles its bytecode
                log("installing this checkout as a wheel (not timed)")
                metasync = installed_copy(args.work)
            else:
                compile_bytecode(metasync)
        except BenchError as exc:
            print(f"\nerror: {exc}", file=sys.stderr)
            return None

    sides: dict[str, Any] = {}
    if "metasync" not in args.skip:
        sides["metasync"] = MetasyncSide(workload, scratch, metasync)
    if "restic" not in args.skip:
        sides["restic"] = ResticSide(workload, scratch)
    if "git" not in args.skip:
        sides["git"] = GitSide(workload, scratch)
    timed: list[dict[str, dict[str, Timing]]] = []
    warmup: dict[str, dict[str, Timing]] = {}
    extras: dict[str, dict[str, Any]] = {}
    try:
        expected = manifest(workload.path)  # also warms the page cache for every tool
        for side in sides.values():
            side.setup()
        for i in range(pairs + 1):
            log(f"pair {i}/{pairs}" + (" (warm-up, not counted)" if i == 0 else "")
                + (": metasync first" if i % 2 else ": its peer first"))
            result = run_pair(i, sides, expected, verify=args.verify_all or i <= 1)
            if i == 0:
                warmup = result
            else:
                timed.append(result)
        extras = {name: side.extra() for name, side in sides.items()}
        if "metasync" in sides:
            extras["metasync"]["version"] = sides["metasync"].check_status().get("version")
    except BenchError as exc:
        print(f"\nerror: {exc}", file=sys.stderr)
        return None
    finally:
        if not args.keep:
            shutil.rmtree(scratch, ignore_errors=True)

    return timed, warmup, extras, load_start, metasync


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=DEFAULT_WORK, help="workload cache folder")
    parser.add_argument(
        "--scratch", type=Path, default=None, help="folder for copies (default WORK/run)"
    )
    parser.add_argument("--results", type=Path, default=RESULTS_DIR, help="results folder")
    parser.add_argument("--metasync", type=Path, default=None,
                        help="metasync program to time (default: this checkout built as a "
                             "wheel and installed in WORK/installed, as a user has it)")
    parser.add_argument(
        "--skip", action="append", choices=TOOLS, default=[], help="skip a tool (repeatable)"
    )
    parser.add_argument("--pairs", type=int, default=None,
                        help=f"pairs timed after the warm-up (default {DEFAULT_PAIRS}, "
                             f"{QUICK_PAIRS} with --quick)")
    parser.add_argument("--verify-all", action="store_true",
                        help="check clones, restores and statuses in every pair, not only in "
                             "the warm-up and the first")
    parser.add_argument("--keep", action="store_true",
                        help="keep the scratch folder (with --fs host or --scratch)")
    parser.add_argument("--fs", choices=SCRATCH_FS, default="ext4",
                        help="where the copies and clones go: a fresh ext4 made for the run "
                             "(default; needs root) or a folder of the host (--fs host)")
    parser.add_argument("--quick", action="store_true",
                        help="smoke test on the small 'paper' workload instead of Linux")
    args = parser.parse_args(argv)
    pairs = args.pairs if args.pairs is not None else QUICK_PAIRS if args.quick else DEFAULT_PAIRS
    if pairs < 1:
        parser.error("--pairs must be at least 1")

    workload = workload_for(args.work, args.quick)
    if workload is None:
        return 1
    log(f"workload {workload.describe()}")
    log(CACHE_NOTE)
    with ExitStack() as stack:
        try:
            where, fs = (args.scratch, "host folder") if args.scratch else \
                stack.enter_context(scratch_fs(args.fs, args.work))
        except BenchError as exc:
            print(f"\nerror: {exc}", file=sys.stderr)
            return 1
        log(f"copies and clones on: {fs}")
        outcome = run_pairs(args, workload, make_scratch(args, where=where), pairs)
    if outcome is None:
        return 1
    timed, warmup, extras, load_start, metasync = outcome
    figures = summarize(timed)
    targets = check_targets(figures)
    print_report(figures, targets, pairs)

    def pair_dict(p: dict[str, dict[str, Timing]]) -> dict[str, Any]:
        return {fig: {tool: t.as_dict() for tool, t in by_tool.items()}
                for fig, by_tool in p.items()}

    kind = "linux-quick" if args.quick else "linux"
    record = {
        "note": f"{CACHE_NOTE}; {pairs} pairs after one warm-up pair, the order alternating "
                "(metasync first in odd pairs); status is the second of two runs in each pair; "
                "peak memory is each command's own max RSS (os.wait4)",
        "pairs_timed": pairs,
        "scratch_fs": fs,
        "metasync_install": "given (--metasync)" if args.metasync else
                            "wheel of this checkout in its own virtualenv (benchlib.installed_copy)",
        "workload": workload_record(workload),
        "machine": {**machine_info(metasync), "loadavg_start": load_start},
        "figures": figures,
        "targets": targets,
        "ratios": {f"metasync {FIGURES[f][0]} / {FIGURES[f][1]} {FIGURES[f][2]}":
                   fig["median_ratio"] for f, fig in figures.items() if "median_ratio" in fig},
        "pairs": [{"pair": i + 1, "first": "metasync" if (i + 1) % 2 else "peer",
                   **pair_dict(p)} for i, p in enumerate(timed)],
        "warmup": pair_dict(warmup),
        "extra": extras,
        "skipped": sorted(set(args.skip)),
    }
    out = write_results(kind, record, args.results)
    print(f"results written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
