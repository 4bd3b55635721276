"""A backend cannot stop the repository with a compaction floor it made up
(issue 16, scenario 6).

Floors are named ``floor/<12 digits>`` and were read from the names alone, so an
empty file ``floor/999999999999`` on one backend made every push and pull fail
("the log compaction floor kept moving"). A floor now counts only once its
record decodes under the repository key with its own name as context and says
what its name says; anything else is ignored, reported naming the backend and
the key, listed by ``fsck`` and removed by ``fsck --repair``. Real ``dir:``
backends and the real ``metasync`` command throughout.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import run_cli, snapshot
from metasync import Repository, context
from metasync.backends.faulty import FaultyBackend

NAMESPACE = "metasync"
BOGUS = "999999999999"


def _floors(backend: Path) -> list[Path]:
    return sorted(p for p in (backend / NAMESPACE / "floor").glob("*") if p.name.isdigit())


def _compacted_repo(tmp_path: Path, *flags: str) -> tuple[Path, Path, list[Path]]:
    """Folders A and B (a clone) over three backends whose logs gc compacted, so
    every backend holds one genuine floor record."""
    backends = [tmp_path / f"b{i}" for i in range(3)]
    for b in backends:
        b.mkdir()
    a = tmp_path / "A"
    a.mkdir()
    run_cli("init", str(a), *flags, *(f"--backend=dir:{b}" for b in backends))
    for i in range(3):
        (a / f"file{i}.txt").write_text(f"version {i}\n")
        run_cli("push", cwd=a)
    run_cli("gc", "--log-grace", "0", cwd=a)  # leaves a mark
    (a / "late.txt").write_text("after the mark\n")
    run_cli("push", cwd=a)
    out = run_cli("gc", "--log-grace", "0", cwd=a).stdout
    assert "compacted the logs of versions before" in out, out
    b = tmp_path / "B"
    run_cli("clone", f"dir:{backends[1]}", str(b), *(["--no-encrypt"] if "--no-encrypt" in flags else []))
    return a, b, backends


@pytest.mark.parametrize("content", ["empty", "garbage", "replayed"])
@pytest.mark.parametrize("encrypted", [True, False], ids=["encrypted", "plain"])
def test_a_planted_floor_is_ignored_and_reported(
        tmp_path: Path, content: str, encrypted: bool) -> None:
    """``floor/999999999999`` planted on one backend -- empty, garbage, or the bytes
    of the genuine floor record of another number -- is not obeyed: push and pull
    go on, each names the backend and the key, fsck lists it and ``--repair``
    removes it."""
    a, b, backends = _compacted_repo(tmp_path, *([] if encrypted else ["--no-encrypt"]))
    genuine = _floors(backends[0])
    assert len(genuine) == 1
    planted = backends[0] / NAMESPACE / "floor" / BOGUS
    planted.write_bytes({"empty": b"", "garbage": b"\x00garbage{\"floor\": 1}",
                         "replayed": genuine[0].read_bytes()}[content])

    (a / "after.txt").write_text("pushed past a planted floor\n")
    pushed = run_cli("push", cwd=a, check=False)
    assert pushed.returncode == 0, pushed.stderr
    assert f"floor/{BOGUS}" in pushed.stderr and str(backends[0]) in pushed.stderr, pushed.stderr
    pulled = run_cli("pull", cwd=b, check=False)
    assert pulled.returncode == 0, pulled.stderr
    assert snapshot(b) == snapshot(a)
    (b / "from-b.txt").write_text("and back\n")
    run_cli("push", cwd=b)
    run_cli("pull", cwd=a)
    assert (a / "from-b.txt").read_text() == "and back\n"

    checked = run_cli("fsck", cwd=a, check=False)
    assert checked.returncode != 0 and f"floor/{BOGUS}" in checked.stdout + checked.stderr
    run_cli("fsck", "--repair", cwd=a)
    assert not planted.exists() and _floors(backends[0]) == genuine
    assert run_cli("fsck", cwd=a).returncode == 0


def test_a_forged_latest_hint_is_ignored_reported_and_repaired(tmp_path: Path) -> None:
    """A ``latest`` hint that does not decode under the repository key: a client
    behind learns without it, says which backend holds it, fsck lists it and
    ``--repair`` removes it (the next push writes a genuine one)."""
    backends = [tmp_path / f"b{i}" for i in range(3)]
    for b in backends:
        b.mkdir()
    a, b = tmp_path / "A", tmp_path / "B"
    a.mkdir()
    run_cli("init", str(a), *(f"--backend=dir:{x}" for x in backends))
    (a / "one.txt").write_text("one\n")
    run_cli("push", cwd=a)
    run_cli("clone", f"dir:{backends[1]}", str(b))
    for i in range(3):
        (a / f"more{i}.txt").write_text(f"{i}\n")
        run_cli("push", cwd=a)
    hint = backends[0] / NAMESPACE / "latest"
    assert hint.exists()
    hint.write_bytes(b'{"version": 999999, "config": "forged"}')

    pulled = run_cli("pull", cwd=b, check=False)
    assert pulled.returncode == 0, pulled.stderr
    assert snapshot(b) == snapshot(a)
    assert "latest" in pulled.stderr and str(backends[0]) in pulled.stderr, pulled.stderr
    checked = run_cli("fsck", cwd=b, check=False)
    assert checked.returncode != 0 and "latest" in checked.stdout, checked.stdout
    run_cli("fsck", "--repair", cwd=b)
    assert not hint.exists()
    (b / "after.txt").write_text("after\n")
    run_cli("push", cwd=b)
    assert hint.exists() and run_cli("fsck", cwd=b).returncode == 0


def test_a_verified_floor_costs_no_read_in_later_commands(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A floor key is written once, so a client that verified its record remembers
    it: its next commands list ``floor/`` but read no floor record again."""
    a, _, backends = _compacted_repo(tmp_path)
    genuine = f"floor/{_floors(backends[0])[0].name}"
    reads: list[str] = []

    class Counting(FaultyBackend):
        def get(self, key: str) -> bytes:
            reads.append(key)
            return super().get(key)

    real_open = context.open_backend
    monkeypatch.setattr(context, "open_backend",
                        lambda uri, namespace: Counting(real_open(uri, namespace)))
    for push, expected in enumerate((3, 0, 0)):  # one verification per backend, then none
        reads.clear()
        (a / "more.txt").write_text(f"push {push}\n")
        with Repository.open(a) as repo:
            repo.push()
        assert reads.count(genuine) == expected, reads
