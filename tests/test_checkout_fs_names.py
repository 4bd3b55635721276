"""Names that are one file in this folder but two in history (issue 18, review of
the folder code): ``restore`` on a case-insensitive folder, a name kept on disk in
another Unicode form (NFD, as macOS gives it back) than the index's (NFC), a
case-only rename upstream, and a name not written that could be written now.

In each, the folder never ends up holding two spellings of one name, and the
next push never deletes, re-adds or duplicates what the other client has.
"""

from __future__ import annotations

import os
import unicodedata
from pathlib import Path

from servers.fsimages import fresh_folder
from test_checkout_fs import _master, _not_written, _repo

from conftest import run_cli

NFC = unicodedata.normalize("NFC", "café")
NFD = unicodedata.normalize("NFD", "café")
CLEAN = "Nothing to commit, folder clean"


def _names(folder: Path) -> list[str]:
    return sorted(n for n in os.listdir(folder) if n != ".metasync")


def _case_pair(root: Path) -> None:
    (root / "d").mkdir()
    (root / "d" / "Foo.txt").write_text("upper\n")
    (root / "d" / "foo.txt").write_text("lower\n")


def test_restore_on_a_case_insensitive_folder_writes_one_of_two_names(
        tmp_path: Path, fs_images: dict[str, Path]) -> None:
    """``restore d`` of a tree holding d/Foo.txt and d/foo.txt on exFAT wrote
    foo.txt over the place of Foo.txt (moving Foo.txt aside as a conflict copy),
    and the next push replaced both in master by the copy and foo.txt. Now the
    losing name is said and left out, as a checkout does."""
    a, uris = _repo(tmp_path, _case_pair)
    master = _master(a)
    g = fresh_folder(fs_images["exfat"], "restore")
    run_cli("clone", *uris, str(g), cwd=tmp_path)
    assert _names(g / "d") == ["Foo.txt"]
    restore = run_cli("restore", "d", "--version", "~0", cwd=g, check=False)
    assert restore.returncode == 0 and "Traceback" not in restore.stderr, restore.stderr
    said = _not_written(restore.stderr)
    assert list(said) == ["d/foo.txt"] and "case" in said["d/foo.txt"], restore.stderr
    assert _names(g / "d") == ["Foo.txt"]
    assert (g / "d" / "Foo.txt").read_text() == "upper\n"
    assert run_cli("status", cwd=g).stdout.splitlines()[-1] == CLEAN
    assert "Pushed" not in run_cli("push", cwd=g).stdout
    assert _master(g) == master


def _nfd_clone(tmp_path: Path) -> tuple[Path, Path]:
    """``a`` with café.txt (NFC) pushed, and a clone ``g`` (this file system tells
    Unicode forms apart) in which it was renamed to its NFD spelling, as macOS
    gives it back."""
    a, uris = _repo(tmp_path, lambda root: (root / f"{NFC}.txt").write_text("one\n"))
    g = tmp_path / "g"
    run_cli("clone", *uris, str(g), cwd=tmp_path)
    os.rename(g / f"{NFC}.txt", g / f"{NFD}.txt")
    assert run_cli("status", cwd=g).stdout.splitlines()[-1] == CLEAN
    return a, g


def test_an_upstream_change_replaces_the_nfd_spelling_on_disk(tmp_path: Path) -> None:
    """The pull wrote an NFC café.txt beside the NFD one and the next push sent
    both spellings. Now the one file on disk takes the new content."""
    a, g = _nfd_clone(tmp_path)
    (a / f"{NFC}.txt").write_text("two\n")
    run_cli("push", cwd=a)
    master = _master(a)
    pull = run_cli("pull", cwd=g)
    assert "conflict:" not in pull.stderr and "0 conflict copies" in pull.stdout, pull.stderr
    names = _names(g)
    assert len(names) == 1 and unicodedata.normalize("NFC", names[0]) == f"{NFC}.txt", names
    assert (g / names[0]).read_text() == "two\n"
    assert run_cli("status", cwd=g).stdout.splitlines()[-1] == CLEAN
    assert "Pushed" not in run_cli("push", cwd=g).stdout
    assert _master(g) == master


def test_an_upstream_delete_removes_the_nfd_spelling_on_disk(tmp_path: Path) -> None:
    """The pull said "0 deleted" (it looked for the NFC name) and the next push
    put the file back. Now it is deleted, and the push has nothing to send."""
    a, g = _nfd_clone(tmp_path)
    (a / f"{NFC}.txt").unlink()
    (a / "other.txt").write_text("other\n")
    run_cli("push", cwd=a)
    master = _master(a)
    pull = run_cli("pull", cwd=g)
    assert "1 deleted" in pull.stdout, pull.stdout
    assert _names(g) == ["other.txt"]
    assert "Pushed" not in run_cli("push", cwd=g).stdout
    assert _master(g) == master


def test_a_new_file_in_a_folder_spelled_nfd_on_disk_joins_that_folder(tmp_path: Path) -> None:
    """A file added in a folder whose NFC name is NFD on disk made build_trees two
    folders (café/ twice, in each form). Now the folder is one, under the
    index's spelling."""
    def tree(root: Path) -> None:
        (root / NFC).mkdir()
        (root / NFC / "x.txt").write_text("x\n")

    _, uris = _repo(tmp_path, tree)
    g = tmp_path / "g"
    run_cli("clone", *uris, str(g), cwd=tmp_path)
    os.rename(g / NFC, g / NFD)
    (g / NFD / "new.txt").write_text("new\n")
    run_cli("push", cwd=g)
    _, got = _master(g)
    assert sorted(got) == sorted([NFC, f"{NFC}/x.txt", f"{NFC}/new.txt"]), sorted(got)


def test_a_case_only_rename_upstream_keeps_the_local_edit_in_place(
        tmp_path: Path, fs_images: dict[str, Path]) -> None:
    """foo.txt renamed to Foo.txt upstream while edited on a case-insensitive
    folder: writing Foo.txt found foo.txt and moved it to a conflict copy saying it
    "changed during the pull". Now the edited foo.txt stays, and Foo.txt is said
    as one name with it."""
    a, uris = _repo(tmp_path, lambda root: (root / "foo.txt").write_text("one\n"))
    g = fresh_folder(fs_images["exfat"], "rename")
    run_cli("clone", *uris, str(g), cwd=tmp_path)
    (g / "foo.txt").write_text("edited\n")
    os.rename(a / "foo.txt", a / "Foo.txt")
    run_cli("push", cwd=a)
    pull = run_cli("pull", cwd=g, check=False)
    assert pull.returncode == 0 and "Traceback" not in pull.stderr, pull.stderr
    assert "changed during the pull" not in pull.stderr, pull.stderr
    said = _not_written(pull.stderr)
    assert list(said) == ["Foo.txt"] and "case" in said["Foo.txt"], pull.stderr
    assert _names(g) == ["foo.txt"]
    assert (g / "foo.txt").read_text() == "edited\n"


def test_a_name_not_written_is_written_once_its_clash_is_gone(
        tmp_path: Path, fs_images: dict[str, Path]) -> None:
    """Foo.txt written, foo.txt not (one name here); upstream deletes Foo.txt: the
    pull deleted it but never wrote foo.txt. Now it does."""
    a, uris = _repo(tmp_path, lambda root: (_case_pair(root)))
    g = fresh_folder(fs_images["exfat"], "again")
    run_cli("clone", *uris, str(g), cwd=tmp_path)
    assert _names(g / "d") == ["Foo.txt"]
    (a / "d" / "Foo.txt").unlink()
    run_cli("push", cwd=a)
    master = _master(a)
    pull = run_cli("pull", cwd=g, check=False)
    assert pull.returncode == 0 and "Traceback" not in pull.stderr, pull.stderr
    assert not _not_written(pull.stderr), pull.stderr
    assert os.listdir(g / "d") == ["foo.txt"]
    assert (g / "d" / "foo.txt").read_text() == "lower\n"
    assert run_cli("status", cwd=g).stdout.splitlines()[-1] == CLEAN
    assert "Pushed" not in run_cli("push", cwd=g).stdout
    assert _master(g) == master


def test_restore_writes_a_file_under_its_nfd_spelling_on_disk(tmp_path: Path) -> None:
    """``restore`` of café.txt (NFC in history) whose name is NFD on disk wrote an
    NFC twin beside it; now the file on disk is restored (an edit there kept as a
    conflict copy, as anywhere)."""
    a, g = _nfd_clone(tmp_path)
    master = _master(a)
    (g / f"{NFD}.txt").write_text("edited\n")
    restore = run_cli("restore", f"{NFC}.txt", "--version", "~0", cwd=g, check=False)
    assert restore.returncode == 0 and "Traceback" not in restore.stderr, restore.stderr
    assert not _not_written(restore.stderr), restore.stderr
    names = _names(g)
    assert f"{NFD}.txt" in names and f"{NFC}.txt" not in names, names
    assert (g / f"{NFD}.txt").read_text() == "one\n"
    (copy,) = (n for n in names if n != f"{NFD}.txt")
    assert "conflict" in copy
    (g / copy).unlink()
    assert run_cli("status", cwd=g).stdout.splitlines()[-1] == CLEAN
    assert _master(g) == master


def test_a_case_only_rename_upstream_of_an_unchanged_file_renames_it_here(
        tmp_path: Path, fs_images: dict[str, Path]) -> None:
    """The same rename of a file not edited here: the old name is deleted and the
    new one written (nothing kept, nothing said), and the push has nothing to send."""
    a, uris = _repo(tmp_path, lambda root: (root / "foo.txt").write_text("one\n"))
    g = fresh_folder(fs_images["exfat"], "rename")
    run_cli("clone", *uris, str(g), cwd=tmp_path)
    os.rename(a / "foo.txt", a / "Foo.txt")
    run_cli("push", cwd=a)
    master = _master(a)
    pull = run_cli("pull", cwd=g, check=False)
    assert pull.returncode == 0 and not pull.stderr, pull.stderr
    assert _names(g) == ["Foo.txt"]
    assert run_cli("status", cwd=g).stdout.splitlines()[-1] == CLEAN
    assert "Pushed" not in run_cli("push", cwd=g).stdout
    assert _master(g) == master


def test_restore_under_a_folder_that_is_another_name_here_writes_nothing(
        tmp_path: Path, fs_images: dict[str, Path]) -> None:
    """History holds Dir/f and dir/f; on exFAT the clone writes Dir/ and says dir/f.
    ``restore dir/f`` wrote into Dir/f (the folder lookup ignores case), and the
    next push sent dir/f's content as a change of Dir/f. Now the folders above a
    restored path are placed as the disk spells them: dir/ is one name with Dir/
    here, so nothing is written and it is said."""
    def tree(root: Path) -> None:
        for folder, text in (("Dir", "upper\n"), ("dir", "lower\n")):
            (root / folder).mkdir()
            (root / folder / "f").write_text(text)
    a, uris = _repo(tmp_path, tree)
    master = _master(a)
    g = fresh_folder(fs_images["exfat"], "restore-above")
    run_cli("clone", *uris, str(g), cwd=tmp_path)
    assert _names(g) == ["Dir"]
    restore = run_cli("restore", "dir/f", "--version", "~0", cwd=g, check=False)
    assert restore.returncode == 0 and "Traceback" not in restore.stderr, restore.stderr
    said = _not_written(restore.stderr)
    assert list(said) == ["dir/f"] and "case" in said["dir/f"], restore.stderr
    assert (g / "Dir" / "f").read_text() == "upper\n"
    assert "Pushed" not in run_cli("push", cwd=g).stdout
    assert _master(g) == master
