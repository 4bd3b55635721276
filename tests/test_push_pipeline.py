"""The push's hashing and packing pipeline (issue 21): new objects are claimed in
batches, each exactly once; packs are written to the outbox as they fill; files
read whole for chunking are cut exactly as a stream would be."""

from __future__ import annotations

import io
import os
import random
import threading
from pathlib import Path
from typing import Any

import pytest
from pyfastcdc import FastCDC

from conftest import snapshot, wait_until
from metasync import Repository
from metasync.codec import Codec, PackBuilder
from metasync.errors import Interrupted
from metasync.localdb import LocalDB
from metasync.objects import ObjectHasher, PackEntry
from metasync.outbox import SINK_BATCH, KnownIds
from metasync.scanner import Scanner
from metasync.store import RemoteStore
from metasync.worktree import CHUNK_AVG, CHUNK_MAX, CHUNK_MIN, Chunker, ScanEntry

#: The real tree builder, for a test that breaks it and mends it again.
_build_trees = Scanner.build_trees


def _entry(path: Path) -> ScanEntry:
    st = path.stat()
    return ScanEntry(path.name, "file", st.st_size, st.st_mtime_ns, st.st_ino, False)


def test_claim_many_claims_each_new_id_once(tmp_path: Path) -> None:
    """Ids already located are never claimed; a new id is claimed by exactly one
    call, even when listed twice or in several calls (more ids than one query)."""
    db = LocalDB(tmp_path / "local.db")
    stored = [f"{n:064x}" for n in range(700)]
    with db.transaction():
        db.add_locations("p" * 64, [PackEntry(i, "blob", n, 1) for n, i in enumerate(stored)])
    known = KnownIds(db.path)
    new = [f"{n:064x}" for n in range(10_000, 11_300)]
    mixed = [x for pair in zip(stored, new, strict=False) for x in pair] + new[700:] + new[:5]
    assert known.claim_many(mixed) == set(new)
    assert known.claim_many(new + stored) == set()
    assert not known.claim(stored[0])
    fresh = f"{99_999:064x}"
    assert known.claim(fresh) and not known.claim(fresh)


def test_spooled_pack_is_the_pack_built_in_memory(tmp_path: Path) -> None:
    """A pack streamed to a spool file has the same id and bytes as one built in
    memory, and reads back entry by entry."""
    codec = Codec(None)
    spools: list[Path] = []

    def open_spool() -> io.BufferedWriter:
        spools.append(tmp_path / f"spool{len(spools)}")
        return open(spools[-1], "wb")

    in_memory = PackBuilder(codec, target_size=20_000)
    spooled = PackBuilder(codec, target_size=20_000, open_spool=open_spool)
    rng = random.Random(4)
    closed: list[tuple[object, object]] = []
    for _ in range(60):
        data = rng.randbytes(rng.randrange(0, 3000)) * rng.randrange(1, 4)
        object_id = codec.id_of("blob", data)
        a, b = in_memory.add("blob", object_id, data), spooled.add("blob", object_id, data)
        assert (a is None) == (b is None)
        if a is not None:
            closed.append((a, b))
    closed.append((in_memory.flush(), spooled.flush()))
    assert len(closed) >= 3 and len(spools) == len(closed)
    for (a, b), path in zip(closed, spools, strict=True):
        assert a is not None and b is not None
        assert b.data == b"" and b.spool is not None and b.spool.name == str(path)
        b.spool.close()
        stored = path.read_bytes()
        assert (b.pack_id, b.entries, b.blobs) == (a.pack_id, a.entries, a.blobs)
        assert stored == a.data
        assert codec.pack_entries(b.pack_id, stored) == b.entries


@pytest.mark.parametrize("size", [CHUNK_MIN + 1, 3 * CHUNK_AVG + 5, 2 * CHUNK_MAX,
                                  2 * CHUNK_MAX + 1])
def test_files_are_cut_as_a_stream_would_be(tmp_path: Path, size: int) -> None:
    """A file read whole for chunking (up to 2 * CHUNK_MAX) gets exactly the chunks
    FastCDC finds streaming it: chunk ids are part of the format (deduplication
    across versions and clients)."""
    rng = random.Random(size)
    data = rng.randbytes(size // 2) + bytes(size // 4) + rng.randbytes(size - size // 2 - size // 4)
    path = tmp_path / "f"
    path.write_bytes(data)
    hasher = ObjectHasher(b"k" * 32)
    got: list[tuple[str, str, bytes]] = []
    ref = Chunker(hasher).hash_file(path, _entry(path), lambda k, i, d: got.append((k, i, d)))
    cdc = FastCDC(CHUNK_AVG, min_size=CHUNK_MIN, max_size=CHUNK_MAX)
    want = [bytes(p.data) for p in cdc.cut_stream(io.BytesIO(data))]
    assert [d for k, _, d in got if k == "blob"] == want
    assert ref.blobs == len(want) and ref.size == size


def test_commit_packs_every_new_object_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A commit of many files, most sharing content (more than one sink batch of
    each), stores every object in exactly one pack, in verified packs in the
    outbox, and leaves no temporary file there."""
    folder = tmp_path / "f"
    folder.mkdir()
    backend = tmp_path / "b"
    backend.mkdir()
    rng = random.Random(5)
    contents = [rng.randbytes(rng.randrange(1, 40_000)) for _ in range(30)]
    for n in range(4 * SINK_BATCH):
        (folder / f"{n}.bin").write_bytes(contents[n % len(contents)])
    big = rng.randbytes(3 * CHUNK_MAX)
    (folder / "big.bin").write_bytes(big)
    big_chunks = len(list(FastCDC(CHUNK_AVG, min_size=CHUNK_MIN, max_size=CHUNK_MAX).cut_buf(big)))
    (folder / "empty").write_bytes(b"")
    monkeypatch.setenv("METASYNC_PACK_SIZE", str(200_000))
    with Repository.init(folder, [f"dir:{backend}"], replicas=1, encrypt=False) as repo:
        result = repo.commit("many")
        assert result is not None
        outbox = folder / ".metasync" / "outbox"
        names = sorted(os.listdir(outbox))
        assert not [n for n in names if n.startswith(".tmp-")]
        codec = Codec(None)
        ids: list[str] = []
        packs = [kind for _, kind in repo.queued() if kind == "pack"]
        assert len(packs) >= 3
        for stored_id, kind in repo.queued():
            if kind == "pack":
                ids += [e.object_id for e in codec.pack_entries(
                    stored_id, (outbox / stored_id).read_bytes())]
        assert len(ids) == len(set(ids))
        # 30 contents, the empty blob, the big file's chunks; its file object
        assert result.new_objects["blob"] == len(set(contents)) + 1 + big_chunks
        assert result.new_objects["file"] == 1
        assert sum(result.new_objects.values()) == len(ids)
        repo.push("many")


def test_a_failed_commit_closes_and_removes_the_pack_it_was_spooling(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A commit that fails after packing began (here: building its trees fails)
    leaves no descriptor open on a spool file, and no spool file in the outbox
    (before, the file stayed open until the cyclic garbage collector ran: one
    descriptor per failed commit in a daemon)."""
    folder = tmp_path / "f"
    folder.mkdir()
    backend = tmp_path / "b"
    backend.mkdir()
    rng = random.Random(7)
    for n in range(6):
        (folder / f"{n}.bin").write_bytes(rng.randbytes(600_000))  # > one spool write

    def spools_open() -> list[str]:
        out = []
        for fd in os.listdir("/proc/self/fd"):
            try:
                target = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                continue
            if "/outbox/.tmp-" in target:
                out.append(target)
        return out

    def fail(*args: object, **kwargs: object) -> None:
        raise RuntimeError("building the trees failed")

    monkeypatch.setenv("METASYNC_PACK_SIZE", str(64 << 20))  # one pack, still open
    with Repository.init(folder, [f"dir:{backend}"], replicas=1, encrypt=False) as repo:
        monkeypatch.setattr(Scanner, "build_trees", fail)
        with pytest.raises(RuntimeError, match="building the trees"):
            repo.commit("fails")
        assert spools_open() == []
        outbox = folder / ".metasync" / "outbox"
        assert not [n for n in os.listdir(outbox) if n.startswith(".tmp-")]
        monkeypatch.undo()
        assert repo.commit("works") is not None


def _folder_of_packs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, seed: int) -> Path:
    """A folder of 30 random 100 kB files, with packs of 100 kB: more than a sink
    batch's bytes, so packs finish while the scan still runs, and when it ends."""
    folder = tmp_path / "f"
    folder.mkdir()
    rng = random.Random(seed)
    for n in range(30):
        (folder / f"{n}.bin").write_bytes(rng.randbytes(100_000))
    monkeypatch.setenv("METASYNC_PACK_SIZE", str(100_000))
    return folder


def _watch_uploads(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    """Every ``(thread name, stored id)`` the replicator is asked to upload, from now."""
    from metasync.replicator import Replicator

    asked: list[tuple[str, str]] = []
    upload = Replicator.upload

    def watched(self: Replicator, items: Any, on_done: Any, resumed: Any = ()) -> None:
        items = list(items)
        asked.extend((threading.current_thread().name, stored_id) for stored_id, _ in items)
        upload(self, items, on_done, resumed)

    monkeypatch.setattr(Replicator, "upload", watched)
    return asked


def test_a_push_uploads_its_packs_while_it_commits_each_once(
        tmp_path: Path, backends: list[Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """A push uploads each pack as it is finished, by its early-upload thread while
    the commit is built, and the flush books those uploads without uploading them
    again (issue 21): every pack is asked for exactly once, and the flush uploads
    only the indexes and the commit. The version holds every object: a fresh clone
    is the folder, fsck finds nothing."""
    folder = _folder_of_packs(tmp_path, monkeypatch, 11)
    with Repository.init(folder, [f"dir:{b}" for b in backends], replicas=2,
                         encrypt=False) as repo:
        asked = _watch_uploads(monkeypatch)
        result = repo.push("early")
        queued = repo.queued()
        report = repo.fsck()
    assert queued == [] and report.ok, report.problems
    ids = [stored_id for _, stored_id in asked]
    assert len(ids) == len(set(ids)), "an object was uploaded twice"
    early = {stored_id for thread, stored_id in asked if thread == "metasync-early-upload"}
    assert len(early) >= 25, asked
    flushed = set(ids) - early
    assert len(flushed) == 2, asked  # one index, the commit
    assert result.objects_uploaded == len(ids)
    clone = tmp_path / "clone"
    Repository.clone(f"dir:{backends[2]}", clone, allow_unencrypted=True).close()
    assert snapshot(clone) == snapshot(folder)


def test_a_commit_that_fails_stops_its_early_uploads(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A push whose commit fails after packs were uploaded early (here: building its
    trees fails) leaves no upload thread running and nothing queued; the next push
    keeps the packs it left whole in the outbox (as after a Ctrl-C, below) and
    completes."""

    backend = tmp_path / "b"
    backend.mkdir()
    folder = _folder_of_packs(tmp_path, monkeypatch, 12)

    asked: list[tuple[str, str]] = []

    def fail(*args: object, **kwargs: object) -> None:
        wait_until(lambda: asked, 30, "an early upload")
        raise RuntimeError("building the trees failed")

    with Repository.init(folder, [f"dir:{backend}"], replicas=1, encrypt=False) as repo:
        asked = _watch_uploads(monkeypatch)
        monkeypatch.setattr(Scanner, "build_trees", fail)
        with pytest.raises(RuntimeError, match="building the trees"):
            repo.push("fails")
        assert "metasync-early-upload" in {thread for thread, _ in asked}
        assert not [t for t in threading.enumerate() if t.name.startswith("metasync-early")]
        assert repo.queued() == [] and repo.head is None
        monkeypatch.setattr(Scanner, "build_trees", _build_trees)
        result = repo.push("works")
        assert result.version is not None and repo.fsck().ok
    clone = tmp_path / "clone"
    Repository.clone(f"dir:{backend}", clone, allow_unencrypted=True).close()
    assert snapshot(clone) == snapshot(folder)


def _stored_packs(backends: list[Path]) -> dict[Path, int]:
    """Every stored object file (named by a 64-hex id) on ``backends``, with its inode."""
    return {p: p.stat().st_ino for b in backends for p in (b / "metasync" / "objects").rglob("*")
            if p.is_file() and len(p.name) == 64}


def test_the_push_after_a_ctrl_c_keeps_the_packs_the_stopped_commit_made(
        tmp_path: Path, backends: list[Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C while a push still builds its commit, after some packs went up early:
    the next push keeps those packs (they are whole in the outbox) instead of packing
    and uploading their objects again, sends no copy a backend already holds, and its
    version lists them. Before, the next push removed them from the outbox and packed
    and uploaded everything again (a large first push stopped near its end started
    over). fsck is clean, a clone is the folder."""
    from metasync.progress import CANCEL

    folder = _folder_of_packs(tmp_path, monkeypatch, 14)
    stored_at_stop: dict[Path, int] = {}

    def ctrl_c(*args: object, **kwargs: object) -> None:
        wait_until(lambda: len(_stored_packs(backends)) >= 4, 30, "early uploads")
        stored_at_stop.update(_stored_packs(backends))
        CANCEL.request()
        raise KeyboardInterrupt

    with Repository.init(folder, [f"dir:{b}" for b in backends], replicas=2,
                         encrypt=False) as repo:
        monkeypatch.setattr(Scanner, "build_trees", ctrl_c)
        try:
            with pytest.raises(Interrupted):
                repo.push("stopped")
        finally:
            CANCEL.clear()
        assert repo.head is None
        monkeypatch.setattr(Scanner, "build_trees", _build_trees)
        found_whole: set[str] = set()
        has_copy = RemoteStore.has_copy

        def watched_has_copy(self: RemoteStore, backend_id: str, stored_id: str, size: int) -> bool:
            whole = has_copy(self, backend_id, stored_id, size)
            if whole:
                found_whole.add(stored_id)
            return whole

        monkeypatch.setattr(RemoteStore, "has_copy", watched_has_copy)
        result = repo.push("continued")
        assert result.version is not None and result.commit is not None
        located = {row[0] for row in repo.outbox.db.conn.execute(
            "SELECT DISTINCT pack_id FROM locations")}
        report = repo.fsck()
    early = {p.name for p in stored_at_stop}
    assert early <= located, "the continued push did not keep the stopped one's packs"
    assert result.commit.new_objects.get("blob", 0) <= 30 - len(early), result.commit
    after = _stored_packs(backends)
    assert {p: after.get(p) for p in stored_at_stop} == stored_at_stop  # no copy sent again
    assert found_whole >= early  # each holder asked first, and found to hold it whole
    assert report.ok, report.problems
    clone = tmp_path / "clone"
    Repository.clone(f"dir:{backends[2]}", clone, allow_unencrypted=True).close()
    assert snapshot(clone) == snapshot(folder)


def test_a_left_over_file_of_a_pack_already_uploaded_is_removed_not_queued(
        tmp_path: Path, backends: list[Path]) -> None:
    """A flush stopped between booking a pack's upload and removing its file leaves
    the file of a pack that is located and on the backends: the next commit removes
    it, as before, rather than keeping it as a stopped commit's (it would be
    uploaded again, under a second index)."""
    folder = tmp_path / "f"
    folder.mkdir()
    (folder / "a.txt").write_text("a\n")
    with Repository.init(folder, [f"dir:{b}" for b in backends], replicas=2,
                         encrypt=False) as repo:
        repo.push("v1")
        db = repo.outbox.db
        (pack_id,) = db.pack_ids()
        (copy,) = [p for b in backends for p in b.rglob(pack_id)][:1]
        left_over = repo.outbox.folder / pack_id
        left_over.write_bytes(copy.read_bytes())
        indexes = set(db.conn.execute("SELECT index_id FROM indexes").fetchall())
        (folder / "b.txt").write_text("b\n")
        repo.commit("v2")
        assert pack_id not in {stored_id for stored_id, _ in db.outbox()}
        assert not left_over.exists()
        listed = set(repo.graph.head_commit().indexes)  # type: ignore[union-attr]
        assert len(listed - {i for (i,) in indexes}) == 1  # the new commit's own index only


def test_packs_kept_from_a_stopped_commit_that_a_decided_version_does_not_use_stay_listed(
        tmp_path: Path, backends: list[Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """A commit stops after packing new files; the files are moved away and an
    earlier local commit is pushed (the folder is unchanged: no new commit lists
    the packs kept from the stopped one). Once that version is decided, the index
    of the kept packs stays local, and announced with its packs, so the push after
    the files come back lists it: a clone has every file. Before, deciding a version
    made every local index "remote", listed or not: the next version referred to
    objects in packs no version listed, and a clone failed ("in no known pack")."""
    import shutil

    folder = tmp_path / "f"
    folder.mkdir()
    (folder / "a.txt").write_text("a")
    monkeypatch.setenv("METASYNC_PACK_SIZE", str(100_000))
    rng = random.Random(15)
    big = {f"{n}.bin": rng.randbytes(100_000) for n in range(20)}

    def fail(*args: object, **kwargs: object) -> None:
        raise RuntimeError("stopped")

    with Repository.init(folder, [f"dir:{b}" for b in backends], replicas=2,
                         encrypt=False) as repo:
        repo.push("v1")
        (folder / "a.txt").write_text("b")
        repo.commit("offline")
        for name, data in big.items():
            (folder / name).write_bytes(data)
        monkeypatch.setattr(Scanner, "build_trees", fail)
        with pytest.raises(RuntimeError, match="stopped"):
            repo.commit("stopped")
        monkeypatch.setattr(Scanner, "build_trees", _build_trees)
        aside = tmp_path / "aside"
        aside.mkdir()
        for name in big:
            shutil.move(folder / name, aside / name)
        assert repo.push("the offline commit").version is not None
        kept = repo.outbox.db.local_indexes()
        assert kept, "the kept packs' index was taken as the decided version's"
        for name in big:
            shutil.move(aside / name, folder / name)
        result = repo.push("with the files")
        assert result.commit is not None
        assert set(kept) <= set(repo.graph.head_commit().indexes)  # type: ignore[union-attr]
        assert repo.fsck().ok
    clone = tmp_path / "clone"
    Repository.clone(f"dir:{backends[2]}", clone, allow_unencrypted=True).close()
    assert snapshot(clone) == snapshot(folder)


def test_indexes_merged_into_a_commits_are_no_longer_local(
        tmp_path: Path, backends: list[Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """Past MAX_INDEXES a commit merges its indexes into new ones; the local ones it
    merged away are recorded as no longer local with it, so once its version is
    decided nothing is left local or announced, and later commits do not merge them
    again (before, with a decided version keeping unlisted local indexes, every
    later push merged again and kept one more index and its packs announced)."""
    from metasync import outbox

    monkeypatch.setattr(outbox, "MAX_INDEXES", 3)
    folder = tmp_path / "f"
    folder.mkdir()
    with Repository.init(folder, [f"dir:{b}" for b in backends], replicas=2,
                         encrypt=False) as repo:
        for n in range(4):  # commits made offline: more local indexes than one commit lists
            (folder / f"offline-{n}.txt").write_text(f"offline {n}\n")
            repo.commit(f"offline {n}")
        for n in range(6):
            (folder / f"pushed-{n}.txt").write_text(f"pushed {n}\n")
            assert repo.push(f"push {n}").version is not None
            assert repo.outbox.db.local_indexes() == [], n
            assert repo.outbox.ctx.state.announced == [], n
            assert len(repo.graph.head_commit().indexes) <= 3  # type: ignore[union-attr]
    clone = tmp_path / "clone"
    Repository.clone(f"dir:{backends[2]}", clone, allow_unencrypted=True).close()
    assert snapshot(clone) == snapshot(folder)


def test_the_flushs_announcement_is_never_overwritten_by_an_early_one(
        tmp_path: Path, backends: list[Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """The early upload's announcements name its packs only; the flush's names the
    indexes and the commit too. Here every early announcement is held until the
    flush either announces or waits for the early upload: the flush waits first, so
    its announcement is the last one a push in progress writes, and names the commit
    (before the fix, the flush announced first and an early announcement written
    after it dropped the commit and the index: a gc then deleted them)."""
    from metasync.outbox import EarlyUpload, Outbox

    folder = _folder_of_packs(tmp_path, monkeypatch, 13)
    go_on = threading.Event()
    writes: list[tuple[str, set[str], bool]] = []
    lock = threading.Lock()
    write, finish = Outbox.write_client_state, EarlyUpload.finish

    def watched_write(self: Outbox, head: Any, prev: Any, announced: set[str],
                      required: bool) -> None:
        early = threading.current_thread().name.startswith("metasync-early")
        if early:
            assert go_on.wait(30), "neither the flush nor its wait began"
        else:
            go_on.set()
        with lock:
            write(self, head, prev, announced, required)
            writes.append((threading.current_thread().name, set(announced), required))

    def watched_finish(self: EarlyUpload) -> Any:
        go_on.set()
        return finish(self)

    monkeypatch.setattr(Outbox, "write_client_state", watched_write)
    monkeypatch.setattr(EarlyUpload, "finish", watched_finish)
    with Repository.init(folder, [f"dir:{b}" for b in backends], replicas=2,
                         encrypt=False) as repo:
        repo.push("announced")
        head = repo.head
    required = [w for w in writes if w[2]]
    assert any(name.startswith("metasync-early") for name, _, _ in required), writes
    assert head in required[-1][1], "the last announcement of the push drops its commit"
