"""Checkout: moving the folder from one tree to another without losing a local change.

For each path, base = the tree the folder was checked out from, local = the folder now,
remote = the new tree (the rules are in docs/design.md, "The folder"). Files are written
to temporary files beside their targets by :class:`~metasync.filewriter.FileWriter`
(which also serves ``restore``), flushed in batches and renamed into place; a file that
changed since the scan the checkout planned with becomes a conflict copy instead of
being replaced. A checkout is recorded as pending before it starts, so a crash leaves
one the next command finishes.

Every write, rename and delete is made relative to its parent folder opened by
:class:`~metasync.worktree.Folders`, which never follows a symbolic link: a link
in the place of a folder (put there by history, or by a local change during the
checkout) is moved aside as a conflict copy and a real folder made, so nothing
is ever written outside the repository's folder. A name the scan found spelled
otherwise on disk (another Unicode form: :func:`~metasync.scanner.respell`) is
written, replaced and deleted as spelled there (:func:`disk_path`), so the folder
never holds two spellings of one file.
"""

from __future__ import annotations

import os
import stat
import time
from dataclasses import replace
from datetime import datetime
from itertools import chain
from typing import NamedTuple

from metasync.checkout_limits import PullResult, RefusedNames, SealedFolders, still_sealed
from metasync.context import RepoContext, daemon_running
from metasync.errors import ObjectUnavailable
from metasync.faults import crash_point
from metasync.filewriter import FileWriter
from metasync.fstraits import (
    NAME_REFUSED,
    NameRefused,
    cannot_hold,
    name_refused,
)
from metasync.graph import ObjectGraph
from metasync.localdb import OUTSIDE, IndexRow
from metasync.names import display_path
from metasync.objects import PackEntry, TreeEntry, same_entry
from metasync.portable import O_CLOEXEC, O_NOFOLLOW, sync_all
from metasync.scanner import Scanner, ScanResult, name_clashes
from metasync.selection import Selection, drop_selected_rows
from metasync.state import PendingCheckout
from metasync.worktree import (
    META_DIR,
    Folders,
    InTheWay,
    ScanEntry,
    lstat_at,
    lstat_name,
    remove_stale_temps,
)

#: The ref a file that cannot be read stands for in the local side of a checkout:
#: no object has it, so it equals no version of the file.
UNREAD_REF = "unreadable"
#: Files written by a checkout are flushed and renamed in batches of this many.
WRITE_BATCH = 2000
#: Small files of one pack written by one worker task: at most this many, and at
#: most :data:`JOB_BYTES` of content, which the task holds in memory at once (so a
#: clone's memory is bounded by the workers' jobs in flight, not by the tree).
JOB_FILES = 400
JOB_BYTES = 1024 * 1024
#: The same bound where a backend is across a network. Each job is one range read
#: there, and each read costs round trips whatever its size (45-230 ms through the
#: bench's 50 ms links; an SFTP read also opens and closes the file): jobs of 1 MiB
#: of content (~260 KiB stored) made the WAN clone of the Linux tree 4x the reads of
#: jobs of 400 files and 1-1.5 s slower (of ~13 s). 4 MiB of content: ~1 MiB a read.
JOB_BYTES_REMOTE = 4 * 1024 * 1024

#: A file to write: its path, its tree entry, and its content as (blob id, length).
WritePlan = tuple[str, TreeEntry, list[tuple[str, int]]]
#: One worker task: files to write, and where the blobs of those that are one blob
#: each are in a pack (read together) -- None: each file reads its own chunks.
WriteJob = tuple[list[WritePlan], "tuple[str, list[PackEntry]] | None"]
#: A written temporary file: its plan, its name in the plan's folder (None: written
#: in place, at the plan's own name), and its stat (None for a link).
WrittenTemp = tuple[WritePlan, "str | None", "FileStat | None"]


class FileStat(NamedTuple):
    """What a checkout keeps of a written file's stat until its index row is made (a
    ``stat_result`` is ten times the size, times every file of a clone)."""

    size: int
    mtime_ns: int
    ino: int

    @classmethod
    def of(cls, st: os.stat_result | None) -> FileStat | None:
        return None if st is None else cls(st.st_size, st.st_mtime_ns, st.st_ino)


def now_stamp() -> str:
    """The local time as conflict-copy names show it."""
    return datetime.now().strftime("%Y-%m-%d %H%M%S")


class Checkout:
    """Changes one repository's folder from tree to tree."""

    def __init__(self, ctx: RepoContext, graph: ObjectGraph, scanner: Scanner) -> None:
        self.ctx = ctx
        self.root = ctx.root
        self.graph = graph
        self.scanner = scanner
        self.writer = FileWriter(ctx, graph)
        #: What the scan the current checkout planned with saw, by path.
        self._seen: dict[str, ScanEntry] = {}
        #: Paths of :attr:`_seen` spelled otherwise on disk: path -> :func:`disk_path`.
        self._spelled: dict[str, str] = {}
        #: The folders of the current checkout (see :meth:`run`).
        self._folders: Folders
        #: Folders the current checkout's scan could not read (:func:`apply_waiting`).
        self.sealed = SealedFolders(set(), ctx.reporter)
        #: The paths this file system refused in the current checkout (see :meth:`run`).
        self._refused: RefusedNames
        #: This machine's selection during the current checkout, the paths of the
        #: tree outside it that its scan kept from their rows (not here), and the
        #: rows it records for the new tree's paths outside it (:data:`OUTSIDE`).
        self._selection = Selection()
        self._outside_kept: set[str] = set()
        self._outside_rows: list[IndexRow] = []
        self._place = InPlace()  #: The current checkout's writing in place (a fresh clone's).

    def resume(self) -> PullResult | None:
        """Finish a checkout a crash interrupted, and apply changes held back in folders
        that could not be read (:func:`apply_waiting`); ``None`` if none was pending."""
        # A damaged record reads as None: as if none were pending (the next checkout
        # scans the folder anyway, and overwrites it).
        result = None
        if self.ctx.state.checkout_pending is not None:
            remove_stale_temps(self.root)
            result = self.run_pending()
        if self.ctx.state.waiting_folders:
            result = apply_waiting(self) or result
        return result

    def run_pending(self) -> PullResult:
        """Change the folder from tree ``from`` to tree ``to`` of the pending checkout."""
        state = self.ctx.state
        pending = state.checkout_pending
        assert pending is not None
        result = PullResult(state.prev)
        head = self.graph.head_commit()
        if head is not None:
            self.graph.load_indexes(head)
        self.run(self.graph.flatten(pending.from_tree), self.graph.flatten(pending.to_tree),
                 result, pending.moves, pending)
        crash_point("checkout:done")
        db = self.ctx.db
        with state.transaction():
            state.checkout_pending = None
            for index_id in db.local_indexes():
                if head is not None and index_id in head.indexes and state.head == state.prev.master:
                    db.set_index_state(index_id, "remote")
        return result

    # ---------------------------------------------------------------- one checkout
    def run(
        self,
        base: dict[str, TreeEntry],
        remote: dict[str, TreeEntry],
        result: PullResult,
        moves: dict[str, str],
        pending: PendingCheckout | None = None,
    ) -> None:
        """Three-way between ``base`` (what the folder was), the folder, and ``remote``.
        ``moves`` maps new paths to paths whose current content they take (a merge's
        conflict copies of local versions): renamed locally instead of downloaded.
        ``pending``: the recorded checkout this is, may write in place (:func:`writes_in_place`).
        """
        self._refused = RefusedNames(self.ctx.reporter, result, self.scanner.traits)
        self._place = InPlace.of(self.ctx, pending, base) if pending is not None else InPlace()
        with Folders(self.root) as folders:
            self._folders = folders
            self._run(base, remote, result, moves)

    def _run(
        self,
        base: dict[str, TreeEntry],
        remote: dict[str, TreeEntry],
        result: PullResult,
        moves: dict[str, str],
    ) -> None:
        scan = self.scanner.scan(None)
        self._seen = scan.seen
        self._selection = self.scanner.selection()
        self._outside_kept = scan.outside
        self._outside_rows = []
        self._spelled = {p: e.disk for p, e in self._seen.items() if e.disk}
        local = local_side(scan)
        self.sealed = SealedFolders.of(scan, self.ctx.reporter)
        stamp = now_stamp()
        aside = self._in_the_way(stamp, result)
        for copy, source in sorted(moves.items()):
            have = local.get(source)
            if (copy not in local and have is not None and copy in remote
                    and same_entry(have, remote[copy]) and same_entry(have, base.get(source))
                    and _move(self._folders, self._on_disk(source), self._on_disk(copy), aside)):
                local[copy] = local.pop(source)
                self._seen.pop(source, None)
        scanned = {e.path: e for e in scan.rows}
        writes, deletes = plan(self, base, remote, local, stamp, result)
        crash_point("checkout:planned")
        folders = self._folders
        for path in deletes:
            if path not in self._seen:
                continue  # not on this disk (a path it cannot hold): nothing to delete
            parent, _, name = self._on_disk(path).rpartition("/")
            with folders.opened(parent) as fd:
                # No folder there (a link or a file now): nothing of this tree to delete.
                existing = lstat_name(fd, name) if fd is not None else None
                if existing is None or stat.S_ISDIR(existing.st_mode):
                    continue
                if self._changed_since_scan(path, existing):
                    self.ctx.reporter.note(f"kept {display_path(path)}: it changed during the pull")
                    continue
                try:
                    os.unlink(name, dir_fd=fd)
                except FileNotFoundError:
                    continue
                result.deleted += 1
        # Folders deleted remotely go if nothing local remains in them, deepest first.
        for path in sorted((p for p, e in base.items() if e.type == "dir" and p not in remote
                            and not self.sealed.holding(p)),
                           key=lambda p: p.count("/"), reverse=True):
            where = self._on_disk(path)
            parent, _, name = where.rpartition("/")
            with folders.opened(parent) as fd:
                try:
                    if fd is not None:
                        os.rmdir(name, dir_fd=fd)  # a link there fails: rmdir never follows
                        folders.forget(where)
                except OSError:
                    pass
        for path in sorted((p for p, e in remote.items() if e.type == "dir" and not self.sealed.holding(p)
                            and self._selection.selects(p, True)),
                           key=lambda p: p.count("/")):
            b = base.get(path)
            if b is not None and b.type == "dir" and path not in local:
                continue  # removed here, untouched remotely: stays removed (files
                # the remote changed inside bring their folders back as they are written)
            if (path in local and local[path].type == "dir" and path not in self._seen
                    and path not in self._outside_kept):  # refused before: said once
                self._refused.add(path, remote[path], None, result)
                continue
            self._refused.make_folder(folders, path, remote[path], aside, result,
                                      self._on_disk(path))
        rows = self._write_files(writes, stamp, result, scanned)
        db = self.ctx.db
        with db.transaction():
            self.sealed.hold_back(self.ctx.state, base)
            db.delete_index(deletes)
            db.upsert_index(rows)
            if self._selection.active or self._outside_kept:  # else none is marked
                drop_selected_rows(db, self._selection, self.root)  # made above
            db.upsert_index(self._refused.rows.values())
            db.upsert_index(self._outside_rows)
            # Folders gone from the tree: only one this file system refused has a row.
            db.delete_index(p for p, e in base.items()
                            if e.type == "dir" and p not in remote and p not in self._refused.rows)
            # Not rows of files written or deleted since (a stale row outlived a delete).
            stale = {path for path, _ in writes} | set(deletes)
            db.upsert_index(r for r in scan.rows if r.path not in stale)

    def _changed_since_scan(self, path: str, st: os.stat_result) -> bool:
        """True if ``path`` (now ``st``) differs in size or mtime from the scan the
        pull planned with (or did not exist then): replacing it could lose an edit."""
        seen = self._seen.get(path)
        return seen is None or seen.size != st.st_size or seen.mtime_ns != st.st_mtime_ns

    def _conflict_copy(self, path: str, stamp: str) -> str | None:
        """Rename ``path`` to a free conflict name beside it; None if nothing is there
        (or its folder is no longer a folder of this tree: a link is not followed)."""
        where = self._on_disk(path)
        with self._folders.opened(where.rpartition("/")[0]) as fd:
            if fd is None or lstat_name(fd, where.rpartition("/")[2]) is None:
                return None
            return self._move_aside(fd, where, stamp)

    def _move_aside(self, fd: int, path: str, stamp: str) -> str:
        return self._folders.move_aside(fd, path, self.ctx.device, stamp)

    def _on_disk(self, path: str) -> str:
        """``path`` as spelled on disk (:func:`disk_path`): what a checkout writes,
        replaces and deletes, so it never makes a second spelling beside it."""
        return disk_path(self._spelled, path) if self._spelled else path

    def _in_the_way(self, stamp: str, result: PullResult) -> InTheWay:
        """What :class:`Folders` does with a file or link where a folder must be: keep
        it as a conflict copy (a link is never followed, nor replaced unkept)."""

        def aside(fd: int, name: str, path: str) -> None:
            copy = self._move_aside(fd, path, stamp)
            result.conflicts.append(copy)
            self.ctx.reporter.note(f"conflict: {display_path(path)} is in the way of a folder; "
                                   f"moved to {display_path(copy)}")

        return aside

    # ---------------------------------------------------------------- writing
    def _write_files(
        self,
        writes: list[tuple[str, TreeEntry]],
        stamp: str,
        result: PullResult,
        scanned: dict[str, IndexRow],
    ) -> list[IndexRow]:
        """Write files and links through temporary files, renamed in flushed batches.

        Files whose content is one blob are grouped by the pack holding it, so a pack
        of a thousand small files costs a few range reads, not a thousand.
        """
        aside = self._in_the_way(stamp, result)
        ensured: set[str] = set()
        by_pack: dict[str, list[tuple[PackEntry, WritePlan]]] = {}
        jobs: list[WriteJob] = []
        links: list[WritePlan] = []
        total = 0
        folders = self._folders
        exec_bits = self.scanner.traits.exec_bits
        located = self.ctx.db.locations(e.ref for _, e in writes if e.type == "file")
        for path, entry in writes:
            parent = path.rpartition("/")[0]
            if self._refused.refuses(path, entry, result):
                continue
            if parent and parent not in ensured:
                try:
                    folders.release(folders.make(self._on_disk(parent), aside))
                except OSError as exc:
                    if exc.errno not in NAME_REFUSED:
                        raise
                    self._refused.add(path, entry, cannot_hold(exc), result)
                    continue
                while parent and parent not in ensured:
                    ensured.add(parent)
                    parent = parent.rpartition("/")[0]
            total += entry.size
            if entry.executable and not exec_bits and entry.type != "link":
                self._refused.without_exec(path)
            if entry.type == "link":
                links.append((path, entry, []))
            elif entry.type == "file":
                loc = located.get(entry.ref)
                if loc is None:
                    raise ObjectUnavailable(f"object {entry.ref[:12]} is in no known pack")
                by_pack.setdefault(loc[0], []).append(
                    (loc[1], (path, entry, [(entry.ref, entry.size)])))
            else:
                jobs.append(([(path, entry, self.graph.file_chunks(entry))], None))
        for pack_id, placed in by_pack.items():
            # In pack order: each job's blobs are then neighbours, so its coalesced
            # range reads cover only them (in path order they are scattered over the
            # pack, and every job would read most of it).
            placed.sort(key=lambda item: item[0].offset)
            jobs.extend(pack_jobs(pack_id, placed, local=self.ctx.store.all_local()))
        if links:
            jobs.append((links, None))

        rows: list[IndexRow] = []
        pending: list[WrittenTemp] = []
        reporter = self.ctx.reporter
        reporter.start("download", total)
        futures = self.ctx.store.windowed(self._write_job, jobs, aside)
        try:
            for _, fut in futures:
                pending.extend(fut.result())
                if len(pending) >= WRITE_BATCH:
                    rows += self._install(pending, stamp, result)
                    pending = []
            rows += self._install(pending, stamp, result)
            pending = []
            if self._place.writes:
                self.writer.in_place_flush.durable()  # on disk before its rows say so
        except BaseException:
            for _, fut in futures.outstanding:  # leave no temporary file behind
                fut.cancel()
                if not fut.cancelled() and fut.exception() is None:
                    pending.extend(fut.result())
            for (path, _, _), tmp, _ in pending:
                _drop_temp(self._folders, self._on_disk(path), tmp)
            raise
        finally:
            reporter.finish()
        return rows

    def _install(self, pending: list[WrittenTemp], stamp: str,
                 result: PullResult) -> list[IndexRow]:
        """Flush a batch of written temporary files once, then rename each into place."""
        if not pending:
            return []
        if any(tmp is not None for _, tmp, _ in pending):
            sync_all()  # one flush for the batch instead of an fsync per file
        written_at = time.time_ns()
        folders = self._folders

        def fast(item: WrittenTemp, fd: int | None) -> bool | None:
            """Rename into a free or unchanged place; False leaves it to the slow path,
            None: this file system refused the name (the temporary file is removed)."""
            (path, entry, _), tmp, _ = item
            assert tmp is not None  # written in place: never renamed
            name = self._on_disk(path).rpartition("/")[2]
            if fd is None:
                return False
            try:
                existing = lstat_at(fd, name)
                if existing is not None and (stat.S_ISDIR(existing.st_mode)
                                             or self._changed_since_scan(path, existing)
                                             or not self._place.replaces(fd, name, tmp, path)):
                    return False
                os.replace(tmp, name, src_dir_fd=fd, dst_dir_fd=fd)
            except OSError as exc:
                if not name_refused(exc, fd, tmp, name):
                    raise
                os.unlink(tmp, dir_fd=fd)
                refused = exc if exc.errno in NAME_REFUSED else NameRefused(name)
                self._refused.add(path, entry, cannot_hold(refused), result)
                return None
            return True

        # Serial on purpose: renames into the same folders contend on the folder's
        # lock, and measured slower when spread over threads.
        done: list[bool | None] = []
        with folders.cursor() as cursor:
            for item in pending:
                if item[1] is None:
                    done.append(True)  # written in place: nothing to rename
                    continue
                done.append(fast(item, cursor.at(self._on_disk(item[0][0]).rpartition("/")[0])))
                crash_point("checkout:rename")
        rows: list[IndexRow] = []
        for ((path, entry, _), tmp, st), ok in zip(pending, done, strict=True):
            if ok is None:
                continue
            if not ok:
                assert tmp is not None  # only a temporary file is ever left to this
                try:
                    self._install_slow(path, tmp, stamp, result)
                except OSError as exc:
                    if exc.errno not in NAME_REFUSED:
                        raise
                    _drop_temp(self._folders, self._on_disk(path), tmp)
                    self._refused.add(path, entry, cannot_hold(exc), result)
                    continue
            result.written += 1
            if st is not None:  # renaming keeps the inode and mtime of the temporary file
                rows.append(IndexRow(path, entry.type, entry.ref, st.size,
                                     entry.executable, st.mtime_ns, st.ino, written_at))
        return rows

    def _install_slow(self, path: str, tmp: str, stamp: str, result: PullResult) -> None:
        """Put ``tmp`` at ``path`` where a folder or a changed file is in the way."""
        where = self._on_disk(path)
        parent, _, name = where.rpartition("/")
        with self._folders.made(parent, self._in_the_way(stamp, result)) as fd:
            existing = lstat_at(fd, name)
            if existing is not None and stat.S_ISDIR(existing.st_mode):
                try:
                    os.rmdir(name, dir_fd=fd)
                    self._folders.forget(where)
                except OSError:
                    result.conflicts.append(self._move_aside(fd, where, stamp))
            elif existing is not None and (path in self._place.partial  # not the clone's
                                           or self._changed_since_scan(path, existing)):
                # Edited (or created) while we were downloading: keep it.
                copy = self._move_aside(fd, where, stamp)
                result.conflicts.append(copy)
                self.ctx.reporter.note(f"conflict: {display_path(path)} changed during the pull; "
                                       f"kept as {display_path(copy)}")
            replace_name(fd, tmp, name)

    def _write_job(self, job: WriteJob, aside: InTheWay) -> list[WrittenTemp]:
        """Write the files of one job (runs in a worker thread)."""
        plans, located = job
        prefetched = self.graph.read_located(*located) if located is not None else None
        done: list[WrittenTemp] = []
        try:
            with self._folders.cursor(aside) as cursor:
                for plan in plans:
                    path, entry, chunks = plan
                    parent, _, name = (where := self._on_disk(path)).rpartition("/")
                    fd = cursor.at(parent)
                    assert fd is not None  # made, never None
                    try:  # in place where nothing was there at the scan
                        written, st = self.writer.write(
                            fd, name, entry, chunks, prefetched,
                            in_place=where if self._place.writes and path not in self._seen else None)
                        done.append((plan, written, FileStat.of(st)))
                        if written is None:
                            crash_point("checkout:write")
                    except OSError as exc:
                        self._refused.failed(path, entry, exc)
        except BaseException:
            for (path, _, _), tmp, _ in done:
                _drop_temp(self._folders, self._on_disk(path), tmp)
            raise
        return done



def writes_in_place(ctx: RepoContext, pending: PendingCheckout, base: dict[str, TreeEntry]) -> bool:
    """True if the pending checkout writes files at their own names, once: it did
    so before a crash, or it starts from nothing into a folder that holds nothing
    but ``.metasync`` and no daemon watches (a fresh clone: nothing there to
    protect, and no one looking). Recorded before anything is written, so that
    after a crash the files it left part-written are written again, not kept as
    conflict copies (docs/design.md, "Writing the folder")."""
    if daemon_running(ctx.root):
        return False  # someone may be looking: never in place (a resumed one neither)
    if pending.in_place:
        return True
    if base:
        return False
    with os.scandir(ctx.root) as entries:
        if any(e.name != META_DIR for e in entries):
            return False
    state = ctx.state
    with state.transaction():
        state.checkout_pending = replace(pending, in_place=True)
    return True


class InPlace:
    """A recorded checkout's writing in place: whether this run writes new files at
    their own names (:attr:`writes`: :func:`writes_in_place`), and -- resuming one
    that did before a crash -- which files found at its paths may be ones it left
    part-written (:attr:`partial`): no index row (a file whose row was recorded was
    finished, so a difference is the user's), a file, no longer than the tree's. Such
    a file is replaced only if its bytes are the start of the tree's
    (:meth:`replaces`), else kept as a conflict copy: nothing the user wrote is lost."""

    def __init__(self, writes: bool = False, resuming: bool = False,
                 indexed: frozenset[str] = frozenset()) -> None:
        self.writes = writes
        self.resuming = resuming
        self.indexed = indexed
        self.partial: set[str] = set()

    @classmethod
    def of(cls, ctx: RepoContext, pending: PendingCheckout, base: dict[str, TreeEntry]) -> InPlace:
        indexed = frozenset(ctx.db.index_paths()) if pending.in_place else frozenset()
        return cls(writes_in_place(ctx, pending, base), pending.in_place, indexed)

    def may_be_partial(self, path: str, b: TreeEntry | None, loc: TreeEntry | None,
                       n: TreeEntry) -> bool:
        """True (and noted in :attr:`partial`) if ``loc``, the file at ``path`` where
        the tree has ``n``, may be one this checkout left part-written."""
        if (self.resuming and b is None and loc is not None and loc.type in ("file", "chunked")
                and loc.ref != UNREAD_REF and path not in self.indexed and loc.size <= n.size):
            self.partial.add(path)
            return True
        return False

    def replaces(self, fd: int, name: str, tmp: str, path: str) -> bool:
        """True unless ``path`` is in :attr:`partial` and the file ``name`` of folder
        ``fd`` is not the start of the temporary file ``tmp`` (its new content)."""
        return path not in self.partial or starts(fd, tmp, name)


def starts(fd: int, whole: str, part: str) -> bool:
    """True if the bytes of file ``part`` are the first bytes of file ``whole`` (both
    in folder ``fd``; holes read as zeros; links are not followed)."""
    flags = os.O_RDONLY | O_NOFOLLOW | O_CLOEXEC
    try:
        a = os.open(whole, flags, dir_fd=fd)
    except OSError:
        return False
    try:
        b = os.open(part, flags, dir_fd=fd)
    except OSError:
        os.close(a)
        return False
    with open(a, "rb") as fa, open(b, "rb") as fb:
        while True:
            piece = fb.read(1024 * 1024)
            if not piece:
                return True
            if fa.read(len(piece)) != piece:
                return False


def pack_jobs(pack_id: str, placed: list[tuple[PackEntry, WritePlan]],
              local: bool = True) -> list[WriteJob]:
    """The jobs writing the one-blob files of pack ``pack_id`` (``placed``: in pack
    order, with their pack entries), each at most :data:`JOB_FILES` files and
    :data:`JOB_BYTES` of content, :data:`JOB_BYTES_REMOTE` unless every backend is
    ``local`` (a bigger file is a job of its own)."""
    job_bytes = JOB_BYTES if local else JOB_BYTES_REMOTE
    jobs: list[WriteJob] = []
    plans: list[WritePlan] = []
    entries: list[PackEntry] = []
    size = 0
    for entry, plan in placed:
        if plans and (len(plans) == JOB_FILES or size + plan[1].size > job_bytes):
            jobs.append((plans, (pack_id, entries)))
            plans, entries, size = [], [], 0
        plans.append(plan)
        entries.append(entry)
        size += plan[1].size
    if plans:
        jobs.append((plans, (pack_id, entries)))
    return jobs


def local_side(scan: ScanResult) -> dict[str, TreeEntry]:
    """The folder as a checkout's local side: its files, links and folders, and
    each file that cannot be read as a version no tree has (its content is
    unknown: taken as changed here, a remote change never replaces it unkept)."""
    local: dict[str, TreeEntry] = dict(scan.files)
    for d in scan.dirs:
        local[d] = TreeEntry(d.rpartition("/")[2], "dir", "0" * 64)
    for u in scan.problems.unreadable:
        if not u.folder:
            local[u.path] = TreeEntry(u.path.rpartition("/")[2], "file", UNREAD_REF)
    return local


def plan(
    co: Checkout, base: dict[str, TreeEntry], remote: dict[str, TreeEntry],
    local: dict[str, TreeEntry], stamp: str, result: PullResult,
) -> tuple[list[tuple[str, TreeEntry]], list[str]]:
    """The files ``co`` writes and deletes (docs/design.md's table); local files in
    the way of a remote change become conflict copies now. Sets the names of the
    tree that are one here with another that stays (``co._refused.clashes``)."""
    writes: list[tuple[str, TreeEntry]] = []
    deletes: list[str] = []
    selection = co._selection
    for path in sorted(set(base) | set(remote)):
        b, n, loc = base.get(path), remote.get(path), local.get(path)
        entry = n or b
        if selection.active and entry is not None and not selection.selects(path, entry.type == "dir"):
            # Outside the selection: nothing written or deleted; its row follows the new
            # tree (a change made elsewhere is recorded, not downloaded; a path gone from
            # it loses its row through ``deletes``, which skips what the scan did not see).
            if n is not None:
                co._outside_rows.append(IndexRow(path, n.type, n.ref, n.size, n.executable,
                                                 OUTSIDE, 0, 0))
            elif entry.type != "dir":
                deletes.append(path)
            continue
        if path in co._outside_kept and n is not None and n.type != "dir":
            writes.append((path, n))  # selected again (widened): not here yet
            continue
        if co.sealed.leaves(path, changed=not same_entry(n, b)):
            continue
        if n is not None and n.type == "dir":
            # Folders are created later. A file that master replaced by a folder
            # goes if unchanged here; if changed, creating the folder keeps it as
            # a conflict copy.
            if b is not None and b.type != "dir" and same_entry(loc, b):
                deletes.append(path)
            continue
        if b is not None and b.type == "dir" and n is None:
            continue  # a removed folder: its contents are paths of their own
        if same_entry(n, b) or same_entry(loc, n):
            continue
        if same_entry(loc, b):
            if n is None:
                deletes.append(path)
            else:
                writes.append((path, n))
        elif n is None:
            co.ctx.reporter.note(f"kept {display_path(path)}: deleted remotely but changed here")
        else:
            # Not on disk (an index row): nothing to keep; another name may answer.
            # A file a crashed fresh clone may have left part-written is replaced
            # if it is (:class:`InPlace`), else kept as a conflict copy then.
            ours = co._place.may_be_partial(path, b, loc, n)
            if (loc is not None and loc.type != "dir" and not ours
                    and (path in co._seen or loc.ref == UNREAD_REF)):
                copy = co._conflict_copy(path, stamp)
                if copy is not None:
                    result.conflicts.append(copy)
                    co.ctx.reporter.note(f"conflict: your version of {display_path(path)} is now "
                                         f"{display_path(copy)}")
            writes.append((path, n))
    # One name here with a path of the new tree or a local one that stays (an
    # edit kept over a remote case-only rename): the one on disk is kept.
    case_insensitive = co.scanner.traits.case_insensitive
    gone = set(deletes)
    kept = (p for p in local if p not in remote and p not in gone)
    clashes = co._refused.clashes = name_clashes(chain(remote, kept), co._seen, case_insensitive)
    # A path not on disk (an index row) because it was one name with another of
    # the last tree is written once that clash is gone.
    absent = [p for p, e in local.items() if p not in co._seen and e.type != "dir"
              and p not in co._outside_kept
              and e.ref != UNREAD_REF and p not in clashes and same_entry(e, remote.get(p))
              and same_entry(e, base.get(p)) and not co.sealed.holding(p)]
    if absent:
        before = name_clashes(base, co._seen, case_insensitive)
        writes += [(p, remote[p]) for p in absent if p in before]
    return writes, deletes


def disk_path(spelled: dict[str, str], path: str) -> str:
    """``path`` as spelled on disk, given the scan's paths spelled otherwise there
    (``spelled``: index path -> path on disk, :func:`~metasync.scanner.respell`):
    its own spelling, else its nearest such folder's with the rest of ``path``."""
    if path in spelled:
        return spelled[path]
    parent = path.rpartition("/")[0]
    while parent:
        if parent in spelled:
            return spelled[parent] + path[len(parent):]
        parent = parent.rpartition("/")[0]
    return path


def _move(folders: Folders, source: str, copy: str, aside: InTheWay) -> bool:
    """Rename ``source`` to ``copy`` (both in the tree of ``folders``); False if
    ``source``'s folder is no longer a folder of that tree."""
    with folders.opened(source.rpartition("/")[0]) as src:
        if src is None:
            return False
        with folders.made(copy.rpartition("/")[0], aside) as dst:
            os.rename(source.rpartition("/")[2], copy.rpartition("/")[2],
                      src_dir_fd=src, dst_dir_fd=dst)
    return True


def replace_name(fd: int, tmp: str, name: str) -> None:
    """Rename ``tmp`` over ``name`` in folder ``fd``; a name this file system refuses
    raises :class:`~metasync.fstraits.NameRefused` whatever errno it said it with."""
    try:
        os.replace(tmp, name, src_dir_fd=fd, dst_dir_fd=fd)
    except OSError as exc:
        if exc.errno not in NAME_REFUSED and name_refused(exc, fd, tmp, name):
            raise NameRefused(name) from exc
        raise


def _drop_temp(folders: Folders, path: str, tmp: str | None) -> None:
    """Remove the temporary file ``tmp`` written for ``path``, if it is still there
    (None: the file was written in place, and stays)."""
    if tmp is None:
        return
    with folders.opened(path.rpartition("/")[0]) as fd:
        if fd is not None:
            try:
                os.unlink(tmp, dir_fd=fd)
            except FileNotFoundError:
                pass


def apply_waiting(checkout: Checkout) -> PullResult | None:
    """Check out the held-back folders (:attr:`LocalState.waiting_folders`) from the
    tree each was last checked out from to the head's: three ways, as any checkout,
    so an edit made in them meanwhile is kept. A folder still unreadable stays
    held back; None (and no checkout: a whole scan) while every one still is."""
    state = checkout.ctx.state
    waiting = state.waiting_folders
    if all(still_sealed(checkout.root / f) for f in waiting):
        return None
    result = PullResult(state.prev)
    top = state.head or state.prev.master
    checkout.run(*waiting_trees(checkout.graph, waiting, top), result, {})
    state.waiting_folders = {f: t for f, t in waiting.items() if f in checkout.sealed.held}
    return result


def waiting_trees(graph: ObjectGraph, waiting: dict[str, str], top: str | None,
                  ) -> tuple[dict[str, TreeEntry], dict[str, TreeEntry]]:
    """The base and remote sides of the checkout of held-back folders (``waiting``:
    folder -> the tree it still holds) to their content in commit ``top``."""
    now = graph.tree_at(top) if top else {}
    base: dict[str, TreeEntry] = {}
    remote: dict[str, TreeEntry] = {}
    for folder, tree_id in waiting.items():
        inside = folder + "/"
        if tree_id:
            base[folder] = TreeEntry(folder.rpartition("/")[2], "dir", tree_id)
            base.update((inside + p, e) for p, e in graph.flatten(tree_id).items())
        remote.update((p, e) for p, e in now.items() if p == folder or p.startswith(inside))
    return base, remote
