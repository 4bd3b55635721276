"""Files and folders the user running metasync cannot read (issue 17, point 4).

Such a path is never synced, and never taken for deleted: ``status`` lists it as
``cannot read: PATH (Permission denied)`` (never "folder clean"), every ``push``
warns about it with the real reason and exits 3 once the rest is pushed (as
``restic backup`` does when some files could not be read), the last committed
version of the path (a file's content, a folder's whole subtree) stays in the new
commit, and the rest of the folder syncs. The daemon lists them in ``daemon status``
and keeps syncing the rest.

The tests run as root, whom file modes do not stop. So every ``metasync`` command
runs as ``nobody`` (``setpriv``), in a world-traversable temporary folder that
``nobody`` owns, and the modes are real obstacles to it; the clones that check
what was pushed are made as root.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import METASYNC, run_cli

#: The unprivileged user the commands run as (``nobody`` on Debian and most Linux).
NOBODY = 65534


def _env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("METASYNC_")}
    env["HOME"] = str(home)
    env["METASYNC_CONFIG_DIR"] = str(home / "config")
    return env


class Nobody:
    """Runs ``metasync`` as ``nobody`` in a folder ``nobody`` owns."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.folder = base / "folder"
        self.backends = [base / "b1", base / "b2"]

    def __call__(self, *args: str, cwd: Path | None = None, check: bool = True,
                 timeout: float = 120) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(
            ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
             METASYNC, *args],
            cwd=cwd or self.folder, env=_env(self.base), capture_output=True, text=True,
            stdin=subprocess.DEVNULL, timeout=timeout,
        )
        if check and proc.returncode != 0:
            raise AssertionError(f"metasync {' '.join(args)} failed ({proc.returncode}):\n"
                                 f"{proc.stdout}\n{proc.stderr}")
        return proc

    def write(self, rel: str, data: str) -> Path:
        """Write a file as ``nobody`` would own it."""
        path = self.folder / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(data)
        _own(self.base)
        return path


def _own(path: Path) -> None:
    for dirpath, dirnames, filenames in os.walk(path):
        os.lchown(dirpath, NOBODY, NOBODY)
        for name in dirnames + filenames:
            os.lchown(os.path.join(dirpath, name), NOBODY, NOBODY)


@pytest.fixture
def nobody() -> Iterator[Nobody]:
    """A repository of ``nobody`` on two ``dir:`` backends, with a.txt and secret.txt
    pushed, and private/ holding two files."""
    if shutil.which("setpriv") is None:
        pytest.skip("needs setpriv (util-linux) to run as another user")
    if os.geteuid() != 0:
        pytest.skip("needs root to run commands as another user")
    base = Path(tempfile.mkdtemp(prefix="metasync-unreadable-", dir="/tmp"))
    base.chmod(0o755)
    try:
        user = Nobody(base)
        for b in user.backends:
            b.mkdir()
        user.folder.mkdir()
        user.write("a.txt", "a v1\n")
        user.write("secret.txt", "secret v1\n")
        user.write("private/one.txt", "one v1\n")
        user.write("private/deep/two.txt", "two v1\n")
        user("init", str(user.folder), "--no-encrypt", "--replicas", "2",
             *[f"--backend=dir:{b}" for b in user.backends], cwd=base)
        user("push")
        yield user
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _clone(user: Nobody, tmp_path: Path) -> Path:
    dest = tmp_path / "clone"
    run_cli("clone", f"dir:{user.backends[0]}", str(dest), "--no-encrypt",
            *[f"--backend=dir:{b}" for b in user.backends[1:]], passphrase=None)
    return dest


def test_an_unreadable_file_is_listed_by_status(nobody: Nobody) -> None:
    (nobody.folder / "secret.txt").chmod(0)
    proc = nobody("status")
    assert "cannot read: secret.txt (Permission denied)" in proc.stdout
    assert "clean" not in proc.stdout
    assert "D secret.txt" not in proc.stdout  # not taken for deleted
    doc = json.loads(nobody("status", "--json").stdout)
    assert doc["clean"] is False
    assert doc["unreadable"] == [{"path": "secret.txt", "reason": "Permission denied",
                                  "type": "file"}]
    assert doc["changes"] == []


def test_push_warns_on_every_run_and_keeps_the_last_committed_version(
        nobody: Nobody, tmp_path: Path) -> None:
    secret = nobody.folder / "secret.txt"
    secret.write_text("secret v2, never readable to metasync\n")
    secret.chmod(0)
    nobody.write("a.txt", "a v2\n")
    for _ in range(2):  # every run says it, not only the first
        proc = nobody("push", check=False)
        assert proc.returncode == 3, proc.stderr
        assert "warning: cannot read secret.txt: Permission denied" in proc.stderr
        assert "changed while being read" not in proc.stderr + proc.stdout
        assert "1 path(s) could not be read" in proc.stderr
    clone = _clone(nobody, tmp_path)
    assert (clone / "a.txt").read_text() == "a v2\n"  # the rest was synced
    assert (clone / "secret.txt").read_text() == "secret v1\n"  # not deleted


def test_a_new_unreadable_file_is_reported_and_not_pushed(nobody: Nobody, tmp_path: Path) -> None:
    nobody.write("new.txt", "new\n").chmod(0)
    assert "cannot read: new.txt (Permission denied)" in nobody("status").stdout
    proc = nobody("push", check=False)
    assert proc.returncode == 3
    assert "warning: cannot read new.txt: Permission denied" in proc.stderr
    clone = _clone(nobody, tmp_path)
    assert not (clone / "new.txt").exists()
    assert (clone / "secret.txt").read_text() == "secret v1\n"


def test_an_unreadable_folder_keeps_its_subtree_and_the_rest_syncs(
        nobody: Nobody, tmp_path: Path) -> None:
    private = nobody.folder / "private"
    nobody.write("a.txt", "a v2\n")
    nobody.write("b.txt", "b\n")
    private.chmod(0)
    try:
        st = nobody("status")
        assert "cannot read: private/ (Permission denied)" in st.stdout
        assert "D private" not in st.stdout
        assert "A b.txt" in st.stdout
        proc = nobody("push", check=False)
        assert proc.returncode == 3, proc.stderr
        assert "warning: cannot read private/: Permission denied" in proc.stderr
        assert "Pushed version" in proc.stdout
    finally:
        private.chmod(0o755)
    clone = _clone(nobody, tmp_path)
    assert (clone / "a.txt").read_text() == "a v2\n"
    assert (clone / "b.txt").read_text() == "b\n"
    assert (clone / "private" / "one.txt").read_text() == "one v1\n"
    assert (clone / "private" / "deep" / "two.txt").read_text() == "two v1\n"


def test_a_folder_that_can_be_listed_but_not_entered(nobody: Nobody, tmp_path: Path) -> None:
    """``r--``: its names can be listed, nothing in it can be stat'ed or read."""
    private = nobody.folder / "private"
    private.chmod(0o444)
    try:
        st = nobody("status")
        assert "cannot read: private/ (Permission denied)" in st.stdout
        assert " D " not in st.stdout
        nobody.write("c.txt", "c\n")
        assert nobody("push", check=False).returncode == 3
    finally:
        private.chmod(0o755)
    clone = _clone(nobody, tmp_path)
    assert (clone / "c.txt").read_text() == "c\n"
    assert (clone / "private" / "deep" / "two.txt").read_text() == "two v1\n"


def test_once_readable_again_it_syncs(nobody: Nobody, tmp_path: Path) -> None:
    secret = nobody.folder / "secret.txt"
    secret.write_text("secret v2\n")
    secret.chmod(0)
    assert nobody("push", check=False).returncode == 3
    secret.chmod(0o644)
    proc = nobody("push")
    assert "cannot read" not in proc.stderr
    assert (_clone(nobody, tmp_path) / "secret.txt").read_text() == "secret v2\n"


def test_pull_never_replaces_an_unreadable_file_unkept(nobody: Nobody, tmp_path: Path) -> None:
    """A remote change to a file that cannot be read here must not overwrite it (it
    may hold an edit no scan could see): as for any local edit, the local file is
    kept as a conflict copy and the remote version takes its place."""
    clone = _clone(nobody, tmp_path)
    (clone / "secret.txt").write_text("secret from the clone\n")
    run_cli("push", cwd=clone, passphrase=None)
    secret = nobody.folder / "secret.txt"
    secret.write_text("secret edited here\n")
    secret.chmod(0)
    proc = nobody("pull", check=False)
    assert proc.returncode == 0, proc.stderr
    assert secret.read_text() == "secret from the clone\n"
    copies = [p for p in nobody.folder.iterdir() if "conflict" in p.name]
    assert [p.read_text() for p in copies] == ["secret edited here\n"]


def test_a_folder_replacing_an_unreadable_file_keeps_the_file(nobody: Nobody,
                                                              tmp_path: Path) -> None:
    """Another machine made a folder where a file is that cannot be read here: the
    file is kept as a conflict copy and the folder is written (it was silently
    taken for a folder this file system refused, so the next push undid it)."""
    clone = _clone(nobody, tmp_path)
    (clone / "secret.txt").unlink()
    (clone / "secret.txt").mkdir()
    (clone / "secret.txt" / "inner.txt").write_text("inner\n")
    run_cli("push", cwd=clone, passphrase=None)
    secret = nobody.folder / "secret.txt"
    secret.write_text("secret edited here\n")
    secret.chmod(0)
    proc = nobody("pull", check=False)
    assert proc.returncode == 0, proc.stderr
    assert (secret / "inner.txt").read_text() == "inner\n"
    copies = [p for p in nobody.folder.iterdir() if "conflict" in p.name]
    assert len(copies) == 1, proc.stderr
    copies[0].chmod(0o644)
    assert copies[0].read_text() == "secret edited here\n"


def test_pull_leaves_an_unreadable_folder_alone(nobody: Nobody, tmp_path: Path) -> None:
    """Remote changes inside a folder that cannot be read wait (nothing can be
    written into it); the rest of the pull is applied."""
    clone = _clone(nobody, tmp_path)
    (clone / "private" / "one.txt").write_text("one v2\n")
    (clone / "a.txt").write_text("a v2\n")
    run_cli("push", cwd=clone, passphrase=None)
    private = nobody.folder / "private"
    private.chmod(0)
    try:
        proc = nobody("pull", check=False)
        assert proc.returncode == 0, proc.stderr
        assert "cannot read private/" in proc.stderr
        assert (nobody.folder / "a.txt").read_text() == "a v2\n"
    finally:
        private.chmod(0o755)
    # Readable again: the held-back change is applied by the next command (it is
    # not taken for a local edit and pushed back).
    assert "folder clean" in nobody("status").stdout
    assert (private / "one.txt").read_text() == "one v2\n"
    assert "Everything up to date" in nobody("push").stdout


def test_the_daemon_reports_them_and_syncs_the_rest(nobody: Nobody, tmp_path: Path) -> None:
    private = nobody.folder / "private"
    private.chmod(0)
    (nobody.folder / "secret.txt").chmod(0)
    daemon = subprocess.Popen(
        ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", METASYNC,
         "daemon", "--settle", "0.3", "--poll", "0.5", "--rescan", "5"],
        cwd=nobody.folder, env=_env(nobody.base), stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True)
    try:
        nobody.write("fresh.txt", "fresh\n")
        deadline = time.monotonic() + 60
        doc: dict[str, object] = {}
        while time.monotonic() < deadline:
            doc = json.loads(nobody("daemon", "status", "--json").stdout)
            if doc.get("unreadable") and doc.get("state") == "idle" and doc.get("version") == 2:
                break
            time.sleep(0.2)  # polling for a condition with a deadline, not synchronising
        assert doc.get("state") == "idle", doc
        assert doc.get("unreadable") == ["private/ (Permission denied)",
                                         "secret.txt (Permission denied)"], doc
        text = nobody("daemon", "status").stdout
        assert "cannot read: private/ (Permission denied)" in text
    finally:
        daemon.terminate()
        daemon.wait(timeout=60)
        private.chmod(0o755)
    clone = _clone(nobody, tmp_path)
    assert (clone / "fresh.txt").read_text() == "fresh\n"
    assert (clone / "secret.txt").read_text() == "secret v1\n"
    assert (clone / "private" / "one.txt").read_text() == "one v1\n"
