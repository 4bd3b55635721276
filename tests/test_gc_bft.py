"""In ``--bft`` mode a faulty backend cannot make gc delete a push in progress
(issue 16, scenario 10).

A push announces the objects it is about to upload (``pending`` in its
``clients/<id>`` record) before uploading, and gc keeps every announced object.
With 5 backends (f = 1) the push used to need its announcement on a simple
majority (3) and gc read a simple majority (3): the two sets can meet in one
backend, and if that one is faulty and replays the client's older record, gc
sees no announcement and deletes the uploads. Both sides now use the Byzantine
quorum (4 of 5), so the sets meet in at least f + 1 = 2 backends, one of them
honest (docs/protocol.md, "Garbage collection and Byzantine backends").

Real ``dir:`` backends, each behind a :class:`FaultyBackend` that refuses what
the scenario needs; the stale record is the client's own earlier record,
written back on the faulty backend.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import backend_dirs, run_cli, snapshot
from metasync import Repository, context
from metasync.backends import Backend
from metasync.backends.faulty import ALWAYS, Faults, FaultyBackend
from metasync.errors import BackendUnavailable, MetasyncError

NAMESPACE = "metasync"


def _objects(backends: dict[str, Path]) -> set[str]:
    return {p.name for b in backends.values() for p in (b / NAMESPACE / "objects").glob("*/*")}


@pytest.mark.parametrize("announced_on", [3, 4])
def test_bft_gc_keeps_a_push_in_progress_despite_a_stale_client_record(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, announced_on: int) -> None:
    """5 backends, ``--bft``. A's push can write its announcement on only
    ``announced_on`` backends (the others refuse ``clients/`` writes) and then
    cannot get its version decided (every log append refused): a push in
    progress, its uploads on the backends. C's gc cannot list ``clients/`` on
    the first 5 - ``announced_on`` - 1 backends, and backend b2 serves A's
    previous record (no ``pending``). Whatever gc does, every object A uploaded
    is still there; and once the faults are gone, A's push completes and C pulls
    it, fsck clean."""
    b = backend_dirs(tmp_path, *(f"b{i}" for i in range(5)))
    a, c = tmp_path / "A", tmp_path / "C"
    a.mkdir()
    (a / "start.txt").write_text("start\n")
    run_cli("init", str(a), "--bft", *(f"--backend=dir:{p}" for p in b.values()))
    run_cli("push", cwd=a)
    records = list((b["b2"] / NAMESPACE / "clients").iterdir())
    assert len(records) == 1  # A's, as published after its first push: no pending
    stale = records[0].read_bytes()
    run_cli("clone", f"dir:{b['b0']}", str(c))
    run_cli("config", "retention", "0", cwd=c)

    faults = Faults()
    real_open = context.open_backend

    def open_faulty(uri: str, namespace: str) -> Backend:
        return FaultyBackend(real_open(uri, namespace), faults, label=uri.rsplit("/", 1)[-1])

    monkeypatch.setattr(context, "open_backend", open_faulty)
    # A's push: the announcement reaches only the first ``announced_on`` backends,
    # and no vote gets through, so the push stays in progress after uploading.
    for i in range(announced_on, 5):
        faults.refuse("put", "clients/", backend=f"b{i}", times=ALWAYS,
                      error=BackendUnavailable, message=f"b{i} unreachable")
    faults.refuse(("append", "append_at"), "log/", times=ALWAYS,
                  error=BackendUnavailable, message="unreachable")
    (a / "big.bin").write_bytes(bytes(range(256)) * 4000)
    before = _objects(b)
    with Repository.open(a) as repo, pytest.raises(MetasyncError):
        repo.push()
    in_progress = _objects(b) - before
    faults.clear()

    # C's gc: b2 replays A's earlier record; the backends that have A's
    # announcement besides b2 are the ones gc cannot list, all but one of them.
    (b["b2"] / NAMESPACE / "clients" / records[0].name).write_bytes(stale)
    for i in (0, 1)[: 5 - announced_on]:
        faults.refuse("list", "clients", backend=f"b{i}", times=ALWAYS,
                      error=BackendUnavailable, message=f"b{i} unreachable")
    with Repository.open(c) as repo:
        try:
            repo.gc(log_grace_s=0)
        except MetasyncError:
            pass  # refusing is fine: deleting is not
    assert in_progress <= _objects(b), "gc deleted objects of a push in progress"
    faults.clear()

    with Repository.open(a) as repo:
        repo.push()
    run_cli("pull", cwd=c)
    assert snapshot(c) == snapshot(a)
    assert run_cli("fsck", cwd=c).returncode == 0
