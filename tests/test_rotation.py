"""Key rotation: re-encrypting what the backends hold under a new data key
(metasync/maintenance/rekey.py; docs/FORMAT.md §5.1 and §6 "Re-keyed packs").

The pass is checked on real ``dir:`` backends of repositories made by the real
``metasync`` command: afterwards no stored item opens under the old data key and
every one opens under the new key alone; killed (like ``kill -9``) at write after
write, every stored item opens under one of the ring's keys at each crash, and the
next run finishes the job.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from conftest import run_cli
from metasync.backends import Backend, open_backend
from metasync.codec import Codec
from metasync.erasure import ErasureScheme
from metasync.errors import CorruptObject, ObjectUnavailable
from metasync.keys import Keyring
from metasync.keyslots import LocalKey
from metasync.layout import LOG_PREFIX, object_key, parse_fragment_key
from metasync.maintenance.rekey import Rekeyer, RekeyReport

NEW_KEY = bytes(range(100, 132))


def old_ring(folder: Path) -> Keyring:
    return LocalKey.from_bytes((folder / ".metasync" / "key").read_bytes()).ring


def rotated(ring: Keyring, *, keep_old: bool = True) -> Keyring:
    """``ring`` with epoch 1 (``NEW_KEY``) current, with or without the old epochs."""
    keys = {**ring.data_keys, 1: NEW_KEY} if keep_old else {1: NEW_KEY}
    return Keyring(ring.id_key, keys, 1)


def open_all(backends: list[Path]) -> dict[str, Backend]:
    return {str(i): open_backend(f"dir:{b}", "metasync") for i, b in enumerate(backends)}


def rekey(backends: list[Path], ring: Keyring, scheme: ErasureScheme | None) -> RekeyReport:
    with ThreadPoolExecutor(4) as pool:
        return Rekeyer(Codec(ring), open_all(backends), scheme, pool).run()


def stored_items(backends: list[Path]) -> Iterator[tuple[str, bytes]]:
    """Every stored item a key opens, as ``(key, stored bytes)``: pPaxos logs (never
    rewritten), descriptors, key files, scratch keys and fragments (see
    :func:`coded_objects`) aside."""
    for backend in open_all(backends).values():
        for key in backend.list():
            if key.startswith((LOG_PREFIX + "/", "keys/", "probe/")) or key == "metasync.json" \
                    or parse_fragment_key(key) is not None:
                continue
            yield key, backend.get(key)


def opens(checker: Rekeyer, key: str, stored: bytes) -> bool:
    """Whether the checker's keyring opens the item ``stored`` at ``key``."""
    try:
        checker._fresh(key, stored)
        return True
    except CorruptObject:
        return False


def openers(backends: list[Path], ring: Keyring, scheme: ErasureScheme | None) -> dict[str, int]:
    """How many stored items (logs excepted) each key of ``ring`` alone opens:
    ``{"old": n, "new": m, "neither": k}``; every item is checked whole."""
    counts = {"old": 0, "new": 0, "neither": 0}
    only_old = Keyring(ring.id_key, {e: k for e, k in ring.data_keys.items() if e != 1},
                       min(e for e in ring.data_keys if e != 1))
    only_new = Keyring(ring.id_key, {1: NEW_KEY}, 1)
    with ThreadPoolExecutor(1) as pool:
        checkers = {name: Rekeyer(Codec(r), open_all(backends), scheme, pool)
                    for name, r in (("old", only_old), ("new", only_new))}
        for key, stored in stored_items(backends):
            name = next((n for n, c in checkers.items() if opens(c, key, stored)), "neither")
            counts[name] += 1
        if scheme is not None:
            for name, checker in checkers.items():
                # An erasure-coded object, rebuilt from its fragments, counts once.
                counts[f"coded-{name}"] = 0
                for object_id, holders in coded_objects(backends).items():
                    try:
                        checker._fresh(object_key(object_id), checker.rebuilt(object_id, holders))
                        counts[f"coded-{name}"] += 1
                    except (CorruptObject, ObjectUnavailable):
                        pass
    return counts


def coded_objects(backends: list[Path]) -> dict[str, dict[int, list[str]]]:
    found: dict[str, dict[int, list[str]]] = {}
    for backend_id, backend in open_all(backends).items():
        for key in backend.list("objects"):
            parsed = parse_fragment_key(key)
            if parsed:
                found.setdefault(parsed[0], {}).setdefault(parsed[1], []).append(backend_id)
    return found


@pytest.fixture(scope="module")
def pushed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Path]]:
    """A folder pushed twice to three backends (R=2, encrypted), with a pending
    client state, hints, configs and packs of several kinds."""
    root = tmp_path_factory.mktemp("rot")
    backends = [root / f"b{i}" for i in range(3)]
    for b in backends:
        b.mkdir()
    a = root / "A"
    a.mkdir()
    rng = random.Random(3)
    for i in range(40):
        (a / f"d{i % 4}").mkdir(exist_ok=True)
        (a / f"d{i % 4}" / f"f{i}.txt").write_bytes(rng.randbytes(rng.choice([10, 900, 20000])))
    run_cli("init", str(a), *(f"--backend=dir:{b}" for b in backends))
    run_cli("push", "-m", "one", cwd=a)
    (a / "d0" / "more.txt").write_text("more\n")
    run_cli("push", "-m", "two", cwd=a)
    return a, backends


def copy_of(pushed: tuple[Path, list[Path]], tmp_path: Path) -> tuple[Path, list[Path]]:
    import shutil

    a, backends = pushed
    shutil.copytree(a, tmp_path / "A", symlinks=True)
    copies = []
    for b in backends:
        shutil.copytree(b, tmp_path / b.name, symlinks=True)
        copies.append(tmp_path / b.name)
    return tmp_path / "A", copies


def test_a_rekeyed_repository_opens_under_the_new_key_alone(
        pushed: tuple[Path, list[Path]], tmp_path: Path) -> None:
    a, backends = copy_of(pushed, tmp_path)
    ring = rotated(old_ring(a))
    before = openers(backends, ring, None)
    assert before["new"] == 0 and before["old"] > 10 and before["neither"] == 0, before
    report = rekey(backends, ring, None)
    assert report.complete, report
    assert report.rewritten == before["old"]
    after = openers(backends, ring, None)
    assert after == {"old": 0, "new": before["old"], "neither": 0}, after
    # A second pass finds nothing left to do.
    again = rekey(backends, ring, None)
    assert again.complete and again.rewritten == 0


def _crash_script(backends: list[Path], ring: Keyring) -> str:
    return (
        "import sys\n"
        "from concurrent.futures import ThreadPoolExecutor\n"
        "from metasync.backends import open_backend\n"
        "from metasync.codec import Codec\n"
        "from metasync.keys import Keyring\n"
        "from metasync.maintenance.rekey import Rekeyer\n"
        f"ring = Keyring(bytes.fromhex({ring.id_key.hex()!r}), "
        f"{{e: bytes.fromhex(k) for e, k in {({e: k.hex() for e, k in ring.data_keys.items()})!r}.items()}}, 1)\n"
        f"dirs = {[str(b) for b in backends]!r}\n"
        "backends = {str(i): open_backend('dir:' + d, 'metasync') for i, d in enumerate(dirs)}\n"
        "with ThreadPoolExecutor(1) as pool:\n"
        "    r = Rekeyer(Codec(ring), backends, None, pool).run()\n"
        "print(r.rewritten, len(r.left))\n"
    )


def test_a_rekey_killed_at_any_write_leaves_every_item_readable_and_is_finished_by_the_next(
        pushed: tuple[Path, list[Path]], tmp_path: Path) -> None:
    """kill -9 (``os._exit`` at the crash point) before write 1, 2, ... of a pass, at
    20 points spread over the whole pass: after each crash every stored item opens
    under the old or the new key; the next pass finishes, and then only the new key
    opens anything."""
    a, backends = copy_of(pushed, tmp_path)
    ring = rotated(old_ring(a))
    total = openers(backends, ring, None)["old"]
    points = sorted(random.Random(5).sample(range(1, total + 1), min(20, total)))
    script = _crash_script(backends, ring)
    done = 0
    for point in points:
        env = {**os.environ, "METASYNC_CRASH_AT": f"rekey:write:{point - done}"}
        proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                              text=True)
        assert proc.returncode == 137, proc.stderr
        done = point - 1
        state = openers(backends, ring, None)
        assert state["neither"] == 0, (point, state)
        assert state["new"] == done, (point, state)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          check=True)
    assert proc.stdout.split() == [str(total - done), "0"]
    assert openers(backends, ring, None) == {"old": 0, "new": total, "neither": 0}


def test_erasure_coded_objects_are_rekeyed_whole(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """2/3 coding: every coded object is rebuilt, re-keyed and written again as three
    fragments that rebuild under the new key alone; 3/4 coding (where a crash between
    two fragment writes could leave fewer than K of either encoding) is reported and
    left untouched."""
    monkeypatch.setenv("METASYNC_PACK_SIZE", str(1 << 20))
    for k, n in ((2, 3), (3, 4)):
        backends = [tmp_path / f"{k}{n}b{i}" for i in range(n)]
        for b in backends:
            b.mkdir()
        a = tmp_path / f"A{k}{n}"
        a.mkdir()
        (a / "big.bin").write_bytes(random.Random(k).randbytes(3 << 20))
        run_cli("init", str(a), "--erasure", f"{k}/{n}", *(f"--backend=dir:{b}" for b in backends))
        run_cli("push", "-m", "big", cwd=a)
        scheme = ErasureScheme(k, n)
        ring = rotated(old_ring(a))
        coded = len(coded_objects(backends))
        assert coded >= 2
        assert openers(backends, ring, scheme)["coded-old"] == coded
        report = rekey(backends, ring, scheme)
        after = openers(backends, ring, scheme)
        if n >= 2 * k - 1:
            assert report.complete, report
            assert after["coded-new"] == coded and after["coded-old"] == 0, after
        else:
            assert len(report.left) == coded and "cannot be re-keyed in place" in report.left[0]
            assert after["coded-old"] == coded, after


OTHER = "a second passphrase, for bob"


def _items_opened_by(backends: list[Path], ring: Keyring) -> int:
    """Stored items (logs, descriptors, key files aside) that ``ring`` opens."""
    with ThreadPoolExecutor(1) as pool:
        checker = Rekeyer(Codec(ring), open_all(backends), None, pool)
        return sum(opens(checker, key, stored) for key, stored in stored_items(backends))


def test_key_rotate_revokes_a_removed_device_and_survives_kill_9(tmp_path: Path) -> None:
    """Alice's repository has a second passphrase (Bob's device, cloned with it) and
    a second device of Alice's. Bob's device is lost: `key remove` its slot, then
    `key rotate`, killed (kill -9) after it starts, before its first and its last
    write, at every sixth of its re-encryption pass and before it retires the old
    key, and run again each time. After every kill `metasync fsck` passes; once done, the
    old keyring (Bob's stolen `.metasync/key`) opens no stored item, Bob's device
    fails in one line, and Alice's other device follows the new key and syncs."""
    dirs = [tmp_path / f"b{i}" for i in range(3)]
    for d in dirs:
        d.mkdir()
    a, a2, bob = tmp_path / "A", tmp_path / "A2", tmp_path / "bob"
    a.mkdir()
    for i in range(30):
        (a / f"d{i % 3}").mkdir(exist_ok=True)
        (a / f"d{i % 3}" / f"f{i}.txt").write_bytes(random.Random(i).randbytes(3000))
    run_cli("init", str(a), *(f"--backend=dir:{d}" for d in dirs))
    run_cli("push", "-m", "one", cwd=a)
    run_cli("key", "add", "--label", "bob", cwd=a, passphrase=None,
            env_extra={"METASYNC_NEW_PASSPHRASE": OTHER})
    run_cli("clone", f"dir:{dirs[1]}", str(bob), passphrase=OTHER)
    run_cli("clone", f"dir:{dirs[2]}", str(a2))
    stolen = LocalKey.from_bytes((bob / ".metasync" / "key").read_bytes())
    run_cli("key", "remove", str(stolen.slot), cwd=a, passphrase=None)
    (a / "d0" / "after-removal.txt").write_text("before the rotation\n")
    run_cli("push", "-m", "two", cwd=a)
    assert _items_opened_by(dirs, stolen.ring) > 20

    # Where a rotation can die: each write of the re-encryption, and the steps.
    trace = tmp_path / "trace"
    env = {"METASYNC_CRASH_AT": "never", "METASYNC_CRASH_TRACE": str(trace)}
    dry = tmp_path / "dry"
    import shutil

    shutil.copytree(a, dry / "A", symlinks=True)
    for d in dirs:
        shutil.copytree(d, dry / d.name, symlinks=True)
    # The dry run on a copy (its backends' paths differ: only the counts matter).
    run_cli("key", "rotate", cwd=a, passphrase=None, env_extra=env, check=False)
    shutil.rmtree(a)
    for d in dirs:
        shutil.rmtree(d)
        shutil.copytree(dry / d.name, d, symlinks=True)
    shutil.copytree(dry / "A", a, symlinks=True)
    names = trace.read_text().split()
    writes = names.count("rekey:write")
    assert writes > 20 and {"rotate:started", "rotate:retiring"} <= set(names), names[:5]
    # The pass goes backend by backend, each holding about a third of the writes, so
    # a cut at every sixth falls inside each backend's stretch (that backend part
    # re-keyed, the copies of an item under both keys) and near each boundary (every
    # kind of record -- hint, client states, configurations, packs -- new on one
    # backend and old on the next); the first and the last write are the ends of the
    # pass. Crashes write by write are test_a_rekey_killed_at_any_write_...'s.
    cuts = {1, writes, *(round(writes * i / 6) for i in range(1, 6))}
    points = ["rotate:started:1", *(f"rekey:write:{n}" for n in sorted(cuts)),
              "rotate:retiring:1"]
    done = 0
    for point in points:
        name, _, count = point.rpartition(":")
        if name == "rekey:write":
            count = str(int(count) - done)
            done = int(point.rpartition(":")[2])
        proc = run_cli("key", "rotate", cwd=a, passphrase=None, check=False,
                       env_extra={"METASYNC_CRASH_AT": f"{name}:{count}"})
        assert proc.returncode == 137, (point, proc.stderr)
        check = run_cli("fsck", cwd=a, passphrase=None, check=False)
        assert check.returncode == 0, (point, check.stdout, check.stderr)
        if name == "rekey:write":
            done -= 1  # the write the crash came before is done by the next run
    out = run_cli("key", "rotate", cwd=a, passphrase=None).stdout
    assert "Rotated the repository's key" in out
    assert run_cli("fsck", cwd=a, passphrase=None).returncode == 0

    assert _items_opened_by(dirs, stolen.ring) == 0
    assert _items_opened_by(dirs, old_ring(a)) > 20  # the new keyring opens them all
    proc = run_cli("pull", cwd=bob, passphrase=None, check=False)
    assert proc.returncode != 0 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "removed" in proc.stderr and "Traceback" not in proc.stderr
    run_cli("pull", cwd=a2, passphrase=None)
    assert (a2 / "d0" / "after-removal.txt").read_text() == "before the rotation\n"
    (a2 / "from-a2.txt").write_text("after the rotation\n")
    run_cli("push", "-m", "three", cwd=a2, passphrase=None)
    run_cli("pull", cwd=a, passphrase=None)
    assert (a / "from-a2.txt").read_text() == "after the rotation\n"
    fresh = tmp_path / "fresh"
    run_cli("clone", f"dir:{dirs[0]}", str(fresh))
    assert (fresh / "from-a2.txt").exists()


def test_a_rotation_warns_of_no_tampering_here_or_on_another_device(
        tmp_path: Path, backends: list[Path]) -> None:
    """``key rotate`` re-encrypts every backend's ``latest`` hint under the new key:
    the rotating client reads them with it (it used to warn, once per backend, that
    each hint "does not decode ... the backend may be tampering with it"), and so
    does another device once it has fetched the new key."""
    a, other = tmp_path / "a", tmp_path / "other"
    a.mkdir()
    (a / "x.txt").write_text("one\n")
    run_cli("init", str(a), *(f"--backend=dir:{d}" for d in backends))
    run_cli("push", "-m", "one", cwd=a)
    run_cli("clone", f"dir:{backends[0]}", str(other))
    rotated = run_cli("key", "rotate", cwd=a)
    assert "Rotated the repository's key" in rotated.stdout
    assert "ignored" not in rotated.stderr and "tampering" not in rotated.stderr, rotated.stderr
    (a / "y.txt").write_text("after the rotation\n")
    run_cli("push", "-m", "two", cwd=a)
    pulled = run_cli("pull", cwd=other)
    assert "tampering" not in pulled.stderr, pulled.stderr
    assert (other / "y.txt").read_text() == "after the rotation\n"
