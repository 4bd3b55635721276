"""What a checkout cannot do as asked, and what it tells of it: the names this
folder cannot hold (:class:`RefusedNames`), the folders it cannot read
(:class:`SealedFolders`), and the result of a pull (:class:`PullResult`).
Split from :mod:`metasync.checkout`, which uses them on every checkout."""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from pathlib import Path

from metasync.fstraits import (
    DROPS_DOT,
    NAME_REFUSED,
    FolderTraits,
    cannot_hold,
    cannot_write,
    clash_reason,
    not_written_note,
)
from metasync.localdb import NOT_ON_DISK, IndexRow
from metasync.names import display_path
from metasync.objects import TreeEntry, Version
from metasync.progress import Reporter
from metasync.scanner import ScanResult
from metasync.state import LocalState
from metasync.worktree import Folders, InTheWay


@dataclass
class PullResult:
    """What a pull (or the checkout of a push's merge) did to the folder."""

    version: Version
    written: int = 0
    deleted: int = 0
    conflicts: list[str] = field(default_factory=list)
    up_to_date: bool = False
    #: Set when the version taken does not descend from the one this client had
    #: (history forked): the one-line warning saying so (:mod:`metasync.sync`).
    fork: str = ""
    #: Paths of the tree this file system refused to create (each said in a note);
    #: they stay in the repository (see :data:`~metasync.localdb.NOT_ON_DISK`).
    not_written: list[str] = field(default_factory=list)


class RefusedNames:
    """The paths of one checkout that this folder cannot hold (a name too long or
    forbidden here, one the same as another's but for case or Unicode form, a
    symbolic link where there are none, a file too large): each is named in a note
    and gets an index row (:data:`~metasync.localdb.NOT_ON_DISK`) that keeps it in
    the tree, so it is neither shown as deleted nor dropped by the next commit.
    Thread-safe (file writers add from worker threads)."""

    def __init__(self, reporter: Reporter, result: PullResult, traits: FolderTraits) -> None:
        self.reporter = reporter
        #: The folder's traits: a name ending in a dot where they drop it is refused.
        self.traits = traits
        #: The checkout's result, whose ``not_written`` lists them.
        self.result = result
        #: Their index rows, by path.
        self.rows: dict[str, IndexRow] = {}
        #: Paths of the tree that are one name here with another path (loser ->
        #: the one written: :func:`~metasync.scanner.name_clashes`).
        self.clashes: dict[str, str] = {}
        self._lock = threading.Lock()

    def failed(self, path: str, entry: TreeEntry, exc: OSError) -> None:
        """Record ``path`` if writing it failed with ``exc`` because this file system
        cannot hold it (:func:`~metasync.fstraits.cannot_write`), else raise ``exc``."""
        why = cannot_write(entry.type, exc)
        if why is None:
            raise exc
        self.add(path, entry, why, self.result)

    def without_exec(self, path: str) -> None:
        """Say that the file ``path`` is written without its exec bit, which this
        file system does not keep (as git's ``core.fileMode=false``: the scan keeps
        the index's, so the bit stays in the repository)."""
        self.reporter.note(f"cannot be written here: {display_path(path)}: this file system "
                           "keeps no exec bit; the file is written without it, and keeps it "
                           "in the repository")

    def refuses(self, path: str, entry: TreeEntry, result: PullResult) -> bool:
        """True (and recorded) if ``path`` cannot be made here before anything is
        tried: a folder above it was refused, or it clashes with another name of
        the tree (:attr:`clashes`), or this folder would write it without its
        trailing dot (another name here, :meth:`FolderTraits.drops_dot`)."""
        if self.under(path):
            self.add(path, entry, None, result)
            return True
        if self.traits.drops_dot(path):
            self.add(path, entry, DROPS_DOT, result)
            return True
        other = self.clashes.get(path)
        if other is None:
            return False
        self.add(path, entry, clash_reason(path, other), result)
        return True

    def under(self, path: str) -> bool:
        """True if a folder above ``path`` was refused (so ``path`` cannot be made)."""
        if not self.rows:
            return False  # the usual case: no per-path walk up
        parent = path.rpartition("/")[0]
        while parent:
            if parent in self.rows:
                return True
            parent = parent.rpartition("/")[0]
        return False

    def add(self, path: str, entry: TreeEntry, why: str | None, result: PullResult) -> None:
        """Record ``path``, and say ``why`` (None: inside a folder already said)."""
        with self._lock:
            self.rows[path] = IndexRow(path, entry.type, entry.ref, entry.size, entry.executable,
                                       NOT_ON_DISK, 0, 0)
            result.not_written.append(path)
        if why is not None:
            self.reporter.note(not_written_note(path, why))

    def make_folder(self, folders: Folders, path: str, entry: TreeEntry, aside: InTheWay,
                    result: PullResult, where: str) -> bool:
        """Make the folder ``path`` at ``where`` (its spelling on disk), and its
        parents; False if this file system refused its name or a parent's."""
        if self.refuses(path, entry, result):
            return False
        try:
            folders.release(folders.make(where, aside))
        except OSError as exc:
            if exc.errno not in NAME_REFUSED:
                raise
            self.add(path, entry, cannot_hold(exc), result)
            return False
        return True


def still_sealed(folder: Path) -> bool:
    """True if ``folder`` is there and still cannot be listed or entered (its
    held-back changes cannot be applied yet); a folder gone or readable again is not."""
    return folder.is_dir() and not os.access(folder, os.R_OK | os.X_OK)


class SealedFolders:
    """The folders a checkout's scan could not read (list or enter): nothing can be
    known of, or written into, what they hold, so the checkout leaves them alone
    and records those whose changes it held back (``held``) for
    :meth:`Checkout.resume` to apply once they can be read."""

    def __init__(self, folders: set[str], reporter: Reporter) -> None:
        self.folders = folders
        self.reporter = reporter
        self.held: set[str] = set()

    @classmethod
    def of(cls, scan: ScanResult, reporter: Reporter) -> SealedFolders:
        """The folders ``scan`` could not read."""
        return cls({u.path for u in scan.problems.unreadable if u.folder}, reporter)

    def leaves(self, path: str, changed: bool) -> bool:
        """True if ``path`` is in (or is) one of these folders, so the checkout must
        leave it alone; a change there (``changed``) is held back, and said once
        per folder."""
        sealed = self.holding(path)
        if sealed is None:
            return False
        if changed and sealed not in self.held:
            self.held.add(sealed)
            self.reporter.note(f"not updated: cannot read {display_path(sealed)}/; the "
                               "changes to it are applied once it can be read")
        return True

    def holding(self, path: str) -> str | None:
        """The folder of these that is ``path`` or holds it; None if none does."""
        if not self.folders:
            return None
        while path:
            if path in self.folders:
                return path
            path = path.rpartition("/")[0]
        return None

    def hold_back(self, state: LocalState, base: dict[str, TreeEntry]) -> None:
        """Record the held-back folders in ``state.waiting_folders`` with the tree
        each still holds (the first record of a folder stays: it is what the
        folder holds)."""
        if not self.held:
            return
        waiting = dict(state.waiting_folders)
        for folder in self.held:
            b = base.get(folder)
            waiting.setdefault(folder, b.ref if b is not None and b.type == "dir" else "")
        state.waiting_folders = waiting
