"""Configuration changes stay durable and live when they go wrong halfway
(docs/design.md, "Living with changing storage").

Four rules a model of the changes found production breaking, each checked here
through real code (the CLI, or the Repository API over ``dir:`` backends with a
failure injected at one precise place):

- a change is decided only after a clean copy to its new holders (F1);
- the rebalance a change needs is recorded, with the configurations it leaves,
  before the change is proposed, and finishing it reads those too (F2);
- the rebalance with drops goes to the newest configuration, whoever decided it
  (F3);
- a change of the acceptors is followed at once by a version decided on the new
  ones, so losing the old configuration's majority strands no one (F5).
"""

from __future__ import annotations

import os
import random
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from conftest import backend_dirs, run_cli, snapshot
from metasync import context
from metasync.backends import Backend
from metasync.backends.faulty import ALWAYS, Faults, FaultyBackend
from metasync.consensus import Consensus
from metasync.errors import MetasyncError
from metasync.layout import parse_object_key
from metasync.maintenance import reconfig
from metasync.objects import Config
from metasync.repository import Repository
from metasync.store import mapping_of

TIMEOUT = ("--timeout", "10")
NAMESPACE = "metasync"


class Crash(BaseException):
    """The process dying at a precise point (nothing after it runs; no handler of
    MetasyncError catches it)."""


def _held(backend: Path) -> set[str]:
    root = backend / NAMESPACE / "objects"
    out = set()
    for path in root.glob("*/*") if root.exists() else ():
        stored_id = parse_object_key(str(path.relative_to(backend / NAMESPACE)))
        if stored_id is not None:
            out.add(stored_id)
    return out


def _latest(repo_dir: Path) -> tuple[int, Config]:
    with Repository.open(repo_dir) as repo:
        latest = repo.learn_latest()
        return latest.number, repo.load_config(latest.config)


def _check_placement(repo_dir: Path, folders: dict[str, Path]) -> None:
    """Every object found on any backend folder is on exactly the backends the
    newest configuration's mapping names for it, and nowhere else."""
    _, config = _latest(repo_dir)
    by_id = {b.id: Path(b.uri.removeprefix("dir:")) for b in config.backends}
    mapping = mapping_of(config)
    held = {path: _held(path) for path in folders.values()}
    for stored_id in set().union(*held.values()):
        where = {path for path, ids in held.items() if stored_id in ids}
        assert where == {by_id[b] for b in mapping.locate(stored_id)}, stored_id


def _repo(tmp_path: Path, b: dict[str, Path], names: tuple[str, ...], files: int = 40,
          replicas: int = 2) -> Path:
    src = tmp_path / "src"
    src.mkdir()
    for i in range(files):
        (src / f"f{i:03d}.bin").write_bytes(random.Random(i).randbytes(400))
    run_cli("init", "--replicas", str(replicas), *(f"--backend=dir:{b[n]}" for n in names),
            cwd=src)
    # A pack per file: many objects, so every backend holds some whatever the
    # repository's random placement key.
    os.environ["METASYNC_PACK_SIZE"] = "300"
    try:
        run_cli("push", cwd=src)
    finally:
        del os.environ["METASYNC_PACK_SIZE"]
    return src


@contextmanager
def _after_first_publish(action: Callable[[], None]) -> Iterator[None]:
    """Run ``action`` right after the next version this process decides is
    published (the moment a configuration change is decided), once."""
    real = Consensus.publish
    fired: list[bool] = []

    def publish(self: Consensus, version: Any) -> None:
        real(self, version)
        if not fired:
            fired.append(True)
            action()

    Consensus.publish = publish  # type: ignore[method-assign]
    try:
        yield
    finally:
        Consensus.publish = real  # type: ignore[method-assign]


# ---------------------------------------------------------------- F1
@pytest.mark.parametrize("fault", ["write", "listing"])
def test_a_change_is_not_decided_unless_every_new_holder_got_its_copies(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fault: str) -> None:
    """A backend being added refuses its object writes (or does not answer its
    listing): nothing is decided, the error says in one line how many objects
    could not be placed, which backend, and that retrying completes it; once the
    backend works, the same command does it and every object is in place."""
    b = backend_dirs(tmp_path, "b1", "b2", "b3", "b4")
    src = _repo(tmp_path, b, ("b1", "b2", "b3"))
    faults = Faults()
    if fault == "write":
        faults.refuse("put", "objects/", times=ALWAYS)
    else:
        faults.refuse("list_sizes", "objects", times=ALWAYS)
    real_open = reconfig.open_backend

    def open_faulty(uri: str, namespace: str) -> Backend:
        return FaultyBackend(real_open(uri, namespace), faults)

    before = _latest(src)
    monkeypatch.setattr(reconfig, "open_backend", open_faulty)
    with Repository.open(src) as repo, pytest.raises(MetasyncError) as refused:
        repo.add_backend(f"dir:{b['b4']}")
    message = str(refused.value)
    assert "\n" not in message, message
    assert str(b["b4"]) in message and "retry" in message, message
    if fault == "write":
        assert "object(s) could not be placed" in message, message
    else:
        assert "did not answer" in message, message
    assert _latest(src) == before, "nothing was decided"

    monkeypatch.setattr(reconfig, "open_backend", real_open)
    run_cli("backend", "add", f"dir:{b['b4']}", cwd=src)
    number, config = _latest(src)
    assert number > before[0] and len(config.backends) == 4
    _check_placement(src, b)


def test_a_copy_that_could_not_be_read_just_now_is_not_lost(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """R=1: removing a live backend whose object reads fail for a moment (listing
    fine). Its copies are not lost -- they are there, unread -- so nothing is
    decided (before, each counted as "no good copy" and the change went through,
    leaving those objects only on the removed backend; found by the simulator,
    seed 1005893 at --bft-share 0.5); once reads work, the removal moves them."""
    b = backend_dirs(tmp_path, "b1", "b2", "b3")
    src = _repo(tmp_path, b, ("b1", "b2", "b3"), files=30, replicas=1)
    only_b3 = _held(b["b3"])
    assert only_b3
    faults = Faults()
    faults.refuse("get", "objects/", times=ALWAYS, message="connection reset")
    real_open = context.open_backend

    def open_flaky_b3(uri: str, namespace: str) -> Backend:
        backend = real_open(uri, namespace)
        return FaultyBackend(backend, faults) if uri.endswith(str(b["b3"])) else backend

    before = _latest(src)
    monkeypatch.setattr(context, "open_backend", open_flaky_b3)
    with Repository.open(src) as repo, pytest.raises(MetasyncError) as refused:
        repo.remove_backend(f"dir:{b['b3']}")
    message = str(refused.value)
    assert "\n" not in message and "could not be read" in message, message
    assert _latest(src) == before, "nothing was decided"
    assert _held(b["b3"]) == only_b3
    monkeypatch.setattr(context, "open_backend", real_open)
    run_cli("backend", "remove", f"dir:{b['b3']}", cwd=src)
    assert _held(b["b3"]) == set()
    _check_placement(src, {n: b[n] for n in ("b1", "b2")})


def test_removing_a_dead_backend_is_not_blocked_by_objects_without_a_good_copy(
        tmp_path: Path) -> None:
    """An object whose every reachable copy is corrupt can never be placed: the
    removal of a dead backend reports it and goes on (else it could never be
    removed)."""
    b = backend_dirs(tmp_path, "b1", "b2", "b3")
    src = _repo(tmp_path, b, ("b1", "b2", "b3"), files=30)
    # An object on b1 and b2 only: b2 dies and b1's copy goes bad.
    victim = sorted(_held(b["b1"]) & _held(b["b2"]))[0]
    shutil.rmtree(b["b2"])
    (b["b1"] / NAMESPACE / "objects" / victim[:2] / victim).write_bytes(b"not the object")
    out = run_cli(*TIMEOUT, "backend", "remove", f"dir:{b['b2']}", cwd=src)
    assert "removed backend" in out.stdout
    assert "1 object(s) have no good copy" in out.stderr, out.stderr


# ---------------------------------------------------------------- F2
def test_a_change_cut_short_right_after_its_decision_is_finished_by_rebalance(
        tmp_path: Path) -> None:
    """``backend remove`` dies right after the change is decided: the rebalance it
    needs was recorded before, so ``backend list`` says so, and ``rebalance``
    empties the removed backend (a source only the old configuration names)."""
    b = backend_dirs(tmp_path, "b1", "b2", "b3", "b4")
    src = _repo(tmp_path, b, ("b1", "b2", "b3", "b4"))
    assert _held(b["b2"])

    def crash() -> None:
        raise Crash()

    with _after_first_publish(crash), Repository.open(src) as repo, pytest.raises(Crash):
        repo.remove_backend(f"dir:{b['b2']}")
    _, config = _latest(src)
    assert str(b["b2"]) not in {s.uri.removeprefix("dir:") for s in config.backends}
    listed = run_cli("backend", "list", cwd=src)
    assert "run `metasync rebalance`" in listed.stderr, listed.stderr
    run_cli("rebalance", cwd=src)
    assert _held(b["b2"]) == set(), "the removed backend is emptied"
    _check_placement(src, {n: b[n] for n in ("b1", "b3", "b4")})
    listed = run_cli("backend", "list", cwd=src)
    assert "rebalance" not in listed.stderr, listed.stderr


# ---------------------------------------------------------------- F3
def test_the_slower_of_two_changes_drops_by_the_newest_configuration(tmp_path: Path) -> None:
    """A adds b4; right after A's change is decided, B removes b3 (deciding after
    A's). A's rebalance with drops must follow B's newer configuration: every
    object ends up exactly where it says, and b3 is emptied."""
    b = backend_dirs(tmp_path, "b1", "b2", "b3", "b4")
    src = _repo(tmp_path, b, ("b1", "b2", "b3"))
    other = tmp_path / "other"
    run_cli("clone", f"dir:{b['b1']}", str(other))

    def remove_b3() -> None:
        with Repository.open(other) as repo_b:
            repo_b.remove_backend(f"dir:{b['b3']}")

    with _after_first_publish(remove_b3), Repository.open(src) as repo:
        repo.add_backend(f"dir:{b['b4']}")
    _, config = _latest(src)
    assert {s.uri.removeprefix("dir:") for s in config.backends} == {
        str(b[n]) for n in ("b1", "b2", "b4")}
    assert _held(b["b3"]) == set()
    _check_placement(src, b)
    run_cli("fsck", cwd=src)


# ---------------------------------------------------------------- F5
def test_clone_and_pull_after_removing_a_dead_backend_and_losing_another_without_a_push(
        tmp_path: Path) -> None:
    """init on b1, b2, b3; a second client clones; backend add b4; b2 dies;
    backend remove b2; no push; b1 dies. The configuration is {b1, b3, b4}, of
    which b3 and b4 answer: a clone from b4 and a pull by the second client work."""
    b = backend_dirs(tmp_path, "b1", "b2", "b3", "b4")
    src = _repo(tmp_path, b, ("b1", "b2", "b3"), files=3)
    second = tmp_path / "second"
    run_cli("clone", f"dir:{b['b3']}", str(second))
    run_cli("backend", "add", f"dir:{b['b4']}", cwd=src)
    shutil.rmtree(b["b2"])
    run_cli(*TIMEOUT, "backend", "remove", f"dir:{b['b2']}", cwd=src)
    shutil.rmtree(b["b1"])
    clone = tmp_path / "clone"
    run_cli(*TIMEOUT, "clone", f"dir:{b['b4']}", str(clone))
    assert snapshot(clone) == snapshot(src)
    run_cli(*TIMEOUT, "pull", cwd=second)
    assert snapshot(second) == snapshot(src)
    (clone / "new.txt").write_text("pushed after the losses\n")
    run_cli(*TIMEOUT, "push", cwd=clone)
    run_cli(*TIMEOUT, "pull", cwd=second)
    assert snapshot(second) == snapshot(clone)
