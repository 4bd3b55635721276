"""Clone throughput from bandwidth-limited backends (paper Figure 11; issue #7).

Each backend is wrapped in ``throttle:B:dir:...`` (tests/servers/throttle.py): all
requests to it share one link of B bytes per second. A repository of incompressible
files is pushed to three such backends with R = 2, then cloned; the clone's rate
is compared with B. A single backend (R = 1) is measured the same way as the
baseline. Target: the three-backend clone runs at 2.4 B or more.

    bin/bench pread                     (or: .venv/bin/python bench/parallel_read_bench.py
                                         [--rate-mb 10] [--size-mb 150] [--quick])

Writes bench/results/parallel-read-<UTC stamp>.json and prints a table.
"""

from __future__ import annotations

import argparse
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchlib import machine_info, write_results  # noqa: E402

from metasync.repository import Repository  # noqa: E402
from tests.servers import throttle  # noqa: E402

PASSPHRASE = "bench"
MiB = 1 << 20


def make_tree(root: Path, size_mb: int) -> int:
    """Incompressible files of 1 to 8 MiB adding up to ``size_mb`` MiB."""
    rng = random.Random(42)
    total = 0
    i = 0
    while total < size_mb * MiB:
        n = min(rng.randint(1, 8) * MiB, size_mb * MiB - total)
        folder = root / f"album{i % 5}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"photo{i:03d}.raw").write_bytes(rng.randbytes(n))
        total += n
        i += 1
    return total


def run(work: Path, backends: int, replicas: int, rate: float, size_mb: int) -> dict[str, float]:
    folders = [work / f"backend{i}" for i in range(backends)]
    for f in folders:
        f.mkdir(parents=True)
    uris = [f"throttle:{rate}:dir:{f}" for f in folders]
    src = work / "src"
    size = make_tree(src, size_mb)
    with Repository.init(src, uris, replicas=replicas, passphrase=lambda: PASSPHRASE) as repo:
        repo.push("bench")
    before = {u: throttle.links[u.split(":", 2)[2]].bytes for u in uris}
    start = time.monotonic()
    with Repository.clone(uris[0], work / "clone", passphrase=lambda: PASSPHRASE,
                          connect=uris[1:]):
        pass
    seconds = time.monotonic() - start
    read = [throttle.links[u.split(":", 2)[2]].bytes - before[u] for u in uris]
    return {"backends": backends, "replicas": replicas, "bytes": size, "seconds": seconds,
            "mb_per_s": size / seconds / 1e6, "share_per_backend": [r / sum(read) for r in read]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate-mb", type=float, default=10.0, help="B, in MB/s per backend")
    parser.add_argument("--size-mb", type=int, default=150, help="size of the tree in MiB")
    parser.add_argument("--quick", action="store_true", help="a 20 MiB tree (smoke test)")
    args = parser.parse_args()
    if args.quick:
        args.size_mb = 20
    rate = args.rate_mb * 1e6
    results = []
    for backends, replicas in ((1, 1), (3, 2)):
        work = Path(tempfile.mkdtemp(prefix="metasync-pread-"))
        try:
            results.append(run(work, backends, replicas, rate, args.size_mb))
        finally:
            shutil.rmtree(work, ignore_errors=True)
            throttle.links.clear()
    print(f"B = {args.rate_mb:g} MB/s per backend, {args.size_mb} MiB incompressible tree")
    print(f"{'backends':>8} {'R':>2} {'seconds':>8} {'MB/s':>7} {'x B':>6}  bytes read per backend")
    for r in results:
        shares = " ".join(f"{s:.0%}" for s in r["share_per_backend"])
        print(f"{r['backends']:>8} {r['replicas']:>2} {r['seconds']:>8.2f} {r['mb_per_s']:>7.2f} "
              f"{r['mb_per_s'] / args.rate_mb:>6.2f}  {shares}")
    out = write_results("parallel-read", {"machine": machine_info(), "rate_mb_per_s": args.rate_mb,
                                          "size_mib": args.size_mb, "runs": results})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
