"""``dir:`` backends on the filesystems a user plugs in: exFAT, FAT32 and NTFS images
mounted with FUSE (tests/servers/fsimages.py), and how the backend chooses its logs
by probing its folder (backends/publish.py, backends/local.py; docs/backends.md,
"dir: on USB sticks, SD cards and other filesystems").

The FUSE drivers here (exfat-fuse, and tests/servers/fatfuse.py for FAT: libfuse 2)
have neither hard links nor a no-replace rename (renameat2 answers EINVAL), so a new ``dir:`` backend there keeps
its logs as Disk Paxos registers (marked in its folder); NTFS through ntfs-3g has hard
links. The no-replace rename itself is exercised on the machine's own filesystem.
"""

from __future__ import annotations

import errno
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import pytest

from metasync.backends.conformance import BackendConformance, Location
from metasync.backends.local import (
    ENTRY_CAPABILITIES,
    REGISTER_CAPABILITIES,
    REGISTERS_MARKER,
    LocalBackend,
)
from metasync.backends.publish import LINK, RENAME, describe_filesystem, probe_publish, publish
from metasync.errors import BackendError, BackendUnavailable, MetasyncError, PrimitiveMissing
from tests.conftest import make_edge_case_tree, one_line_error, run_cli, snapshot
from tests.servers.fsimages import fresh_folder

#: What the case-insensitive images without an exclusive publish declare.
NO_PUBLISH_CAPABILITIES = replace(REGISTER_CAPABILITIES, case_sensitive=False,
                                  atomic_replace=False)
#: What a folder on NTFS through ntfs-3g declares: hard links, case-sensitive, but a
#: FUSE driver (a replaced file is missing for a moment).
NTFS_CAPABILITIES = replace(ENTRY_CAPABILITIES, atomic_replace=False)

#: How the fixture's drivers appear in the one-line error.
FUSE_NAMES = {"exfat": "fuseblk (exFAT) at ", "fat": "fuse.fatfuse (FAT32) at "}


def test_exfat_stick_and_one_local_folder_push_and_clone(
    tmp_path: Path, fs_images: dict[str, Path]
) -> None:
    """The issue's scenario: an exFAT stick and one local folder. init, push and a
    clone through either backend work, and the stick takes part in every agreement:
    it holds the log entries (as registers) that a clone through it alone reads."""
    stick = fresh_folder(fs_images["exfat"])
    local = tmp_path / "local"
    local.mkdir()
    src = tmp_path / "src"
    src.mkdir()
    (src / "hello.txt").write_text("hello\n")
    run_cli("init", str(src), "--backend", f"dir:{stick}", "--backend", f"dir:{local}")
    run_cli("push", cwd=src)
    (src / "more.txt").write_text("more\n")
    push = run_cli("push", cwd=src)
    assert "warning" not in push.stderr
    for i, backend in enumerate((stick, local)):
        clone = tmp_path / f"clone{i}"
        run_cli("clone", f"dir:{backend}", str(clone))
        assert snapshot(clone) == snapshot(src)
    namespaces = [p.parent for p in stick.rglob(REGISTERS_MARKER)]
    assert len(namespaces) == 1
    entries = [p for p in namespaces[0].rglob("*") if p.is_file() and p.name.isdigit()]
    assert len(entries) >= 2, "the stick holds the decided entries of both versions"
    assert not list((local).rglob(REGISTERS_MARKER)), "the local folder keeps entry logs"


@pytest.mark.parametrize("kind", ["exfat", "fat"])
def test_entry_logs_on_a_filesystem_without_publish_are_refused_in_one_line(
    kind: str, tmp_path: Path, fs_images: dict[str, Path]
) -> None:
    """A repository whose dir: logs are entry files (made where hard links work),
    copied onto a filesystem with no exclusive publish: cloning from it is refused in
    one line naming the filesystem, where it is mounted and what it lacks -- never the
    consensus error -- and no folder is made."""
    made = tmp_path / "made"
    made.mkdir()
    src = tmp_path / "src"
    src.mkdir()
    (src / "hello.txt").write_text("hello\n")
    run_cli("init", str(src), "--backend", f"dir:{made}")
    run_cli("push", cwd=src)
    stick = fresh_folder(fs_images[kind])
    for path in sorted(made.rglob("*")):  # contents only: FAT keeps no modes
        target = stick / path.relative_to(made)
        if path.is_dir():
            target.mkdir()
        else:
            shutil.copyfile(path, target)
    clone = tmp_path / "clone"
    proc = run_cli("clone", f"dir:{stick}", str(clone), check=False)
    line = one_line_error(proc, f"dir:{stick} cannot hold metasync's logs",
                          FUSE_NAMES[kind] + str(fs_images[kind]),
                          "neither hard links nor a no-replace rename")
    assert "could not agree" not in line
    assert not clone.exists()


@pytest.mark.parametrize("kind", ["exfat", "fat"])
def test_probe_finds_no_primitive_on(kind: str, fs_images: dict[str, Path]) -> None:
    """The probe's own answer on the real filesystem, and the backend's error type
    (PrimitiveMissing: not transient, so no retry hides it)."""
    folder = fresh_folder(fs_images[kind])
    assert probe_publish(str(folder), _temp_writer(folder)) is None
    assert list(folder.iterdir()) == [], "the probe removes every file it made"
    assert describe_filesystem(str(folder)).startswith(FUSE_NAMES[kind])
    backend = LocalBackend(f"dir:{folder}", "ns")
    (folder / "ns").mkdir()
    with pytest.raises(PrimitiveMissing) as raised:
        backend.publish_method()
    message = str(raised.value)
    assert message.startswith(
        f"dir:{folder} cannot hold metasync's logs: {FUSE_NAMES[kind]}{fs_images[kind]} "
        "has neither hard links nor a no-replace rename, "), message
    assert "\n" not in message
    assert list((folder / "ns").iterdir()) == [], "the backend's probe leaves nothing"
    backend.create()  # a new folder: its logs become registers
    assert backend.uses_registers()
    assert backend.capabilities == NO_PUBLISH_CAPABILITIES
    other = LocalBackend(f"dir:{folder}", "ns")
    assert other.capabilities == NO_PUBLISH_CAPABILITIES
    assert type(other.logs.store()).__name__ == "RegisterLogs"  # type: ignore[attr-defined]


@pytest.mark.parametrize("kind", ["exfat", "fat", "ntfs"])
def test_edge_case_tree_round_trips_through_a_backend_on(
    kind: str, tmp_path: Path, fs_images: dict[str, Path]
) -> None:
    """The edge-case tree pushed to a ``dir:`` backend on the image (with a local
    folder) clones back into a normal folder identical, through either backend."""
    backend = fresh_folder(fs_images[kind])
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


@pytest.mark.parametrize("kind", ["exfat", "fat"])
def test_probe_whose_second_write_fails_leaves_no_file_on(
    kind: str, fs_images: dict[str, Path]
) -> None:
    """The probe writes two temporary files per primitive; when the second write
    fails (the disk filled up), the error reaches the caller and the first file is
    removed all the same."""
    folder = fresh_folder(fs_images[kind])
    write = _temp_writer(folder)
    calls = iter(range(10**6))

    def write_then_fill(data: bytes) -> str:
        if next(calls) == 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        return write(data)

    with pytest.raises(OSError) as raised:
        probe_publish(str(folder), write_then_fill)
    assert raised.value.errno == errno.ENOSPC
    assert list(folder.iterdir()) == []


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


class _LocalBackendOnImage(BackendConformance):
    """The conformance suite against ``dir:`` in a fresh folder of the ``kind`` image;
    the instance must declare exactly the ``capabilities`` the class selects the
    tests by (what it lacks is deselected with that reason, never skipped)."""

    __test__ = False
    kind = ""
    backend_class = LocalBackend
    transient_faults = False  # a local folder has no connection to break
    # FUSE drivers in user space are slow, and a folder has no listing pages: fewer keys
    # and appends still test what the suite checks (exFAT and FAT logs are registers,
    # where each append reads every slot: 6 x 8 appends contend for every position).
    many_keys = 300
    appends_per_worker = 8

    @pytest.fixture
    def backend_location(self, fs_images: dict[str, Path]) -> Location:
        return (f"dir:{fresh_folder(fs_images[self.kind])}", "ns")

    @pytest.fixture
    def unicode_location(self, fs_images: dict[str, Path]) -> Location:
        return (f"dir:{fresh_folder(fs_images[self.kind], 'ünïcødé store ☃ 名前')}", "ns")

    def test_declares_what_the_class_says(self, backend: LocalBackend) -> None:
        assert backend.capabilities == self.capabilities


class TestLocalBackendOnNtfs(_LocalBackendOnImage):
    """NTFS (ntfs-3g): hard links, case-sensitive; a FUSE driver, so no
    ``atomic_replace``. (exFAT and FAT under the FUSE drivers here have no exclusive
    publish at all: refused above.)"""

    __test__ = True
    kind = "ntfs"
    capabilities = NTFS_CAPABILITIES


class TestLocalBackendOnExfat(_LocalBackendOnImage):
    """exFAT (exfat-fuse): register logs, no exclusive create, case-insensitive, no
    atomic replace."""

    __test__ = True
    kind = "exfat"
    capabilities = NO_PUBLISH_CAPABILITIES


class TestLocalBackendOnFat(_LocalBackendOnImage):
    """FAT32 (tests/servers/fatfuse.py, vfat's rules): what exFAT declares, for the
    same reasons."""

    __test__ = True
    kind = "fat"
    capabilities = NO_PUBLISH_CAPABILITIES

    @pytest.mark.xfail(strict=True, reason="vfat drops a name's trailing dots, so the key "
                       "'...' is an empty name there (ENOENT), and 'a.' would be 'a'")
    def test_odd_but_valid_keys(self, backend: LocalBackend) -> None:
        super().test_odd_but_valid_keys(backend)


def test_push_warns_of_a_backend_whose_log_appends_fail(tmp_path: Path) -> None:
    """A backend whose log appends fail is outvoted by the others; the push still
    succeeds but says which backend took no part and why, instead of nothing."""
    folders = [tmp_path / f"b{i}" for i in range(3)]
    for folder in folders:
        folder.mkdir()
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("a\n")
    run_cli("init", str(src), *(a for f in folders for a in ("--backend", f"dir:{f}")))
    run_cli("push", cwd=src)
    logs = next(p for p in folders[2].rglob("log") if p.is_dir())
    shutil.rmtree(logs)
    logs.write_text("in the way\n")  # every append there now fails
    (src / "b.txt").write_text("b\n")
    push = run_cli("push", cwd=src)
    assert "Pushed version" in push.stdout
    warnings = [line for line in push.stderr.splitlines() if "took no part" in line]
    assert len(warnings) == 1 and f"dir:{folders[2]}" in warnings[0], push.stderr


def _format_4_repo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                   backends: int = 2) -> tuple[Path, list[Path], str]:
    """A repository made as format 4 metasync makes it (R = ``backends``, one push,
    no encryption) over ``backends`` folders: its folder, the folders, its namespace."""
    from metasync import Repository, context, lifecycle

    folder = tmp_path / "repo"
    folder.mkdir()
    (folder / "f.txt").write_text("data\n")
    dirs = [tmp_path / f"b{i}" for i in range(backends)]
    for d in dirs:
        d.mkdir()
    with monkeypatch.context() as older:
        older.setattr(lifecycle, "FORMAT_VERSION", 4)
        older.setattr(context, "FORMAT_VERSION", 4)
        with Repository.init(folder, [f"dir:{d}" for d in dirs], replicas=backends,
                             encrypt=False) as repo:
            repo.push("first")
            assert repo.config.format == 4
            return folder, dirs, repo.config.namespace


def test_adding_a_stick_to_a_format_4_repository_makes_it_format_5(
    tmp_path: Path, fs_images: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A repository of format 4 stays 4 until `backend add` brings in a folder of
    register logs: that configuration says 5, which a format 4 reader refuses with
    "upgrade" (it would read the stick's logs as empty)."""
    from metasync import Repository, context, layout, objects

    folder, dirs, _ = _format_4_repo(tmp_path, monkeypatch)
    stick = fresh_folder(fs_images["exfat"])
    with Repository.open(folder) as repo:
        repo.add_backend(f"dir:{stick}")
        assert repo.versions.load_config(repo.versions.learn_latest().config).format == 5
    for module in (objects, layout, context):  # a format 4 reader
        monkeypatch.setattr(module, "READABLE_FORMATS", (3, 4))
    with pytest.raises(MetasyncError, match="upgrade metasync"):
        Repository.clone(f"dir:{dirs[0]}", tmp_path / "old-reader", allow_unencrypted=True)


def test_a_stick_unplugged_at_the_first_log_operation_keeps_register_logs(
    fs_images: dict[str, Path]
) -> None:
    """A daemon's backend whose first log operation finds the stick unplugged (its
    namespace folder gone) fails as unreachable and decides nothing: plugged back,
    its appends are registers that every other client reads, never entry files."""
    stick = fresh_folder(fs_images["exfat"])
    LocalBackend(f"dir:{stick}", "ns").create()
    assert (stick / "ns" / REGISTERS_MARKER).is_file()
    daemon = LocalBackend(f"dir:{stick}", "ns")
    (stick / "ns").rename(stick / "away")  # unplugged
    with pytest.raises(BackendUnavailable, match="missing or unreachable"):
        daemon.logs.fetch("log")
    (stick / "away").rename(stick / "ns")  # plugged back
    assert type(daemon.logs.store()).__name__ == "RegisterLogs"  # type: ignore[attr-defined]
    daemon.logs.append("log", b"x")
    assert LocalBackend(f"dir:{stick}", "ns").logs.fetch("log") == [(0, b"x")]


def test_a_marker_that_cannot_be_read_is_an_error_not_entry_logs(tmp_path: Path) -> None:
    """Whether a folder's logs are registers is read from its marker; a marker that
    cannot be read (here a symlink loop: ELOOP, as an I/O error would be) is the
    backend's one-line error, and nothing is remembered: once it reads, the answer
    is the marker's."""
    store = tmp_path / "store"
    (store / "ns").mkdir(parents=True)
    marker = store / "ns" / REGISTERS_MARKER
    marker.symlink_to(marker)
    backend = LocalBackend(f"dir:{store}", "ns")
    with pytest.raises(BackendError) as raised:
        backend.logs.fetch("log")
    assert str(raised.value).startswith(f"cannot read {REGISTERS_MARKER!r} on dir:{store}: ")
    assert "\n" not in str(raised.value)
    marker.unlink()
    marker.write_text("registers\n")
    assert backend.uses_registers()
    assert type(backend.logs.store()).__name__ == "RegisterLogs"  # type: ignore[attr-defined]


def test_recover_adding_a_stick_to_a_format_4_repository_makes_it_format_5(
    tmp_path: Path, fs_images: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`recover --add-backend` with a folder of register logs (an exFAT stick) gives
    the new configuration format 5, as `backend add` does: a format 4 reader would
    read the stick's logs as empty."""
    from metasync import Repository

    _, dirs, _ = _format_4_repo(tmp_path, monkeypatch, backends=3)
    for d in dirs[:2]:
        d.rename(d.with_name(d.name + "-lost"))
    stick = fresh_folder(fs_images["exfat"])
    rec = tmp_path / "rec"
    run_cli("--timeout", "10", "recover", "--backend", f"dir:{dirs[2]}",
            "--add-backend", f"dir:{stick}", "--yes", "--no-encrypt", str(rec))
    assert (rec / "f.txt").read_text() == "data\n"
    assert list(stick.rglob(REGISTERS_MARKER)), "the stick keeps register logs"
    with Repository.open(rec) as repo:
        assert repo.versions.load_config(repo.versions.learn_latest().config).format == 5


def test_a_folder_that_cannot_be_listed_at_create_is_a_one_line_error(
    fs_images: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a filesystem without an exclusive publish, create lists the namespace folder
    to see whether it is new; a disk that fails that read (EIO, injected at the OS
    call: a real stick fails so only when dying) gives the backend's error, one line
    naming the folder, not a raw OSError -- and no marker."""
    stick = fresh_folder(fs_images["exfat"])
    backend = LocalBackend(f"dir:{stick}", "ns")
    (stick / "ns").mkdir()
    listdir = os.listdir

    def failing_listdir(path: str = ".") -> list[str]:
        if os.fspath(path) == backend.root:
            raise OSError(errno.EIO, os.strerror(errno.EIO), path)
        return listdir(path)

    monkeypatch.setattr(os, "listdir", failing_listdir)
    with pytest.raises(BackendError) as raised:
        backend.create()
    assert str(raised.value) == (f"cannot write {REGISTERS_MARKER!r} on dir:{stick}: "
                                 f"{os.strerror(errno.EIO)}")
    monkeypatch.undo()
    assert not (stick / "ns" / REGISTERS_MARKER).exists()


def test_the_volume_kind_is_read_only_from_a_device_or_an_image_file(tmp_path: Path) -> None:
    """The mount source named in /proc/self/mountinfo is read for a boot sector only
    if it is a block device or a regular file: anything else (a FIFO, which would
    block the reader, a character device) is left alone. Here a FIFO holds an exFAT
    boot sector: it is not read, and the bytes stay in it."""
    from metasync.backends.publish import _volume_kind

    sector = bytes(3) + b"EXFAT   " + bytes(501)
    image = tmp_path / "image"
    image.write_bytes(sector)
    assert _volume_kind(str(image)) == "exFAT"
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    fd = os.open(fifo, os.O_RDWR | os.O_NONBLOCK)  # a writer, so a reader would not block
    try:
        os.write(fd, sector)
        assert _volume_kind(str(fifo)) is None
        assert os.read(fd, 1024) == sector, "nothing was read from the FIFO"
    finally:
        os.close(fd)


def test_an_acceptor_whose_last_request_was_a_failed_append_is_still_named(
    tmp_path: Path
) -> None:
    """`failing_appends` names an acceptor whose log appends fail while it answers
    the rest, even when the failed append was its last request of the operation (a
    propose ends with appends); only one whose other requests failed is left out."""
    from metasync import Repository
    from metasync.objects import Version

    folders = [tmp_path / f"b{i}" for i in range(3)]
    for folder in folders:
        folder.mkdir()
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("a\n")
    with Repository.init(src, [f"dir:{f}" for f in folders], encrypt=False) as repo:
        repo.push("first")
    logs = next(p for p in folders[2].rglob("log") if p.is_dir())
    shutil.rmtree(logs)
    logs.write_text("in the way\n")  # every append there now fails; reads answer
    with Repository.open(src) as repo:
        prev = repo.versions.prev
        proposal = Version(prev.number + 1, prev.master, prev.config)
        assert repo.versions.consensus.propose(proposal.number, proposal) == proposal
        named = [repo.backend_name(b) for b in repo.versions.failing_appends()]
    assert len(named) == 1 and f"dir:{folders[2]}" in named[0], named


def test_adding_a_folder_already_marked_for_registers_makes_it_format_5(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A folder that holds the register-logs marker already (used before, or marked
    by hand) keeps its logs as registers, even on a filesystem with hard links: `backend
    add` makes the configuration format 5 all the same (docs/FORMAT.md §11.1), since a
    format 4 reader would read those logs as empty."""
    from metasync import Repository

    folder, _, namespace = _format_4_repo(tmp_path, monkeypatch)
    marked = tmp_path / "marked"
    (marked / namespace).mkdir(parents=True)
    (marked / namespace / REGISTERS_MARKER).write_text("registers\n")
    with Repository.open(folder) as repo:
        repo.add_backend(f"dir:{marked}")
        assert repo.versions.load_config(repo.versions.learn_latest().config).format == 5
    assert LocalBackend(f"dir:{marked}", namespace).uses_registers()
