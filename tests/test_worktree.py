"""The working tree: conflict names, scanning, and content-defined chunking."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

from metasync.objects import FileObject, ObjectHasher
from metasync.worktree import (
    CHUNK_MAX,
    CHUNK_MIN,
    META_DIR,
    TEMP_PREFIX,
    Chunker,
    FileChanged,
    HashedFile,
    ScanEntry,
    conflict_name,
    remove_stale_temps,
    scan,
)

WHEN = "2026-01-02 030405"
HASHER = ObjectHasher(None)


# ----------------------------------------------------------------------------- conflict_name


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("report.pdf", "report (conflict laptop 2026-01-02 030405).pdf"),
        ("Makefile", "Makefile (conflict laptop 2026-01-02 030405)"),
        (".bashrc", ".bashrc (conflict laptop 2026-01-02 030405)"),
        ("a.tar.gz", "a.tar (conflict laptop 2026-01-02 030405).gz"),
        (".config.json", ".config (conflict laptop 2026-01-02 030405).json"),
        ("résumé ☃.txt", "résumé ☃ (conflict laptop 2026-01-02 030405).txt"),
    ],
)
def test_conflict_name(name: str, expected: str) -> None:
    """NAME (conflict DEVICE WHEN).EXT: the last extension stays last; a name with
    no dot, or only a leading dot (a hidden file), gets no fake extension."""
    assert conflict_name(name, "laptop", WHEN) == expected


def test_conflict_name_is_a_safe_distinct_name() -> None:
    """The conflict copy differs from the original and adds no path separator."""
    for name in ("x", "x.y", ".x", "x.", "a b.c d"):
        result = conflict_name(name, "dev", WHEN)
        assert result != name
        assert "/" not in result


# ----------------------------------------------------------------------------- scan


def test_scan_records_files_dirs_links_and_exec_bits(tmp_path: Path) -> None:
    """scan lists files (size, exec bit), folders (also empty ones) and links with
    '/'-separated relative paths."""
    root = tmp_path / "root"
    (root / "sub" / "deeper").mkdir(parents=True)
    (root / "empty").mkdir()
    (root / "a.txt").write_bytes(b"hello")
    script = root / "sub" / "run.sh"
    script.write_bytes(b"#!/bin/sh\n")
    script.chmod(0o755)
    (root / "sub" / "deeper" / "x").write_bytes(b"")
    os.symlink("a.txt", root / "link")
    found = scan(root)
    assert set(found) == {"a.txt", "sub", "sub/run.sh", "sub/deeper", "sub/deeper/x", "empty", "link"}
    assert found["a.txt"].type == "file" and found["a.txt"].size == 5
    assert not found["a.txt"].executable
    assert found["sub/run.sh"].executable
    assert found["sub"].type == "dir" and found["empty"].type == "dir"
    assert found["sub/deeper/x"].size == 0
    assert found["link"] == ScanEntry(
        "link", "link", len(b"a.txt"), os.lstat(root / "link").st_mtime_ns,
        os.lstat(root / "link").st_ino, False, "a.txt",
    )
    st = os.stat(root / "a.txt")
    assert (found["a.txt"].mtime_ns, found["a.txt"].ino) == (st.st_mtime_ns, st.st_ino)


def test_scan_skips_metadata_and_temp_files(tmp_path: Path) -> None:
    """.metasync (and everything in it) and .metasync-tmp-* files are never listed,
    at any depth; a similar but different name is."""
    root = tmp_path / "root"
    (root / META_DIR / "objects").mkdir(parents=True)
    (root / META_DIR / "objects" / "x").write_bytes(b"x")
    (root / "sub").mkdir()
    (root / f"{TEMP_PREFIX}abc").write_bytes(b"partial")
    (root / "sub" / f"{TEMP_PREFIX}def").write_bytes(b"partial")
    (root / ".metasync-tmp").write_bytes(b"not ours: no trailing dash")
    (root / ".metasyncx").write_bytes(b"not ours")
    assert set(scan(root)) == {"sub", ".metasync-tmp", ".metasyncx"}
    assert remove_stale_temps(root) == 2
    assert not (root / f"{TEMP_PREFIX}abc").exists()
    assert (root / META_DIR / "objects" / "x").exists()


def test_scan_does_not_follow_links(tmp_path: Path) -> None:
    """A link to a folder outside the tree is recorded as a link (with its target)
    and never entered; dangling and looping links are links too."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_bytes(b"do not sync")
    root = tmp_path / "root"
    root.mkdir()
    os.symlink(outside, root / "out")
    os.symlink("missing", root / "dangling")
    os.symlink("loop", root / "loop")
    os.symlink(".", root / "self")
    found = scan(root)
    assert set(found) == {"out", "dangling", "loop", "self"}
    assert found["out"].type == "link"
    assert found["out"].target == str(outside)
    assert found["out"].size == len(os.fsencode(str(outside)))
    assert all(e.type == "link" for e in found.values())


def test_scan_undecodable_names(tmp_path: Path) -> None:
    """A file name that is not UTF-8 is listed by its surrogate-escaped spelling,
    which maps back to the same bytes."""
    root = tmp_path / "root"
    root.mkdir()
    raw = b"caf\xe9.txt"
    with open(os.path.join(os.fsencode(root), raw), "wb") as fh:
        fh.write(b"x")
    (name,) = scan(root)
    assert os.fsencode(name) == raw


def test_scan_skips_special_files(tmp_path: Path) -> None:
    """FIFOs are not synchronised."""
    root = tmp_path / "root"
    root.mkdir()
    os.mkfifo(root / "pipe")
    (root / "f").write_bytes(b"")
    assert set(scan(root)) == {"f"}


# ----------------------------------------------------------------------------- chunker


def write(path: Path, data: bytes) -> ScanEntry:
    path.write_bytes(data)
    st = os.stat(path)
    return ScanEntry(path.name, "file", st.st_size, st.st_mtime_ns, st.st_ino, False)


def hash_collect(path: Path, entry: ScanEntry) -> tuple[HashedFile, list[tuple[str, str, bytes]]]:
    emitted: list[tuple[str, str, bytes]] = []
    ref = Chunker(HASHER).hash_file(path, entry, lambda k, i, d: emitted.append((k, i, d)))
    return ref, emitted


@pytest.fixture(scope="module")
def big_random() -> bytes:
    """~20 MB of deterministic random bytes."""
    return random.Random(20).randbytes(20 * 1024 * 1024 + 12345)


def test_identical_content_identical_refs(tmp_path: Path) -> None:
    """Two files with the same content get the same reference (small and chunked)."""
    data = random.Random(1).randbytes(3 * CHUNK_MAX)
    for size in (10, len(data)):
        a = write(tmp_path / "a", data[:size])
        b = write(tmp_path / "b", data[:size])
        assert Chunker(HASHER).hash_file(tmp_path / "a", a, None) == Chunker(HASHER).hash_file(
            tmp_path / "b", b, None
        )


def test_small_file_is_one_blob(tmp_path: Path) -> None:
    """A file up to CHUNK_MIN is one blob named by its content; the sink gets it."""
    data = b"x" * CHUNK_MIN
    ref, emitted = hash_collect(tmp_path / "f", write(tmp_path / "f", data))
    blob_id = HASHER.id_of("blob", data)
    assert (ref.type, ref.ref, ref.size, ref.blobs) == ("file", blob_id, CHUNK_MIN, 1)
    assert emitted == [("blob", blob_id, data)]


def test_empty_file_is_one_empty_blob(tmp_path: Path) -> None:
    """An empty file is a single empty blob (reported to the sink too)."""
    ref, emitted = hash_collect(tmp_path / "e", write(tmp_path / "e", b""))
    empty = HASHER.id_of("blob", b"")
    assert (ref.type, ref.ref, ref.size, ref.blobs) == ("file", empty, 0, 1)
    assert emitted == [("blob", empty, b"")]
    assert Chunker(HASHER).hash_file(tmp_path / "e", write(tmp_path / "e", b""), None).ref == empty


def test_large_file_is_chunked_contiguously(tmp_path: Path, big_random: bytes) -> None:
    """A file larger than CHUNK_MIN becomes a FileObject whose chunks are
    contiguous, within the size bounds, cover the whole size, and match the
    blobs given to the sink, which reassemble the file."""
    data = big_random[: 9 * 1024 * 1024 + 7]
    ref, emitted = hash_collect(tmp_path / "big", write(tmp_path / "big", data))
    assert ref.type == "chunked"
    file_records = [e for e in emitted if e[0] == "file"]
    assert len(file_records) == 1
    _, file_id, file_bytes = file_records[0]
    assert file_id == ref.ref == HASHER.id_of("file", file_bytes)
    obj = FileObject.from_bytes(file_bytes)  # the parser checks contiguity and total size
    assert obj.size == len(data) == ref.size
    assert len(obj.chunks) == ref.blobs >= 3
    blobs = {i: d for k, i, d in emitted if k == "blob"}
    offset = 0
    for n, chunk in enumerate(obj.chunks):
        assert chunk.offset == offset
        assert chunk.length <= CHUNK_MAX
        if n < len(obj.chunks) - 1:
            assert chunk.length >= CHUNK_MIN
        assert blobs[chunk.blob_id] == data[chunk.offset : chunk.offset + chunk.length]
        offset += chunk.length
    assert offset == len(data)
    # a file just over CHUNK_MIN is still covered exactly
    small = big_random[: CHUNK_MIN + 1]
    ref2, emitted2 = hash_collect(tmp_path / "s", write(tmp_path / "s", small))
    assert ref2.size == CHUNK_MIN + 1
    assert b"".join(d for k, _, d in emitted2 if k == "blob") == small


def test_one_byte_edit_changes_at_most_two_blobs(tmp_path: Path, big_random: bytes) -> None:
    """Content-defined chunking: changing one byte in the middle of a ~20 MB file
    changes at most 2 blob ids; all the others are reused."""
    path = tmp_path / "big"
    before, emitted_before = hash_collect(path, write(path, big_random))
    edited = bytearray(big_random)
    edited[len(edited) // 2] ^= 0xFF
    after, emitted_after = hash_collect(path, write(path, bytes(edited)))
    old = [i for k, i, _ in emitted_before if k == "blob"]
    new = [i for k, i, _ in emitted_after if k == "blob"]
    assert len(old) >= 10
    assert before.ref != after.ref
    assert 1 <= len(set(new) - set(old)) <= 2
    assert len(set(old) - set(new)) <= 2


def test_hash_file_detects_change(tmp_path: Path) -> None:
    """hash_file raises FileChanged when the file's size or mtime differ from the
    scan entry it was given (the file changed since it was scanned)."""
    path = tmp_path / "f"
    entry = write(path, b"hello")
    chunker = Chunker(HASHER)
    assert chunker.hash_file(path, entry, None).size == 5
    for stale in (
        ScanEntry("f", "file", 6, entry.mtime_ns, entry.ino, False),
        ScanEntry("f", "file", 5, entry.mtime_ns + 1, entry.ino, False),
    ):
        with pytest.raises(FileChanged):
            chunker.hash_file(path, stale, None)
    # the file grows after the scan: size and mtime move
    with open(path, "ab") as fh:
        fh.write(b"!")
    os.utime(path, ns=(entry.mtime_ns + 10**9, entry.mtime_ns + 10**9))
    with pytest.raises(FileChanged):
        chunker.hash_file(path, entry, None)
    # and the same for a chunked file
    big = random.Random(3).randbytes(CHUNK_MIN * 3)
    big_entry = write(path, big)
    os.utime(path, ns=(big_entry.mtime_ns + 5, big_entry.mtime_ns + 5))
    with pytest.raises(FileChanged):
        chunker.hash_file(path, big_entry, None)


def test_keyed_hasher_changes_blob_ids(tmp_path: Path) -> None:
    """With a keyed hasher, the same content gets different ids than unkeyed."""
    entry = write(tmp_path / "f", b"same")
    plain = Chunker(HASHER).hash_file(tmp_path / "f", entry, None)
    keyed = Chunker(ObjectHasher(b"k" * 32)).hash_file(tmp_path / "f", entry, None)
    assert plain.ref != keyed.ref
