"""``metasync mount``: every version as a read-only folder, files fetched on demand.

Each test mounts with the real ``metasync mount`` command (a separate process, a
real FUSE mount through /dev/fuse) and unmounts with SIGTERM at the end, checking
that the mount is gone and the process exited cleanly. Transfers are counted by
the storage server's side: an S3 server (SeaweedFS) behind a counting proxy that
logs every request with its ``Range`` and the bytes it answered.
"""

from __future__ import annotations

import os
import shutil
import signal
import stat
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from bench.countproxy import CountingProxy
from conftest import (
    METASYNC,
    PASSPHRASE,
    make_edge_case_tree,
    one_line_error,
    run_cli,
    wait_until,
)
from metasync import Repository

pytestmark = pytest.mark.skipif(not os.path.exists("/dev/fuse"), reason="needs /dev/fuse")

MiB = 1024 * 1024


class Mount:
    """A running ``metasync mount`` of ``repo`` at ``point``."""

    def __init__(self, repo: Path, point: Path, *args: str) -> None:
        self.point = point
        point.mkdir(exist_ok=True)
        env = {**os.environ, "METASYNC_PASSPHRASE": PASSPHRASE}
        self.log = point.parent / f"{point.name}.log"
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen([METASYNC, "mount", str(point), *args], cwd=repo,
                                         env=env, stdout=out, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL)
        wait_until(lambda: self.proc.poll() is not None or (point / "latest").is_dir(), 60,
                   "the mount to come up", detail=self.output)
        assert self.proc.poll() is None, self.output()

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """Stop the mount with ``sig``: it must unmount and exit 0."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                subprocess.run(["fusermount", "-u", "-z", str(self.point)], check=False)
                self.proc.kill()
                raise
        assert self.proc.returncode == 0, self.output()
        assert not os.path.ismount(self.point), "still mounted after the process ended"
        assert "Traceback" not in self.output(), self.output()


@pytest.fixture
def mounts() -> Iterator[Callable[..., Mount]]:
    """Start mounts; every one still running at the end is stopped (and checked)."""
    started: list[Mount] = []

    def start(repo: Path, point: Path, *args: str) -> Mount:
        m = Mount(repo, point, *args)
        started.append(m)
        return m

    yield start
    for m in started:
        m.stop()


def _push(repo: Repository, message: str) -> int:
    repo.push(message)
    return repo.prev.number


def test_versions_match_a_restore_of_each_version(tmp_path: Path, backends: list[Path],
                                                  passphrase: Callable[[], str],
                                                  mounts: Callable[..., Mount]) -> None:
    """``diff -r`` of ``versions/N/`` against version N restored by metasync is empty,
    for three versions of the edge-case tree; ``latest/`` is the newest of them."""
    src = tmp_path / "src"
    make_edge_case_tree(src)
    repo = Repository.init(src, [f"dir:{b}" for b in backends], passphrase=passphrase)
    numbers = [_push(repo, "one")]
    (src / "notes.txt").write_text("notes, edited\n")
    (src / "case.txt").unlink()
    with open(src / "big.bin", "r+b") as fh:  # one chunk of the big file changes
        fh.seek(3 * MiB)
        fh.write(b"x" * 1000)
    (src / "new-dir").mkdir()
    (src / "new-dir" / "new.txt").write_text("new\n")
    numbers.append(_push(repo, "two"))
    shutil.rmtree(src / "level0")
    (src / "empty-file").write_text("not empty any more\n")
    (src / "link-to-notes").unlink()
    os.symlink("new-dir/new.txt", src / "link-to-notes")
    numbers.append(_push(repo, "three"))
    refs = tmp_path / "refs"
    masters = {e.version: e.commit_id for e in repo.log()}
    for n in numbers:
        tree = repo.tree_at(masters[n])
        for name in {p.split("/")[0] for p in tree}:
            repo.restore(name, version=str(n), to=refs / str(n) / name)
        assert (refs / str(n) / "big.bin").stat().st_size == 5 * MiB
    repo.close()

    m = mounts(src, tmp_path / "mnt")
    assert sorted(os.listdir(m.point)) == ["by-date", "latest", "snapshots", "versions"]
    shown = {int(n) for n in os.listdir(m.point / "versions")}
    assert set(numbers) <= shown
    for n in numbers:
        diff = subprocess.run(["diff", "-r", "--no-dereference", str(refs / str(n)),
                               str(m.point / "versions" / str(n))], capture_output=True, text=True)
        assert diff.returncode == 0 and not diff.stdout, diff.stdout + diff.stderr
        assert os.stat(m.point / "versions" / str(n) / "run.sh").st_mode & stat.S_IXUSR
    latest = subprocess.run(["diff", "-r", "--no-dereference", str(refs / str(numbers[-1])),
                             str(m.point / "latest")], capture_output=True, text=True)
    assert latest.returncode == 0, latest.stdout
    assert len(os.listdir(m.point / "by-date")) == 3
    with pytest.raises(OSError):  # read-only
        (m.point / "latest" / "notes.txt").write_text("no")
    m.stop(signal.SIGINT)


def test_latest_shows_a_new_push_within_the_poll_interval(
    tmp_path: Path, backends: list[Path], passphrase: Callable[[], str],
    mounts: Callable[..., Mount],
) -> None:
    """Another clone pushes; ``latest/`` shows its file (polled every second) before
    this folder has it; a pull in the mounted folder runs meanwhile."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("a\n")
    with Repository.init(src, [f"dir:{b}" for b in backends], passphrase=passphrase) as repo:
        repo.push("first")
    other = Repository.clone(f"dir:{backends[0]}", tmp_path / "other", passphrase=passphrase)
    m = mounts(src, tmp_path / "mnt", "--poll", "1")
    assert (m.point / "latest" / "a.txt").read_text() == "a\n"
    (other.root / "b.txt").write_text("pushed by the other clone\n")
    other.push("second")
    other.close()
    wait_until(lambda: (m.point / "latest" / "b.txt").read_text() == "pushed by the other clone\n",
               30, "latest/ to show the other clone's push", detail=m.output)
    # On demand: the mount reads what this folder does not hold (yet).
    assert not (src / "b.txt").exists()
    # The mount leaves the folder to other commands: a pull runs while it is up.
    run_cli("pull", cwd=src)
    assert (src / "b.txt").read_text() == "pushed by the other clone\n"


# ---------------------------------------------------------------- counted transfers
class _Counted:
    def __init__(self, root: Path, proxy: CountingProxy, big: Path, numbers: list[int]) -> None:
        self.root, self.proxy, self.big, self.numbers = root, proxy, big, numbers


@pytest.fixture(scope="module")
def counted_repo(seaweedfs: object, tmp_path_factory: pytest.TempPathFactory) -> Iterator[_Counted]:
    """A repository on S3 (through a counting proxy) with 50 versions: 49 small
    edits, then a 200 MiB file of random bytes (so nothing deduplicates)."""
    from tests.servers.seaweedfs import SeaweedS3

    assert isinstance(seaweedfs, SeaweedS3)
    proxy = CountingProxy("127.0.0.1", seaweedfs.port)
    base = tmp_path_factory.mktemp("counted")
    src = base / "src"
    src.mkdir()
    uri = seaweedfs.uri(f"mount-{os.getpid()}", endpoint=f"http://127.0.0.1:{proxy.port}")
    repo = Repository.init(src, [uri], replicas=1, passphrase=lambda: PASSPHRASE)
    numbers = []
    for i in range(49):
        (src / f"file{i % 5}.txt").write_text(f"edit {i}\n" * 1000)
        numbers.append(_push(repo, f"edit {i}"))
    big = base / "big.reference"
    with open(big, "wb") as fh:
        for _ in range(200):
            fh.write(os.urandom(MiB))
    os.link(big, src / "big.bin")
    numbers.append(_push(repo, "big"))
    repo.close()
    try:
        yield _Counted(src, proxy, big, numbers)
    finally:
        proxy.close()


def test_reading_the_last_mib_of_a_200mb_file_transfers_little(
    counted_repo: _Counted, tmp_path: Path, mounts: Callable[..., Mount],
) -> None:
    """The last MiB of a 200 MiB file arrives (right) with under 10 MB read from
    the backend: only the chunks covering it are fetched, by range."""
    m = mounts(counted_repo.root, tmp_path / "mnt")
    target = m.point / "latest" / "big.bin"
    assert target.stat().st_size == 200 * MiB
    counted_repo.proxy.reset()
    with open(target, "rb") as fh:
        fh.seek(199 * MiB)
        data = fh.read()
    with open(counted_repo.big, "rb") as fh:
        fh.seek(199 * MiB)
        assert data == fh.read()
    got = counted_repo.proxy.bytes_answered
    assert 0 < got < 10_000_000, counted_repo.proxy.log


def test_listing_versions_reads_no_file_content(
    counted_repo: _Counted, tmp_path: Path, mounts: Callable[..., Mount],
) -> None:
    """Listing ``versions/`` of a 50-version repository, stat of each entry and of
    what each version holds, reads no pack (blobs are only in packs)."""
    m = mounts(counted_repo.root, tmp_path / "mnt")
    counted_repo.proxy.reset()
    names = os.listdir(m.point / "versions")
    assert {int(n) for n in names} >= set(counted_repo.numbers)
    assert len(counted_repo.numbers) == 50
    for n in names:
        top = m.point / "versions" / n
        assert stat.S_ISDIR(top.stat().st_mode)
        for entry in os.scandir(top):
            entry.stat(follow_symlinks=False)
    assert (m.point / "versions" / str(counted_repo.numbers[-1]) / "big.bin").stat().st_size \
        == 200 * MiB
    ranged = [r for r in counted_repo.proxy.log if r[2] is not None]
    assert ranged == [], ranged
    # The count does see content reads: reading a file is one.
    (m.point / "latest" / "file0.txt").read_bytes()
    assert any(r[2] is not None for r in counted_repo.proxy.log)


def test_a_backend_lost_mid_read_falls_back_to_the_other_holder(
    tmp_path: Path, passphrase: Callable[[], str], mounts: Callable[..., Mount],
) -> None:
    """Two ``dir:`` backends hold every object (R = 2); with one open file, either
    backend vanishing between reads leaves the reads right."""
    dirs = [tmp_path / "b0", tmp_path / "b1"]
    for d in dirs:
        d.mkdir()
    src = tmp_path / "src"
    src.mkdir()
    content = os.urandom(12 * MiB)
    (src / "big.bin").write_bytes(content)
    with Repository.init(src, [f"dir:{d}" for d in dirs], replicas=2,
                         passphrase=passphrase) as repo:
        repo.push("big")
    m = mounts(src, tmp_path / "mnt")
    with open(m.point / "latest" / "big.bin", "rb") as fh:
        assert fh.read(MiB) == content[:MiB]
        for gone, offset in ((dirs[0], 4 * MiB), (dirs[1], 8 * MiB)):
            gone.rename(gone.with_name(gone.name + "-gone"))
            try:
                fh.seek(offset)
                assert fh.read(2 * MiB) == content[offset:offset + 2 * MiB]
            finally:
                gone.with_name(gone.name + "-gone").rename(gone)
    # `fusermount -u` ends the mount as a signal does.
    fusermount = shutil.which("fusermount3") or shutil.which("fusermount") or "fusermount"
    subprocess.run([fusermount, "-u", str(m.point)], check=True)
    assert m.proc.wait(60) == 0, m.output()
    m.stop()


def test_the_server_being_read_from_killed_mid_file_the_other_holder_answers(
    seaweedfs: object, tmp_path: Path, mounts: Callable[..., Mount],
) -> None:
    """Two S3 backends, each behind its own proxy, hold every object (R = 2). The
    one that served the first read of an open file is killed (its proxy closed:
    connections refused); the rest of the file comes, right, from the other."""
    from tests.servers.seaweedfs import SeaweedS3

    assert isinstance(seaweedfs, SeaweedS3)
    proxies = [CountingProxy("127.0.0.1", seaweedfs.port) for _ in range(2)]
    try:
        uris = [seaweedfs.uri(f"kill-{os.getpid()}-{i}", endpoint=f"http://127.0.0.1:{p.port}")
                for i, p in enumerate(proxies)]
        src = tmp_path / "src"
        src.mkdir()
        content = os.urandom(12 * MiB)
        (src / "big.bin").write_bytes(content)
        with Repository.init(src, uris, replicas=2, passphrase=lambda: PASSPHRASE) as repo:
            repo.push("big")
        m = mounts(src, tmp_path / "mnt", "--cache-size", "0")
        for p in proxies:
            p.reset()
        with open(m.point / "latest" / "big.bin", "rb") as fh:
            assert fh.read(MiB) == content[:MiB]
            served = [i for i, p in enumerate(proxies) if any(r[2] for r in p.log)]
            assert len(served) >= 1, [p.log for p in proxies]
            killed, other = served[0], 1 - served[0]
            proxies[killed].close()
            proxies[other].reset()
            fh.seek(6 * MiB)
            assert fh.read(4 * MiB) == content[6 * MiB:10 * MiB]
        assert any(r[2] for r in proxies[other].log), "the other holder served nothing"
    finally:
        for p in proxies:
            p.close()


def test_bad_mountpoints_and_missing_fuse_are_one_line_errors(
    tmp_path: Path, backends: list[Path], passphrase: Callable[[], str],
) -> None:
    src = tmp_path / "src"
    src.mkdir()
    Repository.init(src, [f"dir:{b}" for b in backends], passphrase=passphrase).close()
    full = tmp_path / "full"
    full.mkdir()
    (full / "x").write_text("x")
    one_line_error(run_cli("mount", str(full), cwd=src, check=False), "empty")
    one_line_error(run_cli("mount", str(tmp_path / "nowhere"), cwd=src, check=False),
                   "does not exist")
    afile = tmp_path / "afile"
    afile.write_text("")
    one_line_error(run_cli("mount", str(afile), cwd=src, check=False), "not a folder")
    empty = tmp_path / "empty"
    empty.mkdir()
    one_line_error(run_cli("mount", str(empty), cwd=src, check=False,
                           env_extra={"FUSE_LIBRARY_PATH": str(tmp_path / "no-libfuse.so")}),
                   "FUSE", "libfuse")
    one_line_error(run_cli("mount", str(empty), "--cache-size", "lots", cwd=src, check=False),
                   "--cache-size")


def test_the_chunk_cache_keeps_its_bound_and_drops_the_least_recently_used(
    tmp_path: Path,
) -> None:
    """``--cache-size``: the folder never holds more than its bound; the chunk used
    longest ago goes first, across restarts; a damaged file is dropped, not served."""
    import hashlib

    from metasync.reader import MEMORY_CHUNKS, ChunkCache

    def check(blob_id: str, data: bytes) -> bool:
        return hashlib.sha256(data).hexdigest() == blob_id

    blobs = [os.urandom(1000) for _ in range(4)]
    ids = [hashlib.sha256(b).hexdigest() for b in blobs]
    folder = tmp_path / "cache"
    cache = ChunkCache(folder, 2500, check)
    cache.put(ids[0], blobs[0])
    cache.put(ids[1], blobs[1])
    cache.memory.clear()  # read back from disk, not memory
    assert cache.get(ids[0]) == blobs[0]  # now 1 is the least recently used
    cache.put(ids[2], blobs[2])
    assert sorted(os.listdir(folder)) == sorted([ids[0], ids[2]])
    assert sum(p.stat().st_size for p in folder.iterdir()) <= 2500
    (folder / ids[2]).write_bytes(b"damaged" + blobs[2][7:])
    again = ChunkCache(folder, 2500, check)  # a restart keeps the order from the folder
    assert again.get(ids[2]) is None and not (folder / ids[2]).exists()
    again.put(ids[3], blobs[3])
    assert again.get(ids[0]) == blobs[0]
    assert sorted(os.listdir(folder)) == sorted([ids[0], ids[3]])
    nothing = ChunkCache(tmp_path / "none", 0, check)  # --cache-size 0: memory only
    nothing.put(ids[0], blobs[0])
    assert not (tmp_path / "none").exists() and len(nothing.memory) <= MEMORY_CHUNKS


def test_a_commit_time_after_year_9999_is_clamped_not_raised(
        tmp_path: Path, backends: list[Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """A commit's time is untrusted: one after year 9999 (or before 1970) names a
    by-date/ folder, a ``log`` line and a ``forget`` row, clamped, instead of an
    unhandled ValueError (which the mount's guard, for metasync's and the disk's
    errors only, let through)."""
    from dataclasses import replace

    from metasync.cli_forget import _when
    from metasync.history import LogEntry
    from metasync.objects import Commit
    from metasync.retention import commit_datetime

    far, before = 400_000 * 365 * 86_400 * 10**9, -(10**18)  # ns: about year 402000; 1938
    assert commit_datetime(far).year == 9999 and commit_datetime(before).year == 1970
    assert _when(far).startswith("9999-")
    assert LogEntry("c" * 64, "d", "x", far, "m", ()).to_json()["time"].startswith("9999-")

    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("a\n")
    with Repository.init(src, [f"dir:{b}" for b in backends[:2]],
                         passphrase=lambda: PASSPHRASE) as repo:
        pushed = repo.push("one")
        assert pushed.version is not None and pushed.version.master is not None
        reader = repo.version_reader(cache_size=0, poll=0)
        real = reader.graph.first_parents

        def far_future(start: str | None) -> Iterator[tuple[str, Commit]]:
            for cid, commit in real(start):
                yield cid, replace(commit, time_ns=far)

        # The stored commit cannot be given such a time without its key: the walk
        # hands the reader one (what a malicious client's commit would carry).
        monkeypatch.setattr(reader.graph, "first_parents", far_future)
        names = list(reader.by_date())
        assert len(names) == 1 and names[0].startswith("9999-12-")
