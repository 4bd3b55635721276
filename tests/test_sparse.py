"""Selective sync per machine (`metasync sparse`, docs/sparse.md): a clone whose
selection leaves out ``photos/`` never writes a file there, never takes what it does
not have for deleted, and never alters ``photos/`` in master; widening fetches
exactly what was left out; narrowing removes a file only once it is safe in master."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from conftest import one_line_error, run_cli, snapshot
from metasync import Repository
from metasync.errors import UsageError
from metasync.selection import Selection

NO_PHOTOS = ["/*", "!/photos/"]


def _files(root: Path) -> set[str]:
    """Every file under ``root`` (relative, ``.metasync`` left out)."""
    out = set()
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d != ".metasync"]
        rel = Path(dirpath).relative_to(root)
        out |= {(rel / f).as_posix() for f in filenames}
    return out


def _under(entries: dict[str, object], prefix: str = "photos") -> dict[str, object]:
    return {p: e for p, e in entries.items() if p == prefix or p.startswith(prefix + "/")}


def _master_photos(repo: Repository) -> dict[str, tuple[str, str]]:
    """``photos/`` of the newest master, as (type, ref) by path."""
    master = repo.learn_latest().master
    assert master is not None
    return {p: (e.type, e.ref) for p, e in _under(repo.tree_at(master)).items()}  # type: ignore[attr-defined]


def _write(root: Path, rel: str, text: str) -> None:
    (root / rel).parent.mkdir(parents=True, exist_ok=True)
    (root / rel).write_text(text)


def test_sparse_clone_never_writes_or_alters_photos(
        tmp_path: Path, backends: list[Path], passphrase: Callable[[], str]) -> None:
    """Done-when: the full clone ``a`` adds, edits and deletes inside and outside
    ``photos/``, pushing several times; the sparse clone ``b`` pulls, and pushes its
    own edits (also merging with ``a``'s concurrent ones): it never has a file under
    ``photos/``, its pushes leave master's ``photos/`` exactly as ``a`` made it, and a
    fresh full clone has every change. Widening writes exactly the missing files."""
    src = tmp_path / "a"
    for rel in ("top.txt", "docs/a.txt", "photos/p1.jpg", "photos/sub/p2.jpg"):
        _write(src, rel, f"{rel} v1\n")
    (src / "photos" / "empty").mkdir()
    a = Repository.init(src, [f"dir:{d}" for d in backends], passphrase=passphrase)
    a.push("first")
    b = Repository.clone(f"dir:{backends[0]}", tmp_path / "b", passphrase=passphrase)
    change = b.sparse.set(NO_PHOTOS)
    assert sorted(change.removed) == ["photos/p1.jpg", "photos/sub/p2.jpg"]
    assert b.sparse.patterns() == NO_PHOTOS
    assert not (b.root / "photos").exists()
    assert b.status().changes == []

    rounds: list[Callable[[], None]] = [
        lambda: (_write(src, "photos/new.jpg", "new\n"), _write(src, "photos/p1.jpg", "p1 v2\n"),
                 _write(src, "docs/a.txt", "a v2\n")),
        lambda: ((src / "photos/sub/p2.jpg").unlink(), (src / "docs/a.txt").unlink(),
                 _write(src, "photos/sub/p3.jpg", "p3\n")),
        lambda: (_write(src, "photos/new.jpg", "new v2\n"), _write(src, "docs/c.txt", "c\n")),
    ]
    for i, edit in enumerate(rounds):
        edit()
        a.push(f"a {i}")
        expected = _master_photos(a)
        # b pushes its own edits on top of a's change before pulling: a merge.
        _write(b.root, "top.txt", f"top from b {i}\n")
        _write(b.root, f"docs/b{i}.txt", f"b {i}\n")
        b.push(f"b {i}")
        assert _master_photos(b) == expected, f"round {i}: b's push altered photos/"
        b.pull()
        assert not [f for f in _files(b.root) if f.startswith("photos/")], f"round {i}"
        assert b.status().changes == [], f"round {i}"
        # The daemon's mass-deletion guard measures against what is here only.
        assert b.tracked_files() == len(_files(b.root)), f"round {i}"
        a.pull()
        assert _master_photos(a) == expected
    # b's own edits outside photos/ once more, after a pull (no merge needed).
    _write(b.root, "docs/late.txt", "late\n")
    b.push("late")
    assert _master_photos(b) == expected
    assert not (b.root / "photos").exists()

    a.pull()
    c = Repository.clone(f"dir:{backends[1]}", tmp_path / "c", passphrase=passphrase)
    assert snapshot(c.root) == snapshot(a.root)
    assert (c.root / "photos/new.jpg").read_text() == "new v2\n"
    assert not (c.root / "photos/sub/p2.jpg").exists()

    # Widening writes exactly the files b was missing, and touches nothing else.
    before = {f: os.stat(b.root / f).st_ino for f in _files(b.root)}
    change = b.sparse.off()
    assert sorted(change.written) == sorted(f for f in _files(c.root) if f.startswith("photos/"))
    assert {f: os.stat(b.root / f).st_ino for f in before} == before
    assert b.sparse.patterns() == []
    assert snapshot(b.root) == snapshot(c.root)
    assert b.status().changes == []


def test_narrowing_refuses_while_an_edit_is_not_in_master(
        tmp_path: Path, backends: list[Path], passphrase: Callable[[], str]) -> None:
    """An unpushed edit (or new file) under a path leaving the selection: refused,
    naming the path and the fix, and nothing changes; once pushed, the narrowing
    goes through."""
    src = tmp_path / "a"
    _write(src, "top.txt", "top\n")
    _write(src, "photos/p1.jpg", "p1\n")
    a = Repository.init(src, [f"dir:{d}" for d in backends], passphrase=passphrase)
    a.push("first")
    (src / "photos/p1.jpg").write_text("edited, not pushed\n")
    _write(src, "photos/new.jpg", "new, not pushed\n")
    a.commit("committed, not pushed")  # a local commit is not master either
    (src / "photos/folder").mkdir()  # an empty folder is content too
    with pytest.raises(UsageError) as info:
        a.sparse.set(NO_PHOTOS)
    message = str(info.value)
    assert "\n" not in message and "photos/new.jpg" in message and "push" in message
    assert (src / "photos/p1.jpg").read_text() == "edited, not pushed\n"
    assert (src / "photos/new.jpg").read_text() == "new, not pushed\n"
    assert (src / "photos/folder").is_dir() and "photos/folder/" in message
    assert a.sparse.patterns() == []
    a.push("now pushed")
    # A deletion here, not committed, under what leaves: the file stays in the
    # repository as the last commit has it (taken back in by the widening).
    (src / "photos/new.jpg").unlink()
    a.sparse.set(NO_PHOTOS)
    assert _files(src) == {"top.txt"}
    assert a.status().changes == [] and a.sparse.outside_count() == 2
    a.sparse.add(["/photos/"])
    assert (src / "photos/new.jpg").read_text() == "new, not pushed\n"
    assert (src / "photos/p1.jpg").read_text() == "edited, not pushed\n"
    assert (src / "photos/folder").is_dir()
    assert a.sparse.patterns() == [*NO_PHOTOS, "/photos/"]


def test_cli_sparse(tmp_path: Path, backends: list[Path]) -> None:
    """`metasync sparse set/add/list/off`, the refusal as one line, and what status
    and log say of paths outside the selection."""
    src = tmp_path / "src"
    _write(src, "top.txt", "top\n")
    _write(src, "photos/p1.jpg", "p1\n")
    run_cli("init", str(src), *[a for d in backends for a in ("--backend", f"dir:{d}")])
    run_cli("push", cwd=src)
    (src / "photos/p1.jpg").write_text("edited\n")
    one_line_error(run_cli("sparse", "set", "/*", "!/photos/", cwd=src, check=False),
                   "photos/p1.jpg", "push")
    assert (src / "photos/p1.jpg").read_text() == "edited\n"
    assert run_cli("sparse", "list", cwd=src).stdout.strip() == ""
    run_cli("push", cwd=src)
    out = run_cli("sparse", "set", "/*", "!/photos/", cwd=src).stdout
    assert "1 file removed" in out
    assert not (src / "photos").exists()
    assert run_cli("sparse", "list", cwd=src).stdout.split() == ["/*", "!/photos/"]
    status = run_cli("status", cwd=src).stdout
    assert "sparse: 2 patterns, 1 path not checked out here" in status
    doc = json.loads(run_cli("status", "--json", cwd=src).stdout)
    assert doc["sparse"] == {"patterns": ["/*", "!/photos/"], "outside": 1}
    log = run_cli("log", "--json", cwd=src).stdout
    assert any(e.get("outside_selection") for e in json.loads(log))
    assert "outside this machine's selection" in run_cli("log", cwd=src).stdout
    one_line_error(run_cli("sparse", "set", cwd=src, check=False), "pattern")
    run_cli("sparse", "add", "/photos/", cwd=src)
    assert (src / "photos/p1.jpg").read_text() == "edited\n"
    run_cli("sparse", "off", cwd=src)
    assert run_cli("sparse", "list", cwd=src).stdout.strip() == ""


def test_daemon_honours_the_selection(tmp_path: Path) -> None:
    """A clone made with ``--sparse`` never writes ``photos/``; a daemon there
    pulls changes made inside and outside
    ``photos/`` without writing ``photos/``, and pushes its user's edits without
    deleting or altering ``photos/`` in master."""
    from test_daemon_sync import Daemons, _status

    from conftest import wait_until

    backends = [tmp_path / f"backend{i}" for i in range(3)]
    for d in backends:
        d.mkdir()
    a, b = tmp_path / "A", tmp_path / "B"
    _write(a, "top.txt", "top\n")
    _write(a, "photos/p1.jpg", "p1\n")
    _write(a, "photos/p2.jpg", "p2\n")
    run_cli("init", str(a), *(f"--backend=dir:{x}" for x in backends))
    run_cli("push", cwd=a)
    # Cloned sparse: photos/ is never written here, not even by the first checkout.
    run_cli("clone", f"dir:{backends[1]}", str(b), "--sparse", "!/photos/")
    assert _files(b) == {"top.txt"} and not (b / "photos").exists()
    assert run_cli("sparse", "list", cwd=b).stdout.split() == ["!/photos/"]
    daemons = Daemons(tmp_path)
    daemon = daemons.start(b)
    try:
        (a / "photos/p1.jpg").write_text("p1 v2\n")
        (a / "photos/p2.jpg").unlink()
        _write(a, "photos/p3.jpg", "p3\n")
        _write(a, "docs/d.txt", "d\n")
        run_cli("push", cwd=a)
        wait_until(lambda: (b / "docs/d.txt").exists() and _status(b).get("state") == "idle",
                   60, "B's daemon pulled A's push", daemon.output)
        _write(b, "docs/from-b.txt", "from b\n")
        (b / "top.txt").write_text("top from b\n")

        def a_has_bs_edit() -> bool:
            run_cli("pull", cwd=a)
            return (a / "docs/from-b.txt").exists() and (a / "top.txt").read_text() == "top from b\n"

        wait_until(a_has_bs_edit, 60, "B's daemon pushed its edits", daemon.output)
        assert not [f for f in _files(b) if f.startswith("photos")]
        assert not (b / "photos").exists()
    finally:
        daemons.stop(daemon)
    assert {f: (a / f).read_text() for f in _files(a) if f.startswith("photos/")} == {
        "photos/p1.jpg": "p1 v2\n", "photos/p3.jpg": "p3\n"}


@pytest.mark.parametrize(("patterns", "selected", "outside"), [
    (["!/photos/"], ["top.txt", "docs/a.txt", "x/photos/p.jpg"], ["photos/p.jpg", "photos/s/q.jpg"]),
    (["/*", "!/photos/", "/photos/2024/"], ["top.txt", "photos/2024/p.jpg"],
     ["photos/2023/p.jpg", "photos/p.jpg"]),
    (["photos/"], ["photos/p.jpg", "x/photos/p.jpg"], ["top.txt", "x/p.jpg"]),
    (["/*", "!*.iso"], ["a.txt", "d/b.txt"], ["a.iso", "d/e/b.iso"]),
    (["!/photos/", "/photos/2024/"], ["top.txt", "photos/2024/p.jpg"], ["photos/p.jpg"]),
])
def test_selection_semantics(patterns: list[str], selected: list[str], outside: list[str]) -> None:
    """The rules docs/sparse.md states: gitignore patterns of what is here, the last
    match decides, a first negation starts from everything."""
    from metasync.selection import Selection, check_patterns

    s = Selection(check_patterns(patterns))
    assert [p for p in selected if not s.selects(p)] == []
    assert [p for p in outside if s.selects(p)] == []


@pytest.mark.parametrize("bad", [[], [""], ["# a comment"], ["!"]])
def test_selection_refuses_what_is_not_a_pattern(bad: list[str]) -> None:
    from metasync.selection import check_patterns

    with pytest.raises(UsageError):
        check_patterns(bad)


def test_folder_deleted_elsewhere_outside_the_selection(
        tmp_path: Path, backends: list[Path], passphrase: Callable[[], str]) -> None:
    """Another machine deletes the whole folder outside the selection: the sparse
    clone records it (nothing left of it in its commits) and re-selecting finds
    nothing to fetch; a folder re-included inside an excluded one is made."""
    src = tmp_path / "a"
    for rel in ("top.txt", "photos/2024/p.jpg", "photos/old/q.jpg", "photos/r.jpg"):
        _write(src, rel, f"{rel}\n")
    a = Repository.init(src, [f"dir:{d}" for d in backends], passphrase=passphrase)
    a.push("first")
    b = Repository.clone(f"dir:{backends[0]}", tmp_path / "b", passphrase=passphrase,
                         sparse=["/*", "!/photos/", "/photos/2024/"])
    assert _files(b.root) == {"top.txt", "photos/2024/p.jpg"}
    assert b.sparse.outside_count() == 2
    import shutil
    shutil.rmtree(src / "photos")
    a.push("photos gone")
    b.pull()
    assert _files(b.root) == {"top.txt"} and b.sparse.outside_count() == 0
    _write(b.root, "top.txt", "b\n")
    b.push("b")
    assert not _under(b.tree_at(b.prev.master))
    assert b.sparse.off().written == []
    assert b.status().changes == []


def test_merge_takes_theirs_outside_the_selection() -> None:
    """Where both sides differ from the base on a path outside the merging machine's
    selection (its side can only be an older master's), master's version is taken
    and no conflict copy is made; inside the selection the usual rules hold."""
    from metasync.merge import Side, merge_trees
    from metasync.objects import TreeEntry

    def f(name: str, ref: str) -> TreeEntry:
        return TreeEntry(name, "file", ref * 64, 1)

    base = {"photos": TreeEntry("photos", "dir", "0" * 64), "photos/a.jpg": f("a.jpg", "1"),
            "top.txt": f("top.txt", "1")}
    ours = {**base, "photos/a.jpg": f("a.jpg", "2"), "top.txt": f("top.txt", "2")}
    theirs = {**base, "photos/a.jpg": f("a.jpg", "3"), "top.txt": f("top.txt", "3")}
    sel = Selection(["!/photos/"])
    merged, conflicts = merge_trees(base, Side(ours, "b", "s"), Side(theirs, "a", "s"),
                                    lambda p, d: not sel.selects(p, d))
    assert merged["photos/a.jpg"].ref == "3" * 64
    assert [c.path for c in conflicts] == ["top.txt"]


def test_folder_taken_in_then_deleted_here_leaves_the_tree(
        tmp_path: Path, backends: list[Path], passphrase: Callable[[], str]) -> None:
    """A folder that was here only as the parent of a re-included folder, taken in by
    `sparse off` (nothing to download), then deleted here: the push deletes it (its
    old OUTSIDE row must not keep it in the tree)."""
    src = tmp_path / "a"
    _write(src, "top.txt", "top\n")
    _write(src, "photos/2024/p.jpg", "p\n")
    a = Repository.init(src, [f"dir:{d}" for d in backends], passphrase=passphrase)
    a.push("first")
    b = Repository.clone(f"dir:{backends[0]}", tmp_path / "b", passphrase=passphrase,
                         sparse=["/*", "!/photos/", "/photos/2024/"])
    assert _files(b.root) == {"top.txt", "photos/2024/p.jpg"}
    assert b.sparse.off().written == []
    import shutil
    shutil.rmtree(b.root / "photos")
    b.push("photos deleted here")
    assert not _under(b.tree_at(b.prev.master))


def test_narrowing_on_fat_keeps_a_same_size_edit_made_in_the_same_tick(
        tmp_path: Path, backends: list[Path], passphrase: Callable[[], str],
        monkeypatch: pytest.MonkeyPatch, fs_images: dict[str, Path]) -> None:
    """FAT keeps mtimes to 2 s: a file leaving the selection that the user rewrites
    with as many bytes between the narrowing's scan and its removal, within the
    tick, keeps the size, mtime and inode the scan saw. The narrowing compares such
    a file's content with the scan's before removing it: the user's version stays,
    and is said to."""
    from metasync.sparse import Sparse
    from tests.servers.fsimages import fresh_folder, rewrite_within_the_tick

    src = fresh_folder(fs_images["fat"], "sparse") / "a"
    _write(src, "top.txt", "top\n")
    _write(src, "photos/p1.jpg", "photo one\n")
    _write(src, "photos/p2.jpg", "photo two\n")
    a = Repository.init(src, [f"dir:{d}" for d in backends], passphrase=passphrase)
    a.push("first")
    remove = Sparse._remove
    edited = src / "photos/p1.jpg"
    mine = "PHOTO ONE\n"  # as many bytes

    def edit_then_remove(self: Sparse, *args: object) -> None:
        rewrite_within_the_tick(edited, mine)
        remove(self, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(Sparse, "_remove", edit_then_remove)
    change = a.sparse.set(NO_PHOTOS)
    assert edited.read_text() == mine, "the user's edit went with the narrowing"
    assert change.kept == ["photos/p1.jpg"] and change.removed == ["photos/p2.jpg"]
    a.close()
