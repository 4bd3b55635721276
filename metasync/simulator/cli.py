"""``bin/simulate``: run a range of seeds (in worker processes), print the failing
ones with the command that replays each, and a summary line."""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
from collections import Counter
from collections.abc import Iterator, Sequence

from metasync.simulator.model import Result
from metasync.simulator.params import DEFAULT_BFT_SHARE
from metasync.simulator.simulation import run


def _run_one(args: tuple[int, float, bool]) -> Result:
    return run(*args)


def _results(seeds: Sequence[int], bft_share: float, verbose: bool, jobs: int) -> Iterator[Result]:
    tasks = [(s, bft_share, verbose) for s in seeds]
    if jobs <= 1 or len(seeds) < 50:
        yield from map(_run_one, tasks)
        return
    # fork where there is one (cheapest); Windows has only spawn (_run_one is importable).
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    with multiprocessing.get_context(method).Pool(jobs) as pool:
        yield from pool.imap(_run_one, tasks, chunksize=max(1, min(64, len(seeds) // (jobs * 8))))


def _default_jobs() -> int:
    if sys.platform == "linux":
        return len(os.sched_getaffinity(0))  # the CPUs this process may use
    return os.cpu_count() or 1


def main(argv: Sequence[str] | None = None) -> int:
    """``bin/simulate`` with ``argv``: 1 if some schedule broke an invariant, else 0."""
    parser = argparse.ArgumentParser(
        prog="bin/simulate",
        description="Run seeded pPaxos fault-injection schedules and check their invariants.")
    parser.add_argument("--seeds", type=int, required=True, help="how many schedules to run")
    parser.add_argument("--first-seed", type=int, default=0, help="the first seed (default 0)")
    parser.add_argument("--bft-share", type=float, default=DEFAULT_BFT_SHARE,
                        help=f"share of schedules in Byzantine mode (default {DEFAULT_BFT_SHARE})")
    parser.add_argument("--jobs", type=int, default=_default_jobs(),
                        help="worker processes (default: the CPUs available)")
    parser.add_argument("-v", "--verbose", action="store_true", help="print each schedule's trace")
    parser.add_argument("--stats", action="store_true", help="print what the schedules exercised")
    args = parser.parse_args(argv)
    if args.seeds < 0 or not 0.0 <= args.bft_share <= 1.0:
        parser.error("--seeds must be >= 0 and --bft-share within [0, 1]")

    seeds = range(args.first_seed, args.first_seed + args.seeds)
    extra = "" if args.bft_share == DEFAULT_BFT_SHARE else f" --bft-share {args.bft_share:g}"
    failing = 0
    totals: Counter[str] = Counter()
    for result in _results(seeds, args.bft_share, args.verbose, args.jobs):
        if args.verbose:
            print("\n".join(result.trace))
            print(f"seed {result.seed}: {result.events} events, {result.versions} versions, "
                  f"{len(result.violations)} violations")
            for v in result.violations:
                print(f"  violation: {v}")
        totals.update(result.stats)
        if result.violations:
            failing += 1
            more = f" (+{len(result.violations) - 1} more)" if len(result.violations) > 1 else ""
            print(f"seed {result.seed}: {result.violations[0]}{more} [{result.params}]; replay: "
                  f"bin/simulate --seeds 1 --first-seed {result.seed}{extra} -v", flush=True)
    if args.stats:
        for key in sorted(totals):
            print(f"  {key}: {totals[key]}")
    print(f"{args.seeds} schedules, {failing} violations")
    return 1 if failing else 0
