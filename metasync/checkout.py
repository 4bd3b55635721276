"""Checkout: moving the folder from one tree to another without losing a local change.

For each path, base = the tree the folder was checked out from, local = the
folder now, remote = the new tree (the rules are in docs/design.md, "The
folder"). Files are written to temporary files beside their targets by the
:class:`FileWriter` (which also serves ``restore``), flushed in batches and
renamed into place; a file that changed since the scan the checkout planned with
becomes a conflict copy instead of being replaced. A checkout is recorded as
pending before it starts, so a crash leaves one the next command finishes.
"""

from __future__ import annotations

import os
import stat
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from metasync.context import RepoContext
from metasync.errors import CorruptObject, ObjectUnavailable
from metasync.faults import crash_point
from metasync.graph import ObjectGraph
from metasync.localdb import IndexRow
from metasync.objects import TreeEntry, Version, same_entry
from metasync.scanner import Scanner
from metasync.worktree import ScanEntry, conflict_name, remove_stale_temps, temp_path_for

#: Files written by a checkout are flushed and renamed in batches of this many.
WRITE_BATCH = 2000
#: Small files of one pack written by one worker task.
JOB_FILES = 400

#: A file to write: its path, its tree entry, and its content as (blob id, length).
WritePlan = tuple[str, TreeEntry, list[tuple[str, int]]]
#: A written temporary file: its plan, its path, and its stat (None for a link).
WrittenTemp = tuple[WritePlan, Path, "os.stat_result | None"]


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


def now_stamp() -> str:
    """The local time as conflict-copy names show it."""
    return datetime.now().strftime("%Y-%m-%d %H%M%S")


class FileWriter:
    """Writes files and links of stored content to temporary files beside their
    targets (the caller renames them into place)."""

    def __init__(self, ctx: RepoContext, graph: ObjectGraph) -> None:
        self.ctx = ctx
        self.graph = graph

    def write_temp(
        self, target: Path, entry: TreeEntry, chunks: list[tuple[str, int]],
        prefetched: dict[str, bytes] | None = None, *, durable: bool = False,
    ) -> tuple[Path, os.stat_result | None]:
        """Write one file or link to a temporary name beside ``target``; return the
        name and, for a file, its final stat (size, mtime and inode survive the
        rename). ``durable`` fsyncs the file (a checkout flushes whole batches
        instead). Every blob's length is checked against the tree."""
        tmp = temp_path_for(target)
        if entry.type == "link":
            os.symlink(entry.ref, tmp)
            return tmp, None
        mode = self.ctx.file_modes[entry.executable]
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
        try:
            with os.fdopen(fd, "wb") as fh:
                for group in chunk_groups(chunks):
                    data = prefetched if prefetched is not None else self.graph.read_blobs(group)
                    for blob_id, length in group:
                        piece = data[blob_id]
                        if len(piece) != length:
                            raise CorruptObject(f"blob {blob_id[:12]} has the wrong length")
                        fh.write(piece)
                        self.ctx.reporter.advance(length)
                fh.flush()
                if durable:
                    os.fsync(fh.fileno())
                st = os.fstat(fh.fileno())
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return tmp, st


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

    # ---------------------------------------------------------------- pending checkouts
    def resume(self) -> PullResult | None:
        """Finish a checkout a crash interrupted; ``None`` if none was pending."""
        # A damaged record reads as None: as if none were pending (the next checkout
        # scans the folder anyway, and overwrites it).
        if self.ctx.state.checkout_pending is None:
            return None
        remove_stale_temps(self.root)
        return self.run_pending()

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
                 result, pending.moves)
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
    ) -> None:
        """Three-way between ``base`` (what the folder was), the folder, and ``remote``.

        ``moves`` maps new paths to paths whose current content they take (a merge's
        conflict copies of local versions): renamed locally instead of downloaded.
        """
        scan = self.scanner.scan(None)
        self._seen = scan.seen
        local: dict[str, TreeEntry] = dict(scan.files)
        for d in scan.dirs:
            local[d] = TreeEntry(d.rpartition("/")[2], "dir", "0" * 64)
        stamp = now_stamp()
        for copy, source in sorted(moves.items()):
            have = local.get(source)
            if (copy not in local and have is not None and copy in remote
                    and same_entry(have, remote[copy]) and same_entry(have, base.get(source))):
                parent = copy.rpartition("/")[0]
                if parent:
                    self._ensure_dir(parent, stamp, result)
                os.rename(self.root / source, self.root / copy)
                local[copy] = local.pop(source)
                self._seen.pop(source, None)
        scanned = {e.path: e for e in scan.rows}
        writes, deletes = self._plan(base, remote, local, stamp, result)
        crash_point("checkout:planned")
        for path in deletes:
            target_path = self.root / path
            try:
                if target_path.is_dir() and not target_path.is_symlink():
                    continue
                if self._changed_since_scan(path):
                    self.ctx.reporter.note(f"kept {path}: it changed during the pull")
                    continue
                target_path.unlink()
                result.deleted += 1
            except FileNotFoundError:
                pass
        # Folders deleted remotely go if nothing local remains in them, deepest first.
        for path in sorted((p for p, e in base.items() if e.type == "dir" and p not in remote),
                           key=lambda p: p.count("/"), reverse=True):
            try:
                (self.root / path).rmdir()
            except OSError:
                pass
        for path in sorted((p for p, e in remote.items() if e.type == "dir"), key=lambda p: p.count("/")):
            b = base.get(path)
            if b is not None and b.type == "dir" and path not in local:
                continue  # removed here, untouched remotely: stays removed (files
                # the remote changed inside bring their folders back as they are written)
            self._ensure_dir(path, stamp, result)
        rows = self._write_files(writes, stamp, result, scanned)
        db = self.ctx.db
        with db.transaction():
            db.delete_index(deletes)
            db.upsert_index(rows)
            db.upsert_index(r for r in scan.rows if r.path not in {w[0] for w in writes})

    def _plan(
        self, base: dict[str, TreeEntry], remote: dict[str, TreeEntry],
        local: dict[str, TreeEntry], stamp: str, result: PullResult,
    ) -> tuple[list[tuple[str, TreeEntry]], list[str]]:
        """The files to write and to delete (docs/design.md's table); local files in
        the way of a remote change become conflict copies now."""
        writes: list[tuple[str, TreeEntry]] = []
        deletes: list[str] = []
        for path in sorted(set(base) | set(remote)):
            b, n, loc = base.get(path), remote.get(path), local.get(path)
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
                self.ctx.reporter.note(f"kept {path}: deleted remotely but changed here")
            else:
                if loc is not None and loc.type != "dir":
                    copy = self._conflict_copy(path, stamp)
                    result.conflicts.append(copy)
                    self.ctx.reporter.note(f"conflict: your version of {path} is now {copy}")
                writes.append((path, n))
        return writes, deletes

    def _changed_since_scan(self, path: str, st: os.stat_result | None = None) -> bool:
        """True if ``path`` exists now but differs in size or mtime from the scan the
        pull planned with (or did not exist then): replacing it could lose an edit."""
        if st is None:
            try:
                st = os.lstat(self.root / path)
            except FileNotFoundError:
                return False
        seen = self._seen.get(path)
        return seen is None or seen.size != st.st_size or seen.mtime_ns != st.st_mtime_ns

    def _conflict_copy(self, path: str, stamp: str) -> str:
        parent, _, name = path.rpartition("/")
        device = self.ctx.device
        new_name = conflict_name(name, device, stamp)
        new_path = f"{parent}/{new_name}" if parent else new_name
        n = 2
        while os.path.lexists(self.root / new_path):
            alt = conflict_name(name, f"{device} {n}", stamp)
            new_path = f"{parent}/{alt}" if parent else alt
            n += 1
        os.rename(self.root / path, self.root / new_path)
        return new_path

    def _ensure_dir(self, path: str, stamp: str, result: PullResult) -> None:
        """Make ``path`` a real folder; a file or link in the way becomes a conflict copy."""
        current = self.root
        for part in path.split("/"):
            current = current / part
            try:
                st = os.lstat(current)
            except FileNotFoundError:
                current.mkdir()
                continue
            if not stat.S_ISDIR(st.st_mode):
                rel = str(current.relative_to(self.root))
                copy = self._conflict_copy(rel, stamp)
                result.conflicts.append(copy)
                self.ctx.reporter.note(f"conflict: {rel} is in the way of a folder; moved to {copy}")
                current.mkdir()

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
        ensured: set[str] = set()
        by_pack: dict[str, list[tuple[int, WritePlan]]] = {}
        jobs: list[list[WritePlan]] = []
        links: list[WritePlan] = []
        total = 0
        db = self.ctx.db
        for path, entry in writes:
            parent = path.rpartition("/")[0]
            if parent and parent not in ensured:
                self._ensure_dir(parent, stamp, result)
                while parent and parent not in ensured:
                    ensured.add(parent)
                    parent = parent.rpartition("/")[0]
            total += entry.size
            if entry.type == "link":
                links.append((path, entry, []))
            elif entry.type == "file":
                loc = db.location(entry.ref)
                if loc is None:
                    raise ObjectUnavailable(f"object {entry.ref[:12]} is in no known pack")
                by_pack.setdefault(loc[0], []).append(
                    (loc[1].offset, (path, entry, [(entry.ref, entry.size)])))
            else:
                jobs.append([(path, entry, self.graph.file_chunks(entry))])
        for placed in by_pack.values():
            # In pack order: each job's blobs are then neighbours, so its coalesced
            # range reads cover only them (in path order they are scattered over the
            # pack, and every job would read most of it).
            placed.sort(key=lambda item: item[0])
            plans = [plan for _, plan in placed]
            jobs.extend(plans[k : k + JOB_FILES] for k in range(0, len(plans), JOB_FILES))
        if links:
            jobs.append(links)

        rows: list[IndexRow] = []
        pending: list[WrittenTemp] = []
        reporter = self.ctx.reporter
        reporter.start("download", total)
        futures = [self.ctx.store.executor.submit(self._write_job, job) for job in jobs]
        try:
            for fut in futures:
                pending.extend(fut.result())
                if len(pending) >= WRITE_BATCH:
                    rows += self._install(pending, stamp, result)
                    pending = []
            rows += self._install(pending, stamp, result)
            pending = []
        except BaseException:
            for fut in futures:  # leave no temporary file behind
                fut.cancel()
                if not fut.cancelled() and fut.exception() is None:
                    pending.extend(fut.result())
            for _, tmp, _ in pending:
                tmp.unlink(missing_ok=True)
            raise
        finally:
            reporter.finish()
        return rows

    def _install(self, pending: list[WrittenTemp], stamp: str, result: PullResult) -> list[IndexRow]:
        """Flush a batch of written temporary files once, then rename each into place."""
        if not pending:
            return []
        os.sync()  # one flush for the batch instead of an fsync per file
        written_at = time.time_ns()

        def fast(item: WrittenTemp) -> bool:
            """Rename into a free or unchanged place; False leaves it to the slow path."""
            (path, _, _), tmp, _ = item
            final = os.path.join(self.root, path)
            try:
                existing = os.lstat(final)
            except FileNotFoundError:
                os.replace(tmp, final)
                return True
            if stat.S_ISDIR(existing.st_mode) or self._changed_since_scan(path, existing):
                return False
            os.replace(tmp, final)
            return True

        # Serial on purpose: renames into the same folders contend on the folder's
        # lock, and measured slower when spread over threads.
        done = []
        for item in pending:
            done.append(fast(item))
            crash_point("checkout:rename")
        rows: list[IndexRow] = []
        for ((path, entry, _), tmp, st), ok in zip(pending, done, strict=True):
            if not ok:
                self._install_slow(path, tmp, stamp, result)
            result.written += 1
            if st is not None:  # renaming keeps the inode and mtime of the temporary file
                rows.append(IndexRow(path, entry.type, entry.ref, st.st_size,
                                     entry.executable, st.st_mtime_ns, st.st_ino, written_at))
        return rows

    def _install_slow(self, path: str, tmp: Path, stamp: str, result: PullResult) -> None:
        """Put ``tmp`` at ``path`` where a folder or a changed file is in the way."""
        final = os.path.join(self.root, path)
        try:
            existing: os.stat_result | None = os.lstat(final)
        except FileNotFoundError:
            existing = None
        if existing is not None and stat.S_ISDIR(existing.st_mode):
            try:
                os.rmdir(final)
            except OSError:
                result.conflicts.append(self._conflict_copy(path, stamp))
        elif existing is not None and self._changed_since_scan(path, existing):
            # Edited (or created) while we were downloading: keep it.
            copy = self._conflict_copy(path, stamp)
            result.conflicts.append(copy)
            self.ctx.reporter.note(f"conflict: {path} changed during the pull; kept as {copy}")
        os.replace(tmp, final)

    def _write_job(self, job: list[WritePlan]) -> list[WrittenTemp]:
        """Write the temporary files of one job (runs in a worker thread)."""
        prefetched: dict[str, bytes] | None = None
        if len(job) > 1 and all(len(chunks) == 1 for _, _, chunks in job):
            prefetched = self.graph.read_blobs([chunks[0] for _, _, chunks in job])
        done: list[WrittenTemp] = []
        try:
            for plan in job:
                path, entry, chunks = plan
                done.append((plan, *self.writer.write_temp(self.root / path, entry, chunks,
                                                           prefetched)))
        except BaseException:
            for _, tmp, _ in done:
                tmp.unlink(missing_ok=True)
            raise
        return done


def chunk_groups(chunks: list[tuple[str, int]], budget: int = 8 * 1024 * 1024) -> list[list[tuple[str, int]]]:
    """Split a file's chunks into groups of about ``budget`` bytes (bounded memory)."""
    groups: list[list[tuple[str, int]]] = [[]]
    size = 0
    for blob_id, length in chunks:
        if groups[-1] and size + length > budget:
            groups.append([])
            size = 0
        groups[-1].append((blob_id, length))
        size += length
    return [g for g in groups if g] or [[]]
