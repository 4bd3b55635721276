"""metasync against rclone and restic over the same (emulated wide-area) links.

For each workload, every contender does the same four steps against the same
servers, through the same links (``servers.py``, ``wanproxy.py``):

``push``
    the first upload of the tree: metasync ``init`` + ``push``; ``rclone copy``
    SRC REMOTE; restic ``init`` + ``backup``.
``clone``
    a fresh full copy elsewhere, verified file by file (path, size, SHA-256):
    metasync ``clone``; ``rclone copy`` REMOTE DST; ``restic restore latest``.
``incremental``
    after ``workloads.modify_tree`` (5 files edited, 2 added, 1 deleted):
    metasync ``push``; ``rclone sync``; restic ``backup``.
``nochange``
    the same again with nothing changed (what a periodic sync costs):
    metasync ``push``; ``rclone sync``; restic ``backup``. metasync's local
    ``status`` (second of two runs) is recorded as ``status``.

Contenders: ``metasync`` (S3 + SFTP + WebDAV, R = 2, the default),
``metasync-<kind>`` (that one backend, R = 1), ``rclone-<kind>`` (rclone 1.x
defaults: 4 transfers, 8 checkers), ``restic-s3`` (restic's S3 backend on the
SeaweedFS server) and ``restic-local`` (a local folder, no link). Each works
on its own hard-linked copy of the workload and its own folder or prefix on
the servers. All are run one after another, never at the same time.

    python bench/peers_bench.py [--profile wan] [--workload paper --workload photos ...]
                                [--only CONTENDER ...] [--skip CONTENDER ...] [--keep]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from benchlib import (
    METASYNC,
    PASSPHRASE,
    RCLONE,
    WORK_DIR,
    BenchError,
    Timing,
    hardlink_copy,
    log,
    machine_info,
    manifest,
    run,
    table,
    verify_copy,
    write_results,
)
from servers import Links, running_servers
from wanproxy import BACKEND_KINDS, PROFILES
from workloads import Tree, modify_tree, prepare

STEPS = ("push", "clone", "incremental", "nochange")
CONTENDERS = (
    "metasync",
    *(f"metasync-{k}" for k in BACKEND_KINDS),
    *(f"rclone-{k}" for k in BACKEND_KINDS),
    "restic-s3",
    "restic-local",
)
WORKLOADS = ("paper", "photos", "linux")


def load_workload(name: str) -> Tree:
    if name == "linux":
        from linux_workload import prepare as prepare_linux

        w = prepare_linux(WORK_DIR)
        return Tree("linux", w.path, w.files, w.bytes, f"linux-source-6.1 {w.package_version}")
    return prepare(name, WORK_DIR)


class Contender:
    """One tool in one configuration; each step returns its timing."""

    def __init__(self, name: str, links: Links, base: Path, location: str) -> None:
        self.name = name
        self.links = links
        self.base = base
        self.location = location  # folder / prefix on the servers, unique per run
        self.src = base / "src"
        self.dst = base / "clone"
        self.env = {**links.env(), "METASYNC_PASSPHRASE": PASSPHRASE,
                    "RESTIC_PASSWORD": PASSPHRASE, "RESTIC_CACHE_DIR": str(base / "restic-cache")}

    def _proxy_bytes(self) -> dict[str, int]:
        stats = self.links.stats()
        out = {"bytes_up": sum(s["bytes_up"] for s in stats.values()),
               "bytes_down": sum(s["bytes_down"] for s in stats.values()),
               "connections": sum(s["connections"] for s in stats.values())}
        for kind, s in stats.items():  # per link: which backends a step really used
            out[f"{kind}_bytes_up"] = s["bytes_up"]
            out[f"{kind}_bytes_down"] = s["bytes_down"]
        return out

    def timed(self, cmd: list[str | Path], cwd: Path) -> Timing:
        before = self._proxy_bytes()
        timing, _ = run(cmd, cwd, self.env)
        after = self._proxy_bytes()
        timing.extra = {k: after[k] - before[k] for k in after}
        return timing

    def push(self) -> Timing: ...
    def clone(self) -> Timing: ...
    def incremental(self) -> Timing: ...
    def nochange(self) -> Timing: ...

    def status(self) -> Timing | None:
        return None


class Metasync(Contender):
    def __init__(self, name: str, links: Links, base: Path, location: str,
                 kinds: tuple[str, ...], replicas: int) -> None:
        super().__init__(name, links, base, location)
        self.uris = []
        for kind in kinds:
            links.make_location(kind, location)
            self.uris.append(links.metasync_uri(kind, location))
        self.replicas = replicas

    def _cmd(self, *args: str | Path) -> list[str | Path]:
        return [METASYNC, "--quiet", *args]

    def push(self) -> Timing:
        backends: list[str | Path] = []
        for uri in self.uris:
            backends += ["--backend", uri]
        t = self.timed(self._cmd("init", self.src, *backends, "--replicas", str(self.replicas)),
                       self.base)
        init_s = t.wall
        t.add(self.timed(self._cmd("push"), self.src))
        t.extra["init_s"] = round(init_s, 3)
        return t

    def clone(self) -> Timing:
        # The other backends by URI too: a clone reaches the entry backend by the URI
        # it is given, and every other one only through `--backend` (credentials and
        # mount points stay on each machine; issue 17).
        others: list[str | Path] = []
        for uri in self.uris[1:]:
            others += ["--backend", uri]
        return self.timed(self._cmd("clone", self.uris[0], self.dst, *others), self.base)

    def incremental(self) -> Timing:
        return self.timed(self._cmd("push"), self.src)

    def nochange(self) -> Timing:
        return self.timed(self._cmd("push"), self.src)

    def status(self) -> Timing:
        self.timed(self._cmd("status", "--offline"), self.src)
        return self.timed(self._cmd("status", "--offline"), self.src)


class Rclone(Contender):
    def __init__(self, name: str, links: Links, base: Path, location: str, kind: str) -> None:
        super().__init__(name, links, base, location)
        links.make_location(kind, location)
        self.remote = links.rclone_remote(kind, location)

    def _cmd(self, *args: str | Path) -> list[str | Path]:
        return [RCLONE, "--config", self.links.rclone_config, *args]

    def push(self) -> Timing:
        return self.timed(self._cmd("copy", self.src, self.remote), self.base)

    def clone(self) -> Timing:
        return self.timed(self._cmd("copy", self.remote, self.dst), self.base)

    def incremental(self) -> Timing:
        return self.timed(self._cmd("sync", self.src, self.remote), self.base)

    nochange = incremental


class Restic(Contender):
    def __init__(self, name: str, links: Links, base: Path, location: str, local: bool) -> None:
        super().__init__(name, links, base, location)
        repo = str(base / "repo") if local else links.restic_repo(location)
        self.env["RESTIC_REPOSITORY"] = repo

    def push(self) -> Timing:
        t = self.timed(["restic", "init", "--quiet"], self.base)
        init_s = t.wall
        t.add(self.timed(["restic", "backup", "--quiet", "."], self.src))
        t.extra["init_s"] = round(init_s, 3)
        return t

    def clone(self) -> Timing:
        return self.timed(["restic", "restore", "latest", "--target", str(self.dst), "--quiet"],
                          self.base)

    def incremental(self) -> Timing:
        return self.timed(["restic", "backup", "--quiet", "."], self.src)

    nochange = incremental


def make_contender(name: str, links: Links, base: Path, location: str) -> Contender:
    if name == "metasync":
        return Metasync(name, links, base, location, BACKEND_KINDS, 2)
    tool, _, kind = name.partition("-")
    if tool == "metasync":
        return Metasync(name, links, base, location, (kind,), 1)
    if tool == "rclone":
        return Rclone(name, links, base, location, kind)
    return Restic(name, links, base, location, local=(kind == "local"))


def bench_one(name: str, tree: Tree, expected: dict[str, tuple[int, str]], links: Links,
              scratch: Path, run_id: str) -> dict[str, Any]:
    """All steps of one contender on one workload; errors are recorded, not raised."""
    base = scratch / name
    base.mkdir(parents=True)
    contender = make_contender(name, links, base, f"{run_id}/{tree.name}/{name}")
    hardlink_copy(tree.path, contender.src)
    out: dict[str, Any] = {}
    try:
        for step in STEPS:
            if step == "incremental":
                modify_tree(contender.src)
                expected = manifest(contender.src)
            log(f"{tree.name}/{name}: {step}")
            timing = getattr(contender, step)()
            out[step] = timing.as_dict()
            log(f"{tree.name}/{name}: {step} {timing.wall:.2f} s")
            if step == "clone":
                verify_copy(expected, contender.dst, f"{name} clone")
            if step == "nochange":
                status = contender.status()
                if status is not None:
                    out["status"] = status.as_dict()
    except BenchError as exc:
        log(f"{tree.name}/{name} FAILED: {exc}")
        out["error"] = str(exc)[-3000:]
    return out


def ratios(results: dict[str, dict[str, Any]]) -> dict[str, float]:
    """metasync's speed-up over each peer per step (peer time / metasync time)."""
    out: dict[str, float] = {}
    ms = results.get("metasync", {})
    for peer, steps in results.items():
        if peer.startswith("metasync"):
            continue
        for step in ("push", "clone", "incremental", "nochange"):
            a, b = ms.get(step), steps.get(step)
            if a and b and a["wall_s"] > 0:
                out[f"{peer} {step} / metasync {step}"] = round(b["wall_s"] / a["wall_s"], 3)
    return out


def report(workload: str, results: dict[str, dict[str, Any]]) -> str:
    rows = []
    for name, steps in results.items():
        cells = [name]
        for step in (*STEPS, "status"):
            s = steps.get(step)
            cells.append(f"{s['wall_s']:.2f}" if s else ("FAILED" if "error" in steps else "-"))
        push = steps.get("push") or {}
        cells.append(f"{push.get('bytes_up', 0) / 1e6:.1f}" if push else "-")
        rows.append(cells)
    headers = ["contender", "push s", "clone s", "incremental s", "no-change s", "status s",
               "push MB sent"]
    return f"### {workload}\n\n" + table(headers, rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", choices=sorted(PROFILES), default="wan")
    parser.add_argument("--workload", action="append", choices=WORKLOADS, default=[])
    parser.add_argument("--only", action="append", choices=CONTENDERS, default=[])
    parser.add_argument("--skip", action="append", choices=CONTENDERS, default=[])
    parser.add_argument("--keep", action="store_true", help="keep the scratch folders")
    args = parser.parse_args(argv)
    workloads = args.workload or ["paper", "photos", "linux"]
    contenders = [c for c in (args.only or CONTENDERS) if c not in args.skip]
    if any(c.startswith("restic") for c in contenders) and shutil.which("restic") is None:
        print("error: restic is not installed (bin/bench installs it)", file=sys.stderr)
        return 1

    trees = [load_workload(w) for w in workloads]
    run_id = f"run-{uuid.uuid4().hex[:8]}"
    # Per-run folders: two runs at once (say, two profiles) never share a server.
    scratch = WORK_DIR / f"peers-{run_id}"
    started = time.perf_counter()
    results: dict[str, dict[str, dict[str, Any]]] = {}
    with running_servers(WORK_DIR / f"servers-{run_id}") as servers:
        links = Links(servers, args.profile, scratch / "links")
        for spec_kind, spec in links.specs.items():
            log(f"link to {spec_kind}: {spec.describe()}")
        try:
            for tree in trees:
                log(f"workload {tree.describe()}")
                expected = manifest(tree.path)
                results[tree.name] = {}
                for name in contenders:
                    results[tree.name][name] = bench_one(
                        name, tree, expected, links, scratch / tree.name, run_id)
                    if not args.keep:
                        shutil.rmtree(scratch / tree.name / name, ignore_errors=True)
                print("\n" + report(tree.name, results[tree.name]) + "\n", flush=True)
        finally:
            links.close()
    if not args.keep:
        shutil.rmtree(scratch, ignore_errors=True)
    elapsed = time.perf_counter() - started
    record = {
        "note": "ratios from one run: every contender ran on this machine, one after the "
                "other, through the same emulated links",
        "profile": args.profile,
        "links": {k: {"rtt_ms": s.rtt_ms, "up_mb_s": s.up_mb_s, "down_mb_s": s.down_mb_s,
                      "label": s.label} for k, s in PROFILES[args.profile].items()},
        "workloads": {t.name: t.as_dict() for t in trees},
        "machine": machine_info(),
        "elapsed_s": round(elapsed, 1),
        "results": results,
        "ratios": {w: ratios(r) for w, r in results.items()},
    }
    out = write_results(f"peers-{args.profile}", record)
    for w, r in record["ratios"].items():
        print(f"{w}: " + ", ".join(f"{k} = {v:.2f}x" for k, v in r.items()))
    print(f"\n{elapsed:.0f} s in all; results in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
