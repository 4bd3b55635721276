"""End to end through the real ``metasync`` command: the core issue's "done when".

One repository (10k small files, a 50 MB file, and every awkward kind of entry)
is pushed once per module to three folder backends with R=2; each test starts
from a pristine copy of those backends, restored in place so the URIs in the
shared config stay valid.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import PASSPHRASE, make_tree, run_cli, snapshot
from metasync import Repository
from metasync.codec import Codec
from metasync.keyslots import LocalKey

BIG_MB = 50
SMALL_FILES = 10_000


@dataclass
class Pushed:
    src: Path
    backends: list[Path]
    pristine: list[Path]
    work: Path

    def uri(self, i: int) -> str:
        return f"dir:{self.backends[i]}"

    def restore(self) -> None:
        for live, saved in zip(self.backends, self.pristine, strict=True):
            shutil.rmtree(live, ignore_errors=True)
            shutil.copytree(saved, live, symlinks=True)


@pytest.fixture(scope="module")
def pushed(tmp_path_factory: pytest.TempPathFactory) -> Pushed:
    base = tmp_path_factory.mktemp("e2e")
    src = base / "src"
    make_tree(src, small_files=SMALL_FILES, big_mb=BIG_MB)
    backends = [base / f"backend{i}" for i in range(3)]
    for b in backends:
        b.mkdir()
    args = ["init", str(src), "--replicas", "2"]
    for b in backends:
        args += ["--backend", f"dir:{b}"]
    run_cli(*args)
    run_cli("push", "-m", "first", cwd=src)
    pristine = [base / f"pristine{i}" for i in range(3)]
    for live, saved in zip(backends, pristine, strict=True):
        shutil.copytree(live, saved, symlinks=True)
    return Pushed(src, backends, pristine, base)


@pytest.fixture
def repo(pushed: Pushed, tmp_path: Path) -> Pushed:
    """The pushed repository with its backends restored, and a fresh work folder."""
    pushed.restore()
    return Pushed(pushed.src, pushed.backends, pushed.pristine, tmp_path)


def _objects(backend: Path) -> set[Path]:
    return {p for p in (backend / "metasync" / "objects").rglob("*") if p.is_file()}


def test_round_trip_then_edit_delete_rename_add(repo: Pushed) -> None:
    """A clone is identical to the source (content, links, exec bits, empty
    folders, unicode names); after edits, deletes, renames and adds pushed from one
    clone, pulling in another makes them identical again."""
    expected = snapshot(repo.src)
    a, b = repo.work / "a", repo.work / "b"
    run_cli("clone", repo.uri(0), str(a))
    assert snapshot(a) == expected
    run_cli("clone", repo.uri(1), str(b))

    (a / "ünïcödé — 名前" / "résumé ☃.txt").write_text("edited\n")
    (a / "small" / "d00" / "f00000.txt").unlink()
    os.rename(a / "small" / "d01", a / "small" / "d01-renamed")
    os.rename(a / "bin" / "run.sh", a / "bin" / "run2.sh")
    (a / "link-to-script").unlink()
    os.symlink("bin/run2.sh", a / "link-to-script")
    (a / "new-empty-dir").mkdir()
    (a / "new file.md").write_text("# new\n")
    (a / "small" / "d02" / "f00002.txt").chmod(0o755)
    shutil.rmtree(a / "empty-dir")
    with open(a / "big.bin", "r+b") as fh:
        fh.seek(10 * 1024 * 1024)
        fh.write(b"edited in the middle")
    run_cli("push", "-m", "changes", cwd=a)
    run_cli("pull", cwd=b)
    assert snapshot(b) == snapshot(a)
    assert snapshot(b) != expected
    status = json.loads(run_cli("status", "--json", cwd=b).stdout)
    assert status["clean"] and status["version"] == 2
    log = json.loads(run_cli("log", "--json", cwd=b).stdout)
    assert [e["message"] for e in log] == ["changes", "first"]


def test_small_files_are_packed(repo: Pushed) -> None:
    """10k small files do not become 10k backend objects (packs hold them)."""
    total = sum(len(_objects(b)) for b in repo.backends)
    assert total < 60, f"{total} objects for {SMALL_FILES} files"


@pytest.mark.parametrize("lost", [0, 1, 2])
def test_clone_after_losing_a_whole_backend(repo: Pushed, lost: int) -> None:
    """With R=2 over three backends, deleting any one backend folder entirely
    still lets a clone from either remaining backend rebuild the identical tree."""
    expected = snapshot(repo.src)
    shutil.rmtree(repo.backends[lost])
    for i in range(3):
        if i == lost:
            continue
        target = repo.work / f"clone-from-{i}"
        run_cli("clone", repo.uri(i), str(target))
        assert snapshot(target) == expected
    assert not repo.backends[lost].exists(), "a lost backend must not be recreated"


def test_corrupt_copies_are_survived_and_reported(repo: Pushed) -> None:
    """Flipping a byte in every object copy on one backend: clone and pull still
    return correct data, and fsck names the corrupt copies and exits 1."""
    early = repo.work / "early"
    run_cli("clone", repo.uri(1), str(early))
    writer = repo.work / "writer"
    run_cli("clone", repo.uri(2), str(writer))
    (writer / "after-corruption.txt").write_text("new content\n")
    with open(writer / "big.bin", "r+b") as fh:
        fh.seek(30 * 1024 * 1024)
        fh.write(b"x" * 100)
    run_cli("push", cwd=writer)

    corrupted = sorted(_objects(repo.backends[0]))
    assert corrupted
    for path in corrupted:
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))

    fresh = repo.work / "fresh"
    run_cli("clone", repo.uri(0), str(fresh))
    assert snapshot(fresh) == snapshot(writer)
    run_cli("pull", cwd=early)
    assert snapshot(early) == snapshot(writer)

    proc = run_cli("fsck", cwd=fresh, check=False)
    assert proc.returncode == 1
    reported = [line for line in proc.stdout.splitlines() if line.startswith("corrupt:")]
    assert len(reported) == len(corrupted)
    assert all(str(repo.backends[0]) in line for line in reported)
    clean = run_cli("fsck", cwd=writer, check=False)
    assert clean.returncode == 1  # same backends, same verdict from any client


def test_fsck_passes_on_healthy_backends(repo: Pushed) -> None:
    """fsck verifies every copy of every reachable object and exits 0 when all are good."""
    proc = run_cli("fsck", cwd=repo.src)
    assert proc.stdout.startswith("ok:")


def test_encryption_hides_names_and_content(repo: Pushed) -> None:
    """With encryption on, no file name (as a path or inside a file) and no file
    content of the tree appears anywhere on any backend."""
    names: set[bytes] = set()
    contents: set[bytes] = set()
    for path in repo.src.rglob("*"):
        if ".metasync" in path.parts:
            continue
        encoded = path.name.encode()
        if len(encoded) >= 5:  # shorter byte strings occur in 100 MB of ciphertext by chance
            names.add(encoded)
        if path.is_file() and not path.is_symlink() and path.stat().st_size >= 16:
            data = path.read_bytes()
            contents.add(data[:16])
            contents.add(data[len(data) // 2 : len(data) // 2 + 16])
    assert len(names) > 1000 and len(contents) > 1000
    # A leak would show on every file alike, so a seeded sample of the small files
    # plus every distinctive one keeps the scan of ~144 MB of ciphertext quick (each
    # needle is one pass over it: 120 + 120 of them took 18 s).
    rng = random.Random(3)
    names = set(rng.sample(sorted(names), 30)) | {n for n in names if not n.startswith(b"f0")}
    contents = set(rng.sample(sorted(contents), 30))
    contents |= {b"snow man\n", b"#!/bin/sh\necho run"}
    for backend in repo.backends:
        for path in backend.rglob("*"):
            rel = str(path.relative_to(backend)).encode()
            assert not any(n in rel for n in names), rel
            if path.is_file():
                blob = path.read_bytes()
                leaked = [n for n in names if n in blob] + [c for c in contents if c in blob]
                assert not leaked, f"{path} leaks {leaked[:3]}"


def test_one_byte_edit_uploads_at_most_two_chunks(repo: Pushed) -> None:
    """Changing one byte in the middle of the 50 MB file re-uploads at most two
    chunks: checked on what the push reports and on the packs that appeared."""
    clone = repo.work / "clone"
    run_cli("clone", repo.uri(0), str(clone))
    before = [_objects(b) for b in repo.backends]
    with open(clone / "big.bin", "r+b") as fh:
        fh.seek(BIG_MB * 1024 * 1024 // 2)
        byte = fh.read(1)
        fh.seek(-1, os.SEEK_CUR)
        fh.write(bytes([byte[0] ^ 1]))
    with Repository.open(clone) as r:
        result = r.push("one byte")
        key = LocalKey.from_bytes((clone / ".metasync" / "key").read_bytes()).ring
    assert result.commit is not None
    assert result.commit.new_objects.get("blob", 0) <= 2
    codec = Codec(key)
    new_blobs = set()
    for old, backend in zip(before, repo.backends, strict=True):
        for path in _objects(backend) - old:
            try:
                entries = codec.pack_entries(path.name, path.read_bytes())
            except Exception:
                continue  # an index or commit, not a pack
            new_blobs |= {e.object_id for e in entries if e.kind == "blob"}
    assert 1 <= len(new_blobs) <= 2
    assert result.bytes_uploaded < 2 * 2 * 4 * 1024 * 1024 + 1024 * 1024


def test_status_of_unchanged_tree_reads_no_file(repo: Pushed) -> None:
    """After a push, status of an unchanged tree hashes no file (the index answers)."""
    clone = repo.work / "clone"
    run_cli("clone", repo.uri(0), str(clone))
    # Files just written are "racily clean" (same-granularity mtime); age them as
    # any real tree ages, then one status records them as trusted.
    old = 1_600_000_000
    for path in clone.rglob("*"):
        if ".metasync" not in path.parts and not path.is_symlink():
            os.utime(path, (old, old))
    with Repository.open(clone) as r:
        first = r.status()
        assert first.clean
        second = r.status()
    assert second.clean and second.files_hashed == 0
    (clone / "small" / "d03" / "f00003.txt").write_bytes(b"changed")
    with Repository.open(clone) as r:
        third = r.status()
    assert third.files_hashed == 1
    assert [c.path for c in third.changes] == ["small/d03/f00003.txt"]


def test_push_after_master_moved_merges(repo: Pushed) -> None:
    """A push from a client that has not pulled the latest master merges with it
    (never over it): both clients' changes end up in both trees, and the history
    is linear along first parents."""
    a, b = repo.work / "a", repo.work / "b"
    run_cli("clone", repo.uri(0), str(a))
    run_cli("clone", repo.uri(1), str(b))
    (a / "from-a.txt").write_text("a\n")
    run_cli("push", cwd=a)
    (b / "from-b.txt").write_text("b\n")
    run_cli("push", cwd=b)
    assert (b / "from-a.txt").read_text() == "a\n" and (b / "from-b.txt").read_text() == "b\n"
    run_cli("pull", cwd=a)
    assert snapshot(a) == snapshot(b)
    history = json.loads(run_cli("log", "--json", cwd=a).stdout)
    # The merge's first parent is the master it merged into (a's push, the version
    # before it); log lists b's side too.
    first = next(e for e in history if e["commit"] == history[0]["parents"][0])
    assert first["version"] == history[0]["version"] - 1
    assert len(history) == 4


def test_pull_keeps_local_edit_as_conflict_copy(repo: Pushed) -> None:
    """If a file changed both here and in master, pull keeps the local version as a
    conflict copy next to master's version: nothing is lost."""
    a, b = repo.work / "a", repo.work / "b"
    run_cli("clone", repo.uri(0), str(a))
    run_cli("clone", repo.uri(1), str(b))
    target = "ünïcödé — 名前/résumé ☃.txt"
    (a / target).write_text("remote edit\n")
    run_cli("push", cwd=a)
    (b / target).write_text("local edit\n")
    run_cli("pull", cwd=b)
    assert (b / target).read_text() == "remote edit\n"
    copies = list((b / "ünïcödé — 名前").glob("résumé ☃ (conflict *).txt"))
    assert len(copies) == 1 and copies[0].read_text() == "local edit\n"


def test_no_passphrase_needed_after_clone(repo: Pushed) -> None:
    """After clone, the unwrapped key lives in .metasync (mode 0600); later
    commands need no passphrase."""
    clone = repo.work / "clone"
    run_cli("clone", repo.uri(0), str(clone))
    key = clone / ".metasync" / "key"
    assert key.stat().st_mode & 0o777 == 0o600
    (clone / "x.txt").write_text("x\n")
    run_cli("push", cwd=clone, passphrase=None)


def test_passphrase_file(repo: Pushed) -> None:
    """--passphrase-file is used when METASYNC_PASSPHRASE is not set."""
    secret = repo.work / "pass.txt"
    secret.write_text(PASSPHRASE + "\n")
    clone = repo.work / "clone"
    run_cli("clone", repo.uri(2), str(clone), "--passphrase-file", str(secret), passphrase=None)
    assert (clone / "big.bin").stat().st_size == BIG_MB * 1024 * 1024
