"""The tests' FAT32 driver (tests/servers/fatfuse.py) on the ``fat`` image of
``fs_images``: what metasync relies on behaves as Linux's vfat does."""

from __future__ import annotations

import ctypes
import errno
import os
import sqlite3
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from tests.servers.fsimages import fresh_folder

AT_FDCWD = -100
RENAME_NOREPLACE = 1


@pytest.fixture
def fat(fs_images: dict[str, Path]) -> Path:
    return fresh_folder(fs_images["fat"], "drv")


def _errno(fn, *args) -> int:
    try:
        fn(*args)
    except OSError as exc:
        return exc.errno
    return 0


def test_a_renamed_folder_keeps_its_contents(fat: Path) -> None:
    (fat / "d1" / "sub").mkdir(parents=True)
    (fat / "d1" / "a").write_text("hi\n")
    (fat / "d1" / "sub" / "b").write_bytes(os.urandom(5000))
    want = (fat / "d1" / "sub" / "b").read_bytes()
    os.rename(fat / "d1", fat / "d2")
    assert sorted(os.listdir(fat / "d2")) == ["a", "sub"]
    assert (fat / "d2" / "a").read_text() == "hi\n"
    # Moved below another folder: its ".." follows.
    (fat / "e").mkdir()
    os.rename(fat / "d2", fat / "e" / "d3")
    assert (fat / "e" / "d3" / "sub" / "b").read_bytes() == want
    assert os.listdir(fat) == ["e"]
    assert _errno(os.rename, fat / "e", fat / "e" / "d3" / "inside") == errno.EINVAL


def test_rename_replaces_a_file_and_refuses_what_rename_2_refuses(fat: Path) -> None:
    (fat / "new").write_text("new\n")
    (fat / "old").write_text("old, longer\n")
    with open(fat / "old") as held:
        os.rename(fat / "new", fat / "old")
        assert held.read() == "old, longer\n"  # the replaced file lives while open
    assert (fat / "old").read_text() == "new\n"
    assert sorted(os.listdir(fat)) == ["old"]
    (fat / "dir").mkdir()
    (fat / "full").mkdir()
    (fat / "full" / "x").write_text("x")
    assert _errno(os.rename, fat / "old", fat / "dir") == errno.EISDIR
    assert _errno(os.rename, fat / "dir", fat / "old") == errno.ENOTDIR
    assert _errno(os.rename, fat / "dir", fat / "full") == errno.ENOTEMPTY
    os.rename(fat / "full", fat / "dir")  # over an empty folder
    assert os.listdir(fat / "dir") == ["x"]


def test_rename_noreplace_is_einval_as_fuse_without_rename2(fat: Path) -> None:
    (fat / "a").write_text("a")
    libc = ctypes.CDLL(None, use_errno=True)
    rc = libc.renameat2(AT_FDCWD, str(fat / "a").encode(), AT_FDCWD, str(fat / "b").encode(),
                        RENAME_NOREPLACE)
    assert (rc, ctypes.get_errno()) == (-1, errno.EINVAL)


def test_names_are_case_insensitive_case_preserving_and_vfat_checked(fat: Path) -> None:
    (fat / "Foo.txt").write_text("foo\n")
    assert (fat / "FOO.TXT").read_text() == "foo\n"
    assert os.listdir(fat) == ["Foo.txt"]
    assert _errno(os.open, fat / "foo.txt", os.O_CREAT | os.O_EXCL | os.O_WRONLY) == errno.EEXIST
    os.rename(fat / "Foo.txt", fat / "foo.txt")  # a case-only rename changes the case
    assert os.listdir(fat) == ["foo.txt"]
    for bad in (*':?"<>|*\\', "tab\there", "space "):
        assert _errno(os.open, fat / f"a{bad}", os.O_CREAT | os.O_WRONLY) == errno.EINVAL, bad
    (fat / "dot.").write_text("d")  # vfat drops trailing dots
    assert "dot" in os.listdir(fat) and (fat / "dot").read_text() == "d"
    long = "ü" * 200  # 400 bytes of UTF-8: over vfat's 255
    assert _errno(os.open, fat / long[:128], os.O_CREAT | os.O_WRONLY) == errno.ENAMETOOLONG
    for name in ("n" * 251 + ".txt", "ünïcödé — 名前 ☃.txt", ".hidden", "aux.txt"):
        (fat / name).write_text(name)
        assert name in os.listdir(fat) and (fat / name).read_text() == name


def test_no_links_no_exec_bits_and_the_mounting_users_files(fat: Path) -> None:
    (fat / "f").write_text("f")
    assert _errno(os.symlink, "f", fat / "l") == errno.EPERM
    assert _errno(os.link, fat / "f", fat / "h") == errno.EPERM
    assert stat.S_IMODE((fat / "f").stat().st_mode) == 0o755
    os.chmod(fat / "f", 0o644)  # accepted, ignored (vfat's fat_sanitize_mode)
    assert stat.S_IMODE((fat / "f").stat().st_mode) == 0o755
    os.chmod(fat / "f", 0o555)  # the read-only attribute
    assert stat.S_IMODE((fat / "f").stat().st_mode) == 0o555
    os.chmod(fat / "f", 0o755)
    assert _errno(os.chmod, fat / "f", 0o4755) == errno.EPERM
    st = (fat / "f").stat()
    assert (st.st_uid, st.st_gid) == (os.getuid(), os.getgid())


def test_data_truncate_utime_and_statfs(fat: Path) -> None:
    data = os.urandom(3 * 1024 * 1024 + 7)
    (fat / "big").write_bytes(data)
    assert (fat / "big").read_bytes() == data
    with open(fat / "big", "r+b") as f:
        f.seek(10)
        f.write(b"X" * 5000)
        f.truncate(6000)
        f.seek(9000)  # a hole is zeros
        f.write(b"end")
        os.fsync(f.fileno())
    assert (fat / "big").read_bytes() == data[:10] + b"X" * 5000 + data[5010:6000] \
        + b"\0" * 3000 + b"end"
    os.utime(fat / "big", (1_600_000_000, 1_600_000_001))
    assert (fat / "big").stat().st_mtime == 1_600_000_000  # 2-second resolution
    before = os.statvfs(fat)
    (fat / "big").unlink()
    assert os.statvfs(fat).f_bfree > before.f_bfree
    assert not (fat / "big").exists()


def test_sqlite_connections_share_a_database(fat: Path) -> None:
    db = fat / "state.db"
    a = sqlite3.connect(db)
    a.execute("create table t (k integer primary key, v text)")
    a.commit()
    b = sqlite3.connect(db)
    for i in range(200):
        a.execute("insert into t values (?, ?)", (i, "x" * i))
        a.commit()
        if i % 50 == 0:
            assert b.execute("select count(*) from t").fetchone() == (i + 1,)
    b.execute("delete from t where k < 100")
    b.commit()
    assert a.execute("pragma integrity_check").fetchone() == ("ok",)
    assert a.execute("select count(*) from t").fetchone() == (100,)
    a.close()
    b.close()


def test_what_is_written_survives_an_unmount(tmp_path: Path) -> None:
    image, mnt = tmp_path / "fat.img", tmp_path / "mnt"
    mnt.mkdir()
    with open(image, "wb") as f:
        f.truncate(64 * 1024 * 1024)
    subprocess.run(["mkfs.vfat", "-F", "32", "-s", "1", str(image)], check=True,
                   capture_output=True)

    def mount() -> subprocess.Popen[bytes]:
        proc = subprocess.Popen([sys.executable, "-m", "tests.servers.fatfuse", str(image),
                                 str(mnt)], cwd=Path(__file__).resolve().parents[1],
                                stdout=subprocess.PIPE)
        assert proc.stdout is not None and proc.stdout.readline().strip() == b"ready"
        return proc

    def unmount(proc: subprocess.Popen[bytes]) -> None:
        subprocess.run(["fusermount", "-u", str(mnt)], check=True)
        assert proc.wait(timeout=60) == 0

    proc = mount()
    try:
        (mnt / "d" / "e").mkdir(parents=True)
        for i in range(40):  # more entries than one cluster holds
            (mnt / "d" / f"file number {i}.txt").write_text(str(i))
        for i in range(0, 40, 2):
            (mnt / "d" / f"file number {i}.txt").unlink()
        os.rename(mnt / "d", mnt / "D2")
    finally:
        unmount(proc)
    fsck = subprocess.run(["fsck.fat", "-n", str(image)], capture_output=True, text=True)
    assert fsck.returncode == 0, fsck.stdout + fsck.stderr
    proc = mount()
    try:
        want = sorted(f"file number {i}.txt" for i in range(1, 40, 2))
        assert sorted(os.listdir(mnt / "D2")) == ["e", *want]
        assert (mnt / "D2" / "file number 7.txt").read_text() == "7"
    finally:
        unmount(proc)
