"""The client side of ``metasync status``'s fast path: ask the daemon (or the
service) that watches this folder for the answer instead of scanning it.

The daemon serves each folder's status on a unix socket in the folder's
``.metasync`` (:data:`SOCKET_NAME`, see :mod:`metasync.watch_status`). This module
is what ``metasync status`` loads before anything else, so it imports nothing but
the standard library's basics: the fast path exists to skip the start-up cost of
the full CLI and the scan.

Trust: the answer is used only from a socket that the user running this command
owns, with no access for anyone else, in a ``.metasync`` folder the user owns
that no one else can write to; on Linux the process listening on it must also
run as this user (``SO_PEERCRED``). Anything else, any error, a daemon that does
not answer in time or answers something malformed: ``None``, and the caller
scans as it always did. No fast path where the OS has no unix sockets (Windows).
"""

from __future__ import annotations

# The C module under `socket`: the Python one loads selectors, enum and array first,
# a few milliseconds this path exists to save.
import _socket
import os
import stat
import sys

TYPE_CHECKING = False  # not typing's: importing typing costs start-up time
if TYPE_CHECKING:
    from typing import Any

#: The folder's metadata folder (metasync.worktree.META_DIR).
META_DIR = ".metasync"
#: The socket in ``.metasync`` the daemon answers ``status`` on.
SOCKET_NAME = "daemon.sock"
#: Version of the request/answer documents; a daemon of another version is not asked.
PROTOCOL = 1
#: Longest wait for the daemon's answer (a cache miss scans the folder first).
ANSWER_TIMEOUT = 120.0
#: Longest answer read (a folder with very many changes): anything longer is dropped.
MAX_ANSWER = 256 * 1024 * 1024
#: macOS's limit on a socket path is 104 bytes (Linux 108): beyond it, no fast path
#: except through Linux's /proc/self/fd.
MAX_SOCKET_PATH = 100


def find_root(start: str) -> str | None:
    """The folder containing ``start`` that has a repository, searching upwards as
    :func:`metasync.ownership.find_root` does (without its ownership check: that
    is :func:`_open_meta`'s and the scan's)."""
    path = os.path.abspath(start)
    while True:
        if os.path.isfile(os.path.join(path, META_DIR, "state.db")):
            return path
        parent = os.path.dirname(path)
        if parent == path:
            return None
        path = parent


def _private(st: os.stat_result, others: int) -> bool:
    """``st`` belongs to this process's user and grants ``others`` to no one else."""
    if sys.platform == "win32":
        return False  # no user ids to check by: no fast path
    return st.st_uid == os.geteuid() and not st.st_mode & others


def _open_meta(root: str) -> int | None:
    """A descriptor of ``root/.metasync`` if it is a real folder of this user that
    no one else can write to, else None."""
    flags = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(os.path.join(root, META_DIR), flags)
    except OSError:
        return None
    st = os.fstat(fd)
    if not stat.S_ISDIR(st.st_mode) or not _private(st, 0o022):
        os.close(fd)
        return None
    return fd


def socket_address(meta_fd: int, meta: str) -> str | None:
    """The address to reach ``meta``'s socket by: through the open descriptor on
    Linux (``/proc/self/fd``: no path length limit, and the folder checked is the
    one connected to), else the path when it is short enough, else None."""
    if sys.platform.startswith("linux") and os.path.isdir("/proc/self/fd"):
        return f"/proc/self/fd/{meta_fd}/{SOCKET_NAME}"
    path = os.path.join(meta, SOCKET_NAME)
    return path if len(os.fsencode(path)) <= MAX_SOCKET_PATH else None


def peer_uid(sock: _socket.socket) -> int | None:
    """The user id of the process at the other end of ``sock`` (Linux: ``struct
    ucred``, three native ints: pid, uid, gid), else None."""
    option = getattr(_socket, "SO_PEERCRED", None)
    if option is None:
        return None
    creds = sock.getsockopt(_socket.SOL_SOCKET, option, 12)
    return int.from_bytes(creds[4:8], sys.byteorder)


def ask(cwd: str, offline: bool, timeout: float = ANSWER_TIMEOUT) -> dict[str, Any] | None:
    """The daemon's answer for the repository containing ``cwd``: ``{"json": the
    text ``status --json`` prints, "text": [[stream, line], ...] the text form
    prints ("out": stdout unless --quiet, "err": stderr), "how": "cache" or
    "scan"}``; None when no daemon of this user answers (see the module doc)."""
    if not hasattr(_socket, "AF_UNIX") or not hasattr(os, "geteuid"):
        return None
    root = find_root(cwd)
    if root is None:
        return None
    meta = os.path.join(root, META_DIR)
    fd = _open_meta(root)
    if fd is None:
        return None
    try:
        try:
            st = os.stat(SOCKET_NAME, dir_fd=fd, follow_symlinks=False)
        except OSError:
            return None  # no daemon (the common case)
        if not stat.S_ISSOCK(st.st_mode) or not _private(st, 0o077):
            return None
        address = socket_address(fd, meta)
        if address is None:
            return None
        return _exchange(address, {"v": PROTOCOL, "offline": offline}, timeout)
    finally:
        os.close(fd)


def _exchange(address: str, request: dict[str, Any], timeout: float) -> dict[str, Any] | None:
    if sys.platform == "win32":
        return None
    try:
        sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    except OSError:
        return None
    try:
        sock.settimeout(timeout)
        sock.connect(address)
        uid = peer_uid(sock)
        if uid is not None and uid != os.geteuid():
            return None  # someone else's process listens there
        import json  # only with a daemon to ask: json's decoder imports re, ~10 ms

        sock.sendall(json.dumps(request).encode() + b"\n")
        sock.shutdown(_socket.SHUT_WR)
        chunks, size = [], 0
        while chunk := sock.recv(1 << 16):
            chunks.append(chunk)
            size += len(chunk)
            if size > MAX_ANSWER:
                return None
    except OSError:
        return None  # a stale socket (refused), a daemon that stopped or hangs
    finally:
        sock.close()
    try:
        reply = json.loads(b"".join(chunks))
    except ValueError:
        return None
    return _valid(reply)


def _valid(reply: Any) -> dict[str, Any] | None:
    """The answer in ``reply`` if it is one (``ok`` and well formed), else None."""
    if not isinstance(reply, dict) or reply.get("v") != PROTOCOL or reply.get("ok") is not True:
        return None
    answer = reply.get("answer")
    if not isinstance(answer, dict) or not isinstance(answer.get("json"), str):
        return None
    text = answer.get("text")
    if not isinstance(text, list) or not all(
            isinstance(t, list) and len(t) == 2 and t[0] in ("out", "err")
            and isinstance(t[1], str) for t in text):
        return None
    return answer


def emit(answer: dict[str, Any], as_json: bool, quiet: bool) -> None:
    """Print ``answer`` as ``metasync status`` does (``--json``: the document;
    else the text lines, stdout's unless ``quiet``), flushing after each line as
    ``click.echo`` does so that stdout and stderr interleave the same way."""
    if as_json:
        _write(sys.stdout, answer["json"])
        return
    for stream, line in answer["text"]:
        if stream == "err":
            _write(sys.stderr, line)
        elif not quiet:
            _write(sys.stdout, line)


def _write(stream: Any, line: str) -> None:
    stream.write(line + "\n")
    stream.flush()
