"""A full backend is reported as full, not as unreachable, and its copies spill.

Issue 17, point 6: ENOSPC, EDQUOT, HTTP 507 and the services' quota errors are
:class:`~metasync.errors.BackendFull` ("backend X is full (...); free space there
or add a backend"); a push names the full backend, ``backend list`` and the
daemon's status show it as ``full``, and the copies it refused go to other
backends (the spill of issue 15) and move home once it has room.

The ``dir:`` backend is a real small filesystem: a tmpfs mounted for the test
(root only; skipped elsewhere), grown with a remount to "free space". The WebDAV
server answers 507 to object uploads while a marker file says its quota is used
up (``wsgidav_faults.Answer507WhenFull``).
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import backend_dirs, run_cli
from tests.servers.webdav import WebdavServer, run_wsgidav

#: Size of the small filesystem: room for the repository's records, not for data.
SMALL = "512k"
#: One pack per file (``METASYNC_PACK_SIZE``), so that the small backend holds many
#: objects: each backend is a holder of about two thirds of them.
ONE_PACK_PER_FILE = {"METASYNC_PACK_SIZE": "60000"}


def _mount_tmpfs(path: Path, size: str) -> None:
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                   check=True, capture_output=True)


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """An empty folder on a 1 MiB tmpfs of its own, unmounted afterwards."""
    path = tmp_path / "small"
    path.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    try:
        _mount_tmpfs(path, SMALL)
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"cannot mount a tmpfs here: {exc}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False, capture_output=True)


def _fill_folder(folder: Path, files: int = 24, size: int = 100_000) -> None:
    """Incompressible files (2.4 MB): more than the small disk holds."""
    for i in range(files):
        (folder / f"big{i}.bin").write_bytes(os.urandom(size))


def _pushed_beside(tmp_path: Path, middle: str) -> tuple[dict[str, Path], Path]:
    """A folder pushed once to dir: backend b1, the backend ``middle`` (the one that
    fills up) and dir: backend b3: (the two roomy backends' folders, the folder)."""
    dirs = backend_dirs(tmp_path, "b1", "b3")
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "small.txt").write_text("fits\n")
    run_cli("init", str(folder), "--backend", f"dir:{dirs['b1']}", "--backend", middle,
            "--backend", f"dir:{dirs['b3']}")
    run_cli("push", cwd=folder)
    return dirs, folder


def _health(folder: Path) -> dict[str, str]:
    listing = json.loads(run_cli("backend", "list", "--json", cwd=folder).stdout)
    return {b["uri"]: b["health"] for b in listing["backends"]}


def test_a_full_dir_backend_is_named_full_and_its_copies_spill(
    tmp_path: Path, small_disk: Path
) -> None:
    """On the code before issue 17 the push said the holders "did not answer" (the
    full disk counted as unreachable) and ``backend list`` showed it ``ok``."""
    full_uri = f"dir:{small_disk}"
    dirs, folder = _pushed_beside(tmp_path, full_uri)
    _fill_folder(folder)

    push = run_cli("push", cwd=folder, env_extra=ONE_PACK_PER_FILE)
    assert "Traceback" not in push.stderr
    warning = [line for line in push.stderr.splitlines() if "is full" in line]
    assert warning, push.stderr
    assert full_uri in warning[0] and "No space left on device" in warning[0]
    assert "free space" in warning[0]
    assert "did not answer" not in push.stdout + push.stderr
    assert "unreachable" not in push.stdout + push.stderr

    health = _health(folder)
    assert health[full_uri].startswith("full:"), health
    assert all(h == "ok" for uri, h in health.items() if uri != full_uri), health
    table = run_cli("backend", "list", cwd=folder)
    row = next(line for line in table.stdout.splitlines() if line.endswith(full_uri))
    assert " full " in row, table.stdout

    # Nothing is lost: a clone from the two other backends has every file.
    clone = tmp_path / "clone"
    run_cli("clone", f"dir:{dirs['b1']}", str(clone))
    for i in range(24):
        assert (clone / f"big{i}.bin").read_bytes() == (folder / f"big{i}.bin").read_bytes()

    # fsck says why the copies are not there yet (not "lost").
    fsck = run_cli("fsck", cwd=folder, check=False)
    assert "Traceback" not in fsck.stderr
    for line in fsck.stdout.splitlines():
        if line.startswith("missing:"):
            assert "the backend is full" in line, fsck.stdout

    # Room again: the next push moves the copies home and the backend is ok.
    subprocess.run(["mount", "-o", "remount,size=64m", str(small_disk)], check=True)
    again = run_cli("push", cwd=folder)
    assert "is full" not in again.stderr, again.stderr
    assert _health(folder)[full_uri] == "ok"
    assert run_cli("fsck", cwd=folder).returncode == 0


def test_enospc_is_backend_full_on_a_dir_backend(small_disk: Path) -> None:
    """The ``dir:`` backend maps ENOSPC to :class:`BackendFull` (not transient, not
    unreachable) with a message that names the backend, the cause and the fix."""
    from metasync.backends import open_backend
    from metasync.errors import BackendFull, BackendUnavailable

    backend = open_backend(f"dir:{small_disk}", "ns")
    backend.create()
    with pytest.raises(BackendFull) as info:
        backend.put("objects/ab/big", os.urandom(2 << 20))
    assert not info.value.transient and not isinstance(info.value, BackendUnavailable)
    text = str(info.value)
    assert str(small_disk) in text and "is full" in text and "free space" in text
    # It still answers: what it holds is readable.
    backend.put("small", b"x")
    assert backend.get("small") == b"x"


@pytest.fixture
def webdav_quota(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WebdavServer]:
    """A wsgidav server that answers 507 Insufficient Storage to object uploads
    while ``root/../FULL`` exists (``wsgidav_faults.Answer507WhenFull``)."""
    with run_wsgidav(tmp_path_factory.mktemp("wsgidav-507"), ("Answer507WhenFull",)) as server:
        yield server


def test_a_webdav_backend_answering_507_is_full(
    tmp_path: Path, webdav_quota: WebdavServer
) -> None:
    """507 Insufficient Storage is "full", not "out of space (507)" as a plain error:
    the push spills, names the backend full, and ``backend list`` says ``full``."""
    (webdav_quota.root_dir / "quota").mkdir()
    _, folder = _pushed_beside(tmp_path, webdav_quota.uri("quota"))
    marker = webdav_quota.root_dir.parent / "FULL"
    marker.touch()
    try:
        _fill_folder(folder, files=12, size=20_000)
        push = run_cli("push", cwd=folder, env_extra={"METASYNC_PACK_SIZE": "15000"})
        assert "507" in push.stderr and "is full" in push.stderr, push.stderr
        by_uri = _health(folder)
        webdav_health = next(h for u, h in by_uri.items() if u.startswith("webdav://"))
        assert webdav_health.startswith("full:"), by_uri
    finally:
        marker.unlink()
    run_cli("push", cwd=folder)
    health = _health(folder)
    assert all(h == "ok" for h in health.values()), health


@pytest.mark.parametrize("provider", ["dropbox", "gdrive", "box", "onedrive"])
def test_a_providers_quota_error_is_backend_full(
    provider: str, request: pytest.FixtureRequest
) -> None:
    """Each provider's own "out of space" answer (Dropbox ``insufficient_space``,
    Drive ``storageQuotaExceeded``, Box ``storage_limit_exceeded``, OneDrive 507
    ``quotaLimitReached``), from its emulator, is :class:`BackendFull` naming the
    backend; before issue 17 each was a plain error (OneDrive's 507 a transient one,
    retried)."""
    from metasync.errors import BackendFull
    from tests.emulators.base import QUOTA
    from tests.providers_common import emulator_location, specific_backend

    service = request.getfixturevalue(f"{provider}_service")
    folder = ("" if provider == "gdrive" else "/") + "quota17"
    with specific_backend(service, emulator_location(service, provider, folder)) as backend:
        backend.put("objects/ab/first", b"fits")
        service.emulator.faults.inject(QUOTA, only="upload|content|/up/" if provider != "gdrive"
                                       else None)
        with pytest.raises(BackendFull) as info:
            backend.put("objects/ab/second", b"does not fit")
        assert "is full" in str(info.value) and provider in str(info.value).lower()
        assert backend.get("objects/ab/first") == b"fits"


def test_the_daemon_status_shows_a_full_backend(
    tmp_path: Path, small_disk: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The daemon syncs past a full backend (its copies spill) and ``daemon status``
    names that backend ``full``, the others ``ok``; before issue 17 it showed the
    full one as unreachable (or ok)."""
    from tests.test_daemon_safety import Daemons, _status_cli, wait_until

    full_uri = f"dir:{small_disk}"
    dirs, folder = _pushed_beside(tmp_path, full_uri)
    monkeypatch.setenv("METASYNC_PACK_SIZE", ONE_PACK_PER_FILE["METASYNC_PACK_SIZE"])
    daemons = Daemons()
    try:
        daemons.start(folder)
        _fill_folder(folder)
        health = wait_until(
            lambda: (h := _status_cli(folder)["backends"]).get(full_uri, "").startswith("full")
            and h, 60, "the daemon's status to show the small backend full")
        assert health[f"dir:{dirs['b1']}"] == health[f"dir:{dirs['b3']}"] == "ok", health
        text = run_cli("daemon", "status", cwd=folder).stdout
        assert f"{full_uri}: full: backend {full_uri} is full" in text, text
    finally:
        problems = daemons.stop_all()
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("kind", ["sftp", "rclone"])
def test_a_full_disk_behind_sftp_or_rclone_is_backend_full(
    kind: str, small_disk: Path, request: pytest.FixtureRequest
) -> None:
    """The small disk served by the test's OpenSSH server (which answers ENOSPC with
    a bare SSH_FX_FAILURE: the backend asks ``statvfs@openssh.com`` how much room is
    left), or by an rclone local remote (whose error says "no space left on
    device"): either way :class:`BackendFull`, and what is there stays readable."""
    from metasync.backends import open_backend
    from metasync.errors import BackendFull

    if kind == "sftp":
        uri = request.getfixturevalue("sshd_server").uri(small_disk)
    else:
        uri = request.getfixturevalue("rclone_env").uri(f"local:{small_disk}")
    backend = open_backend(uri, "ns")
    try:
        backend.create()
        backend.put("small", b"x")
        with pytest.raises(BackendFull) as info:
            backend.put("objects/ab/big", os.urandom(2 << 20))
        assert not info.value.transient and "is full" in str(info.value)
        assert backend.get("small") == b"x"
    finally:
        backend.close()
