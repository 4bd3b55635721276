"""A no-change ``metasync status --offline`` answered from the index, as git answers
``git status``: before the CLI (click, the codec, the repository) is loaded.

When a full status finds the folder clean (:meth:`Committer.status
<metasync.committer.Committer.status>`, with the folder's lock held), it keeps
what it printed in the local state (setting :data:`MEMO_KEY`) together with a
*stamp* of everything that answer was made from:

* ``settings``: a digest of every other row of the ``settings`` table (the
  version, head, pending checkout, unfinished clone, sparse selection, waiting
  folders, configuration, folder traits, the tree memo...);
* ``tree``: the fingerprint of the scan (:func:`metasync.scanner.tree_fingerprint`
  of every file's content id, size and exec bit, link targets and folders) that
  the tree memo ties to the head commit's tree -- the full status then lists no
  change without building a tree;
* what the scan's rules read besides: the exec-bit trait and the file system's
  device number, the key file (size, mtime, inode), the object format.

:func:`answer` walks the folder with the scan's rules (:func:`metasync.worktree.scan`
and :meth:`metasync.scanner.Scanner.scan`), taking each file's content id from
its index row only where the full scan would (same size, mtime and inode, not
racily clean), and recomputes the stamp. Equal stamps mean the full status would
read the same inputs, and so print the same answer: it is printed. Anything the
walk does not handle the way the full scan would -- a file the index cannot vouch
for, an ignore file, a sparse selection, an unreadable folder, a special file, a
name not in UTF-8, a row kept for a path not on disk -- or any error gives None,
and the full CLI runs. Only the standard library is imported here.
"""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
import stat
import sys

TYPE_CHECKING = False  # not typing's: importing typing costs start-up time
if TYPE_CHECKING:
    from typing import Any

#: The setting that keeps the last clean answer and its stamp.
MEMO_KEY = "quick_status_v1"
#: Version of the memo's document and of the rules below: a memo of another is not used.
MEMO_VERSION = 1
#: The folder's metadata folder (metasync.worktree.META_DIR), its temporary files'
#: prefix (TEMP_PREFIX) and the ignore file (IGNORE_FILE).
META_DIR = ".metasync"
TEMP_PREFIX = ".metasync-tmp-"
IGNORE_FILE = ".metasyncignore"
#: metasync.scanner.RACY_NS and TREE_MEMO.
RACY_NS = 2_000_000_000
TREE_MEMO = "tree_memo_v1"
#: metasync.localdb.NOT_ON_DISK and OUTSIDE: rows kept for paths not on disk.
SPECIAL_MTIMES = (-1, -2)
#: The key file and the outbox folder in ``.metasync`` (metasync.context's KEY_FILE
#: and OUTBOX_DIR).
KEY_FILE = "key"
OUTBOX_DIR = "outbox"


class _Decline(Exception):
    """The quick path cannot vouch for the answer: the full status runs."""


# --- the stamp, for both sides -------------------------------------------------------


def settings_digest(conn: sqlite3.Connection) -> str:
    """A digest of every row of the ``settings`` table but the memo itself."""
    h = hashlib.blake2b(digest_size=32)
    for key, value in conn.execute(
            "SELECT key, value FROM settings WHERE key != ? ORDER BY key", (MEMO_KEY,)):
        h.update(f"{len(key)}:{key}\0{len(value)}:{value}\0".encode("utf-8", "surrogatepass"))
    return h.hexdigest()


def fingerprint(files: list[tuple[str, str, str, int, bool]], dirs: list[str],
                fmt: int) -> str:
    """:func:`metasync.scanner.tree_fingerprint` of ``files`` (path, type, ref,
    size, executable) and ``dirs``, for object format ``fmt``."""
    h = hashlib.blake2b(digest_size=32)
    h.update(f"{TREE_MEMO}\0{fmt}\0{len(files)}\0{len(dirs)}\0".encode())
    files.sort()
    batch = [f"{p}\0{t}\0{r}\0{s}\0{'x' if x else '-'}\0" for p, t, r, s, x in files]
    dirs.sort()
    batch.extend(f"{d}\0" for d in dirs)
    h.update("".join(batch).encode("utf-8", "surrogatepass"))
    return h.hexdigest()


def key_stamp(meta: str) -> list[int] | None:
    """What the key file's change would show: size, mtime, inode (None: no file)."""
    try:
        st = os.lstat(os.path.join(meta, KEY_FILE))
    except FileNotFoundError:
        return None
    return [st.st_size, st.st_mtime_ns, st.st_ino]


def memo(conn: sqlite3.Connection, root: str, tree: str, fmt: int, exec_bits: bool,
         device: int, answer: dict[str, Any]) -> dict[str, Any]:
    """The memo (:data:`MEMO_KEY`) for the clean ``answer`` (``{"json": ...,
    "text": ...}`` of an offline status) of a scan with fingerprint ``tree``; read
    the settings after every other write of the command."""
    return {
        "v": MEMO_VERSION, "settings": settings_digest(conn), "tree": tree, "format": fmt,
        "exec_bits": exec_bits, "device": device,
        "key": key_stamp(os.path.join(root, META_DIR)),
        "answer": {"json": answer["json"], "text": answer["text"]}}


# --- the quick path ------------------------------------------------------------------


def find_root(start: str) -> str | None:
    """As :func:`metasync.watch_client.find_root` (metasync.worktree.find_root's search)."""
    path = os.path.abspath(start)
    while True:
        if os.path.isfile(os.path.join(path, META_DIR, "state.db")):
            return path
        parent = os.path.dirname(path)
        if parent == path:
            return None
        path = parent


def _owned(root: str) -> bool:
    """``root/.metasync`` passes metasync.worktree.check_owner without being trusted:
    a real folder of this user that no one else may write to, its state and key
    files this user's regular files."""
    if not hasattr(os, "geteuid"):
        return False  # Windows: no quick path
    me = os.geteuid()
    meta = os.path.join(root, META_DIR)
    st = os.lstat(meta)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != me or st.st_mode & 0o022:
        return False
    for name in ("state.db", KEY_FILE):
        try:
            fst = os.lstat(os.path.join(meta, name))
        except FileNotFoundError:
            continue
        if not stat.S_ISREG(fst.st_mode) or fst.st_uid != me:
            return False
    return True


def walk(root: str) -> tuple[dict[str, os.stat_result], list[str], dict[str, str]]:
    """Files, folders and links under ``root`` by the scan's rules
    (metasync.worktree.scan): ``(files by path, folders, link targets by path)``;
    _Decline for anything the scan would report as a problem."""
    files: dict[str, os.stat_result] = {}
    dirs: list[str] = []
    links: dict[str, str] = {}
    me = os.geteuid()
    everything = me == 0
    s_ifmt, s_ifreg, s_ifdir, s_iflnk = 0o170000, stat.S_IFREG, stat.S_IFDIR, stat.S_IFLNK
    s_irusr = stat.S_IRUSR
    stack = [(root, "")]
    while stack:
        abs_dir, rel_dir = stack.pop()
        try:
            it = os.scandir(abs_dir)
        except OSError:
            raise _Decline(f"cannot list {rel_dir}") from None
        prefix = f"{rel_dir}/" if rel_dir else ""
        with it:
            for de in it:
                name = de.name
                if name.startswith(META_DIR) and (name == META_DIR or name.startswith(TEMP_PREFIX)):
                    continue
                rel = prefix + name
                try:
                    st = de.stat(follow_symlinks=False)
                except OSError:
                    raise _Decline(f"cannot stat {rel}") from None
                kind = st.st_mode & s_ifmt
                if kind == s_ifreg:
                    if not (everything or (st.st_uid == me and st.st_mode & s_irusr)):
                        raise _Decline(f"maybe unreadable: {rel}")
                    files[rel] = st
                elif kind == s_ifdir:
                    dirs.append(rel)
                    stack.append((de.path, rel))
                elif kind == s_iflnk:
                    links[rel] = os.readlink(de.path)
                else:
                    raise _Decline(f"special file: {rel}")
    return files, dirs, links


def _open_db(root: str) -> sqlite3.Connection:
    """``state.db``, read-only (what a URI's path cannot hold as it is, escaped)."""
    path = os.path.join(root, META_DIR, "state.db")
    path = path.replace("%", "%25").replace("?", "%3f").replace("#", "%23")
    return sqlite3.connect(f"file:{path}?mode=ro", uri=True, isolation_level=None)


def answer(cwd: str) -> dict[str, Any] | None:
    """The offline status of the repository containing ``cwd`` (``{"json": ...,
    "text": [[stream, line], ...]}``, as :func:`metasync.watch_client.ask` gives
    it) if the quick path can vouch for it, else None."""
    if sys.platform == "win32" or not hasattr(os, "geteuid"):
        return None
    try:
        root = find_root(cwd)
        if root is None or not _owned(root):
            return None
        return _answer(root)
    except (_Decline, OSError, sqlite3.Error, ValueError, KeyError, TypeError, AttributeError):
        return None


def _answer(root: str) -> dict[str, Any]:
    if os.path.lexists(os.path.join(root, IGNORE_FILE)):
        raise _Decline("an ignore file")  # its rules are pathspec's: the full scan's
    conn = _open_db(root)
    try:
        conn.execute("BEGIN")  # one snapshot of the settings and the index
        row = conn.execute("SELECT value FROM settings WHERE key = ?", (MEMO_KEY,)).fetchone()
        if row is None:
            raise _Decline("no memo")
        doc = json.loads(row[0])
        if not isinstance(doc, dict) or doc.get("v") != MEMO_VERSION:
            raise _Decline("no memo of this version")
        if doc["settings"] != settings_digest(conn):
            raise _Decline("the local state changed")
        if doc["key"] != key_stamp(os.path.join(root, META_DIR)):
            raise _Decline("the key file changed")
        if doc["device"] != os.stat(root).st_dev:
            raise _Decline("another file system")
        # What opening the repository needs besides: the outbox folder (made if
        # missing) and the head commit, cached locally (read from a backend else).
        if not os.path.isdir(os.path.join(root, META_DIR, OUTBOX_DIR)):
            raise _Decline("no outbox folder")
        head = conn.execute("SELECT value FROM settings WHERE key = 'head'").fetchone()
        if head is None or not conn.execute("SELECT 1 FROM objects WHERE object_id = ?",
                                            (json.loads(head[0]),)).fetchone():
            raise _Decline("the head commit is not cached")
        exec_bits = doc["exec_bits"]
        found, dirs, links = walk(root)
        files: list[tuple[str, str, str, int, bool]] = []
        for path, kind, ref, size, executable, mtime_ns, ino, hashed_at in conn.execute(
                "SELECT path, type, ref, size, executable, mtime_ns, ino, hashed_at_ns "
                "FROM worktree"):
            if path.__class__ is not str or ref.__class__ is not str:
                raise _Decline("a name not in UTF-8")
            st = found.pop(path, None)
            if st is None:
                if mtime_ns in SPECIAL_MTIMES or not path.isascii():
                    raise _Decline("a row kept for a path not on disk, or respelled")
                continue  # not a file here: a folder, a link, or gone
            # The scanner's test of a row it trusts (Scanner.scan).
            if (st.st_size != size or st.st_mtime_ns != mtime_ns or st.st_ino != ino
                    or mtime_ns + RACY_NS >= hashed_at):
                raise _Decline(f"changed or racily clean: {path}")
            files.append((path, kind, ref, size,
                          bool(st.st_mode & stat.S_IXUSR) if exec_bits else bool(executable)))
        if found:
            raise _Decline("files the index does not vouch for")
        files.extend((p, "link", t, len(os.fsencode(t)), False) for p, t in links.items())
        if fingerprint(files, dirs, doc["format"]) != doc["tree"]:
            raise _Decline("another tree")
        conn.execute("COMMIT")
    finally:
        conn.close()
    got = doc["answer"]
    if not isinstance(got.get("json"), str) or not isinstance(got.get("text"), list):
        raise _Decline("a malformed memo")
    return {"json": got["json"], "text": got["text"]}
