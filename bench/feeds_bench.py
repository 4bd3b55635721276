"""Change feeds (issue 19): what an idle folder costs, and how fast a change arrives.

For each backend kind -- the four provider emulators (Dropbox, Google Drive, Box,
OneDrive, through their official SDKs, tests/emulators/), S3 (SeaweedFS behind a
request-counting proxy, bench/countproxy.py) and ``dir:`` -- one repository on one
backend of that kind, two daemons on it (folders A and B, as two machines), run
twice:

``before``
    ``METASYNC_CHANGE_FEEDS=0``: the polling of before issue 19 (every ``--poll``
    10 s each acceptor's ``latest`` hint, and a full sync every ``--rescan`` 60 s);
``after``
    the change feeds (metasync/remote_watch.py).

Measured per kind and mode:

(a) requests per backend per hour of an idle folder: the backend's request count
    over an idle window (after a warm-up), scaled to an hour, for both daemons
    and per daemon (one machine's cost). ``dir:`` makes no requests to count;
(b) the latency from A's push (A's ``daemon.json`` showing the pushed version) to
    the file in B's folder, over ``--changes`` changes (median, spread), and from
    the write in A (which adds A's settle and push).

Kinds run at the same time (each its own two daemons); modes one after the other.
Prints a table; JSON to bench/results/feeds-<UTC time>.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchlib import METASYNC, PASSPHRASE, ROOT, WORK_DIR, log, run, write_results
from countproxy import CountingProxy

sys.path.insert(0, str(ROOT))

KINDS = ("dropbox", "gdrive", "box", "onedrive", "s3", "dir")
MODES = ("before", "after")
SETTLE = "0.5"
#: The daemons' own defaults otherwise (poll 10 s, rescan 60 s): what a user runs.
DAEMON_ARGS = ("daemon", "--settle", SETTLE)


@dataclass
class Location:
    """Where one kind's repository lives and how its requests are counted."""

    kind: str
    uri: str
    count: Any  # () -> int, or None where nothing is counted (dir:)


@dataclass
class KindResult:
    kind: str
    mode: str
    idle_seconds: float = 0.0
    idle_requests: int | None = None
    per_hour_both: float | None = None
    per_hour_per_daemon: float | None = None
    push_to_arrival: list[float] = field(default_factory=list)
    write_to_arrival: list[float] = field(default_factory=list)
    error: str = ""

    def summary(self) -> dict[str, Any]:
        def stats(xs: list[float]) -> dict[str, float] | None:
            if not xs:
                return None
            qs = statistics.quantiles(xs, n=10, method="inclusive") if len(xs) >= 2 else [xs[0]] * 9
            return {"median": round(statistics.median(xs), 3), "p10": round(qs[0], 3),
                    "p90": round(qs[-1], 3), "min": round(min(xs), 3), "max": round(max(xs), 3),
                    "n": len(xs)}
        return {"kind": self.kind, "mode": self.mode, "idle_seconds": round(self.idle_seconds, 1),
                "idle_requests": self.idle_requests,
                "requests_per_hour_both_daemons": _round(self.per_hour_both),
                "requests_per_hour_per_daemon": _round(self.per_hour_per_daemon),
                "push_to_arrival_s": stats(self.push_to_arrival),
                "write_to_arrival_s": stats(self.write_to_arrival),
                "samples_push_to_arrival_s": [round(x, 3) for x in self.push_to_arrival],
                "error": self.error}


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 1)


def _status(root: Path) -> dict[str, Any]:
    try:
        doc: dict[str, Any] = json.loads((root / ".metasync" / "daemon.json").read_text())
    except (OSError, ValueError):
        return {}
    return doc


def _wait(condition: Any, timeout: float, what: str, tick: float = 0.01) -> float:
    """Poll ``condition`` every ``tick`` s; return the time it became true."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if condition():
                return time.monotonic()
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"not within {timeout:g} s: {what}")
        time.sleep(tick)


class Pair:
    """Folders A and B on one repository, each with its daemon."""

    def __init__(self, base: Path, location: Location, mode: str) -> None:
        self.base = base
        self.location = location
        self.mode = mode
        self.env = {**os.environ, "METASYNC_PASSPHRASE": PASSPHRASE}
        if mode == "before":
            self.env["METASYNC_CHANGE_FEEDS"] = "0"
        else:
            self.env.pop("METASYNC_CHANGE_FEEDS", None)
        self.a, self.b = base / "A", base / "B"
        self.procs: list[subprocess.Popen[bytes]] = []

    def setup(self) -> None:
        self.a.mkdir(parents=True)
        (self.a / "hello.txt").write_text("hello\n")
        run([METASYNC, "--quiet", "init", self.a, "--backend", self.location.uri], self.a, self.env)
        run([METASYNC, "--quiet", "push", "-m", "start"], self.a, self.env)
        run([METASYNC, "--quiet", "clone", self.location.uri, self.b], self.base, self.env)

    def start(self) -> None:
        for root in (self.a, self.b):
            out = open(self.base / f"daemon-{root.name}.out", "wb")  # noqa: SIM115 (kept open)
            self.procs.append(subprocess.Popen([str(METASYNC), *DAEMON_ARGS], cwd=root, env=self.env,
                                               stdout=out, stderr=subprocess.STDOUT,
                                               stdin=subprocess.DEVNULL))
        for root in (self.a, self.b):
            _wait(lambda root=root: _status(root).get("state") == "idle", 120,
                  f"{self.location.kind} daemon in {root} idle", tick=0.2)

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def change(self, i: int) -> tuple[float, float]:
        """Write a file in A; (push -> arrival in B, write -> arrival in B) seconds."""
        version = int(_status(self.a).get("version") or 0)
        name, text = f"change-{i:03d}.txt", f"change {i} {uuid.uuid4().hex}\n"
        written = time.monotonic()
        (self.a / name).write_text(text)
        target = self.b / name
        arrived: list[float] = []

        def watch_b() -> None:
            with contextlib.suppress(TimeoutError):
                arrived.append(_wait(lambda: target.is_file() and target.read_text() == text,
                                     300, f"{name} in B"))

        watcher = threading.Thread(target=watch_b)
        watcher.start()
        pushed = _wait(lambda: int(_status(self.a).get("version") or 0) > version, 300,
                       f"A pushed {name}")
        watcher.join()
        if not arrived:
            raise TimeoutError(f"{name} did not reach B within 300 s")
        return max(0.0, arrived[0] - pushed), arrived[0] - written


def measure(pair: Pair, warmup: float, idle: float, changes: int, seed: int,
            gap: float) -> KindResult:
    result = KindResult(pair.location.kind, pair.mode)
    try:
        pair.setup()
        pair.start()
        time.sleep(warmup)  # both daemons' first syncs, the feeds' first looks
        count = pair.location.count
        before = count() if count else None
        start = time.monotonic()
        time.sleep(idle)
        result.idle_seconds = time.monotonic() - start
        if count is not None and before is not None:
            result.idle_requests = count() - before
            result.per_hour_both = result.idle_requests * 3600 / result.idle_seconds
            result.per_hour_per_daemon = result.per_hour_both / 2
        rng = random.Random(seed)
        for i in range(changes):
            # A random gap as long as a poll period: changes land at every phase of
            # B's poll timer (a short one would lock them to it).
            time.sleep(rng.uniform(0.5, gap))
            push_s, write_s = pair.change(i)
            result.push_to_arrival.append(push_s)
            result.write_to_arrival.append(write_s)
    except Exception as exc:  # one kind failing must not lose the others' figures
        result.error = f"{type(exc).__name__}: {exc}"
        log(f"{pair.location.kind} {pair.mode}: {result.error}")
    finally:
        pair.stop()
    return result


@contextlib.contextmanager
def locations(base: Path, kinds: list[str]) -> Any:
    """Start what ``kinds`` need; yield a function making a fresh location per kind."""
    os.environ.setdefault("METASYNC_CONFIG_DIR", tempfile.mkdtemp(prefix="metasync-bench-config-"))
    os.environ["METASYNC_TOKEN_STORE"] = "file"
    with contextlib.ExitStack() as stack:
        services: dict[str, Any] = {}
        providers = {
            "dropbox": ("tests.emulators.dropbox", "running_dropbox"),
            "gdrive": ("tests.emulators.gdrive", "running_gdrive"),
            "box": ("tests.emulators.box", "running_box"),
            "onedrive": ("tests.emulators.onedrive", "running_onedrive"),
        }
        for kind in kinds:
            if kind in providers:
                module, fn = providers[kind]
                running = getattr(__import__(module, fromlist=[fn]), fn)
                service = stack.enter_context(running())
                os.environ.update(service.env())
                service.sign_in()
                services[kind] = service
        proxy = None
        bucket = "metasync-feeds-bench"
        if "s3" in kinds:
            from tests.servers.seaweedfs import aws_credentials, run_seaweedfs

            stack.enter_context(aws_credentials())
            s3 = stack.enter_context(run_seaweedfs(base / "seaweedfs", bucket))
            proxy = CountingProxy("127.0.0.1", s3.port)
            stack.callback(proxy.close)

        def make(kind: str, tag: str) -> Location:
            folder = f"feeds-{tag}-{uuid.uuid4().hex[:6]}"
            if kind in ("dropbox", "box", "onedrive"):
                services[kind].emulator.make_folder(f"/{folder}")
                emulator = services[kind].emulator
                return Location(kind, f"{kind}:/{folder}", lambda: emulator.requests)
            if kind == "gdrive":
                services[kind].emulator.make_folder(folder)
                emulator = services[kind].emulator
                return Location(kind, f"gdrive:{folder}", lambda: emulator.requests)
            if kind == "s3":
                assert proxy is not None
                counter = proxy
                return Location(kind, f"s3://{bucket}/{folder}?endpoint=http://127.0.0.1:{proxy.port}",
                                lambda: counter.requests)
            path = base / "dir-backends" / folder
            path.mkdir(parents=True)
            return Location(kind, f"dir:{path}", None)

        yield make


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="short windows, 5 changes")
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--warmup", type=float, default=90.0)
    parser.add_argument("--idle", type=float, default=300.0, help="idle window, seconds")
    parser.add_argument("--changes", type=int, default=20)
    parser.add_argument("--gap", type=float, default=10.5,
                        help="longest random pause between changes, seconds (default: "
                             "the daemons' poll period and a bit)")
    args = parser.parse_args()
    if args.quick:
        args.warmup, args.idle, args.changes = 20.0, 40.0, 5
    kinds = [k for k in args.kinds.split(",") if k]
    modes = [m for m in args.modes.split(",") if m]
    unknown = [k for k in kinds if k not in KINDS] + [m for m in modes if m not in MODES]
    if unknown:
        parser.error(f"unknown kind or mode: {', '.join(unknown)}")
    base = WORK_DIR / "feeds"
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True)
    results: list[KindResult] = []
    with locations(base, kinds) as make:
        for mode in modes:
            log(f"mode {mode}: {', '.join(kinds)} at once (warm-up {args.warmup:g} s, idle "
                f"{args.idle:g} s, {args.changes} changes)")
            pairs = [Pair(base / mode / kind, make(kind, mode), mode) for kind in kinds]
            out: list[KindResult] = []

            def one(pair: Pair, seed: int, out: list[KindResult] = out) -> None:
                out.append(measure(pair, args.warmup, args.idle, args.changes, seed, args.gap))

            threads = [threading.Thread(target=one, args=(p, 19 + i)) for i, p in enumerate(pairs)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            results.extend(sorted(out, key=lambda r: kinds.index(r.kind)))
    record = {"kinds": kinds, "modes": modes, "warmup_s": args.warmup, "idle_s": args.idle,
              "changes": args.changes, "gap_max_s": args.gap, "settle": float(SETTLE),
              "results": [r.summary() for r in results]}
    path = write_results("feeds", record)
    print(table(results))
    log(f"results: {path}")
    return 1 if any(r.error for r in results) else 0


def table(results: list[KindResult]) -> str:
    lines = ["| backend | mode | requests/h per daemon (both) | push -> arrival median (p10-p90) s "
             "| write -> arrival median s |", "|---|---|---|---|---|"]
    for r in results:
        s = r.summary()
        reqs = ("n/a" if r.per_hour_per_daemon is None
                else f"{r.per_hour_per_daemon:.0f} ({r.per_hour_both:.0f})")
        p = s["push_to_arrival_s"]
        w = s["write_to_arrival_s"]
        lat = f"{p['median']:.2f} ({p['p10']:.2f}-{p['p90']:.2f})" if p else "-"
        wl = f"{w['median']:.2f}" if w else "-"
        err = f" ERROR {r.error}" if r.error else ""
        lines.append(f"| {r.kind} | {r.mode} | {reqs} | {lat} | {wl} |{err}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
