"""Resumable uploads of the cloud-provider backends: this client's journal of an
unfinished upload session (:class:`UploadJournal`), so that a ``put`` interrupted
by a crash, a killed process or a run of failures continues the provider's session
instead of starting over.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets
import time
from dataclasses import asdict, dataclass

from metasync.backends.cloud import config_dir
from metasync.portable import try_lock

#: How long a provider keeps an unfinished upload session (Dropbox: 7 days, Graph and
#: Drive: about a week); older journal records are not resumed.
UPLOAD_SESSION_MAX_AGE = 6 * 24 * 3600.0


@dataclass(frozen=True)
class PendingUpload:
    """An upload session the provider holds part of: its id (or URL), how many bytes
    it has, and the SHA-256 of those bytes (so a resumed source is checked to be the
    same data before the rest is appended)."""

    session: str
    offset: int
    prefix_sha256: str
    started: float


class UploadJournal:
    """This client's record of one unfinished large upload, so that a ``put`` of the
    same object to the same place after an interruption (a crash, a killed process, a
    run of failures) continues the provider's upload session instead of starting
    over. One JSON file per target under ``<config>/uploads/``; while an upload runs
    it holds an exclusive lock on it, so concurrent writers of one key never share a
    session (the second one simply uploads without a journal).

    Usage (see dropbox.py ``_upload_session``)::

        with UploadJournal("dropbox", target) as journal:
            pending = journal.pending()      # None, or a session to resume
            ... journal.record(PendingUpload(...)) after each piece ...
            ... journal.clear() once committed ...
    """

    def __init__(self, provider: str, target: str) -> None:
        digest = hashlib.sha256(target.encode()).hexdigest()[:32]
        self.path = config_dir() / "uploads" / f"{provider}-{digest}.json"
        self._fd: int | None = None

    def __enter__(self) -> UploadJournal:
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(self.path.with_suffix(".lock"), os.O_RDWR | os.O_CREAT, 0o600)
        if not try_lock(fd):
            os.close(fd)  # another writer of this target: go without a journal
            return self
        self._fd = fd
        return self

    def __exit__(self, *exc: object) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    @property
    def active(self) -> bool:
        """False if another upload of the same target holds the journal."""
        return self._fd is not None

    def pending(self, now: float | None = None) -> PendingUpload | None:
        if not self.active:
            return None
        try:
            doc = json.loads(self.path.read_text(encoding="utf-8"))
            pending = PendingUpload(**doc)
        except (OSError, ValueError, TypeError):
            return None
        if (now if now is not None else time.time()) - pending.started > UPLOAD_SESSION_MAX_AGE:
            self.clear()
            return None
        return pending

    def record(self, pending: PendingUpload) -> None:
        if not self.active:
            return
        tmp = self.path.with_name(f".tmp-{secrets.token_hex(6)}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(asdict(pending), fh)
        os.replace(tmp, self.path)

    def clear(self) -> None:
        if self.active:
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()


class NoJournal(UploadJournal):
    """A journal that is never active: it has nothing pending and records nothing.
    For an upload that cannot be resumed (a source that cannot be re-read from its
    start); an :class:`UploadJournal` another upload of the target holds behaves the
    same."""

    def __init__(self) -> None:
        self._fd = None


#: The one :class:`NoJournal` (it keeps no state).
NO_JOURNAL: UploadJournal = NoJournal()
