"""The change feed of a ``dir:`` backend: the operating system tells (inotify on
Linux, FSEvents on macOS, ReadDirectoryChangesW on Windows, through watchdog).

It watches the namespace folder itself (not its subfolders: the ``latest`` hint and
the descriptor live there) and, recursively, its ``log`` folder, where every commit
lands as a new entry (or a rewritten register) -- a push by another client fires it
at its commit point, even one that died before writing its hint. Objects are not
watched: they arrive before the log entry that names them, and watching their
thousands of folders would use up the user's inotify watches.

The kernel reports writes made through this machine's mount, whoever makes them:
local disks and FUSE filesystems of a device (exfat-fuse, ntfs-3g, fusefat). It
cannot report what another machine writes to a network filesystem (NFS, SMB,
sshfs, a cloud mount): there, and wherever the watch cannot start (no inotify
watches left), :func:`dir_feed` gives a :class:`~.feeds.PollingFeed` instead.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

from metasync.backends.feeds import ChangeFeed, PollingFeed
from metasync.backends.keys import TEMP_PREFIX
from metasync.backends.publish import _mount_of, _volume_kind
from metasync.errors import BackendUnavailable

#: The folder of the log entries, below the namespace folder (docs/FORMAT.md).
LOG_FOLDER = "log"
#: Seconds between checks that the watched folder is still there (a stat each).
ALIVE_EVERY = 2.0

#: Filesystem types another machine may write to: their events come only from this
#: machine's writes, so a watch would stay silent on what matters.
NETWORK_FILESYSTEMS = frozenset({
    "nfs", "nfs4", "cifs", "smb3", "smbfs", "9p", "afs", "ceph", "glusterfs", "lustre",
    "gpfs", "ocfs2", "gfs2", "davfs", "coda", "ncpfs", "virtiofs", "orangefs",
})
#: FUSE drivers of a local device (``fuse.NAME`` or ``fuseblk``): every write to them
#: passes through this machine's kernel. Any other FUSE filesystem may be a network
#: one (sshfs, rclone mount, s3fs), so it is polled.
LOCAL_FUSE = frozenset({"fuseblk", "fuse.exfat", "fuse.exfat-fuse", "fuse.ntfs-3g",
                        "fuse.ntfs", "fuse.fusefat", "fuse.fatfuse"})


def watchable(path: str) -> bool:
    """Whether the kernel sees every write to ``path``'s filesystem (a local one).
    True where the mount table cannot be read (macOS, Windows: their watch APIs
    cover their local disks; a network share there is the user's to poll)."""
    mount = _mount_of(path)
    if mount is None:
        return True
    _, fstype, source = mount
    if fstype.startswith("fuse"):
        # A known driver, or one whose source is a device or image with a disk's
        # filesystem on it (ntfs-3g on an image mounts as plain "fuse").
        return fstype in LOCAL_FUSE or _volume_kind(source) is not None
    return fstype not in NETWORK_FILESYSTEMS


class DirFeed(ChangeFeed):
    """Fires on any entry written, renamed or removed in the namespace folder or below
    its ``log`` folder (temporary files of writes in progress excepted: their rename
    into place fires). Started at the first :meth:`wait`."""

    kind = "notify"

    def __init__(self, root: str) -> None:
        self.root = root
        self._fired = threading.Event()
        self._closed = threading.Event()
        self._observer: Any = None
        self._identity: tuple[int, int] | None = None
        self._log_watched = False
        self._waited = False

    def start(self) -> None:
        """Start watching; raise OSError where the watch cannot start (the folder is
        gone, no inotify watches left)."""
        from watchdog.events import FileSystemEvent, FileSystemEventHandler
        from watchdog.observers import Observer

        feed = self

        class Handler(FileSystemEventHandler):
            def on_any_event(self, event: FileSystemEvent) -> None:
                if event.event_type in ("opened", "closed_no_write"):
                    return
                if event.is_directory and event.event_type == "modified":
                    return  # a folder's own times: its entries' events say what changed
                for raw in (event.src_path, getattr(event, "dest_path", "")):
                    path = os.fsdecode(raw) if raw else ""
                    if path == log_folder and not feed._log_watched:
                        feed._watch_log(self)  # the first push made the log folder
                    if path and not os.path.basename(path).startswith(TEMP_PREFIX):
                        feed._fired.set()

        log_folder = os.path.join(self.root, LOG_FOLDER)
        st = os.stat(self.root)
        self._identity = (st.st_dev, st.st_ino)
        observer = Observer()
        self._observer = observer
        handler = Handler()
        observer.schedule(handler, self.root, recursive=False)
        if os.path.isdir(log_folder):
            self._watch_log(handler)
        observer.daemon = True
        try:
            observer.start()
        except BaseException:
            self._observer = None
            observer.stop()
            raise

    def _watch_log(self, handler: Any) -> None:
        """Watch the log folder and below (new log folders are watched as they come)."""
        observer = self._observer
        if observer is None or self._log_watched:
            return
        try:
            observer.schedule(handler, os.path.join(self.root, LOG_FOLDER), recursive=True)
        except OSError:
            return  # gone again, or no watches left: the hint still fires
        self._log_watched = True

    def wait(self, timeout: float) -> bool:
        if self._observer is None or not self._waited:
            # The first call establishes the starting point (the watch runs from
            # dir_feed on, so what came since is kept for the next call).
            if self._observer is None and not self._closed.is_set():
                self.start()
            self._waited = True
            return False
        # The folder is looked at (one stat) every ALIVE_EVERY seconds: a move or an
        # unmount of a folder above it sends the watch no event, and a backend that
        # is gone must be said (and its hint polled) at once, not after a long wait.
        deadline = time.monotonic() + timeout
        while True:
            fired = self._fired.wait(max(0.0, min(ALIVE_EVERY, deadline - time.monotonic())))
            if self._closed.is_set():
                return False
            self._check_alive()
            if fired or time.monotonic() >= deadline:
                break
        if fired:
            self._fired.clear()
        return fired

    def _check_alive(self) -> None:
        """Raise :class:`BackendUnavailable` if the watch can no longer see changes:
        the folder was removed, replaced or unmounted (its watch ends with it), or
        the watching thread stopped. The caller starts a new feed later."""
        try:
            st = os.stat(self.root)
        except OSError as exc:
            raise BackendUnavailable(f"backend folder {self.root} is missing or "
                                     f"unreachable ({exc.strerror}); its watch stopped") from exc
        if (st.st_dev, st.st_ino) != self._identity or not self._observer.is_alive():
            raise BackendUnavailable(f"the watch of backend folder {self.root} stopped "
                                     "(the folder was replaced or remounted)")

    def close(self) -> None:
        self._closed.set()
        self._fired.set()  # unblocks a wait in progress
        observer, self._observer = self._observer, None
        if observer is not None:
            observer.stop()
            if observer is not threading.current_thread():
                observer.join(timeout=5)


def dir_feed(backend: Any, root: str, watch_key: str | None) -> ChangeFeed | None:
    """The feed of the ``dir:`` backend ``backend`` at namespace folder ``root``,
    watching from now on: a :class:`DirFeed` where the kernel sees every write
    (:func:`watchable`) and a watch starts, else a :class:`PollingFeed` on
    ``watch_key`` (None without one). A missing folder raises
    :class:`BackendUnavailable` (the caller asks again later)."""
    if watchable(root):
        feed = DirFeed(root)
        try:
            feed.start()
            return feed
        except OSError as exc:
            if not os.path.isdir(root):
                raise BackendUnavailable(f"backend folder {root} is missing or unreachable "
                                         f"({exc.strerror or exc})") from exc
            # No watches left (ENOSPC) or none on this filesystem: look instead.
    return PollingFeed(backend, watch_key) if watch_key is not None else None
