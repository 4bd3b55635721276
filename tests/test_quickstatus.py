"""The quick path of a no-change ``metasync status --offline`` (metasync.quickstatus):
in every situation it prints what the full status prints, or it declines and the
full status runs -- never a "clean" the full status would not say.

Each check asks the quick path first (in this process: it reads only), then the
full status (``--scan``: the CLI, not the console script's quick path) on the same
folder, and compares what they print. Files are given mtimes well in the past
(``os.utime``), as a folder's files are when a status runs long after they were
written: the index trusts a row only if the file is older than the row by the
racy-clean margin, and these tests must not wait that long.
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import PASSPHRASE, run_cli
from metasync import quickstatus

#: How far in the past test files' mtimes are put (well beyond scanner.RACY_NS).
OLD = 60


def age(root: Path) -> None:
    """Put every file's, folder's and link's mtime ``OLD`` seconds in the past."""
    past = time.time() - OLD
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d != ".metasync"]
        for name in filenames + dirnames:
            os.utime(os.path.join(dirpath, name), (past, past), follow_symlinks=False)


def age_one(path: Path) -> None:
    """Put ``path``'s mtime ``OLD`` seconds in the past (only it: the others' stay)."""
    past = time.time() - OLD
    os.utime(path, (past, past), follow_symlinks=False)


def make_folder(tmp_path: Path, backends: list[Path]) -> Path:
    root = tmp_path / "folder"
    (root / "docs" / "deep").mkdir(parents=True)
    for i in range(4):
        (root / "docs" / f"f{i}.txt").write_text(f"file {i}\n")
    (root / "docs" / "deep" / "run.sh").write_text("#!/bin/sh\necho hi\n")
    os.chmod(root / "docs" / "deep" / "run.sh", 0o755)
    os.symlink("docs/f0.txt", root / "link")
    (root / "héllo wörld.txt").write_text("unicode name\n")
    age(root)
    run_cli("init", str(root), *(f"--backend=dir:{b}" for b in backends))
    run_cli("push", cwd=root)
    return root


def full(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return run_cli("status", "--offline", "--scan", *args, cwd=root, check=False)


def agree(root: Path) -> bool:
    """Ask the quick path, then the full status (text and --json); assert the quick
    answer, if any, is what the full one prints. True if the quick path answered."""
    quick = quickstatus.answer(str(root))
    text = full(root)
    doc = full(root, "--json")
    assert text.returncode == 0 and doc.returncode == 0, text.stderr + doc.stderr
    if quick is None:
        return False
    out = "".join(line + "\n" for stream, line in quick["text"] if stream == "out")
    err = "".join(line + "\n" for stream, line in quick["text"] if stream == "err")
    assert (out, err) == (text.stdout, text.stderr)
    assert quick["json"] + "\n" == doc.stdout
    return True


def clean_and_kept(root: Path) -> None:
    """A full status on a clean folder keeps its answer: the quick path gives it."""
    full(root)
    assert agree(root), "the quick path declined a clean folder it should answer"


def test_clean_folder_is_answered_and_agrees(tmp_path: Path, backends: list[Path]) -> None:
    root = make_folder(tmp_path, backends)
    clean_and_kept(root)
    doc = json.loads(quickstatus.answer(str(root))["json"])  # type: ignore[index]
    assert doc["clean"] is True and doc["changes"] == []


def test_from_a_subfolder(tmp_path: Path, backends: list[Path]) -> None:
    root = make_folder(tmp_path, backends)
    clean_and_kept(root)
    assert agree(root / "docs" / "deep")


@pytest.mark.parametrize("change", [
    "new file", "deleted file", "new empty folder", "removed folder", "same size new inode",
    "exec bit", "link retargeted", "file became link", "fresh write", "ignore file",
    "fifo", "unreadable folder", "temp name", "non-utf8 name",
])
def test_a_change_is_never_answered_clean(tmp_path: Path, backends: list[Path],
                                          change: str) -> None:
    root = make_folder(tmp_path, backends)
    clean_and_kept(root)
    docs = root / "docs"
    f1 = docs / "f1.txt"
    st = f1.stat()
    if change == "new file":
        (docs / "new.txt").write_text("new\n")
        age_one(docs / "new.txt")
    elif change == "deleted file":
        f1.unlink()
    elif change == "new empty folder":
        (root / "empty").mkdir()
        age_one(root / "empty")
    elif change == "removed folder":
        for p in (docs / "deep").iterdir():
            p.unlink()
        (docs / "deep").rmdir()
    elif change == "same size new inode":
        # Other content, same size, the mtime put back: only the inode tells.
        tmp = docs / "tmp"
        tmp.write_text("FILE 1\n")
        os.rename(tmp, f1)
        os.utime(f1, ns=(st.st_atime_ns, st.st_mtime_ns))
    elif change == "exec bit":
        os.chmod(f1, 0o755)
    elif change == "link retargeted":
        (root / "link").unlink()
        os.symlink("docs/f2.txt", root / "link")
    elif change == "file became link":
        f1.unlink()
        os.symlink("f0.txt", f1)
    elif change == "fresh write":
        # Written within the racy-clean margin of the row: the index cannot vouch.
        f1.write_text("file 9\n")
        os.utime(f1, ns=(st.st_atime_ns, time.time_ns()))
        full(root)  # the row now carries a hash made in the same second
        f1.write_text("file 8\n")
        os.utime(f1, ns=(st.st_atime_ns, os.stat(f1).st_mtime_ns))
    elif change == "ignore file":
        (root / ".metasyncignore").write_text("*.log\n")
        (root / "x.log").write_text("ignored\n")
        age_one(root / "x.log")
        age_one(root / ".metasyncignore")
    elif change == "fifo":
        os.mkfifo(docs / "pipe")
    elif change == "unreadable folder":
        if os.geteuid() == 0:
            pytest.skip("root reads every folder")
        os.chmod(docs / "deep", 0)
    elif change == "temp name":
        (docs / ".metasync-tmp-abc").write_text("a checkout's temporary file\n")
    elif change == "non-utf8 name":
        name = os.fsdecode(b"caf\xe9.txt")
        (docs / name).write_text("latin-1 name\n")
        age_one(docs / name)
    try:
        answered = agree(root)
        if change == "temp name":
            assert answered  # the scan skips them too
        elif change == "exec bit":
            pass  # answered only where exec bits do not stick; then it agrees
        else:
            assert not answered, f"{change}: answered from the memo"
    finally:
        if change == "unreadable folder":
            os.chmod(docs / "deep", 0o755)


def test_same_size_same_mtime_same_inode_edit_agrees(tmp_path: Path,
                                                     backends: list[Path]) -> None:
    """An edit in place that keeps size and mtime is invisible to the full scan too
    (as to git): both say the same thing."""
    root = make_folder(tmp_path, backends)
    clean_and_kept(root)
    f1 = root / "docs" / "f1.txt"
    st = f1.stat()
    with open(f1, "r+") as fh:
        fh.write("FILE")
    os.utime(f1, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert agree(root)


def test_stat_put_back_after_a_status_saw_the_change(tmp_path: Path,
                                                     backends: list[Path]) -> None:
    """An edit a status saw (and hashed), whose size, mtime and inode are then put
    back as they were when the answer was kept: the index row is the edit's, so the
    full status reads the file again; the quick path must not answer from the memo."""
    root = make_folder(tmp_path, backends)
    clean_and_kept(root)
    f1 = root / "docs" / "f1.txt"
    st = f1.stat()
    with open(f1, "r+") as fh:
        fh.write("FILE")
    age_one(f1)
    assert not agree(root)  # the edit is seen, and its row written
    os.utime(f1, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert not agree(root)
    assert "M docs/f1.txt" in full(root).stdout


def test_an_index_written_behind_the_memo_declines(tmp_path: Path,
                                                   backends: list[Path]) -> None:
    """A writer that does not drop the memo (older code, a tool) changes the sums."""
    root = make_folder(tmp_path, backends)
    clean_and_kept(root)
    db = sqlite3.connect(root / ".metasync" / "state.db")
    try:
        db.execute("UPDATE worktree SET hashed_at_ns = hashed_at_ns + 1 WHERE path = 'docs/f1.txt'")
        db.commit()
    finally:
        db.close()
    assert quickstatus.answer(str(root)) is None


def test_unpushed_commit_and_after_a_pull(tmp_path: Path, backends: list[Path]) -> None:
    root = make_folder(tmp_path, backends)
    clean_and_kept(root)
    (root / "docs" / "f1.txt").write_text("changed\n")
    age_one(root / "docs" / "f1.txt")
    assert not agree(root)
    run_cli("commit", "-m", "local", cwd=root)
    assert not agree(root)  # the head moved: the memo's stamp is another
    clean_and_kept(root)
    assert "local commits not pushed" in full(root).stdout
    # Another clone pushes; this one pulls.
    other = tmp_path / "other"
    run_cli("push", cwd=root)
    assert not agree(root)
    clean_and_kept(root)
    run_cli("clone", f"dir:{backends[0]}", str(other))
    (other / "docs" / "f2.txt").write_text("from the other clone\n")
    age_one(other / "docs" / "f2.txt")
    run_cli("push", cwd=other)
    run_cli("pull", cwd=root)
    assert not agree(root)  # the head, the version and a file changed
    age_one(root / "docs" / "f2.txt")  # older than its row by the margin now
    full(root)  # its new mtime: hashed again, then trusted
    clean_and_kept(root)
    assert "On version 3" in full(root).stdout


def test_pending_checkout_and_unfinished_clone(tmp_path: Path, backends: list[Path]) -> None:
    root = make_folder(tmp_path, backends)
    clean_and_kept(root)
    other = tmp_path / "other"
    run_cli("clone", f"dir:{backends[0]}", str(other))
    for i in range(5):
        (other / "docs" / f"g{i}.txt").write_text(f"new {i}\n")
    run_cli("push", cwd=other)
    crashed = run_cli("pull", cwd=root, check=False,
                      env_extra={"METASYNC_CRASH_AT": "checkout:planned"})
    assert crashed.returncode == 137, crashed.stderr
    db = sqlite3.connect(root / ".metasync" / "state.db")
    try:
        assert db.execute("SELECT 1 FROM settings WHERE key='checkout_pending'").fetchone()
    finally:
        db.close()
    assert quickstatus.answer(str(root)) is None  # the full status finishes the checkout
    # A clone stopped before its first pull ended.
    third = tmp_path / "third"
    stopped = run_cli("clone", f"dir:{backends[0]}", str(third), check=False,
                      env_extra={"METASYNC_CRASH_AT": "checkout:planned"})
    assert stopped.returncode == 137, stopped.stderr
    assert not agree(third)
    assert "Unfinished clone" in full(third).stdout


def test_a_changed_setting_or_key_declines(tmp_path: Path, backends: list[Path]) -> None:
    root = make_folder(tmp_path, backends)
    clean_and_kept(root)
    db = sqlite3.connect(root / ".metasync" / "state.db")
    try:
        db.execute("INSERT OR REPLACE INTO settings(key, value) VALUES ('sparse_patterns', "
                   "'[\"docs/\"]')")
        db.commit()
        assert quickstatus.answer(str(root)) is None
        db.execute("DELETE FROM settings WHERE key='sparse_patterns'")
        db.commit()
        assert quickstatus.answer(str(root)) is not None
    finally:
        db.close()
    key = root / ".metasync" / "key"
    data = key.read_bytes()
    os.unlink(key)
    key.write_bytes(data)  # another inode: as a rotated key is written
    os.chmod(key, 0o600)
    assert quickstatus.answer(str(root)) is None


#: The console script's quick path, in a fresh process: what it printed, and
#: whether it loaded the CLI.
PROBE = """
import json, os, sys
real_exit, me = os._exit, os.getpid()
def ends(code):  # the quick path ends with os._exit: seen here instead (not the
    if os.getpid() != me:  # walk's forked helper's, which ends with it too)
        real_exit(code)
    raise SystemExit(code)
os._exit = ends
sys.argv = ["metasync", "status", "--offline"]
from metasync.entry import main
try:
    main()
except SystemExit as exc:
    code = exc.code
print(json.dumps({"exit": code, "click": "click" in sys.modules,
                  "codec": "metasync.codec" in sys.modules}))
"""


def test_console_script_answers_without_the_cli(tmp_path: Path, backends: list[Path]) -> None:
    root = make_folder(tmp_path, backends)
    clean_and_kept(root)
    env = {**os.environ, "METASYNC_PASSPHRASE": PASSPHRASE}
    proc = subprocess.run([sys.executable, "-c", PROBE], cwd=root, env=env,
                          capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr
    *printed, last = proc.stdout.splitlines(keepends=True)
    assert json.loads(last) == {"exit": 0, "click": False, "codec": False}
    assert "".join(printed) == full(root).stdout


def test_a_checked_variable_runs_the_full_status(tmp_path: Path, backends: list[Path]) -> None:
    """The CLI refuses a bad METASYNC_TIMEOUT before status runs: so does the
    console script, which then does not take its quick path."""
    root = make_folder(tmp_path, backends)
    clean_and_kept(root)
    bad = run_cli("status", "--offline", cwd=root, check=False,
                  env_extra={"METASYNC_TIMEOUT": "soon"})
    assert bad.returncode != 0 and "timeout" in bad.stderr


def test_constants_are_the_full_paths() -> None:
    """The quick path keeps its own copies of the scan's names and rules (it imports
    only the standard library): they must be the ones the full status uses."""
    from metasync import context, watch_client, worktree

    assert (quickstatus.META_DIR, quickstatus.TEMP_PREFIX, quickstatus.IGNORE_FILE) == (
        worktree.META_DIR, worktree.TEMP_PREFIX, worktree.IGNORE_FILE)
    assert (quickstatus.KEY_FILE, quickstatus.OUTBOX_DIR) == (context.KEY_FILE, context.OUTBOX_DIR)
    assert watch_client.META_DIR == quickstatus.META_DIR
    from metasync import entry
    from metasync.backends import bwlimit

    assert bwlimit.ENV in entry.CHECKED_ENV


def _entries(found: quickstatus.Found) -> tuple[list[str], list[int], list[str], list[str]]:
    return found.files, found.stats, found.dirs, found.links


def _wide_tree(root: Path) -> None:
    """Folders at every depth the walk shares and below, files at each level, links,
    an executable, names that are not UTF-8 and an empty folder."""
    for top in ("a", "b", "c"):
        for mid in range(4):
            for low in range(3):
                folder = root / top / f"m{mid}" / f"l{low}" / "deeper"
                folder.mkdir(parents=True)
                (folder / "x.txt").write_text(f"{top}{mid}{low}\n")
                (folder.parent / f"y{low}.txt").write_text("y\n")
            (root / top / f"m{mid}" / "z.txt").write_text("z\n")
        (root / top / "t.txt").write_text("t\n")
    (root / "r.txt").write_text("r\n")
    os.chmod(root / "a" / "m1" / "z.txt", 0o755)
    os.symlink("../t.txt", root / "b" / "m2" / "up")
    (root / "c" / "empty").mkdir()
    if sys.platform == "linux":
        os.mkdir(os.fsencode(root / "c" / "m0") + b"/caf\xe9")
        (Path(os.fsdecode(os.fsencode(root / "c" / "m0") + b"/caf\xe9")) / "n.txt").write_text("n\n")


@pytest.mark.skipif(sys.platform != "linux", reason="the walk is shared with a forked helper on Linux only")
def test_the_shared_walk_lists_what_one_process_lists(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The helper's subtrees are put back where one walk lists them: every list is
    the same, in the same order (the stamp's digest depends on the order)."""
    _wide_tree(tmp_path)
    forks = []
    real = quickstatus._Helper.__init__

    def counting(self: quickstatus._Helper, top: int, me: int) -> None:
        real(self, top, me)
        forks.append(self.pid)

    monkeypatch.setattr(quickstatus._Helper, "__init__", counting)
    alone = quickstatus.walk(str(tmp_path), share=False)
    shared = quickstatus.walk(str(tmp_path))
    assert len(forks) == 1, "the walk was not shared"
    assert _entries(shared) == _entries(alone)
    assert len(alone.files) == 3 * 4 * 3 * 2 + 3 * 4 + 3 + 1 + 1
    assert shared.digest() == alone.digest()
    with pytest.raises(ChildProcessError):
        os.waitpid(forks[0], os.WNOHANG)  # reaped


@pytest.mark.skipif(sys.platform != "linux", reason="the walk is shared with a forked helper on Linux only")
@pytest.mark.parametrize("problem", ["fifo", "unlistable"])
def test_a_problem_the_helper_finds_declines(tmp_path: Path, problem: str) -> None:
    """What the helper meets in its subtree (the first folder two deep is its) makes
    the quick path decline, as it does in this process's part."""
    deep = tmp_path / "a" / "b" / "c"
    deep.mkdir(parents=True)
    (deep / "f.txt").write_text("f\n")
    if problem == "fifo":
        os.mkfifo(deep / "pipe")
    else:
        if os.geteuid() == 0:
            pytest.skip("root reads every folder")
        deep.chmod(0)
    try:
        with pytest.raises(quickstatus._Decline):
            quickstatus.walk(str(tmp_path))
        with pytest.raises(quickstatus._Decline):
            quickstatus.walk(str(tmp_path), share=False)
    finally:
        deep.chmod(0o755)


def test_loads_reads_json_dumps_and_refuses_the_rest() -> None:
    """The memo's JSON is read without importing json: what json.dumps wrote comes
    back; anything else is a ValueError."""
    doc = {"v": 1, "a": [1, 2.5, "x\u00e9\n", None, True, False], "n": {"k": -3}}
    assert quickstatus.loads(json.dumps(doc)) == doc
    for bad in ["", " 1", "[1]x", "NaN", '{"a":', "[Infinity]", '"\\ud800', "{'a': 1}"]:
        with pytest.raises(ValueError):
            quickstatus.loads(bad)


@pytest.mark.skipif(sys.platform != "linux", reason="the walk is shared with a forked helper on Linux only")
def test_a_helper_that_fails_or_cannot_start(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A helper that dies without a word (here: out of memory) makes the quick path
    decline, not crash; no process to spare (fork fails) walks alone, leaking no
    descriptor."""
    _wide_tree(tmp_path)
    alone = quickstatus.walk(str(tmp_path), share=False)
    real = quickstatus._subtree

    def no_memory(*args: object) -> quickstatus.Found:
        if os.getpid() != parent:
            raise MemoryError("simulated")
        return real(*args)  # type: ignore[arg-type]

    parent = os.getpid()
    monkeypatch.setattr(quickstatus, "_subtree", no_memory)
    with pytest.raises(quickstatus._Decline, match="MemoryError"):
        quickstatus.walk(str(tmp_path))
    monkeypatch.setattr(quickstatus, "_subtree", real)

    def no_fork() -> int:
        raise BlockingIOError(11, "Resource temporarily unavailable")

    monkeypatch.setattr(os, "fork", no_fork)
    before = _pipes()
    assert _entries(quickstatus.walk(str(tmp_path))) == _entries(alone)
    assert _pipes() == before


def _pipes() -> set[str]:
    """This process's open pipes (what a helper that could not start might leak)."""
    found = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("pipe:"):
            found.add(f"{fd}={target}")
    return found


def test_answered_through_a_link_to_the_folder(tmp_path: Path, backends: list[Path]) -> None:
    """A folder reached by a path that ends in a link (``cd ~/sync`` where ``sync``
    points at the folder) is answered as the folder itself is."""
    root = make_folder(tmp_path, backends)
    clean_and_kept(root)
    os.symlink(root, tmp_path / "via-link")
    assert quickstatus.answer(str(tmp_path / "via-link")) == quickstatus.answer(str(root))
    assert quickstatus.answer(str(tmp_path / "via-link")) is not None
