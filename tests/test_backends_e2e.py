"""End to end over real servers: one repository spanning S3 (SeaweedFS), SFTP
(OpenSSH) and WebDAV (wsgidav) with R=2, driven through the real ``metasync``
command, plus the one-line errors a user sees when a backend cannot be used.
"""

from __future__ import annotations

import os
import sqlite3
import uuid
from pathlib import Path

import pytest

from conftest import make_tree, run_cli, snapshot
from metasync.backends import open_backend
from tests.servers.seaweedfs import SeaweedS3
from tests.servers.sshd import SshServer
from tests.servers.webdav import WebdavServer

NAMESPACE = "metasync"


def _objects_on(uri: str) -> set[str]:
    """Object keys (``objects/...``) the repository holds on one backend."""
    backend = open_backend(uri, NAMESPACE)
    try:
        return set(backend.list("objects"))
    finally:
        backend.close()


def _config_doc(root: Path) -> str:
    conn = sqlite3.connect(root / ".metasync" / "state.db")
    try:
        rows = conn.execute("SELECT value FROM settings WHERE key = 'config_doc'").fetchall()
    finally:
        conn.close()
    return str(rows[0][0])


@pytest.fixture
def mixed_uris(
    seaweedfs: SeaweedS3,
    sshd_server: SshServer,
    webdav_server: WebdavServer,
) -> list[str]:
    """Fresh locations on the three servers: [s3, sftp, webdav]."""
    tag = uuid.uuid4().hex[:8]
    sftp_dir = sshd_server.root_dir / f"e2e-{tag}"
    sftp_dir.mkdir()
    (webdav_server.root_dir / f"e2e-{tag}").mkdir()
    return [
        seaweedfs.uri(f"e2e-{tag}"),
        sshd_server.uri(sftp_dir),
        webdav_server.uri(f"e2e-{tag}"),
    ]


def test_repository_spanning_s3_sftp_and_webdav(
    mixed_uris: list[str], webdav_server: WebdavServer, tmp_path: Path
) -> None:
    """init, push, clone from each of the three backends, edit, push, pull: every
    copy ends identical; every object is on exactly 2 of the 3 backends; and the
    WebDAV password is in no backend's configuration."""
    src = tmp_path / "src"
    make_tree(src, small_files=120, big_mb=3)
    args = ["init", str(src), "--replicas", "2"]
    for uri in mixed_uris:
        args += ["--backend", uri]
    run_cli(*args)
    run_cli("push", "-m", "first", cwd=src)
    expected = snapshot(src)

    clones = []
    for i, uri in enumerate(mixed_uris):
        clone = tmp_path / f"clone{i}"
        # The other backends are named as this machine reaches them (the WebDAV one
        # with its password): a shared configuration's URIs are not opened unasked.
        others = [arg for u in mixed_uris if u != uri for arg in ("--backend", u)]
        run_cli("clone", uri, str(clone), *others)
        assert snapshot(clone) == expected, f"clone from {uri.split(':')[0]} differs"
        clones.append(clone)

    # Each object sits on exactly R=2 of the 3 backends.
    holdings = [_objects_on(uri) for uri in mixed_uris]
    every = set().union(*holdings)
    assert every, "no objects stored"
    for key in every:
        assert sum(key in held for held in holdings) == 2, key

    # The shared config names the WebDAV backend without its password.
    assert webdav_server.password not in _config_doc(clones[0])
    assert f"{webdav_server.user}@" in _config_doc(clones[0])

    # Edit in the clone made from SFTP, push; everyone else pulls.
    editor = clones[1]
    (editor / "small" / "d00" / "f00000.txt").write_bytes(b"edited over sftp\n")
    (editor / "new folder ünï").mkdir()
    (editor / "new folder ünï" / "added.bin").write_bytes(os.urandom(300_000))
    (editor / "empty-file").unlink()
    run_cli("push", "-m", "edit", cwd=editor)
    edited = snapshot(editor)
    assert edited != expected
    for other in (src, clones[0], clones[2]):
        run_cli("pull", cwd=other)
        assert snapshot(other) == edited, other.name
    for repo in (src, *clones):
        run_cli("fsck", cwd=repo)


def _one_line_failure(*args: str, cwd: Path | None = None) -> str:
    proc = run_cli(*args, cwd=cwd, check=False)
    assert proc.returncode != 0, proc.stdout
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    return lines[0]


def test_missing_bucket_is_one_line_naming_it(seaweedfs: SeaweedS3, tmp_path: Path) -> None:
    uri = f"s3://no-such-bucket-{uuid.uuid4().hex[:8]}/x?endpoint={seaweedfs.endpoint}"
    line = _one_line_failure("init", str(tmp_path / "r"), "--backend", uri)
    assert "no-such-bucket" in line and "bucket" in line.lower()


def test_wrong_webdav_password_is_one_line_without_the_password(
    webdav_server: WebdavServer, tmp_path: Path
) -> None:
    (webdav_server.root_dir / "pw").mkdir(exist_ok=True)
    uri = webdav_server.uri("pw", password="wrong-secret")
    line = _one_line_failure("init", str(tmp_path / "r"), "--backend", uri)
    assert "wrong-secret" not in line
    assert str(webdav_server.port) in line


def test_unknown_sftp_host_key_is_one_line(sshd_server: SshServer, tmp_path: Path) -> None:
    empty = tmp_path / "known_hosts"
    empty.write_text("")
    (sshd_server.root_dir / "hk").mkdir(exist_ok=True)
    uri = sshd_server.uri(sshd_server.root_dir / "hk", known_hosts=empty)
    line = _one_line_failure("init", str(tmp_path / "r"), "--backend", uri)
    assert "host key" in line.lower()


def test_unreachable_host_is_one_line(tmp_path: Path) -> None:
    # Port 9 on loopback: nothing listens, so the connection is refused at once.
    line = _one_line_failure("init", str(tmp_path / "r"), "--backend", "webdav://127.0.0.1:9/x")
    assert "127.0.0.1:9" in line
