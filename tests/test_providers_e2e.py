"""One repository over all four cloud providers -- Dropbox, Google Drive, Box and
OneDrive, each through its official SDK against its emulator (tests/emulators/) --
driven through the real ``metasync`` command while one provider throttles hard.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from conftest import make_tree, run_cli, snapshot
from tests.emulators.box import BoxService
from tests.emulators.dropbox import DROPBOX_FAULTS, DropboxService
from tests.emulators.gdrive import GDriveService
from tests.emulators.onedrive import OneDriveService


def test_repository_over_four_providers_while_dropbox_throttles(
    dropbox_service: DropboxService,
    gdrive_service: GDriveService,
    box_service: BoxService,
    onedrive_service: OneDriveService,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """dropbox + gdrive + box + onedrive, R = 2: init, push, clone from each provider,
    edit in one clone, push, pull in the first -- identical trees, fsck clean --
    while Dropbox fails half of all requests throughout (429 with and without
    Retry-After, too_many_write_operations, 503, 500). Every command succeeds with
    the retries a user on a throttled account would allow."""
    monkeypatch.setenv("METASYNC_RETRY_ATTEMPTS", "10")
    tag = uuid.uuid4().hex[:6]
    folder = f"e2e4-{tag}"
    dropbox_service.emulator.make_folder(f"/{folder}")
    gdrive_service.emulator.make_folder(folder)
    box_service.emulator.make_folder(f"/{folder}")
    onedrive_service.emulator.make_folder(f"/{folder}")
    uris = [f"dropbox:/{folder}", f"gdrive:{folder}", f"box:/{folder}", f"onedrive:/{folder}"]
    src = tmp_path / "src"
    make_tree(src, small_files=80)
    faults = dropbox_service.emulator.faults
    before = faults.injected
    faults.schedule(0.5, seed=44, kinds=DROPBOX_FAULTS)
    try:
        run_cli("init", str(src), "--replicas", "2", *(f"--backend={u}" for u in uris))
        run_cli("push", "-m", "first", cwd=src)
        tree = snapshot(src)
        clones = []
        for i, uri in enumerate(uris):
            clone = tmp_path / f"clone{i}"
            # The other providers are connected at once (a configuration's cloud
            # backends are not opened without it: they use this machine's grants).
            others = [arg for u in uris if u != uri for arg in ("--backend", u)]
            run_cli("clone", uri, str(clone), *others)
            assert snapshot(clone) == tree, f"clone from {uri} differs"
            clones.append(clone)
        (clones[2] / "from-box-clone.txt").write_text("edited in the clone made from Box\n")
        (clones[2] / "empty-file").unlink()
        run_cli("push", "-m", "edit", cwd=clones[2])
        run_cli("pull", cwd=src)
        run_cli("pull", cwd=clones[1])
        assert snapshot(src) == snapshot(clones[2]) == snapshot(clones[1])
        assert (src / "from-box-clone.txt").read_text() == "edited in the clone made from Box\n"
    finally:
        faults.clear()
    assert run_cli("fsck", cwd=src).returncode == 0
    assert faults.injected - before >= 30, "Dropbox did not throttle"
