"""Change feeds: how a client learns, cheaply and at once, that a backend changed.

The MetaSync paper's backend abstraction has ``poll(path)``, built on the
provider's own change notification. A :class:`ChangeFeed` is that: the watch
daemon blocks in :meth:`ChangeFeed.wait` on each acceptor (one thread each) and
reads the acceptors' ``latest`` hints only when some feed fired. Each backend
kind returns its own feed from :meth:`Backend.change_feed` and declares its
kind in ``Capabilities.change_feed``:

- ``longpoll``: the service holds a request open until something changes
  (Dropbox ``list_folder/longpoll``, Box's event long-poll);
- ``cursor``: a saved cursor/page token asked "what changed since?" at an
  interval (Google Drive ``changes.list``, OneDrive ``delta``): one cheap
  request per interval;
- ``notify``: the operating system tells (``dir:``, inotify on the log folder);
- ``poll``: nothing better than reading the hint, at an interval that grows
  while nothing changes and is short right after a change (S3, SFTP, WebDAV).

A feed may fire when nothing relevant changed (a false alarm costs one hint
read per acceptor); it must not stay silent after a change for longer than its
interval. Nothing a feed returns is trusted beyond "look again".
"""

from __future__ import annotations

import abc

#: The kinds ``Capabilities.change_feed`` names, best first.
FEED_KINDS = ("notify", "longpoll", "cursor", "poll")


class ChangeFeed(abc.ABC):
    """One backend's change notification for one namespace. Not shared between
    threads except for :meth:`close`, which any thread may call."""

    #: One of :data:`FEED_KINDS`.
    kind: str = "poll"

    @abc.abstractmethod
    def wait(self, timeout: float) -> bool:
        """Block for at most ``timeout`` seconds (also bounded by the backend's own
        ``--timeout`` per request); return True if the namespace may have changed
        since the previous call (the first call only establishes the starting
        point and may return False at once), False if the time ran out with no
        change seen. A network failure raises the usual :class:`BackendError`;
        the caller backs off and calls again. Returns promptly after :meth:`close`."""

    @abc.abstractmethod
    def close(self) -> None:
        """Unblock a :meth:`wait` in progress and release what the feed holds.
        Idempotent."""
