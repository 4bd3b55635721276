"""Checking out into a folder on a file system that cannot hold everything
(issue 18, "the folder itself"): exFAT, FAT32 and NTFS images mounted with FUSE
(tests/servers/fsimages.py), a case-insensitive folder, a lowered RLIMIT_FSIZE.

What the folder cannot hold -- a symbolic link, an exec bit, a name it refuses,
two names that differ only in case or in Unicode normal form, a file too large
-- is said per path (``cannot be written here: PATH: WHY``), kept in history as
it is, and never turned into a deletion or a change by this machine's next push
(docs/design.md, "File names" and "Folders that cannot hold everything").

The backends are ``dir:`` folders in the normal temporary folder; only the work
trees are on the images.
"""

from __future__ import annotations

import os
import subprocess
import unicodedata
from collections.abc import Callable
from pathlib import Path

import pytest
from servers.fsimages import fresh_folder

from conftest import (
    EDGE_CASE_HARD_NAMES,
    METASYNC,
    PASSPHRASE,
    make_edge_case_tree,
    run_cli,
    snapshot,
)
from metasync.fstraits import FolderTraits, probe_traits
from metasync.repository import Repository

NOT_WRITTEN = "cannot be written here: "
NFD = unicodedata.normalize("NFD", "née.txt")
NFC = unicodedata.normalize("NFC", "née.txt")


def _repo(tmp_path: Path, make: Callable[[Path], object]) -> tuple[Path, list[str]]:
    """A folder ``tmp_path/a`` made by ``make(folder)`` and pushed to two ``dir:``
    backends; its folder and the clone arguments for the backends."""
    for b in ("b1", "b2"):
        (tmp_path / b).mkdir()
    uris = [f"dir:{tmp_path / 'b1'}", "--backend", f"dir:{tmp_path / 'b2'}"]
    folder = tmp_path / "a"
    folder.mkdir()
    make(folder)
    run_cli("init", "--backend", uris[0], "--backend", uris[2], cwd=folder)
    run_cli("push", cwd=folder)
    return folder, uris


def _not_written(stderr: str) -> dict[str, str]:
    """The paths a command said it cannot write here, with why."""
    out = {}
    for line in stderr.splitlines():
        if line.startswith(NOT_WRITTEN):
            path, _, why = line[len(NOT_WRITTEN):].partition(": ")
            out[path] = why
    return out


def _master(folder: Path) -> tuple[str, dict[str, tuple[str, str, bool]]]:
    """The commit id of ``folder``'s master and its tree (path -> type, ref, exec bit)."""
    with Repository.open(folder) as repo:
        tree = repo.tree_at(repo.prev.master)
        return repo.prev.master or "", {p: (e.type, e.ref, e.executable) for p, e in tree.items()}


def _small_tree(root: Path) -> None:
    """The issue's tree: a symlink, an exec bit, ``Foo.txt`` + ``foo.txt``,
    ``aux.txt``, ``a:b`` and an NFD name, and a plain file to edit."""
    (root / "plain.txt").write_text("plain\n")
    (root / "Foo.txt").write_text("upper\n")
    (root / "foo.txt").write_text("lower\n")
    (root / "aux.txt").write_text("aux\n")
    (root / "a:b").write_text("colon\n")
    (root / NFD).write_text("decomposed\n")
    script = root / "run.sh"
    script.write_text("#!/bin/sh\n")
    script.chmod(0o755)
    os.symlink("plain.txt", root / "link")


def test_a_clone_into_exfat_says_what_it_cannot_write_and_pushes_nothing_of_it(
        tmp_path: Path, fs_images: dict[str, Path]) -> None:
    """The clone failed on the first symbolic link (Function not implemented). Now
    it names each path it cannot write; a push from it changes nothing in master; a
    later edit there pushes only that file, and the other client's tree is untouched."""
    a, uris = _repo(tmp_path, _small_tree)
    before = snapshot(a)
    master, tree = _master(a)
    g = fresh_folder(fs_images["exfat"], "clone")
    clone = run_cli("clone", *uris, str(g), cwd=tmp_path, check=False)
    assert clone.returncode == 0 and "Traceback" not in clone.stderr, clone.stderr
    said = _not_written(clone.stderr)
    assert set(said) == {"link", "run.sh", "foo.txt", "a:b"}, clone.stderr
    assert "symbolic link" in said["link"] and "exec bit" in said["run.sh"]
    assert "Foo.txt" in said["foo.txt"] and "case" in said["foo.txt"]
    assert sorted(os.listdir(g)) == sorted([".metasync", "plain.txt", "Foo.txt", "aux.txt", NFD,
                                            "run.sh"])
    assert (g / "Foo.txt").read_text() == "upper\n"
    status = run_cli("status", cwd=g)
    assert status.stdout.splitlines()[-1] == "Nothing to commit, folder clean", status.stdout
    restore = run_cli("restore", "link", cwd=g)  # says so too, and writes nothing
    assert list(_not_written(restore.stderr)) == ["link"], restore.stderr
    assert "restored 0 file(s)" in restore.stdout

    push = run_cli("push", cwd=g)
    assert "Pushed" not in push.stdout, push.stdout
    assert _master(g) == (master, tree)

    (g / "plain.txt").write_text("edited on the stick\n")
    run_cli("push", cwd=g)
    new_master, new_tree = _master(g)
    assert new_master != master
    changed = {p for p in tree.keys() | new_tree.keys() if tree.get(p) != new_tree.get(p)}
    assert changed == {"plain.txt"}

    run_cli("pull", cwd=a)
    before["plain.txt"] = snapshot(a)["plain.txt"]
    assert snapshot(a) == before
    assert (a / "plain.txt").read_text() == "edited on the stick\n"

    # A change upstream of the name not written here is said again, and leaves the
    # one written alone.
    (a / "foo.txt").write_text("lower, changed\n")
    run_cli("push", cwd=a)
    pull = run_cli("pull", cwd=g)
    assert list(_not_written(pull.stderr)) == ["foo.txt"], pull.stderr
    assert (g / "Foo.txt").read_text() == "upper\n"
    assert [n for n in os.listdir(g) if n.lower() == "foo.txt"] == ["Foo.txt"]
    assert run_cli("status", cwd=g).stdout.splitlines()[-1] == "Nothing to commit, folder clean"


#: What each file system of fs_images cannot hold of make_edge_case_tree, and the
#: words its reason must hold.
EDGE_NOT_WRITTEN = {
    "exfat": {"case.txt": "case", "a:b": "name", "what?.txt": "name",
              "link-to-notes": "symbolic link", "run.sh": "exec bit"},
    # VFAT long names hold any Unicode name (UTF-16), as exFAT's do; Linux's vfat
    # refuses a name ending in a space (vfat_valid_longname) and drops a name's
    # trailing dots without an error (as Windows does).
    "fat": {"case.txt": "case", "a:b": "name", "what?.txt": "name", "trailing-space ": "name",
            "trailing-dot.": "trailing dot", "link-to-notes": "symbolic link",
            "run.sh": "exec bit"},
    "ntfs": {"run.sh": "exec bit"},
}


@pytest.fixture(scope="module")
def edge_repo(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    """The edge-case tree, pushed once for the module's clones."""
    return _repo(tmp_path_factory.mktemp("edge"), make_edge_case_tree)


@pytest.mark.parametrize("kind", ["exfat", "fat", "ntfs"])
def test_the_edge_case_tree_clones_into_exfat_fat_and_ntfs(
        kind: str, edge_repo: tuple[Path, list[str]], fs_images: dict[str, Path]) -> None:
    """Cloned into each file system: identical except what it cannot hold, which
    is listed; and nothing of that is pushed back."""
    a, uris = edge_repo
    g = fresh_folder(fs_images[kind], "edge")
    clone = run_cli("clone", *uris, str(g), cwd=a.parent, check=False)
    assert clone.returncode == 0 and "Traceback" not in clone.stderr, clone.stderr
    said = _not_written(clone.stderr)
    assert set(said) == set(EDGE_NOT_WRITTEN[kind]), clone.stderr
    for path, words in EDGE_NOT_WRITTEN[kind].items():
        assert words in said[path], (path, said[path])
    assert set(said) <= set(EDGE_CASE_HARD_NAMES) | {"café-nfc.txt", "cafe\u0301-nfd.txt",
                                                     "ünïcödé — 名前 ☃.txt"}
    # None of these keeps exec bits (exFAT and FAT show every file executable,
    # ntfs-3g without permissions too): files are compared without them.
    want, got = ({p: v[:2] for p, v in snapshot(root).items()} for root in (a, g))
    for path in said:
        if path != "run.sh":  # written, without its exec bit
            assert path not in got
            want.pop(path)
    assert got == want
    status = run_cli("status", cwd=g)
    assert status.stdout.splitlines()[-1] == "Nothing to commit, folder clean", status.stdout
    master = _master(a)
    push = run_cli("push", cwd=g)
    assert "Pushed" not in push.stdout, push.stdout
    assert _master(g) == master


def test_a_name_renamed_to_its_nfd_spelling_is_the_same_file(tmp_path: Path) -> None:
    """macOS gives back a name decomposed (NFD) that another client wrote composed
    (NFC): a scan that finds the NFD spelling of an indexed NFC name takes it for
    that file, so the push is not a deletion and an addition. And two names of
    history equal but for their normal form are one file here: the second is said
    and kept, not written."""
    a, uris = _repo(tmp_path, lambda root: (root / NFC).write_text("composed\n"))
    master = _master(a)
    os.rename(a / NFC, a / NFD)
    status = run_cli("status", cwd=a)
    assert status.stdout.splitlines()[-1] == "Nothing to commit, folder clean", status.stdout
    assert "Pushed" not in run_cli("push", cwd=a).stdout
    assert _master(a) == master

    # Both spellings in history (a Linux client can hold both): one is written.
    (a / NFC).write_text("composed\n")
    run_cli("push", cwd=a)
    clone = run_cli("clone", *uris, str(tmp_path / "g"), cwd=tmp_path)
    said = _not_written(clone.stderr)
    assert list(said) == [NFD] and NFC in said[NFD] and "Unicode" in said[NFD], clone.stderr
    assert sorted(n for n in os.listdir(tmp_path / "g") if n != ".metasync") == [NFC]
    status = run_cli("status", cwd=tmp_path / "g")
    assert status.stdout.splitlines()[-1] == "Nothing to commit, folder clean", status.stdout


def test_a_file_too_large_for_the_file_system_is_said_and_kept(tmp_path: Path) -> None:
    """A file over the file system's largest (FAT32's 4 GiB; here a lowered
    RLIMIT_FSIZE gives the same EFBIG) is said, kept in history, and the rest of
    the clone is written."""
    def tree(root: Path) -> None:
        (root / "small.txt").write_text("small\n")
        (root / "big.bin").write_bytes(os.urandom(3 * 1024 * 1024))

    a, uris = _repo(tmp_path, tree)
    master = _master(a)
    g = tmp_path / "g"
    env = {**os.environ, "METASYNC_PASSPHRASE": PASSPHRASE}
    clone = subprocess.run(["prlimit", f"--fsize={2 * 1024 * 1024}", METASYNC, "clone", *uris,
                            str(g)], cwd=tmp_path, env=env, capture_output=True, text=True,
                           stdin=subprocess.DEVNULL)
    assert clone.returncode == 0 and "Traceback" not in clone.stderr, clone.stderr
    said = _not_written(clone.stderr)
    assert list(said) == ["big.bin"] and "File too large" in said["big.bin"], clone.stderr
    assert sorted(os.listdir(g)) == [".metasync", "small.txt"]
    assert "Pushed" not in run_cli("push", cwd=g).stdout
    assert _master(g) == master


def test_folder_traits_are_recorded_and_probed_again_on_another_file_system(
        tmp_path: Path, fs_images: dict[str, Path]) -> None:
    """The probe's record is used while the folder's device number is the one
    recorded, and probed again when it differs (the folder moved, a disk mounted
    again); a probe of exFAT finds it case-insensitive and without exec bits."""
    a, _ = _repo(tmp_path, lambda root: (root / "x.txt").write_text("x\n"))
    with Repository.open(a) as repo:
        recorded = repo.scanner.traits
        assert (recorded.case_insensitive, recorded.exec_bits) == (False, True)
        assert repo._ctx.state.folder_traits == recorded
        # A record from another device is not believed (but for exec bits that did
        # not stick there: tests/test_folder_moved_off_exfat.py).
        repo._ctx.state.folder_traits = FolderTraits(recorded.device + 1, True, True)
    with Repository.open(a) as repo:
        assert repo.scanner.traits == recorded
    meta = fresh_folder(fs_images["exfat"], "probe")
    exfat = probe_traits(meta, meta)
    assert exfat is not None and (exfat.case_insensitive, exfat.exec_bits) == (True, False)
    assert os.listdir(meta) == []  # the scratch file is gone


def test_trailing_dots_are_probed_and_an_older_record_is_probed_again(
        tmp_path: Path, fs_images: dict[str, Path]) -> None:
    """The probe finds whether a name's trailing dot stays (it does not on vfat,
    which drops it without an error) and leaves neither spelling of its scratch
    file; a record written before this was probed is probed again, not believed."""
    meta = fresh_folder(fs_images["fat"], "probe-dots")
    fat = probe_traits(meta, meta)
    assert fat is not None and fat.trailing_dots is False and fat.drops_dot("x.")
    assert os.listdir(meta) == []
    a, _ = _repo(tmp_path, lambda root: (root / "x.txt").write_text("x\n"))
    local = probe_traits(a, a / ".metasync")
    assert local is not None and local.trailing_dots is True and not local.drops_dot("x.")
    with Repository.open(a) as repo:
        recorded = repo.scanner.traits
        old = {"device": recorded.device, "case_insensitive": False, "exec_bits": True}
        assert FolderTraits.from_json(old) == FolderTraits(recorded.device, False, True, None)
        repo._ctx.state.folder_traits = FolderTraits(recorded.device, False, True, None)
    with Repository.open(a) as repo:
        assert repo.scanner.traits == recorded and recorded.trailing_dots is True
        assert repo._ctx.state.folder_traits == recorded


def test_a_name_ending_in_a_dot_is_not_written_where_the_dot_is_dropped(
        tmp_path: Path, fs_images: dict[str, Path]) -> None:
    """On vfat (and Windows) ``x.`` would be written as ``x``, over another file of
    the tree: a name ending in a dot is said and kept in history, never written
    (by a clone, a pull or a restore), never shown as deleted or pushed."""
    def tree(root: Path) -> None:
        (root / "x.").write_text("dot\n")
        (root / "x").write_text("plain\n")
        (root / "d.").mkdir()
        (root / "d." / "in.txt").write_text("in\n")
    a, uris = _repo(tmp_path, tree)
    g = fresh_folder(fs_images["fat"], "dots")
    clone = run_cli("clone", *uris, str(g), cwd=tmp_path, check=False)
    assert clone.returncode == 0 and "Traceback" not in clone.stderr, clone.stderr
    said = _not_written(clone.stderr)
    assert set(said) == {"x.", "d."} and all("trailing dot" in w for w in said.values()), said
    assert sorted(os.listdir(g)) == [".metasync", "x"] and (g / "x").read_text() == "plain\n"
    status = run_cli("status", cwd=g)
    assert status.stdout.splitlines()[-1] == "Nothing to commit, folder clean", status.stdout
    restore = run_cli("restore", "x.", cwd=g)
    assert list(_not_written(restore.stderr)) == ["x."], restore.stderr
    assert (g / "x").read_text() == "plain\n"
    master = _master(a)
    assert "Pushed" not in run_cli("push", cwd=g).stdout
    assert _master(g) == master
    # Changed upstream: said again, still not written over x.
    (a / "x.").write_text("dot, changed\n")
    run_cli("push", cwd=a)
    pull = run_cli("pull", cwd=g)
    assert list(_not_written(pull.stderr)) == ["x."], pull.stderr
    assert (g / "x").read_text() == "plain\n"
    assert "Pushed" not in run_cli("push", cwd=g).stdout
    assert _master(g) == _master(a)
