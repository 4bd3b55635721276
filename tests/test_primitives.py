"""Primitives are verified, not assumed (issue 15, point 4, and two smaller points).

metasync's logs need one atomic primitive per backend: an exclusive create (S3
``If-None-Match: *``, SFTP's link-based rename), or a lock the server enforces
(WebDAV). Servers that accept the request but do not honour it are started here
from real parts (tests/servers/s3_no_conditionals.py, paramiko_sftp.py,
wsgidav_faults.py), and the real ``metasync`` command is run against them:

- ``init`` and ``backend add`` refuse such a backend with one line naming what it
  lacks and what to use instead, and leave nothing behind;
- the mode they suggest (``logs=registers``) is accepted, and two clients racing
  6 rounds of pushes through it lose nothing;
- the error of a refused append is reported as that error, not as contention;
- folders are created before the first write into them (a WebDAV server answering
  500 to a PUT into a missing folder works), and ``init``/``backend add`` create a
  missing WebDAV or SFTP location, but a missing ``dir:`` folder only with ``--mkdir``;
- the check is repeated at most once per period, in commands that talk to backends.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import METASYNC, PASSPHRASE, make_tree, run_cli, snapshot
from metasync import verification
from metasync.backends import open_backend, public_uri
from metasync.backends.faulty import ALWAYS, FaultyBackend
from metasync.backends.local import LocalBackend
from metasync.backends.memory import MemoryBackend
from metasync.codec import Codec
from metasync.consensus import Consensus
from metasync.errors import BackendError, BackendUnavailable, PrimitiveMissing, UsageError
from metasync.layout import DESCRIPTOR_KEY
from metasync.localdb import LocalDB
from metasync.objects import Version
from metasync.state import LocalState
from metasync.verification import RECHECK_SECONDS
from tests.servers.s3_no_conditionals import NoConditionalsS3
from tests.servers.sshd import SshServer
from tests.servers.webdav import WebdavServer

NAMESPACE = "metasync"
ROUNDS = 6


def _tag() -> str:
    return uuid.uuid4().hex[:8]


def with_option(uri: str, name: str, value: str) -> str:
    return f"{uri}{'&' if '?' in uri else '?'}{name}={value}"


def one_line_failure(*args: str, cwd: Path | None = None) -> str:
    """Run the CLI, expect it to fail with exactly one line on stderr; return it."""
    proc = run_cli(*args, cwd=cwd, check=False)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    return lines[0]


@dataclass
class Broken:
    """A server that accepts the request of one primitive and does not honour it."""

    kind: str
    #: A fresh location on it: ``make_uri(tag)`` (the folder exists).
    make_uri: Callable[[str], str]
    #: Words the refusal must contain (the missing primitive, what broke it).
    words: tuple[str, ...]


@pytest.fixture(params=["s3", "sftp", "webdav"])
def broken(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Broken:
    if request.param == "s3":
        proxy: NoConditionalsS3 = request.getfixturevalue("s3_ignoring_if_none_match")
        return Broken("s3", lambda tag: proxy.uri(f"prim-{tag}"),
                      ("lacks an exclusive create", "If-None-Match"))
    if request.param == "sftp":
        sftp: SshServer = request.getfixturevalue("sftp_rename_overwrites")

        def sftp_uri(tag: str) -> str:
            folder = sftp.root_dir / f"prim-{tag}"
            folder.mkdir()
            return sftp.uri(folder)

        return Broken("sftp", sftp_uri, ("lacks an exclusive create", "rename"))
    dav: WebdavServer = request.getfixturevalue("webdav_refusing_locked_move")
    monkeypatch.setenv("METASYNC_WEBDAV_USER", dav.user)
    monkeypatch.setenv("METASYNC_WEBDAV_PASSWORD", dav.password)

    def dav_uri(tag: str) -> str:
        (dav.root_dir / f"prim-{tag}").mkdir()
        return dav.uri(f"prim-{tag}")

    return Broken("webdav", dav_uri, ("lacks a lock", "412"))


def _left_on(uri: str) -> list[str]:
    backend = open_backend(uri, NAMESPACE)
    try:
        return sorted(backend.list()) if backend.exists() else []
    finally:
        backend.close()


# ---------------------------------------------------------------- the servers break it


def test_the_test_servers_really_break_the_primitive(
    s3_ignoring_if_none_match: NoConditionalsS3,
    sftp_rename_overwrites: SshServer,
    webdav_refusing_locked_move: WebdavServer,
) -> None:
    """Without any probing: the S3 endpoint and the SFTP server let a second exclusive
    create of one key succeed (and overwrite), and the WebDAV server refuses a locked
    append. (This is what made two racing clients both "win" a log position.)"""
    tag = _tag()
    (sftp_rename_overwrites.root_dir / tag).mkdir()
    (webdav_refusing_locked_move.root_dir / tag).mkdir()
    s3 = open_backend(s3_ignoring_if_none_match.uri(tag), "ns")
    sftp = open_backend(sftp_rename_overwrites.uri(sftp_rename_overwrites.root_dir / tag), "ns")
    for backend in (s3, sftp):
        backend.create()
        assert backend.put_if_absent("k", b"first") is True
        assert backend.put_if_absent("k", b"second") is True
        assert backend.get("k") == b"second"
        backend.close()
    assert s3_ignoring_if_none_match.stripped >= 2
    dav = open_backend(webdav_refusing_locked_move.uri(tag), "ns")
    dav.create()
    with pytest.raises(BackendError):
        dav.logs.append("log/1", b"m")
    dav.close()


# ---------------------------------------------------------------- refused with one line


def test_init_refuses_a_backend_that_does_not_honour_its_primitive(
    broken: Broken, tmp_path: Path
) -> None:
    """`init` names the missing primitive and the option that would do instead, in one
    line; no repository is created, locally or on the backend, and the probe's scratch
    keys are gone."""
    uri = broken.make_uri(_tag())
    line = one_line_failure("init", str(tmp_path / "r"), "--backend", uri)
    for word in broken.words:
        assert word in line, line
    assert "logs=registers" in line, line
    assert not (tmp_path / "r" / ".metasync").exists()
    assert _left_on(uri) == []


def test_backend_add_refuses_a_backend_that_does_not_honour_its_primitive(
    broken: Broken, tmp_path: Path, backends: list[Path]
) -> None:
    """`backend add` refuses it the same way; the configuration keeps its backends."""
    root = tmp_path / "r"
    root.mkdir()
    (root / "a.txt").write_text("a\n")
    run_cli("init", str(root), "--backend", f"dir:{backends[0]}")
    run_cli("push", cwd=root)
    uri = broken.make_uri(_tag())
    line = one_line_failure("backend", "add", uri, cwd=root)
    for word in broken.words:
        assert word in line, line
    assert "logs=registers" in line, line
    listing = json.loads(run_cli("backend", "list", "--json", cwd=root).stdout)
    assert len(listing["backends"]) == 1
    assert _left_on(uri) == []


# ---------------------------------------------------------------- the accepted mode races safely

#: One client's work: ROUNDS rounds, each adding one file of its own and pushing at once.
WORKER = r"""
import json, os, subprocess, sys
root, name, rounds, metasync = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
os.makedirs(os.path.join(root, name), exist_ok=True)
for k in range(rounds):
    with open(os.path.join(root, name, f"r{k}.txt"), "w") as f:
        f.write(f"{name} round {k}\n")
    proc = subprocess.run([metasync, "push", "-m", f"{name} {k}"], cwd=root,
                          capture_output=True, text=True)
    print(json.dumps({"round": k, "rc": proc.returncode, "out": proc.stdout,
                      "err": proc.stderr}), flush=True)
"""


def race(roots: list[Path], rounds: int) -> list[list[dict[str, object]]]:
    env = {**os.environ, "METASYNC_PASSPHRASE": PASSPHRASE}
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(root), f"client{i}", str(rounds),
                               METASYNC], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env)
             for i, root in enumerate(roots)]
    results = []
    for proc in procs:
        out, err = proc.communicate()
        assert proc.returncode == 0, err
        results.append([json.loads(line) for line in out.splitlines()])
    return results


def files_of(root: Path) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): p.read_text() for p in root.rglob("*")
            if p.is_file() and not p.relative_to(root).as_posix().startswith(".metasync")}


def test_two_clients_racing_in_the_suggested_mode_lose_nothing(
    broken: Broken, tmp_path: Path
) -> None:
    """With the option the refusal suggests (logs=registers), init accepts the same
    server, and two clients (real `metasync` processes) racing 6 rounds of pushes
    each lose nothing: every push reports success, every file of every round is in
    both folders at the end, and both have the same history."""
    uri = with_option(broken.make_uri(_tag()), "logs", "registers")
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    (a / "start.txt").write_text("start\n")
    run_cli("init", str(a), "--backend", uri)
    run_cli("push", cwd=a)
    run_cli("clone", uri, str(b))
    results = race([a, b], ROUNDS)
    for i, pushes in enumerate(results):
        assert [p["rc"] for p in pushes] == [0] * ROUNDS, f"client{i}: {pushes}"
    for root in (a, b):
        run_cli("pull", cwd=root)
    expected = {"start.txt": "start\n"} | {
        f"client{i}/r{k}.txt": f"client{i} round {k}\n" for i in range(2) for k in range(ROUNDS)}
    assert files_of(a) == expected
    assert files_of(b) == expected
    # (Without version numbers: each client knows those of the versions it synced with.)
    logs = [[{k: v for k, v in e.items() if k != "version"}
             for e in json.loads(run_cli("log", "--json", cwd=root).stdout)] for root in (a, b)]
    assert logs[0] == logs[1]
    # One version per push plus the first, along first parents (master's line).
    by_id, line = {e["commit"]: e for e in logs[0]}, [logs[0][0]]
    while line[-1]["parents"]:
        line.append(by_id[line[-1]["parents"][0]])
    assert len(line) == 2 * ROUNDS + 1


# ---------------------------------------------------------------- the append path's own errors


def test_a_refused_locked_append_is_the_servers_error_not_contention(
    webdav_refusing_locked_move: WebdavServer,
) -> None:
    """A WebDAV server that refuses the MOVE carrying this client's own fresh lock token
    fails the append at once (no retries) with that refusal, and the pPaxos driver
    reports it as the backend's error -- not as "other clients kept committing"."""
    server = webdav_refusing_locked_move
    tag = _tag()
    (server.root_dir / tag).mkdir()
    backend = open_backend(server.uri(tag), "ns")
    backend.create()
    try:
        started = time.monotonic()
        with pytest.raises(PrimitiveMissing) as info:
            backend.logs.append("log/1", b"m")
        assert time.monotonic() - started < 1.5
        message = str(info.value)
        assert "412" in message and "logs=registers" in message and "\n" not in message
        assert not info.value.transient
        consensus = Consensus({"w": backend}, Codec(None), "client", timeout=10)
        assert consensus.get_recent(Version(0, None, "c")).number == 0
        with pytest.raises(BackendUnavailable) as failed:
            consensus.propose(1, Version(1, None, "c"))
        assert "412" in str(failed.value)
        assert "kept committing" not in str(failed.value)
    finally:
        backend.close()


def test_a_faulty_backend_refusing_appends_is_reported_as_its_error(tmp_path: Path) -> None:
    """Two of three acceptors refuse every append with a PrimitiveMissing: a proposal
    fails at once naming them and carrying their error."""
    acceptors: dict[str, LocalBackend | FaultyBackend] = {}
    for i in range(3):
        folder = tmp_path / f"b{i}"
        folder.mkdir()
        inner = LocalBackend(f"dir:{folder}", "ns")
        inner.create()
        if i == 0:
            acceptors[f"b{i}"] = inner
            continue
        faulty = FaultyBackend(inner)
        faulty.faults.refuse({"append", "append_at"}, times=ALWAYS, error=PrimitiveMissing,
                             message=f"{inner.name}: the service refused the entry (injected)")
        acceptors[f"b{i}"] = faulty
    consensus = Consensus(dict(acceptors), Codec(None), "client", timeout=10)
    started = time.monotonic()
    with pytest.raises(BackendUnavailable) as info:
        consensus.propose(1, Version(1, None, "c"))
    assert time.monotonic() - started < 5
    message = str(info.value)
    assert "the service refused the entry (injected)" in message
    assert "kept committing" not in message
    assert acceptors["b1"].name in message and acceptors["b2"].name in message


# ---------------------------------------------------------------- missing locations


def test_init_creates_a_missing_webdav_or_sftp_location(
    webdav_server: WebdavServer, sshd_server: SshServer, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Like restic and rclone, `init` and `backend add` create a WebDAV or SFTP
    location folder (with its parents) that does not exist yet."""
    tag = _tag()
    dav_path = f"new-{tag}/deeper"
    sftp_path = sshd_server.root_dir / f"new-{tag}" / "deeper"
    src = tmp_path / "src"
    make_tree(src, small_files=20)
    run_cli("init", str(src), "--backend", webdav_server.uri(dav_path),
            "--backend", sshd_server.uri(sftp_path))
    assert (webdav_server.root_dir / dav_path / NAMESPACE).is_dir()
    assert (sftp_path / NAMESPACE).is_dir()
    run_cli("push", cwd=src)
    added = f"added-{tag}/x"
    run_cli("backend", "add", webdav_server.uri(added), cwd=src)
    assert (webdav_server.root_dir / added / NAMESPACE / DESCRIPTOR_KEY).is_file()
    clone = tmp_path / "clone"
    # The WebDAV backends reach this server with a password: a clone is told about
    # them (the shared configuration holds no password, and is not trusted to name
    # a host to send one to).
    run_cli("clone", sshd_server.uri(sftp_path), str(clone),
            "--backend", webdav_server.uri(dav_path), "--backend", webdav_server.uri(added))
    assert snapshot(clone) == snapshot(src)


def test_a_missing_dir_location_needs_mkdir(tmp_path: Path, backends: list[Path]) -> None:
    """A missing dir: folder is usually an unmounted disk: `init` and `backend add`
    refuse it (naming --mkdir) and create nothing, unless --mkdir is given."""
    missing = tmp_path / "usb" / "sync"
    line = one_line_failure("init", str(tmp_path / "r"), "--backend", f"dir:{missing}")
    assert str(missing) in line and "--mkdir" in line
    assert not missing.exists() and not (tmp_path / "r").exists()
    root = tmp_path / "r"
    run_cli("init", str(root), "--backend", f"dir:{missing}", "--mkdir")
    assert (missing / NAMESPACE / DESCRIPTOR_KEY).is_file()
    (root / "a.txt").write_text("a\n")
    run_cli("push", cwd=root)
    other = tmp_path / "usb2" / "sync"
    line = one_line_failure("backend", "add", f"dir:{other}", cwd=root)
    assert str(other) in line and "--mkdir" in line
    assert not other.exists()
    run_cli("backend", "add", f"dir:{other}", "--mkdir", cwd=root)
    assert (other / NAMESPACE / DESCRIPTOR_KEY).is_file()


# ---------------------------------------------------------------- folders before writes


def test_webdav_answering_500_for_a_missing_folder(
    webdav_500_for_missing_folder: WebdavServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A WebDAV server answering 500 (not 409) to a PUT into a missing folder: folders
    are created before the first write into them, so init, push and clone work."""
    server = webdav_500_for_missing_folder
    monkeypatch.setenv("METASYNC_WEBDAV_USER", server.user)
    monkeypatch.setenv("METASYNC_WEBDAV_PASSWORD", server.password)
    folder = f"store-{_tag()}"
    (server.root_dir / folder).mkdir()
    uri = server.uri(folder)
    src = tmp_path / "src"
    make_tree(src, small_files=40)
    run_cli("init", str(src), "--backend", uri)
    run_cli("push", cwd=src)
    clone = tmp_path / "clone"
    run_cli("clone", uri, str(clone))
    assert snapshot(clone) == snapshot(src)
    (clone / "new folder" / "deep").mkdir(parents=True)
    (clone / "new folder" / "deep" / "f.txt").write_text("new\n")
    run_cli("push", cwd=clone)
    run_cli("pull", cwd=src)
    assert snapshot(clone) == snapshot(src)


def test_sftp_generic_failure_for_a_missing_folder(sftp_rename_overwrites: SshServer) -> None:
    """An SFTP server answering a generic failure (not "no such file") to an open in a
    missing folder: the folders are made first, so the write works."""
    folder = sftp_rename_overwrites.root_dir / f"f-{_tag()}"
    folder.mkdir()
    backend = open_backend(sftp_rename_overwrites.uri(folder), "ns")
    try:
        backend.create()
        backend.put("a/b/c", b"deep")
        assert backend.get("a/b/c") == b"deep"
        assert backend.put_if_absent("d/e", b"x") is True
    finally:
        backend.close()


# ---------------------------------------------------------------- when the check is repeated


def _state(root: Path) -> Iterator[LocalState]:
    db = LocalDB(root / ".metasync" / "state.db")
    try:
        yield LocalState(db)
    finally:
        db.close()


def test_a_backend_that_breaks_later_is_refused_by_the_recheck(
    webdav_server: WebdavServer, webdav_refusing_locked_move: WebdavServer, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """init records each backend's verified primitives; status and commit never
    recheck; a push rechecks a backend whose check is older than the period (or
    that this client now reaches by another URI), and refuses it in one line if it
    no longer holds. Skipping the recheck, the push's append fails with the server's
    own error."""
    monkeypatch.setenv("METASYNC_WEBDAV_USER", webdav_server.user)
    monkeypatch.setenv("METASYNC_WEBDAV_PASSWORD", webdav_server.password)
    folder = f"moved-{_tag()}"
    (webdav_server.root_dir / folder).mkdir()
    root = tmp_path / "r"
    root.mkdir()
    (root / "a.txt").write_text("a\n")
    run_cli("init", str(root), "--backend", webdav_server.uri(folder))
    for state in _state(root):
        (backend_id, record), = state.primitives_checked.items()
        assert record.uri == public_uri(webdav_server.uri(folder))
        assert record.logs == "WebdavLockLogs" and time.time() - record.at < 60
    run_cli("push", cwd=root)

    # The same repository, now served by a server that refuses locked moves.
    bad = webdav_refusing_locked_move
    shutil.copytree(webdav_server.root_dir / folder, bad.root_dir / folder)
    for state in _state(root):
        with state.transaction():
            state.uri_overrides = {backend_id: bad.uri(folder)}
    (root / "b.txt").write_text("b\n")
    run_cli("status", cwd=root)
    run_cli("commit", cwd=root)
    line = one_line_failure("push", cwd=root)
    assert "lacks a lock" in line and "logs=registers" in line
    # A clone from it is refused the same way, and leaves no folder behind.
    line = one_line_failure("clone", bad.uri(folder), str(tmp_path / "clone"))
    assert "lacks a lock" in line and not (tmp_path / "clone").exists()

    # Pretend the recheck ran: the append itself now fails, as the server's error.
    for state in _state(root):
        with state.transaction():
            state.primitives_checked = {backend_id: dataclasses.replace(
                record, uri=public_uri(bad.uri(folder)), at=time.time())}
    line = one_line_failure("push", cwd=root)
    assert "412" in line and "kept committing" not in line


def _checked_at(root: Path) -> dict[str, float]:
    for state in _state(root):
        return {b: r.at for b, r in state.primitives_checked.items()}
    raise AssertionError("unreachable")


def test_the_recheck_runs_at_most_once_per_period(tmp_path: Path, backends: list[Path]) -> None:
    """A clone checks (and records) every backend before its first pull; a push or
    pull rechecks a backend only once its check is older than the period, then not
    again; status and commit never touch the record."""
    root = tmp_path / "r"
    root.mkdir()
    (root / "a.txt").write_text("a\n")
    run_cli("init", str(root), *(f"--backend=dir:{b}" for b in backends[:2]))
    first = _checked_at(root)
    assert len(first) == 2
    run_cli("push", cwd=root)
    assert _checked_at(root) == first
    clone = tmp_path / "clone"
    run_cli("clone", f"dir:{backends[0]}", str(clone))
    assert set(_checked_at(clone)) == set(first)

    old_id = sorted(first)[0]
    week_ago = time.time() - RECHECK_SECONDS - 60
    for state in _state(root):
        with state.transaction():
            state.primitives_checked = {
                b: dataclasses.replace(r, at=week_ago) if b == old_id else r
                for b, r in state.primitives_checked.items()}
    aged = _checked_at(root)
    (root / "b.txt").write_text("b\n")
    run_cli("status", cwd=root)
    run_cli("commit", cwd=root)
    assert _checked_at(root) == aged
    run_cli("push", cwd=root)
    after = _checked_at(root)
    assert after[old_id] > time.time() - 120
    assert {b: t for b, t in after.items() if b != old_id} == {
        b: t for b, t in first.items() if b != old_id}
    run_cli("pull", cwd=root)
    assert _checked_at(root) == after


def test_a_recheck_waits_a_bounded_time_and_a_refusal_always_fails(tmp_path: Path) -> None:
    """A recheck of a backend that does not answer gives up after its wait (not
    recorded, and not tried again by this process for a while); a backend that
    fails its check fails every recheck, never only the first."""
    db = LocalDB(tmp_path / "state.db")
    try:
        state = LocalState(db)
        tag = _tag()
        hung = FaultyBackend(MemoryBackend(f"memory:hung-{tag}", "ns"))
        hung.create()
        stuck = hung.faults.hang({"put_if_absent"}, times=ALWAYS)
        started = time.monotonic()
        verification.recheck(state, {"h": hung}, wait=0.5)
        assert time.monotonic() - started < 5
        assert stuck.entered.is_set() and state.primitives_checked == {}
        fired = stuck.fired
        verification.recheck(state, {"h": hung}, wait=0.5)
        assert stuck.fired == fired and verification.due(state, {"h": hung})
        stuck.release()

        bad = FaultyBackend(MemoryBackend(f"memory:bad-{tag}", "ns"))
        bad.create()
        bad.faults.refuse({"append_at"}, times=ALWAYS, error=PrimitiveMissing,
                          message="the entry was refused (injected)")
        for _ in range(2):
            with pytest.raises(UsageError, match=r"refused \(injected\)"):
                verification.recheck(state, {"b": bad})
        good = MemoryBackend(f"memory:good-{tag}", "ns")
        good.create()
        verification.recheck(state, {"g": good})
        assert set(state.primitives_checked) == {"g"}
        assert state.primitives_checked["g"].logs == "ObjectStoreLogs"
    finally:
        db.close()


def test_locations_by_lookup_and_by_one_pass_agree(tmp_path: Path) -> None:
    """``LocalDB.locations`` looks ids up, or reads the whole table when asked for
    most of it (a clone's checkout): the same answer either way, current locations
    first, then historic ones, unknown ids left out."""
    from metasync import localdb
    from metasync.objects import PackEntry

    db = LocalDB(tmp_path / "state.db")
    try:
        with db.transaction():
            db.add_locations("p1", [PackEntry(f"{i:064x}", "blob", i * 10, 10) for i in range(50)])
            db.add_locations("h1", [PackEntry(f"{i:064x}", "blob", 7, 3) for i in range(40, 60)],
                             historic=True)
        few = [f"{i:064x}" for i in (1, 45, 55, 99)]
        most = [f"{i:064x}" for i in range(100)]
        for ids in (few, most):
            by_pass = db.locations(ids)
            original = localdb._SCAN_FACTOR
            try:
                localdb._SCAN_FACTOR = 0  # never a pass: every id looked up
                by_lookup = db.locations(ids)
            finally:
                localdb._SCAN_FACTOR = original
            assert by_pass == by_lookup
        assert set(by_pass) == {f"{i:064x}" for i in range(60)}
        assert by_pass[f"{45:064x}"][0] == "p1" and by_pass[f"{55:064x}"][0] == "h1"
        assert db.locations([]) == {}
    finally:
        db.close()
