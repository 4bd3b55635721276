"""Crash consistency through the real ``metasync`` command.

Every test drives real CLI processes and kills them like ``kill -9`` -- at named
crash points (``METASYNC_CRASH_AT=NAME:N`` ends the process with ``os._exit(137)``,
see :mod:`metasync.faults`) or with a real ``SIGKILL`` -- and then checks that the
command the user would run next completes the work: nothing the user wrote is
lost, every folder converges on the same tree, ``fsck`` passes and ``status`` is
clean.

How a sweep works: the scenario is built once and its live folders (working
folders *and* backend folders) are saved; the command under test is first run
with a crash target that never fires plus ``METASYNC_CRASH_TRACE``, which lists
every crash-point arrival in order; then, for each chosen arrival ``(NAME, N)``,
the live folders are restored in place from the saved copy (in place, so the
backend URIs in the shared configuration stay valid) and the command is run
again, dying at that arrival. Arrivals are chosen deterministically: every
arrival of the push sweep, and for the other sweeps every distinct point name
with its first, middle and last arrival (a checkout renames once per file, so
hundreds of ``checkout:rename`` arrivals share one code path). Restoring links
the saved files back (metasync never writes an existing file in place; its
SQLite state is copied), and checks after the recovery use the Python API in
this process, the same code the CLI wraps: the sweeps run hundreds of commands.

The crash-point tests found no lost file, no divergence and no repository a
command could not complete. The tests at the end pin the bugs they did find
(now fixed): ``METASYNC_CRASH_AT`` could not name most points, an interrupted
commit leaked its objects in ``.metasync/outbox``, ``status`` reported an
interrupted pull's unapplied changes as the user's own, and a pull brought back
folders the user had removed.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from conftest import METASYNC, PASSPHRASE, make_tree, snapshot
from metasync import Repository
from metasync.repository import Status

CRASH_STATUS = 137
TEMP_PREFIX = ".metasync-tmp-"
#: Runs the CLI dying at the N-th arrival of a crash point. ``METASYNC_CRASH_AT``
#: cannot name one today: faults.py splits NAME:N at the *first* colon and every
#: point name but ``upload`` contains one (see test_crash_at_accepts_point_names);
#: so the target is set in faults' variables directly, with METASYNC_CRASH_AT set
#: to a placeholder to switch crash points (and tracing) on.
LAUNCHER = """
import os, sys
name, _, n = os.environ.pop("CRASH_TEST_TARGET").rpartition(":")
os.environ["METASYNC_CRASH_AT"] = "crash-test"
import metasync.faults as faults
faults._spec, faults._target, faults._remaining = "crash-test", name, int(n)
sys.argv[0] = "metasync"
from metasync.cli import main
main()
"""
#: Safety net only (a command that hangs is a bug worth seeing): no test waits on it.
HANG_LIMIT = 600
Snapshot = dict[str, tuple[str, ...]]


@pytest.fixture(scope="module")
def pycache() -> Iterator[Path]:
    """Bytecode for the CLI processes, kept outside the checkout: each of the
    hundreds of commands would otherwise compile metasync from source."""
    with tempfile.TemporaryDirectory(prefix="metasync-crash-pyc-") as d:
        yield Path(d)


class World:
    """The live folders of one scenario (backends, client folders ``a``, ``b``, a
    scratch clone ``c``) and a saved copy to restore them from, in place."""

    def __init__(self, root: Path, pycache: Path) -> None:
        self.live = root / "live"
        self.saved = root / "saved"
        self.backends = [self.live / f"backend{i}" for i in range(3)]
        self.a, self.b, self.c = self.live / "a", self.live / "b", self.live / "c"
        self.env = {k: v for k, v in os.environ.items()
                    if not k.startswith("METASYNC_") and k != "PYTHONDONTWRITEBYTECODE"}
        self.env["METASYNC_PASSPHRASE"] = PASSPHRASE
        self.env["PYTHONPYCACHEPREFIX"] = str(pycache)
        for d in self.backends:
            d.mkdir(parents=True)
        self.restores = 0
        self.deleter = ThreadPoolExecutor(max_workers=1)
        self.deleting: list[Future[None]] = []

    def run(self, *args: str, cwd: Path, crash: str | None = None, trace: Path | None = None,
            check: bool = True) -> subprocess.CompletedProcess[str]:
        env = dict(self.env)
        command = [METASYNC, *args]
        if crash is not None and ":" in crash:
            env["CRASH_TEST_TARGET"] = crash
            command = [sys.executable, "-c", LAUNCHER, *args]
        elif crash is not None:
            env["METASYNC_CRASH_AT"] = crash
        if trace is not None:
            env["METASYNC_CRASH_TRACE"] = str(trace)
        proc = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True,
                              stdin=subprocess.DEVNULL, timeout=HANG_LIMIT)
        if check and proc.returncode != 0:
            raise AssertionError(f"metasync {' '.join(args)} in {cwd.name} failed "
                                 f"({proc.returncode}):\n{proc.stdout}{proc.stderr}")
        return proc

    def init(self) -> None:
        """``a`` (already filled) becomes a repository on the three backends, R=2."""
        args = ["init", str(self.a), "--replicas", "2"]
        for d in self.backends:
            args += ["--backend", f"dir:{d}"]
        self.run(*args, cwd=self.live)

    def init_and_clone(self) -> None:
        """:meth:`init`, push, and ``b`` a clone of it."""
        self.init()
        self.run("push", "-m", "first", cwd=self.a)
        self.run("clone", f"dir:{self.backends[0]}", str(self.b), cwd=self.live)

    def save(self) -> None:
        shutil.rmtree(self.saved, ignore_errors=True)
        shutil.copytree(self.live, self.saved, symlinks=True)

    def restore(self) -> None:
        """Put the saved folders back in place; the old ones are deleted in the
        background (deleting is slower than linking the saved files back)."""
        self.restores += 1
        trash = self.live.with_name(f"trash{self.restores}")
        self.live.rename(trash)
        self.deleting.append(self.deleter.submit(shutil.rmtree, trash))
        shutil.copytree(self.saved, self.live, symlinks=True, copy_function=_link_or_copy)

    def close(self) -> None:
        self.deleter.shutdown(wait=True)
        for done in self.deleting:
            done.result()

    def arrivals(self, *args: str, cwd: Path) -> list[tuple[str, int]]:
        """Every crash-point arrival of the command, in order, as ``(name, n)``; the
        folders are restored afterwards."""
        trace = self.live.parent / "trace"
        trace.unlink(missing_ok=True)
        self.restore()
        self.run(*args, cwd=cwd, crash="no-such-point", trace=trace)
        self.restore()
        seen: Counter[str] = Counter()
        out = []
        for name in trace.read_text().split():
            seen[name] += 1
            out.append((name, seen[name]))
        return out

    def crash(self, *args: str, cwd: Path, at: tuple[str, int]) -> None:
        """Run the command so that it dies at arrival ``at``."""
        proc = self.run(*args, cwd=cwd, crash=f"{at[0]}:{at[1]}", check=False)
        assert proc.returncode == CRASH_STATUS, (
            f"metasync {' '.join(args)} did not die at {at[0]}:{at[1]} "
            f"(exit {proc.returncode}):\n{proc.stdout}{proc.stderr}")

    def status(self, cwd: Path) -> dict[str, Any]:
        """``metasync status --json``, parsed."""
        data: dict[str, Any] = json.loads(self.run("status", "--json", cwd=cwd).stdout)
        return data

    def check_cli(self, cwd: Path) -> None:
        """``metasync fsck`` exits 0, ``status --json`` is clean, no temporary file."""
        self.run("fsck", cwd=cwd)
        st = self.status(cwd)
        assert st["clean"] and not st["changes"], f"{cwd.name} not clean: {st}"
        assert not temps(cwd), f"temporary files left in {cwd.name}: {temps(cwd)}"


# Checks after the recovery go through the Python API in this process -- the same
# code the CLI is a thin layer over -- which saves a process start per check (the
# sweeps make hundreds); the crashing and the recovering commands are always real
# CLI processes, and test_sigkill_during_push_of_many_files checks through the CLI.
def api_pull(root: Path) -> None:
    with Repository.open(root) as repo:
        repo.pull()


def api_clone(uri: str, root: Path) -> None:
    Repository.clone(uri, root, passphrase=lambda: PASSPHRASE).close()


def api_status(root: Path) -> Status:
    with Repository.open(root) as repo:
        return repo.status()


def api_check(root: Path) -> None:
    """What ``metasync fsck`` (exit 0) and ``metasync status`` (clean) check, and
    no temporary file left in the folder."""
    with Repository.open(root) as repo:
        report = repo.fsck()
        assert report.ok, f"fsck of {root.name}: {report.problems}"
        st = repo.status()
        assert st.clean, f"{root.name} not clean: {st}"
    assert not temps(root), f"temporary files left in {root.name}: {temps(root)}"


def _link_or_copy(src: str, dst: str) -> str:
    """Restore a file as a hard link to its saved copy -- safe because metasync never
    writes an existing file in place (it writes new files and renames them), except
    its SQLite state, which is copied."""
    if os.path.basename(src).startswith("state.db"):
        return str(shutil.copy2(src, dst))
    os.link(src, dst)
    return dst


@pytest.fixture
def world(tmp_path: Path, pycache: Path) -> Iterator[World]:
    w = World(tmp_path, pycache)
    yield w
    w.close()


def temps(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob(f"{TEMP_PREFIX}*"))


def sample(arrivals: list[tuple[str, int]]) -> list[tuple[str, int]]:
    """Every distinct point with its first, middle and last arrival, in trace order."""
    last = Counter(name for name, _ in arrivals)
    keep = {(name, n) for name, total in last.items() for n in {1, (total + 1) // 2, total}}
    return [a for a in arrivals if a in keep]


def sweep(points: list[tuple[str, int]], one: Callable[[tuple[str, int]], None]) -> None:
    """Run ``one(point)`` for every point; report every failing point at once."""
    failures = []
    for point in points:
        try:
            one(point)
        except AssertionError as exc:
            failures.append(f"--- crash at {point[0]}:{point[1]}: {exc}")
    assert not failures, f"{len(failures)} of {len(points)} crash points failed:\n" + "\n".join(failures)


def write(path: Path, data: str | bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(data, str):
        path.write_text(data)
    else:
        path.write_bytes(data)


def local_changes(a: Path, remove_folder: bool = True) -> None:
    """Edits, additions (one multi-chunk file of 5 MB), deletions, a new exec bit and
    link, a removed (empty) folder -- on top of :func:`make_tree`."""
    rng = random.Random(11)
    write(a / "small" / "d00" / "f00000.txt", "edited in a\n")
    write(a / "ünïcödé — 名前" / "résumé ☃.txt", "snow man, edited\n")
    write(a / "new" / "added-1.txt", "added one\n")
    write(a / "new" / "deep" / "added-2.txt", rng.randbytes(3000))
    write(a / "big.bin", rng.randbytes(5 * 1024 * 1024))
    (a / "small" / "d01" / "f00001.txt").unlink()
    (a / "small" / "d02" / "f00002.txt").unlink()
    if remove_folder:
        (a / "empty-dir" / "nested-empty").rmdir()
    (a / "small" / "d03" / "f00003.txt").chmod(0o755)
    os.symlink("new/added-1.txt", a / "link-to-added")


def test_push_crash_sweep(world: World) -> None:
    """A push killed at any crash point -- before or after its commit is stored,
    between object uploads, before the proposal, between consensus round trips,
    after the decision -- is finished by the next ``push``: a pulled clone and a
    fresh clone then hold exactly the pushing folder, every edit, addition and
    deletion made before the crash included; ``fsck`` passes and ``status`` is
    clean. All arrivals of the push are exercised."""
    w = world
    make_tree(w.a, small_files=60)
    w.init_and_clone()
    local_changes(w.a)
    expected = snapshot(w.a)
    w.save()
    points = w.arrivals("push", "-m", "changes", cwd=w.a)
    assert {name for name, _ in points} >= {"push:learned", "commit:stored", "upload",
                                             "push:propose", "push:decided", "paxos:batch"}
    assert sum(name == "upload" for name, _ in points) >= 3

    def one(at: tuple[str, int]) -> None:
        w.restore()
        w.crash("push", "-m", "changes", cwd=w.a, at=at)
        w.run("push", "-m", "after the crash", cwd=w.a)
        assert snapshot(w.a) == expected, "the pushing folder changed"
        api_pull(w.b)
        api_clone(f"dir:{w.backends[1]}", w.c)
        assert snapshot(w.b) == expected, "the pulling clone differs"
        assert snapshot(w.c) == expected, "a fresh clone differs"
        api_check(w.a)

    sweep(points, one)


def conflict_copies(snap: Snapshot, name: str) -> list[str]:
    """Paths of ``NAME (conflict DEVICE YYYY-MM-DD HHMMSS).EXT`` copies of top-level ``name``."""
    stem, _, ext = name.rpartition(".")
    pattern = re.compile(rf"{re.escape(stem)} \(conflict [A-Za-z0-9_-]+( \d+)? "
                         rf"\d{{4}}-\d{{2}}-\d{{2}} \d{{6}}\)\.{re.escape(ext)}")
    return sorted(p for p in snap if pattern.fullmatch(p))


def file_entry(text: str, executable: bool = False) -> tuple[str, ...]:
    """A snapshot entry for a file holding ``text``."""
    return ("file", hashlib.blake2b(text.encode()).hexdigest(), str(executable))


def test_push_merge_crash_sweep(world: World) -> None:
    """A push that must merge with a master another client moved (a non-conflicting
    change and a conflicting edit of ``shared.txt``), killed at any crash point --
    including after the merge commit is sealed and in the middle of the checkout
    that brings the merge into the folder -- is finished by what the user runs next
    (``push`` again, or ``pull`` then ``push``; alternately over the points):
    afterwards both versions of ``shared.txt`` exist (the other client's, decided
    first, under the name; ours as a conflict copy), every other change of both
    sides is there, and the pushing folder, the other client after a pull and a
    fresh clone are identical; ``fsck`` passes and ``status`` is clean. Sampled:
    every point name, first/middle/last arrival of each. No folder is removed here:
    ``pull`` brings back folders removed and not yet committed (see
    test_pull_keeps_uncommitted_folder_removal), which the recovery by ``pull``
    would otherwise show at the points before the commit is recorded."""
    w = world
    make_tree(w.a, small_files=60)
    write(w.a / "shared.txt", "base\n")
    w.init_and_clone()
    base = snapshot(w.b)
    write(w.b / "shared.txt", "edited in b\n")
    write(w.b / "small" / "d05" / "f00005.txt", "edited in b\n")
    write(w.b / "b-only" / "new.txt", "added in b\n")
    (w.b / "small" / "d06" / "f00006.txt").unlink()
    w.run("push", "-m", "b", cwd=w.b)
    theirs = snapshot(w.b)
    local_changes(w.a, remove_folder=False)
    write(w.a / "shared.txt", "edited in a\n")
    ours = snapshot(w.a)
    expected = dict(ours)
    for path in set(base) | set(theirs):
        if base.get(path) != theirs.get(path):
            if path in theirs:
                expected[path] = theirs[path]
            else:
                expected.pop(path, None)
    w.save()
    points = w.arrivals("push", "-m", "changes", cwd=w.a)
    names = {name for name, _ in points}
    assert names >= {"merge:sealed", "checkout:planned", "checkout:rename", "checkout:done"}, names

    chosen = sample(points)

    def one(at: tuple[str, int]) -> None:
        w.restore()
        w.crash("push", "-m", "changes", cwd=w.a, at=at)
        if chosen.index(at) % 2:
            w.run("pull", cwd=w.a)
        w.run("push", "-m", "after the crash", cwd=w.a)
        api_pull(w.b)
        api_clone(f"dir:{w.backends[2]}", w.c)
        got = snapshot(w.a)
        copies = conflict_copies(got, "shared.txt")
        assert len(copies) == 1, f"conflict copies of shared.txt: {copies}"
        assert got[copies[0]] == ours["shared.txt"], "our version of shared.txt is lost"
        assert got["shared.txt"] == theirs["shared.txt"], "their version of shared.txt is lost"
        rest = {p: e for p, e in got.items() if p != copies[0]}
        assert rest == expected, (
            f"missing or wrong: {sorted(p for p in expected if rest.get(p) != expected[p])}; "
            f"unexpected: {sorted(set(rest) - set(expected))}")
        assert snapshot(w.b) == got, "the other client differs after its pull"
        assert snapshot(w.c) == got, "a fresh clone differs"
        api_check(w.a)

    sweep(chosen, one)


def test_pull_crash_sweep(world: World) -> None:
    """A pull of a large change (hundreds of new files, deletions, a removed folder,
    a moved folder and a renamed file) killed at any point -- while learning the
    version, after the checkout was planned (conflict copies already made), between
    the renames that put downloaded files in place, before the checkout is marked
    done -- is completed by the next ``pull`` or ``push`` (alternately over the
    points; the user runs ``status`` first to look): the folder is the pushed
    tree, no temporary file is left, an uncommitted edit of a file the remote did
    not change survives, and an uncommitted edit of a file the remote changed is
    kept as exactly one conflict copy. After ``pull``, ``status`` shows exactly
    those two local changes; after ``push`` they are master, the folder is clean
    and fsck passes, and the other client pulls the same tree. Sampled: every
    point name, first/middle/last arrival of each."""
    w = world
    make_tree(w.a, small_files=100)
    write(w.a / "shared.txt", "base\n")
    write(w.a / "local-only.txt", "base\n")
    w.init_and_clone()
    rng = random.Random(5)
    for i in range(400):
        write(w.a / "bulk" / f"d{i % 20:02d}" / f"n{i:04d}.txt", rng.randbytes(rng.choice([0, 40, 900])))
    for i in range(0, 100, 7):
        (w.a / "small" / f"d{i % 37:02d}" / f"f{i:05d}.txt").unlink(missing_ok=True)
    shutil.rmtree(w.a / "empty-dir")
    (w.a / "moved").mkdir()
    (w.a / "small" / "d10").rename(w.a / "moved" / "d10")
    (w.a / "small" / "d11" / "f00011.txt").rename(w.a / "small" / "d11" / "renamed.txt")
    write(w.a / "shared.txt", "edited in a\n")
    w.run("push", "-m", "big change", cwd=w.a)
    pushed = snapshot(w.a)
    write(w.b / "local-only.txt", "uncommitted edit in b\n")
    write(w.b / "shared.txt", "conflicting uncommitted edit in b\n")
    expected = dict(pushed)
    expected["local-only.txt"] = file_entry("uncommitted edit in b\n")
    w.save()
    points = w.arrivals("pull", cwd=w.b)
    assert sum(name == "checkout:rename" for name, _ in points) >= 400

    chosen = sample(points)

    def one(at: tuple[str, int]) -> None:
        w.restore()
        w.crash("pull", cwd=w.b, at=at)
        api_status(w.b)  # the user looks first: that must work (and change nothing)
        pushed_after = chosen.index(at) % 2 == 1
        w.run("push" if pushed_after else "pull", cwd=w.b)
        got = snapshot(w.b)
        assert not temps(w.b), f"temporary files left: {temps(w.b)}"
        copies = conflict_copies(got, "shared.txt")
        assert len(copies) == 1, f"conflict copies of shared.txt: {copies}"
        assert got[copies[0]] == file_entry("conflicting uncommitted edit in b\n")
        rest = {p: e for p, e in got.items() if p != copies[0]}
        assert rest == expected, (
            f"missing or wrong: {sorted(p for p in expected if rest.get(p) != expected[p])}; "
            f"unexpected: {sorted(set(rest) - set(expected))}")
        if pushed_after:  # the local edit and the conflict copy are now master
            api_check(w.b)
            api_pull(w.a)
            assert snapshot(w.a) == got, "the pushing client differs after its pull"
        else:
            st = api_status(w.b)
            changes = sorted((c.path, c.kind) for c in st.changes)
            assert changes == sorted([("local-only.txt", "modified"), (copies[0], "added")]), st
            assert not st.unpushed, st

    sweep(chosen, one)


def backend_files(w: World) -> set[str]:
    """Every file on the three backends, by its path below ``live``."""
    return {str(f.relative_to(w.live)) for d in w.backends for f in d.rglob("*") if f.is_file()}


def test_gc_crash_sweep(world: World) -> None:
    """A gc killed at any point -- with its commit, indexes and configuration stored
    but not proposed, between consensus round trips, once decided and before it
    deleted anything, between deletions, while it compacts the logs -- is finished
    by the next ``gc``: every object copy a gc that ran through deleted is gone, and
    nothing still needed is: fsck passes and status is clean in the collecting
    folder, the other client pulls the same tree, a fresh clone is identical, and
    that client's next push reaches the first. Sampled: every point name,
    first/middle/last arrival of each."""
    w = world
    make_tree(w.a, small_files=30)
    w.init_and_clone()
    rng = random.Random(3)
    for i in range(3):  # versions whose content only they hold: garbage at retention 0
        write(w.a / f"old{i}.bin", rng.randbytes(200_000))
        w.run("push", "-m", f"old {i}", cwd=w.a)
    # Marks the logs up to here as decided: the gc below also compacts them.
    w.run("gc", "--log-grace", "0", cwd=w.a)
    for i in range(3):
        (w.a / f"old{i}.bin").unlink()
    local_changes(w.a)
    w.run("push", "-m", "changes", cwd=w.a)
    w.run("config", "retention", "0", cwd=w.a)
    expected = snapshot(w.a)
    w.save()
    before = backend_files(w)
    w.run("gc", "--log-grace", "0", cwd=w.a)
    collected = before - backend_files(w)  # what a gc that ran through deletes
    assert sum("objects" in Path(f).parts for f in collected) >= 6, "too little garbage"
    points = w.arrivals("gc", "--log-grace", "0", cwd=w.a)
    assert {name for name, _ in points} >= {"gc:stored", "gc:decided", "gc:delete",
                                             "gc:compacted", "paxos:batch"}

    def one(at: tuple[str, int]) -> None:
        w.restore()
        w.crash("gc", "--log-grace", "0", cwd=w.a, at=at)
        w.run("gc", "--log-grace", "0", cwd=w.a)
        left = sorted(collected & backend_files(w))
        assert not left, f"garbage the next gc left behind: {left[:5]} ({len(left)})"
        assert snapshot(w.a) == expected, "the collecting folder changed"
        api_check(w.a)
        api_pull(w.b)
        assert snapshot(w.b) == expected, "the other client differs"
        api_clone(f"dir:{w.backends[2]}", w.c)
        assert snapshot(w.c) == expected, "a fresh clone differs"
        write(w.b / "after-gc.txt", "pushed after the gc\n")
        w.run("push", "-m", "after the gc", cwd=w.b)
        api_pull(w.a)
        assert snapshot(w.a) == snapshot(w.b), "a push after the gc did not reach the other"

    sweep(sample(points), one)


def _fill(fd: int) -> None:
    """Fill the pipe behind the non-blocking ``fd`` until it takes no byte more."""
    for size in (65536, 4096, 512, 64, 8, 1):
        while True:
            try:
                os.write(fd, b"\0" * size)
            except BlockingIOError:
                break


def test_sigkill_during_push_of_many_files(world: World) -> None:
    """A real ``SIGKILL`` (not a crash point's ``os._exit``) of the first push of
    3,000 small files and two 12 MB files (two packs), while it uploads: the next
    ``push`` completes, a fresh clone is identical, ``fsck`` passes and ``status``
    is clean.

    The crash trace is a FIFO this test reads (``select``, no sleeping). Once it
    shows the first finished ``upload``, the test fills the pipe and kills the
    process at once: the kill lands wherever the push is at that moment (the
    other pack uploading or done but not yet recorded, ...) and, the pipe being
    full, at the latest at the next crash point, so the push cannot finish first."""
    w = world
    make_tree(w.a, small_files=3000)
    rng = random.Random(3)
    for name in ("one.bin", "two.bin"):
        write(w.a / "large" / name, rng.randbytes(12 * 1024 * 1024))
    w.init()
    expected = snapshot(w.a)
    fifo = w.live.parent / "trace-fifo"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    holder = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)  # no EOF between the writer's opens
    env = dict(w.env, METASYNC_CRASH_AT="never-reached", METASYNC_CRASH_TRACE=str(fifo))
    log = w.live.parent / "push.log"
    with open(log, "wb") as out:  # a file: a full output pipe must not stall the push
        proc = subprocess.Popen([METASYNC, "push", "-m", "first"], cwd=w.a, env=env,
                                stdin=subprocess.DEVNULL, stdout=out, stderr=out)
    try:
        seen = b""
        for _ in range(HANG_LIMIT):
            ready, _, _ = select.select([reader], [], [], 1.0)
            if ready:
                seen += os.read(reader, 65536)
            if b"upload\n" in seen or proc.poll() is not None:
                break
        assert b"upload\n" in seen, f"push never reached an upload; trace: {seen!r}, exit {proc.poll()}"
        _fill(holder)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=HANG_LIMIT)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(reader)
        os.close(holder)
    assert proc.returncode == -signal.SIGKILL, (proc.returncode, log.read_text())
    w.run("push", "-m", "after the kill", cwd=w.a)
    assert snapshot(w.a) == expected
    w.run("clone", f"dir:{w.backends[1]}", str(w.c), cwd=w.live)
    assert snapshot(w.c) == expected
    w.check_cli(w.a)
    w.check_cli(w.c)


def test_crash_at_accepts_point_names(world: World) -> None:
    """``METASYNC_CRASH_AT=push:learned`` and ``push:learned:1`` crash a push at its
    first ``push:learned``, as faults.py documents (NAME or NAME:N)."""
    w = world
    write(w.a / "x.txt", "x\n")
    w.init()
    for spec in ("push:learned", "push:learned:1"):
        proc = subprocess.run([METASYNC, "push"], cwd=w.a, capture_output=True, text=True,
                                  env=dict(w.env, METASYNC_CRASH_AT=spec), stdin=subprocess.DEVNULL,
                                  timeout=HANG_LIMIT)
        assert proc.returncode == CRASH_STATUS, (spec, proc.returncode, proc.stderr)


def test_interrupted_commit_leaks_nothing_in_outbox(world: World) -> None:
    """A push that dies after writing its objects to the outbox but before recording
    them (``commit:stored``) leaves nothing behind once the next push succeeds:
    the outbox holds only what is queued, and after a push nothing is queued."""
    w = world
    make_tree(w.a, small_files=30)
    write(w.a / "big.bin", random.Random(2).randbytes(5 * 1024 * 1024))
    w.init()
    w.crash("push", cwd=w.a, at=("commit:stored", 1))
    w.run("push", cwd=w.a)
    outbox = w.a / ".metasync" / "outbox"
    left = {p.name: p.stat().st_size for p in outbox.iterdir()}
    assert not left, f"{len(left)} unrecorded files, {sum(left.values())} bytes left in {outbox}"


def test_status_after_interrupted_pull_shows_only_local_changes(world: World) -> None:
    """After a pull dies with its checkout planned but not applied, ``status`` shows
    the user's own uncommitted changes, not the remote changes still to apply."""
    w = world
    write(w.a / "keep.txt", "base\n")
    write(w.a / "local-only.txt", "base\n")
    w.init_and_clone()
    for i in range(5):
        write(w.a / "remote" / f"n{i}.txt", f"remote {i}\n")
    w.run("push", cwd=w.a)
    write(w.b / "local-only.txt", "uncommitted edit in b\n")
    w.crash("pull", cwd=w.b, at=("checkout:planned", 1))
    st = w.status(w.b)
    changes = sorted((c["path"], c["change"]) for c in st["changes"])
    assert changes == [("local-only.txt", "modified")], changes


def test_pull_keeps_uncommitted_folder_removal(world: World) -> None:
    """A folder removed locally (not committed yet) stays removed when a pull brings
    an unrelated remote change -- as a removed file does. (Not a crash: found as
    the recovery by ``pull`` of a push that died before recording its commit.)"""
    w = world
    write(w.a / "keep.txt", "keep\n")
    write(w.a / "full" / "x.txt", "x\n")
    (w.a / "empty" / "nested").mkdir(parents=True)
    w.init_and_clone()
    shutil.rmtree(w.a / "full")
    (w.a / "empty" / "nested").rmdir()
    write(w.b / "new.txt", "new in b\n")
    w.run("push", cwd=w.b)
    w.run("pull", cwd=w.a)
    got = snapshot(w.a)
    assert "new.txt" in got
    assert "full/x.txt" not in got, "a removed file came back"
    back = sorted(p for p in ("full", "empty/nested") if p in got)
    assert not back, f"removed folders came back: {back}"
