"""``metasync mount``: every version as a read-only folder (docs/mount.md).

The folder shows::

    latest/                       master, followed as it moves
    versions/<N>/                 each version this client knows the number of
    snapshots/<name>/             each snapshot
    by-date/<YYYY-MM-DD-HHMMSS>/  master and each of its first parents

through FUSE (mfusepy over libfuse). All of it is served by a
:class:`~metasync.reader.VersionReader`: listing and ``stat`` read only commits
and trees; a file's content is fetched chunk by chunk as it is read, verified.

The file system runs in the foreground and single-threaded (the reader and the
local database belong to one thread). libfuse's own handlers stop it on SIGINT,
SIGTERM and SIGHUP, and it unmounts on the way out; ``fusermount -u`` ends it
too. An error while reading (no backend has a good copy) is EIO for that call,
said in one line on stderr; the mount goes on.
"""

from __future__ import annotations

import errno
import os
import signal
import stat
import sys
import time
from dataclasses import dataclass
from typing import Any

import mfusepy

from metasync.errors import MetasyncError
from metasync.reader import FileReader, VersionReader

#: The top-level folders.
TOP = ("by-date", "latest", "snapshots", "versions")


@dataclass(frozen=True)
class Node:
    """What a path of the mount is: a folder of versions (``names``), or a path
    ``inner`` (``""``: the root) inside the tree of ``commit``."""

    names: list[str] | None = None
    commit: str | None = None
    inner: str = ""


def _fail(code: int) -> mfusepy.FuseOSError:
    return mfusepy.FuseOSError(code)


class MountView(mfusepy.Operations):
    """The FUSE operations of the read-only view (see the module docstring)."""

    use_ns = True

    def __init__(self, reader: VersionReader) -> None:
        self.reader = reader
        self.started_ns = time.time_ns()
        self.files: dict[int, FileReader] = {}
        self.next_fh = 1
        self.uid = self.gid = 0
        if sys.platform != "win32":  # FUSE is POSIX's (WinFsp's FUSE layer maps these)
            self.uid, self.gid = os.getuid(), os.getgid()

    # ---------------------------------------------------------------- paths
    def _versions_of(self, top: str) -> dict[str, str]:
        if top == "versions":
            return {str(n): c for n, c in self.reader.numbered().items()}
        if top == "snapshots":
            return self.reader.snapshots()
        return self.reader.by_date()

    def _node(self, path: str) -> Node:
        parts = [p for p in path.split("/") if p]
        if not parts:
            return Node(names=list(TOP))
        top, rest = parts[0], parts[1:]
        if top == "latest":
            commit = self.reader.latest().master
            if commit is None:  # nothing pushed yet: an empty folder
                if rest:
                    raise _fail(errno.ENOENT)
                return Node(names=[])
            return Node(commit=commit, inner="/".join(rest))
        if top not in TOP:
            raise _fail(errno.ENOENT)
        versions = self._versions_of(top)
        if not rest:
            return Node(names=sorted(versions, key=_natural))
        commit = versions.get(rest[0])
        if commit is None:
            raise _fail(errno.ENOENT)
        return Node(commit=commit, inner="/".join(rest[1:]))

    # ---------------------------------------------------------------- operations
    def getattr(self, path: str, fh: int | None = None) -> dict[str, Any]:
        node = self._guarded(self._node, path)
        base = {"st_uid": self.uid, "st_gid": self.gid, "st_nlink": 1}
        if node.commit is None:
            when = self.started_ns
            return {**base, **_times(when), "st_mode": stat.S_IFDIR | 0o555, "st_nlink": 2}
        if not node.inner:
            when = self._guarded(self.reader.commit_time, node.commit)
            return {**base, **_times(when), "st_mode": stat.S_IFDIR | 0o555, "st_nlink": 2}
        tree = self._guarded(self.reader.tree, node.commit)
        entry = tree.paths.get(node.inner)
        if entry is None:
            raise _fail(errno.ENOENT)
        times = _times(tree.time_ns)
        if entry.type == "dir":
            return {**base, **times, "st_mode": stat.S_IFDIR | 0o555, "st_nlink": 2}
        if entry.type == "link":
            return {**base, **times, "st_mode": stat.S_IFLNK | 0o777,
                    "st_size": len(os.fsencode(entry.ref))}
        mode = 0o555 if entry.executable else 0o444
        return {**base, **times, "st_mode": stat.S_IFREG | mode, "st_size": entry.size,
                "st_blocks": (entry.size + 511) // 512}

    def readdir(self, path: str, fh: int) -> list[str]:
        node = self._guarded(self._node, path)
        if node.names is not None:
            return [".", "..", *node.names]
        assert node.commit is not None
        tree = self._guarded(self.reader.tree, node.commit)
        names = tree.children.get(node.inner)
        if names is None:
            raise _fail(errno.ENOTDIR if node.inner in tree.paths else errno.ENOENT)
        return [".", "..", *names]

    def readlink(self, path: str) -> str:
        node = self._guarded(self._node, path)
        if node.commit is None or not node.inner:
            raise _fail(errno.EINVAL)
        entry = self._guarded(self.reader.tree, node.commit).paths.get(node.inner)
        if entry is None:
            raise _fail(errno.ENOENT)
        if entry.type != "link":
            raise _fail(errno.EINVAL)
        return entry.ref

    def open(self, path: str, flags: int) -> int:
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_TRUNC | os.O_APPEND):
            raise _fail(errno.EROFS)
        node = self._guarded(self._node, path)
        if node.commit is None or not node.inner:
            raise _fail(errno.EISDIR)
        try:
            reader = self._guarded(self.reader.open_file, node.commit, node.inner)
        except KeyError:
            raise _fail(errno.ENOENT if node.inner not in self.reader.tree(node.commit).paths
                        else errno.EISDIR) from None
        fh, self.next_fh = self.next_fh, self.next_fh + 1
        self.files[fh] = reader
        return fh

    def read(self, path: str, size: int, offset: int, fh: int) -> bytes:
        reader = self.files.get(fh)
        if reader is None:
            raise _fail(errno.EBADF)
        data: bytes = self._guarded(reader.read, offset, size)
        return data

    def release(self, path: str, fh: int) -> int:
        self.files.pop(fh, None)
        return 0

    def statfs(self, path: str) -> dict[str, int]:
        return {"f_bsize": 4096, "f_frsize": 4096, "f_namemax": 255}

    def _guarded(self, fn: Any, *args: Any) -> Any:
        """``fn(*args)``; a failure of metasync's (no good copy, a backend out of
        reach) or of the local disk (the cache) is said in one line and becomes EIO
        for this call."""
        try:
            return fn(*args)
        except (mfusepy.FuseOSError, KeyError):
            raise
        except (MetasyncError, OSError) as exc:
            print(f"metasync: mount: {' '.join(str(exc).split())}", file=sys.stderr, flush=True)
            raise _fail(errno.EIO) from None


def _times(ns: int) -> dict[str, int]:
    return {"st_mtime": ns, "st_ctime": ns, "st_atime": ns}


def _natural(name: str) -> tuple[int, str]:
    """Version numbers in numeric order, other names after them by name."""
    return (int(name), "") if name.isdigit() else (sys.maxsize, name)


def serve(reader: VersionReader, mountpoint: str) -> None:
    """Serve the view at ``mountpoint`` until it is unmounted or a SIGINT, SIGTERM
    or SIGHUP arrives (libfuse handles them, and unmounts)."""
    # libfuse installs its stop handlers only where a signal has the default action;
    # the CLI's Python handlers could not run while the main thread is in libfuse.
    stops = [signal.SIGINT, signal.SIGTERM]
    if sys.platform != "win32":
        stops.append(signal.SIGHUP)
    for sig in stops:
        signal.signal(sig, signal.SIG_DFL)
    signal.set_wakeup_fd(-1)
    try:
        mfusepy.FUSE(MountView(reader), mountpoint, foreground=True, nothreads=True, ro=True,
                     fsname="metasync", subtype="metasync", default_permissions=True)
    except RuntimeError as exc:  # libfuse could not mount (it said why on stderr)
        raise MetasyncError(f"mounting at {mountpoint} failed ({exc}); see the FUSE "
                            "message above") from None
