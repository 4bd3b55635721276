"""Backends are compared by what they are, not by how their URI is spelled (issue 17,
point 2): one folder given twice -- with a trailing slash, ``//``, ``..``, a symlink
-- or one server path spelled two ways is refused by ``init``, ``backend add`` and
``clone --backend`` with a one-line error naming both spellings; so is a backend
whose folder lies inside another backend's folder or inside the synced folder.

Before the fix ``init`` accepted every spelling below and made a repository whose
``backend list`` claimed two copies of each object where one existed.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

from conftest import backend_dirs, one_line_error, run_cli
from metasync.backends.uris import location_identity, overlap
from metasync.errors import UsageError
from tests.servers.webdav import WebdavServer


def _spellings(b: Path, tmp_path: Path) -> list[str]:
    """Other spellings of the folder ``b`` (``tmp_path/b3``)."""
    link = tmp_path / "link-to-b3"
    if not link.exists():
        os.symlink(b, link)
    return [f"dir:{b}/", f"dir:{tmp_path}//b3", f"dir:{b}/../b3", f"dir:{link}", f"{b}/"]


def test_init_refuses_one_folder_given_twice(tmp_path: Path) -> None:
    """Each other spelling of ``b3`` beside ``dir:b3`` is refused, naming both, and
    nothing is written (the folder stays empty, no repository is made)."""
    b = backend_dirs(tmp_path, "b1", "b3")
    for i, other in enumerate(_spellings(b["b3"], tmp_path)):
        root = tmp_path / f"repo{i}"
        proc = run_cli("init", str(root), "--backend", f"dir:{b['b1']}", "--backend",
                       f"dir:{b['b3']}", "--backend", other, check=False)
        line = one_line_error(proc, f"dir:{b['b3']}", other, "same")
        assert "Traceback" not in proc.stderr, line
        assert not (root / ".metasync").exists()
        assert list(b["b3"].iterdir()) == []


def test_backend_add_refuses_another_spelling_of_a_backend(tmp_path: Path) -> None:
    b = backend_dirs(tmp_path, "b1", "b3")
    root = tmp_path / "repo"
    run_cli("init", str(root), "--backend", f"dir:{b['b1']}", "--backend", f"dir:{b['b3']}")
    for other in _spellings(b["b3"], tmp_path):
        proc = run_cli("backend", "add", other, cwd=root, check=False)
        one_line_error(proc, other, f"dir:{b['b3']}", "same")
    listing = run_cli("backend", "list", cwd=root).stdout
    assert listing.count("dir:") == 2, listing


def test_nested_backend_folders_are_refused(tmp_path: Path) -> None:
    """A backend inside another backend's folder, or inside the synced folder."""
    b = backend_dirs(tmp_path, "b1", "b3")
    (b["b3"] / "inner").mkdir()
    proc = run_cli("init", str(tmp_path / "r1"), "--backend", f"dir:{b['b3']}", "--backend",
                   f"dir:{b['b3']}/inner", "--backend", f"dir:{b['b1']}", check=False)
    one_line_error(proc, f"dir:{b['b3']}/inner", f"dir:{b['b3']}", "inside")
    root = tmp_path / "r2"
    (root / "store").mkdir(parents=True)
    proc = run_cli("init", str(root), "--backend", f"dir:{root}/store", "--backend",
                   f"dir:{b['b1']}", check=False)
    one_line_error(proc, f"dir:{root}/store", "synced folder")
    assert not (root / ".metasync").exists()
    run_cli("init", str(root), "--backend", f"dir:{b['b1']}", "--backend", f"dir:{b['b3']}")
    proc = run_cli("backend", "add", f"dir:{root}/store", cwd=root, check=False)
    one_line_error(proc, f"dir:{root}/store", "synced folder")
    proc = run_cli("backend", "add", f"dir:{b['b3']}/inner", cwd=root, check=False)
    one_line_error(proc, f"dir:{b['b3']}/inner", "inside")


def test_clone_backend_matches_by_identity(tmp_path: Path) -> None:
    """``clone --backend`` given another spelling of a backend of the repository
    connects that backend (it was silently ignored: not matched by its spelling);
    the same backend twice is refused."""
    b = backend_dirs(tmp_path, "b1", "b3")
    src = tmp_path / "src"
    run_cli("init", str(src), "--backend", f"dir:{b['b1']}", "--backend", f"dir:{b['b3']}")
    proc = run_cli("clone", f"dir:{b['b1']}", str(tmp_path / "c1"), "--backend",
                   f"dir:{b['b3']}/", "--backend", f"dir:{tmp_path}//b3", check=False)
    one_line_error(proc, f"dir:{b['b3']}/", f"dir:{tmp_path}//b3", "same")
    proc = run_cli("clone", f"dir:{b['b1']}", str(tmp_path / "c2"), "--backend",
                   f"dir:{b['b1']}/", check=False)
    one_line_error(proc, f"dir:{b['b1']}/", f"dir:{b['b1']}", "same")


def test_recover_refuses_one_survivor_given_twice(tmp_path: Path) -> None:
    """``recover`` counts survivors as init counts backends: another spelling of one
    is refused before anything is read or written."""
    b = backend_dirs(tmp_path, "b1", "b3")
    run_cli("init", str(tmp_path / "src"), "--backend", f"dir:{b['b1']}", "--backend",
            f"dir:{b['b3']}")
    rec = tmp_path / "rec"
    proc = run_cli("recover", "--backend", f"dir:{b['b3']}", "--backend", f"dir:{b['b3']}/.",
                   "--yes", str(rec), check=False)
    one_line_error(proc, f"dir:{b['b3']}", f"dir:{b['b3']}/.", "same")
    assert not (rec / ".metasync").exists()


def test_clone_backend_connects_a_server_spelled_otherwise(
    tmp_path: Path, webdav_server: WebdavServer
) -> None:
    """A WebDAV backend (which a clone uses only once told how to reach it) given to
    ``clone --backend`` with a trailing slash is the
    configuration's backend, and is connected. Before: not matched by its spelling,
    so "not connected here"."""
    b = backend_dirs(tmp_path, "b1")
    dav = f"ident-{uuid.uuid4().hex[:8]}/store"
    src = tmp_path / "src"
    run_cli("init", str(src), "--backend", f"dir:{b['b1']}", "--backend",
            webdav_server.uri(dav))
    (src / "f.txt").write_text("hello\n")
    run_cli("push", cwd=src)
    spelled = webdav_server.uri(dav) + "/"
    clone = tmp_path / "clone"
    proc = run_cli("clone", f"dir:{b['b1']}", str(clone), "--backend", spelled)
    assert "not connected" not in proc.stderr, proc.stderr
    listing = run_cli("backend", "list", cwd=clone)
    assert "not connected" not in listing.stdout + listing.stderr, listing.stdout


@pytest.mark.parametrize(("a", "b"), [
    ("webdav://Host.Example:80/dav/b3", "webdav://host.example/dav/b3/"),
    ("webdavs://host:443/a/./b3", "webdavs://host/a//b3"),
    ("webdav://u:p@host/dav/b%33", "webdav://host/dav/x/../b3"),
    ("sftp://me@HOST:22/srv/b3", "sftp://me@host/srv/b3/"),
    ("s3://bucket/pre/fix/", "s3://bucket/pre//fix"),
    ("rclone:remote:path/b3/", "rclone:remote:path//b3"),
])
def test_url_spellings_have_one_identity(a: str, b: str) -> None:
    assert location_identity(a) == location_identity(b)
    with pytest.raises(UsageError, match="same"):
        overlap([a, b], root=None)


@pytest.mark.parametrize(("a", "b"), [
    ("webdav://host/dav/b3", "webdavs://host/dav/b3"),
    ("webdav://host:8080/dav/b3", "webdav://host/dav/b3"),
    ("sftp://me@host/b3", "sftp://you@host/b3"),  # relative to each user's home
    ("s3://bucket/a", "s3://other/a"),
    ("s3://bucket/a?endpoint=http://x:9000", "s3://bucket/a"),
    ("rclone:one:b3", "rclone:two:b3"),
    ("webdav://host/dav/b3", "webdav://host/dav/b33"),
])
def test_distinct_locations_stay_distinct(a: str, b: str) -> None:
    assert location_identity(a) != location_identity(b)
    overlap([a, b], root=None)  # no error


def test_a_server_folder_inside_another_is_refused() -> None:
    with pytest.raises(UsageError, match="inside"):
        overlap(["webdav://host/dav", "webdav://HOST:80/dav/b3/"], root=None)
    with pytest.raises(UsageError, match="inside"):
        overlap(["sftp://me@host/srv/b3/x", "sftp://me@host:22/srv/b3"], root=None)
