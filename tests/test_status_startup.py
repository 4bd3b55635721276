"""What a no-change ``metasync status --offline`` loads (issue 21: status at most 3x
``git status``). Its time is the interpreter's start, the imports and one pass
over the folder; bench/ measures the time, this guards the imports: each module
below is one that status never needs and that once cost it start-up time.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import PASSPHRASE, run_cli

#: Modules a no-change offline status must not import, and why each was costly.
NOT_FOR_STATUS = {
    # portalocker's import reads every installed package's metadata (~0.1 s);
    # status locks with flock directly (metasync.portable).
    "portalocker": "reads every package's metadata on import",
    "importlib.metadata": "scans site-packages",
    # pathname2url (the daemon's read-only state.db) pulled in HTTP and TLS.
    "urllib.request": "HTTP client, ssl and email",
    "http.client": "HTTP client",
    "ssl": "TLS",
    "ctypes": "the no-replace rename's C library, loaded when first called",
    "webbrowser": "metasync gui's",
    "pyfastcdc": "content-defined chunking: only a file read again needs it",
    # The command modules: each is loaded when its own command runs.
    "metasync.cli_app": "the service commands",
    "metasync.cli_daemon": "the daemon commands",
    "metasync.cli_forget": "forget",
    "metasync.cli_gui": "gui",
    "metasync.cli_history": "log",
    "metasync.cli_keys": "key",
    "metasync.cli_mount": "mount",
    "metasync.cli_sparse": "sparse",
    # What the repository loads on first use only.
    "metasync.history": "log, restore and the online standing",
    "metasync.sync": "push and pull",
    "metasync.lifecycle": "init and clone",
    "metasync.fsck": "fsck",
    "metasync.daemon": "the daemon",
}

#: Runs the console script's entry point in this process, then prints which of the
#: modules above it imported (stdout: status's own output, then that JSON line).
PROBE = """
import json, sys
sys.argv = ["metasync", "--quiet", "status", "--offline"]
from metasync.entry import main
try:
    main()
except SystemExit as exc:
    code = exc.code
print(json.dumps({"exit": code, "loaded": sorted(m for m in %r if m in sys.modules)}))
"""


def test_no_change_offline_status_imports_only_what_it_needs(
        tmp_path: Path, backends: list[Path]) -> None:
    root = tmp_path / "folder"
    (root / "docs").mkdir(parents=True)
    for i in range(5):
        (root / "docs" / f"f{i}.txt").write_text(f"file {i}\n")
    run_cli("init", str(root), *(f"--backend=dir:{b}" for b in backends))
    run_cli("push", cwd=root)
    env = {**os.environ, "METASYNC_PASSPHRASE": PASSPHRASE}
    proc = subprocess.run([sys.executable, "-c", PROBE % (sorted(NOT_FOR_STATUS),)],
                          cwd=root, env=env, capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.splitlines()[-1])
    assert report["exit"] == 0, proc.stderr  # a clean status (no daemon: it scanned)
    loaded = {m: NOT_FOR_STATUS[m] for m in report["loaded"]}
    assert not loaded, f"status imported modules it does not need: {loaded}"
