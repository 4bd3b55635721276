"""Benchmark pPaxos (``metasync.consensus``) the way the MetaSync paper does (5.1).

Every backend is in memory behind a latency model: each request (fetch, append,
append_at, get, put) sleeps ``--latency-ms`` (default 20 ms) and then acts, and
each backend serves **one request at a time** (a per-backend lock is held during
the sleep and the action), like a rate-limited cloud API. Requests to one
backend queue; requests to different backends run in parallel.

* Experiment 1 (paper Figure 9): 1 to 5 competing proposers, each a thread with
  its own :class:`Consensus` and client id, all released together by a barrier.
  Each commits ``--commits`` versions: ``get_recent``, then ``propose`` its own
  value at the next instance; if another value is decided there, ``get_recent``
  again and retry until its own value is decided. Run for the four modes of
  :class:`Consensus` (conditional appends on/off x fast round on/off). Reported
  per successful commit: latency (from the start of its first ``get_recent`` to
  its value decided), round trips of ``propose`` calls only ("decide") and of
  everything ("total", including ``get_recent``), and requests.
* Experiment 2 (paper Figure 10): one proposer commits while 1, 2, 4, 8 or 16
  clients are known to the system. pPaxos does not care how many clients exist;
  the Disk Paxos baseline (Gafni and Lamport, one block per client per disk)
  reads every other client's block on every disk in each of its two phases.

No hint is published between commits (``Consensus.publish`` is not called), so a
proposer that falls behind walks forward one instance per round trip.

    python bench/consensus_bench.py [--latency-ms 20] [--commits 10] [--acceptors 5]
                                    [--out bench/results/consensus-<timestamp>.json]
"""

from __future__ import annotations

import argparse
import builtins
import hashlib
import io
import json
import os
import platform
import random
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

from metasync.backends.base import Backend, Capabilities
from metasync.backends.logs import LogStore
from metasync.codec import Codec
from metasync.consensus import Consensus
from metasync.errors import BackendError, CorruptObject, ObjectNotFound
from metasync.keys import MasterKey
from metasync.objects import Version

BENCH_DIR = Path(__file__).resolve().parent
#: Where results go; ``bin/bench --quick`` points it elsewhere so smoke runs never
#: become the latest results.
RESULTS_DIR = Path(os.environ.get("METASYNC_BENCH_RESULTS") or BENCH_DIR / "results")
CONFIG_ID = hashlib.sha256(b"consensus-bench config").hexdigest()
GENESIS = Version(0, None, CONFIG_ID)
PROPOSER_COUNTS = (1, 2, 3, 4, 5)
CLIENT_COUNTS = (1, 2, 4, 8, 16)
LATENCY_NOTE = (
    "in-memory backends; every request (fetch, append, append_at, get, put) sleeps the "
    "configured latency and then acts; each backend serves one request at a time (a "
    "per-backend lock is held during sleep+action), like a rate-limited cloud API, so "
    "requests to one backend queue and requests to different backends run in parallel"
)

T = TypeVar("T")


# ================================================================ backends
class MemoryLogs(LogStore):
    """Append-only logs in a dict: each append or fetch is one request."""

    def __init__(self) -> None:
        self._logs: dict[str, list[bytes]] = {}
        self._lock = threading.Lock()

    def append(self, log: str, message: bytes) -> int:
        with self._lock:
            entries = self._logs.setdefault(log, [])
            entries.append(message)
            return len(entries) - 1

    def append_at(self, log: str, position: int, message: bytes) -> bool:
        with self._lock:
            entries = self._logs.setdefault(log, [])
            if len(entries) != position:
                return False
            entries.append(message)
            return True

    def fetch(self, log: str, start: int = 0) -> builtins.list[tuple[int, bytes]]:
        with self._lock:
            entries = list(self._logs.get(log, ()))
        return [(i, m) for i, m in enumerate(entries) if i >= start]

    def delete_log(self, log: str) -> int:
        with self._lock:
            return len(self._logs.pop(log, ()))


class MemoryBackend(Backend):
    """A whole storage service in a dict: objects and append-only logs."""

    capabilities = Capabilities(conditional_create=True, conditional_append=True)
    scheme = "mem"

    def __init__(self, uri: str, namespace: str = "bench") -> None:
        super().__init__(uri, namespace)
        self._objects: dict[str, bytes] = {}
        self._lock = threading.Lock()

    def exists(self) -> bool:
        return True

    def create(self) -> None:
        pass

    def put(self, key: str, data: bytes | BinaryIO) -> None:
        raw = data if isinstance(data, bytes) else data.read()
        with self._lock:
            self._objects[key] = raw

    def put_if_absent(self, key: str, data: bytes) -> bool:
        with self._lock:
            if key in self._objects:
                return False
            self._objects[key] = data
            return True

    def get(self, key: str) -> bytes:
        with self._lock:
            try:
                return self._objects[key]
            except KeyError:
                raise ObjectNotFound(f"{self.uri}: no object {key!r}") from None

    def open(self, key: str) -> BinaryIO:
        return io.BytesIO(self.get(key))

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        data = self.get(key)
        if offset + length > len(data):
            raise BackendError(f"{self.uri}: {key!r} is shorter than {offset + length} bytes")
        return data[offset:offset + length]

    def size(self, key: str) -> int:
        return len(self.get(key))

    def delete(self, key: str) -> None:
        with self._lock:
            if self._objects.pop(key, None) is None:
                raise ObjectNotFound(f"{self.uri}: no object {key!r}")

    def list(self, prefix: str = "") -> Iterator[str]:
        with self._lock:
            keys = [k for k in self._objects if k.startswith(prefix)]
        return iter(keys)

    def poll(self, key: str) -> str | None:
        with self._lock:
            data = self._objects.get(key)
        return None if data is None else hashlib.sha256(data).hexdigest()

    def specific_logs(self) -> LogStore:
        return MemoryLogs()


class LatencyBackend(Backend):
    """Wraps a backend: each request waits for the backend to be free, then takes
    ``latency`` seconds (held busy), then acts. Counts requests by kind."""

    def __init__(self, inner: Backend, latency: float) -> None:
        super().__init__(inner.uri, inner.namespace)
        self.inner = inner
        self.latency = latency
        self.capabilities = inner.capabilities
        self._busy = threading.Lock()
        self._count_lock = threading.Lock()
        self.counts: dict[str, int] = {}

    def _serve(self, kind: str, action: Callable[[], T]) -> T:
        with self._count_lock:
            self.counts[kind] = self.counts.get(kind, 0) + 1
        with self._busy:
            time.sleep(self.latency)
            return action()

    def exists(self) -> bool:
        return self.inner.exists()

    def create(self) -> None:
        self.inner.create()

    def put(self, key: str, data: bytes | BinaryIO) -> None:
        self._serve("put", lambda: self.inner.put(key, data))

    def put_if_absent(self, key: str, data: bytes) -> bool:
        return self._serve("put_if_absent", lambda: self.inner.put_if_absent(key, data))

    def get(self, key: str) -> bytes:
        return self._serve("get", lambda: self.inner.get(key))

    def open(self, key: str) -> BinaryIO:
        return io.BytesIO(self.get(key))

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        return self._serve("get", lambda: self.inner.get_range(key, offset, length))

    def size(self, key: str) -> int:
        return self._serve("get", lambda: self.inner.size(key))

    def delete(self, key: str) -> None:
        self._serve("delete", lambda: self.inner.delete(key))

    def list(self, prefix: str = "") -> Iterator[str]:
        return self._serve("list", lambda: iter(list(self.inner.list(prefix))))

    def poll(self, key: str) -> str | None:
        return self._serve("get", lambda: self.inner.poll(key))

    def specific_logs(self) -> LogStore:
        return LatencyLogs(self)


class LatencyLogs(LogStore):
    """The inner backend's logs, each request served by the :class:`LatencyBackend`."""

    def __init__(self, backend: LatencyBackend) -> None:
        self.backend = backend

    def append(self, log: str, message: bytes) -> int:
        inner = self.backend.inner.logs
        return self.backend._serve("append", lambda: inner.append(log, message))

    def append_at(self, log: str, position: int, message: bytes) -> bool:
        inner = self.backend.inner.logs
        return self.backend._serve("append_at", lambda: inner.append_at(log, position, message))

    def fetch(self, log: str, start: int = 0) -> builtins.list[tuple[int, bytes]]:
        inner = self.backend.inner.logs
        return self.backend._serve("fetch", lambda: inner.fetch(log, start))

    def delete_log(self, log: str) -> int:
        inner = self.backend.inner.logs
        return self.backend._serve("delete_log", lambda: inner.delete_log(log))


def make_backends(count: int, latency: float) -> dict[str, LatencyBackend]:
    return {f"a{i}": LatencyBackend(MemoryBackend(f"mem:a{i}"), latency) for i in range(count)}


def make_codec() -> Codec:
    return Codec(MasterKey(bytes(32)))


def master_of(client: str, commit: int) -> str:
    """A distinct master id per (client, commit): each proposer proposes its own value."""
    return hashlib.sha256(f"{client}/{commit}".encode()).hexdigest()


# ================================================================ modes
@dataclass(frozen=True)
class Mode:
    key: str
    label: str
    conditional: bool
    fast_path: bool


MODES = (
    Mode("cond-fast", "conditional + fast round (metasync default)", True, True),
    Mode("plain-fast", "plain appends + fast round", False, True),
    Mode("plain-classic", "plain appends, classic (paper pPaxos)", False, False),
    Mode("cond-classic", "conditional, classic (CRIC's CPaxos)", True, False),
)


# ================================================================ measurements
@dataclass
class Commit:
    """One successful commit of one proposer."""

    latency_s: float
    #: Time spent in ``propose`` calls only.
    decide_s: float
    decide_round_trips: int
    total_round_trips: int
    decide_requests: int
    total_requests: int
    proposals: int
    contended_errors: int


@dataclass
class Summary:
    commits: int
    wall_s: float
    latency_mean_s: float
    latency_median_s: float
    latency_p90_s: float
    latency_max_s: float
    decide_mean_s: float
    decide_median_s: float
    decide_round_trips: float
    total_round_trips: float
    decide_requests: float
    total_requests: float
    proposals_per_commit: float
    proposals_max: int
    contended_errors: int
    backend_requests: dict[str, int] = field(default_factory=dict)
    #: ``[latency ms, proposals]`` of every commit, in order of completion per proposer.
    per_commit: list[list[int]] = field(default_factory=list)


def summarize(commits: Sequence[Commit], wall: float, counts: dict[str, int]) -> Summary:
    n = len(commits)
    lat = [c.latency_s for c in commits]
    dec = [c.decide_s for c in commits]
    return Summary(
        commits=n,
        wall_s=round(wall, 4),
        latency_mean_s=round(statistics.fmean(lat), 4),
        latency_median_s=round(statistics.median(lat), 4),
        latency_p90_s=round(statistics.quantiles(lat, n=10, method="inclusive")[-1], 4)
        if n > 1 else round(lat[0], 4),
        latency_max_s=round(max(lat), 4),
        decide_mean_s=round(statistics.fmean(dec), 4),
        decide_median_s=round(statistics.median(dec), 4),
        decide_round_trips=round(sum(c.decide_round_trips for c in commits) / n, 3),
        total_round_trips=round(sum(c.total_round_trips for c in commits) / n, 3),
        decide_requests=round(sum(c.decide_requests for c in commits) / n, 3),
        total_requests=round(sum(c.total_requests for c in commits) / n, 3),
        proposals_per_commit=round(sum(c.proposals for c in commits) / n, 3),
        proposals_max=max(c.proposals for c in commits),
        contended_errors=sum(c.contended_errors for c in commits),
        backend_requests=counts,
        per_commit=[[round(c.latency_s * 1000), c.proposals] for c in commits],
    )


def backend_counts(backends: dict[str, LatencyBackend]) -> dict[str, int]:
    total: dict[str, int] = {}
    for b in backends.values():
        for kind, count in b.counts.items():
            total[kind] = total.get(kind, 0) + count
    return dict(sorted(total.items()))


def commit_loop(cons: Consensus, client: str, commits: int, barrier: threading.Barrier | None,
                out: list[Commit]) -> None:
    """Commit ``commits`` values of this client; append one :class:`Commit` each."""
    known = GENESIS
    if barrier is not None:
        barrier.wait()
    for i in range(commits):
        master = master_of(client, i)
        start = time.perf_counter()
        rt0, rq0 = cons.round_trips, cons.requests
        decide_rt = decide_rq = proposals = contended = 0
        decide_s = 0.0
        known = cons.get_recent(known)
        while True:
            mine = Version(known.number + 1, master, CONFIG_ID)
            rt, rq, t0 = cons.round_trips, cons.requests, time.perf_counter()
            try:
                got = cons.propose(mine.number, mine)
            except BackendError as exc:  # Contended: "other clients kept committing"
                if not exc.transient:
                    raise
                contended += 1
                # Our value may still be decided there: learn the instance before moving on.
                got = cons.learn(mine.number)
            decide_s += time.perf_counter() - t0
            decide_rt += cons.round_trips - rt
            decide_rq += cons.requests - rq
            proposals += 1
            if got == mine:
                known = mine
                break
            if got is None:
                continue  # undecided after Contended: try the same instance again
            known = cons.get_recent(got)
        out.append(Commit(
            latency_s=time.perf_counter() - start,
            decide_s=decide_s,
            decide_round_trips=decide_rt,
            total_round_trips=cons.round_trips - rt0,
            decide_requests=decide_rq,
            total_requests=cons.requests - rq0,
            proposals=proposals,
            contended_errors=contended,
        ))


def check_history(backends: dict[str, LatencyBackend], codec: Codec, expected: int) -> None:
    """Every instance 1..expected decided, each value exactly once (read without latency)."""
    raw = {a: b.inner for a, b in backends.items()}
    reader = Consensus(raw, codec, "checker")
    seen: set[str | None] = set()
    for instance in range(1, expected + 1):
        value = reader.learn(instance)
        if value is None or value.number != instance:
            raise RuntimeError(f"instance {instance} not decided ({value})")
        if value.master in seen:
            raise RuntimeError(f"value {value.master} decided twice")
        seen.add(value.master)
    if reader.learn(expected + 1) is not None:
        raise RuntimeError(f"instance {expected + 1} decided, but only {expected} commits ran")


# ================================================================ experiment 1
def run_proposers(mode: Mode, proposers: int, commits: int, acceptors: int,
                  latency: float) -> Summary:
    backends = make_backends(acceptors, latency)
    codec = make_codec()
    barrier = threading.Barrier(proposers)
    outs: list[list[Commit]] = [[] for _ in range(proposers)]
    errors: list[BaseException] = []

    def body(index: int) -> None:
        client = f"client{index}"
        cons = Consensus(backends, codec, client, conditional=mode.conditional,
                         fast_path=mode.fast_path)
        try:
            commit_loop(cons, client, commits, barrier, outs[index])
        except BaseException as exc:  # reported below, in the main thread
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=body, args=(i,)) for i in range(proposers)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    if errors:
        raise errors[0]
    check_history(backends, codec, proposers * commits)
    return summarize([c for out in outs for c in out], wall, backend_counts(backends))


# ================================================================ Disk Paxos
Ballot = tuple[int, int]  # (number, client index); (0, 0) is "none"
NO_BALLOT: Ballot = (0, 0)


@dataclass(frozen=True)
class DiskBlock:
    """Gafni & Lamport's ``dblock``: the highest ballot begun (``mbal``), the highest
    ballot in which a value was accepted (``bal``) and that value (``inp``)."""

    mbal: Ballot
    bal: Ballot
    inp: Version | None

    def to_bytes(self) -> bytes:
        return json.dumps({"mbal": list(self.mbal), "bal": list(self.bal),
                           "inp": self.inp.to_json() if self.inp else None}).encode()

    @classmethod
    def from_bytes(cls, raw: bytes) -> DiskBlock:
        doc = json.loads(raw)
        inp = Version.from_json(doc["inp"]) if doc["inp"] is not None else None
        return cls(tuple(doc["mbal"]), tuple(doc["bal"]), inp)


class DiskPaxosAborted(Exception):
    """Too many ballots aborted in a row."""


class DiskPaxos:
    """A minimal, faithful Disk Paxos proposer over passive backends ("disks").

    Each disk holds one block per client and instance, key
    ``dpaxos/<instance>/<client>``, written only by that client. A *phase* writes
    the client's own block to every disk, then reads every other client's block on
    each disk, one request per block; it succeeds if a majority of disks completed
    and no block read anywhere shows a higher ``mbal`` (else the ballot aborts).
    Phase 1 starts a ballot; phase 2 writes the value with the highest ``bal`` seen
    in phase 1 (its own if none) and, if it succeeds, that value is chosen.
    Requests to one disk are sequential; disks are served in parallel, so a phase
    is ``m`` round trips for ``m`` clients.
    """

    def __init__(self, disks: dict[str, Backend], codec: Codec, clients: Sequence[str],
                 me: str, *, backoff: float = 0.05, max_attempts: int = 10,
                 rng: random.Random | None = None) -> None:
        self.disks = disks
        self.codec = codec
        self.clients = tuple(clients)
        self.me = me
        self.index = self.clients.index(me) + 1  # 0 is reserved for "no ballot"
        self.backoff = backoff
        self.max_attempts = max_attempts
        self.rng = rng or random.Random()
        self.majority = len(disks) // 2 + 1
        self.round_trips = 0
        self.requests = 0
        self._own: dict[int, DiskBlock] = {}

    def _key(self, instance: int, client: str) -> str:
        return f"dpaxos/{instance:012d}/{client}"

    def _read(self, disk: Backend, instance: int, client: str) -> DiskBlock | None:
        try:
            raw = disk.get(self._key(instance, client))
        except ObjectNotFound:
            return None
        try:
            return DiskBlock.from_bytes(self.codec.decode("dpaxos", str(instance), raw))
        except (CorruptObject, ValueError, KeyError, TypeError):
            return None

    def _phase(self, instance: int, block: DiskBlock) -> tuple[bool, list[DiskBlock], Ballot]:
        """Write ``block`` to all disks and read the others' blocks. Returns
        (succeeded, blocks seen, highest mbal seen)."""
        data = self.codec.encode("dpaxos", str(instance), block.to_bytes())
        others = [c for c in self.clients if c != self.me]
        results: dict[str, tuple[str, list[DiskBlock], int]] = {}
        lock = threading.Lock()

        def on_disk(name: str, disk: Backend) -> None:
            seen: list[DiskBlock] = []
            requests = 0
            outcome = "ok"
            try:
                disk.put(self._key(instance, self.me), data)
                requests += 1
                for other in others:
                    got = self._read(disk, instance, other)
                    requests += 1
                    if got is None:
                        continue
                    seen.append(got)
                    if got.mbal > block.mbal:
                        outcome = "aborted"
                        break
            except Exception:
                outcome = "failed"
            with lock:
                results[name] = (outcome, seen, requests)

        threads = [threading.Thread(target=on_disk, args=(n, d), daemon=True)
                   for n, d in self.disks.items()]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self.round_trips += max(r[2] for r in results.values())
        self.requests += sum(r[2] for r in results.values())
        seen = [b for r in results.values() for b in r[1]]
        highest = max((b.mbal for b in seen), default=NO_BALLOT)
        aborted = any(r[0] == "aborted" for r in results.values())
        completed = sum(1 for r in results.values() if r[0] == "ok")
        return (not aborted and completed >= self.majority), seen, highest

    def propose(self, instance: int, value: Version) -> Version:
        """Run ballots in ``instance`` until one chooses a value; return it."""
        own = self._own.get(instance, DiskBlock(NO_BALLOT, NO_BALLOT, None))
        highest = own.mbal
        for attempt in range(self.max_attempts):
            if attempt:
                time.sleep(self.rng.uniform(0, self.backoff * 2 ** min(attempt, 6)))
            ballot: Ballot = (max(highest[0], own.mbal[0]) + 1, self.index)
            # Phase 1: announce the ballot, learn what was accepted before it.
            own = DiskBlock(ballot, own.bal, own.inp)
            self._own[instance] = own
            ok, seen, top = self._phase(instance, own)
            highest = max(highest, top)
            if not ok:
                continue
            accepted = [b for b in [*seen, own] if b.bal != NO_BALLOT and b.inp is not None]
            chosen = max(accepted, key=lambda b: b.bal).inp if accepted else value
            assert chosen is not None
            # Phase 2: accept the value in this ballot.
            own = DiskBlock(ballot, ballot, chosen)
            self._own[instance] = own
            ok, seen, top = self._phase(instance, own)
            highest = max(highest, top)
            if ok:
                return chosen
        raise DiskPaxosAborted(f"instance {instance}: {self.max_attempts} ballots aborted")


# ================================================================ experiment 2
def run_disk_paxos(clients: int, commits: int, acceptors: int, latency: float) -> Summary:
    backends = make_backends(acceptors, latency)
    names = [f"client{i}" for i in range(clients)]
    dp = DiskPaxos(backends, make_codec(), names, names[0])
    out: list[Commit] = []
    start = time.perf_counter()
    for i in range(commits):
        value = Version(i + 1, master_of(names[0], i), CONFIG_ID)
        t0 = time.perf_counter()
        rt, rq = dp.round_trips, dp.requests
        got = dp.propose(i + 1, value)
        if got != value:
            raise RuntimeError(f"Disk Paxos decided {got} for an uncontended {value}")
        took = time.perf_counter() - t0
        out.append(Commit(took, took, dp.round_trips - rt, dp.round_trips - rt,
                          dp.requests - rq, dp.requests - rq, 1, 0))
    return summarize(out, time.perf_counter() - start, backend_counts(backends))


def run_ppaxos_clients(mode: Mode, clients: int, commits: int, acceptors: int,
                       latency: float) -> Summary:
    """One proposer among ``clients``; the idle ones hold a Consensus and never call it."""
    backends = make_backends(acceptors, latency)
    codec = make_codec()
    conss = [Consensus(backends, codec, f"client{i}", conditional=mode.conditional,
                       fast_path=mode.fast_path) for i in range(clients)]
    out: list[Commit] = []
    start = time.perf_counter()
    commit_loop(conss[0], "client0", commits, None, out)
    wall = time.perf_counter() - start
    check_history(backends, codec, commits)
    return summarize(out, wall, backend_counts(backends))


# ================================================================ report
def ms(seconds: float) -> str:
    return f"{seconds * 1000:.0f}"


def table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    lines = ["| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)) + " |",
             "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    lines += ["| " + " | ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) + " |"
              for r in rows]
    return "\n".join(lines)


def report_exp1(results: dict[str, dict[int, Summary]]) -> str:
    out = []
    headers = ["mode", "proposers", "mean ms", "median ms", "p90 ms", "max ms", "decide RT",
               "total RT", "requests", "proposals", "max prop."]
    rows = []
    for mode in MODES:
        for p, s in results[mode.key].items():
            rows.append([mode.key, str(p), ms(s.latency_mean_s), ms(s.latency_median_s),
                         ms(s.latency_p90_s), ms(s.latency_max_s),
                         f"{s.decide_round_trips:.2f}", f"{s.total_round_trips:.2f}",
                         f"{s.total_requests:.1f}", f"{s.proposals_per_commit:.2f}",
                         str(s.proposals_max)])
    contended = sum(s.contended_errors for per in results.values() for s in per.values())
    out.append(table(headers, rows))
    out.append("decide RT: round trips inside propose calls; total RT: also get_recent; "
               "requests: all requests per commit;")
    out.append("proposals: propose calls per commit (more than 1: lost an instance to another "
               "proposer, or helped finish its value, first)")
    out.append(f"propose calls that gave up as Contended after max_attempts: {contended}")
    out.append("")
    out.append("Uncontended (1 proposer) round trips per commit:")
    rows = []
    for mode in MODES:
        s = results[mode.key][1]
        rows.append([mode.key, mode.label, f"{s.decide_round_trips:.2f}",
                     f"{s.total_round_trips:.2f}", ms(s.latency_median_s)])
    out.append(table(["mode", "what", "decide RT", "total RT", "median ms"], rows))
    return "\n".join(out)


def report_exp2(results: dict[str, dict[int, Summary]]) -> str:
    headers = ["clients"]
    for key in results:
        headers += [f"{key} decide ms", f"{key} decide RT", f"{key} decide req"]
    rows = []
    counts = next(iter(results.values())).keys()
    for m in counts:
        row = [str(m)]
        for per in results.values():
            s = per[m]
            row += [ms(s.decide_mean_s), f"{s.decide_round_trips:.1f}",
                    f"{s.decide_requests:.1f}"]
        rows.append(row)
    # pPaxos commits include a get_recent; show its full commit latency too.
    lines = [table(headers, rows), "", "Full commit (pPaxos: get_recent + propose; "
             "Disk Paxos: the two phases), mean ms / median ms / total RT / requests:"]
    rows2 = []
    for m in counts:
        row = [str(m)]
        for per in results.values():
            s = per[m]
            row.append(f"{ms(s.latency_mean_s)} / {ms(s.latency_median_s)} / "
                       f"{s.total_round_trips:.1f} / {s.total_requests:.1f}")
        rows2.append(row)
    lines.append(table(["clients", *results], rows2))
    return "\n".join(lines)


def machine_info() -> dict[str, Any]:
    cpu_model = ""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    cpu_model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {
        "nproc": len(os.sched_getaffinity(0)),
        "cpu_model": cpu_model,
        "loadavg_end": [round(x, 2) for x in os.getloadavg()],
        "platform": platform.platform(),
        "python": sys.version.split()[0],
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--latency-ms", type=float, default=20.0,
                        help="latency of every backend request (default 20)")
    parser.add_argument("--commits", type=int, default=10,
                        help="commits per proposer (default 10)")
    parser.add_argument("--acceptors", type=int, default=5,
                        help="backends / acceptors / disks (default 5, the paper's 'all')")
    parser.add_argument("--out", type=Path, default=None,
                        help="results file (default bench/results/consensus-<timestamp>.json)")
    parser.add_argument("--skip", choices=("proposers", "clients"), action="append", default=[],
                        help="skip an experiment")
    parser.add_argument("--quick", action="store_true",
                        help="smoke test: 3 commits per proposer (same shapes, noisier)")
    args = parser.parse_args(argv)
    if args.quick:
        args.commits = 3
    latency = args.latency_ms / 1000
    started = datetime.now(UTC).replace(microsecond=0)
    print(f"consensus bench: {args.acceptors} backends, {args.latency_ms:g} ms per request, "
          f"{args.commits} commits per proposer")
    print(f"latency model: {LATENCY_NOTE}")
    t_all = time.perf_counter()

    exp1: dict[str, dict[int, Summary]] = {}
    if "proposers" not in args.skip:
        print("\n== Experiment 1: competing proposers (paper Figure 9) ==")
        for mode in MODES:
            exp1[mode.key] = {}
            for p in PROPOSER_COUNTS:
                s = run_proposers(mode, p, args.commits, args.acceptors, latency)
                exp1[mode.key][p] = s
                print(f"  {mode.key:13} {p} proposer(s): median {ms(s.latency_median_s)} ms, "
                      f"{s.total_round_trips:.2f} RT/commit ({s.wall_s:.1f} s)", flush=True)
        print()
        print(report_exp1(exp1))

    exp2: dict[str, dict[int, Summary]] = {}
    if "clients" not in args.skip:
        print("\n== Experiment 2: pPaxos vs Disk Paxos as clients grow, 1 proposer "
              "(paper Figure 10) ==")
        ppaxos_modes = [m for m in MODES if m.key in ("plain-classic", "cond-fast")]
        exp2["disk-paxos"] = {}
        for mode in ppaxos_modes:
            exp2[mode.key] = {}
        for m in CLIENT_COUNTS:
            s = run_disk_paxos(m, args.commits, args.acceptors, latency)
            exp2["disk-paxos"][m] = s
            line = f"  {m:2} clients: disk-paxos {ms(s.latency_mean_s)} ms"
            for mode in ppaxos_modes:
                s = run_ppaxos_clients(mode, m, args.commits, args.acceptors, latency)
                exp2[mode.key][m] = s
                line += f", {mode.key} {ms(s.latency_mean_s)} ms"
            print(line, flush=True)
        print()
        print(report_exp2(exp2))

    elapsed = time.perf_counter() - t_all
    uncontended = {k: {"decide_round_trips": v[1].decide_round_trips,
                       "total_round_trips": v[1].total_round_trips}
                   for k, v in exp1.items()}
    doc = {
        "benchmark": "consensus",
        "timestamp": started.isoformat(),
        "note": LATENCY_NOTE + "; no hint published between commits",
        "config": {"latency_ms": args.latency_ms, "commits_per_proposer": args.commits,
                   "acceptors": args.acceptors, "proposer_counts": list(PROPOSER_COUNTS),
                   "client_counts": list(CLIENT_COUNTS),
                   "modes": {m.key: {"label": m.label, "conditional": m.conditional,
                                     "fast_path": m.fast_path} for m in MODES}},
        "machine": machine_info(),
        "elapsed_s": round(elapsed, 2),
        "headline_uncontended": uncontended,
        "results": {
            "proposers": {k: {str(p): asdict(s) for p, s in v.items()} for k, v in exp1.items()},
            "clients": {k: {str(m): asdict(s) for m, s in v.items()} for k, v in exp2.items()},
        },
    }
    out = args.out or RESULTS_DIR / f"consensus-{started.strftime('%Y%m%dT%H%M%SZ')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"\n{elapsed:.0f} s in all; results in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
