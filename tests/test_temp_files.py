"""Temporary files of killed uploads (issue 17, point 7).

A push killed mid-upload leaves ``.tmp-*`` files on backends (a whole pack, tens of
megabytes). Before the fix neither ``metasync gc`` nor ``fsck --repair`` ever removed
them, and ``fsck`` did not mention them. Now ``fsck`` reports those older than the
grace period with their total size, and ``fsck --repair`` and ``gc`` delete them;
a younger one -- possibly an upload in progress -- is never touched.

The push is killed for real (SIGKILL) at a deterministic point: a launcher makes the
``dir:`` backend's publishing rename of a pack kill the process, so the pack's
complete temporary file stays behind. Its age is then moved back with ``os.utime``
(the grace period is a day; no test waits one).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from conftest import PASSPHRASE, backend_dirs, run_cli

#: Runs ``metasync`` with the dir: backend's rename of a completed temporary file
#: into ``objects/`` replaced by a SIGKILL of the process: a push killed mid-upload.
LAUNCHER = """
import os, signal, sys
import metasync.backends.local as local
real = local.os.replace
def replace(src, dst, *args, **kwargs):
    if os.path.basename(str(src)).startswith(".tmp-") and "/objects/" in str(dst):
        os.kill(os.getpid(), signal.SIGKILL)
    return real(src, dst, *args, **kwargs)
local.os.replace = replace
sys.argv[0] = "metasync"
from metasync.cli import main
main()
"""

DAY = 24 * 3600


def temps(backend: Path) -> list[Path]:
    return sorted(p for p in backend.rglob(".tmp-*") if p.is_file())


def age(paths: list[Path], seconds: float) -> None:
    """Make ``paths`` look last written ``seconds`` ago."""
    when = time.time() - seconds
    for path in paths:
        os.utime(path, (when, when))


def killed_push(root: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "METASYNC_PASSPHRASE": PASSPHRASE}
    return subprocess.run([sys.executable, "-c", LAUNCHER, "push"], cwd=root, env=env,
                          capture_output=True, text=True, stdin=subprocess.DEVNULL)


def setup(tmp_path: Path) -> tuple[Path, dict[str, Path]]:
    b = backend_dirs(tmp_path, "b1", "b2")
    root = tmp_path / "repo"
    run_cli("init", str(root), "--backend", f"dir:{b['b1']}", "--backend", f"dir:{b['b2']}",
            "--replicas", "2")
    return root, b


def test_gc_removes_temp_files_of_a_killed_push_after_the_grace(tmp_path: Path) -> None:
    root, b = setup(tmp_path)
    (root / "big.bin").write_bytes(os.urandom(3 << 20))
    proc = killed_push(root)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    left = temps(b["b1"]) + temps(b["b2"])
    assert left and sum(p.stat().st_size for p in left) >= 3 << 20, left
    # Young: possibly an upload in progress. gc and fsck --repair leave them.
    run_cli("gc", cwd=root)
    run_cli("fsck", "--repair", cwd=root)
    assert temps(b["b1"]) + temps(b["b2"]) == left
    age(left, 2 * DAY)
    out = run_cli("fsck", cwd=root)  # not a problem: exit 0, but said
    assert f"{len(left)} temporary file(s) of interrupted uploads" in out.stdout, out.stdout
    assert "MB" in out.stdout and "fsck --repair" in out.stdout
    assert temps(b["b1"]) + temps(b["b2"]) == left
    out = run_cli("gc", cwd=root)
    assert f"removed {len(left)} temporary file(s)" in out.stdout, out.stdout
    assert temps(b["b1"]) + temps(b["b2"]) == []
    run_cli("push", cwd=root)
    run_cli("fsck", cwd=root)


def test_fsck_repair_removes_old_temp_files_and_keeps_young_ones(tmp_path: Path) -> None:
    root, b = setup(tmp_path)
    (root / "f.txt").write_text("hello\n")
    run_cli("push", cwd=root)
    old = [b["b1"] / "metasync" / "objects" / ".tmp-0123456789abcdef",
           b["b2"] / "metasync" / ".tmp-fedcba9876543210"]
    young = b["b1"] / "metasync" / "objects" / ".tmp-00112233445566ff"
    for path in [*old, young]:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"x" * (1 << 20))
    age(old, DAY + 3600)
    out = run_cli("fsck", cwd=root)
    assert "2 temporary file(s) of interrupted uploads, 2.1 MB" in out.stdout, out.stdout
    out = run_cli("fsck", "--repair", cwd=root)
    assert "removed 2 temporary file(s)" in out.stdout, out.stdout
    assert [p.exists() for p in old] == [False, False]
    assert young.exists()
    # gc --log-grace sets the grace: with 0 hours nothing is young any more.
    out = run_cli("gc", "--log-grace", "0", cwd=root)
    assert not young.exists(), out.stdout
