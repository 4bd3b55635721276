"""pull and push through the Python API on a small repository: the rules that keep
local changes safe, and recovery after an interrupted command."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from conftest import snapshot
from metasync import Repository
from metasync.errors import BackendError, ObjectUnavailable
from metasync.progress import NullReporter


def _init(tmp_path: Path, backends: list[Path], passphrase: Callable[[], str]) -> Repository:
    src = tmp_path / "a"
    src.mkdir()
    (src / "doc.txt").write_text("v1\n")
    (src / "keep.txt").write_text("keep\n")
    repo = Repository.init(src, [f"dir:{b}" for b in backends], passphrase=passphrase)
    repo.push("first")
    return repo


def _clone(tmp_path: Path, backends: list[Path], passphrase: Callable[[], str], name: str,
           reporter: NullReporter | None = None) -> Repository:
    return Repository.clone(f"dir:{backends[0]}", tmp_path / name, passphrase=passphrase,
                            reporter=reporter)


class EditDuringDownload(NullReporter):
    """Edits a file at the moment the pull starts downloading (a user typing)."""

    def __init__(self, path: Path, text: str) -> None:
        super().__init__()
        self.path, self.text = path, text

    def start(self, label: str, total: int) -> None:
        if label == "download" and self.path.exists():
            self.path.write_text(self.text)


def test_edit_during_pull_becomes_conflict_copy(tmp_path: Path, backends: list[Path],
                                                passphrase: Callable[[], str]) -> None:
    """A file edited after pull planned but before it replaced the file is kept as a
    conflict copy, never overwritten."""
    a = _init(tmp_path, backends, passphrase)
    b = _clone(tmp_path, backends, passphrase, "b")
    (a.root / "doc.txt").write_text("remote v2\n")
    a.push("v2")
    b.reporter = EditDuringDownload(b.root / "doc.txt", "typed during the pull\n")
    result = b.pull()
    assert (b.root / "doc.txt").read_text() == "remote v2\n"
    assert len(result.conflicts) == 1
    assert (b.root / result.conflicts[0]).read_text() == "typed during the pull\n"


class EditWhenReadingStarts(NullReporter):
    """Rewrites a file, longer, as a push starts reading the changed files: the scan
    saw the old size, the read meets the new one."""

    def __init__(self, path: Path, text: str) -> None:
        super().__init__()
        self.path, self.text = path, text

    def start(self, label: str, total: int) -> None:
        if label == "pack" and self.text:
            self.path.write_text(self.text)
            self.text = ""


def test_a_file_growing_between_scan_and_read_is_committed_as_read(
    tmp_path: Path, backends: list[Path], passphrase: Callable[[], str]
) -> None:
    """A file that changes after the scan saw it and before it is read is read again;
    the commit records the size of what was read, so a clone writes it (before, the
    tree kept the scan's size beside the new content: "blob ... has the wrong
    length" on every pull, which stopped a daemon for good)."""
    a = _init(tmp_path, backends, passphrase)
    (a.root / "doc.txt").write_text("v2\n")
    a.reporter = EditWhenReadingStarts(a.root / "doc.txt", "v2, and a longer third line\n")
    a.push("v2")
    b = _clone(tmp_path, backends, passphrase, "b")
    assert (b.root / "doc.txt").read_text() == "v2, and a longer third line\n"
    assert a.status().changes == []


def test_remote_delete_of_locally_modified_file_keeps_it(
    tmp_path: Path, backends: list[Path], passphrase: Callable[[], str]
) -> None:
    """Delete (remote) against modify (local) keeps the modified file."""
    a = _init(tmp_path, backends, passphrase)
    b = _clone(tmp_path, backends, passphrase, "b")
    (a.root / "doc.txt").unlink()
    a.push("delete")
    (b.root / "doc.txt").write_text("local change\n")
    b.pull()
    assert (b.root / "doc.txt").read_text() == "local change\n"
    b.push("keep my change")
    a.pull()
    assert (a.root / "doc.txt").read_text() == "local change\n"


def test_local_delete_of_remotely_modified_file_restores_it(
    tmp_path: Path, backends: list[Path], passphrase: Callable[[], str]
) -> None:
    """Modify (remote) against delete (local) keeps the modified file."""
    a = _init(tmp_path, backends, passphrase)
    b = _clone(tmp_path, backends, passphrase, "b")
    (a.root / "doc.txt").write_text("modified\n")
    a.push("modify")
    (b.root / "doc.txt").unlink()
    b.pull()
    assert (b.root / "doc.txt").read_text() == "modified\n"


def test_untracked_local_file_in_the_way_is_kept(
    tmp_path: Path, backends: list[Path], passphrase: Callable[[], str]
) -> None:
    """A new local file where master adds a file of the same name survives as a
    conflict copy; a local file where master adds a folder too."""
    a = _init(tmp_path, backends, passphrase)
    b = _clone(tmp_path, backends, passphrase, "b")
    (a.root / "new.txt").write_text("remote\n")
    (a.root / "folder").mkdir()
    (a.root / "folder" / "inner.txt").write_text("inner\n")
    a.push("adds")
    (b.root / "new.txt").write_text("local\n")
    (b.root / "folder").write_text("a file where a folder will be\n")
    result = b.pull()
    assert (b.root / "new.txt").read_text() == "remote\n"
    assert (b.root / "folder" / "inner.txt").read_text() == "inner\n"
    kept = sorted(p.read_text() for p in b.root.glob("* (conflict *)*"))
    assert kept == ["a file where a folder will be\n", "local\n"]
    assert len(result.conflicts) == 2


def test_push_interrupted_before_proposal_is_completed_by_next_push(
    tmp_path: Path, backends: list[Path], passphrase: Callable[[], str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A push that dies after uploading data but before pPaxos leaves master alone;
    the next push completes it, and a clone sees exactly the new tree."""
    a = _init(tmp_path, backends, passphrase)
    (a.root / "doc.txt").write_text("v2\n")
    original = a.consensus.propose

    def crash(*args: object, **kwargs: object) -> object:
        raise KeyboardInterrupt  # the process is killed here

    monkeypatch.setattr(a.consensus, "propose", crash)
    with pytest.raises(KeyboardInterrupt):
        a.push("v2")
    monkeypatch.setattr(a.consensus, "propose", original)
    fresh = _clone(tmp_path, backends, passphrase, "before")
    assert (fresh.root / "doc.txt").read_text() == "v1\n"  # master did not move
    a.push()
    c = _clone(tmp_path, backends, passphrase, "after")
    assert snapshot(c.root) == snapshot(a.root)


def test_unreachable_backends_keep_objects_queued(
    tmp_path: Path, backends: list[Path], passphrase: Callable[[], str]
) -> None:
    """With every backend away the push fails cleanly (no quorum) before changing
    anything: no commit, nothing queued; once the backends return, push works."""
    a = _init(tmp_path, backends, passphrase)
    (a.root / "doc.txt").write_text("v2\n")
    hidden = [b.with_name(b.name + "-away") for b in backends]
    for b, h in zip(backends, hidden, strict=True):
        b.rename(h)
    head = a.head
    with pytest.raises(BackendError, match="only 0 of 3 backends answered"):
        a.push("offline")
    assert a.head == head and not a.queued(), "a failed push changes nothing"
    for b, h in zip(backends, hidden, strict=True):
        h.rename(b)
    a.close()
    a = Repository.open(a.root)
    a.push()
    assert not a.queued()
    c = _clone(tmp_path, backends, passphrase, "c")
    assert (c.root / "doc.txt").read_text() == "v2\n"


def test_one_backend_down_push_still_works(
    tmp_path: Path, backends: list[Path], passphrase: Callable[[], str]
) -> None:
    """With one of three backends away, push succeeds (a quorum of acceptors and at
    least one copy of each object); the missed copies are written once it is back."""
    a = _init(tmp_path, backends, passphrase)
    away = backends[2].with_name("away")
    backends[2].rename(away)
    (a.root / "doc.txt").write_text("while one is down\n")
    result = a.push("degraded")
    assert result.version is not None and result.version.number == 2
    away.rename(backends[2])
    a.close()
    a = Repository.open(a.root)
    (a.root / "more.txt").write_text("more\n")
    a.push("healed")
    assert not a.missing_copies()
    assert a.fsck().ok


def test_object_reaching_no_backend_stays_queued(
    tmp_path: Path, backends: list[Path], passphrase: Callable[[], str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An object none of whose holders accepts it is not dropped from the outbox
    (the push fails); the next push uploads it and master then refers to it."""
    a = _init(tmp_path, backends, passphrase)
    (a.root / "doc.txt").write_text("v2\n")
    real_put = a.store.put_copy
    monkeypatch.setattr(a.store, "put_copy", lambda b, sid, data: "refused")
    with pytest.raises(ObjectUnavailable):
        a.push("v2")
    assert len(a.queued()) == 3  # pack, index, commit
    assert all((a.meta / "outbox" / sid).exists() for sid, _ in a.queued())
    monkeypatch.setattr(a.store, "put_copy", real_put)
    a.push()
    assert not a.queued()
    c = _clone(tmp_path, backends, passphrase, "c")
    assert (c.root / "doc.txt").read_text() == "v2\n"


def test_push_after_master_moved_merges(
    tmp_path: Path, backends: list[Path], passphrase: Callable[[], str]
) -> None:
    """Two clients at the same version: the second push merges with the first's
    commit (a merge commit whose first parent is the first push) and both changes
    end up in both folders."""
    a = _init(tmp_path, backends, passphrase)
    b = _clone(tmp_path, backends, passphrase, "b")
    (a.root / "x").write_text("a\n")
    first = a.push()
    (b.root / "y").write_text("b\n")
    second = b.push()
    assert second.version is not None and first.version is not None
    assert second.version.number == first.version.number + 1
    assert (b.root / "x").read_text() == "a\n" and (b.root / "y").read_text() == "b\n"
    merge = b.load_commit(b.head or "")
    assert merge.parents[0] == first.version.master and len(merge.parents) == 2
    a.pull()
    assert (a.root / "y").read_text() == "b\n"
    assert [e.commit_id for e in a.log()] == [e.commit_id for e in b.log()]


def test_file_and_folder_swaps(
    tmp_path: Path, backends: list[Path], passphrase: Callable[[], str]
) -> None:
    """A file that master turns into a folder, and a folder that master turns into a
    file, are applied without conflict copies when the local side did not change them."""
    a = _init(tmp_path, backends, passphrase)
    (a.root / "box").mkdir()
    (a.root / "box" / "inside.txt").write_text("inside\n")
    a.push("folder box")
    b = _clone(tmp_path, backends, passphrase, "b")
    (a.root / "doc.txt").unlink()
    (a.root / "doc.txt").mkdir()
    (a.root / "doc.txt" / "now-a-folder").write_text("x\n")
    shutil.rmtree(a.root / "box")
    (a.root / "box").write_text("now a file\n")
    a.push("swap")
    result = b.pull()
    assert result.conflicts == []
    assert snapshot(b.root) == snapshot(a.root)


def test_failed_clone_leaves_nothing(
    tmp_path: Path, backends: list[Path], passphrase: Callable[[], str]
) -> None:
    """A clone that fails after it started writing (every object copy gone) reports
    the missing objects and leaves no folder behind, or an empty folder empty."""
    _init(tmp_path, backends, passphrase).close()
    for b in backends:
        # A backend may hold no object at all (3 objects, 2 copies each, placed by id).
        shutil.rmtree(b / "metasync" / "objects", ignore_errors=True)
    with pytest.raises(ObjectUnavailable):
        _clone(tmp_path, backends, passphrase, "new")
    assert not (tmp_path / "new").exists()
    (tmp_path / "empty").mkdir()
    with pytest.raises(ObjectUnavailable):
        _clone(tmp_path, backends, passphrase, "empty")
    assert list((tmp_path / "empty").iterdir()) == []


def test_failed_clone_removes_only_what_it_wrote(
    tmp_path: Path, backends: list[Path], passphrase: Callable[[], str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A clone that fails halfway removes the files it wrote and the folders left
    empty -- but not a file the user saved into the folder meanwhile, nor a cloned
    file the user edited since it was written: nothing of theirs is lost."""
    from metasync import checkout

    a = _init(tmp_path, backends, passphrase)
    for i in range(12):
        (a.root / "sub" / f"d{i % 3}").mkdir(parents=True, exist_ok=True)
        (a.root / "sub" / f"d{i % 3}" / f"f{i}.txt").write_text(f"file {i}\n")
    os.symlink("doc.txt", a.root / "link")
    a.push("more")
    target = tmp_path / "new"
    elsewhere = tmp_path / "elsewhere"
    writes = 0
    edited: list[Path] = []

    def fail_midway(name: str) -> None:
        nonlocal writes
        if name != "checkout:write":
            return
        writes += 1
        if writes == 10:  # the user saves a file, edits a cloned one, then a read fails
            (target / "mine.txt").write_text("the user's\n")
            (target / "sub" / "d0" / "mine too.txt").write_text("also the user's\n")
            done = sorted(p for p in target.rglob("*.txt") if ".metasync" not in p.parts
                          and "mine" not in p.name)
            edited.append(done[0])
            with open(done[0], "a") as fh:
                fh.write("edited by the user\n")
            # A folder moved elsewhere, a link left in its place: what was written
            # into it is the user's now, out of the clone's reach.
            moved = next(d for d in sorted((target / "sub").iterdir())
                         if d.name != "d0" and any(d.iterdir()) and d != edited[0].parent)
            shutil.move(moved, elsewhere)
            os.symlink(elsewhere, moved)
            raise ObjectUnavailable("a read failed (test)")

    monkeypatch.setattr(checkout, "crash_point", fail_midway)
    with pytest.raises(ObjectUnavailable, match="a read failed"):
        _clone(tmp_path, backends, passphrase, "new")
    moved_files = sorted(p.name for p in elsewhere.iterdir())
    assert moved_files and all(p.read_text().startswith("file ") for p in elsewhere.iterdir())
    link = next(p for p in (target / "sub").iterdir() if p.is_symlink())
    left = sorted(str(p.relative_to(target)) for p in target.rglob("*"))
    kept = str(edited[0].relative_to(target))
    assert left == sorted({"mine.txt", "sub", "sub/d0", "sub/d0/mine too.txt", kept,
                           str(link.relative_to(target)),
                           *(str(Path(kept).parents[i]) for i in range(len(Path(kept).parents) - 1))})
    assert (target / "mine.txt").read_text() == "the user's\n"
    assert edited[0].read_text().endswith("edited by the user\n")


def test_a_failed_clone_on_fat_keeps_a_same_size_edit_made_in_the_same_tick(
    tmp_path: Path, backends: list[Path], passphrase: Callable[[], str],
    monkeypatch: pytest.MonkeyPatch, fs_images: dict[str, Path],
) -> None:
    """FAT keeps mtimes to 2 s: a cloned file the user rewrote with as many bytes
    within the tick of the clone's write has the size, mtime and inode the clone
    recorded. A failed clone's undo compares such a file's content with what it
    wrote before removing it: the user's version stays."""
    from metasync import checkout
    from tests.servers.fsimages import fresh_folder, rewrite_within_the_tick

    a = _init(tmp_path, backends, passphrase)
    for i in range(12):
        (a.root / f"f{i:02}.txt").write_text(f"file {i:02}\n")
    a.push("more")
    target = fresh_folder(fs_images["fat"], "clone") / "new"
    writes = 0
    edited: list[tuple[Path, str]] = []

    def fail_midway(name: str) -> None:
        nonlocal writes
        if name != "checkout:write":
            return
        writes += 1
        if writes == 10:
            done = sorted(p for p in target.glob("f*.txt"))
            path = done[0]
            mine = path.read_text().upper()  # as many bytes
            rewrite_within_the_tick(path, mine)
            edited.append((path, mine))
            raise ObjectUnavailable("a read failed (test)")

    monkeypatch.setattr(checkout, "crash_point", fail_midway)
    with pytest.raises(ObjectUnavailable, match="a read failed"):
        Repository.clone(f"dir:{backends[0]}", target, passphrase=passphrase)
    (path, mine), = edited
    assert path.exists() and path.read_text() == mine, "the user's edit went with the clone"
    assert sorted(p.name for p in target.iterdir()) == [path.name]


def test_many_pushes_merge_indexes(
    tmp_path: Path, backends: list[Path], passphrase: Callable[[], str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past MAX_INDEXES index objects a commit merges them into a few; a clone then
    finds every object through the merged indexes alone."""
    from metasync import outbox

    monkeypatch.setattr(outbox, "MAX_INDEXES", 3)
    a = _init(tmp_path, backends, passphrase)
    for i in range(6):
        (a.root / f"file-{i}.txt").write_text(f"content {i}\n")
        a.push(f"push {i}")
        head = a.load_commit(a.head or "")
        assert len(head.indexes) <= 3
    c = _clone(tmp_path, backends, passphrase, "c")
    assert snapshot(c.root) == snapshot(a.root)


def test_status_before_push_does_not_hide_new_content(
    tmp_path: Path, backends: list[Path], passphrase: Callable[[], str]
) -> None:
    """`status` caches the hash of a new file without storing its content; the next
    push must still pack and upload it (regression: the commit trusted the cached
    hash and referred to a blob no pack held, so clones failed)."""
    import os
    import time

    a = _init(tmp_path, backends, passphrase)
    new = a.root / "new.txt"
    new.write_text("content only status has seen\n")
    old = time.time() - 60  # not 'racily clean': cached hashes are trusted
    for path in a.root.glob("*.txt"):
        os.utime(path, (old, old))
    assert [c.path for c in a.status().changes] == ["new.txt"]
    assert a.status().files_hashed == 0  # the second status used the cache
    a.push("new file")
    c = _clone(tmp_path, backends, passphrase, "c")
    assert (c.root / "new.txt").read_text() == "content only status has seen\n"


def test_pull_merges_unpushed_local_commits(
    tmp_path: Path, backends: list[Path], passphrase: Callable[[], str]
) -> None:
    """Local commits not yet pushed are merged with a moved master by `pull` into a
    local merge commit (first parent: master); the folder holds both sides, a file
    changed on both sides keeps master's version under its name and the local one
    as a conflict copy (renamed locally, not downloaded); `push` then publishes
    the merge and the other clone gets exactly the same tree."""
    a = _init(tmp_path, backends, passphrase)
    b = _clone(tmp_path, backends, passphrase, "b")
    (b.root / "doc.txt").write_text("b's edit\n")
    (b.root / "from-b.txt").write_text("b\n")
    b.commit("b local")
    (a.root / "doc.txt").write_text("a's edit\n")
    (a.root / "from-a.txt").write_text("a\n")
    pushed = a.push("a")
    result = b.pull()
    assert b.head is not None and b.head != pushed.version.master  # type: ignore[union-attr]
    merge = b.load_commit(b.head)
    assert merge.parents[0] == pushed.version.master  # type: ignore[union-attr]
    assert (b.root / "doc.txt").read_text() == "a's edit\n"
    assert len(result.conflicts) == 1
    assert (b.root / result.conflicts[0]).read_text() == "b's edit\n"
    assert (b.root / "from-a.txt").read_text() == "a\n" and (b.root / "from-b.txt").exists()
    assert b.status().changes == []
    b.push()
    a.pull()
    assert snapshot(a.root) == snapshot(b.root)


def test_one_command_per_folder_at_a_time(
    tmp_path: Path, backends: list[Path], passphrase: Callable[[], str]
) -> None:
    """While a repository is open (a command running), a second open of the same
    folder waits for it at most its bound, then fails with a one-line error
    instead of interleaving with it; once the first closes, the folder opens
    again."""
    from metasync.errors import UsageError

    a = _init(tmp_path, backends, passphrase)
    with pytest.raises(UsageError, match=r"another metasync command is using .* did not "
                                         r"finish within 0\.2 s"):
        Repository.open(a.root / "doc.txt", wait=0.2)
    with pytest.raises(UsageError, match="another metasync command is using"):
        Repository.open(a.root, wait=0)
    a.close()
    Repository.open(a.root).close()


def test_metasyncignore_keeps_untracked_paths_out(
    tmp_path: Path, backends: list[Path], passphrase: Callable[[], str]
) -> None:
    """`.metasyncignore` (gitignore syntax, itself synced) keeps matching untracked
    files and folders out of commits; a file tracked before the pattern was added
    stays synchronised, as git does with .gitignore."""
    a = _init(tmp_path, backends, passphrase)
    (a.root / "tracked.log").write_text("tracked before the rule\n")
    a.push("tracked")
    (a.root / ".metasyncignore").write_text("*.log\nbuild/\n!keep.log\n")
    (a.root / "new.log").write_text("ignored\n")
    (a.root / "keep.log").write_text("negated: synced\n")
    (a.root / "build").mkdir()
    (a.root / "build" / "out.bin").write_bytes(b"x")
    (a.root / "tracked.log").write_text("tracked, edited\n")
    a.push("with ignores")
    c = _clone(tmp_path, backends, passphrase, "c")
    names = sorted(p.name for p in c.root.iterdir() if p.name != ".metasync")
    assert names == [".metasyncignore", "doc.txt", "keep.log", "keep.txt", "tracked.log"]
    assert (c.root / "tracked.log").read_text() == "tracked, edited\n"
    assert a.status().clean
