"""The outbox: objects a commit made, packed and queued for upload.

A commit writes new packs, then index objects, then the commit into
``.metasync/outbox/`` (temporary file, fsync, rename) before the local database
records them in one transaction; ``flush`` uploads them in that order (packs,
then indexes, then commits, each phase finished before the next), so nothing on
a backend ever refers to an object that is not there yet (docs/FORMAT.md §10).
An object leaves the outbox once at least one holder has it; the holders it
missed are recorded and written later by the replicator.
"""

from __future__ import annotations

import io
import json
import os
import sqlite3
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from metasync.backends import Backend
from metasync.codec import PACK_TARGET_SIZE, FinishedPack, PackBuilder
from metasync.context import RepoContext
from metasync.errors import (
    BackendUnavailable,
    CorruptObject,
    Interrupted,
    MetasyncError,
    UsageError,
)
from metasync.faults import crash_point, pause_point
from metasync.graph import ObjectGraph
from metasync.layout import client_key
from metasync.localdb import IndexRow
from metasync.objects import Commit, FileObject, Index, PackEntry, Version, is_object_id
from metasync.progress import CANCEL
from metasync.replicator import Replicator, Uploaded
from metasync.worktree import write_durable

#: A commit lists at most this many index objects; beyond it they are merged.
MAX_INDEXES = 64
#: Pack entries per index object (keeps each well under the readers' size limit).
INDEX_ENTRIES = 100_000

#: A standalone object to store: ``(kind, id, plaintext)``.
Standalone = tuple[str, str, bytes]


def pack_target_size() -> int:
    """Bytes at which a pack is closed: 16 MiB, or ``METASYNC_PACK_SIZE`` (for
    tests that need many objects, and for measuring other sizes on slow links)."""
    raw = os.environ.get("METASYNC_PACK_SIZE")
    if not raw:
        return PACK_TARGET_SIZE
    try:
        value = int(raw)
    except ValueError:
        raise UsageError(f"METASYNC_PACK_SIZE={raw!r} is not a number of bytes") from None
    if not 1 <= value <= PACK_TARGET_SIZE * 4:
        raise UsageError(f"METASYNC_PACK_SIZE must be between 1 and {PACK_TARGET_SIZE * 4}")
    return value


@dataclass
class FlushReport:
    """What one flush of the outbox uploaded."""

    objects: int = 0
    bytes: int = 0
    #: Copies written to another backend because a holder could not take them.
    spilled: int = 0
    #: Objects that got fewer copies (or fragments) than they should have: fewer
    #: backends took writes than the configuration asks for.
    short: list[str] = field(default_factory=list)

    def add(self, placed: Uploaded | FlushReport) -> None:
        if isinstance(placed, FlushReport):
            self.objects += placed.objects
            self.bytes += placed.bytes
            self.spilled += placed.spilled
            self.short += placed.short
            return
        self.objects += 1
        self.bytes += placed.written
        self.spilled += len(placed.spilled)
        if placed.short:
            self.short.append(placed.stored_id)


class KnownIds:
    """Which object ids already have a location, answered from any thread."""

    def __init__(self, db_path: Path) -> None:
        self._path = db_path
        self._local = threading.local()
        self._new: set[str] = set()
        self._lock = threading.Lock()

    def claim(self, object_id: str) -> bool:
        """True exactly once per id that is not yet stored anywhere."""
        return bool(self.claim_many([object_id]))

    def claim_many(self, object_ids: list[str]) -> set[str]:
        """The ids of ``object_ids`` not yet stored anywhere nor claimed before, each
        claimed now (so it is returned exactly once): one query per few hundred ids
        rather than one per id."""
        with self._lock:
            fresh = [i for i in dict.fromkeys(object_ids) if i not in self._new]
            self._new.update(fresh)
        if not fresh:
            return set()
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = self._local.conn = sqlite3.connect(f"file:{self._path}?mode=ro", uri=True)
        claimed = set(fresh)
        for start in range(0, len(fresh), _CLAIM_QUERY):
            part = fresh[start:start + _CLAIM_QUERY]
            marks = ",".join("?" * len(part))
            claimed.difference_update(r[0] for r in conn.execute(
                f"SELECT object_id FROM locations WHERE object_id IN ({marks})", part))
        return claimed


#: Ids looked up in one query (under SQLite's oldest limit of 999 parameters).
_CLAIM_QUERY = 500
#: A hashing thread hands its objects to the pack in batches of at most this many
#: objects or bytes (one lookup of which are new per batch, not one per object).
SINK_BATCH = 256
SINK_BATCH_BYTES = 1 << 20


class ObjectWriter:
    """Packs new objects into the outbox for one commit (from any thread).

    Each thread's objects wait in a small batch (:data:`SINK_BATCH`) so which of
    them are new is asked once per batch; :meth:`finish` packs what still waits."""

    def __init__(self, outbox: Outbox, early: EarlyUpload | None = None) -> None:
        self.outbox = outbox
        self.early = early
        self.known = KnownIds(outbox.ctx.db.path)
        # Each pack is written to the outbox as it fills: no pack is held in memory.
        self.builder = PackBuilder(outbox.ctx.codec, pack_target_size(), self._spool)
        self.finished: list[FinishedPack] = []
        self.counts: dict[str, int] = {}
        self._lock = threading.Lock()
        self._local = threading.local()
        #: Every thread's batch, so :meth:`finish` drains them all.
        self._batches: list[_Batch] = []

    def _spool(self) -> BinaryIO:
        """A new temporary file in the outbox for a pack being built (one that an
        interrupted commit leaves is removed by :meth:`Outbox.clean`)."""
        return open(self.outbox.folder / f".tmp-{os.urandom(6).hex()}", "wb")

    def _keep(self, pack: FinishedPack | None) -> None:
        if pack is None:
            return
        spool = pack.spool
        if spool is None:
            write_durable(self.outbox.folder / pack.pack_id, pack.data)
            pack.data = b""  # on disk now: keep only the entries, so memory stays flat
        else:  # temp file, fsync, rename, as write_durable
            with spool:
                os.fsync(spool.fileno())
            os.replace(spool.name, self.outbox.folder / pack.pack_id)
            pack.spool = None
        with self._lock:
            self.finished.append(pack)
        if self.early is not None:
            self.early.offer(pack.pack_id)

    def sink(self, kind: str, object_id: str, data: bytes) -> None:
        """Store one object unless some pack already holds it (once this thread's
        batch is drained, at the latest by :meth:`finish`)."""
        batch: _Batch | None = getattr(self._local, "batch", None)
        if batch is None:
            batch = self._local.batch = _Batch()
            with self._lock:
                self._batches.append(batch)
        batch.items.append((kind, object_id, data))
        batch.size += len(data)
        if len(batch.items) >= SINK_BATCH or batch.size >= SINK_BATCH_BYTES:
            self._drain(batch)

    def _drain(self, batch: _Batch) -> None:
        items, batch.items, batch.size = batch.items, [], 0
        new = self.known.claim_many([object_id for _, object_id, _ in items])
        for kind, object_id, data in items:
            if object_id not in new:
                continue
            new.discard(object_id)  # the same content twice in one batch: packed once
            with self._lock:
                self.counts[kind] = self.counts.get(kind, 0) + 1
            self._keep(self.builder.add(kind, object_id, data))

    def abandon(self) -> None:
        """The commit failed: close and remove the pack being spooled now (a failed
        commit otherwise kept its file open until the cyclic garbage collector ran:
        one descriptor per failed commit in a daemon). Finished packs stay in the
        outbox for :meth:`Outbox.clean`."""
        if self.early is not None:
            self.early.stop()
        spool = self.builder.discard()
        if spool is not None and not isinstance(spool, io.BytesIO):
            Path(spool.name).unlink(missing_ok=True)

    def finish(self) -> list[Standalone]:
        """Pack what waits in every thread's batch, flush the last pack; return the
        index objects listing every pack. Only once no thread sinks any more."""
        for batch in self._batches:
            self._drain(batch)
        self._keep(self.builder.flush())
        return self.outbox.index_objects([(p.pack_id, tuple(p.entries)) for p in self.finished])


class EarlyUpload:
    """Packs uploaded while the commit that made them is still being built, so a
    push hashes on every core while the backends already take its first packs.

    One thread announces each batch of finished packs to gc, exactly as
    :meth:`Outbox.flush` does for its own, but from a snapshot of this client's
    state taken when the commit began: it writes nothing to the local database,
    which the committing thread holds. It then hands the batch to a thread of its
    own that uploads it, and goes on with the next batch, so uploads overlap as in
    the flush (a slow link is not left idle between packs). What they placed waits
    in :attr:`placed`; once the commit has recorded the packs, the flush books each
    (missed holders, outbox row) as if it had uploaded it itself and announces them
    again, durably. A pack uploaded here whose commit is never recorded is garbage
    nothing refers to (announced until a later push of this client is decided): gc
    collects it.

    Best effort: a batch it cannot announce or place stops it, and the flush
    uploads what is left, and says why, as it always did."""

    def __init__(self, outbox: Outbox) -> None:
        self.outbox = outbox
        state = outbox.ctx.state
        self._head, self._prev = state.head, state.prev
        self._announced = set(state.announced)
        self._queue: list[str] = []
        self._cond = threading.Condition()
        self._closed = False
        self._thread: threading.Thread | None = None
        self._uploads: list[threading.Thread] = []
        #: Packs on enough backends, by id, with where their copies went.
        self.placed: dict[str, Uploaded] = {}
        #: Packs handed to an upload once their announcement took the quorum.
        self.sent: set[str] = set()

    def offer(self, pack_id: str) -> None:
        """Queue a pack now durable in the outbox (from any thread)."""
        with self._cond:
            if self._closed:
                return
            self._queue.append(pack_id)
            self._cond.notify()
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="metasync-early-announce",
                                                daemon=True)
                self._thread.start()

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while not self._queue and not self._closed:
                        self._cond.wait()
                    batch, self._queue = self._queue, []
                if not batch:
                    return
                self._announced.update(batch)
                try:
                    self.outbox.write_client_state(self._head, self._prev, self._announced,
                                                   required=True)
                except Exception:  # the flush does it again, and reports it
                    self._give_up()
                    return
                self.sent.update(batch)
                upload = threading.Thread(target=self._upload, args=(batch,),
                                          name="metasync-early-upload", daemon=True)
                upload.start()
                self._uploads.append(upload)
        finally:
            for upload in self._uploads:
                upload.join()

    def _upload(self, batch: list[str]) -> None:
        outbox = self.outbox
        try:
            outbox.replicator.upload(
                [(pack_id, outbox._loader(pack_id)) for pack_id in batch], self._keep)
        except Exception:
            # Left to the flush, which retries and reports in the command's thread
            # (nothing refers to a pack yet: the commit is not even recorded).
            self._give_up()
            return
        crash_point("upload:early")
        pause_point("upload:early")

    def _give_up(self) -> None:
        with self._cond:
            self._closed = True
            self._queue.clear()

    def _keep(self, placed: Uploaded) -> None:
        self.placed[placed.stored_id] = placed

    def finish(self) -> dict[str, Uploaded]:
        """Wait until every offered pack is uploaded (or left to the flush); the
        packs placed."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        if self._thread is not None:
            try:
                self._thread.join()
            except BaseException:  # Ctrl-C while waiting: stop the transfers first
                self.stop()
                raise
        return self.placed

    def stop(self) -> None:
        """The commit failed: drop what waits and stop the transfers under way (as a
        Ctrl-C does), returning once none runs."""
        with self._cond:
            self._closed = True
            self._queue.clear()
            self._cond.notify()
        if self._thread is None or not self._thread.is_alive():
            return
        asked_here = CANCEL.request()
        try:
            self._thread.join()
        finally:
            if asked_here:
                CANCEL.clear()


@dataclass
class _Batch:
    """One thread's objects waiting to be packed."""

    items: list[tuple[str, str, bytes]] = field(default_factory=list)
    size: int = 0


class Outbox:
    """The queue of stored objects this client made and has not uploaded."""

    def __init__(self, ctx: RepoContext, graph: ObjectGraph, replicator: Replicator) -> None:
        self.ctx = ctx
        self.db = ctx.db
        self.folder = ctx.outbox_dir
        self.graph = graph
        self.replicator = replicator
        #: What an earlier command left queued after it began uploading it (announced
        #: first, always: a Ctrl-C or a crash in its flush): copies may be on some
        #: backends, which are not sent it again. Only those: a copy of what was
        #: never sent (an offline commit's) is not looked for.
        self._left = ({stored_id for stored_id, _ in self.db.outbox()}
                      & set(ctx.state.announced))

        #: Packs a push uploaded while it committed (see :class:`EarlyUpload`),
        #: booked by the next flush.
        self._early: EarlyUpload | None = None

    def writer(self, upload_early: bool = False) -> ObjectWriter:
        """A writer packing the objects of one new commit; with ``upload_early`` (a
        push) each finished pack is uploaded at once, booked by the next flush."""
        if not upload_early:
            return ObjectWriter(self)
        self._early = EarlyUpload(self)
        return ObjectWriter(self, self._early)

    # ---------------------------------------------------------------- index objects
    def index_objects(self, packs: list[tuple[str, tuple[PackEntry, ...]]]) -> list[Standalone]:
        """Index objects listing ``packs``, each at most INDEX_ENTRIES entries so no
        index exceeds what readers accept."""
        out: list[Standalone] = []
        group: list[tuple[str, tuple[PackEntry, ...]]] = []
        count = 0
        for pack_id, entries in packs:
            if group and count + len(entries) > INDEX_ENTRIES:
                out.append(self._index_object(group))
                group, count = [], 0
            group.append((pack_id, entries))
            count += len(entries)
        if group:
            out.append(self._index_object(group))
        return out

    def _index_object(self, packs: list[tuple[str, tuple[PackEntry, ...]]]) -> Standalone:
        data = Index(tuple(packs)).to_bytes()
        return "index", self.ctx.codec.id_of("index", data), data

    def commit_indexes(self, inherited: list[Commit],
                       stored: list[Standalone]) -> tuple[set[str], set[str]]:
        """The indexes a new commit lists: this client's unpublished ones, those of
        the current line the ``inherited`` commits list, and the new ``stored`` ones.
        Past MAX_INDEXES they are merged into a few new ones, appended to ``stored``.
        Second: the unpublished and new ones merged away, which the caller records
        as no longer local when it records the commit (their packs are listed by the
        merged ones; left local, each later commit would list and merge them again,
        and a decided version would keep them announced)."""
        db = self.db
        own = set(db.local_indexes()) | {object_id for _, object_id, _ in stored}
        indexes = set(own)
        for c in inherited:
            # Only indexes of the current line: after a gc, older ones may list
            # collected packs (see LocalState.forget_collected).
            indexes |= {i for i in c.indexes if db.index_state(i) in ("remote", "local")}
        if len(indexes) > MAX_INDEXES:
            fresh = {object_id: data for _, object_id, data in stored}
            merged = self.index_objects(self._merged_index_packs(indexes, fresh))
            stored += merged
            indexes = {object_id for _, object_id, _ in merged}
        return indexes, own - indexes

    def _merged_index_packs(
        self, index_ids: set[str], fresh: dict[str, bytes]
    ) -> list[tuple[str, tuple[PackEntry, ...]]]:
        """The union of the packs the given indexes list (to merge many into few);
        ``fresh`` holds indexes made by this commit, not yet recorded anywhere."""
        packs: dict[str, tuple[PackEntry, ...]] = {}
        for index_id in sorted(index_ids):
            data = fresh.get(index_id)
            index = Index.from_bytes(data) if data is not None else self.graph.read_index(index_id)
            for pack_id, entries in index.packs:
                packs.setdefault(pack_id, entries)
        return sorted(packs.items())

    # ---------------------------------------------------------------- queueing
    def store_standalone(self, stored: list[Standalone]) -> None:
        """Write standalone objects' stored bytes to the outbox, durably (not yet
        recorded: see :meth:`record_standalone`)."""
        codec = self.ctx.codec
        for kind, object_id, plaintext in stored:
            write_durable(self.folder / object_id, codec.encode(kind, object_id, plaintext))

    def record_standalone(self, stored: list[Standalone]) -> None:
        """Queue standalone objects written by :meth:`store_standalone` (inside the
        caller's transaction)."""
        for kind, object_id, plaintext in stored:
            self.db.cache_object(object_id, kind, plaintext)
            self.db.add_outbox(object_id, kind)
            if kind == "index":
                self.db.set_index_state(object_id, "local")

    def record_packs(self, packs: list[FinishedPack], refreshed: list[IndexRow]) -> None:
        """Queue finished packs and learn their entries' locations, with the
        working-tree index rows the scan refreshed, in one transaction."""
        with self.db.transaction():
            for pack in packs:
                self.db.add_locations(pack.pack_id, pack.entries)
                self.db.add_outbox(pack.pack_id, "pack")
            self.db.upsert_index(refreshed)

    def clean(self) -> None:
        """Deal with the outbox files no transaction recorded: what an interrupted
        commit wrote before it could record it (nothing refers to them). Its whole
        packs are kept and queued (:meth:`_adopt`), so the next commit neither packs
        nor uploads their objects again; anything else is removed."""
        recorded = {stored_id for stored_id, _ in self.db.outbox()}
        with os.scandir(self.folder) as it:
            unrecorded = [Path(entry.path) for entry in it if entry.name not in recorded]
        adopted = self._whole_packs([p for p in unrecorded if is_object_id(p.name)])
        # Removed before the adopted packs' index is written: it may have the name
        # of an index the interrupted commit wrote (the same packs, the same bytes).
        for path in unrecorded:
            if path.name not in adopted:
                path.unlink(missing_ok=True)
        self._adopt(adopted)

    def _whole_packs(self, candidates: list[Path]) -> dict[str, list[PackEntry]]:
        """The finished packs among ``candidates`` (outbox files an interrupted
        commit -- Ctrl-C, a crash, an error -- wrote but never recorded) that can be
        kept, with their entries.

        A candidate is kept only if it is a whole pack under its name (the codec's
        full check) and every file object in it has all its chunks in a kept pack or
        already located: the next scan trusts an index row whose content is located,
        so a file object kept without its chunks would be committed without them.
        Not kept either: a pack already located (a flush stopped between booking its
        upload and removing its file: it is on the backends) and one under an older
        data key (a key rotation under way would have to re-key it again)."""
        codec, db = self.ctx.codec, self.db
        packs: dict[str, list[PackEntry]] = {}
        needs: dict[str, set[str]] = {}
        located = db.pack_ids() if candidates else set()
        # Only while a rotation is under way can a pack be under an older key.
        rotating = codec.keyring is not None and len(codec.keyring.data_keys) > 1
        for path in candidates:
            if path.name in located:
                continue
            try:
                data = path.read_bytes()
                entries = codec.pack_entries(path.name, data)
                if rotating and codec.pack_is_stale(path.name, data, entries):
                    continue
                chunks: set[str] = set()
                for e in entries:
                    if e.kind == "file":
                        plain = codec.decode("file", e.object_id, data[e.offset:e.offset + e.length])
                        chunks.update(c.blob_id for c in FileObject.from_bytes(plain).chunks)
            except (OSError, CorruptObject):
                continue  # not a pack, or not whole: removed
            packs[path.name], needs[path.name] = entries, chunks
        while True:  # dropping a pack can leave another's file objects without chunks
            held = {e.object_id for entries in packs.values() for e in entries}
            lacking = [pack_id for pack_id, chunks in needs.items()
                       if any(c not in held and not db.is_located(c) for c in chunks)]
            if not lacking:
                break
            for pack_id in lacking:
                del packs[pack_id], needs[pack_id]
        return packs

    def _adopt(self, packs: dict[str, list[PackEntry]]) -> None:
        """Queue ``packs`` (:meth:`_whole_packs`) with an index object listing them,
        as a commit records its own. Those the early upload had announced keep that
        record (see :meth:`stop_early`), so the flush sends no copy a backend
        already holds whole. Only those: after a crash the local record lacks the
        others, and a command that publishes it (a pull) ends their announcement on
        the backends, so a gc may be collecting a copy found there; they are sent
        again."""
        if not packs:
            return
        db = self.db
        listed = sorted(packs.items())
        stored = self.index_objects([(pack_id, tuple(entries)) for pack_id, entries in listed])
        self.store_standalone(stored)
        with db.transaction():
            for pack_id, entries in listed:
                db.add_locations(pack_id, entries)
                db.add_outbox(pack_id, "pack")
            self.record_standalone(stored)
        self._left |= set(packs) & set(self.ctx.state.announced)

    # ---------------------------------------------------------------- uploading
    def flush(self) -> FlushReport:
        """Upload queued objects: all packs, then indexes, then commits, so nothing
        on a backend ever refers to an object that is not there yet. Announces the
        uploads to gc first. Packs a push already uploaded while it committed are
        waited for and booked, not uploaded again (:class:`EarlyUpload`)."""
        # Left in place until the end: whatever stops the flush early, the push's
        # own cleanup (:meth:`stop_early`) still stops the early upload.
        early_upload = self._early
        # What it placed, filled until EarlyUpload.finish returns.
        placed: dict[str, Uploaded] = early_upload.placed if early_upload is not None else {}
        pending = self.db.outbox()
        report = FlushReport()
        sizes = {sid: (self.folder / sid).stat().st_size for sid, _ in pending}
        replicas = self.ctx.store.config.replicas
        reporter = self.ctx.reporter
        booked: set[str] = set()

        def done(placed: Uploaded) -> None:
            stored_id = placed.stored_id
            with self.db.transaction():
                self._record_missed(placed)
                self.db.remove_outbox(stored_id)
            (self.folder / stored_id).unlink(missing_ok=True)
            booked.add(stored_id)
            report.add(placed)
            reporter.advance(sizes[stored_id] * replicas)
            crash_point("upload")

        announced = False  # this client's local record names the early packs

        def book_early(phase: str | None = None) -> None:
            """Book the recorded packs the early upload placed (of ``phase``): only
            once the local record of this client's announcement names them -- this
            flush's announcement, or after a stop the early upload's own -- (booked,
            they leave the outbox, and a later announcement must not drop them while
            no decided version names them)."""
            if not announced:
                return
            for sid, kind in pending:
                if sid in placed and sid not in booked and phase in (None, kind):
                    done(placed[sid])

        try:
            # From here a Ctrl-C says how much was kept: tests/test_interrupt.py
            # interrupts a push once it is here.
            pause_point("upload:flush")
            if early_upload is not None:
                # Before this flush's announcement: a late one of the early upload's
                # (its packs only) must never overwrite it on a backend.
                early_upload.finish()
            if pending:
                self.publish_client_state([sid for sid, _ in pending])
            announced = True
            reporter.start("upload", sum(sizes.values()) * replicas)
            for phase in ("pack", "index", "commit"):
                if phase == "index":
                    # The packs are up and announced, nothing refers to them yet: a
                    # test runs another client's gc here (tests/test_gc.py).
                    pause_point("upload:packs")
                book_early(phase)
                items = [(sid, self._loader(sid)) for sid, kind in pending
                         if kind == phase and sid not in placed]
                if items:
                    self.replicator.upload(items, done, self._left)
        except (Interrupted, KeyboardInterrupt) as exc:
            if early_upload is not None and not announced:
                # Stopped before this flush announced (while it waited for the early
                # upload, on a slow link most of the push): each pack the early upload
                # placed went up only after an announcement of its own that names it
                # took the quorum. Recorded as announced, every later announcement of
                # this client names it too, so it is kept, not uploaded again.
                # So is each it began to upload (announced the same way): copies of
                # it may be whole on some backends, which the next flush asks first.
                self.stop_early()
                self._keep_announced([sid for sid, _ in pending
                                      if sid in placed or sid in early_upload.sent])
                announced = True
            book_early()  # what the early upload placed before it stopped is kept too
            if not CANCEL.requested() and not isinstance(exc, Interrupted):
                raise  # not the user's stop (a library caller's KeyboardInterrupt)
            # Each object recorded as uploaded has its copies; the others stay queued
            # and nothing refers to them yet (commits go last).
            raise Interrupted(
                f"{report.objects} of {len(pending)} objects uploaded; the next push "
                "continues") from None
        finally:
            self.stop_early()  # an error above: no transfer is left running
            reporter.finish()
        return report

    def _keep_announced(self, stored_ids: list[str]) -> None:
        """Add objects already announced on the backends to the local record of
        this client's announcement (:meth:`publish_client_state`)."""
        state = self.ctx.state
        with state.transaction():
            state.announced = sorted(set(state.announced) | set(stored_ids))

    def stop_early(self) -> None:
        """Stop the early upload of the last commit, if any still runs (its placed
        packs not booked are uploaded again by the next flush)."""
        early, self._early = self._early, None
        if early is not None:
            early.stop()
            # Stopped before its flush (Ctrl-C while the commit is built): what it
            # announced stays announced, and the next commit keeps those packs.
            unrecorded = early.sent - set(self.ctx.state.announced)
            if unrecorded:
                self._keep_announced(sorted(unrecorded))

    def _record_missed(self, placed: Uploaded) -> None:
        """Remember (inside the caller's transaction) the holders an upload missed,
        and, if it is short, the copies it has: every later push and daemon cycle
        repairs it and says it is short until R copies exist."""
        for backend_id in placed.missed:
            self.db.add_missing_copy(placed.stored_id, backend_id)
        if placed.short:
            self.db.set_short(placed.stored_id, placed.copies)

    def _loader(self, stored_id: str) -> Callable[[], BinaryIO]:
        path = self.folder / stored_id
        return lambda: open(path, "rb")

    def upload_standalone(self, stored: list[Standalone]) -> None:
        """Encode and upload standalone objects to their holders now, not through
        the queue (copies that fail are recorded for repair)."""
        codec = self.ctx.codec
        encoded = {object_id: codec.encode(kind, object_id, plaintext)
                   for kind, object_id, plaintext in stored}

        def done(placed: Uploaded) -> None:
            with self.db.transaction():
                self._record_missed(placed)

        self.replicator.upload(
            [(object_id, _bytes_loader(data)) for object_id, data in encoded.items()], done)

    def publish_client_state(self, pending: list[str] | None = None) -> None:
        """Per-client data (paper 3.1): this client's head and prev on every backend.

        With ``pending`` -- the objects it is about to upload -- this is the push's
        announcement to garbage collection: written to a majority of the backends
        (in Byzantine mode a Byzantine quorum: :func:`metasync.paxos.announcement_quorum`)
        before the first upload (or the push fails), so a gc that lists an upload
        also reads its announcement and keeps it (docs/design.md, "Garbage
        collection"). Announced objects stay in the state until a push of this
        client is decided. Without ``pending``, best effort."""
        state = self.ctx.state
        if pending:
            self._keep_announced(pending)
        self.write_client_state(state.head, state.prev, set(state.announced),
                                required=bool(pending))

    def write_client_state(self, head: str | None, prev: Version, announced: set[str],
                           required: bool) -> None:
        """Write this client's state (:meth:`publish_client_state`) on every backend;
        ``required``: raise :class:`BackendUnavailable` unless the announcement
        quorum took it. Touches no local database (any thread may call it)."""
        doc: dict[str, Any] = {"head": head, "prev": prev.to_json()}
        if announced:
            # Every object uploaded since the last decided push stays announced: a
            # local commit not decided yet may still need it.
            doc["pending"] = sorted(announced)
        name = client_key(self.ctx.client_id)
        data = self.ctx.codec.encode("client", name, json.dumps(doc).encode())
        backends = self.ctx.store.backends

        def one(backend: Backend) -> str | None:
            try:
                backend.put(name, data)
            except MetasyncError as exc:
                return f"{backend.name}: {exc}"
            return None

        failures = [f for f in self.ctx.store.executor.map(one, backends.values()) if f]
        written = len(backends) - len(failures)
        from metasync.paxos import announcement_quorum  # small, pure; only pushes need it

        needed = announcement_quorum(
            len(backends), self.ctx.store.config.fault_model == "byzantine")
        if required and written < needed:
            raise BackendUnavailable(
                f"could not announce the upload on {needed} of the {len(backends)} backends "
                f"(written on {written}: {failures[0]}); nothing was uploaded; retry"
            )


def _bytes_loader(data: bytes) -> Callable[[], BinaryIO]:
    return lambda: io.BytesIO(data)
