"""PNG plots of the latest benchmark results, for docs/benchmarks.md.

Reads the newest ``bench/results/<kind>-*.json`` of each kind and writes
``docs/img/bench-*.png``; a kind without results is skipped with a note.
Needs matplotlib (the ``bench`` extra; ``bin/bench`` installs it).

    python bench/plots.py [--results DIR] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from benchlib import RESULTS_DIR, ROOT, log

OUT_DIR = ROOT / "docs" / "img"


def latest(results: Path, kind: str) -> dict[str, Any] | None:
    files = sorted(results.glob(f"{kind}-2*.json"))
    if not files:
        log(f"no {kind} results in {results}; skipping its plot")
        return None
    log(f"{kind}: {files[-1].name}")
    data: dict[str, Any] = json.loads(files[-1].read_text())
    data["_file"] = files[-1].name
    return data


def plot_peers(plt: Any, data: dict[str, Any], out: Path) -> list[Path]:
    written = []
    steps = ("push", "clone", "incremental", "nochange")
    for workload, per in data["results"].items():
        names = [n for n, r in per.items() if "push" in r]
        if not names:
            continue
        fig, ax = plt.subplots(figsize=(10, 4.5))
        width = 0.8 / len(names)
        for i, name in enumerate(names):
            values = [per[name].get(s, {}).get("wall_s", 0) for s in steps]
            xs = [j + (i - (len(names) - 1) / 2) * width for j in range(len(steps))]
            ax.bar(xs, values, width, label=name)
        ax.set_xticks(range(len(steps)), ["first push", "clone", "incremental", "no change"])
        ax.set_yscale("log")
        ax.set_ylabel("seconds (log scale)")
        links = data["links"]["s3"]
        ax.set_title(f"{workload} workload, profile '{data['profile']}' "
                     f"({links['rtt_ms']:g} ms RTT, {links['up_mb_s']} MB/s a link); one run")
        ax.legend(fontsize=7, ncol=3)
        ax.grid(axis="y", alpha=0.3)
        path = out / f"bench-peers-{data['profile']}-{workload}.png"
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def plot_consensus(plt: Any, data: dict[str, Any], out: Path) -> list[Path]:
    written = []
    res = data["results"]
    if res.get("proposers"):
        fig, ax = plt.subplots(figsize=(6.5, 4))
        for mode, per in res["proposers"].items():
            xs = [int(p) for p in per]
            ax.plot(xs, [s["latency_median_s"] * 1000 for s in per.values()], marker="o",
                    label=mode)
        ax.set_xlabel("competing proposers")
        ax.set_ylabel("median commit latency, ms")
        ax.set_title(f"Figure 9 shape: {data['config']['latency_ms']:g} ms a request, "
                     f"{data['config']['acceptors']} backends")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
        path = out / "bench-consensus-proposers.png"
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    if res.get("clients"):
        fig, ax = plt.subplots(figsize=(6.5, 4))
        for mode, per in res["clients"].items():
            xs = [int(m) for m in per]
            ax.plot(xs, [s["decide_mean_s"] * 1000 for s in per.values()], marker="o",
                    label=mode)
        ax.set_xlabel("clients (one of them proposing)")
        ax.set_ylabel("mean time to decide, ms")
        ax.set_xscale("log", base=2)
        ax.set_title("Figure 10 shape: Disk Paxos vs pPaxos")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
        path = out / "bench-consensus-clients.png"
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def plot_scale(plt: Any, data: dict[str, Any], out: Path) -> list[Path]:
    sizes = sorted(int(n) for n in data["results"])
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    for step in ("push", "status"):
        a1.plot(sizes, [data["results"][str(n)][step]["wall_s"] / n * 1e6 for n in sizes],
                marker="o", label=step)
        a2.plot(sizes, [data["results"][str(n)][step]["max_rss_mib"] for n in sizes],
                marker="o", label=step)
    for ax in (a1, a2):
        ax.set_xscale("log")
        ax.set_xlabel("files")
        ax.grid(alpha=0.3)
        ax.legend()
    a2.legend()
    a1.set_ylabel("µs per file")
    a2.set_ylabel("peak RSS, MiB")
    a2.axhline(1e9 / 2**20, color="red", linestyle="--", linewidth=1, label="1 GB target")
    fig.suptitle("metasync on many small files (one dir: backend); one run")
    path = out / "bench-scale.png"
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]


def plot_mapping(plt: Any, data: dict[str, Any], out: Path) -> list[Path]:
    services = list(data["capacities_gb"])
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.25
    for i, r in enumerate(("R=1", "R=2", "R=3")):
        xs = [j + (i - 1) * width for j in range(len(services))]
        ax.bar(xs, [data["table7"][r][s]["capacity_pct"] for s in services], width, label=r)
    ax.set_xticks(range(len(services)),
                  [f"{s}\n{data['capacities_gb'][s]} GB" for s in services])
    ax.set_ylabel("share of the service's capacity used, %")
    ax.set_yscale("log")
    ax.set_title("Table 7 shape: Linux workload on the paper's capacities")
    ax.legend()
    ax.grid(axis="y", alpha=0.3)
    path = out / "bench-mapping.png"
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=RESULTS_DIR)
    parser.add_argument("--out", type=Path, default=OUT_DIR)
    args = parser.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    args.out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    # Each workload from the peers run with the most contenders for it (the newest of
    # those): a plot never mixes runs.
    by_workload: dict[str, dict[str, Any]] = {}
    for path in sorted(args.results.glob("peers-wan-2*.json")):
        data = json.loads(path.read_text())
        for workload, per in data["results"].items():
            seen = by_workload.get(workload)
            if seen is None or len(per) >= len(seen["results"][workload]):
                by_workload[workload] = {**data, "results": {workload: per}}
    for data in by_workload.values():
        written += plot_peers(plt, data, args.out)
    for kind, fn in (("consensus", plot_consensus), ("scale", plot_scale),
                     ("mapping", plot_mapping)):
        data = latest(args.results, kind)
        if data is not None:
            written += fn(plt, data, args.out)
    for path in written:
        print(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
