"""``dir:`` backends on the filesystems a user plugs in: exFAT, FAT32 and NTFS images
mounted with FUSE (tests/servers/fsimages.py), and the exclusive publish the backend
chooses by probing its folder (backends/publish.py; docs/backends.md, "dir: on USB
sticks, SD cards and other filesystems").

The FUSE drivers here (exfat-fuse, fusefat: libfuse 2) have neither hard links nor a
no-replace rename (renameat2 answers EINVAL), so a ``dir:`` backend there is refused
with one line naming the filesystem; NTFS through ntfs-3g has hard links and works.
The no-replace rename itself is exercised on the test machine's own filesystem.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from metasync.backends.conformance import BackendConformance, Location
from metasync.backends.local import LocalBackend
from metasync.backends.publish import LINK, RENAME, describe_filesystem, probe_publish, publish
from metasync.errors import PrimitiveMissing
from tests.conftest import make_edge_case_tree, one_line_error, run_cli, snapshot
from tests.servers.fsimages import fresh_folder

#: How the fixture's drivers appear in the one-line error.
FUSE_NAMES = {"exfat": "fuseblk (exFAT) at ", "fat": "fuse.fusefat (FAT) at "}


@pytest.mark.parametrize("kind", ["exfat", "fat"])
def test_stick_without_exclusive_publish_is_refused_in_one_line(
    kind: str, tmp_path: Path, fs_images: dict[str, Path]
) -> None:
    """The issue's scenario (a stick and one local folder): init refuses the stick in
    one line naming its filesystem, where it is mounted and what it lacks -- not the
    consensus error of a later push -- and writes no repository anywhere."""
    stick = fresh_folder(fs_images[kind])
    local = tmp_path / "local"
    local.mkdir()
    src = tmp_path / "src"
    src.mkdir()
    (src / "hello.txt").write_text("hello\n")
    proc = run_cli("init", str(src), "--backend", f"dir:{stick}", "--backend", f"dir:{local}",
                   check=False)
    line = one_line_error(proc, f"dir:{stick} cannot hold metasync's logs",
                          FUSE_NAMES[kind] + str(fs_images[kind]),
                          "neither hard links nor a no-replace rename")
    assert "could not agree" not in line
    assert not (src / ".metasync").exists()
    leftovers = [p for p in stick.rglob("*") if p.is_file()]
    assert leftovers == [], "the probe leaves no file behind"


@pytest.mark.parametrize("kind", ["exfat", "fat"])
def test_probe_finds_no_primitive_on(kind: str, fs_images: dict[str, Path]) -> None:
    """The probe's own answer on the real filesystem, and the backend's error type
    (PrimitiveMissing: not transient, so no retry hides it)."""
    folder = fresh_folder(fs_images[kind])
    assert probe_publish(str(folder), _temp_writer(folder)) is None
    assert describe_filesystem(str(folder)).startswith(FUSE_NAMES[kind])
    backend = LocalBackend(f"dir:{folder}", "ns")
    with pytest.raises(PrimitiveMissing) as raised:
        backend.create()
    assert not raised.value.transient
    assert str(raised.value) == backend.lacks_publish_message()


def test_edge_case_tree_round_trips_through_a_backend_on_ntfs(
    tmp_path: Path, fs_images: dict[str, Path]
) -> None:
    """The edge-case tree pushed to a ``dir:`` backend on NTFS (with a local folder)
    clones back into a normal folder identical, through either backend."""
    backend = fresh_folder(fs_images["ntfs"])
    local = tmp_path / "local"
    local.mkdir()
    src = tmp_path / "src"
    make_edge_case_tree(src)
    run_cli("init", str(src), "--backend", f"dir:{backend}", "--backend", f"dir:{local}")
    run_cli("push", cwd=src)
    for i, where in enumerate((backend, local)):
        clone = tmp_path / f"clone{i}"
        run_cli("clone", f"dir:{where}", str(clone))
        assert snapshot(clone) == snapshot(src)


def _temp_writer(folder: Path):  # type: ignore[no-untyped-def]
    counter = iter(range(10**6))

    def write(data: bytes) -> str:
        path = folder / f".tmp-test-{next(counter)}-{os.getpid()}"
        path.write_bytes(data)
        return str(path)

    return write


def test_probe_prefers_hard_links(tmp_path: Path) -> None:
    """On the test machine's own filesystem both primitives hold; a hard link is
    chosen (what every existing client uses), and the probe removes its files."""
    assert probe_publish(str(tmp_path), _temp_writer(tmp_path)) == LINK
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("method", [LINK, RENAME])
def test_publish_refuses_an_existing_name(method: str, tmp_path: Path) -> None:
    """Either primitive publishes a complete file to a free name and refuses a taken
    one, leaving the first file's bytes and (rename) the loser's temp file."""
    write = _temp_writer(tmp_path)
    first, second = write(b"first"), write(b"second")
    target = str(tmp_path / "entry")
    assert publish(method, first, target)
    assert not publish(method, second, target)
    assert Path(target).read_bytes() == b"first"
    assert Path(second).read_bytes() == b"second"


def test_log_appends_by_no_replace_rename_lose_nothing(tmp_path: Path) -> None:
    """Appends published by the no-replace rename (the primitive of exFAT and FAT
    under Linux's own drivers, forced here on the machine's filesystem): 6 clients x
    25 racing appends give 150 contiguous entries, each message exactly once, and the
    files are the ones hard-link clients write (readers need no change)."""
    store = tmp_path / "store"
    store.mkdir()
    clients = [LocalBackend(f"dir:{store}", "ns") for _ in range(6)]
    clients[0].create()
    for client in clients:
        client._method = RENAME  # the choice the probe makes where link() is refused
    try:
        def run(index: int) -> list[int]:
            return [clients[index].logs.append("log", f"{index}:{i}".encode())
                    for i in range(25)]

        with ThreadPoolExecutor(6) as pool:
            positions = [p for ps in pool.map(run, range(6)) for p in ps]
        assert sorted(positions) == list(range(150))
        reader = LocalBackend(f"dir:{store}", "ns")
        entries = reader.logs.fetch("log")
        assert [p for p, _ in entries] == list(range(150))
        assert sorted(m for _, m in entries) == sorted(
            f"{c}:{i}".encode() for c in range(6) for i in range(25))
        assert all(n.isdigit() for n in os.listdir(store / "ns" / "log"))
        assert clients[0].logs.primitive == "a no-replace rename"
    finally:
        for client in clients:
            client.close()


class TestLocalBackendOnNtfs(BackendConformance):
    """The conformance suite against ``dir:`` on an NTFS image (ntfs-3g): hard links,
    case-sensitive, so it declares what the class does. (exFAT and FAT under the FUSE
    drivers here have no exclusive publish at all: refused above.)"""

    backend_class = LocalBackend
    transient_faults = False  # a local folder has no connection to break

    @pytest.fixture
    def backend_location(self, fs_images: dict[str, Path]) -> Location:
        return (f"dir:{fresh_folder(fs_images['ntfs'])}", "ns")

    @pytest.fixture
    def unicode_location(self, fs_images: dict[str, Path]) -> Location:
        return (f"dir:{fresh_folder(fs_images['ntfs'], 'ünïcødé store ☃ 名前')}", "ns")
