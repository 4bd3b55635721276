"""No write through a symbolic link (issue 16, scenario 5): whatever creates,
renames or deletes files in the folder from history -- ``restore``, a checkout
(``pull``, ``clone``), conflict copies -- opens every parent folder without
following a link, so a link that history (or a local change) puts in the place of
a folder never sends a write outside the repository's folder."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from conftest import make_tree, run_cli, snapshot
from metasync import Repository, worktree
from metasync.progress import NullReporter
from metasync.scanner import ScanResult
from metasync.worktree import Folders


def _init(tmp_path: Path, backends: list[Path], passphrase: Callable[[], str],
          files: dict[str, str]) -> Repository:
    src = tmp_path / "attacker"
    for rel, text in files.items():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_text(text)
    repo = Repository.init(src, [f"dir:{b}" for b in backends], passphrase=passphrase)
    repo.push("first")
    return repo


def _outside(tmp_path: Path) -> Path:
    """A folder outside every repository, standing for the victim's ``~/.ssh``."""
    outside = tmp_path / "outside-ssh"
    outside.mkdir()
    (outside / "authorized_keys").write_text("the victim's own key\n")
    (outside / "f.txt").write_text("outside, not the repository's\n")
    return outside


def test_restore_does_not_write_through_a_parent_link(
    tmp_path: Path, backends: list[Path], passphrase: Callable[[], str]
) -> None:
    """The issue's scenario: version 1 has docs/sub/authorized_keys, version 2 makes
    docs/sub a link to a folder outside; `metasync restore docs --version ~1`
    writes nothing outside (not the file, not a conflict copy of the victim's own
    file there): the link, which version 2 holds, is replaced by the folder."""
    outside = _outside(tmp_path)
    before = snapshot(outside)
    attacker = _init(tmp_path, backends, passphrase,
                     {"docs/sub/authorized_keys": "ssh-ed25519 ATTACKER\n", "docs/readme": "hi\n"})
    victim = Repository.clone(f"dir:{backends[0]}", tmp_path / "victim", passphrase=passphrase)
    victim.close()
    for child in (attacker.root / "docs" / "sub").iterdir():
        child.unlink()
    (attacker.root / "docs" / "sub").rmdir()
    os.symlink(outside, attacker.root / "docs" / "sub")
    attacker.push("docs/sub is now a link")
    attacker.close()
    run_cli("pull", cwd=tmp_path / "victim")
    assert (tmp_path / "victim" / "docs" / "sub").is_symlink()

    run_cli("restore", "docs", "--version", "~1", cwd=tmp_path / "victim")

    assert snapshot(outside) == before
    sub = tmp_path / "victim" / "docs" / "sub"
    assert not sub.is_symlink() and sub.is_dir()
    assert (sub / "authorized_keys").read_text() == "ssh-ed25519 ATTACKER\n"


def test_restore_of_one_file_under_a_parent_link(
    tmp_path: Path, backends: list[Path], passphrase: Callable[[], str]
) -> None:
    """Restoring the one file, not its folder: the same link in its path is not
    followed either."""
    outside = _outside(tmp_path)
    before = snapshot(outside)
    repo = _init(tmp_path, backends, passphrase, {"docs/sub/authorized_keys": "ATTACKER\n"})
    (repo.root / "docs" / "sub" / "authorized_keys").unlink()
    (repo.root / "docs" / "sub").rmdir()
    os.symlink(outside, repo.root / "docs" / "sub")
    repo.push("link")
    repo.restore("docs/sub/authorized_keys", "~1")
    assert snapshot(outside) == before
    assert (repo.root / "docs" / "sub" / "authorized_keys").read_text() == "ATTACKER\n"
    assert not (repo.root / "docs" / "sub").is_symlink()


def test_restore_where_the_file_itself_is_a_link_outside(
    tmp_path: Path, backends: list[Path], passphrase: Callable[[], str]
) -> None:
    """A file that a later version made a link to a file outside: restoring it
    replaces the link, never the file it points to."""
    outside = _outside(tmp_path)
    before = snapshot(outside)
    repo = _init(tmp_path, backends, passphrase, {"docs/authorized_keys": "ATTACKER\n"})
    (repo.root / "docs" / "authorized_keys").unlink()
    os.symlink(outside / "authorized_keys", repo.root / "docs" / "authorized_keys")
    repo.push("link")
    result = repo.restore("docs/authorized_keys", "~1")
    assert result.conflicts == []  # the link is in version 2: replacing it loses nothing
    assert snapshot(outside) == before
    assert not (repo.root / "docs" / "authorized_keys").is_symlink()
    assert (repo.root / "docs" / "authorized_keys").read_text() == "ATTACKER\n"


def test_restore_keeps_a_local_parent_link_as_a_conflict_copy(
    tmp_path: Path, backends: list[Path], passphrase: Callable[[], str]
) -> None:
    """A link in the way that no version holds (made here, not pushed) is a local
    change: it is kept under a conflict name, and nothing is written through it."""
    outside = _outside(tmp_path)
    before = snapshot(outside)
    repo = _init(tmp_path, backends, passphrase, {"docs/sub/f.txt": "from history\n"})
    (repo.root / "docs" / "sub" / "f.txt").unlink()
    (repo.root / "docs" / "sub").rmdir()
    os.symlink(outside, repo.root / "docs" / "sub")
    result = repo.restore("docs", "~0")
    assert snapshot(outside) == before
    assert (repo.root / "docs" / "sub" / "f.txt").read_text() == "from history\n"
    [copy] = result.conflicts
    assert Path(copy).is_symlink() and os.readlink(copy) == str(outside)
    assert Path(copy).parent == repo.root / "docs"


def test_pull_of_a_folder_that_history_turned_into_a_link_and_back(
    tmp_path: Path, backends: list[Path], passphrase: Callable[[], str]
) -> None:
    """History makes docs/sub a link to a folder outside, then a folder again with a
    file in it: the pull replaces the link (unchanged here) by a real folder and
    writes nothing through it. (This passed before the fix too: it is the switch
    the issue says pull handles safely, kept safe.)"""
    outside = _outside(tmp_path)
    before = snapshot(outside)
    a = _init(tmp_path, backends, passphrase, {"docs/sub/f.txt": "v1\n"})
    b = Repository.clone(f"dir:{backends[0]}", tmp_path / "b", passphrase=passphrase)
    (a.root / "docs" / "sub" / "f.txt").unlink()
    (a.root / "docs" / "sub").rmdir()
    os.symlink(outside, a.root / "docs" / "sub")
    a.push("link")
    b.pull()
    assert (b.root / "docs" / "sub").is_symlink()
    (a.root / "docs" / "sub").unlink()
    (a.root / "docs" / "sub").mkdir()
    (a.root / "docs" / "sub" / "authorized_keys").write_text("ATTACKER\n")
    a.push("folder again")
    result = b.pull()
    assert result.conflicts == []
    assert snapshot(outside) == before
    assert not (b.root / "docs" / "sub").is_symlink()
    assert (b.root / "docs" / "sub" / "authorized_keys").read_text() == "ATTACKER\n"


class LinkAtDownload(NullReporter):
    """At the moment a pull starts downloading (after it planned and made its
    folders), moves the folder ``sub`` aside and puts a link to ``outside`` in its
    place: a local change racing the pull."""

    def __init__(self, sub: Path, outside: Path) -> None:
        super().__init__()
        self.sub, self.outside = sub, outside

    def start(self, label: str, total: int) -> None:
        if label == "download":
            self.sub.rename(self.sub.with_name("moved-away"))
            os.symlink(self.outside, self.sub)


def test_pull_does_not_write_through_a_link_made_during_the_pull(
    tmp_path: Path, backends: list[Path], passphrase: Callable[[], str]
) -> None:
    """A folder replaced by a link after the pull made sure it was a folder: the
    download goes into the folder it checked (moved, still inside the repository),
    never through the link."""
    outside = _outside(tmp_path)
    before = snapshot(outside)
    a = _init(tmp_path, backends, passphrase, {"docs/sub/f.txt": "v1\n"})
    b = Repository.clone(f"dir:{backends[0]}", tmp_path / "b", passphrase=passphrase)
    (a.root / "docs" / "sub" / "f.txt").write_text("v2\n")
    a.push("v2")
    b.reporter = LinkAtDownload(b.root / "docs" / "sub", outside)
    b.pull()
    assert snapshot(outside) == before
    assert (b.root / "docs" / "sub").is_symlink()  # the local change stays
    assert (b.root / "docs" / "moved-away" / "f.txt").read_text() == "v2\n"


def test_conflict_copy_is_not_made_through_a_link(
    tmp_path: Path, backends: list[Path], passphrase: Callable[[], str]
) -> None:
    """A file edited here and remotely becomes a conflict copy; when its folder is
    replaced by a link after the pull scanned (so the pull still plans the copy),
    the copy is not made through the link (it would rename the file the link points
    to): the link is kept as a conflict copy of its own and the folder is made."""
    outside = _outside(tmp_path)
    before = snapshot(outside)
    a = _init(tmp_path, backends, passphrase, {"docs/sub/f.txt": "v1\n"})
    b = Repository.clone(f"dir:{backends[0]}", tmp_path / "b", passphrase=passphrase)
    (a.root / "docs" / "sub" / "f.txt").write_text("remote v2\n")
    a.push("v2")
    (b.root / "docs" / "sub" / "f.txt").write_text("local edit\n")
    sub = b.root / "docs" / "sub"
    real_scan = b.scanner.scan

    def scan_then_link(*args: object, **kwargs: object) -> ScanResult:
        result = real_scan(*args, **kwargs)  # type: ignore[arg-type]
        if sub.is_dir() and not sub.is_symlink():
            sub.rename(sub.with_name("moved-away"))
            os.symlink(outside, sub)
        return result

    b.scanner.scan = scan_then_link  # type: ignore[method-assign]
    result = b.pull()
    assert snapshot(outside) == before
    assert (sub / "f.txt").read_text() == "remote v2\n"
    assert not sub.is_symlink()
    assert (b.root / "docs" / "moved-away" / "f.txt").read_text() == "local edit\n"
    links = [c for c in result.conflicts if (b.root / c).is_symlink()]
    assert len(links) == 1 and os.readlink(b.root / links[0]) == str(outside)


# ----------------------------------------------------------------------------- Folders


def test_folders_never_follow_a_link(tmp_path: Path) -> None:
    """``open`` gives None for a path through a link or a file; ``make`` hands the
    link to ``in_the_way`` and makes a real folder; neither touches the target."""
    outside = _outside(tmp_path)
    root = tmp_path / "root"
    (root / "a").mkdir(parents=True)
    os.symlink(outside, root / "a" / "link")
    (root / "a" / "file").write_text("x")
    seen: list[str] = []

    def in_the_way(fd: int, name: str, path: str) -> None:
        seen.append(path)
        os.rename(name, name + ".aside", src_dir_fd=fd, dst_dir_fd=fd)

    with Folders(root) as folders:
        assert folders.open("a/link") is None
        assert folders.open("a/link/deeper") is None
        assert folders.open("a/file") is None
        assert folders.open("missing") is None
        fd = folders.make("a/link/deeper", in_the_way)
        os.close(os.open("made", os.O_WRONLY | os.O_CREAT, 0o600, dir_fd=fd))
        folders.release(fd)
    assert seen == ["a/link"]
    assert (root / "a" / "link").is_dir() and not (root / "a" / "link").is_symlink()
    assert (root / "a" / "link" / "deeper" / "made").is_file()
    assert os.readlink(root / "a" / "link.aside") == str(outside)
    assert sorted(p.name for p in outside.iterdir()) == ["authorized_keys", "f.txt"]


def test_folders_cache_is_bounded_and_keeps_pinned_folders(tmp_path: Path) -> None:
    """At most ``capacity`` folders stay open besides those in use; a folder in use
    is never closed under its user, and one forgotten while in use is closed at its
    release."""
    root = tmp_path / "root"
    for i in range(6):
        (root / f"d{i}").mkdir(parents=True)
    with Folders(root, capacity=3) as folders:
        held = folders.open("d0")
        assert held is not None
        for i in range(1, 6):
            fd = folders.open(f"d{i}")
            assert fd is not None
            folders.release(fd)
        assert os.fstat(held).st_ino == os.stat(root / "d0").st_ino  # still open, still d0
        assert len(_open_under(root)) <= 3 + 1  # the cache, and the one in use
        folders.forget("d0")
        assert os.fstat(held).st_ino == os.stat(root / "d0").st_ino
        folders.release(held)
        assert str(root / "d0") not in _open_under(root)


def _open_under(root: Path) -> list[str]:
    """The folders under ``root`` this process has open (Linux's /proc)."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # the listing's own descriptor, closed by now
        if target.startswith(f"{root}/"):
            out.append(target)
    return out


def test_checkout_with_few_open_folders(
    tmp_path: Path, backends: list[Path], passphrase: Callable[[], str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A checkout over more folders than may stay open (folders closed and opened
    again between writing a temporary file and renaming it) writes the same tree."""
    monkeypatch.setattr(worktree, "FOLDER_FDS", 2)
    src = tmp_path / "src"
    make_tree(src, small_files=150)
    repo = Repository.init(src, [f"dir:{b}" for b in backends], passphrase=passphrase)
    repo.push("first")
    clone = Repository.clone(f"dir:{backends[0]}", tmp_path / "clone", passphrase=passphrase)
    assert snapshot(clone.root) == snapshot(src)
    restored = clone.restore("small", "~0", to=tmp_path / "restored")
    assert len(restored.restored) == 150
    assert snapshot(tmp_path / "restored") == snapshot(src / "small")


def test_stale_temporary_files_are_removed_without_following_links(tmp_path: Path) -> None:
    """The clean-up after a crash removes our temporary files and links (a temporary
    link to a folder too) and never walks through a link into a folder outside."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / f"{worktree.TEMP_PREFIX}victim").write_text("not ours to delete\n")
    root = tmp_path / "root"
    (root / "sub").mkdir(parents=True)
    os.symlink(outside, root / "sub" / "link")
    os.symlink(outside, root / "sub" / f"{worktree.TEMP_PREFIX}dirlink")
    (root / f"{worktree.TEMP_PREFIX}file").write_text("partial\n")
    assert worktree.remove_stale_temps(root) == 2
    assert sorted(os.listdir(root / "sub")) == ["link"]
    assert (outside / f"{worktree.TEMP_PREFIX}victim").exists()
