"""Prepare the Linux-source benchmark workload.

The workload is a fixed subset of the kernel tree shipped in Debian's
``linux-source-6.1`` package: the directories listed in ``SUBTREES``.  It is
prepared once into a cache folder (``bench/work/`` by default, git-ignored) and
reused afterwards; a marker file next to the tree records what was prepared.

Those directories give about 15.9k files, about 203 MB of file content and
about 232 MiB on disk (``du -sh``), which is the size this benchmark aims at, so
no further subsetting is needed.  Should a later package version give notably
more files, a deterministic subset is taken: the relative paths are sorted and
files are kept in that order up to ``TARGET_FILES`` (see ``select_subset``).

The tarball holds three symbolic links (under ``include/dt-bindings``).  They
are replaced by regular copies of their targets, so that every tool under test
sees the same plain files whatever its symlink support.

Run directly to prepare the workload and print its path and counts::

    python bench/linux_workload.py [--work DIR] [--force]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

PACKAGE = "linux-source-6.1"
TARBALL = f"usr/src/{PACKAGE}.tar.xz"
TOP = PACKAGE  # top-level directory inside the tarball
SUBTREES: tuple[str, ...] = (
    "fs",
    "net",
    "kernel",
    "mm",
    "block",
    "crypto",
    "include",
    "lib",
    "ipc",
    "init",
    "security",
    "sound",
    "virt",
    "io_uring",
    "arch/x86",
)
TARGET_FILES = 15_800
# Only subset when the tree is this much larger than the target.
SUBSET_SLACK = 1.05
MARKER_VERSION = 1

BENCH_DIR = Path(__file__).resolve().parent
DEFAULT_WORK = BENCH_DIR / "work"
TREE_NAME = "linux-tree"
MARKER_NAME = "linux-tree.json"


class WorkloadError(RuntimeError):
    """Raised when the workload cannot be prepared."""


@dataclass(frozen=True)
class Workload:
    """A prepared workload tree and its counts."""

    path: Path
    files: int
    bytes: int
    disk_bytes: int
    package_version: str
    subset: str

    def describe(self) -> str:
        """Return a one-line human description."""
        return (
            f"{self.path}: {self.files} files, {self.bytes} bytes "
            f"({self.bytes / 1e6:.1f} MB content, {self.disk_bytes / 2**20:.1f} MiB on disk), "
            f"{PACKAGE} {self.package_version}, subset: {self.subset}"
        )


def log(msg: str) -> None:
    """Print a progress message to stderr."""
    print(f"[workload] {msg}", file=sys.stderr, flush=True)


def run(cmd: list[str], cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``cmd``; raise ``WorkloadError`` with its output if it fails."""
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise WorkloadError(
            f"command failed (exit {proc.returncode}): {' '.join(cmd)}\n"
            f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
        )
    return proc


def count_tree(root: Path) -> tuple[int, int, int]:
    """Return (regular files, content bytes, allocated disk bytes) under ``root``.

    The disk figure includes the directories themselves, like ``du``.
    """
    files = size = disk = 0
    for dirpath, _dirnames, filenames in os.walk(root):
        disk += os.lstat(dirpath).st_blocks * 512
        for name in filenames:
            st = os.lstat(os.path.join(dirpath, name))
            files += 1
            size += st.st_size
            disk += st.st_blocks * 512
    return files, size, disk


def list_files(root: Path) -> list[str]:
    """Return the sorted POSIX relative paths of all non-directory entries under ``root``."""
    out: list[str] = []
    for dirpath, _dirnames, filenames in os.walk(root):
        rel = Path(dirpath).relative_to(root)
        out.extend((rel / name).as_posix() for name in filenames)
    out.sort()
    return out


def download_package(dest: Path) -> Path:
    """Download the ``linux-source-6.1`` .deb into ``dest``; run apt-get update if needed."""
    dest.mkdir(parents=True, exist_ok=True)
    for old in dest.glob(f"{PACKAGE}_*.deb"):
        old.unlink()
    cmd = ["apt-get", "download", PACKAGE]
    proc = subprocess.run(cmd, cwd=dest, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        log(f"apt-get download failed ({proc.stderr.strip()}); running apt-get update")
        run(["apt-get", "update"])
        run(cmd, cwd=dest)
    debs = sorted(dest.glob(f"{PACKAGE}_*.deb"))
    if len(debs) != 1:
        raise WorkloadError(f"expected one {PACKAGE} .deb in {dest}, found {debs}")
    return debs[0]


def deb_version(deb: Path) -> str:
    """Return the Debian version of a .deb file."""
    return run(["dpkg-deb", "-f", str(deb), "Version"]).stdout.strip()


def materialize_symlinks(root: Path) -> int:
    """Replace every symlink to a regular file under ``root`` by a copy; return how many.

    A symlink that dangles or points outside ``root`` is removed instead.
    """
    count = 0
    root_resolved = root.resolve()
    for dirpath, dirnames, filenames in os.walk(root):
        for name in filenames + dirnames:
            path = Path(dirpath) / name
            if not path.is_symlink():
                continue
            target = path.resolve()
            path.unlink()
            if target.is_file() and target.is_relative_to(root_resolved):
                shutil.copy2(target, path)
                count += 1
            else:
                log(f"removed symlink {path.relative_to(root)} (target not a file in the tree)")
    return count


def select_subset(root: Path, target_files: int = TARGET_FILES) -> str:
    """Trim ``root`` deterministically if it holds notably more than ``target_files`` files.

    The files' relative paths are sorted and the first ``target_files`` kept; the
    rest are deleted, as are directories left empty.  Returns a description of
    the choice for the marker file.
    """
    paths = list_files(root)
    if len(paths) <= target_files * SUBSET_SLACK:
        return f"all files of {', '.join(SUBTREES)}"
    for rel in paths[target_files:]:
        (root / rel).unlink()
    for dirpath, _dirnames, _filenames in sorted(os.walk(root), key=lambda e: -len(e[0])):
        if dirpath != str(root) and not os.listdir(dirpath):
            os.rmdir(dirpath)
    return (
        f"first {target_files} of {len(paths)} files of {', '.join(SUBTREES)} "
        f"in sorted relative-path order (last kept: {paths[target_files - 1]})"
    )


def read_marker(work: Path) -> Workload | None:
    """Return the recorded workload if the marker and tree exist and agree, else None."""
    marker = work / MARKER_NAME
    tree = work / TREE_NAME
    if not marker.is_file() or not tree.is_dir():
        return None
    try:
        data = json.loads(marker.read_text())
    except (OSError, ValueError):
        return None
    if data.get("marker_version") != MARKER_VERSION or data.get("subtrees") != list(SUBTREES):
        return None
    files, size, disk = count_tree(tree)
    if (files, size) != (data.get("files"), data.get("bytes")):
        log(f"tree has {files} files / {size} bytes, marker says otherwise; rebuilding")
        return None
    return Workload(tree, files, size, disk, data["package_version"], data["subset"])


def prepare(work: Path = DEFAULT_WORK, force: bool = False, keep_archive: bool = False) -> Workload:
    """Prepare (or reuse) the workload tree under ``work`` and return it."""
    work = work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    if not force:
        existing = read_marker(work)
        if existing is not None:
            log(f"reusing {existing.path}")
            return existing

    marker = work / MARKER_NAME
    tree = work / TREE_NAME
    marker.unlink(missing_ok=True)
    download_dir = work / "download"
    deb = download_package(download_dir)
    version = deb_version(deb)
    log(f"downloaded {deb.name}")

    with tempfile.TemporaryDirectory(prefix="prepare-", dir=work) as tmp_name:
        tmp = Path(tmp_name)
        deb_root = tmp / "deb"
        run(["dpkg-deb", "-x", str(deb), str(deb_root)])
        tarball = deb_root / TARBALL
        if not tarball.is_file():
            raise WorkloadError(f"{TARBALL} not found in {deb.name}")
        staged = tmp / "tree"
        staged.mkdir()
        log(f"extracting {len(SUBTREES)} directories from {TARBALL}")
        members = [f"{TOP}/{sub}" for sub in SUBTREES]
        run(["tar", "-xJf", str(tarball), "-C", str(staged), "--strip-components=1", *members])
        links = materialize_symlinks(staged)
        if links:
            log(f"replaced {links} symlinks by copies of their targets")
        subset = select_subset(staged)
        if tree.exists():
            shutil.rmtree(tree)
        staged.rename(tree)

    files, size, disk = count_tree(tree)
    record = {
        "marker_version": MARKER_VERSION,
        "package": PACKAGE,
        "package_version": version,
        "subtrees": list(SUBTREES),
        "subset": subset,
        "files": files,
        "bytes": size,
    }
    tmp_marker = marker.with_suffix(".tmp")
    tmp_marker.write_text(json.dumps(record, indent=2) + "\n")
    tmp_marker.replace(marker)
    if not keep_archive:
        shutil.rmtree(download_dir)
    return Workload(tree, files, size, disk, version, subset)


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point: prepare the workload and print its description."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=DEFAULT_WORK, help="cache folder")
    parser.add_argument("--force", action="store_true", help="rebuild even if prepared")
    parser.add_argument(
        "--keep-archive", action="store_true", help="keep the downloaded .deb in WORK/download"
    )
    args = parser.parse_args(argv)
    try:
        workload = prepare(args.work, force=args.force, keep_archive=args.keep_archive)
    except WorkloadError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(workload.describe())
    print(
        json.dumps({k: str(v) if isinstance(v, Path) else v for k, v in asdict(workload).items()})
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
