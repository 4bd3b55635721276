"""``metasync status`` answered by the daemon that watches the folder (its fast
path; docs/daemon.md, "status from the watch").

What ``status`` prints is made here, for both paths: :func:`scan_answer` (the
scan a command makes, and the daemon on a cache miss) and :func:`render`.

The daemon (one per folder, or each folder's thread in the service) serves the
answer on ``.metasync/daemon.sock`` (:mod:`metasync.watch_client` is the other
end). It keeps the :class:`~metasync.committer.Status` of its last scan and
answers from it while nothing that could change it happened since:

* the folder: no watch event on a path that syncs (the daemon's own rule: not
  ``.metasync``, not a checkout's temporary files, not an ignored path; the
  ignore file itself counts). Events arrive late (inotify is asynchronous), so
  each request first creates a *cookie* file in ``.metasync`` and waits for its
  event: every event of a change made before the request was then seen (one
  event queue, in order; watchman's and git's fsmonitor's method);
* the repository's state: SQLite's ``data_version`` of ``state.db`` unchanged
  (any commit by another connection changes it: a commit, a push, a pull, the
  daemon's own sync), and the same ``state.db`` file.

Else it scans, exactly as the command does (the same code, under the folder's
lock), and keeps that. The lock is taken for every answer: while a command or
the daemon's sync holds it (a push in progress), the daemon says "busy" and the
command scans by itself -- it then says what it always said then. The part that
asks the backends (the newest version: ``latest``, ``behind``) is asked on every
request without ``--offline``, as the command does: the same answer, not one as
old as the last poll.
"""

from __future__ import annotations

import atexit
import errno
import itertools
import json
import logging
import os
import socket
import sqlite3
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from metasync.committer import Status
from metasync.errors import FolderBusy, MetasyncError
from metasync.names import display_path, text_only
from metasync.progress import NullReporter
from metasync.repository import Repository
from metasync.watch_client import PROTOCOL, SOCKET_NAME, peer_uid, socket_address
from metasync.worktree import META_DIR

if TYPE_CHECKING:  # loaded by the online standing only (start-up time)
    from metasync.history import Standing

#: Cookie files in ``.metasync`` that mark a point in the event stream.
COOKIE_PREFIX = "status-cookie-"
#: Longest wait for a cookie's event (a rename's event is held up to 0.5 s by
#: watchdog to pair it; a loaded machine is slower): then the command scans.
COOKIE_TIMEOUT = 5.0
#: Longest a connected client may take to send its request.
REQUEST_TIMEOUT = 5.0

#: ``[stream, line]`` pairs of the text form: "out" (stdout, not with --quiet), "err".
TextLines = list[list[str]]


# --- what status prints -------------------------------------------------------------


def standing_line(standing: Standing) -> str | None:
    """The line on where the folder is against master (None when level)."""
    def plural(n: int, what: str) -> str:
        return f"{n} {what}{'' if n == 1 else 's'}"

    behind, ahead = standing.behind, standing.ahead
    if behind and ahead:
        return (f"Your folder has diverged from master: {plural(ahead, 'local commit')} not "
                f"pushed, {plural(behind, 'version')} not pulled; run metasync push (it merges)")
    if behind:
        return f"Your folder is behind master by {plural(behind, 'version')}; run metasync pull"
    if ahead:
        return (f"Your folder is ahead of master by {plural(ahead, 'local commit')}; "
                "run metasync push")
    return None


def render(st: Status, standing: Standing | None, unknown: str) -> dict[str, Any]:
    """What ``status`` prints for the scan ``st`` and ``standing`` (None: not asked,
    ``--offline``, or not learned: ``unknown`` says why): ``{"json": the --json
    document's text, "text": [[stream, line], ...]}``."""
    doc = st.to_json()
    doc.update({"unfinished_clone": False, "latest": standing.latest if standing else None,
                "behind": standing.behind if standing else None,
                "ahead": standing.ahead if standing else None})
    text: TextLines = []

    def out(line: str) -> None:
        text.append(["out", line])

    out(f"On version {st.version}" + (" (local commits not pushed)" if st.unpushed else ""))
    if st.sparse_patterns:
        plural = "" if len(st.sparse_patterns) == 1 else "s"
        out(f"sparse: {len(st.sparse_patterns)} pattern{plural}, {st.outside} "
            f"{'path' if st.outside == 1 else 'paths'} not checked out here")
    if unknown:
        text.append(["err", f"note: could not learn the newest version ({unknown})"])
    elif standing is not None and (line := standing_line(standing)) is not None:
        out(line)
    if not st.changes and not st.problems.unreadable:
        out("Nothing to commit, folder clean")
    symbols = {"added": "A", "modified": "M", "deleted": "D"}
    for c in st.changes:
        suffix = "/" if c.type == "dir" else ""
        out(f"  {symbols[c.kind]} {display_path(c.path + suffix)}")
    for u in st.problems.unreadable:
        out(f"  cannot read: {display_path(u.display())} ({u.reason})")
    for u in st.problems.special:
        out(f"  skipped: {display_path(u.display())} ({u.reason})")
    return {"json": json.dumps(text_only(doc), indent=2), "text": text}


def learn_standing(repo: Repository, offline: bool) -> tuple[Standing | None, str]:
    """``repo``'s standing against master, or why it could not be learned."""
    if offline:
        return None, ""
    try:
        return repo.history.standing(), ""
    except MetasyncError as exc:
        return None, str(exc)


def scan_answer(repo: Repository, offline: bool) -> dict[str, Any]:
    """``status``'s answer by scanning the folder (the command without a daemon); for
    an unfinished clone, that it is one and how to finish it (no scan: the folder
    holds part of the tree, not changes, and is left as it is)."""
    if repo.unfinished_clone:
        return unfinished_clone_answer(repo)
    st = repo.status()
    if st.quick is not None:  # clean: kept for the quick path (metasync.quickstatus)
        repo.keep_status_answer(st, render(st, None, ""))
    return render(st, *learn_standing(repo, offline))


def unfinished_clone_answer(repo: Repository) -> dict[str, Any]:
    """What ``status`` says in a clone stopped before its first pull ended."""
    version = repo.prev.number
    doc: dict[str, Any] = {"version": version, "head": repo.head, "unpushed": False,
                           "clean": False, "unfinished_clone": True, "changes": []}
    text: TextLines = [
        ["out", f"Unfinished clone (at version {version}): it stopped before all its files "
                "were written"],
        ["out", f"run `metasync pull` here, or the same `metasync clone` into {repo.root} "
                "again, to finish it"]]
    return {"json": json.dumps(doc, indent=2), "text": text}


# --- the daemon's side ---------------------------------------------------------------


class _Refused(Exception):
    """The daemon cannot answer this time; the command scans by itself."""


@dataclass
class _Cached:
    status: Status
    events: int
    db: tuple[int, ...]


class StatusServer:
    """Serves ``root``'s status on ``.metasync/daemon.sock`` from the watch of
    ``observer`` (the daemon's watchdog observer: its events are read by a handler
    added to its watches), ``relevant`` being the daemon's rule of which paths
    sync. :meth:`start` listens (in its own thread); :meth:`stop` ends it and
    removes the socket. ``answers`` counts answers by how they were made."""

    def __init__(self, root: Path, observer: Any, relevant: Callable[[str], bool],
                 log: logging.Logger) -> None:
        self.root = root
        self.meta = root / META_DIR
        self.relevant = relevant
        self.log = log
        self.answers = {"cache": 0, "scan": 0, "refused": 0}
        self._observer = observer
        self._cond = threading.Condition()
        self._events = 0  # relevant events seen so far
        self._cookies: dict[str, threading.Event] = {}
        self._serial = itertools.count()
        self._cached: _Cached | None = None
        self._db: sqlite3.Connection | None = None
        self._db_id: tuple[int, ...] = ()
        self._sock: socket.socket | None = None
        self._sock_id: tuple[int, int] | None = None
        self._stop_lock = threading.Lock()
        self._stopped = False
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._refused = ""  # why the last request was not answered

    # --- events ------------------------------------------------------------------
    def _attach(self) -> None:
        from watchdog.events import FileSystemEvent, FileSystemEventHandler

        server = self

        class Handler(FileSystemEventHandler):
            def on_any_event(self, event: FileSystemEvent) -> None:
                if event.event_type in ("opened", "closed_no_write"):
                    return
                paths = [os.fsdecode(p) for p in (event.src_path, getattr(event, "dest_path", ""))
                         if p]
                server._saw(paths)

        handler = Handler()
        for emitter in list(self._observer.emitters):
            self._observer.add_handler_for_watch(handler, emitter.watch)

    def _saw(self, paths: list[str]) -> None:
        """One watch event (from the observer's thread, in the order they happened)."""
        for path in paths:
            head, name = os.path.split(path)
            if name.startswith(COOKIE_PREFIX) and head == str(self.meta):
                with self._cond:
                    seen = self._cookies.get(name)
                if seen is not None:
                    seen.set()
        try:
            relevant = any(self.relevant(p) for p in paths)
        except Exception:  # never in the watch's way; unsure: it counts
            relevant = True
        if relevant:
            with self._cond:
                self._events += 1

    def _catch_up(self) -> int:
        """Wait until every event of a change made before this call was seen; the
        count of relevant events then. _Refused if the cookie's event does not come
        (the watch stopped, a queue overflowed)."""
        name = f"{COOKIE_PREFIX}{os.getpid()}-{next(self._serial)}"
        seen = threading.Event()
        with self._cond:
            self._cookies[name] = seen
        path = self.meta / name
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            os.close(fd)
            try:
                if not seen.wait(COOKIE_TIMEOUT):
                    raise _Refused(f"the watch did not report a change within {COOKIE_TIMEOUT:g} s")
            finally:
                path.unlink(missing_ok=True)
        except OSError as exc:
            raise _Refused(f"cannot mark the watch: {exc}") from None
        finally:
            with self._cond:
                self._cookies.pop(name, None)
        with self._cond:
            return self._events

    def _db_state(self) -> tuple[int, ...]:
        """Changes whenever anything is committed to ``state.db`` by another
        connection (SQLite's ``data_version``), or the file is another one."""
        path = self.meta / "state.db"
        st = os.stat(path)
        file_id = (st.st_dev, st.st_ino)
        if self._db is None or self._db_id[:2] != file_id:
            if self._db is not None:
                self._db.close()
            from urllib.request import pathname2url  # the daemon's only (start-up time)

            uri = f"file:{pathname2url(str(path))}?mode=ro"
            self._db = sqlite3.connect(uri, uri=True, check_same_thread=False)
            self._db_id = (*file_id, next(self._serial))
        (version,) = self._db.execute("PRAGMA data_version").fetchone()
        return (*self._db_id, int(version))

    # --- answers -------------------------------------------------------------------
    def answer(self, offline: bool) -> tuple[dict[str, Any], str]:
        """The answer ``status`` prints and how it was made ("cache" or "scan");
        _Refused when the command must scan by itself."""
        events = self._catch_up()
        notes = NullReporter()
        try:
            repo = Repository.open(self.root, notes, wait=0)
        except FolderBusy:
            raise _Refused("the folder is busy (a sync or a command)") from None
        with repo:
            cached, how = self._cached, "cache"
            if cached is None or cached.events != events or cached.db != self._db_state():
                how = "scan"
                st = repo.status()
                cached = self._cached = _Cached(st, events, self._db_state())
            standing, unknown = learn_standing(repo, offline)
        if notes.notes:
            # The command would print these too; it says them itself.
            raise _Refused("notes: " + "; ".join(notes.notes))
        return render(cached.status, standing, unknown), how

    def _handle(self, conn: socket.socket) -> None:
        conn.settimeout(REQUEST_TIMEOUT)
        if sys.platform == "win32":
            return  # never started there (start() refuses)
        uid = peer_uid(conn)
        if uid is not None and uid != os.geteuid():
            return  # only the user's own commands are answered
        data = b""
        while len(data) < 4096 and (chunk := conn.recv(4096)):
            data += chunk
            if b"\n" in data:
                break
        reply: dict[str, Any] = {"v": PROTOCOL, "ok": False}
        try:
            request = json.loads(data)
            if not isinstance(request, dict) or request.get("v") != PROTOCOL:
                raise _Refused(f"not a status request of version {PROTOCOL}")
            answer, how = self.answer(bool(request.get("offline")))
            reply.update(ok=True, answer={**answer, "how": how})
            self.answers[how] += 1
        except (_Refused, ValueError, MetasyncError, OSError, sqlite3.Error) as exc:
            self.answers["refused"] += 1
            reply["why"] = str(exc)
            if reply["why"] != self._refused:  # said once, not at every request
                self.log.info("`metasync status` scans by itself: %s", exc)
            self._refused = reply["why"]
        except Exception as exc:  # a bug: the command scans; the daemon goes on
            self.answers["refused"] += 1
            reply["why"] = f"internal error: {type(exc).__name__}"
            self.log.exception("status not answered")
        conn.sendall(json.dumps(reply).encode())

    # --- the socket ----------------------------------------------------------------
    def start(self) -> None:
        """Listen on ``.metasync/daemon.sock`` (0600, in the 0700 ``.metasync``);
        OSError if it cannot (always on Windows: no user ids to check a caller by)."""
        if sys.platform == "win32":
            raise OSError(errno.ENOTSUP, "no status socket on Windows")
        self._attach()
        meta_fd = os.open(self.meta, os.O_RDONLY)
        try:
            address = socket_address(meta_fd, str(self.meta))
            if address is None:
                raise OSError(errno.ENAMETOOLONG, "the socket's path is too long", str(self.meta))
            try:
                os.unlink(SOCKET_NAME, dir_fd=meta_fd)  # a crashed daemon's (this one holds the lock)
            except FileNotFoundError:
                pass
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                try:
                    os.fchmod(sock.fileno(), 0o600)  # Linux: the file is made with this mode
                except OSError:
                    pass
                sock.bind(address)
                os.chmod(address, 0o600)
                st = os.stat(SOCKET_NAME, dir_fd=meta_fd, follow_symlinks=False)
                sock.listen(16)
            except BaseException:
                sock.close()
                raise
        finally:
            os.close(meta_fd)
        self._sock, self._sock_id = sock, (st.st_dev, st.st_ino)
        self._thread = threading.Thread(target=self._serve, name=f"status {self.root.name}",
                                        daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        assert self._sock is not None
        while not self._stopping.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                break  # closed by stop()
            with conn:
                try:
                    self._handle(conn)
                except OSError:
                    pass  # the command went away

    def stop(self) -> None:
        """Stop answering; remove the socket if it is still this server's. Once: the
        watch's end and the process's exit may both ask (:func:`answer_status`), and
        the second returns only when the first is done."""
        with self._stop_lock:  # held throughout: a second caller returns once it is done
            if self._stopped:
                return
            self._stopped = True
            self._stopping.set()
            if self._sock is not None:
                try:
                    st = os.stat(self.meta / SOCKET_NAME, follow_symlinks=False)
                    if (st.st_dev, st.st_ino) == self._sock_id:
                        (self.meta / SOCKET_NAME).unlink()
                except OSError:
                    pass
                try:
                    self._sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                self._sock.close()
            if self._thread is not None:
                self._thread.join(timeout=10)
            if self._db is not None:
                self._db.close()


def answer_status(observer: Any, root: Path, relevant: Callable[[str], bool],
                  log: logging.Logger) -> Any:
    """Answer ``status`` for the daemon of ``root`` from the watch of ``observer``
    (the daemon's started watchdog observer, or None without a watch) until the
    observer stops; returns ``observer``. Where it cannot (no watch, no unix
    sockets, the socket cannot be made: logged), ``status`` scans by itself."""
    if observer is None or not hasattr(socket, "AF_UNIX") or not hasattr(os, "geteuid"):
        return observer  # no unix sockets, or no owners to check them by (Windows)
    server = StatusServer(root, observer, relevant, log)
    try:
        server.start()
    except OSError as exc:
        log.warning("`metasync status` scans without the daemon's help: cannot listen "
                    "on %s (%s)", root / META_DIR / SOCKET_NAME, exc)
        server.stop()
        return observer
    # The answers end with the watch they come from: when the daemon stops it. This
    # thread may not get its turn before the process exits (it is a daemon thread,
    # so that a watch that never ends cannot hold the exit): the exit stops the
    # server too, so no socket is left behind.
    def end_with_the_watch() -> None:
        observer.join()
        server.stop()
        atexit.unregister(server.stop)

    atexit.register(server.stop)
    threading.Thread(target=end_with_the_watch, daemon=True, name=f"status end {root.name}").start()
    return observer
