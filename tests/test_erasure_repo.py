"""An erasure-coded repository end to end, through the real ``metasync`` command:
``init --erasure 2/3`` stores objects of 1 MiB or more as 3 fragments on 3
backends, any 2 of which rebuild them (metasync/erasure.py; docs/FORMAT.md §15).
"""

from __future__ import annotations

import json
import random
import re
import shutil
from pathlib import Path

import pytest

from conftest import run_cli, snapshot

NAMESPACE = "metasync"


def _fragments(backend: Path) -> list[Path]:
    return sorted(p for p in (backend / NAMESPACE / "objects").glob("*/*.f*"))


def test_erasure_2_of_3_survives_any_backend_at_one_and_a_half_times_the_size(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Three backends, 2/3 coding, 24 MiB of incompressible files plus small ones:
    ``backend list`` prints about 1.5x storage; with any one backend folder gone, a
    clone from each of the other two is identical; a deleted and a corrupted
    fragment are found by fsck and rebuilt by ``fsck --repair``; a 4th backend
    takes its share of fragments and the repository stays whole."""
    # 2 MiB packs: a dozen coded objects, so the 4th backend below surely gets some
    # fragments (with the default 16 MiB packs there were two objects, and about 1 in 16
    # repository keys would place neither on it, by the mapping's odds).
    monkeypatch.setenv("METASYNC_PACK_SIZE", str(2 << 20))
    backends = [tmp_path / f"b{i}" for i in range(4)]
    for b in backends:
        b.mkdir()
    a = tmp_path / "A"
    rng = random.Random(4)
    for i in range(6):
        (a / "photos").mkdir(parents=True, exist_ok=True)
        (a / "photos" / f"p{i}.raw").write_bytes(rng.randbytes(4 << 20))
    for i in range(30):
        (a / "notes" / f"n{i % 3}").mkdir(parents=True, exist_ok=True)
        (a / "notes" / f"n{i % 3}" / f"{i}.txt").write_text(f"note {i}\n" * 20)
    out = run_cli("init", str(a), "--erasure", "2/3", *(f"--backend=dir:{b}" for b in backends[:3]))
    assert "erasure 2/3" in out.stdout
    run_cli("push", "-m", "photos", cwd=a)
    tree = snapshot(a)

    listing = json.loads(run_cli("backend", "list", "--json", cwd=a).stdout)
    assert listing["erasure"] == [2, 3]
    assert 1.4 <= listing["overhead"] <= 1.6, listing
    assert re.search(r"\(1\.[45]\dx, erasure 2/3\)", run_cli("backend", "list", cwd=a).stdout)
    assert all(_fragments(b) for b in backends[:3])  # every backend holds fragments

    for lost in range(3):
        away = tmp_path / "away"
        backends[lost].rename(away)
        try:
            for source in range(3):
                if source == lost:
                    continue
                clone = tmp_path / f"clone-{lost}-{source}"
                run_cli("clone", f"dir:{backends[source]}", str(clone))
                assert snapshot(clone) == tree, (lost, source)
                shutil.rmtree(clone)
        finally:
            away.rename(backends[lost])

    # Damage: one fragment deleted, another flipped.
    frags = _fragments(backends[0]) + _fragments(backends[1])
    rng.shuffle(frags)
    frags[0].unlink()
    data = bytearray(frags[1].read_bytes())
    data[len(data) // 2] ^= 1
    frags[1].write_bytes(bytes(data))
    bad = run_cli("fsck", cwd=a, check=False)
    assert bad.returncode == 1
    assert "missing: fragment" in bad.stdout and "corrupt: fragment" in bad.stdout, bad.stdout
    fixed = run_cli("fsck", "--repair", cwd=a)
    assert fixed.stdout.count("repaired:") == 2, fixed.stdout
    assert run_cli("fsck", cwd=a).stdout.startswith("ok:")

    # A fourth backend: fragments move to it, nothing is lost.
    run_cli("backend", "add", f"dir:{backends[3]}", cwd=a)
    assert _fragments(backends[3])
    assert run_cli("fsck", cwd=a).stdout.startswith("ok:")
    clone = tmp_path / "clone-after-add"
    run_cli("clone", f"dir:{backends[3]}", str(clone))
    assert snapshot(clone) == tree
