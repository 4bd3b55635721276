"""Shared fixtures: sample trees, tree comparison, and running the real CLI."""

from __future__ import annotations

import hashlib
import os
import random
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

# Detailed assertion messages inside the shared backend suite, which lives in the package.
pytest.register_assert_rewrite("metasync.backends.conformance")

from metasync.backends.conformance import deselect_inapplicable  # noqa: E402

# Fixtures that start real servers on loopback, one module per server.
pytest_plugins: list[str] = [
    "tests.servers.webdav",
    "tests.servers.seaweedfs",
    "tests.servers.sshd",
    "tests.servers.rclone",
    # Servers that break one primitive metasync's logs need (tests/test_primitives.py).
    "tests.servers.s3_no_conditionals",
    "tests.servers.paramiko_sftp",
    # exFAT, FAT32 and NTFS images mounted with FUSE (tests/servers/fsimages.py).
    "tests.servers.fsimages",
    # Emulators of the cloud providers' REST APIs (tests/emulators/).
    "tests.emulators.dropbox",
    "tests.emulators.box",
    "tests.emulators.onedrive",
    "tests.emulators.gdrive",
]

# Sign-ins (tokens) of the tests live in a throwaway folder, in files: never in the
# user's keyring or ~/.config. Set before anything reads them; child processes inherit.
os.environ["METASYNC_CONFIG_DIR"] = tempfile.mkdtemp(prefix="metasync-test-config-")
os.environ["METASYNC_TOKEN_STORE"] = "file"

# Key files the tests write use scrypt N=2**10, not 2**17 (~0.4 s each). A reader
# accepts such a file only while this is set, so it cannot weaken real key files.
os.environ.setdefault("METASYNC_INSECURE_TEST_SCRYPT_N", "1024")

# Backoff between retries in tests: short, so fault-injection tests stay quick.
os.environ.setdefault("METASYNC_RETRY_BASE", "0.02")

# Under pytest-xdist the workers collect (and deselect); they report the reasons
# through this file, which the controlling process prints in its summary.
_DESELECTED_LOG = "METASYNC_TEST_DESELECTED_LOG"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--live",
        action="store_true",
        default=False,
        help="also run tests marked `live` against the real cloud services (they need "
        "credentials in environment variables; see docs/backends.md)",
    )


def pytest_configure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput"):
        fd, path = tempfile.mkstemp(prefix="metasync-deselected-", suffix=".txt")
        os.close(fd)
        os.environ[_DESELECTED_LOG] = path


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    lines = deselect_inapplicable(config, items)
    if not config.getoption("--live"):
        # Tests against real services are deselected (not skipped) without --live.
        live = [item for item in items if item.get_closest_marker("live")]
        if live:
            config.hook.pytest_deselected(items=live)
            items[:] = [item for item in items if not item.get_closest_marker("live")]
            lines += [f"{item.nodeid}: a live test (run with --live)" for item in live]
    if lines:
        with open(os.environ[_DESELECTED_LOG], "a", encoding="utf-8") as log:
            log.writelines(line + "\n" for line in lines)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    path = os.environ.get(_DESELECTED_LOG)
    if path is None or hasattr(terminalreporter.config, "workerinput"):
        return
    with open(path, encoding="utf-8") as log:
        lines = sorted(set(log.read().splitlines()))
    os.unlink(path)
    if lines:
        terminalreporter.section("backend tests that do not apply (deselected)")
        for line in lines:
            terminalreporter.line(line)

PASSPHRASE = "correct horse battery staple"
METASYNC = str(Path(sys.executable).with_name("metasync"))


def run_cli(
    *args: str, cwd: Path | None = None, passphrase: str | None = PASSPHRASE, check: bool = True,
    env_extra: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run the installed ``metasync`` console script as a separate process
    (``env_extra``: more environment variables, e.g. METASYNC_NEW_PASSPHRASE)."""
    env = {k: v for k, v in os.environ.items() if k != "METASYNC_PASSPHRASE"}
    if passphrase is not None:
        env["METASYNC_PASSPHRASE"] = passphrase
    env.update(env_extra or {})
    proc = subprocess.run(
        [METASYNC, *args], cwd=cwd, env=env, capture_output=True, text=True, stdin=subprocess.DEVNULL
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"metasync {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr}")
    return proc


def one_line_error(proc: subprocess.CompletedProcess[str], *needles: str) -> str:
    """Assert that ``proc`` failed cleanly: non-zero exit, exactly one line on stderr,
    ``metasync: error: ...`` with every needle in it, no traceback; return the line."""
    assert proc.returncode != 0, proc.stdout
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("metasync: error: ") and "Traceback" not in proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def backend_dirs(tmp_path: Path, *names: str) -> dict[str, Path]:
    """Empty folders ``tmp_path/<name>`` for ``dir:`` backends, by name."""
    out = {}
    for name in names:
        out[name] = tmp_path / name
        out[name].mkdir()
    return out


def snapshot(root: Path) -> dict[str, tuple[str, ...]]:
    """Everything that must round-trip: type, content hash, exec bit, link target,
    and empty folders. ``.metasync`` is excluded."""
    result: dict[str, tuple[str, ...]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = os.path.relpath(dirpath, root)
        dirnames[:] = [d for d in dirnames if not (rel_dir == "." and d == ".metasync")]
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            rel = os.path.normpath(os.path.join(rel_dir, name))
            st = os.lstat(path)
            if stat.S_ISLNK(st.st_mode):
                result[rel] = ("link", os.readlink(path))
            elif stat.S_ISDIR(st.st_mode):
                result[rel] = ("dir",)
                if path.is_symlink():
                    dirnames.remove(name)
            else:
                digest = hashlib.blake2b(path.read_bytes()).hexdigest()
                result[rel] = ("file", digest, str(bool(st.st_mode & stat.S_IXUSR)))
    return result


def make_tree(root: Path, *, small_files: int = 200, big_mb: int = 0, seed: int = 7) -> None:
    """A tree with every kind of thing metasync must keep: empty files and folders,
    unicode names, exec bits, symlinks (inside and pointing outside), many small
    files across folders, and optionally one big incompressible file."""
    rng = random.Random(seed)
    root.mkdir(parents=True, exist_ok=True)
    (root / "empty-file").write_bytes(b"")
    (root / "empty-dir" / "nested-empty").mkdir(parents=True)
    (root / "ünïcödé — 名前").mkdir()
    (root / "ünïcödé — 名前" / "résumé ☃.txt").write_text("snow man\n")
    script = root / "bin" / "run.sh"
    script.parent.mkdir()
    script.write_text("#!/bin/sh\necho run\n")
    script.chmod(0o755)
    os.symlink("bin/run.sh", root / "link-to-script")
    os.symlink("/etc/hostname", root / "link-outside")
    os.symlink("does-not-exist", root / "dangling")
    for i in range(small_files):
        folder = root / "small" / f"d{i % 37:02d}"
        folder.mkdir(parents=True, exist_ok=True)
        size = rng.choice([0, 1, 17, 300, 2000, 9000])
        (folder / f"f{i:05d}.txt").write_bytes(rng.randbytes(size))
    if big_mb:
        with open(root / "big.bin", "wb") as fh:
            for _ in range(big_mb):
                fh.write(rng.randbytes(1024 * 1024))


#: The names of :func:`make_edge_case_tree` that some filesystem or OS cannot hold,
#: with why: what a checkout into exFAT, FAT, NTFS, a case-insensitive folder or
#: Windows must report per path and keep in history.
EDGE_CASE_HARD_NAMES = {
    "Case.txt": "differs from case.txt only in case",
    "case.txt": "differs from Case.txt only in case",
    "aux.txt": "a reserved device name on Windows",
    "CON": "a reserved device name on Windows",
    "a:b": "':' is refused by Windows, FAT and exFAT",
    "trailing-dot.": "a trailing dot is dropped by Windows",
    "trailing-space ": "a trailing space is dropped by Windows",
    "what?.txt": "'?' is refused by Windows, FAT and exFAT",
    "link-to-notes": "a symbolic link",
    "run.sh": "an exec bit",
}


def make_edge_case_tree(root: Path) -> None:
    """The tree a cross-platform sync must get right: everything :func:`make_tree`
    has (empty file and folder, unicode names, exec bit, symlinks) in a small form,
    plus names that differ only in case, Windows-reserved names and characters,
    trailing dots and spaces, an NFD name beside an NFC one (two different names
    here: ``café-nfc.txt`` and ``cafe\u0301-nfd.txt``), a 255-byte name, a deep
    path, a hidden file and a 5 MiB file spanning several chunks. The names
    :data:`EDGE_CASE_HARD_NAMES` lists are the ones some filesystem cannot hold."""
    rng = random.Random(18)
    root.mkdir(parents=True, exist_ok=True)
    (root / "empty-file").write_bytes(b"")
    (root / "empty-dir").mkdir()
    (root / "notes.txt").write_text("notes\n")
    (root / "Case.txt").write_text("upper\n")
    (root / "case.txt").write_text("lower\n")
    for name in ("aux.txt", "CON", "a:b", "trailing-dot.", "trailing-space ", "what?.txt"):
        (root / name).write_text(f"{name}\n")
    (root / "café-nfc.txt").write_text("composed\n")
    (root / "cafe\u0301-nfd.txt").write_text("decomposed\n")
    (root / ("n" * 251 + ".txt")).write_text("long\n")
    deep = root.joinpath(*(f"level{i}" for i in range(12)))
    deep.mkdir(parents=True)
    (deep / "deep.txt").write_text("deep\n")
    (root / ".hidden").write_text("hidden\n")
    (root / "ünïcödé — 名前 ☃.txt").write_text("snow man\n")
    script = root / "run.sh"
    script.write_text("#!/bin/sh\necho run\n")
    script.chmod(0o755)
    os.symlink("notes.txt", root / "link-to-notes")
    (root / "big.bin").write_bytes(rng.randbytes(5 * 1024 * 1024))


@pytest.fixture(autouse=True)
def _no_pause_from_an_earlier_test() -> None:
    """Backends opened in this process share each URI's pause after a silence
    (:func:`metasync.backends.retry.silence_of`); a test starts with none, so a
    server on a port an earlier test's silent server had is asked."""
    from metasync.backends import retry

    with retry._silences_lock:
        retry._silences.clear()


@pytest.fixture
def backends(tmp_path: Path) -> list[Path]:
    """Three empty backend folders."""
    dirs = [tmp_path / f"backend{i}" for i in range(3)]
    for d in dirs:
        d.mkdir()
    return dirs


@pytest.fixture
def passphrase() -> Callable[[], str]:
    return lambda: PASSPHRASE


def copy_backends(src: list[Path], dst_root: Path) -> list[Path]:
    dst = []
    for i, d in enumerate(src):
        target = dst_root / f"backend{i}"
        shutil.copytree(d, target, symlinks=True)
        dst.append(target)
    return dst


def wait_until(condition: Callable[[], Any], timeout: float, what: str,
               detail: Callable[[], str] | None = None, every: float = 0.1) -> Any:
    """Poll ``condition`` every ``every`` seconds until it returns something truthy
    (returned); fail naming ``what`` -- with the last exception and ``detail()`` --
    at the deadline. An exception a check of a live folder meets (a file replaced
    mid-read, a JSON file half-written, a key not there yet) counts as "not yet"."""
    deadline = time.monotonic() + timeout
    tick = threading.Event()
    last: BaseException | None = None
    while True:
        try:
            result = condition()
            if result:
                return result
        except (OSError, ValueError, KeyError, AssertionError) as exc:
            last = exc
        if time.monotonic() >= deadline:
            pytest.fail(f"not within {timeout:g} s: {what}"
                        + (f" (last error: {last})" if last else "")
                        + (f"\n{detail()}" if detail else ""))
        tick.wait(every)
