"""A no-change ``metasync status --offline`` answered from the last clean answer, as
git answers ``git status`` from its index: before the CLI (click, the codec, the
repository) is loaded. Only the standard library is imported here.

When a full status finds the folder clean (:meth:`Committer.status
<metasync.committer.Committer.status>`, with the folder's lock held) and trusted
*every* file's index row (same size, mtime and inode, not racily clean: nothing
was read), it keeps what it printed in the local state (setting :data:`MEMO_KEY`)
with a stamp of everything that answer was made from:

* ``settings``: a digest of every other row of the ``settings`` table (the
  version, head, pending checkout, unfinished clone, sparse selection, waiting
  folders, configuration, folder traits, the tree memo...);
* ``disk``: a digest of the scan's entries (:class:`Found`: each file's size,
  mtime, inode and exec bit, each link's target, each folder);
* the index as it was: any write to it drops the memo
  (:meth:`metasync.localdb.LocalDB.upsert_index`, ``delete_index``), and
  ``index`` holds sums over its rows that catch a writer that does not;
* the key file (size, mtime, inode) and the file system's device number.

:func:`answer` walks the folder with the scan's rules (:func:`metasync.worktree.scan`)
and recomputes the stamp. Equal stamps mean the full status would read the same
files against the same index rows, trust each one again, find the same tree
against the same head and settings, and so print the same answer: it is printed.
Anything else -- an ignore file, a special file, a file this user may not read,
a folder it cannot list, any error -- gives None, and the full CLI runs.
"""

from __future__ import annotations

import os
import stat
import sys
from array import array

try:  # the C module under sqlite3: sqlite3.dbapi2 imports datetime and collections first, ~4 ms
    from _sqlite3 import Error as DBError
    from _sqlite3 import connect
except ImportError:  # pragma: no cover - another Python
    from sqlite3 import Error as DBError
    from sqlite3 import connect

try:  # the C module under hashlib: hashlib loads OpenSSL first, a few milliseconds
    from _blake2 import blake2b
except ImportError:  # pragma: no cover - another Python
    from hashlib import blake2b

try:  # json's C scanner: the json package imports re for its pure-Python one, ~10 ms
    from _json import make_scanner
except ImportError:  # pragma: no cover - another Python
    make_scanner = None  # type: ignore[assignment,misc]

TYPE_CHECKING = False  # not typing's: importing typing costs start-up time
if TYPE_CHECKING:
    import sqlite3
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
#: The key file and the outbox folder in ``.metasync`` (metasync.context's KEY_FILE
#: and OUTBOX_DIR).
KEY_FILE = "key"
OUTBOX_DIR = "outbox"


class _JSONRules:
    """What json's C scanner reads of its decoder: strict strings, plain objects,
    floats and ints; no NaN or Infinity (json.dumps writes none into a memo)."""

    strict = True
    object_hook = None
    object_pairs_hook = None
    parse_float = float
    parse_int = int
    array_hook = None  # read from Python 3.15 on

    @staticmethod
    def parse_constant(name: str) -> None:
        raise ValueError(f"{name} in a memo")


def loads(text: str) -> Any:
    """``json.loads(text)`` for a document written by ``json.dumps`` (no white
    space around it), without importing json; ValueError if it is not one."""
    if make_scanner is None:  # pragma: no cover - another Python
        import json

        return json.loads(text)
    try:
        # A duck-typed context, as json.decoder passes (typeshed's stub wants the class).
        value, end = make_scanner(_JSONRules)(text, 0)  # type: ignore[arg-type]
    except StopIteration:
        raise ValueError("not a JSON document") from None
    if end != len(text):
        raise ValueError("more after the JSON document")
    return value


class _Decline(Exception):
    """The quick path cannot vouch for the answer: the full status runs."""


# --- the stamp, for both sides -------------------------------------------------------


def settings_digest(conn: sqlite3.Connection) -> str:
    """A digest of every row of the ``settings`` table but the memo itself."""
    h = blake2b(digest_size=32)
    for key, value in conn.execute(
            "SELECT key, value FROM settings WHERE key != ? ORDER BY key", (MEMO_KEY,)):
        h.update(f"{len(key)}:{key}\0{len(value)}:{value}\0".encode("utf-8", "surrogatepass"))
    return h.hexdigest()


class Found:
    """What the stamp holds of a scan, in the scan's order (a folder's entries as
    ``scandir`` gives them, folders depth first from a stack, as
    metasync.worktree.scan walks): each file's path, and its size, mtime, inode
    and exec bit (what decides whether its index row is trusted); each folder's
    path; each link's path and target."""

    __slots__ = ("dirs", "files", "links", "stats")

    def __init__(self) -> None:
        self.files: list[str] = []
        self.stats: list[int] = []  # four per file
        self.dirs: list[str] = []
        self.links: list[str] = []  # path, target

    def add(self, path: str, kind: str, size: int, mtime_ns: int, ino: int,
            executable: bool, target: str) -> None:
        """Add one scanned path (a metasync.worktree.ScanEntry's fields)."""
        if kind == "file":
            self.files.append(path)
            self.stats.extend((size, mtime_ns, ino, stat.S_IXUSR if executable else 0))
        elif kind == "link":
            self.links.extend((path, target))
        else:
            self.dirs.append(path)

    def digest(self) -> str:
        """The stamp's digest ("" if a number does not fit 64 bits: no stamp). No
        name or target holds a NUL, and the counts come first: one reading only."""
        try:
            numbers = array("q", self.stats).tobytes()
        except OverflowError:
            return ""
        h = blake2b(digest_size=32)
        h.update(f"{len(self.files)}\0{len(self.dirs)}\0{len(self.links)}\0".encode())
        text = "\0".join(self.files) + "\0" + "\0".join(self.dirs) + "\0" + "\0".join(self.links)
        h.update(text.encode("utf-8", "surrogatepass"))
        h.update(numbers)
        return h.hexdigest()


def index_check(conn: sqlite3.Connection) -> list[int]:
    """Sums over the index's rows, made by SQLite in one pass: a write by code that
    does not drop the memo (:meth:`metasync.localdb.LocalDB.upsert_index` does)
    changes them -- a file hashed again has a new ``hashed_at_ns``."""
    m = 2_147_483_647
    row = conn.execute(
        f"SELECT count(*), sum(hashed_at_ns % {m}), sum(mtime_ns % {m}), sum(ino % {m}), "
        f"sum(size % {m}), sum(length(ref)) FROM worktree").fetchone()
    return [int(v or 0) for v in row]


def key_stamp(meta: str) -> list[int] | None:
    """What the key file's change would show: size, mtime, inode (None: no file)."""
    try:
        st = os.lstat(os.path.join(meta, KEY_FILE))
    except FileNotFoundError:
        return None
    return [st.st_size, st.st_mtime_ns, st.st_ino]


def memo(conn: sqlite3.Connection, root: str, disk: str, device: int,
         answer: dict[str, Any]) -> dict[str, Any]:
    """The memo (:data:`MEMO_KEY`) for the clean ``answer`` (``{"json": ...,
    "text": ...}`` of an offline status) of a scan whose entries' :meth:`Found.digest`
    is ``disk``; read the settings after every other write of the command."""
    return {
        "v": MEMO_VERSION, "settings": settings_digest(conn), "disk": disk,
        "index": index_check(conn), "device": device,
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


#: Folders this deep (1: in the root) are shared between this process and a forked
#: helper, every other one to the helper (:func:`walk`); deeper ones go with them.
SHARE_DEPTHS = (2, 3)
#: The open flags of a folder the walk lists.
_DIR_FLAGS = os.O_RDONLY | sum(getattr(os, flag, 0) for flag in ("O_DIRECTORY", "O_NOFOLLOW",
                                                                  "O_CLOEXEC"))


def _list(top: int, rel_dir: str, depth: int, found: Found, stack: list[tuple[str, int]],
          me: int) -> None:
    """Add the entries of the folder ``rel_dir`` (under the folder open as ``top``)
    to ``found`` and push its folders on ``stack``; _Decline for what the scan
    would report. Each file is stat'ed by its name in its open folder (``fstatat``:
    the kernel looks up one name, not the whole path)."""
    try:
        fd = os.open(rel_dir or ".", _DIR_FLAGS, dir_fd=top)
    except OSError:
        raise _Decline(f"cannot list {rel_dir}") from None
    try:
        it = os.scandir(fd)  # its own copy of fd
    except OSError:
        os.close(fd)
        raise _Decline(f"cannot list {rel_dir}") from None
    files, stats, dirs, links = found.files, found.stats, found.dirs, found.links
    everything = me == 0
    prefix = f"{rel_dir}/" if rel_dir else ""
    deeper = depth + 1
    try:
        with it:
            for de in it:
                name = de.name
                if name[0] == "." and (name == META_DIR or name.startswith(TEMP_PREFIX)):
                    continue
                rel = prefix + name
                # A regular file first: most entries are, and it is one call.
                if not de.is_file(follow_symlinks=False):
                    if de.is_dir(follow_symlinks=False):
                        dirs.append(rel)
                        stack.append((rel, deeper))
                        continue
                    if de.is_symlink():
                        links.extend((rel, os.readlink(name, dir_fd=fd)))
                        continue
                st = de.stat(follow_symlinks=False)
                mode = st.st_mode
                if mode & 0o170000 != stat.S_IFREG:
                    raise _Decline(f"special file: {rel}")
                if not (everything or (st.st_uid == me and mode & stat.S_IRUSR)):
                    raise _Decline(f"maybe unreadable: {rel}")
                files.append(rel)
                stats.extend((st.st_size, st.st_mtime_ns, st.st_ino, mode & stat.S_IXUSR))
    finally:
        os.close(fd)


def _subtree(top: int, rel_dir: str, depth: int, me: int) -> Found:
    """Everything under the folder ``rel_dir``, in the scan's order."""
    found = Found()
    stack = [(rel_dir, depth)]
    while stack:
        rel, at = stack.pop()
        _list(top, rel, at, found, stack, me)
    return found


class _Helper:
    """A forked copy of this process that walks the subtrees it is sent while this
    one walks the rest: with one interpreter lock per process, the two lists and
    ``lstat``s run on two cores (threads would take turns; git stats its index's
    files from several threads too). Forked only when there is a subtree to share,
    and only where a fork copies nothing but this small process (Linux).

    Subtrees go as NUL-ended names on one pipe; at its end the helper sends back, on
    another, every subtree's :class:`Found` lists (``marshal``) or the reason to
    decline."""

    pid: int
    sent: int
    _to: int
    _back: int

    def __init__(self, top: int, me: int) -> None:
        if sys.platform == "win32":  # never made there (:func:`walk`)
            raise _Decline
        self.sent = 0
        opened: list[int] = []
        try:  # OSError (no descriptors, no processes left): none is left open
            to_r, self._to = os.pipe()
            opened += (to_r, self._to)
            self._back, back_w = os.pipe()
            opened += (self._back, back_w)
            self.pid = os.fork()
        except OSError:
            for fd in opened:
                os.close(fd)
            raise
        code = 1
        try:
            if self.pid == 0:  # the helper: never returns
                os.close(self._to)
                os.close(self._back)
                self._serve(top, me, to_r, back_w)
                code = 0
        finally:
            if self.pid == 0:
                os._exit(code)
        os.close(to_r)
        os.close(back_w)

    @staticmethod
    def _serve(top: int, me: int, names_fd: int, out_fd: int) -> None:
        import marshal

        results: list[Any] = []
        pending = b""
        try:
            while chunk := os.read(names_fd, 1 << 16):
                *names, pending = (pending + chunk).split(b"\0")
                for raw in names:
                    depth, _, rel = raw.decode("utf-8", "surrogatepass").partition(":")
                    f = _subtree(top, rel, int(depth), me)
                    results.append((f.files, f.stats, f.dirs, f.links))
            data = marshal.dumps(("ok", results))
        except Exception as exc:  # any failure: the parent declines
            data = marshal.dumps(("decline", f"{type(exc).__name__}: {exc}"))
        view = memoryview(data)
        while view:
            view = view[os.write(out_fd, view):]

    def send(self, rel: str, depth: int) -> int:
        """Have the helper walk the subtree at ``rel``; its number among those sent."""
        data = f"{depth}:{rel}\0".encode("utf-8", "surrogatepass")
        view = memoryview(data)
        try:
            while view:
                view = view[os.write(self._to, view):]
        except BrokenPipeError:
            pass  # the helper stopped (it declined): :meth:`results` says why
        self.sent += 1
        return self.sent - 1

    def results(self) -> list[Found]:
        """Every subtree's entries, in the order sent; _Decline as the helper did."""
        import marshal

        os.close(self._to)
        self._to = -1
        chunks = []
        while chunk := os.read(self._back, 1 << 20):
            chunks.append(chunk)
        try:  # a helper that died (killed, out of memory) sent nothing or part
            kind, body = marshal.loads(b"".join(chunks))
            if kind != "ok" or len(body) != self.sent:
                raise _Decline(f"the helper walk: {body}")
            out = []
            for files, stats, dirs, links in body:
                f = Found()
                f.files, f.stats, f.dirs, f.links = files, stats, dirs, links
                out.append(f)
        except (EOFError, ValueError, TypeError) as exc:
            raise _Decline(f"the helper walk: {exc}") from None
        return out

    def close(self) -> None:
        """Stop the helper (if still at work) and reap it."""
        for fd in (self._to, self._back):
            if fd >= 0:
                os.close(fd)
        self._to = self._back = -1
        try:
            os.kill(self.pid, 9)
            os.waitpid(self.pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass  # reaped already (a parent that ignores SIGCHLD has no zombies)


def walk(root: str, *, share: bool = True) -> Found:
    """Every file, folder and link under ``root`` by the scan's rules and in its
    order (metasync.worktree.scan); _Decline for anything the scan would report as
    a problem. A folder or a link is told by its directory entry's type; only
    files are stat'ed. One folder is open at a time besides ``root``.

    With ``share`` (on Linux), every other folder at :data:`SHARE_DEPTHS` is walked,
    with all below it, by a forked :class:`_Helper` while this process walks the
    rest. The order comes out the same: the walk takes folders from a stack, so a
    folder's whole subtree comes next after it, and is put there."""
    if sys.platform == "win32":  # never asked there (:func:`answer`)
        raise _Decline
    me = os.geteuid()
    # The root may be reached through a link (a folder's path, as the user gave it):
    # only folders inside it are never followed.
    top = os.open(root, _DIR_FLAGS & ~getattr(os, "O_NOFOLLOW", 0))
    helper: _Helper | None = None
    try:
        # This process's entries, and the helper's subtrees by number, in order.
        parts: list[Found | int] = [Found()]
        share = share and sys.platform == "linux"
        turn = False
        stack = [("", 0)]
        while stack:
            rel, depth = stack.pop()
            if share and depth in SHARE_DEPTHS:
                turn = not turn
                if turn:
                    if helper is None:
                        try:
                            helper = _Helper(top, me)
                        except OSError:  # no process to spare: walk alone
                            share = False
                    if helper is not None:
                        parts.append(helper.send(rel, depth))
                        parts.append(Found())
                        continue
            here = parts[-1]
            assert isinstance(here, Found)
            _list(top, rel, depth, here, stack, me)
        theirs = helper.results() if helper is not None else []
    finally:
        if helper is not None:
            helper.close()
        os.close(top)
    found = Found()
    for part in parts:
        got = theirs[part] if isinstance(part, int) else part
        found.files += got.files
        found.stats += got.stats
        found.dirs += got.dirs
        found.links += got.links
    return found


def _open_db(root: str) -> sqlite3.Connection:
    """``state.db``, read-only (what a URI's path cannot hold as it is, escaped)."""
    path = os.path.join(root, META_DIR, "state.db")
    path = path.replace("%", "%25").replace("?", "%3f").replace("#", "%23")
    return connect(f"file:{path}?mode=ro", uri=True, isolation_level=None)


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
    except (_Decline, OSError, DBError, ValueError, KeyError, TypeError, AttributeError,
            EOFError, RecursionError):
        return None


def _answer(root: str) -> dict[str, Any]:
    meta = os.path.join(root, META_DIR)
    if os.path.lexists(os.path.join(root, IGNORE_FILE)):
        raise _Decline("an ignore file")  # its rules are pathspec's: the full scan's
    # What opening the repository needs besides: the outbox folder (made if missing).
    if not os.path.isdir(os.path.join(meta, OUTBOX_DIR)):
        raise _Decline("no outbox folder")
    conn = _open_db(root)
    try:
        conn.execute("BEGIN")  # one snapshot of the settings and the index
        row = conn.execute("SELECT value FROM settings WHERE key = ?", (MEMO_KEY,)).fetchone()
        if row is None:
            raise _Decline("no memo")
        doc = loads(row[0])
        if not isinstance(doc, dict) or doc.get("v") != MEMO_VERSION:
            raise _Decline("no memo of this version")
        if doc["settings"] != settings_digest(conn):
            raise _Decline("the local state changed")
        if doc["index"] != index_check(conn):
            raise _Decline("the index changed")
        # The head commit is read from the local cache (else from a backend).
        head = conn.execute("SELECT value FROM settings WHERE key = 'head'").fetchone()
        if head is None or not conn.execute("SELECT 1 FROM objects WHERE object_id = ?",
                                            (loads(head[0]),)).fetchone():
            raise _Decline("the head commit is not cached")
        conn.execute("COMMIT")
    finally:
        conn.close()
    if doc["key"] != key_stamp(meta):
        raise _Decline("the key file changed")
    if doc["device"] != os.stat(root).st_dev:
        raise _Decline("another file system")
    if walk(root).digest() != doc["disk"]:
        raise _Decline("the folder changed")
    got = doc["answer"]
    if not isinstance(got.get("json"), str) or not isinstance(got.get("text"), list):
        raise _Decline("a malformed memo")
    return {"json": got["json"], "text": got["text"]}
