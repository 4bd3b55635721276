"""A first push throttled by ``--bwlimit`` (issue 20): the rate the bytes actually
reach the backends, against the limit.

Two runs, each a first push (``metasync --bwlimit 2M:off push``, a separate
process, encrypted) of incompressible files into empty ``dir:`` backends:

- ``one``: one backend, ~150 MiB of files (the push's worker threads still send
  several packs at once);
- ``parallel``: three backends with two replicas and packs of 4 MiB, so many
  objects are in flight at once, each going to two of the backends: ~64 MiB of
  files (~128 MiB sent), the transfers to all three backends at once sharing the
  one limit of the process, not one limit each.

What reached the backends is sampled every :data:`SAMPLE` seconds as the sum of
the sizes of every file under each backend folder (a ``dir:`` upload grows a
temporary file as it is sent, so the count follows the bytes as they land). The
rate reported is the steady one, between the moments the total first reached 5%
and 95% of its final value (start-up and the final commit excluded), and the
whole push's (final bytes over the push's wall time) beside it; the uploads in
progress at once (``dir:`` temporary files) are counted in each sample. Done when the
steady rate is within 10% of the limit in both runs, measured over about 60 s.

    bin/bench bwlimit       (or: .venv/bin/python bench/bwlimit_bench.py
                             [--limit 2M] [--size-mb 150] [--parallel-mb 64] [--quick])

Writes bench/results/bwlimit-<UTC stamp>.json and prints a table.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from benchlib import METASYNC, BenchError, log, machine_info, table, write_results

from metasync.backends.bwlimit import parse_bwlimit
from metasync.backends.keys import TEMP_PREFIX

PASSPHRASE = "metasync-bwlimit-bench"
MiB = 1 << 20
#: Seconds between two samples of the backends' sizes.
SAMPLE = 0.25


def make_files(root: Path, size_mb: int, seed: int) -> int:
    """Incompressible files of 1 to 12 MiB adding up to ``size_mb`` MiB."""
    rng = random.Random(seed)
    root.mkdir(parents=True)
    total, i = 0, 0
    while total < size_mb * MiB:
        size = min(rng.randint(1, 12) * MiB, size_mb * MiB - total)
        (root / f"file{i:03d}.bin").write_bytes(os.urandom(size))
        total += size
        i += 1
    return total


def folder_bytes(folder: Path) -> int:
    """The sizes of every file under ``folder``."""
    return scan(folder)[0]


def scan(folder: Path) -> tuple[int, int]:
    """The sizes of every file under ``folder``, and how many of them are uploads in
    progress (``dir:`` temporary files). A file renamed meanwhile (a finished upload)
    counts as absent for this sample."""
    total = temps = 0
    for dirpath, _, files in os.walk(folder):
        for name in files:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
            except FileNotFoundError:
                continue
            temps += name.startswith(TEMP_PREFIX)
    return total, temps


class Sampler:
    """Samples each backend folder's bytes every :data:`SAMPLE` seconds in a thread."""

    def __init__(self, folders: list[Path]) -> None:
        self.folders = folders
        self.samples: list[tuple[float, list[int]]] = []
        #: Uploads in progress on each backend, per sample.
        self.in_flight: list[list[int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        start = time.monotonic()
        while True:
            stopping = self._stop.is_set()
            scans = [scan(f) for f in self.folders]
            self.samples.append((time.monotonic() - start, [b for b, _ in scans]))
            self.in_flight.append([t for _, t in scans])
            if stopping:
                return
            self._stop.wait(SAMPLE)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def steady_rate(samples: list[tuple[float, list[int]]], base: int) -> dict[str, float]:
    """The rate between the 5% and 95% marks of the bytes added after ``base``."""
    totals = [(t, sum(sizes) - base) for t, sizes in samples]
    final = totals[-1][1]
    t5 = next(t for t, b in totals if b >= 0.05 * final)
    b5 = next(b for t, b in totals if b >= 0.05 * final)
    t95 = next(t for t, b in totals if b >= 0.95 * final)
    b95 = next(b for t, b in totals if b >= 0.95 * final)
    return {"seconds": t95 - t5, "bytes": b95 - b5, "rate": (b95 - b5) / (t95 - t5)}


def concurrency(in_flight: list[list[int]]) -> dict[str, Any]:
    """How many uploads were in progress at once (all backends), and on how many
    backends, counted over the samples that saw any."""
    busy = [row for row in in_flight if sum(row)]
    uploads: dict[str, int] = {}
    backends: dict[str, int] = {}
    for row in busy:
        uploads[str(sum(row))] = uploads.get(str(sum(row)), 0) + 1
        key = str(sum(1 for n in row if n))
        backends[key] = backends.get(key, 0) + 1
    return {"samples_by_uploads_in_flight": dict(sorted(uploads.items(), key=lambda kv: int(kv[0]))),
            "samples_by_backends_receiving": dict(sorted(backends.items())),
            "median_uploads_in_flight": sorted(sum(r) for r in busy)[len(busy) // 2] if busy else 0}


def run_push(work: Path, name: str, size_mb: int, backends: int, replicas: int,
             limit: str, seed: int, pack_mib: int) -> dict[str, Any]:
    """One first push of ``size_mb`` MiB to ``backends`` empty dir: backends, in packs
    of ``pack_mib`` MiB (smaller packs: more uploads in flight at once)."""
    folder = work / f"{name}-src"
    data = make_files(folder, size_mb, seed)
    dirs = [work / f"{name}-b{i}" for i in range(backends)]
    for d in dirs:
        d.mkdir()
    env = {**os.environ, "METASYNC_PASSPHRASE": PASSPHRASE}
    env.pop("METASYNC_BWLIMIT", None)
    env["METASYNC_PACK_SIZE"] = str(pack_mib * MiB)
    init = [str(METASYNC), "init", str(folder), "--replicas", str(replicas),
            *[a for d in dirs for a in ("--backend", f"dir:{d}")]]
    subprocess.run(init, env=env, check=True, capture_output=True)
    base = sum(folder_bytes(d) for d in dirs)
    log(f"{name}: pushing {data / MiB:.0f} MiB to {backends} backend(s), "
        f"{replicas} replica(s), --bwlimit {limit}")
    with Sampler(dirs) as sampler:
        start = time.monotonic()
        proc = subprocess.run([str(METASYNC), "--bwlimit", limit, "push", "-q"], cwd=folder,
                              env=env, capture_output=True, text=True, check=False)
        wall = time.monotonic() - start
    if proc.returncode != 0:
        raise BenchError(f"push failed ({proc.returncode}): {proc.stderr[-2000:]}")
    schedule = parse_bwlimit(limit)
    up = schedule.at(datetime.now()).up if schedule else None
    sent = sum(folder_bytes(d) for d in dirs) - base
    steady = steady_rate(sampler.samples, base)
    per_backend = [sampler.samples[-1][1][i] - sampler.samples[0][1][i] for i in range(backends)]
    record = {
        "backends": backends, "replicas": replicas, "limit": limit, "pack_bytes": pack_mib * MiB,
        "limit_bytes_per_s": up, "data_bytes": data, "sent_bytes": sent,
        "per_backend_bytes": per_backend, "push_seconds": round(wall, 2),
        "whole_push_rate": sent / wall, "steady": steady,
        "steady_vs_limit": steady["rate"] / up if up else None,
        **concurrency(sampler.in_flight),
    }
    log(f"{name}: {sent / MiB:.1f} MiB in {wall:.1f} s; steady {steady['rate'] / MiB:.3f} MiB/s "
        f"over {steady['seconds']:.1f} s ({record['steady_vs_limit']:.3f} of the limit)")
    return record


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--limit", default="2M:off", help="the --bwlimit of the pushes")
    parser.add_argument("--size-mb", type=int, default=150, help="MiB of the one-backend push")
    parser.add_argument("--parallel-mb", type=int, default=64,
                        help="MiB of the three-backend push (two replicas: twice sent)")
    parser.add_argument("--quick", action="store_true", help="small sizes (a smoke test)")
    parser.add_argument("--work", type=Path, default=None, help="scratch folder")
    args = parser.parse_args()
    size, parallel = (args.size_mb, args.parallel_mb) if not args.quick else (16, 8)
    work = Path(tempfile.mkdtemp(prefix="bwlimit-bench-", dir=args.work))
    try:
        runs = {
            "one": run_push(work, "one", size, 1, 1, args.limit, 1, 16),
            "parallel": run_push(work, "parallel", parallel, 3, 2, args.limit, 2, 4),
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)
    target = 0.10
    ok = all(r["steady_vs_limit"] is not None and abs(r["steady_vs_limit"] - 1) <= target
             for r in runs.values())
    out = write_results("bwlimit", {"machine": machine_info(), "quick": args.quick,
                                    "target": f"steady rate within {target:.0%} of the limit",
                                    "met": ok, "runs": runs})
    rows = [[name, str(r["backends"]), f"{r['sent_bytes'] / MiB:.1f}",
             f"{r['push_seconds']:.1f}", f"{r['steady']['seconds']:.1f}",
             f"{r['steady']['rate'] / MiB:.3f}", f"{r['whole_push_rate'] / MiB:.3f}",
             f"{(r['steady_vs_limit'] - 1) * 100:+.1f}%", str(r["median_uploads_in_flight"])]
            for name, r in runs.items()]
    print(table(["run", "backends", "MiB sent", "push s", "steady s", "steady MiB/s",
                 "whole push MiB/s", "vs limit", "uploads at once (median)"], rows))
    print(f"results: {out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
