"""FIFOs, sockets and device files, and sparse files (issue 17, lesser points).

A FIFO, a socket or a device file has no content to sync: ``status`` and ``push``
say so for each (``skipped: PATH (a FIFO)``) and carry on; nothing ever opens a
FIFO (an open with no writer would block forever), even one that replaced a
regular file between the scan and the read. A file with holes comes back with
holes: a clone or pull writes the all-zero chunks as holes, not as zeros.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import run_cli
from metasync import Repository
from metasync.worktree import ScanEntry


@pytest.fixture
def repo_dir(tmp_path: Path) -> Iterator[Path]:
    folder = tmp_path / "folder"
    folder.mkdir()
    (tmp_path / "b1").mkdir()
    (folder / "a.txt").write_text("a\n")
    run_cli("init", str(folder), "--no-encrypt", f"--backend=dir:{tmp_path / 'b1'}",
            passphrase=None)
    yield folder


def test_fifos_and_sockets_are_named_by_status_and_push(repo_dir: Path, tmp_path: Path) -> None:
    os.mkfifo(repo_dir / "pipe")
    (repo_dir / "sub").mkdir()
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(repo_dir / "sub" / "sock"))
    try:
        st = run_cli("status", cwd=repo_dir, passphrase=None)
        assert "skipped: pipe (a FIFO)" in st.stdout
        assert "skipped: sub/sock (a socket)" in st.stdout
        doc = json.loads(run_cli("status", "--json", cwd=repo_dir, passphrase=None).stdout)
        assert doc["special"] == [{"path": "pipe", "reason": "a FIFO"},
                                  {"path": "sub/sock", "reason": "a socket"}]
        push = run_cli("push", cwd=repo_dir, passphrase=None)
        assert push.returncode == 0  # not synced on purpose: nothing failed
        assert "skipped: pipe (a FIFO)" in push.stdout + push.stderr
        assert "skipped: sub/sock (a socket)" in push.stdout + push.stderr
    finally:
        sock.close()
    clone = tmp_path / "clone"
    run_cli("clone", f"dir:{tmp_path / 'b1'}", str(clone), "--no-encrypt", passphrase=None)
    assert sorted(p.name for p in clone.iterdir() if p.name != ".metasync") == ["a.txt", "sub"]


def test_a_device_file_is_named(repo_dir: Path) -> None:
    try:
        os.mknod(repo_dir / "null", 0o600 | 0o020000, os.makedev(1, 3))  # S_IFCHR
    except PermissionError:
        pytest.skip("cannot make device files here")
    st = run_cli("status", cwd=repo_dir, passphrase=None)
    assert "skipped: null (a character device)" in st.stdout


def test_a_fifo_swapped_in_after_the_scan_is_never_opened(repo_dir: Path) -> None:
    """The scan saw a regular file; by the time it is read a FIFO is there: the
    read must not block on it (no writer will ever come)."""
    os.mkfifo(repo_dir / "late")
    st = os.lstat(repo_dir / "late")
    with Repository.open(repo_dir) as repo:
        entry = ScanEntry("late", "file", st.st_size, st.st_mtime_ns, st.st_ino, False)
        got: list[object] = []
        reader = threading.Thread(target=lambda: got.append(repo.scanner.hash_one(entry, None)))
        reader.start()
        reader.join(60)
        if reader.is_alive():  # blocked in open(): give it a writer so the test ends
            os.close(os.open(repo_dir / "late", os.O_WRONLY | os.O_NONBLOCK))
            reader.join()
            pytest.fail("hash_one blocked opening a FIFO")
        assert got == [None]


def test_a_sparse_file_comes_back_sparse(repo_dir: Path, tmp_path: Path) -> None:
    big = repo_dir / "disk.img"
    with open(big, "wb") as fh:
        fh.truncate(40 * 1024 * 1024)
        fh.seek(20 * 1024 * 1024)
        fh.write(b"a few bytes in the middle")
        fh.seek(40 * 1024 * 1024 - 3)
        fh.write(b"end")
    with open(big, "rb") as fh:
        digest = hashlib.file_digest(fh, "sha256").hexdigest()
    assert os.stat(big).st_blocks * 512 < 1024 * 1024  # the filesystem keeps holes
    run_cli("push", cwd=repo_dir, passphrase=None)
    clone = tmp_path / "clone"
    run_cli("clone", f"dir:{tmp_path / 'b1'}", str(clone), "--no-encrypt", passphrase=None)
    copy = clone / "disk.img"
    assert copy.stat().st_size == 40 * 1024 * 1024
    with open(copy, "rb") as fh:
        assert hashlib.file_digest(fh, "sha256").hexdigest() == digest
    # Only the chunks holding the written bytes take space (a chunk is at most 4 MiB).
    assert copy.stat().st_blocks * 512 <= 3 * 4 * 1024 * 1024, copy.stat().st_blocks

    # A pull writes the same way; and a file ending in a hole keeps its size.
    with open(big, "r+b") as fh:
        fh.truncate(48 * 1024 * 1024)
    run_cli("push", cwd=repo_dir, passphrase=None)
    run_cli("pull", cwd=clone, passphrase=None)
    assert copy.stat().st_size == 48 * 1024 * 1024
    assert copy.stat().st_blocks * 512 <= 3 * 4 * 1024 * 1024, copy.stat().st_blocks
