"""Shared pieces of the benchmarks: timed commands, tree checks, machine facts, results.

Every timed command runs as its own process; its wall time is measured with
``time.perf_counter`` around it, and its CPU time and peak memory (maximum
resident set size, of the process and its waited-for children) come from
``os.wait4``. Dirty pages are flushed (``os.sync``, not timed) before each one
so that one step's pending writes are not billed to the next.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
ROOT = BENCH_DIR.parent
#: Where results go; ``bin/bench --quick`` points it elsewhere so smoke runs never
#: become the latest results.
RESULTS_DIR = Path(os.environ.get("METASYNC_BENCH_RESULTS") or BENCH_DIR / "results")
WORK_DIR = BENCH_DIR / "work"
VENV_BIN = ROOT / ".venv" / "bin"
METASYNC = VENV_BIN / "metasync"
RCLONE = VENV_BIN / "rclone"
PASSPHRASE = "metasync-bench-passphrase"
#: Longest a single benchmarked command may run before it is stopped.
COMMAND_TIMEOUT = 3 * 3600


class BenchError(RuntimeError):
    """A benchmarked or helper command failed."""


def log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


@dataclass
class Timing:
    """Wall-clock, CPU time and peak memory of one or more commands."""

    wall: float = 0.0
    user: float = 0.0
    sys: float = 0.0
    max_rss_kib: int = 0
    commands: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    def add(self, other: Timing) -> Timing:
        self.wall += other.wall
        self.user += other.user
        self.sys += other.sys
        self.max_rss_kib = max(self.max_rss_kib, other.max_rss_kib)
        self.commands.extend(other.commands)
        for k, v in other.extra.items():
            if isinstance(v, int | float) and isinstance(self.extra.get(k), int | float):
                self.extra[k] += v
            else:
                self.extra[k] = v
        return self

    def as_dict(self) -> dict[str, Any]:
        return {
            "wall_s": round(self.wall, 4),
            "user_s": round(self.user, 4),
            "sys_s": round(self.sys, 4),
            "max_rss_mib": round(self.max_rss_kib / 1024, 1),
            "commands": self.commands,
            **self.extra,
        }


def run(
    cmd: Sequence[str | Path],
    cwd: Path,
    env: Mapping[str, str] | None = None,
    timeout: float = COMMAND_TIMEOUT,
) -> tuple[Timing, str]:
    """Run ``cmd``, time it; return (timing, stdout). Raise ``BenchError`` with its
    output if it fails or runs longer than ``timeout`` seconds."""
    argv = [str(c) for c in cmd]
    full_env = {**os.environ, **(env or {})}
    os.sync()
    out_path = WORK_DIR / f".cmd-{os.getpid()}-{threading.get_ident()}.out"
    out_path.parent.mkdir(parents=True, exist_ok=True)
    with open(out_path, "w+b") as out:
        start = time.perf_counter()
        proc = subprocess.Popen(argv, cwd=cwd, env=full_env, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        timer = threading.Timer(timeout, lambda: _kill_group(proc.pid))
        timer.start()
        try:
            _, status, usage = os.wait4(proc.pid, 0)
        finally:
            timer.cancel()
        wall = time.perf_counter() - start
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        output = out.read().decode(errors="replace")
    out_path.unlink(missing_ok=True)
    if proc.returncode != 0:
        why = f"timed out after {timeout:.0f} s" if wall >= timeout else f"exit {proc.returncode}"
        raise BenchError(f"command failed ({why}) in {cwd}: {' '.join(argv)}\n{output[-6000:]}")
    return Timing(wall, usage.ru_utime, usage.ru_stime, usage.ru_maxrss, [" ".join(argv)]), output


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def hardlink_copy(src: Path, dst: Path) -> None:
    """A copy of ``src`` at ``dst`` whose files are hard links (instant, no space);
    edits must replace files (see ``workloads.modify_tree``), never write in place."""
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst, symlinks=True, copy_function=os.link)


def manifest(root: Path) -> dict[str, tuple[int, str]]:
    """Each file's relative path under ``root`` -> (size, sha256); top-level dot
    entries (tool metadata such as ``.metasync``) are skipped."""
    out: dict[str, tuple[int, str]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = Path(dirpath).relative_to(root)
        if rel_dir == Path("."):
            dirnames[:] = [d for d in dirnames if not d.startswith(".")]
            filenames = [f for f in filenames if not f.startswith(".")]
        for name in filenames:
            path = Path(dirpath) / name
            h = hashlib.sha256()
            with open(path, "rb") as fh:
                while chunk := fh.read(1 << 20):
                    h.update(chunk)
            out[(rel_dir / name).as_posix()] = (path.stat().st_size, h.hexdigest())
    return out


def verify_copy(expected: dict[str, tuple[int, str]], root: Path, what: str) -> None:
    """Raise ``BenchError`` unless ``root`` holds exactly the files in ``expected``."""
    got = manifest(root)
    if got == expected:
        return
    missing = sorted(set(expected) - set(got))
    extra = sorted(set(got) - set(expected))
    differ = sorted(p for p in set(expected) & set(got) if expected[p] != got[p])
    raise BenchError(
        f"{what} differs from the source: {len(missing)} missing, {len(extra)} extra, "
        f"{len(differ)} different; e.g. missing {missing[:3]}, extra {extra[:3]}, "
        f"different {differ[:3]}"
    )


#: ``--fs`` choices: a fresh ext4 made for the run, or a folder of the host's own.
SCRATCH_FS = ("ext4", "host")
#: Size of the sparse image behind ``--fs ext4`` (only what is written takes space).
SCRATCH_IMAGE_BYTES = 16 << 30


@contextmanager
def scratch_fs(kind: str, work: Path) -> Iterator[tuple[Path, str]]:
    """Yield (a folder for the run's copies, what file system it is on).

    ``ext4``: a fresh ext4 file system, made by ``mkfs.ext4`` with its defaults (so
    with a journal, as on a user's disk), on a loop device over a sparse file in
    ``work``; unmounted and deleted afterwards. Both tools then create their files on
    the same fresh file system, so a figure measures the tools. The host's own
    folders need not be like that: this machine's root ext4 has no journal, and there
    creating the same 16k files cost 0.3 s of system time in one folder and 1.7-5.8 s
    in another, by the block group each folder's inodes came from (docs/benchmarks.md).
    ``host``: ``work`` itself, as before.
    """
    if kind == "host":
        yield work, "host folder"
        return
    if os.geteuid() != 0 or not shutil.which("mkfs.ext4"):
        raise BenchError("--fs ext4 needs root and mkfs.ext4 (e2fsprogs); or use --fs host")
    image, mnt = work / "scratch-ext4.img", work / "scratch-ext4"
    subprocess.run(["umount", str(mnt)], capture_output=True)  # a previous run's, if left
    image.unlink(missing_ok=True)
    mnt.mkdir(parents=True, exist_ok=True)
    with open(image, "wb") as fh:
        fh.truncate(SCRATCH_IMAGE_BYTES)
    try:
        for cmd in (["mkfs.ext4", "-q", "-F", str(image)],
                    ["mount", "-o", "loop", str(image), str(mnt)]):
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0:
                raise BenchError(f"{' '.join(cmd)} failed: {done.stderr.strip()}; "
                                 "or use --fs host")
        try:
            yield mnt, "ext4 (mkfs.ext4 defaults, loop device)"
        finally:
            subprocess.run(["umount", str(mnt)], capture_output=True)
    finally:
        image.unlink(missing_ok=True)


#: What the installed copy is built from (:func:`installed_copy`): the package's own files.
PACKAGE_SOURCES = ("pyproject.toml", "README.md", "LICENSE", "metasync", "backends", "translators")


def installed_copy(work: Path) -> Path:
    """Install this checkout as a user gets it and return that copy's ``metasync``.

    The development virtualenv holds metasync as an editable install: every Python
    it starts first imports setuptools' import finder for it (``pathlib``, ``re``,
    ``fnmatch``...), ~20 ms on this machine, a cost no installed copy pays and a
    fifth of a no-change ``status``. So a wheel is built from a clean copy of the
    source as it is now (a stale ``build/lib`` could slip deleted modules in), with
    ``bin/setup-venv``'s wheelhouse when there is one, and installed (bytecode
    compiled) into a virtualenv of its own in ``work/installed``. Its dependencies
    are the development virtualenv's, reached by a path file: a plain path, so that
    folder's own ``.pth`` files, the finder's among them, are not run.
    """
    dest, build = work / "installed", work / "installed-build"
    python = VENV_BIN / "python"
    for folder in (dest, build):
        shutil.rmtree(folder, ignore_errors=True)
    src = build / "src"
    src.mkdir(parents=True)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in PACKAGE_SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=ignore)
        else:
            shutil.copy2(ROOT / name, src / name)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    wheelhouse = ROOT / ".venv" / "wheelhouse"
    if any(wheelhouse.glob("setuptools-*.whl")):
        env.update(PIP_NO_INDEX="1", PIP_FIND_LINKS=str(wheelhouse))

    def step(cmd: list[str]) -> str:
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
        if done.returncode != 0:
            raise BenchError(f"installing metasync for the bench: {' '.join(cmd[:5])} failed:\n"
                             f"{(done.stderr or done.stdout).strip()[-2000:]}")
        return done.stdout.strip()

    purelib = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    quiet = ["--quiet", "--disable-pip-version-check"]
    deps = step([str(python), "-c", purelib])
    step([str(python), "-m", "pip", "wheel", *quiet, "--no-deps", "--wheel-dir",
          str(build / "dist"), str(src)])
    wheel = next((build / "dist").glob("metasync-*.whl"))
    step([str(python), "-m", "venv", "--without-pip", str(dest)])
    step([str(python), "-m", "pip", "--python", str(dest / "bin" / "python"), "install",
          *quiet, "--no-deps", str(wheel)])
    site = step([str(dest / "bin" / "python"), "-c", purelib])
    (Path(site) / "zz-metasync-bench-deps.pth").write_text(deps + "\n")
    shutil.rmtree(build, ignore_errors=True)
    return dest / "bin" / "metasync"


def tool_version(cmd: Sequence[str | Path]) -> str:
    try:
        proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True,
                              check=False, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unavailable ({exc})"
    text = (proc.stdout or proc.stderr).strip()
    first = text.splitlines()[0] if text else ""
    return first if proc.returncode == 0 else f"unavailable (exit {proc.returncode}: {first})"


def machine_info() -> dict[str, Any]:
    """Machine and tool facts for a results file."""
    mem_kib = 0
    with open("/proc/meminfo") as fh:
        for line in fh:
            if line.startswith("MemTotal:"):
                mem_kib = int(line.split()[1])
    cpu_model = ""
    with open("/proc/cpuinfo") as fh:
        for line in fh:
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    metasync = tool_version([VENV_BIN / "python", "-c",
                             "import importlib.metadata as m; print(m.version('metasync'))"])
    commit = tool_version(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"])
    return {
        "nproc": len(os.sched_getaffinity(0)),
        "cpu_model": cpu_model,
        "memory_bytes": mem_kib * 1024,
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "loadavg": [round(x, 2) for x in os.getloadavg()],
        "tools": {
            "metasync": f"{metasync} (commit {commit})",
            "restic": tool_version(["restic", "version"]),
            "rclone": tool_version([RCLONE, "version"]),
            "git": tool_version(["git", "--version"]),
        },
    }


def write_results(kind: str, record: dict[str, Any], results_dir: Path = RESULTS_DIR) -> Path:
    """Write ``record`` as ``<results_dir>/<kind>-<UTC timestamp>.json`` (atomically)."""
    now = datetime.now(UTC)
    record = {"benchmark": kind, "timestamp": now.isoformat(timespec="seconds"), **record}
    results_dir.mkdir(parents=True, exist_ok=True)
    out = results_dir / f"{kind}-{now.strftime('%Y%m%dT%H%M%SZ')}.json"
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    tmp.replace(out)
    return out


def table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A Markdown table (right-aligned cells after the first column)."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
              for i, h in enumerate(headers)]
    lines = ["| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)) + " |",
             "|" + "|".join(("-" * (w + 1) + ":") if i else "-" * (w + 2)
                            for i, w in enumerate(widths)) + "|"]
    for r in rows:
        cells = [c.ljust(w) if i == 0 else c.rjust(w)
                 for i, (c, w) in enumerate(zip(r, widths, strict=True))]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
