"""A folder checked out on exFAT (no exec bits: every file shows mode 0777) and then
copied with its ``.metasync`` to a file system with exec bits (``cp -a`` onto ext4):
the bits on disk are exFAT's, not the user's, so exec bits stay taken from history
there and the next push changes nothing (docs/design.md, "Folders that cannot hold
everything")."""

from __future__ import annotations

import shutil
from pathlib import Path

from metasync.repository import Repository
from tests.conftest import run_cli
from tests.servers.fsimages import fresh_folder


def test_a_folder_copied_off_exfat_pushes_no_exec_bit(
    tmp_path: Path, fs_images: dict[str, Path]
) -> None:
    backends = [tmp_path / "b1", tmp_path / "b2"]
    for b in backends:
        b.mkdir()
    src = tmp_path / "src"
    src.mkdir()
    (src / "plain.txt").write_text("plain\n")
    script = src / "run.sh"
    script.write_text("#!/bin/sh\n")
    script.chmod(0o755)
    run_cli("init", "--backend", f"dir:{backends[0]}", "--backend", f"dir:{backends[1]}",
            cwd=src)
    run_cli("push", cwd=src)
    stick = fresh_folder(fs_images["exfat"]) / "clone"
    run_cli("clone", f"dir:{backends[0]}", str(stick), "--backend", f"dir:{backends[1]}")
    assert (stick / "plain.txt").stat().st_mode & 0o111, "exFAT shows every file executable"
    moved = tmp_path / "moved"
    shutil.copytree(stick, moved, symlinks=True)  # cp -a: modes kept
    (moved / ".metasync").chmod(0o700)
    with Repository.open(src) as repo:
        before = repo.prev.master
    status = run_cli("status", cwd=moved)
    assert "plain.txt" not in status.stdout, status.stdout
    run_cli("push", cwd=moved)
    with Repository.open(src) as repo:
        repo.pull()
        assert repo.prev.master == before, "a push from the moved folder changed master"
