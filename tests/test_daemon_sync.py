"""The daemon end to end: real ``metasync daemon`` processes on real clones.

Every test runs the daemon in the foreground as a separate process
(``metasync daemon --settle 0.5 --poll 0.5 --rescan 5``) in each clone of one
repository on three ``dir:`` backends, changes files with plain Python file
APIs -- as a user or an application would -- and waits (polling, with a
deadline) for the clones to converge. Daemons are stopped with SIGTERM and must
exit 0.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from conftest import METASYNC, PASSPHRASE, run_cli, snapshot, wait_until
from metasync.consensus import Consensus
from metasync.repository import Repository

DAEMON_ARGS = ("daemon", "--settle", "0.5", "--poll", "0.5", "--rescan", "5")
TEMP_PREFIX = ".metasync-tmp-"
SMALL_FOLDER_FILES = 6
CONFLICT_RE = r"{stem} \(conflict .+ \d{{4}}-\d\d-\d\d \d{{6}}\){ext}"


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("METASYNC_")}
    env["METASYNC_PASSPHRASE"] = PASSPHRASE
    env.update(extra)
    return env




def _daemon_log(root: Path) -> str:
    try:
        return (root / ".metasync" / "daemon.log").read_text()[-3000:]
    except OSError:
        return "(no daemon.log)"


def _status(root: Path) -> dict[str, object]:
    try:
        doc: dict[str, object] = json.loads((root / ".metasync" / "daemon.json").read_text())
    except (OSError, ValueError):
        return {}
    return doc


@dataclass
class Daemon:
    root: Path
    proc: subprocess.Popen[bytes]
    out: Path

    def output(self) -> str:
        return self.out.read_text(errors="replace")[-3000:]


@dataclass
class Daemons:
    """Starts daemons; the fixture's finalizer stops the ones still running."""

    tmp: Path
    running: list[Daemon] = field(default_factory=list)

    def start(self, root: Path, *args: str, **env: str) -> Daemon:
        out = self.tmp / f"daemon-{root.name}-{len(self.running)}-{time.monotonic_ns()}.out"
        with open(out, "wb") as fh:
            proc = subprocess.Popen([METASYNC, *DAEMON_ARGS, *args], cwd=root, env=_env(**env),
                                    stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        d = Daemon(root, proc, out)
        self.running.append(d)
        wait_until(lambda: proc.poll() is not None or _status(root).get("pid") == proc.pid, 15,
                   f"daemon in {root} started", lambda: d.output())
        assert proc.poll() is None, f"daemon in {root} exited at once:\n{d.output()}"
        return d

    def stop(self, d: Daemon) -> None:
        """SIGTERM: the daemon finishes its step and exits 0."""
        self.running.remove(d)
        if d.proc.poll() is None:
            d.proc.send_signal(signal.SIGTERM)
        try:
            rc = d.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            d.proc.kill()
            d.proc.wait()
            pytest.fail(f"daemon in {d.root} did not stop within 60 s of SIGTERM")
        assert rc == 0, f"daemon in {d.root} exited {rc}:\n{d.output()}\n{_daemon_log(d.root)}"

    def kill9(self, d: Daemon) -> None:
        self.running.remove(d)
        d.proc.send_signal(signal.SIGKILL)
        assert d.proc.wait(timeout=30) == -signal.SIGKILL


@pytest.fixture
def daemons(tmp_path: Path) -> Iterator[Daemons]:
    ds = Daemons(tmp_path)
    yield ds
    errors = []
    for d in list(ds.running):
        try:
            ds.stop(d)
        except BaseException as exc:  # stop the others too, then report
            errors.append(str(exc))
    assert not errors, errors


def _setup(tmp_path: Path, seed: Callable[[Path], None] | None = None) -> tuple[Path, Path]:
    """Clone A (init'ed on 3 dir: backends, seeded, pushed) and clone B of it."""
    backends = [tmp_path / f"backend{i}" for i in range(3)]
    for b in backends:
        b.mkdir()
    a, b = tmp_path / "A", tmp_path / "B"
    a.mkdir()
    (a / "hello.txt").write_text("hello\n")
    if seed:
        seed(a)
    run_cli("init", str(a), *(f"--backend=dir:{x}" for x in backends))
    run_cli("push", "-m", "start", cwd=a)
    run_cli("clone", f"dir:{backends[1]}", str(b))
    assert snapshot(a) == snapshot(b)
    return a, b


def _identical(a: Path, b: Path) -> bool:
    return snapshot(a) == snapshot(b)


def _diff(a: Path, b: Path) -> Callable[[], str]:
    def show() -> str:
        sa, sb = snapshot(a), snapshot(b)
        only_a = sorted(set(sa) - set(sb))[:10]
        only_b = sorted(set(sb) - set(sa))[:10]
        differ = sorted(p for p in set(sa) & set(sb) if sa[p] != sb[p])[:10]
        return (f"only in A: {only_a}\nonly in B: {only_b}\ndiffer: {differ}\n"
                f"A status: {_status(a)}\nB status: {_status(b)}\n"
                f"A log:\n{_daemon_log(a)}\nB log:\n{_daemon_log(b)}")
    return show


def _both_idle_at_same_version(a: Path, b: Path) -> bool:
    sa, sb = _status(a), _status(b)
    return (sa.get("state") == sb.get("state") == "idle"
            and sa.get("version") == sb.get("version") and _identical(a, b))


# ============================================================== 1: random ops
@dataclass
class Op:
    """One user operation: what it touched, and what it implies if nothing else
    touched the same paths (``None`` content: the path must be absent;
    ``"<dir>"``: a folder)."""

    side: str
    desc: str
    paths: set[str] = field(default_factory=set)
    prefixes: set[str] = field(default_factory=set)  # folders renamed or deleted
    claims: dict[str, str | None] = field(default_factory=dict)


def _listing(root: Path) -> tuple[list[str], list[str]]:
    files, dirs = [], []
    for dirpath, dirnames, filenames in os.walk(root):
        rel = os.path.relpath(dirpath, root)
        dirnames[:] = sorted(d for d in dirnames if not (rel == "." and d == ".metasync")
                             and not d.startswith(TEMP_PREFIX))
        for d in dirnames:
            dirs.append(os.path.normpath(os.path.join(rel, d)))
        for f in sorted(filenames):
            if not f.startswith(TEMP_PREFIX):
                files.append(os.path.normpath(os.path.join(rel, f)))
    return files, dirs


def _under(root: Path, folder: str) -> tuple[list[str], list[str]]:
    files, dirs = _listing(root / folder)
    return [f"{folder}/{f}" for f in files], [f"{folder}/{d}" for d in dirs]


def _random_op(rng: random.Random, op: Op, root: Path, n: int) -> None:
    """Do one random operation on ``root``, recording it in ``op`` (paths before
    acting, so a failed operation still counts as touching them)."""
    side = op.side
    files, dirs = _listing(root)
    kind = rng.choice(["create", "create", "create", "modify", "modify", "delete",
                       "rename", "mkdir", "rename_dir", "delete_dir"])
    if kind in ("modify", "delete", "rename") and not files:
        kind = "create"
    # A folder operation shadows every claim under it (a merge decides them), so it
    # only targets folders holding a few files: a whole seeded folder renamed while
    # the other side is behind would leave almost nothing for the test to check.
    small_dirs = [d for d in dirs if len(_under(root, d)[0]) <= SMALL_FOLDER_FILES]
    if kind in ("rename_dir", "delete_dir") and not small_dirs:
        kind = "mkdir"
    op.desc = f"{side}: {kind}"
    if kind == "create":
        folder = rng.choice(["", *dirs])
        path = f"{folder}/new{n:02d}{side}.txt" if folder else f"new{n:02d}{side}.txt"
        content = f"created by op {n} on {side}\n" * rng.randint(1, 300)
        op.paths.add(path)
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(content)
        op.claims[path] = content
    elif kind == "modify":
        path = rng.choice(files)
        content = f"modified by op {n} on {side}\n" * rng.randint(1, 300)
        op.paths.add(path)
        (root / path).write_text(content)
        op.claims[path] = content
    elif kind == "delete":
        path = rng.choice(files)
        op.paths.add(path)
        (root / path).unlink()
        op.claims[path] = None
    elif kind == "rename":
        path = rng.choice(files)
        target = str(Path(path).with_name(f"ren{n:02d}{side}-{Path(path).name}"))
        op.paths |= {path, target}
        content = (root / path).read_text()
        os.rename(root / path, root / target)
        op.claims.update({path: None, target: content})
    elif kind == "mkdir":
        parent = rng.choice(["", *dirs])
        path = f"{parent}/dir{n:02d}{side}" if parent else f"dir{n:02d}{side}"
        op.paths.add(path)
        (root / path).mkdir(parents=True)
        op.claims[path] = "<dir>"
    elif kind == "rename_dir":
        folder = rng.choice(small_dirs)
        target = str(Path(folder).with_name(f"rd{n:02d}{side}-{Path(folder).name}"))
        inner_files, inner_dirs = _under(root, folder)
        contents = {f: (root / f).read_text() for f in inner_files}
        op.prefixes |= {folder, target}
        os.rename(root / folder, root / target)
        # What was there is gone from the old place and now lives under the new one.
        for f, text in contents.items():
            op.claims[f] = None
            op.claims[target + f[len(folder):]] = text
        for d in inner_dirs:
            op.claims[d] = None
        op.claims[folder] = None
    else:  # delete_dir
        folder = rng.choice(small_dirs)
        inner_files, inner_dirs = _under(root, folder)
        op.prefixes.add(folder)
        shutil.rmtree(root / folder)
        for p in [*inner_files, *inner_dirs, folder]:
            op.claims[p] = None
    op.desc = f"{side}: {kind} {sorted(op.paths | op.prefixes)}"


def _seed_tree(root: Path) -> None:
    rng = random.Random(5)
    for d in ("docs", "docs/old", "photos", "src", "src/lib"):
        (root / d).mkdir(parents=True)
    for i in range(60):
        folder = rng.choice(["", "docs", "docs/old", "photos", "src", "src/lib"])
        path = root / folder / f"seed{i:02d}.txt"
        path.write_text(f"seed file {i}\n" * rng.randint(1, 200))
    # Small seeded folders, for the folder operations (see SMALL_FOLDER_FILES).
    (root / "misc").mkdir()
    for i in range(4):
        (root / "photos" / "trip").mkdir(exist_ok=True)
        (root / "photos" / "trip" / f"trip{i}.txt").write_text(f"trip photo {i}\n" * 50)


def _affects(op: Op, path: str) -> bool:
    """Did ``op`` touch ``path``, something inside it (a folder survives while
    anything merged lives in it), or a folder above it?"""
    if any(p == path or p.startswith(path + "/") for p in (*op.paths, *op.claims, *op.prefixes)):
        return True
    return any(path.startswith(p + "/") for p in op.prefixes)


def test_two_daemons_converge_after_random_operations_on_both_sides(
    tmp_path: Path, daemons: Daemons
) -> None:
    """50 seeded-random operations (create/modify/delete/rename files, create/
    rename/delete folders), interleaved on two clones while both daemons run:
    within 15 s of the last one both trees are identical, and every change no
    other operation touched (same path, or a folder above it renamed/deleted) is
    there: files created, modified or renamed-to hold their content on both
    sides, folders made exist, and what was deleted or renamed away is gone."""
    a, b = _setup(tmp_path, _seed_tree)
    sides = {"A": a, "B": b}
    # Deleted folders and files add up to a large share: no deletion guard here.
    daemons.start(a, "--delete-share", "1")
    daemons.start(b, "--delete-share", "1")
    wait_until(lambda: _both_idle_at_same_version(a, b), 15, "both daemons idle at first")

    rng = random.Random(20240611)
    pace = threading.Event()
    ops: list[Op] = []
    for n in range(50):
        op = Op(rng.choice("AB"), "")
        ops.append(op)
        try:
            _random_op(rng, op, sides[op.side], n)
        except OSError as exc:  # the daemon changed the folder under this op
            op.desc = f"failed: {op.desc} {sorted(op.paths | op.prefixes)}: {exc}"
            op.claims.clear()
        # Mostly a few ms apart; now and then a pause long enough for a sync.
        pace.wait(0.8 if n % 12 == 11 else rng.uniform(0.005, 0.05))
    failed = [o.desc for o in ops if o.desc.startswith("failed")]
    assert len(failed) <= 3, failed

    wait_until(lambda: _identical(a, b), 15, "A and B identical after the last operation",
               _diff(a, b))
    tree = snapshot(a)
    checked = 0
    problems = []
    for i, op in enumerate(ops):
        for path, want in op.claims.items():
            if any(_affects(other, path) for j, other in enumerate(ops) if j != i):
                continue  # another operation touched it: a merge decides
            checked += 1
            got = tree.get(path)
            if want is None:
                if got is not None:
                    problems.append(f"{op.desc}: {path} should be gone, is {got}")
            elif want == "<dir>":
                if got != ("dir",):
                    problems.append(f"{op.desc}: folder {path} missing ({got})")
            elif got is None or (a / path).read_text() != want:
                problems.append(f"{op.desc}: {path} lacks its content ({got})")
    assert not problems, "\n".join(problems[:20])
    assert checked >= 15, (checked, [o.desc for o in ops])
    # Every file created and never touched again is on both sides with its content.
    for i, op in enumerate(ops):
        if op.desc.startswith(f"{op.side}: create "):
            (path, text), = op.claims.items()
            if not any(_affects(other, path) for j, other in enumerate(ops) if j != i):
                assert (a / path).read_text() == (b / path).read_text() == text, path


# ============================================================== 2: conflicts
def test_simultaneous_edits_keep_both_versions(tmp_path: Path, daemons: Daemons) -> None:
    """The same file edited on both clones at the same moment while both daemons
    run: both versions are kept -- one under the name, the other as
    `doc (conflict DEVICE YYYY-MM-DD HHMMSS).txt` -- and the trees converge
    identical, byte for byte."""
    a, b = _setup(tmp_path, lambda root: (root / "doc.txt").write_text("base\n"))
    daemons.start(a)
    daemons.start(b)
    wait_until(lambda: _both_idle_at_same_version(a, b), 15, "both daemons idle at first")
    texts = {"A": "edited on A\n" * 1000, "B": "edited on B\n" * 1000}
    (a / "doc.txt").write_text(texts["A"])
    (b / "doc.txt").write_text(texts["B"])

    def converged() -> bool:
        return _identical(a, b) and len([p for p in a.iterdir() if p.name.startswith("doc")]) == 2

    wait_until(converged, 15, "both versions on both sides", _diff(a, b))
    docs = sorted(p.name for p in a.iterdir() if p.name.startswith("doc"))
    assert "doc.txt" in docs, docs
    copy = next(d for d in docs if d != "doc.txt")
    assert re.fullmatch(CONFLICT_RE.format(stem="doc", ext=r"\.txt"), copy), copy
    assert {(a / d).read_text() for d in docs} == set(texts.values())
    assert {p.name for p in b.iterdir() if p.name.startswith("doc")} == set(docs)


# ============================================================== 3: slow writer
BIG = 200 * 1024 * 1024
CHUNK = 2 * 1024 * 1024


def _big_content() -> Iterator[bytes]:
    """200 MB, incompressible-ish but cheap: one random MB, each copy numbered."""
    block = random.Random(3).randbytes(1024 * 1024)
    for i in range(BIG // CHUNK):
        yield b"".join((2 * i + k).to_bytes(8, "big") + block[8:] for k in range(2))


def _file_digest(path: Path) -> str:
    h = hashlib.blake2b()
    with open(path, "rb") as fh:
        while data := fh.read(4 * 1024 * 1024):
            h.update(data)
    return h.hexdigest()


def test_slowly_written_big_file_never_syncs_partially(
    tmp_path: Path, daemons: Daemons, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 200 MB file written slowly on A (2 MB every ~0.1 s, ~10 s in all) while
    both daemons run: B never has a partial file -- whenever B's path exists it has
    the full size and the final hash -- and in the end has it whole; no commit in
    history (every commit of `log --json` and every merge parent) records any size
    for it but the full one, and a fresh clone gets the whole file."""
    final = hashlib.blake2b()
    for chunk in _big_content():
        final.update(chunk)
    want = final.hexdigest()
    a, b = _setup(tmp_path)
    da, db = daemons.start(a), daemons.start(b)
    wait_until(lambda: _both_idle_at_same_version(a, b), 15, "both daemons idle at first")

    done = threading.Event()
    errors: list[BaseException] = []

    def writer() -> None:
        try:
            pause = threading.Event()
            with open(a / "big.bin", "wb") as fh:
                for chunk in _big_content():
                    fh.write(chunk)
                    fh.flush()
                    pause.wait(0.1)
        except BaseException as exc:  # reported by the test thread
            errors.append(exc)
        finally:
            done.set()

    seen: list[tuple[int, int, int]] = []  # (size, inode, mtime) B's path had
    bad: list[str] = []
    hashed: dict[tuple[int, int], str] = {}

    def check_b() -> bool:
        """One look at B's path; True once the writer is done and B has it whole."""
        try:
            st = os.stat(b / "big.bin")
        except FileNotFoundError:
            return False
        seen.append((st.st_size, st.st_ino, st.st_mtime_ns))
        if st.st_size != BIG:
            bad.append(f"B had big.bin with {st.st_size} bytes")
            return False
        key = (st.st_ino, st.st_mtime_ns)
        if key not in hashed:
            hashed[key] = _file_digest(b / "big.bin")
            if hashed[key] != want:
                bad.append(f"B had big.bin ({BIG} bytes) with the wrong content")
        return done.is_set() and hashed[key] == want

    thread = threading.Thread(target=writer)
    thread.start()
    tick = threading.Event()
    deadline = None
    try:
        # B is looked at every 50 ms while the write runs and until B has the file.
        while not check_b():
            if done.is_set() and deadline is None:
                deadline = time.monotonic() + 60
            if deadline is not None and time.monotonic() > deadline:
                pytest.fail(f"B lacks the whole big file 60 s after the write\n{_diff(a, b)()}")
            tick.wait(0.05)
    finally:
        done.wait(60)
        thread.join()
    assert not errors, errors
    assert _file_digest(a / "big.bin") == want
    assert not bad, bad[:5]
    assert seen and seen[-1][0] == BIG
    wait_until(lambda: _identical(a, b), 15, "A and B identical", _diff(a, b))

    daemons.stop(da)
    daemons.stop(db)
    log = json.loads(run_cli("log", "--json", cwd=a).stdout)
    monkeypatch.setenv("METASYNC_PASSPHRASE", PASSPHRASE)
    from metasync import Repository

    sizes: dict[str, int | None] = {}
    with Repository.open(a) as repo:
        todo = [str(e["commit"]) for e in log]
        while todo:
            cid = todo.pop()
            if cid in sizes:
                continue
            entry = repo.tree_at(cid).get("big.bin")
            sizes[cid] = None if entry is None else entry.size
            todo += repo.load_commit(cid).parents
    assert {s for s in sizes.values() if s is not None} == {BIG}, sizes
    fresh = tmp_path / "fresh"
    run_cli("clone", f"dir:{tmp_path / 'backend2'}", str(fresh))
    assert _file_digest(fresh / "big.bin") == want
    assert snapshot(fresh) == snapshot(a)


# ============================================================== 4: kill -9
class TraceReader:
    """Reads crash-point names from a FIFO the daemon writes (METASYNC_CRASH_TRACE)
    one open/write/close per point. It stops reading after ``stop_at``: the daemon
    then blocks opening the FIFO at its next crash point, held right there."""

    def __init__(self, fifo: Path, stop_at: str) -> None:
        self.fifo, self.stop_at = fifo, stop_at
        self.names: list[str] = []
        self.reached = threading.Event()
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        while True:
            with open(self.fifo) as fh:  # blocks until the daemon opens it to write
                self.names += fh.read().split()
            if self.stop_at in self.names:
                self.reached.set()
                return

    def close(self) -> None:
        """Unblock a reader still waiting for a writer."""
        try:
            fd = os.open(self.fifo, os.O_WRONLY | os.O_NONBLOCK)
        except OSError:  # no reader waits
            return
        os.close(fd)
        self.thread.join(timeout=5)


def test_daemon_killed_mid_upload_and_restarted_syncs_everything(
    tmp_path: Path, daemons: Daemons
) -> None:
    """A's daemon is killed with SIGKILL in the middle of uploading a few thousand
    new small files (held after its first uploaded object, before it proposes the
    version), then started again: B, its daemon running throughout, ends identical
    to A, every file on A is intact, and fsck finds every object on every backend."""
    a, b = _setup(tmp_path)
    fifo = tmp_path / "trace.fifo"
    os.mkfifo(fifo)
    trace = TraceReader(fifo, "upload")
    try:
        db = daemons.start(b)
        da = daemons.start(a, METASYNC_CRASH_AT="never", METASYNC_CRASH_TRACE=str(fifo))
        wait_until(lambda: _both_idle_at_same_version(a, b), 15, "both daemons idle at first")
        rng = random.Random(11)
        expected: dict[str, bytes] = {}
        for i in range(3000):
            rel = f"many/d{i % 50:02d}/f{i:05d}.bin"
            data = rng.randbytes(rng.randint(100, 4000))
            (a / rel).parent.mkdir(parents=True, exist_ok=True)
            (a / rel).write_bytes(data)
            expected[rel] = data
        wait_until(trace.reached.is_set, 60, "A's daemon reached its first upload",
                   lambda: f"trace: {trace.names}\n{_daemon_log(a)}")
        assert _status(a).get("state") == "syncing"
        assert "push:propose" not in trace.names, trace.names
        daemons.kill9(da)
    finally:
        trace.close()
    assert not (b / "many").exists(), "the version was published before the kill"
    da = daemons.start(a)
    wait_until(lambda: _identical(a, b) and all((b / p).is_file() for p in expected), 60,
               "B identical to A after the restart", _diff(a, b))
    for rel, data in expected.items():
        assert (a / rel).read_bytes() == data, rel
        assert (b / rel).read_bytes() == data, rel
    assert (a / "hello.txt").read_text() == "hello\n"
    # Nothing the killed upload left behind is missing or corrupt on any backend.
    daemons.stop(da)
    daemons.stop(db)
    run_cli("fsck", cwd=a)


def test_a_command_waits_for_the_daemons_step_and_succeeds(
        tmp_path: Path, daemons: Daemons) -> None:
    """A CLI command that changes the folder, run while the daemon is in the middle
    of a sync step (it holds the folder), waits for it, saying so in one line, and
    then succeeds -- instead of failing at once with "another metasync command is
    using". (Read-only commands do not wait: tests/test_interrupt.py.)"""
    a, _ = _setup(tmp_path)
    pause = tmp_path / "pause"
    daemons.start(a, METASYNC_PAUSE_AT="daemon:sync", METASYNC_PAUSE_FILE=str(pause))
    (a / "new.txt").write_text("made while the daemon runs\n")
    wait_until(lambda: Path(f"{pause}.reached").exists(), 30, "the daemon reached its sync step")
    proc = subprocess.Popen([METASYNC, "commit"], cwd=a, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
    assert proc.stderr is not None
    note = proc.stderr.readline()  # blocks until the command says it waits
    assert "waiting for the daemon" in note, note
    assert proc.poll() is None, "the command is still waiting while the daemon holds the folder"
    Path(f"{pause}.release").touch()
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert "Committed" in out or "Nothing to commit" in out, out


def test_the_daemon_finishes_a_configuration_change_cut_short(
        tmp_path: Path, daemons: Daemons) -> None:
    """``backend remove`` dies right after its change is decided (the rebalance it
    needs recorded first): the daemon's next cycle moves the copies off the removed
    backend and clears the record, as ``metasync rebalance`` would."""
    a, _ = _setup(tmp_path)
    # Placement follows the repository's random key: one push's three objects miss a
    # given backend one time in 27, so remove one that holds some.
    removed = next(b for b in (tmp_path / f"backend{i}" for i in (2, 0, 1))
                   if any(p.is_file() for p in (b / "metasync" / "objects").rglob("*")))
    real = Consensus.publish

    def publish_then_die(self: Consensus, version: Any) -> None:
        real(self, version)
        raise _Crash()

    Consensus.publish = publish_then_die  # type: ignore[method-assign]
    try:
        with Repository.open(a) as repo, pytest.raises(_Crash):
            repo.remove_backend(f"dir:{removed}")
    finally:
        Consensus.publish = real  # type: ignore[method-assign]
    with Repository.open(a) as repo:
        assert repo.rebalance_pending()
    d = daemons.start(a)
    wait_until(lambda: not any(p.is_file() for p in (removed / "metasync" / "objects").rglob("*")),
               60, "the removed backend emptied by the daemon",
               lambda: _daemon_log(a))
    daemons.stop(d)
    with Repository.open(a) as repo:
        assert not repo.rebalance_pending()
    run_cli("fsck", cwd=a)


class _Crash(BaseException):
    """The process dying at a precise point (no handler of MetasyncError catches it)."""
