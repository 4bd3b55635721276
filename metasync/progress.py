"""Progress reporting hooks, and cancellation. The core reports; the CLI decides
how to show it, and tells the core when the user asked it to stop."""

from __future__ import annotations

import threading
from typing import BinaryIO, Protocol, cast

from metasync.errors import Interrupted


class Reporter(Protocol):
    """Receives progress of one transfer phase at a time (bytes)."""

    def start(self, label: str, total: int) -> None: ...

    def advance(self, amount: int) -> None: ...

    def finish(self) -> None: ...

    def note(self, message: str) -> None:
        """A line worth telling the user (a conflict copy, a skipped file)."""
        ...


class NullReporter:
    """Reports nothing; notes are collected so scripts can read them."""

    def __init__(self) -> None:
        self.notes: list[str] = []

    def start(self, label: str, total: int) -> None:
        pass

    def advance(self, amount: int) -> None:
        pass

    def finish(self) -> None:
        pass

    def note(self, message: str) -> None:
        self.notes.append(message)


class Cancellation:
    """Whether the user asked the running command to stop (Ctrl-C, SIGTERM).

    Set from the main thread (the CLI's signal handler, or the replicator when a
    ``KeyboardInterrupt`` reaches it); read by the transfer threads, which stop at
    their next request to a backend or their next piece of a streamed upload by
    raising :class:`Interrupted`. A transfer stuck inside one backend call does not
    see it: only a second signal ends that (the CLI exits at once)."""

    def __init__(self) -> None:
        self._event = threading.Event()

    def request(self) -> bool:
        """Ask every transfer to stop; False if that was asked already."""
        if self._event.is_set():
            return False
        self._event.set()
        return True

    def requested(self) -> bool:
        return self._event.is_set()

    def clear(self) -> None:
        """Let transfers run again (a library caller that goes on after an interrupt)."""
        self._event.clear()

    def check(self) -> None:
        """Raise :class:`Interrupted` if a stop was asked."""
        if self._event.is_set():
            raise Interrupted("stopped by the user")

    def guard(self, stream: BinaryIO) -> BinaryIO:
        """``stream`` read through a check before every piece: an upload streamed from
        it stops (the backend removes its temporary file, as for any source error)
        at its next piece once a stop is asked."""
        return cast(BinaryIO, _Guarded(stream, self))


class _Guarded:
    """A readable, seekable stream that checks a :class:`Cancellation` before each read."""

    def __init__(self, inner: BinaryIO, cancel: Cancellation) -> None:
        self._inner = inner
        self._cancel = cancel

    def read(self, size: int = -1) -> bytes:
        self._cancel.check()
        return self._inner.read(size)

    def readinto(self, buffer: bytearray | memoryview) -> int:
        self._cancel.check()
        return self._inner.readinto(buffer)  # type: ignore[attr-defined]

    def seek(self, offset: int, whence: int = 0) -> int:
        return self._inner.seek(offset, whence)

    def tell(self) -> int:
        return self._inner.tell()

    def seekable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True

    def __getattr__(self, name: str) -> object:
        return getattr(self._inner, name)


#: The process's one cancellation (a command runs one at a time per process).
CANCEL = Cancellation()
