"""Garbage collection, snapshots and restore, through the real ``metasync`` command.

gc deletes only what no kept version needs: master, every version younger than
the retention, snapshots, every client's published state, and every push in
progress (which announces its uploads first). The held tests hold a push or a
gc at a pause point (metasync.faults.pause_point) while the other client acts, so
each way the two interleave happens every run; a short smoke test also runs a
pusher and a gc loop in separate processes at once.
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import threading
import time
from pathlib import Path

from conftest import METASYNC, PASSPHRASE, run_cli, snapshot, wait_until

NAMESPACE = "metasync"


def _objects(backends: list[Path]) -> set[str]:
    """The objects stored on ``backends`` (not an upload's temporary file)."""
    return {p.name for b in backends for p in (b / NAMESPACE / "objects").glob("*/*")
            if not p.name.startswith(".tmp-")}


def _stored_bytes(backends: list[Path]) -> int:
    return sum(p.stat().st_size for b in backends for p in (b / NAMESPACE / "objects").glob("*/*"))


def _repo(tmp_path: Path, n: int = 3) -> tuple[Path, list[Path]]:
    backends = [tmp_path / f"b{i}" for i in range(n)]
    for b in backends:
        b.mkdir()
    a = tmp_path / "A"
    a.mkdir()
    run_cli("init", str(a), *(f"--backend=dir:{b}" for b in backends))
    return a, backends


def test_gc_keeps_history_within_retention_and_collects_the_rest(tmp_path: Path) -> None:
    """With the default 30-day retention, gc deletes nothing a recent version needs
    (every old version stays restorable); with retention 0 it collects the content
    only old versions had, and master, log, fsck and a fresh clone are unharmed."""
    a, backends = _repo(tmp_path)
    rng = random.Random(1)
    (a / "keep.txt").write_text("kept all along\n")
    for i in range(4):
        (a / f"big{i}.bin").write_bytes(rng.randbytes(300_000))
        run_cli("push", "-m", f"big {i}", cwd=a)
    for i in range(3):
        (a / f"big{i}.bin").unlink()
    run_cli("push", "-m", "drop three", cwd=a)
    before = _objects(backends)
    out = run_cli("gc", cwd=a).stdout
    assert "nothing to collect" in out
    assert _objects(backends) == before
    run_cli("restore", "big1.bin", cwd=a)  # still restorable
    assert (a / "big1.bin").stat().st_size == 300_000
    (a / "big1.bin").unlink()

    run_cli("config", "retention", "0", cwd=a)
    out = run_cli("gc", cwd=a).stdout
    m = re.search(r"collected (\d+) object copies", out)
    assert m and int(m.group(1)) > 0, out
    assert before - _objects(backends)  # some objects are gone (gc also wrote two)
    assert run_cli("fsck", cwd=a).returncode == 0
    assert len(run_cli("log", cwd=a).stdout.split("commit ")) - 1 >= 5  # history stays
    clone = tmp_path / "clone"
    run_cli("clone", f"dir:{backends[2]}", str(clone))
    assert snapshot(clone) == snapshot(a)
    # The collected version cannot be restored, and says why.
    bad = run_cli("restore", "big1.bin", cwd=a, check=False)
    assert bad.returncode != 0 and "no kept version has a big1.bin" in bad.stderr, bad.stderr


def test_restore_file_deleted_five_versions_ago(tmp_path: Path) -> None:
    """A file deleted and pushed, then five more versions: ``restore`` brings it back
    byte for byte; ``--version ~N`` and ``--to`` pick another version and place; a
    local file in the way whose content is in no version is kept as a conflict copy."""
    a, _ = _repo(tmp_path)
    content = random.Random(5).randbytes(1_500_000)  # several chunks
    (a / "docs").mkdir()
    (a / "docs" / "report.bin").write_bytes(content)
    run_cli("push", "-m", "report", cwd=a)
    (a / "docs" / "report.bin").unlink()
    run_cli("push", "-m", "deleted", cwd=a)
    for i in range(5):
        (a / "notes.txt").write_text(f"version {i}\n")
        run_cli("push", "-m", f"notes {i}", cwd=a)
    out = run_cli("restore", "docs/report.bin", cwd=a).stdout
    assert "restored 1 file(s)" in out
    assert (a / "docs" / "report.bin").read_bytes() == content

    # Another version, somewhere else: ~2 is two versions before master.
    run_cli("restore", "notes.txt", "--version", "~2", "--to", str(tmp_path / "old.txt"), cwd=a)
    assert (tmp_path / "old.txt").read_text() == "version 2\n"
    assert (a / "notes.txt").read_text() == "version 4\n"
    # An uncommitted edit in the way survives as a conflict copy.
    (a / "notes.txt").write_text("edited, never committed\n")
    out = run_cli("restore", "notes.txt", "--version", "~1", cwd=a).stdout
    assert "conflict" in out
    assert (a / "notes.txt").read_text() == "version 3\n"
    copies = [p for p in a.iterdir() if p.name.startswith("notes (conflict")]
    assert len(copies) == 1 and copies[0].read_text() == "edited, never committed\n"


def test_snapshot_keeps_a_version_from_gc(tmp_path: Path) -> None:
    """A snapshot keeps its version's content through gc at retention 0, and restore
    takes it by name; deleting the snapshot lets the next gc collect it."""
    a, backends = _repo(tmp_path)
    (a / "photo.bin").write_bytes(random.Random(2).randbytes(400_000))
    run_cli("push", cwd=a)
    run_cli("snapshot", "before-cleanup", cwd=a)
    assert "before-cleanup" in run_cli("snapshot", cwd=a).stdout
    (a / "photo.bin").unlink()
    run_cli("push", "-m", "cleanup", cwd=a)
    run_cli("config", "retention", "0", cwd=a)
    run_cli("gc", cwd=a)
    run_cli("restore", "photo.bin", "--version", "before-cleanup", cwd=a)
    assert (a / "photo.bin").read_bytes() == random.Random(2).randbytes(400_000)
    (a / "photo.bin").unlink()
    run_cli("push", cwd=a)
    size_before = _stored_bytes(backends)
    run_cli("snapshot", "--delete", "before-cleanup", cwd=a)
    run_cli("gc", cwd=a)
    assert _stored_bytes(backends) < size_before - 400_000  # both copies of the photo went
    assert run_cli("fsck", cwd=a).returncode == 0


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("METASYNC_")}
    env["METASYNC_PASSPHRASE"] = PASSPHRASE
    return env


#: Pushes of the free-running smoke test, at least (each checked by fsck --quick).
ROUNDS = 5


def test_pushes_while_another_client_runs_gc_in_a_loop(tmp_path: Path) -> None:
    """A smoke test of the free-running race (the held tests below make each
    interleaving happen every run): client A edits, adds, deletes and re-creates
    files (so new commits share content with versions gc is collecting) and pushes
    :data:`ROUNDS` times, and on until gc collected twice; after each push, ``fsck
    --quick`` checks master has every object. Client B runs ``gc`` in a loop at
    retention 0 meanwhile. No push fails, no check fails, gc really deletes, and at
    the end fsck (full) is clean and a fresh clone equals A."""
    a, backends = _repo(tmp_path)
    rng = random.Random(9)
    pool = [rng.randbytes(rng.randint(1000, 200_000)) for _ in range(12)]
    for i in range(6):
        (a / f"f{i}.bin").write_bytes(pool[i])
    run_cli("push", cwd=a)
    run_cli("config", "retention", "0", cwd=a)
    b = tmp_path / "B"
    run_cli("clone", f"dir:{backends[1]}", str(b))

    stop = threading.Event()
    gc_outputs: list[str] = []
    gc_failures: list[str] = []

    def gc_loop() -> None:
        while not stop.is_set():
            proc = subprocess.run([METASYNC, "gc"], cwd=b, env=_env(), capture_output=True,
                                  text=True, stdin=subprocess.DEVNULL)
            if proc.returncode != 0 and "another metasync command" not in proc.stderr:
                gc_failures.append(proc.stderr)
            gc_outputs.append(proc.stdout)

    def collected() -> int:
        return sum(1 for o in list(gc_outputs) if o.startswith("collected"))

    runner = threading.Thread(target=gc_loop)
    runner.start()
    pushes = 0
    try:
        while pushes < ROUNDS or collected() < 2:
            assert pushes < 4 * ROUNDS, ("gc never collected", gc_failures[:1], gc_outputs[-3:])
            names = sorted(p.name for p in a.glob("f*.bin"))
            action = rng.choice(["edit", "add", "delete", "recreate"])
            if action == "delete" and len(names) > 2:
                (a / rng.choice(names)).unlink()
            elif action == "recreate":  # content an earlier version had: deduplicated
                (a / f"f{rng.randrange(40)}.bin").write_bytes(rng.choice(pool))
            else:
                (a / f"f{rng.randrange(40)}.bin").write_bytes(rng.randbytes(rng.randint(100, 150_000)))
            run_cli("push", "-m", f"push {pushes}", cwd=a)
            check = run_cli("fsck", "--quick", cwd=a, check=False)
            assert check.returncode == 0, check.stdout + check.stderr
            pushes += 1
    finally:
        stop.set()
        runner.join()
    assert not gc_failures, gc_failures[:3]
    assert collected() >= 2, gc_outputs[-5:]
    assert run_cli("fsck", cwd=a).returncode == 0
    clone = tmp_path / "clone"
    run_cli("clone", f"dir:{backends[2]}", str(clone))
    assert snapshot(clone) == snapshot(a)
    run_cli("pull", cwd=b)
    assert snapshot(b) == snapshot(a)


def _log_instances(backend: Path) -> set[int]:
    return {int(p.name) for p in (backend / NAMESPACE / "log").glob("*") if p.name.isdigit()}


def test_gc_compacts_old_logs_and_clients_behind_them_catch_up(tmp_path: Path) -> None:
    """gc removes the pPaxos logs of versions decided before its previous run's mark
    (grace 0 here); a clone that was far behind still pulls and pushes (it jumps
    over the compacted versions), and a fresh clone and fsck are unharmed."""
    a, backends = _repo(tmp_path)
    (a / "first.txt").write_text("one\n")
    run_cli("push", cwd=a)
    b = tmp_path / "B"
    run_cli("clone", f"dir:{backends[0]}", str(b))
    for i in range(8):
        (a / f"file{i}.txt").write_text(f"version {i}\n")
        run_cli("push", cwd=a)
    first = run_cli("gc", "--log-grace", "0", cwd=a).stdout
    assert "compacted" not in first  # the first gc leaves a mark only
    marked = max(_log_instances(backends[0]))
    (a / "late.txt").write_text("after the mark\n")
    run_cli("push", cwd=a)
    out = run_cli("gc", "--log-grace", "0", cwd=a).stdout
    m = re.search(r"compacted the logs of versions before (\d+) \((\d+) log objects removed\)", out)
    assert m, out
    floor = int(m.group(1))
    assert floor >= marked - 1 and int(m.group(2)) > 0
    for backend in backends:
        assert min(_log_instances(backend)) == floor
    # The default grace (a day) compacts nothing more now.
    assert "compacted" not in run_cli("gc", cwd=a).stdout

    # B learned version 1 or 2 only: behind the floor. It edits, pushes, and both converge.
    (b / "first.txt").write_text("edited on B\n")
    run_cli("push", cwd=b)
    run_cli("pull", cwd=a)
    assert snapshot(a) == snapshot(b)
    assert (a / "first.txt").read_text() == "edited on B\n" and (b / "late.txt").exists()
    assert run_cli("fsck", cwd=a).returncode == 0
    clone = tmp_path / "C"
    run_cli("clone", f"dir:{backends[1]}", str(clone))
    assert snapshot(clone) == snapshot(a)
    assert len(run_cli("log", cwd=clone).stdout.split("commit ")) - 1 >= 11  # history whole


def test_client_behind_compaction_and_a_backend_change_catches_up(tmp_path: Path) -> None:
    """A clone that slept through a backend add and remove *and* a log compaction:
    the floor points it at a version its old acceptors never decided, so it finds
    the newest version from the backends' hints (as a fresh clone does) and pulls."""
    a, backends = _repo(tmp_path)
    (a / "first.txt").write_text("one\n")
    run_cli("push", cwd=a)
    b = tmp_path / "B"
    run_cli("clone", f"dir:{backends[0]}", str(b))
    extra = tmp_path / "b3"
    extra.mkdir()
    run_cli("backend", "add", f"dir:{extra}", cwd=a)
    run_cli("backend", "remove", f"dir:{backends[2]}", cwd=a)
    for i in range(4):
        (a / f"file{i}.txt").write_text(f"version {i}\n")
        run_cli("push", cwd=a)
    run_cli("gc", "--log-grace", "0", cwd=a)
    (a / "late.txt").write_text("after the mark\n")
    run_cli("push", cwd=a)
    out = run_cli("gc", "--log-grace", "0", cwd=a).stdout
    assert "compacted the logs of versions before" in out, out
    run_cli("pull", cwd=b)
    assert snapshot(b) == snapshot(a)
    (b / "first.txt").write_text("edited on B\n")
    run_cli("push", cwd=b)
    run_cli("pull", cwd=a)
    assert snapshot(a) == snapshot(b)
    assert run_cli("fsck", cwd=a).returncode == 0


# ------------------------------------------------------------ interleavings, held still
# Each test holds one process at a pause point (metasync.faults.pause_point) while the
# other client acts, then lets it go on: the concurrent cases of docs/design.md,
# "Garbage collection, and why a push in progress loses nothing", every run.

#: Bound on every wait for a held process (it reaches its point in about a second).
HOLD_LIMIT = 60.0


def _held(args: list[str], cwd: Path, point: str, pause: Path,
          **extra: str) -> subprocess.Popen[str]:
    """``metasync ARGS`` in ``cwd`` (with ``extra`` environment variables), started
    and waited for until it stands at pause point ``point`` (it goes on once
    :func:`_release` is called)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("METASYNC_CRASH", "METASYNC_PASSPHRASE", "METASYNC_PAUSE"))}
    env.update(METASYNC_PASSPHRASE=PASSPHRASE, METASYNC_PAUSE_AT=point,
               METASYNC_PAUSE_FILE=str(pause), **extra)
    proc = subprocess.Popen([METASYNC, *args], cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + HOLD_LIMIT
    while proc.poll() is None and not Path(f"{pause}.reached").exists():
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"metasync {' '.join(args)} never reached {point}")
        time.sleep(0.01)
    if proc.poll() is not None:
        out, err = proc.communicate()
        raise AssertionError(f"metasync {' '.join(args)} ended before {point}:\n{out}{err}")
    return proc


def _release(proc: subprocess.Popen[str], pause: Path) -> tuple[str, str]:
    """Let a held command go on; its stdout and stderr once it ended (it must succeed)."""
    Path(f"{pause}.release").touch()
    try:
        out, err = proc.communicate(timeout=HOLD_LIMIT)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    assert proc.returncode == 0, err
    assert "Traceback" not in err, err
    return out, err


def _collected_content_repo(tmp_path: Path) -> tuple[Path, Path, list[Path], bytes]:
    """A (pushed) and its clone B over three backends, retention 0: ``gone.bin`` was
    added and deleted in two versions, so its content -- returned -- is the garbage a
    gc collects; ``keep.txt`` stays."""
    a, backends = _repo(tmp_path)
    (a / "keep.txt").write_text("kept all along\n")
    run_cli("push", cwd=a)
    gone = random.Random(3).randbytes(300_000)
    (a / "gone.bin").write_bytes(gone)
    run_cli("push", "-m", "gone", cwd=a)
    (a / "gone.bin").unlink()
    run_cli("push", "-m", "deleted", cwd=a)
    run_cli("config", "retention", "0", cwd=a)
    b = tmp_path / "B"
    run_cli("clone", f"dir:{backends[1]}", str(b))
    return a, b, backends, gone


def _gc_version(out: str) -> int:
    m = re.search(r"collected \d+ object copies .* now version (\d+)", out)
    assert m, out
    return int(m.group(1))


def _converged(tmp_path: Path, a: Path, b: Path, backends: list[Path]) -> None:
    """fsck (full) passes on A and B, and B after a pull and a fresh clone equal A."""
    assert run_cli("fsck", cwd=a, check=False).returncode == 0, run_cli("fsck", cwd=a, check=False)
    run_cli("pull", cwd=b)
    assert snapshot(b) == snapshot(a)
    assert run_cli("fsck", cwd=b, check=False).returncode == 0
    clone = tmp_path / "clone"
    run_cli("clone", f"dir:{backends[2]}", str(clone))
    assert snapshot(clone) == snapshot(a)


def test_gc_keeps_the_uploads_of_a_push_in_progress_which_then_merges(tmp_path: Path) -> None:
    """A's push has uploaded its packs (announced first) but not the commit naming
    them when B's gc runs and decides the next version: gc keeps the packs (only the
    announcement names them), A loses that version to gc, merges with it and pushes
    the merge as the version after."""
    a, b, backends, gone = _collected_content_repo(tmp_path)
    new = random.Random(4).randbytes(200_000)
    (a / "new.bin").write_bytes(new)
    before = _objects(backends)
    pause = tmp_path / "pause"
    push = _held(["push", "--json"], a, "upload:packs", pause)
    uploaded = _objects(backends) - before
    assert uploaded, "the held push uploaded no pack"
    gc_version = _gc_version(run_cli("gc", cwd=b).stdout)
    assert uploaded <= _objects(backends), "gc deleted a push in progress's upload"
    out, _ = _release(push, pause)
    assert json.loads(out)["version"] == gc_version + 1  # lost to gc, then won with a merge
    assert f"merge version {gc_version}" in run_cli("log", "--oneline", cwd=a).stdout
    # The merge read A's pre-gc base; what it learned there serves reads only: content
    # gc collected, made again, is uploaded again, not deduplicated against the dead.
    (a / "gone.bin").write_bytes(gone)
    assert json.loads(run_cli("push", "--json", cwd=a).stdout)["bytes_uploaded"] > len(gone)
    _converged(tmp_path, a, b, backends)
    assert (b / "new.bin").read_bytes() == new and (b / "gone.bin").read_bytes() == gone


def test_gc_keeps_the_packs_a_push_uploads_while_it_still_hashes(tmp_path: Path) -> None:
    """A's push uploads its packs as they are finished, while it still commits
    (issue 21: a thread announces each batch to gc first, then uploads it). B's gc
    runs once some are up and A's commit, held, is not even recorded -- only the
    early announcement names them: gc keeps them. A loses the version to gc, merges
    and pushes, and nothing its versions name is missing: the flush did not upload
    those packs again, it booked them."""
    a, b, backends, _ = _collected_content_repo(tmp_path)
    rng = random.Random(5)
    new = {f"new-{i}.bin": rng.randbytes(90_000) for i in range(8)}
    for name, data in new.items():
        (a / name).write_bytes(data)
    before = _objects(backends)
    pause = tmp_path / "pause"
    push = _held(["push", "--json"], a, "commit:stored", pause, METASYNC_PACK_SIZE="100000")
    wait_until(lambda: _objects(backends) - before, HOLD_LIMIT, "a pack uploaded early")
    uploaded = _objects(backends) - before
    gc_version = _gc_version(run_cli("gc", cwd=b).stdout)
    assert uploaded <= _objects(backends), "gc deleted a pack uploaded early"
    out, _ = _release(push, pause)
    assert json.loads(out)["version"] == gc_version + 1
    _converged(tmp_path, a, b, backends)
    assert all((b / name).read_bytes() == data for name, data in new.items())


def test_a_push_repacks_content_gc_collected_while_it_ran(tmp_path: Path) -> None:
    """A re-creates a file whose content only a deleted version had: its commit
    deduplicates against the old copies (nothing re-uploaded) just before B's gc
    collects them. A's push loses to gc, learns its epoch, packs the content again
    from the folder into the merge and pushes it; nothing refers to a deleted object."""
    a, b, backends, gone = _collected_content_repo(tmp_path)
    (a / "gone.bin").write_bytes(gone)
    pause = tmp_path / "pause"
    push = _held(["push", "--json"], a, "upload:packs", pause)
    held = _stored_bytes(backends)
    gc_version = _gc_version(run_cli("gc", cwd=b).stdout)
    collected = _stored_bytes(backends)
    assert collected < held - len(gone), "gc did not collect the old copies of gone.bin"
    out, _ = _release(push, pause)
    assert json.loads(out)["version"] == gc_version + 1
    assert _stored_bytes(backends) > collected + len(gone), "the content was not packed again"
    _converged(tmp_path, a, b, backends)
    assert (b / "gone.bin").read_bytes() == gone


def test_a_gc_that_loses_the_race_to_a_push_deletes_nothing(tmp_path: Path) -> None:
    """B's gc has chosen its garbage -- the old copies of ``gone.bin`` -- and not yet
    proposed its version when A re-creates gone.bin (deduplicated against those very
    copies) and pushes first: gc loses the version to A's push, says so and deletes
    nothing. The next gc keeps the content, which master needs again."""
    a, b, backends, gone = _collected_content_repo(tmp_path)
    before = _objects(backends)
    pause = tmp_path / "pause"
    gc = _held(["gc"], b, "gc:propose", pause)
    (a / "gone.bin").write_bytes(gone)
    pushed = run_cli("push", "--json", cwd=a).stdout
    assert json.loads(pushed)["objects_uploaded"] < 5  # the content was not uploaded again
    out, _ = _release(gc, pause)
    assert "another client committed meanwhile: nothing was deleted" in out, out
    assert before <= _objects(backends)
    assert "collected" in run_cli("gc", cwd=b).stdout  # the rest of the garbage
    _converged(tmp_path, a, b, backends)
    assert (b / "gone.bin").read_bytes() == gone
