"""A fresh clone killed at random points, then finished (issue 21).

One source folder -- a few hundred small files in folders, several files of
several chunks each (chunks are 256 KiB-4 MiB, content-defined), a link, an
executable, an empty file -- is pushed once to three ``dir:`` backends. One whole
``metasync clone`` is traced (``METASYNC_CRASH_TRACE`` lists every crash-point
arrival in order, see :mod:`metasync.faults`), and 20 arrivals are chosen from
the trace with a fixed seed: the first arrival of every point (so the early ones
-- before ``.metasync`` exists, right after it -- and whatever points the
checkout's file writing has, picked up by name from the trace, never listed
here), the last of each, and the rest spread over the trace. For each, a clone
dies there like ``kill -9`` (``METASYNC_CRASH_AT=NAME:N``), and is then finished
the two ways a user would, in turn: ``metasync pull`` in the folder, or the same
``metasync clone URI DIR`` again. A few clones are also killed with a real
``SIGKILL`` at moments chosen by progress (how many files the folder holds).

Checked after each kill: ``metasync status`` in the folder says the clone is not
finished and how to finish it (it must not look clean, nor change the folder).
Checked after each finish: the folder is the source exactly (paths, types,
content, link targets, exec bits), so no partly written file is left looking
whole; no conflict copy and no temporary file is left; ``status`` is clean; and
``fsck`` passes once at the end.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from conftest import METASYNC, PASSPHRASE, one_line_error, snapshot
from metasync import Repository
from metasync.worktree import META_DIR, TEMP_PREFIX

CRASH_STATUS = 137
#: Kill points chosen from the trace.
POINTS = 20
SEED = 21
#: Safety net only (a command that hangs is a bug worth seeing): no test waits on it.
HANG_LIMIT = 300
#: Longest wait for a clone to reach the progress a SIGKILL waits for.
PROGRESS_LIMIT = 120.0
Snapshot = dict[str, tuple[str, ...]]


@dataclass
class Source:
    """The pushed source folder, its backends, and the trace of one whole clone."""

    root: Path
    work: Path
    backends: list[Path]
    expected: Snapshot
    arrivals: list[tuple[str, int]]
    env: dict[str, str]

    @property
    def uri(self) -> str:
        return f"dir:{self.backends[0]}"

    def run(self, *args: str, cwd: Path, crash: str | None = None, trace: Path | None = None,
            check: bool = True) -> subprocess.CompletedProcess[str]:
        env = dict(self.env)
        if crash is not None:
            env["METASYNC_CRASH_AT"] = crash
        if trace is not None:
            env["METASYNC_CRASH_TRACE"] = str(trace)
        proc = subprocess.run([METASYNC, *args], cwd=cwd, env=env, capture_output=True,
                              text=True, stdin=subprocess.DEVNULL, timeout=HANG_LIMIT)
        if check and proc.returncode != 0:
            raise AssertionError(f"metasync {' '.join(args)} in {cwd} failed "
                                 f"({proc.returncode}):\n{proc.stdout}{proc.stderr}")
        return proc

    def clone(self, folder: Path, crash: str | None = None,
              check: bool = True) -> subprocess.CompletedProcess[str]:
        return self.run("clone", self.uri, str(folder), cwd=self.work, crash=crash, check=check)


def fill(root: Path) -> None:
    rng = random.Random(SEED)
    for i in range(240):
        folder = root / f"d{i % 6}" / (f"s{i % 4}" if i % 3 else "")
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"f{i:03}.txt").write_bytes(rng.randbytes(rng.randint(1, 4000)))
    for i in range(3):  # several chunks each (256 KiB-4 MiB, content-defined)
        (root / "big" / f"blob{i}.bin").parent.mkdir(exist_ok=True)
        (root / "big" / f"blob{i}.bin").write_bytes(rng.randbytes((4 << 20) + (i + 1) * 300_000))
    (root / "empty").write_bytes(b"")
    (root / "tool.sh").write_text("#!/bin/sh\necho tool\n")
    (root / "tool.sh").chmod(0o755)
    os.symlink("d0/f000.txt", root / "link")


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Source]:
    base = tmp_path_factory.mktemp("clone-crash")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("METASYNC_CRASH", "METASYNC_PASSPHRASE", "METASYNC_PAUSE"))}
    env["METASYNC_PASSPHRASE"] = PASSPHRASE
    backends = [base / f"backend{i}" for i in range(3)]
    for b in backends:
        b.mkdir()
    root = base / "source"
    fill(root)
    src = Source(root, base, backends, {}, [], env)
    src.run("init", str(root), "--replicas", "2",
            *(a for b in backends for a in ("--backend", f"dir:{b}")), cwd=base)
    src.run("push", "-m", "all", cwd=root)
    src.expected = snapshot(root)
    trace = base / "trace"
    traced = base / "traced"
    src.run("clone", src.uri, str(traced), cwd=base, crash="no-such-point", trace=trace)
    assert snapshot(traced) == src.expected
    shutil.rmtree(traced)
    seen: Counter[str] = Counter()
    for name in trace.read_text().split():
        seen[name] += 1
        src.arrivals.append((name, seen[name]))
    yield src


def choose(arrivals: list[tuple[str, int]], count: int = POINTS) -> list[tuple[str, int]]:
    """``count`` arrivals: the first and last of every point, the rest spread over
    the trace (one drawn from each of equal stretches, fixed seed); in trace order."""
    counts = Counter(name for name, _ in arrivals)
    must = {(name, 1) for name in counts} | {(name, n) for name, n in counts.items()}
    rest = [a for a in arrivals if a not in must]
    wanted = max(0, count - len(must))
    rng = random.Random(SEED)
    picked: set[tuple[str, int]] = set()
    if rest and wanted:
        step = len(rest) / min(wanted, len(rest))
        for k in range(min(wanted, len(rest))):
            lo, hi = int(k * step), max(int(k * step) + 1, int((k + 1) * step))
            picked.add(rest[rng.randrange(lo, min(hi, len(rest)))])
    chosen = must | picked
    return [a for a in arrivals if a in chosen]


def leftovers(root: Path) -> list[str]:
    """Temporary files, staging folders and conflict copies in ``root``."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel = os.path.relpath(dirpath, root)
        if rel == ".":
            dirnames[:] = [d for d in dirnames if d != META_DIR]
        for name in dirnames + filenames:
            if (name.startswith(TEMP_PREFIX) or name.startswith(f"{META_DIR}.new-")
                    or "(conflict " in name):
                out.append(os.path.normpath(os.path.join(rel, name)))
    return sorted(out)


def check_unfinished(src: Source, folder: Path, where: str) -> None:
    """After a kill: ``status`` says the clone is unfinished and how to finish it,
    and leaves the folder as it is."""
    if not (folder / META_DIR).is_dir():
        return  # killed before the clone's repository existed: nothing to ask
    before = snapshot(folder)
    proc = src.run("status", cwd=folder, check=False)
    said = proc.stdout + proc.stderr
    assert "folder clean" not in said, f"{where}: status of an unfinished clone looks clean:\n{said}"
    assert "unfinished clone" in said.lower() and "metasync pull" in said, (
        f"{where}: status does not say the clone is unfinished and how to finish it:\n{said}")
    assert snapshot(folder) == before, f"{where}: status changed the unfinished clone"


def check_finished(src: Source, folder: Path, where: str) -> None:
    got = snapshot(folder)
    if got != src.expected:
        missing = sorted(set(src.expected) - set(got))[:5]
        extra = sorted(set(got) - set(src.expected))[:5]
        differ = sorted(p for p in set(got) & set(src.expected) if got[p] != src.expected[p])[:5]
        raise AssertionError(f"{where}: the finished clone differs from the source: "
                             f"missing {missing}, extra {extra}, different {differ}")
    assert not leftovers(folder), f"{where}: left behind: {leftovers(folder)}"
    # Through the API in this process (the code the CLI wraps): saves a process start.
    with Repository.open(folder) as repo:
        st = repo.status()
        assert not repo.unfinished_clone, f"{where}: the clone is still marked unfinished"
    assert st.clean and not st.changes, f"{where}: {st}"


def finish(src: Source, folder: Path, way: str) -> str:
    """Finish an interrupted clone ``way`` ("pull" or "re-run"); return the way
    taken (a folder without ``.metasync`` has nothing to pull: re-run)."""
    if way == "pull" and (folder / META_DIR).is_dir():
        src.run("pull", cwd=folder)
        return "pull"
    interrupted = (folder / META_DIR).is_dir()
    proc = src.clone(folder)
    if interrupted:
        assert f"resuming the interrupted clone in {folder}" in proc.stderr, proc.stderr
    return "re-run"


def test_trace_covers_the_clone(source: Source) -> None:
    """The traced clone passes the points the sweep needs: before and right after
    ``.metasync`` exists, and one per file written."""
    names = Counter(name for name, _ in source.arrivals)
    assert names["clone:checked"] == 1 and names["clone:created"] == 1, names
    assert names["checkout:planned"] == 1, names
    written = sum(1 for kind, *_ in source.expected.values() if kind != "dir")
    assert max(names.values()) >= written, f"no point is passed once per file: {names}"


def test_clone_killed_at_20_points_is_finished_by_pull_or_rerun(source: Source) -> None:
    points = choose(source.arrivals)
    assert len(points) >= POINTS, points
    # Kills inside a file's write (between its chunks) and between files written in
    # place: what a part-written file that looks whole would come from.
    assert {"write:piece", "checkout:write"} <= {name for name, _ in points}, points
    ways: Counter[str] = Counter()
    last = None
    for i, (name, n) in enumerate(points):
        folder = source.work / f"clone-{i:02}"
        where = f"killed at {name}:{n}"
        proc = source.clone(folder, crash=f"{name}:{n}", check=False)
        assert proc.returncode == CRASH_STATUS, (
            f"the clone did not die at {name}:{n} ({proc.returncode}):\n{proc.stderr}")
        check_unfinished(source, folder, where)
        way = finish(source, folder, "pull" if i % 2 == 0 else "re-run")
        ways[way] += 1
        check_finished(source, folder, f"{where}, then {way}")
        if last is not None:
            shutil.rmtree(last)
        last = folder
    assert ways["pull"] >= 5 and ways["re-run"] >= 5, ways
    assert last is not None
    source.run("fsck", cwd=last)
    shutil.rmtree(last)


def files_in(folder: Path) -> int:
    """Files (of any name, temporary ones too) in ``folder`` outside ``.metasync``."""
    count = 0
    for dirpath, dirnames, filenames in os.walk(folder):
        if dirpath == str(folder):
            dirnames[:] = [d for d in dirnames if d != META_DIR]
        count += len(filenames)
    return count


def kill_when(src: Source, folder: Path, ready: Callable[[], bool]) -> bool:
    """Start a clone into ``folder`` and SIGKILL it once ``ready()`` (polled, with a
    bounded wait); False if it finished first."""
    proc = subprocess.Popen([METASYNC, "clone", src.uri, str(folder)], cwd=src.work,
                            env=src.env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + PROGRESS_LIMIT
        while proc.poll() is None and not ready():
            if time.monotonic() > deadline:
                raise AssertionError(f"the clone into {folder} made no progress")
            time.sleep(0.002)
        landed = proc.poll() is None
        proc.send_signal(signal.SIGKILL)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=HANG_LIMIT)
    return landed and proc.returncode == -signal.SIGKILL


def test_sigkill_by_progress_then_finish(source: Source) -> None:
    """Real ``kill -9`` at moments chosen by how many files the folder holds (and
    once while a multi-chunk file is partly there), finished both ways."""
    total = sum(1 for kind, *_ in source.expected.values() if kind != "dir")
    biggest = max(p.stat().st_size for p in (source.root / "big").iterdir())

    def holding(k: int) -> Callable[[Path], bool]:
        return lambda folder: files_in(folder) >= k

    def partial_big(folder: Path) -> bool:
        for dirpath, dirnames, filenames in os.walk(folder):
            dirnames[:] = [d for d in dirnames if d != META_DIR]
            for name in filenames:
                try:
                    size = os.lstat(os.path.join(dirpath, name)).st_size
                except FileNotFoundError:
                    continue
                if 0 < size < biggest and size > 256 * 1024:
                    return True
        return False

    conditions = [("a first file", holding(1)), ("a third of the files", holding(total // 3)),
                  ("a big file partly written", partial_big),
                  ("nearly every file", holding(total - 2))]
    landed = 0
    for i, (what, ready) in enumerate(conditions):
        folder = source.work / f"killed-{i}"
        hit = kill_when(source, folder, lambda f=folder, r=ready: r(f))  # type: ignore[misc]
        landed += hit
        if hit:
            check_unfinished(source, folder, f"SIGKILL at {what}")
        way = finish(source, folder, "re-run" if i % 2 == 0 else "pull")
        check_finished(source, folder, f"SIGKILL at {what}, then {way}")
        shutil.rmtree(folder)
    assert landed, "no SIGKILL landed before its clone finished"


@pytest.mark.parametrize("point", ["clone:created", "clone:hinted"])
def test_clone_killed_before_its_checkout_is_finished_by_pull(source: Source, point: str) -> None:
    """A clone killed before it wrote anything of its first checkout leaves a
    state that ``metasync pull`` finishes (and that status calls unfinished)."""
    folder = source.work / f"early-{point.replace(':', '-')}"
    assert source.clone(folder, crash=point, check=False).returncode == CRASH_STATUS
    assert (folder / META_DIR).is_dir() and files_in(folder) == 0
    check_unfinished(source, folder, f"killed at {point}")
    doc = json.loads(source.run("status", "--json", "--offline", cwd=folder).stdout)
    assert doc["unfinished_clone"] is True and doc["clean"] is False, doc
    source.run("pull", cwd=folder)
    check_finished(source, folder, f"killed at {point}, then pull")
    shutil.rmtree(folder)


def test_rerun_removes_a_staging_leftover(source: Source) -> None:
    """Killed while ``.metasync`` was being built: only its staging folder is
    there, which ``pull`` cannot use; re-running the clone removes it."""
    folder = source.work / "staged"
    assert source.clone(folder, crash="create:staged", check=False).returncode == CRASH_STATUS
    names = [p.name for p in folder.iterdir()]
    assert len(names) == 1 and names[0].startswith(f"{META_DIR}.new-"), names
    source.clone(folder)
    check_finished(source, folder, "killed at create:staged, then re-run")
    shutil.rmtree(folder)


def test_rerun_refuses_what_is_not_an_interrupted_clone(source: Source, tmp_path: Path) -> None:
    """User files, a finished clone, or an interrupted clone of another repository
    are refused with the one-line error, and left as they were."""
    user = tmp_path / "user"
    (user / "notes").mkdir(parents=True)
    (user / "notes" / "todo.txt").write_text("mine\n")
    one_line_error(source.clone(user, check=False), "is not empty")
    assert (user / "notes" / "todo.txt").read_text() == "mine\n"

    finished = tmp_path / "finished"
    source.clone(finished)
    before = snapshot(finished)
    one_line_error(source.clone(finished, check=False), "is not empty")
    assert snapshot(finished) == before

    # An interrupted clone of another repository (same passphrase, other backends).
    other_backends = [tmp_path / "ob0", tmp_path / "ob1"]
    for b in other_backends:
        b.mkdir()
    other = tmp_path / "other-src"
    (other / "x").parent.mkdir(parents=True)
    (other / "x").write_text("x\n")
    source.run("init", str(other), "--replicas", "1",
               *(a for b in other_backends for a in ("--backend", f"dir:{b}")), cwd=tmp_path)
    source.run("push", cwd=other)
    foreign = tmp_path / "foreign"
    killed = source.run("clone", f"dir:{other_backends[0]}", str(foreign), cwd=tmp_path,
                        crash="clone:created", check=False)
    assert killed.returncode == CRASH_STATUS
    one_line_error(source.clone(foreign, check=False), "another repository")
    assert (foreign / META_DIR).is_dir()


def written_files(folder: Path) -> list[Path]:
    """The regular files a killed clone left in ``folder`` (outside ``.metasync``)."""
    out = []
    for dirpath, dirnames, filenames in os.walk(folder):
        if dirpath == str(folder):
            dirnames[:] = [d for d in dirnames if d != META_DIR]
        out += [Path(dirpath) / n for n in filenames if not n.startswith(".metasync")]
    return sorted(p for p in out if p.is_file() and not p.is_symlink())


@pytest.mark.parametrize(("point", "way"), [("checkout:write:60", "pull"),
                                             ("checkout:write:60", "re-run"),
                                             ("checkout:done", "pull")])
def test_what_the_user_wrote_in_an_interrupted_clone_is_kept(
        source: Source, tmp_path: Path, point: str, way: str) -> None:
    """After a kill, the user edits a file the clone wrote and makes one at a path it
    had not written yet (and, the clone's files all written, appends to one): the
    clone finished either way keeps each as a conflict copy -- a file in the folder
    is replaced only if it is the start of the tree's content (part-written by the
    clone), never the user's bytes (review of issue 21: they were overwritten)."""
    folder = tmp_path / "clone"
    proc = source.clone(folder, crash=point, check=False)
    assert proc.returncode == CRASH_STATUS, proc.stderr
    rel_written = {p.relative_to(folder).as_posix() for p in written_files(folder)}
    small = sorted(p for p in source.expected if p.endswith(".txt"))
    edited = next(p for p in small if p in rel_written)
    (folder / edited).write_bytes(b"MY PRECIOUS EDIT")
    mine = {edited: b"MY PRECIOUS EDIT"}
    if point == "checkout:done":
        appended = next(p for p in reversed(small) if p in rel_written and p != edited)
        mine[appended] = (folder / appended).read_bytes() + b" and my line"
        (folder / appended).write_bytes(mine[appended])
    else:
        created = next(p for p in small if p not in rel_written)
        (folder / created).parent.mkdir(parents=True, exist_ok=True)
        (folder / created).write_bytes(b"MADE BY ME")
        mine[created] = b"MADE BY ME"
    finish(source, folder, way)
    got = snapshot(folder)
    for path, data in mine.items():
        assert got[path] == source.expected[path], f"{path} is not the tree's after the finish"
        stem = path.rsplit(".", 1)[0]
        copies = [p for p in got if p.startswith(stem + " (conflict ")]
        assert len(copies) == 1, f"no conflict copy of {path}: {sorted(got)[:20]}"
        assert (folder / copies[0]).read_bytes() == data, f"{copies[0]} is not what the user wrote"


def test_a_clone_flushes_early_and_records_its_files_only_once_all_are_on_disk(
        source: Source, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The in-place clone starts flushing in the background as it writes
    (``filewriter.EarlyFlush``), but the index rows of what it wrote are recorded
    only after a flush that began once every file was written had returned: a power
    cut can never leave a row vouching for a file not on disk."""
    from metasync import Repository, filewriter
    from metasync.localdb import LocalDB

    events: list[str] = []
    lock = threading.Lock()
    writing = {"files": 0}

    def flush() -> None:
        with lock:
            events.append(f"flush-start {threading.current_thread().name} {writing['files']}")
        with lock:
            events.append(f"flush-end {threading.current_thread().name}")

    real_wrote = filewriter.EarlyFlush.wrote

    def wrote(self: filewriter.EarlyFlush, size: int) -> None:
        with lock:
            writing["files"] += 1
        real_wrote(self, size)

    real_upsert = LocalDB.upsert_index

    def upsert(self: LocalDB, rows: Any) -> None:
        rows = list(rows)
        if rows:
            with lock:
                events.append(f"rows {len(rows)}")
        real_upsert(self, rows)

    monkeypatch.setattr(filewriter, "sync_all", flush)
    monkeypatch.setattr(filewriter, "FLUSH_EVERY", 64 * 1024)
    monkeypatch.setattr(filewriter.EarlyFlush, "wrote", wrote)
    monkeypatch.setattr(LocalDB, "upsert_index", upsert)
    repo = Repository.clone(source.uri, tmp_path / "c", passphrase=lambda: PASSPHRASE)
    repo.close()
    assert snapshot(tmp_path / "c") == source.expected
    early = [e for e in events if e.startswith("flush-start metasync-flush")]
    assert early, f"no background flush while writing: {events}"
    total = writing["files"]
    first_rows = next(i for i, e in enumerate(events) if e.startswith("rows"))
    finals = [i for i, e in enumerate(events[:first_rows])
              if e.startswith("flush-start") and "metasync-flush" not in e
              and e.endswith(f" {total}")]
    assert finals, f"no flush after the last file and before its rows: {events}"
    assert events[finals[-1] + 1].startswith("flush-end"), events
    # Every background flush ended before the rows were recorded (durable joins it).
    assert (events[:first_rows].count("flush-end metasync-flush")
            == len(early)), events
