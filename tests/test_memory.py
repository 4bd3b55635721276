"""Large files are streamed: memory does not grow with the size of a file."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from conftest import METASYNC, PASSPHRASE

_MEASURE = """
import resource, subprocess, sys
proc = subprocess.run(sys.argv[1:], capture_output=True, text=True)
if proc.returncode:
    sys.exit(proc.stderr)
print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
"""


def _peak_kb(*args: str, cwd: Path) -> int:
    """Peak resident memory (KiB) of one metasync command, in a fresh parent process
    so earlier commands do not count."""
    env = dict(os.environ, METASYNC_PASSPHRASE=PASSPHRASE)
    out = subprocess.run([sys.executable, "-c", _MEASURE, METASYNC, *args], cwd=cwd, env=env,
                         capture_output=True, text=True, check=True)
    return int(out.stdout.strip())


def _write_random(path: Path, megabytes: int) -> None:
    with open(path, "wb") as fh:
        for _ in range(megabytes):
            fh.write(os.urandom(1024 * 1024))


def test_push_and_clone_memory_is_flat(tmp_path: Path) -> None:
    """Pushing and cloning a 240 MB file needs no more memory than a 40 MB one (within
    48 MiB): files are chunked from a stream, packs are bounded and written out as
    they fill, and downloads are written chunk group by chunk group."""
    peaks: dict[int, tuple[int, int]] = {}
    for size in (40, 240):
        base = tmp_path / f"s{size}"
        src, b1, b2 = base / "src", base / "b1", base / "b2"
        for d in (src, b1, b2):
            d.mkdir(parents=True)
        _write_random(src / "big.bin", size)
        subprocess.run([METASYNC, "-q", "init", "--backend", f"dir:{b1}", "--backend", f"dir:{b2}"],
                       cwd=src, env=dict(os.environ, METASYNC_PASSPHRASE=PASSPHRASE), check=True)
        push = _peak_kb("-q", "push", cwd=src)
        clone = _peak_kb("-q", "clone", f"dir:{b2}", str(base / "dst"), cwd=base)
        assert (base / "dst" / "big.bin").stat().st_size == size * 1024 * 1024
        peaks[size] = (push, clone)
    (small_push, small_clone), (big_push, big_clone) = peaks[40], peaks[240]
    assert big_push - small_push < 48 * 1024, peaks
    assert big_clone - small_clone < 48 * 1024, peaks


def test_push_holds_no_pack_in_memory(tmp_path: Path) -> None:
    """Pushing 72 MB of small incompressible files (several 16 MiB packs) needs no
    more memory than 2 MB of them (within 24 MiB: the hashing window's files and the
    allocator's arenas come to 9-13 MiB; one pack held whole would add 16 MiB more,
    all of them 77 MiB, as before issue 21): each pack is written to the outbox as it
    fills, never gathered in memory."""
    peaks: dict[int, int] = {}
    for megabytes in (2, 72):
        base = tmp_path / f"s{megabytes}"
        src, b1 = base / "src", base / "b1"
        for d in (src, b1):
            d.mkdir(parents=True)
        for n in range(megabytes * 5):  # 200 KiB each: one blob, below CHUNK_MIN
            (src / f"{n:04}.bin").write_bytes(os.urandom(200 * 1024))
        subprocess.run([METASYNC, "-q", "init", "--backend", f"dir:{b1}"], cwd=src,
                       env=dict(os.environ, METASYNC_PASSPHRASE=PASSPHRASE), check=True)
        peaks[megabytes] = _peak_kb("-q", "push", cwd=src)
    assert peaks[72] - peaks[2] < 24 * 1024, peaks
