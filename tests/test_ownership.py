"""A ``.metasync`` folder someone else planted is not opened (issue 16, scenario 7).

Like git's ``safe.directory``: a command opens a repository only if its
``.metasync`` folder (and the state and key files in it) belong to the user
running it and no one else can write to it, or if the user trusted its folder
(``metasync trust``, or ``METASYNC_SAFE_DIRECTORIES``). The tests run as root, so
the planter is uid 65534 (``nobody``): the files are given to it with ``chown``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from conftest import one_line_error, run_cli
from metasync import Repository
from metasync.errors import UnsafeRepository

#: The other user: ``nobody`` on Debian and most Linux distributions.
PLANTER = 65534


@pytest.fixture(autouse=True)
def _own_config_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test trusts folders in a configuration folder of its own."""
    monkeypatch.setenv("METASYNC_CONFIG_DIR", str(tmp_path / "config"))
    monkeypatch.delenv("METASYNC_SAFE_DIRECTORIES", raising=False)


def _chown_tree(path: Path, uid: int) -> None:
    os.lchown(path, uid, uid)
    for dirpath, dirnames, filenames in os.walk(path):
        for name in dirnames + filenames:
            os.lchown(os.path.join(dirpath, name), uid, uid)


def _planted(tmp_path: Path) -> tuple[Path, Path]:
    """A shared parent folder where another user made a repository (``shared``),
    and the victim's own folder of files inside it (``victim``)."""
    shared = tmp_path / "shared"
    backend = tmp_path / "planter-backend"
    backend.mkdir()
    Repository.init(shared, [f"dir:{backend}"], replicas=1, encrypt=False).close()
    _chown_tree(shared / ".metasync", PLANTER)
    victim = shared / "victim"
    (victim / "deeper").mkdir(parents=True)
    (victim / "secret.txt").write_text("the victim's secret\n")
    return shared, victim


def _refused(proc: object, *needles: str) -> str:
    import subprocess

    assert isinstance(proc, subprocess.CompletedProcess)
    line = one_line_error(proc, *needles)
    assert "secret.txt" not in proc.stdout
    return line


def test_status_in_a_subfolder_of_a_foreign_repository_is_refused(tmp_path: Path) -> None:
    """The issue's scenario: `metasync status` run in the victim's folder under a
    shared parent where another user planted a repository does not list the
    victim's files as that repository's changes; it names the owner and the fix."""
    shared, victim = _planted(tmp_path)
    for cwd in (victim, victim / "deeper"):
        proc = run_cli("status", cwd=cwd, check=False)
        _refused(proc, f"{shared / '.metasync'}", f"uid {PLANTER}", f"metasync trust {shared}")
    proc = run_cli("push", cwd=victim, check=False)
    _refused(proc, "metasync trust")
    with pytest.raises(UnsafeRepository):
        Repository.open(victim)


def test_a_foreign_state_file_is_refused(tmp_path: Path) -> None:
    """The folder is this user's but the state file in it is not (it was put there
    while the folder was open to others): refused as well."""
    shared, victim = _planted(tmp_path)
    _chown_tree(shared / ".metasync", os.geteuid())
    os.lchown(shared / ".metasync" / "state.db", PLANTER, PLANTER)
    proc = run_cli("status", cwd=victim, check=False)
    _refused(proc, "state.db", f"uid {PLANTER}")


def test_a_metasync_folder_others_can_write_is_refused(tmp_path: Path) -> None:
    """Owned by this user but writable by the group or everyone: anyone could plant
    files in it, so it is refused, and the message names the chmod that fixes it."""
    shared, victim = _planted(tmp_path)
    _chown_tree(shared / ".metasync", os.geteuid())
    (shared / ".metasync").chmod(0o777)
    proc = run_cli("status", cwd=victim, check=False)
    _refused(proc, "writable by others", f"chmod go-w {shared / '.metasync'}")


def test_trust_opens_it(tmp_path: Path) -> None:
    """`metasync trust REPO` (the fix the message names) records the folder for this
    user; the repository then opens. `--remove` takes it back."""
    shared, victim = _planted(tmp_path)
    run_cli("trust", str(shared), cwd=tmp_path)
    proc = run_cli("status", cwd=victim)
    assert "secret.txt" in proc.stdout
    run_cli("trust", "--remove", str(shared), cwd=tmp_path)
    _refused(run_cli("status", cwd=victim, check=False), "metasync trust")


def test_environment_trusts_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``METASYNC_SAFE_DIRECTORIES`` (paths separated by ``:``) trusts folders for one
    process or session, like git's ``safe.directory``."""
    shared, victim = _planted(tmp_path)
    monkeypatch.setenv("METASYNC_SAFE_DIRECTORIES", f"{tmp_path / 'elsewhere'}:{shared}")
    assert "secret.txt" in run_cli("status", cwd=victim).stdout


def test_own_repository_below_a_foreign_one_opens(tmp_path: Path) -> None:
    """The search upwards stops at the nearest repository: the victim's own, below
    the planted one, opens as always."""
    _, victim = _planted(tmp_path)
    backend = tmp_path / "victim-backend"
    backend.mkdir()
    Repository.init(victim, [f"dir:{backend}"], replicas=1, encrypt=False).close()
    proc = run_cli("status", "--json", cwd=victim / "deeper")
    assert "secret.txt" in proc.stdout
