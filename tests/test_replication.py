"""Copies a backend refused, written again later: never from a rotten copy, and
whole copies and erasure-coded fragments alike (issue 14's two bugs).

Each test refuses some writes to one backend during a push (as a full disk or a
flaky service would: the write fails and the backend counts as down for the
rest of that command), then lets a later push or ``fsck --repair`` write the
missed copies through the replicator.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from metasync import Repository
from metasync.layout import fragment_key, object_key
from metasync.replicator import verify_stored

NAMESPACE = "metasync"


def _refuse(repo: Repository, monkeypatch: pytest.MonkeyPatch, backend_id: str | None,
            fragments_only: bool = False) -> list[str]:
    """Make every write to ``backend_id`` of a whole copy (or, with
    ``fragments_only``, of a fragment) fail during this session, as a put that
    raised would: the write does not happen and the backend counts as down.
    ``backend_id`` None: the first backend such a write goes to (the placement of a
    few objects may give one backend none). Returns a list that holds the refused
    backend's id once one was."""
    store = repo.store
    real = store.put_copy
    chosen = [] if backend_id is None else [backend_id]

    def put_copy(target: str, stored_id: str, data: Any, key: str | None = None) -> str | None:
        is_fragment = key is not None and key != object_key(stored_id)
        if is_fragment == fragments_only and not chosen:
            chosen.append(target)
        if chosen and target == chosen[0] and is_fragment == fragments_only:
            store.down.setdefault(target, "refused (injected)")
            return "refused (injected)"
        return real(target, stored_id, data, key)

    monkeypatch.setattr(store, "put_copy", put_copy)
    return chosen


def _path(backend_dir: Path, key: str) -> Path:
    return backend_dir / NAMESPACE / Path(*key.split("/"))


def _dirs(tmp_path: Path, n: int) -> list[Path]:
    dirs = [tmp_path / f"b{i}" for i in range(n)]
    for d in dirs:
        d.mkdir()
    return dirs


def _refused_repo(
    tmp_path: Path, passphrase: Callable[[], str], monkeypatch: pytest.MonkeyPatch,
    *, size: int, refuse_index: int | None, fragments_only: bool = False,
    erasure: tuple[int, int] | None = None,
) -> tuple[Repository, list[Path], list[str], str]:
    """A repository over 3 folders (R=2, or ``erasure``) whose first push had every
    write of a whole copy (or of a fragment) to one backend refused; returns it
    reopened with the faults gone, the backend folders, the backend ids and the
    refused backend's id."""
    dirs = _dirs(tmp_path, 3)
    src = tmp_path / "src"
    src.mkdir()
    (src / "data.bin").write_bytes(os.urandom(size))
    repo = Repository.init(src, [f"dir:{d}" for d in dirs], replicas=2, erasure=erasure,
                           passphrase=passphrase)
    ids = list(repo.config.acceptors)
    chosen = _refuse(repo, monkeypatch, None if refuse_index is None else ids[refuse_index],
                     fragments_only)
    assert repo.push("first").missing_copies >= 1
    refused = chosen[0]
    assert all(b == refused for _, b in repo.missing_copies())
    monkeypatch.undo()
    repo.close()
    return Repository.open(src), dirs, ids, refused


def test_repair_never_copies_a_rotten_copy(
    tmp_path: Path, passphrase: Callable[[], str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """R=2 over 3 backends; one holder refuses the upload; the only other copy then
    rots (zeros). The next push must not write the zeros onto the refused holder,
    must keep the missing-copy row (the copy is still missing), and must say so;
    fsck then reports the rotten copy. (On main before the split, the push copied
    the zeros and cleared the row: both copies corrupt, nothing said.)"""
    repo, dirs, ids, refused = _refused_repo(tmp_path, passphrase, monkeypatch,
                                             size=50_000, refuse_index=None)
    missing = repo.missing_copies()
    by_id = dict(zip(ids, dirs, strict=True))
    rotten: dict[str, Path] = {}
    for sid, _ in missing:
        # Every copy there is -- the other holder's, and the one spilled in place of
        # the refused holder's -- rots.
        copies = [_path(d, object_key(sid)) for b, d in by_id.items() if b != refused]
        for path in (p for p in copies if p.exists()):
            path.write_bytes(b"\0" * path.stat().st_size)
            rotten[sid] = path
    (repo.root / "more.txt").write_text("a second push\n")
    result = repo.push("second")

    for sid, _ in missing:
        target = _path(by_id[refused], object_key(sid))
        assert not target.exists() or target.read_bytes().strip(b"\0"), (
            f"the rotten copy of {sid[:12]} was copied onto the refused holder")
    assert sorted(repo.missing_copies()) == sorted(missing), "the copies are still missing"
    assert result.missing_copies == len(missing)
    notes = repo.reporter.notes  # type: ignore[attr-defined]
    assert any("no good copy" in n for n in notes), notes
    report = repo.fsck()
    assert {(p.object_id, p.problem) for p in report.problems} >= {
        (sid, "corrupt") for sid in rotten}
    repo.close()


def test_refused_copy_is_rewritten_from_a_verified_copy(
    tmp_path: Path, passphrase: Callable[[], str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same refusal without the rot: the next push writes every missed copy,
    byte for byte a good copy, and the missing count goes to 0."""
    repo, dirs, ids, _ = _refused_repo(tmp_path, passphrase, monkeypatch,
                                       size=50_000, refuse_index=None)
    missing = repo.missing_copies()
    result = repo.push()
    assert result.missing_copies == 0 and repo.missing_copies() == []
    by_id = dict(zip(ids, dirs, strict=True))
    codec = repo.store.codec
    for sid, backend_id in missing:
        verify_stored(codec, sid, _path(by_id[backend_id], object_key(sid)).read_bytes())
    assert repo.fsck().ok
    repo.close()


def _coded_repo(tmp_path: Path, passphrase: Callable[[], str],
                monkeypatch: pytest.MonkeyPatch) -> tuple[Repository, list[Path], list[str], str]:
    """A 2-of-3 erasure-coded repository whose first push had the fragments for one
    backend refused (see :func:`_refused_repo`)."""
    return _refused_repo(tmp_path, passphrase, monkeypatch, size=3 * 1024 * 1024,
                         refuse_index=1, fragments_only=True, erasure=(2, 3))


def _fragments_on(backend_dir: Path, stored_id: str) -> list[Path]:
    folder = _path(backend_dir, object_key(stored_id)).parent
    return sorted(folder.glob(f"{stored_id}.f*"))


def test_missed_fragment_is_rebuilt_by_the_next_push(
    tmp_path: Path, passphrase: Callable[[], str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A refused fragment is rebuilt by the next push (from the other fragments),
    the missing count goes to 0, and a push after that reports nothing missing.
    (On main before the split every later push reported the same missing copy,
    and the daemon pushed again on every cycle.)"""
    repo, dirs, ids, refused = _coded_repo(tmp_path, passphrase, monkeypatch)
    missing = repo.missing_copies()
    by_id = dict(zip(ids, dirs, strict=True))
    for sid, _ in missing:
        assert _fragments_on(by_id[refused], sid) == []
    first = repo.push()
    assert first.missing_copies == 0 and repo.missing_copies() == []
    for sid, _ in missing:
        (fragment,) = _fragments_on(by_id[refused], sid)
        index = int(fragment.name.rpartition(".f")[2])
        assert fragment == _path(by_id[refused], fragment_key(sid, index))
    assert repo.push().missing_copies == 0
    report = repo.fsck()
    assert report.ok, report.problems
    repo.close()


def test_fsck_repair_settles_a_missed_fragment(
    tmp_path: Path, passphrase: Callable[[], str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``fsck --repair`` rebuilds the refused fragment and forgets its missing-copy
    row, so the next push has nothing left to repair. (On main before the split
    the row stayed: rows were cleared before fragments were repaired.)"""
    repo, _, _, refused = _coded_repo(tmp_path, passphrase, monkeypatch)
    report = repo.fsck(repair=True)
    assert report.problems and all(p.backend == refused for p in report.problems)
    assert report.ok, report.problems
    assert repo.missing_copies() == []
    assert repo.fsck().ok
    repo.close()
