"""``bin/demo``, the README's first command: it runs to the end printing no error,
and any step that fails (a metasync command, a ``diff`` that finds a difference)
makes it exit non-zero. ``METASYNC_DEMO_BIN`` points it at the tools under test
(this interpreter's ``metasync``, or a shim in front of it) instead of .venv."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

DEMO = Path(__file__).resolve().parent.parent / "bin" / "demo"


def _run_demo(tmp_path: Path, bin_dir: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("METASYNC_")}
    env["METASYNC_DEMO_BIN"] = str(bin_dir)
    env.update({k: os.environ[k] for k in ("METASYNC_CONFIG_DIR", "METASYNC_TOKEN_STORE",
                                           "METASYNC_INSECURE_TEST_SCRYPT_N")
                if k in os.environ})
    return subprocess.run(["bash", str(DEMO), str(tmp_path / "demo")], env=env,
                          capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=300)


def _shim(tmp_path: Path, name: str, body: str) -> Path:
    """A folder holding ``metasync`` (the real one unless ``name`` is it) and a
    shim ``name`` running ``body``."""
    shims = tmp_path / "shims"
    shims.mkdir(exist_ok=True)
    real = Path(sys.executable).with_name("metasync")
    if name != "metasync":
        (shims / "metasync").symlink_to(real)
    script = shims / name
    script.write_text(f"#!/usr/bin/env bash\nREAL={real}\n{body}\n")
    script.chmod(0o755)
    return shims


def test_demo_runs_clean() -> None:
    import tempfile

    with tempfile.TemporaryDirectory(prefix="metasync-demo-test-") as tmp:
        proc = _run_demo(Path(tmp), Path(sys.executable).parent)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr
    assert "error" not in proc.stderr.lower(), proc.stderr
    assert "Usage:" not in proc.stderr
    out = proc.stdout
    for said in ("identical: content", "identical again", "identical, both versions kept",
                 "identical without the usb disk"):
        assert said in out, out[-3000:]
    assert "version 1" in out and "laptop plan" in out and "desktop plan" in out


def test_demo_fails_when_a_metasync_step_fails(tmp_path: Path) -> None:
    """The laptop's pull after the concurrent pushes fails: the demo stops there,
    non-zero, and never claims the trees are identical."""
    shims = _shim(tmp_path, "metasync", 'if [[ " $* " == *" pull "* ]] && '
                  '[[ -e "$PWD/docs/plan.txt" ]]; then echo "shim: pull failed" >&2; exit 3; fi\n'
                  'exec "$REAL" "$@"')
    proc = _run_demo(tmp_path, shims)
    assert proc.returncode != 0, proc.stdout[-2000:]
    assert "shim: pull failed" in proc.stderr
    assert "identical, both versions kept" not in proc.stdout


def test_demo_fails_when_a_diff_differs(tmp_path: Path) -> None:
    """A ``diff`` that finds a difference after the desktop's edits stops the demo."""
    flag = tmp_path / "first-diff-done"
    real_diff = shutil.which("diff")
    shims = _shim(tmp_path, "diff", f'if [[ -e "{flag}" ]]; then exit 1; fi\n'
                  f'touch "{flag}"; exec {real_diff} "$@"')
    proc = _run_demo(tmp_path, shims)
    assert proc.returncode != 0, proc.stdout[-2000:]
    assert "identical: content" in proc.stdout
    assert "identical again" not in proc.stdout
