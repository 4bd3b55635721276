"""System calls per file of a fresh ``metasync clone`` and of ``restic restore``.

Set-up as ``linux_bench.py`` (its functions, not timed): a copy of the Linux
workload pushed by metasync to three ``dir:`` backends with two replicas
(encrypted), and backed up by restic to a local repository. Then each of
``metasync clone dir:B1`` and ``restic restore latest`` runs once, into a new
folder, under ``strace -c -f -o FILE`` (every thread and child counted); the
result is checked against the workload. Printed per system call: its count for
each tool and that count per restored file, then the totals (start-up included),
also without the threads' waits (futex, nanosleep, sched_yield), whose counts follow
timing more than files.
strace slows both tools down a lot: only the counts mean anything, not the times.
Results go to ``bench/results/syscalls-<timestamp>.json``.

    python bench/syscalls.py [--work DIR] [--quick] [--keep]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from benchlib import write_results
from linux_bench import (
    DEFAULT_METASYNC,
    RESULTS_DIR,
    BenchError,
    MetasyncSide,
    ResticSide,
    fresh_dir,
    log,
    machine_info,
    make_scratch,
    manifest,
    verify_copy,
    workload_for,
    workload_record,
)
from linux_workload import DEFAULT_WORK

STRACE = "/usr/bin/strace"
#: Rows printed: the calls made at least this often per file by either tool.
SHOWN_PER_FILE = 0.01
#: Threads waking and sleeping: their counts follow timing (and strace's slowdown) more
#: than the work done per file, so a second total leaves them out.
SCHEDULING = ("futex", "nanosleep", "sched_yield")


def parse_strace_summary(text: str) -> dict[str, dict[str, int]]:
    """``strace -c`` output -> {syscall: {"calls": n, "errors": n}} (``total`` included)."""
    out: dict[str, dict[str, int]] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) not in (5, 6) or not parts[3].isdigit():
            continue  # the header, the rules, anything else
        errors = int(parts[4]) if len(parts) == 6 else 0
        out[parts[-1]] = {"calls": int(parts[3]), "errors": errors}
    if "total" not in out:
        raise BenchError(f"no strace summary in:\n{text[-2000:]}")
    return out


def traced(side: MetasyncSide | ResticSide, out: Path) -> dict[str, dict[str, int]]:
    """Run ``side``'s clone (restore) into a fresh folder under ``strace -c -f``."""
    fresh_dir(side.target)
    argv = [STRACE, "-c", "-f", "-o", str(out), *(str(c) for c in side.clone_cmd())]
    proc = subprocess.run(argv, cwd=side.base, env={**os.environ, **side.env},
                          capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise BenchError(f"{' '.join(argv)} failed (exit {proc.returncode}):\n"
                         f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return parse_strace_summary(out.read_text())


def print_table(counts: dict[str, dict[str, dict[str, int]]], files: int) -> None:
    """Per system call: each tool's count and count per file; then the totals."""
    tools = list(counts)
    names = {n for c in counts.values() for n in c if n != "total"}

    def calls(tool: str, name: str) -> int:
        return counts[tool].get(name, {}).get("calls", 0)

    shown = sorted((n for n in names if max(calls(t, n) for t in tools) / files >= SHOWN_PER_FILE),
                   key=lambda n: (-sum(calls(t, n) for t in tools), n))
    head = "".join(f" {t + ' calls':>16} {'per file':>9}" for t in tools)
    print(f"\n{files} files restored; system calls of the whole command (start-up included)")
    print(f"{'syscall':<20}{head}")
    print("-" * (20 + 27 * len(tools)))

    def row(label: str, values: list[int]) -> None:
        cells = "".join(f" {v:>16,} {v / files:>9.2f}" for v in values)
        print(f"{label:<20}{cells}")

    for name in shown:
        row(name, [calls(t, name) for t in tools])
    rest = sorted(names - set(shown))
    if rest:
        row(f"{len(rest)} others", [sum(calls(t, n) for n in rest) for t in tools])
    totals = [counts[t]["total"]["calls"] for t in tools]
    row("total", totals)
    row("total w/o waits", [total - sum(calls(t, n) for n in SCHEDULING)
                            for t, total in zip(tools, totals, strict=True)])
    print(f"(waits: {', '.join(SCHEDULING)}: their counts follow timing, and strace's "
          "slowdown, more than the files)")


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=DEFAULT_WORK, help="workload cache folder")
    parser.add_argument("--scratch", type=Path, default=None,
                        help="folder for copies (default WORK/syscalls-run)")
    parser.add_argument("--results", type=Path, default=RESULTS_DIR, help="results folder")
    parser.add_argument("--metasync", type=Path, default=DEFAULT_METASYNC, help="metasync binary")
    parser.add_argument("--keep", action="store_true",
                        help="keep the scratch folder (and strace's summaries in it)")
    parser.add_argument("--quick", action="store_true",
                        help="smoke test on the small 'paper' workload instead of Linux")
    args = parser.parse_args(argv)
    if not os.access(STRACE, os.X_OK):
        print(f"error: {STRACE} is needed (apt-get install strace)", file=sys.stderr)
        return 1
    workload = workload_for(args.work, args.quick)
    if workload is None:
        return 1
    log(f"workload {workload.describe()}")
    scratch = make_scratch(args, "syscalls-run")
    metasync = args.metasync.resolve()
    sides: dict[str, MetasyncSide | ResticSide] = {
        "metasync clone": MetasyncSide(workload, scratch, metasync),
        "restic restore": ResticSide(workload, scratch),
    }
    counts: dict[str, dict[str, dict[str, int]]] = {}
    try:
        expected = manifest(workload.path)
        for name, side in sides.items():
            log(f"{name}: set-up (copy, init, push or backup; not timed)")
            side.setup()
            side.push()
            log(f"{name} under strace -c -f")
            counts[name] = traced(side, scratch / f"strace-{name.split()[0]}.txt")
            verify_copy(expected, side.target, name)
            fresh_dir(side.target)
    except BenchError as exc:
        print(f"\nerror: {exc}", file=sys.stderr)
        return 1
    finally:
        if not args.keep:
            shutil.rmtree(scratch, ignore_errors=True)

    print_table(counts, workload.files)
    kind = "syscalls-quick" if args.quick else "syscalls"
    record: dict[str, Any] = {
        "note": "strace -c -f counts of one run each, start-up included; per_file = calls / "
                "files restored",
        "workload": workload_record(workload),
        "machine": machine_info(metasync),
        "strace": subprocess.run([STRACE, "-V"], capture_output=True, text=True,
                                 check=False).stdout.splitlines()[0],
        "commands": {name: " ".join(str(c) for c in side.clone_cmd())
                     for name, side in sides.items()},
        "syscalls": {name: {sc: {**v, "per_file": round(v["calls"] / workload.files, 4)}
                            for sc, v in sorted(c.items())}
                     for name, c in counts.items()},
        "total_per_file": {name: round(c["total"]["calls"] / workload.files, 2)
                           for name, c in counts.items()},
        "total_per_file_without_scheduling": {
            name: round((c["total"]["calls"] - sum(c.get(n, {}).get("calls", 0)
                                                   for n in SCHEDULING)) / workload.files, 2)
            for name, c in counts.items()},
        "scheduling_calls": list(SCHEDULING),
    }
    out = write_results(kind, record, args.results)
    print(f"results written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
