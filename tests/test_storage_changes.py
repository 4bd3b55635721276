"""Living with changing storage, end to end through the real ``metasync`` command:
backends added, removed (also when already gone), R changed, and copies repaired.

Placement is checked against the stable mapping of the configuration the
backends agreed on, by listing every backend folder: each object must be on
exactly the backends its mapping names, and nowhere else.
"""

from __future__ import annotations

import random
import re
import shutil
from pathlib import Path

import pytest

from conftest import run_cli, snapshot
from metasync.checkout import WRITE_BATCH
from metasync.layout import parse_object_key
from metasync.objects import Config
from metasync.repository import Repository
from metasync.store import mapping_of

NAMESPACE = "metasync"


def _held(backend: Path) -> set[str]:
    """Stored object ids in one backend folder."""
    root = backend / NAMESPACE
    out = set()
    for path in (root / "objects").glob("*/*"):
        stored_id = parse_object_key(str(path.relative_to(root)))
        if stored_id is not None:
            out.add(stored_id)
    return out


def _placement(repo_dir: Path) -> tuple[dict[str, Path], Config]:
    """Backend id -> folder, and the latest configuration, as a client learns them."""
    with Repository.open(repo_dir) as repo:
        latest = repo.learn_latest()
        config = repo.load_config(latest.config)
    return {b.id: Path(b.uri.removeprefix("dir:")) for b in config.backends}, config


def _check_placement(repo_dir: Path, expect_replicas: int) -> int:
    """Every object found on any backend of the latest configuration is on exactly
    the backends its mapping names; return how many objects there are."""
    backends, config = _placement(repo_dir)
    assert config.replicas == expect_replicas
    mapping = mapping_of(config)
    held = {b: _held(folder) for b, folder in backends.items()}
    everything = set().union(*held.values())
    for stored_id in everything:
        where = {b for b, ids in held.items() if stored_id in ids}
        assert where == set(mapping.locate(stored_id)), stored_id
    return len(everything)


def _moved(output: str) -> tuple[int, int]:
    m = re.search(r"moved (\d+) object copies .*theoretical minimum (\d+)", output)
    assert m, output
    return int(m.group(1)), int(m.group(2))


def _clone_matches(tmp: Path, uri: str, want: dict[str, tuple[str, ...]], name: str) -> None:
    target = tmp / name
    run_cli("clone", uri, str(target))
    assert snapshot(target) == want, f"clone from {uri} differs"
    shutil.rmtree(target)


#: Files of the test below, each its own stored object. Every check holds object by
#: object (each object's placement; the copies a change makes, which with equal
#: capacities is exactly the minimum for each object), so more objects repeat the
#: checks without adding one; the count only has to cross the batches the commands
#: work in: a clone installs files WRITE_BATCH at a time (two batches here), and ids
#: are looked up and claimed 500 or 900 to a query.
FILES = 2500


@pytest.mark.slow
def test_add_remove_and_change_replicas_on_thousands_of_objects(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """3 backends, R = 2, 2,500 files packed one per pack (2,500+ stored
    objects). Adding a 4th backend moves only the copies whose mapping changed (the
    printed count is within 1.1x of the theoretical minimum, and every object is
    exactly where the new mapping says); ``config replicas 3`` puts every object on
    3 backends; removing a backend, and then one whose folder was deleted, leaves
    fsck clean and clones identical. A client cloned
    before all this learns each change on its next pull and pushes under it."""
    backends = [tmp_path / f"b{i}" for i in range(5)]
    for b in backends:
        b.mkdir()
    a = tmp_path / "A"
    assert FILES > WRITE_BATCH  # a clone installs them in more than one batch
    rng = random.Random(7)
    for i in range(FILES):
        folder = a / f"d{i % 50:02d}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"f{i:04d}").write_bytes(rng.randbytes(rng.randint(300, 900)))
    run_cli("init", str(a), *(f"--backend=dir:{b}" for b in backends[:3]))
    monkeypatch.setenv("METASYNC_PACK_SIZE", "300")  # a pack per file
    run_cli("push", "-m", "one object per file", cwd=a)
    monkeypatch.delenv("METASYNC_PACK_SIZE")
    other = tmp_path / "B"
    run_cli("clone", f"dir:{backends[0]}", str(other))
    tree = snapshot(a)
    assert _check_placement(a, 2) >= FILES

    # A 4th backend: only the copies the new mapping puts on it are written.
    out = run_cli("backend", "add", f"dir:{backends[3]}", cwd=a).stdout
    moved, minimum = _moved(out)
    assert minimum > 0 and moved <= 1.1 * minimum, out
    assert len(_held(backends[3])) == moved  # all new copies went to the new backend
    objects = _check_placement(a, 2)
    assert run_cli("fsck", cwd=a).returncode == 0
    _clone_matches(tmp_path, f"dir:{backends[3]}", tree, "from-new")

    # Three replicas of everything.
    out = run_cli("config", "replicas", "3", cwd=a).stdout
    assert _moved(out)[0] == objects  # one more copy of each object
    assert _check_placement(a, 3) == objects
    assert run_cli("fsck", "--quick", cwd=a).returncode == 0

    # Remove a backend that is still there: its copies are re-made elsewhere first,
    # and it is emptied once every object has 3 verified copies on the others.
    ids, _ = _placement(a)
    first = next(b for b, folder in ids.items() if folder == backends[0])
    out = run_cli("backend", "remove", first, cwd=a).stdout
    assert "removed backend" in out
    assert _held(backends[0]) == set()
    _check_placement(a, 3)
    assert run_cli("fsck", cwd=a).returncode == 0
    _clone_matches(tmp_path, f"dir:{backends[1]}", tree, "from-rest")

    # Remove one whose folder is already gone for good (R down to 2 first).
    run_cli("config", "replicas", "2", cwd=a)
    shutil.rmtree(backends[1])
    out = run_cli("backend", "remove", f"dir:{backends[1]}", cwd=a).stdout
    assert "removed backend" in out
    assert not backends[1].exists()  # never recreated
    assert _check_placement(a, 2) == objects
    assert run_cli("fsck", cwd=a).returncode == 0
    _clone_matches(tmp_path, f"dir:{backends[2]}", tree, "from-survivors")

    # The client cloned at the start follows all five changes and pushes under them.
    (other / "d00" / "late.txt").write_text("written after the changes\n")
    run_cli("push", "-m", "late", cwd=other)
    run_cli("pull", cwd=a)
    assert snapshot(a) == snapshot(other)
    assert (a / "d00" / "late.txt").read_text() == "written after the changes\n"
    _check_placement(a, 2)
    assert run_cli("fsck", cwd=other).returncode == 0


def test_fsck_repair_restores_deleted_and_corrupt_copies(tmp_path: Path) -> None:
    """Random object copies on one backend deleted and others corrupted (a byte
    flipped, or cut short): fsck fails naming each; ``fsck --repair`` re-creates
    every one of them from a good copy and says so; a second fsck is clean, and so
    is a clone from the damaged backend."""
    backends = [tmp_path / f"b{i}" for i in range(3)]
    for b in backends:
        b.mkdir()
    a = tmp_path / "A"
    rng = random.Random(11)
    for i in range(300):
        (a / f"d{i % 7}").mkdir(parents=True, exist_ok=True)
        (a / f"d{i % 7}" / f"f{i}").write_bytes(rng.randbytes(rng.randint(100, 40_000)))
    run_cli("init", str(a), *(f"--backend=dir:{b}" for b in backends))
    run_cli("push", "-m", "data", cwd=a)
    for i in range(30):  # more objects: a commit and an index each
        (a / f"more{i}.txt").write_text(f"more {i}\n")
        run_cli("push", "-m", f"more {i}", cwd=a)
    tree = snapshot(a)
    victim = backends[1] / NAMESPACE / "objects"
    copies = sorted(p for p in victim.glob("*/*") if p.is_file())
    assert len(copies) >= 20
    rng.shuffle(copies)
    deleted, flipped, cut = copies[:6], copies[6:12], copies[12:15]
    for p in deleted:
        p.unlink()
    for p in flipped:
        data = bytearray(p.read_bytes())
        data[len(data) // 2] ^= 0x40
        p.write_bytes(bytes(data))
    for p in cut:
        p.write_bytes(p.read_bytes()[:-5])
    damaged = {p.name for p in deleted + flipped + cut}

    check = run_cli("fsck", cwd=a, check=False)
    assert check.returncode == 1
    named = set(re.findall(r"^(?:missing|corrupt): \w+ ([0-9a-f]{64}) on ", check.stdout, re.M))
    assert named == damaged, check.stdout

    repair = run_cli("fsck", "--repair", cwd=a)
    assert set(re.findall(r"^repaired: \w+ \w+ ([0-9a-f]{64}) on ", repair.stdout, re.M)) == damaged
    assert "repaired" in repair.stdout.splitlines()[-1]
    again = run_cli("fsck", cwd=a)
    assert again.stdout.startswith("ok:") and "repaired" not in again.stdout
    assert {p.name for p in victim.glob("*/*")} >= damaged
    _clone_matches(tmp_path, f"dir:{backends[1]}", tree, "after-repair")
