"""The ``dir:`` backend: the shared conformance suite, plus local-only behaviour."""

from __future__ import annotations

import io
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from metasync.backends import Backend, open_backend
from metasync.backends.conformance import (
    CHILD_TIMEOUT,
    BackendConformance,
    ChildProcesses,
    Location,
    check_versioned_payload,
    overwrite_worker,
    versioned_payload,
)
from metasync.backends.local import CHUNK_SIZE, TEMP_PREFIX, LocalBackend
from metasync.errors import (
    BackendError,
    BackendUnavailable,
    InvalidKey,
    ObjectNotFound,
    UsageError,
)


class TestLocalBackend(BackendConformance):
    """The conformance suite against ``dir:<tmp>/store`` with namespace ``ns``."""

    backend_class = LocalBackend
    transient_faults = False  # a local folder has no connection to break

    @pytest.fixture
    def backend_location(self, tmp_path: Path) -> Location:
        store = tmp_path / "store"
        store.mkdir()
        return (f"dir:{store}", "ns")

    @pytest.fixture
    def unicode_location(self, tmp_path: Path) -> Location:
        store = tmp_path / "ünïcødé store ☃ 名前"
        store.mkdir()
        return (f"dir:{store}", "ns")


# --- local-only behaviour -------------------------------------------------------------


@pytest.fixture
def store(tmp_path: Path) -> Path:
    """The location folder (exists, empty)."""
    path = tmp_path / "store"
    path.mkdir()
    return path


@pytest.fixture
def local(store: Path) -> Iterator[LocalBackend]:
    """A created backend at ``store`` with namespace ``ns``."""
    backend = LocalBackend(f"dir:{store}", "ns")
    backend.create()
    yield backend
    backend.close()


def _all_names(folder: Path) -> list[str]:
    return [name for _, dirs, files in os.walk(folder) for name in dirs + files]


@pytest.mark.parametrize("uri", ["dir:relative/path", "dir:./x", "dir:~/x", "dir:", "relative"])
def test_relative_path_rejected(uri: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A relative location is a UsageError telling the absolute form; nothing is created."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UsageError, match=r"must be absolute.*dir:/absolute/path"):
        LocalBackend(uri, "ns")
    if uri.startswith("dir:"):
        with pytest.raises(UsageError):
            open_backend(uri, "ns")
    assert list(tmp_path.iterdir()) == []


def test_bare_absolute_path_means_dir(store: Path) -> None:
    """open_backend of a bare absolute path gives a LocalBackend with a dir: URI."""
    backend = open_backend(str(store), "ns")
    assert isinstance(backend, LocalBackend)
    assert backend.uri == f"dir:{store}"
    assert backend.root == str(store / "ns")


@pytest.mark.parametrize("namespace", ["", "..", "a//b", "a b"])
def test_invalid_namespace_rejected(store: Path, namespace: str) -> None:
    """A namespace that is not a safe relative name is a UsageError."""
    with pytest.raises(UsageError, match="namespace"):
        LocalBackend(f"dir:{store}", namespace)


def test_opening_touches_nothing(store: Path) -> None:
    """Constructing a backend creates no folder; create() creates only the namespace."""
    missing = store / "not-yet"
    backend = LocalBackend(f"dir:{missing}", "ns")
    assert not missing.exists()
    assert not backend.exists()


def test_create_requires_existing_location(tmp_path: Path) -> None:
    """create() with a missing location raises BackendUnavailable naming it and asking
    the user to create it; the location is not created."""
    missing = tmp_path / "unmounted"
    backend = LocalBackend(f"dir:{missing}", "ns")
    with pytest.raises(BackendUnavailable, match="create") as info:
        backend.create()
    assert str(missing) in str(info.value)
    assert not missing.exists()


def test_create_on_a_file_location_is_unavailable(tmp_path: Path) -> None:
    """A location that is a file (not a folder) is BackendUnavailable."""
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(BackendUnavailable, match="not a folder"):
        LocalBackend(f"dir:{tmp_path / 'file'}", "ns").create()


def _every_operation(backend: Backend) -> dict[str, Callable[[], object]]:
    return {
        "put": lambda: backend.put("a/b/c", b"x"),
        "put stream": lambda: backend.put("k", io.BytesIO(b"x")),
        "put_if_absent": lambda: backend.put_if_absent("a/b/new", b"x"),
        "get": lambda: backend.get("k"),
        "open": lambda: backend.open("k"),
        "get_range": lambda: backend.get_range("k", 0, 1),
        "size": lambda: backend.size("k"),
        "delete": lambda: backend.delete("k"),
        "list": lambda: backend.list(),
        "list prefix": lambda: backend.list("a"),
        "poll": lambda: backend.poll("k"),
        "append": lambda: backend.logs.append("logs/log", b"x"),
        "fetch": lambda: backend.logs.fetch("logs/log"),
        "fetch missing": lambda: backend.logs.fetch("nolog"),
    }


@pytest.mark.parametrize("deleted", ["location", "namespace"])
def test_deleted_folder_is_unavailable_and_not_recreated(
    local: LocalBackend, store: Path, deleted: str
) -> None:
    """Once the location (unmounted disk) or the namespace folder is gone, every
    operation raises BackendUnavailable with a one-line message naming the folder,
    and no operation recreates anything."""
    local.put("k", b"x")
    local.logs.append("logs/log", b"entry")
    gone = store if deleted == "location" else store / "ns"
    shutil.rmtree(gone)
    assert not local.exists()
    for name, operation in _every_operation(local).items():
        with pytest.raises(BackendUnavailable) as info:
            operation()
            pytest.fail(f"{name} succeeded on a deleted folder")
        message = str(info.value)
        assert "\n" not in message, name
        assert local.root in message, name
        assert not gone.exists(), f"{name} recreated {gone}"
    if deleted == "location":
        with pytest.raises(BackendUnavailable):
            local.create()
        assert not store.exists()


def test_leftover_temp_and_stray_files_are_ignored(local: LocalBackend, store: Path) -> None:
    """Temp files of a crashed writer are never listed nor fetched as log entries;
    other non-entry names in a log folder are skipped, and appending continues after
    the last real entry."""
    local.put("a/k", b"value")
    assert local.logs.append("log", b"e0") == 0
    assert local.logs.append("log", b"e1") == 1
    ns = store / "ns"
    (ns / f"{TEMP_PREFIX}deadbeef").write_bytes(b"half a wri")
    (ns / "a" / f"{TEMP_PREFIX}0000000007").write_bytes(b"half")
    (ns / "log" / f"{TEMP_PREFIX}cafe").write_bytes(b"torn entr")
    (ns / "log" / f"{TEMP_PREFIX}0000000002").write_bytes(b"torn")
    (ns / "log" / "00000002").write_bytes(b"too few digits")
    (ns / "log" / "00000000002").write_bytes(b"not canonical")
    (ns / "log" / "0000000002.bak").write_bytes(b"a copy")
    (ns / "stray name with spaces").write_bytes(b"put there by hand")
    assert list(local.list("a")) == ["a/k"]
    # Valid names in the log folder are keys like any other; temp files and names
    # that are not valid keys are not.
    assert sorted(local.list()) == sorted(
        [
            "a/k",
            "log/00000000002",
            "log/0000000000",
            "log/0000000001",
            "log/0000000002.bak",
            "log/00000002",
        ]
    )
    assert local.logs.fetch("log") == [(0, b"e0"), (1, b"e1")]
    assert local.logs.append("log", b"e2") == 2
    assert local.logs.fetch("log", 2) == [(2, b"e2")]


def test_temp_names_are_reserved(local: LocalBackend) -> None:
    """Keys with a part starting with '.tmp-' are rejected: they would never be listed."""
    for key in (f"{TEMP_PREFIX}x", f"a/{TEMP_PREFIX}x", f"{TEMP_PREFIX}x/a"):
        with pytest.raises(InvalidKey):
            local.put(key, b"x")
        with pytest.raises(InvalidKey):
            local.logs.append(key, b"x")
        with pytest.raises(InvalidKey):
            local.list(key)


def test_writes_leave_no_temp_files(local: LocalBackend, store: Path) -> None:
    """After put (bytes and stream), put_if_absent (both outcomes) and append, no
    temp file remains; missing parent folders were created."""
    local.put("deep/er/k", b"x")
    local.put("deep/er/s", io.BytesIO(b"y" * (CHUNK_SIZE + 1)))
    assert local.put_if_absent("deep/p", b"1")
    assert not local.put_if_absent("deep/p", b"2")
    local.logs.append("deep/log", b"m")
    names = _all_names(store / "ns")
    assert not [n for n in names if n.startswith(TEMP_PREFIX)], names
    assert (store / "ns" / "deep" / "log" / "0000000000").read_bytes() == b"m"


def test_on_disk_layout(local: LocalBackend, store: Path) -> None:
    """Key a/b is the file <location>/<namespace>/a/b; log entry n is <log>/%010d."""
    local.put("a/b", b"object")
    local.logs.append("logs/main", b"first")
    local.logs.append("logs/main", b"second")
    assert (store / "ns" / "a" / "b").read_bytes() == b"object"
    assert sorted(os.listdir(store / "ns" / "logs" / "main")) == ["0000000000", "0000000001"]


class _FailingStream(io.RawIOBase):
    """Yields ``good`` bytes, then raises like a broken source file would."""

    def __init__(self, good: int) -> None:
        super().__init__()
        self.left = good

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: memoryview) -> int:  # type: ignore[override]
        if self.left <= 0:
            raise RuntimeError("source went away")
        n = min(len(buffer), self.left)
        buffer[:n] = b"z" * n
        self.left -= n
        return n


def test_failed_stream_keeps_old_object(local: LocalBackend, store: Path) -> None:
    """If the source stream fails mid-put, its exception propagates unchanged, the old
    object is intact and no temp file is left."""
    local.put("k", b"old")
    with pytest.raises(RuntimeError, match="source went away"):
        local.put("k", io.BufferedReader(_FailingStream(CHUNK_SIZE + CHUNK_SIZE // 2)))
    assert local.get("k") == b"old"
    assert os.listdir(store / "ns") == ["k"]


class _RecordingStream(io.BytesIO):
    """A BytesIO remembering the size asked for by every read()."""

    def __init__(self, data: bytes) -> None:
        super().__init__(data)
        self.requests: list[int | None] = []

    def read(self, size: int | None = -1) -> bytes:
        self.requests.append(size)
        return super().read(size)


def test_put_reads_stream_in_bounded_pieces(local: LocalBackend) -> None:
    """put never reads a stream whole: every read() asks for 1..CHUNK_SIZE bytes."""
    data = b"q" * (3 * CHUNK_SIZE + 11)
    stream = _RecordingStream(data)
    local.put("k", stream)
    assert local.get("k") == data
    assert stream.requests
    assert all(n is not None and 0 < n <= CHUNK_SIZE for n in stream.requests), stream.requests


def test_put_is_atomic_on_disk(local: LocalBackend, store: Path, tmp_path: Path) -> None:
    """While another process overwrites a key, the file at the key's path is always a
    complete version, the folder only ever holds that file plus temp files, and
    list() never shows a temp file."""
    local.put("atomic", versioned_payload(0))
    folder = store / "ns"
    location = (f"dir:{store}", "ns")
    with ChildProcesses(
        overwrite_worker, [(location, "atomic", 30)], parent_in_barrier=True
    ) as children:
        children.barrier.wait(timeout=CHILD_TIMEOUT)
        while not children.done():
            check_versioned_payload((folder / "atomic").read_bytes())
            assert {n for n in os.listdir(folder) if not n.startswith(TEMP_PREFIX)} == {"atomic"}
            assert list(local.list()) == ["atomic"]
        assert children.results() == [30]
    assert local.get("atomic") == versioned_payload(30)
    assert os.listdir(folder) == ["atomic"]


def test_open_file_survives_overwrite_and_delete(local: LocalBackend) -> None:
    """A stream from open() keeps reading the version it opened, because writes
    replace the file instead of modifying it."""
    local.put("k", b"version one")
    with local.open("k") as f:
        local.put("k", b"version two!")
        assert f.read() == b"version one"
    with local.open("k") as f:
        local.delete("k")
        assert f.read() == b"version two!"


def test_object_and_folder_cannot_share_a_key(local: LocalBackend) -> None:
    """On a filesystem, 'a' cannot be an object and the folder of 'a/b' at once: such a
    put is a plain BackendError (not Unavailable); the folder is not an object."""
    local.put("a", b"object")
    with pytest.raises(BackendError) as info:
        local.put("a/b", b"x")
    assert not isinstance(info.value, BackendUnavailable)
    local.put("x/y", b"x")
    with pytest.raises(BackendError):
        local.put("x", b"x")
    with pytest.raises(ObjectNotFound):
        local.get("x")
    with pytest.raises(ObjectNotFound):
        local.size("x")
    with pytest.raises(ObjectNotFound):
        local.delete("x")
    assert local.poll("x") is None
    assert local.get("x/y") == b"x"


def test_negative_ranges_are_programming_errors(local: LocalBackend) -> None:
    """Negative offsets, lengths or fetch starts raise ValueError."""
    local.put("k", b"abc")
    with pytest.raises(ValueError):
        local.get_range("k", -1, 1)
    with pytest.raises(ValueError):
        local.get_range("k", 0, -1)
    with pytest.raises(ValueError):
        local.logs.fetch("log", -1)


def test_a_listing_names_what_the_folder_read_found_even_if_removed_since(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``list`` names each file the folder's read found, even one removed before its
    type or size was checked: a listing is one moment of the folder. Register logs
    rest on that (an entry created and blocks removed while a listing ran must not
    both be missed); before, the stat of each name for its size dropped the ones
    removed meanwhile, and 6 processes racing on one register log lost an append
    about once in ten runs. ``list_sizes`` has no size for such a file and leaves
    it out."""
    import metasync.backends.local as local

    backend = LocalBackend(f"dir:{tmp_path}", "ns")
    backend.create()
    backend.put("log/0000000000.b.1", b"block")
    backend.put("log/0000000001", b"entry")
    real_scandir = os.scandir

    class ReadThenRemove:
        """The folder is read; then the block goes, before the names are checked."""

        def __init__(self, path: str) -> None:
            self.inner = real_scandir(path)

        def __enter__(self) -> ReadThenRemove:
            return self

        def __iter__(self) -> Iterator[os.DirEntry[str]]:
            entries = list(self.inner)
            block = tmp_path / "ns" / "log" / "0000000000.b.1"
            if block.exists():
                block.unlink()
            return iter(entries)

        def __exit__(self, *exc: object) -> None:
            self.inner.close()

    monkeypatch.setattr(local.os, "scandir", ReadThenRemove)
    assert sorted(backend.list("log")) == ["log/0000000000.b.1", "log/0000000001"]
    backend.put("log/0000000000.b.1", b"block")
    assert [key for key, _ in backend.list_sizes("log")] == ["log/0000000001"]
