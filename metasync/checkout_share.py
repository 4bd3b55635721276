"""A fresh clone's files written by two processes (:mod:`metasync.forkshare`).

Where a checkout writes in place (a fresh clone: nothing to protect), every
backend is on this machine, and this is Linux with two cores or more, the jobs of
one-blob files are shared with a forked copy of the process: the write is bound
by the interpreter lock, and the copy has its own. Each job the copy runs comes
back as its written files and what it changed in the checkout -- files written in
place (which a failed clone's undo removes), names refused, conflict copies,
notes, progress -- and is applied here as if a thread of this process had run it.

Nothing of the copy reaches the local database: its files' index rows are made
here, from what it sends, after the flush that makes them durable.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Generic, NamedTuple, TypeVar

from metasync.checkout_limits import PullResult, RefusedNames
from metasync.context import InPlaceWrite, RepoContext
from metasync.faults import crash_points_armed
from metasync.filewriter import EarlyFlush, FileWriter
from metasync.forkshare import ForkedShare, available
from metasync.localdb import IndexRow

#: A write job of the checkout: (files, where their blobs are in a pack or None).
Job = TypeVar("Job", bound=tuple[list[Any], Any])

#: Fewer files than this are written by this process alone (a fork costs a few ms).
MIN_SHARED_FILES = 1000


class ShareReport(NamedTuple):
    """What one job of the copy changed in the checkout, besides its files."""

    written_in_place: list[InPlaceWrite]
    refused: dict[str, IndexRow]
    not_written: list[str]
    conflicts: list[str]
    notes: list[str]
    advanced: int


class _Recorder:
    """The copy's reporter: keeps notes and progress for the next report."""

    def __init__(self) -> None:
        self.notes: list[str] = []
        self.advanced = 0

    def start(self, label: str, total: int) -> None:
        pass

    def advance(self, amount: int) -> None:
        self.advanced += amount

    def finish(self) -> None:
        pass

    def note(self, message: str) -> None:
        self.notes.append(message)


class _Since:
    """Reports what the copy's checkout gained since the last report."""

    def __init__(self, ctx: RepoContext, refused: RefusedNames, result: PullResult,
                 recorder: _Recorder) -> None:
        self.ctx = ctx
        self.refused = refused
        self.result = result
        self.recorder = recorder
        self.marks = self._lengths()

    def _lengths(self) -> tuple[int, int, int, int]:
        return (len(self.ctx.written_in_place), len(self.refused.rows),
                len(self.result.not_written), len(self.result.conflicts))

    def __call__(self) -> ShareReport:
        in_place, refused, not_written, conflicts = self.marks
        rows = self.refused.rows
        report = ShareReport(
            self.ctx.written_in_place[in_place:],
            dict(list(rows.items())[refused:]) if len(rows) > refused else {},
            self.result.not_written[not_written:],
            self.result.conflicts[conflicts:],
            self.recorder.notes, self.recorder.advanced)
        self.recorder.notes, self.recorder.advanced = [], 0
        self.marks = self._lengths()
        return report


class SharedWrites(Generic[Job]):
    """The write jobs of one checkout, some run by a forked copy where that pays
    (:meth:`of`): this process runs :meth:`mine`, then takes the copy's files and
    reports with :meth:`collect` -- or, after a failure, :meth:`stop`."""

    def __init__(self, ctx: RepoContext, refused: RefusedNames, result: PullResult,
                 jobs: list[Job], share: ForkedShare[Job] | None) -> None:
        self.ctx = ctx
        self.refused = refused
        self.result = result
        self.jobs = jobs
        #: The copy (None: this process runs every job).
        self.share = share

    @classmethod
    def of(cls, ctx: RepoContext, writer: FileWriter, refused: RefusedNames, result: PullResult,
           jobs: list[Job], work: Callable[[Job], Any], in_place: bool) -> SharedWrites[Job]:
        """Share ``jobs`` (run by ``work``) with a forked copy where the checkout
        writes ``in_place``, enough files are one blob each, every backend is on
        this machine, and this is Linux with two cores or more (no crash point is
        armed: a test counts one process's arrivals)."""
        files = sum(len(plans) for plans, located in jobs if located is not None)
        if (not in_place or files < MIN_SHARED_FILES or not available() or crash_points_armed()
                or not ctx.store.all_local()):
            return cls(ctx, refused, result, jobs, None)
        # Files of several chunks look their blobs up in the local database, which a
        # forked process must not use: this process writes them, first.
        shared = [job for job in jobs if job[1] is not None]
        own = [job for job in jobs if job[1] is None]
        since: list[_Since] = []

        def setup() -> None:  # in the copy
            recorder = _Recorder()
            ctx.reporter = recorder
            refused.reporter = recorder
            ctx.store.executor = ThreadPoolExecutor(1, thread_name_prefix="metasync-io")
            writer.in_place_flush = EarlyFlush()
            since.append(_Since(ctx, refused, result, recorder))

        share = ForkedShare.start(shared, own, work, lambda: since[0](), setup)
        return cls(ctx, refused, result, jobs, share)

    def mine(self) -> Iterable[Job]:
        """The jobs this process runs."""
        return self.share.mine() if self.share is not None else self.jobs

    def collect(self, pending: list[Any], *, raising: bool = True) -> None:
        """Add the files the copy wrote to ``pending`` and apply its reports (call
        once :meth:`mine` is done). If the copy failed, what it did until then is
        applied (a failed clone's undo removes its files) before its failure is
        raised, unless not ``raising``."""
        if self.share is None:
            return
        for _, got, report in self.share.theirs(raising=raising):
            self._apply(report)
            pending.extend(got)

    def stop(self, pending: list[Any]) -> None:
        """After a failure here: stop the copy and apply what it did (its temporary
        files go to ``pending``, to be removed)."""
        if self.share is not None:
            self.share.stop()
            self.collect(pending, raising=False)

    def _apply(self, report: ShareReport) -> None:
        """Apply what a job of the copy changed, as if this process had run it."""
        self.ctx.written_in_place.extend(report.written_in_place)
        self.refused.rows.update(report.refused)
        self.result.not_written.extend(report.not_written)
        self.result.conflicts.extend(report.conflicts)
        for note in report.notes:
            self.ctx.reporter.note(note)
        if report.advanced:
            self.ctx.reporter.advance(report.advanced)
