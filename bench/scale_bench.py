"""metasync on a very large tree: wall time and peak memory of push and status.

For each size N (default 100,000 and 1,000,000 files) the ``small-N`` workload
(``workloads.py``: 100 files per folder, 20-1000 bytes each) is made a
repository in place (``.metasync`` is removed again afterwards) with one
``dir:`` backend and R = 1, so what is measured is metasync itself, not a
network. Timed, each a separate process: ``init``; ``push`` (scan, hash, pack,
encrypt, write, commit); ``status`` on the unchanged tree, twice (the second is
reported). Peak memory is the maximum resident set size of the ``metasync``
process (``os.wait4``). The growth figures compare the per-file cost at the
largest N with that at the smallest.

    python bench/scale_bench.py [--sizes 100000,1000000] [--quick] [--keep]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from typing import Any

from benchlib import METASYNC, PASSPHRASE, WORK_DIR, log, machine_info, run, table, write_results
from workloads import prepare

STEPS = ("init", "push", "status_first", "status")


def bench_size(n: int, keep: bool) -> dict[str, Any]:
    tree = prepare(f"small-{n}", WORK_DIR)
    backend = WORK_DIR / "scale" / f"backend-{n}"
    if backend.exists():
        shutil.rmtree(backend)
    backend.mkdir(parents=True)
    env = {"METASYNC_PASSPHRASE": PASSPHRASE}
    meta = tree.path / ".metasync"
    if meta.exists():
        shutil.rmtree(meta)
    out: dict[str, Any] = {"files": tree.files, "bytes": tree.bytes}
    try:
        for step, args in (
            ("init", ["init", str(tree.path), "--backend", f"dir:{backend}", "--replicas", "1"]),
            ("push", ["push"]),
            ("status_first", ["status"]),
            ("status", ["status"]),
        ):
            log(f"{n} files: {step}")
            timing, _ = run([METASYNC, "--quiet", *args], tree.path, env)
            out[step] = timing.as_dict()
            log(f"{n} files: {step} {timing.wall:.1f} s, peak {timing.max_rss_kib / 1024:.0f} MiB")
        _, text = run([METASYNC, "status", "--json"], tree.path, env)
        if '"clean": true' not in text:
            raise RuntimeError(f"status not clean after push: {text[:500]}")
        out["backend_bytes"] = sum(p.stat().st_size for p in backend.rglob("*") if p.is_file())
        out["state_db_bytes"] = (meta / "state.db").stat().st_size
    finally:
        if not keep:
            shutil.rmtree(meta, ignore_errors=True)
            shutil.rmtree(backend, ignore_errors=True)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="100000,1000000",
                        help="comma-separated file counts (default 100000,1000000)")
    parser.add_argument("--quick", action="store_true", help="sizes 2000 and 20000")
    parser.add_argument("--keep", action="store_true", help="keep .metasync and the backend")
    args = parser.parse_args(argv)
    sizes = [2000, 20000] if args.quick else [int(s) for s in args.sizes.split(",")]
    started = time.perf_counter()
    results = {str(n): bench_size(n, args.keep) for n in sizes}

    rows = []
    for n, r in results.items():
        for step in ("push", "status"):
            t = r[step]
            rows.append([f"{int(n):,}", step, f"{t['wall_s']:.1f}",
                         f"{t['wall_s'] / int(n) * 1e6:.0f}", f"{t['max_rss_mib']:.0f}"])
    print()
    print(table(["files", "step", "wall s", "µs per file", "peak RSS MiB"], rows))
    small, large = str(min(sizes)), str(max(sizes))
    growth = {}
    for step in ("push", "status"):
        per_small = results[small][step]["wall_s"] / int(small)
        per_large = results[large][step]["wall_s"] / int(large)
        growth[step] = {
            "per_file_ratio": round(per_large / per_small, 3),
            "memory_ratio": round(results[large][step]["max_rss_mib"]
                                  / max(results[small][step]["max_rss_mib"], 1), 3),
        }
        print(f"{step}: per-file cost at {int(large):,} / at {int(small):,} = "
              f"{growth[step]['per_file_ratio']:.2f}x; peak memory x"
              f"{growth[step]['memory_ratio']:.2f}")
    record = {
        "note": "one dir: backend, R = 1; each step a separate metasync process; peak memory "
                "is the process's maximum RSS",
        "sizes": sizes,
        "results": results,
        "growth": growth,
        "machine": machine_info(),
        "elapsed_s": round(time.perf_counter() - started, 1),
    }
    out = write_results("scale", record)
    print(f"results in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
