"""Real filesystems a user plugs in, mounted with FUSE from image files: exFAT (a USB
stick, an SD card), FAT32 (an older stick) and NTFS (a Windows disk).

Fixture (session-scoped, registered in tests/conftest.py ``pytest_plugins``):

``fs_images``
    A dict ``{"exfat": Path, "fat": Path, "ntfs": Path}`` of mount points, each the
    root of a freshly formatted filesystem: exFAT through ``exfat-fuse`` on a loop
    device (it insists on a block device), FAT32 through
    :mod:`tests.servers.fatfuse` (a vfat-like driver of ours: no kernel vfat here,
    and Debian's fusefat loses a renamed folder's contents) and NTFS through
    ``ntfs-3g``, both on the image file. Tests work in a fresh folder of
    their own below a mount point (:func:`fresh_folder`), so a session shares one
    mount of each. exFAT and FAT are case-insensitive and have no hard links, no
    symbolic links and no permission bits; NTFS through ntfs-3g has all three
    and is case-sensitive, but refuses Windows-reserved characters only with
    ``windows_names`` (not set here, as on a Linux desktop's automount).

The packages come from bin/setup-system. Every mount is undone at the end of the
session, even if tests failed; a mount that fails fails the fixture with the tool's
message (never a silent skip).
"""

from __future__ import annotations

import contextlib
import os
import select
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

#: Size of each image (sparse: it costs only what is written).
IMAGE_SIZE = 512 * 1024 * 1024
#: The FAT image is smaller: its driver is pure Python and rewrites the whole FAT
#: on each close of a written file. 256 MiB holds the conformance suite's 100 MB
#: object; 2 KiB clusters keep it FAT32 (at least 65525 clusters), the FAT 512 KiB.
FAT_IMAGE_SIZE = 256 * 1024 * 1024
#: How long the FAT driver may take to mount before the fixture gives up.
FAT_MOUNT_TIMEOUT = 60
#: Every kind the fixture mounts.
KINDS = ("exfat", "fat", "ntfs")


def _run(*args: str) -> str:
    proc = subprocess.run(args, capture_output=True, text=True, timeout=60, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed ({proc.returncode}): "
                           f"{(proc.stderr or proc.stdout).strip()}")
    return proc.stdout.strip()


class Mounted:
    """One image mounted at ``mountpoint``; :meth:`close` unmounts it."""

    def __init__(self, kind: str, image: Path, mountpoint: Path) -> None:
        self.kind = kind
        self.image = image
        self.mountpoint = mountpoint
        self.loop: str | None = None
        self.driver: subprocess.Popen[bytes] | None = None
        with open(image, "wb") as f:
            f.truncate(FAT_IMAGE_SIZE if kind == "fat" else IMAGE_SIZE)
        mountpoint.mkdir(parents=True, exist_ok=True)
        if kind == "exfat":
            _run("mkfs.exfat", str(image))
            self.loop = _run("losetup", "--find", "--show", str(image))
            _run("mount.exfat-fuse", self.loop, str(mountpoint))
        elif kind == "fat":
            _run("mkfs.vfat", "-F", "32", "-s", "4", str(image))
            self._mount_fat()
        elif kind == "ntfs":
            _run("mkntfs", "--fast", "--force", str(image))
            _run("ntfs-3g", str(image), str(mountpoint))
        else:
            raise ValueError(f"no such filesystem image kind: {kind}")
        if not Path(mountpoint).is_mount():
            raise RuntimeError(f"{kind} image is not mounted at {mountpoint}")

    def _mount_fat(self) -> None:
        """Start tests.servers.fatfuse on the image and wait for its ``ready`` line
        (printed once the kernel's FUSE INIT reached it: the mount is live)."""
        log = self.image.with_suffix(".log")
        with open(log, "wb") as err:
            self.driver = subprocess.Popen(
                [sys.executable, "-m", "tests.servers.fatfuse", str(self.image),
                 str(self.mountpoint)], cwd=Path(__file__).resolve().parents[2],
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=err)
        assert self.driver.stdout is not None
        ready, _, _ = select.select([self.driver.stdout], [], [], FAT_MOUNT_TIMEOUT)
        line = self.driver.stdout.readline() if ready else b""
        if line.strip() != b"ready":
            self.driver.kill()
            self.driver.wait()
            raise RuntimeError(f"tests.servers.fatfuse did not mount {self.image}: "
                               f"{log.read_text(errors='replace').strip() or 'no output'}")

    def close(self) -> None:
        fusermount = shutil.which("fusermount3") or shutil.which("fusermount") or "fusermount"
        with contextlib.suppress(Exception):
            _run(fusermount, "-u", "-z", str(self.mountpoint))
        if self.driver is not None:
            try:  # the driver writes what it holds to the image and exits on unmount
                self.driver.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.driver.kill()
                self.driver.wait()
        if self.loop:
            with contextlib.suppress(Exception):
                _run("losetup", "-d", self.loop)
        with contextlib.suppress(OSError):
            self.image.unlink()


def rewrite_within_the_tick(path: Path, text: str) -> None:
    """Rewrite ``path`` with ``text`` -- as many bytes as it holds -- in place, and
    give it back its mtime, as a rewrite within FAT's 2 s tick leaves it (set
    explicitly, so a test never depends on the clock's moment within the tick):
    its size, mtime and inode are what they were, which this checks."""
    before = path.stat()
    with open(path, "r+") as fh:
        fh.write(text)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = path.stat()
    assert (after.st_size, after.st_mtime_ns, after.st_ino) == (
        before.st_size, before.st_mtime_ns, before.st_ino)


def fresh_folder(mountpoint: Path, prefix: str = "t") -> Path:
    """A new empty folder below ``mountpoint`` for one test."""
    folder = mountpoint / f"{prefix}-{uuid.uuid4().hex[:8]}"
    folder.mkdir()
    return folder


@pytest.fixture(scope="session")
def fs_images(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Path]]:
    root = tmp_path_factory.mktemp("fs-images")
    mounted: list[Mounted] = []
    try:
        for kind in KINDS:
            try:
                mounted.append(Mounted(kind, root / f"{kind}.img", root / kind))
            except (OSError, RuntimeError) as exc:
                pytest.fail(f"cannot mount a {kind} image (bin/setup-system installs the "
                            f"tools; /dev/fuse and a loop device are needed): {exc}")
        yield {m.kind: m.mountpoint for m in mounted}
    finally:
        for m in mounted:
            m.close()
