"""The stable mapping against the paper's Tables 7 and 8 (section 5.2).

Pure computation with :mod:`metasync.mapping` (no backend, no network):

* **Table 7, balance**: the Linux-source workload (``linux_workload.py``), one
  object per file as in the paper (which turned off directory collapsing for this
  test), placed on the paper's five services with their free capacities
  (Dropbox 2 GB, Google Drive 15 GB, Box 10 GB, OneDrive 7 GB, Baidu 2048 GB) for
  R = 1, 2, 3: objects and bytes per service, and the share of each service's
  capacity they use.
* **Table 8, reconfiguration**: the photos workload (``workloads.py``) cut into
  metasync's content-defined chunks (FastCDC, 1 MiB average), on Dropbox, Box,
  Google Drive and OneDrive: R = 2 -> 3 with S = 4; S = 4 -> 3 (OneDrive removed);
  S = 3 -> 4 (OneDrive added). For each: object copies the new placement adds
  (``moved``), the theoretical minimum (``metasync.mapping.minimum_moved_copies``),
  the bytes those copies hold, and the copies left for garbage collection. The
  time the paper measured depends on the services; ours is the bytes over the
  ``wan`` profile's 10 MB/s per link, shown as an estimate only.

    python bench/mapping_bench.py [--quick]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time
from pathlib import Path
from typing import Any

from benchlib import WORK_DIR, log, machine_info, table, write_results

from metasync.mapping import StableMapping, movement

#: The paper's Table 5/7 free capacities, GB.
CAPACITIES = {"Dropbox": 2, "Google": 15, "Box": 10, "OneDrive": 7, "Baidu": 2048}
TABLE8_SERVICES = ("Dropbox", "Box", "Google", "OneDrive")


def file_objects(root: Path, limit: int | None = None) -> list[tuple[str, int]]:
    """(sha256 of content, size) of every file under ``root``, in path order."""
    out: list[tuple[str, int]] = []
    paths = sorted(os.path.join(d, n) for d, _, names in os.walk(root) for n in names)
    for path in paths[:limit]:
        with open(path, "rb") as fh:
            data = fh.read()
        out.append((hashlib.sha256(data).hexdigest(), len(data)))
    return out


def chunk_objects(root: Path) -> list[tuple[str, int]]:
    """(sha256, size) of metasync's FastCDC chunks of every file under ``root``."""
    from pyfastcdc import FastCDC

    from metasync.worktree import CHUNK_AVG, CHUNK_MAX, CHUNK_MIN

    out: list[tuple[str, int]] = []
    for path in sorted(os.path.join(d, n) for d, _, names in os.walk(root) for n in names):
        with open(path, "rb") as fh:
            for piece in FastCDC(CHUNK_AVG, min_size=CHUNK_MIN, max_size=CHUNK_MAX).cut_stream(fh):
                out.append((hashlib.sha256(piece.data).hexdigest(), len(piece.data)))
    return out


def balance(objects: list[tuple[str, int]]) -> dict[str, Any]:
    """Table 7: per-service objects and bytes for R = 1, 2, 3."""
    out: dict[str, Any] = {}
    for r in (1, 2, 3):
        mapping = StableMapping(list(CAPACITIES.items()), r)
        counts = dict.fromkeys(CAPACITIES, 0)
        sizes = dict.fromkeys(CAPACITIES, 0)
        for object_id, size in objects:
            for service in mapping.locate(object_id):
                counts[service] += 1
                sizes[service] += size
        total = sum(counts.values())
        out[f"R={r}"] = {
            s: {"objects": counts[s], "objects_pct": round(100 * counts[s] / total, 2),
                "bytes": sizes[s],
                "capacity_pct": round(100 * sizes[s] / (CAPACITIES[s] * 1e9), 4),
                "vnodes": mapping.vnodes(s)}
            for s in CAPACITIES
        }
    return out


def reconfigurations(objects: list[tuple[str, int]]) -> dict[str, Any]:
    """Table 8: copies added (vs the minimum) and left for GC by three changes."""
    four = [(s, CAPACITIES[s]) for s in TABLE8_SERVICES]
    three = [(s, c) for s, c in four if s != "OneDrive"]
    s4 = StableMapping(four, 2)
    s3 = StableMapping(three, 2)
    cases = {
        "S=4, R=2->3": (s4, s4.reconfigured(four, replicas=3)),
        "S=4->3, R=2": (s4, s4.reconfigured(three)),
        "S=3->4, R=2": (s3, s3.reconfigured(four)),
    }
    ids = [o for o, _ in objects]
    out: dict[str, Any] = {}
    for label, (old, new) in cases.items():
        moved, minimum = movement(old, new, ids)
        moved_bytes = removed = removed_bytes = 0
        for object_id, size in objects:
            before, after = set(old.locate(object_id)), set(new.locate(object_id))
            moved_bytes += size * len(after - before)
            removed += len(before - after)
            removed_bytes += size * len(before - after)
        out[label] = {"objects": len(objects), "moved_copies": moved, "minimum_copies": minimum,
                      "moved_bytes": moved_bytes, "removed_copies": removed,
                      "removed_bytes": removed_bytes,
                      "estimated_s_at_10MB_s": round(moved_bytes / 10e6, 1)}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="first 2,000 Linux files only, paper workload for Table 8")
    args = parser.parse_args(argv)
    from linux_workload import prepare as prepare_linux
    from workloads import prepare

    started = time.perf_counter()
    linux = prepare_linux(WORK_DIR)
    log("hashing the Linux workload (one object per file)")
    linux_objects = file_objects(linux.path, 2000 if args.quick else None)
    photos = prepare("paper" if args.quick else "photos", WORK_DIR)
    log(f"chunking the {photos.name} workload")
    photo_objects = chunk_objects(photos.path)

    t7 = balance(linux_objects)
    t8 = reconfigurations(photo_objects)

    rows = []
    for r, per in t7.items():
        rows.append([f"{r} objects"] + [f"{v['objects']:,} ({v['objects_pct']:.2f}%)"
                                       for v in per.values()])
        rows.append([f"{r} bytes"] + [f"{v['bytes'] / 1e6:.1f} MB ({v['capacity_pct']:.3f}%)"
                                     for v in per.values()])
    print(f"\nTable 7: {len(linux_objects):,} objects, "
          f"{sum(s for _, s in linux_objects) / 1e6:.1f} MB (Linux workload, one object a file)\n")
    print(table(["", *(f"{s} ({c} GB, {t7['R=1'][s]['vnodes']} vnodes)"
                       for s, c in CAPACITIES.items())], rows))
    rows = [[label, f"{v['moved_copies']}", f"{v['minimum_copies']}",
             f"{v['moved_bytes'] / 1e6:.1f}", f"{v['removed_copies']}",
             f"{v['removed_bytes'] / 1e6:.1f}", f"{v['estimated_s_at_10MB_s']:.1f}"]
            for label, v in t8.items()]
    print(f"\nTable 8: {len(photo_objects)} objects, "
          f"{sum(s for _, s in photo_objects) / 1e6:.1f} MB ({photos.name} workload chunks)\n")
    print(table(["reconfiguration", "copies added", "minimum", "MB added", "copies to GC",
                 "MB to GC", "est. s at 10 MB/s"], rows))
    record = {
        "note": "pure computation with metasync.mapping; Table 7 capacities in GB",
        "quick": args.quick,
        "capacities_gb": CAPACITIES,
        "table7_objects": {"workload": "linux", "objects": len(linux_objects),
                           "bytes": sum(s for _, s in linux_objects)},
        "table7": t7,
        "table8_objects": {"workload": photos.name, "objects": len(photo_objects),
                           "bytes": sum(s for _, s in photo_objects)},
        "table8": t8,
        "machine": machine_info(),
        "elapsed_s": round(time.perf_counter() - started, 1),
    }
    out = write_results("mapping", record)
    print(f"\nresults in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
