"""The client's local state in ``.metasync/state.db`` (SQLite, WAL).

Holds what never goes to a backend as-is: the working-tree index (git's index:
path, size, mtime, inode -> object), where each known object lives in which
pack, a cache of metadata objects (trees, files, commits), the outbox of
objects waiting for upload, and small settings (client id, head, prev).
Every multi-row change runs in one transaction, so a crash leaves either the
old or the new state.

Paths are kept as Python gives them for POSIX names (``os.fsdecode``: bytes that
are not UTF-8 become lone surrogates). SQLite TEXT holds only valid UTF-8, so a
path's column holds TEXT when its name is valid UTF-8 (what every older client
wrote: their index files keep working as they are) and otherwise a BLOB of its
raw bytes (see :func:`path_key`). A TEXT value never equals a BLOB, so each path
has exactly one stored spelling.
"""

from __future__ import annotations

import builtins
import contextlib
import json
import os
import sqlite3
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

from metasync.objects import PackEntry
from metasync.quickstatus import MEMO_KEY as QUICK_STATUS

SCHEMA = """
CREATE TABLE IF NOT EXISTS settings (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS worktree (
    path TEXT PRIMARY KEY, type TEXT NOT NULL, ref TEXT NOT NULL, size INTEGER NOT NULL,
    executable INTEGER NOT NULL, mtime_ns INTEGER NOT NULL, ino INTEGER NOT NULL,
    hashed_at_ns INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS locations (
    object_id TEXT PRIMARY KEY, kind TEXT NOT NULL, pack_id TEXT NOT NULL,
    offset INTEGER NOT NULL, length INTEGER NOT NULL);
CREATE INDEX IF NOT EXISTS locations_pack ON locations(pack_id);
CREATE TABLE IF NOT EXISTS historic_locations (
    object_id TEXT PRIMARY KEY, kind TEXT NOT NULL, pack_id TEXT NOT NULL,
    offset INTEGER NOT NULL, length INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS objects (object_id TEXT PRIMARY KEY, kind TEXT NOT NULL, data BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS indexes (index_id TEXT PRIMARY KEY, state TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS outbox (stored_id TEXT PRIMARY KEY, kind TEXT NOT NULL, seq INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS missing_copies (
    stored_id TEXT NOT NULL, backend_id TEXT NOT NULL, PRIMARY KEY (stored_id, backend_id));
CREATE TABLE IF NOT EXISTS short_objects (stored_id TEXT PRIMARY KEY, copies TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS versions_seen (number INTEGER PRIMARY KEY, master TEXT);
"""


def path_key(path: str) -> str | bytes:
    """What the index stores for ``path``: the path itself if it is valid UTF-8,
    else its raw file-system bytes. Raises UnicodeEncodeError for a string no
    file system name decodes to (a surrogate ``os.fsdecode`` never gives)."""
    if path.isascii():
        return path  # nearly every path, and every object id: no encoding needed
    try:
        path.encode("utf-8")
        return path
    except UnicodeEncodeError:
        return os.fsencode(path)


def path_of(key: str | bytes) -> str:
    """The path :func:`path_key` stored as ``key``."""
    return key if isinstance(key, str) else os.fsdecode(key)


#: ``mtime_ns`` of an index row for a path of the tree that this machine's file
#: system refused to create (a name too long here, or not in the encoding it
#: requires): the scan keeps the row's entry, so the path is neither shown as
#: deleted nor dropped by the next commit.
NOT_ON_DISK = -1
#: ``mtime_ns`` of an index row for a path of the tree outside this machine's sparse
#: selection (:mod:`metasync.selection`): written by the checkout (and by narrowing)
#: with the tree's entry, kept by every scan whether or not its folder is here, so
#: the path stays in each commit exactly as the tree has it. Only a checkout that
#: writes the file (the selection widened) or a tree without it replaces the row.
OUTSIDE = -2


class IndexRow(NamedTuple):
    """What the working-tree index remembers about one path. (A named tuple: status
    loads one per file, so construction cost matters.)"""

    path: str
    type: str
    ref: str
    size: int
    executable: bool
    mtime_ns: int
    ino: int
    hashed_at_ns: int


_make_row = IndexRow._make


def index_row(r: tuple[Any, ...]) -> IndexRow:
    """An index row from its stored columns (a BLOB path or ref: a name or a link
    target not in UTF-8)."""
    if isinstance(r[0], str) and isinstance(r[2], str):
        return _make_row(r)
    return _make_row((path_of(r[0]), r[1], path_of(r[2]), *r[3:]))


def _wal_works_beside(path: Path) -> bool:
    """Whether a scratch database in WAL mode works in ``path``'s folder: told
    apart, on an I/O error, a file system that cannot hold WAL (its error comes
    again on a new database) from a real, passing I/O error on ``path``."""
    scratch = path.with_name(f"wal-probe-{os.urandom(6).hex()}.db")
    try:
        conn = sqlite3.connect(str(scratch), isolation_level=None)
        try:
            conn.execute("PRAGMA journal_mode=WAL")
            conn.executescript("CREATE TABLE t (x); INSERT INTO t VALUES (1);")
            conn.execute("SELECT x FROM t").fetchall()
        finally:
            conn.close()
        return True
    except sqlite3.OperationalError:
        return False
    finally:
        for suffix in ("", "-wal", "-shm", "-journal"):
            with contextlib.suppress(OSError):
                os.unlink(f"{scratch}{suffix}")


class LocalDB:
    """Thin typed wrapper over the SQLite file. Use from one thread."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.conn = sqlite3.connect(str(path), isolation_level=None)
        try:
            # A database in another mode was made where WAL could not work: kept so.
            wal = (self.conn.execute("PRAGMA page_count").fetchone()[0] == 0
                   or self.conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal")
            if wal:
                self.conn.execute("PRAGMA journal_mode=WAL")
                self.conn.execute("PRAGMA synchronous=NORMAL")
            self.conn.executescript(SCHEMA)
        except sqlite3.OperationalError as exc:
            # WAL maps a shared-memory file beside the database; on a file system
            # that cannot (fusefat, some network mounts) every read fails with an
            # I/O error. A rollback journal needs only file locks.
            if "disk I/O error" not in str(exc) or _wal_works_beside(path):
                raise  # a real I/O error, not this file system's lack of WAL
            self.conn.close()
            self._leave_wal()
            wal = False
        if not wal:
            self.conn.execute("PRAGMA synchronous=FULL")
            self.conn.executescript(SCHEMA)
        self._depth = 0

    def _leave_wal(self) -> None:
        """Switch the database to a rollback journal, and connect again. In exclusive
        locking mode WAL needs no shared memory, so the switch can be made where it
        cannot be mapped."""
        conn = sqlite3.connect(str(self.path), isolation_level=None)
        try:
            conn.execute("PRAGMA locking_mode=EXCLUSIVE")
            conn.execute("PRAGMA journal_mode=DELETE")
        finally:
            conn.close()
        self.conn = sqlite3.connect(str(self.path), isolation_level=None)

    def close(self) -> None:
        self.conn.close()

    @contextmanager
    def transaction(self) -> Iterator[None]:
        """Nestable: only the outermost level begins and commits."""
        if self._depth == 0:
            self.conn.execute("BEGIN IMMEDIATE")
        self._depth += 1
        try:
            yield
        except BaseException:
            self._depth -= 1
            if self._depth == 0:
                self.conn.execute("ROLLBACK")
            raise
        self._depth -= 1
        if self._depth == 0:
            self.conn.execute("COMMIT")

    # --- settings -------------------------------------------------------------------
    def get(self, key: str, default: Any = None) -> Any:
        row = self.conn.execute("SELECT value FROM settings WHERE key=?", (key,)).fetchone()
        return json.loads(row[0]) if row else default

    def set(self, key: str, value: Any) -> None:
        self.conn.execute(
            "INSERT OR REPLACE INTO settings(key, value) VALUES (?, ?)", (key, json.dumps(value))
        )

    # --- working-tree index -----------------------------------------------------------
    def index_rows(self) -> dict[str, IndexRow]:
        cur = self.conn.execute(
            "SELECT path, type, ref, size, executable, mtime_ns, ino, hashed_at_ns FROM worktree"
        )
        return {row.path: row for row in map(index_row, cur)}

    def iter_index_rows(self) -> Iterator[IndexRow]:
        """Every index row, streamed (for trees too large to hold the index twice).
        Reads on the same connection may interleave; writes must wait for the end."""
        cur = self.conn.execute(
            "SELECT path, type, ref, size, executable, mtime_ns, ino, hashed_at_ns FROM worktree"
        )
        return map(index_row, cur)

    def iter_index_tuples(self) -> Iterator[tuple[Any, ...]]:
        """Every index row as SQLite gives it, streamed: a plain tuple in
        :class:`IndexRow`'s field order, no object made per row (a no-change
        ``status`` reads one per file). A path or ref stored as a BLOB (a name not
        in UTF-8) comes as bytes: :func:`index_row` decodes such a row."""
        return iter(self.conn.execute(
            "SELECT path, type, ref, size, executable, mtime_ns, ino, hashed_at_ns FROM worktree"))

    def index_paths(self) -> Iterator[str]:
        """Every indexed path, streamed."""
        return (path_of(r[0]) for r in self.conn.execute("SELECT path FROM worktree"))

    def replace_index(self, rows: Iterable[IndexRow]) -> None:
        with self.transaction():
            self.conn.execute("DELETE FROM worktree")
            self.upsert_index(rows)

    def drop_quick_status(self) -> None:
        """Forget the last clean status (:mod:`metasync.quickstatus`): it holds only
        while the index is the one it was made with, so every write here drops it."""
        self.conn.execute("DELETE FROM settings WHERE key=?", (QUICK_STATUS,))

    def upsert_index(self, rows: Iterable[IndexRow]) -> None:
        self.drop_quick_status()
        self.conn.executemany(
            "INSERT OR REPLACE INTO worktree VALUES (?,?,?,?,?,?,?,?)",
            (
                (path_key(r.path), r.type, path_key(r.ref), r.size, int(r.executable), r.mtime_ns, r.ino,
                 r.hashed_at_ns)
                for r in rows
            ),
        )

    def count_index_marked(self, mtime_ns: int) -> int:
        """How many index rows of files and links carry the marker ``mtime_ns``
        (:data:`NOT_ON_DISK`, :data:`OUTSIDE`)."""
        return int(self.conn.execute(
            "SELECT COUNT(*) FROM worktree WHERE mtime_ns=? AND type != 'dir'",
            (mtime_ns,)).fetchone()[0])

    def marked_dirs(self, mtime_ns: int) -> list[str]:
        """The folders whose index rows carry the marker ``mtime_ns``."""
        return [path_of(r[0]) for r in self.conn.execute(
            "SELECT path FROM worktree WHERE mtime_ns=? AND type='dir'", (mtime_ns,))]

    def delete_index(self, paths: Iterable[str]) -> None:
        self.drop_quick_status()
        self.conn.executemany("DELETE FROM worktree WHERE path=?", ((path_key(p),) for p in paths))

    # --- object locations -----------------------------------------------------------
    def add_locations(self, pack_id: str, entries: Iterable[PackEntry], *, historic: bool = False) -> None:
        """Record where objects are. ``historic`` rows come from indexes of versions
        older than the current master's index set: they serve reads of old versions
        but never deduplication (their packs may have been collected)."""
        table = "historic_locations" if historic else "locations"
        self.conn.executemany(
            f"INSERT OR IGNORE INTO {table} VALUES (?,?,?,?,?)",
            ((e.object_id, e.kind, pack_id, e.offset, e.length) for e in entries),
        )

    def location(self, object_id: str) -> tuple[str, PackEntry] | None:
        """Where ``object_id`` is: a current location, else a historic one."""
        return location_in(self.conn, object_id)

    def locations(self, object_ids: Iterable[str]) -> dict[str, tuple[str, PackEntry]]:
        """Where each of ``object_ids`` is (as :meth:`location`; those in no pack are
        left out), in a few queries of many ids each: a checkout of a whole tree asks
        for thousands, and a query each costs SQLite's file locking each time."""
        found: dict[str, tuple[str, PackEntry]] = {}
        columns = "object_id, kind, pack_id, offset, length"
        for table in ("locations", "historic_locations"):
            wanted = [i for i in dict.fromkeys(object_ids) if i not in found]
            if not wanted:
                break
            # Asked for most of the table (a clone's checkout): one pass over it is
            # ~4x faster than looking each id up (0.08 against 0.29 s for 15.8k).
            rows = self.conn.execute("SELECT max(rowid) FROM " + table).fetchone()[0] or 0
            if len(wanted) * _SCAN_FACTOR >= rows:
                wanted_set = set(wanted)
                for object_id, kind, pack_id, offset, length in self.conn.execute(
                        f"SELECT {columns} FROM {table}"):
                    if object_id in wanted_set:
                        found.setdefault(object_id, (pack_id, PackEntry(object_id, kind, offset, length)))
                object_ids = wanted
                continue
            for k in range(0, len(wanted), _IDS_PER_QUERY):
                part = wanted[k : k + _IDS_PER_QUERY]
                for object_id, kind, pack_id, offset, length in self.conn.execute(
                        f"SELECT {columns} FROM {table} "
                        f"WHERE object_id IN ({','.join('?' * len(part))})", part):
                    found.setdefault(object_id, (pack_id, PackEntry(object_id, kind, offset, length)))
            object_ids = wanted
        return found

    def is_located(self, object_id: str) -> bool:
        """True if ``object_id`` has a current location (so it may be deduplicated)."""
        return self.conn.execute(
            "SELECT 1 FROM locations WHERE object_id=?", (object_id,)).fetchone() is not None

    def purge_locations(self, keep_packs: builtins.set[str]) -> int:
        """Forget every location outside ``keep_packs`` (after a gc collected packs):
        nothing may be deduplicated against an object that may be gone. Historic
        rows go too. Returns the rows dropped."""
        self.conn.execute("CREATE TEMP TABLE IF NOT EXISTS keep_packs (pack_id TEXT PRIMARY KEY)")
        self.conn.execute("DELETE FROM keep_packs")
        self.conn.executemany("INSERT OR IGNORE INTO keep_packs VALUES (?)", ((p,) for p in keep_packs))
        dropped = self.conn.execute(
            "DELETE FROM locations WHERE pack_id NOT IN (SELECT pack_id FROM keep_packs)").rowcount
        self.conn.execute("DELETE FROM historic_locations")
        return int(dropped)

    def known_ids(self, ids: Iterable[str]) -> builtins.set[str]:
        """The subset of ``ids`` that already have a location (need no upload)."""
        found: builtins.set[str] = builtins.set()
        batch: list[str] = []
        for object_id in ids:
            batch.append(object_id)
            if len(batch) == 500:
                found |= self._known(batch)
                batch = []
        if batch:
            found |= self._known(batch)
        return found

    def _known(self, batch: list[str]) -> builtins.set[str]:
        marks = ",".join("?" * len(batch))
        cur = self.conn.execute(f"SELECT object_id FROM locations WHERE object_id IN ({marks})", batch)
        return {r[0] for r in cur}

    def pack_ids(self) -> builtins.set[str]:
        return {r[0] for r in self.conn.execute("SELECT DISTINCT pack_id FROM locations")}

    # --- metadata object cache ----------------------------------------------------
    def cache_object(self, object_id: str, kind: str, data: bytes) -> None:
        self.conn.execute("INSERT OR IGNORE INTO objects VALUES (?,?,?)", (object_id, kind, data))

    def cached_object(self, object_id: str) -> bytes | None:
        row = self.conn.execute("SELECT data FROM objects WHERE object_id=?", (object_id,)).fetchone()
        return bytes(row[0]) if row else None

    # --- indexes ------------------------------------------------------------------------
    def index_state(self, index_id: str) -> str | None:
        row = self.conn.execute("SELECT state FROM indexes WHERE index_id=?", (index_id,)).fetchone()
        return row[0] if row else None

    def set_index_state(self, index_id: str, state: str) -> None:
        self.conn.execute("INSERT OR REPLACE INTO indexes VALUES (?,?)", (index_id, state))

    def local_indexes(self) -> list[str]:
        return [r[0] for r in self.conn.execute("SELECT index_id FROM indexes WHERE state='local'")]

    def forget_indexes(self, keep: builtins.set[str]) -> None:
        """Mark every index outside ``keep`` (and not local) as never read."""
        rows = self.conn.execute("SELECT index_id FROM indexes WHERE state != 'local'").fetchall()
        self.conn.executemany("DELETE FROM indexes WHERE index_id=?",
                              ((r[0],) for r in rows if r[0] not in keep))

    # --- versions this client had as its base ----------------------------------------
    def note_version(self, number: int, master: str | None) -> None:
        """Remember that version ``number`` has master ``master`` (a decided version
        this client made its base): what ``log`` numbers commits by."""
        self.conn.execute("INSERT OR REPLACE INTO versions_seen VALUES (?, ?)", (number, master))

    def version_master(self, number: int) -> tuple[bool, str | None]:
        """``(known, master)`` of version ``number`` as :meth:`note_version` recorded it."""
        row = self.conn.execute("SELECT master FROM versions_seen WHERE number=?",
                                (number,)).fetchone()
        return (row is not None, row[0] if row else None)

    def master_numbers(self) -> dict[str, int]:
        """Commit id -> the first version number it was master in, as far as known."""
        rows = self.conn.execute("SELECT master, MIN(number) FROM versions_seen "
                                 "WHERE master IS NOT NULL GROUP BY master")
        return {r[0]: r[1] for r in rows}

    # --- outbox ---------------------------------------------------------------------
    def add_outbox(self, stored_id: str, kind: str) -> None:
        seq = self.conn.execute("SELECT COALESCE(MAX(seq), 0) + 1 FROM outbox").fetchone()[0]
        self.conn.execute("INSERT OR IGNORE INTO outbox VALUES (?,?,?)", (stored_id, kind, seq))

    def outbox(self) -> list[tuple[str, str]]:
        """Pending uploads in the order they were made (data before what refers to it)."""
        return [(r[0], r[1]) for r in self.conn.execute("SELECT stored_id, kind FROM outbox ORDER BY seq")]

    def remove_outbox(self, stored_id: str) -> None:
        self.conn.execute("DELETE FROM outbox WHERE stored_id=?", (stored_id,))

    # --- copies that could not be written -------------------------------------------------
    def add_missing_copy(self, stored_id: str, backend_id: str) -> None:
        self.conn.execute("INSERT OR IGNORE INTO missing_copies VALUES (?,?)", (stored_id, backend_id))

    def missing_copies(self) -> list[tuple[str, str]]:
        return [(r[0], r[1]) for r in self.conn.execute("SELECT stored_id, backend_id FROM missing_copies")]

    def remove_missing_copy(self, stored_id: str, backend_id: str) -> None:
        self.conn.execute(
            "DELETE FROM missing_copies WHERE stored_id=? AND backend_id=?", (stored_id, backend_id)
        )

    # --- objects stored with fewer copies than R ------------------------------------------
    def set_short(self, stored_id: str, copies: dict[str, int | None]) -> None:
        """Record (or update) an object that has fewer copies or fragments than the
        configuration asks for: ``copies`` maps each backend known to hold one to
        its fragment index (None: a whole copy)."""
        self.conn.execute("INSERT OR REPLACE INTO short_objects VALUES (?,?)",
                          (stored_id, json.dumps(copies, sort_keys=True)))

    def short_objects(self) -> dict[str, dict[str, int | None]]:
        """Every object recorded short, with the backends known to hold a copy."""
        return {r[0]: json.loads(r[1])
                for r in self.conn.execute("SELECT stored_id, copies FROM short_objects")}

    def remove_short(self, stored_id: str) -> None:
        self.conn.execute("DELETE FROM short_objects WHERE stored_id=?", (stored_id,))


#: Ids asked for in one query by :meth:`LocalDB.locations` (SQLite allows 32,766
#: parameters since 3.32, 999 before).
_IDS_PER_QUERY = 900
#: :meth:`LocalDB.locations` reads the whole table when asked for at least one id
#: per this many rows in it (by its largest rowid): a pass costs a row what a lookup
#: costs about four.
_SCAN_FACTOR = 3


def location_in(conn: sqlite3.Connection, object_id: str) -> tuple[str, PackEntry] | None:
    """Look ``object_id`` up in the current locations, then the historic ones."""
    for table in ("locations", "historic_locations"):
        row = conn.execute(
            f"SELECT kind, pack_id, offset, length FROM {table} WHERE object_id=?", (object_id,)
        ).fetchone()
        if row is not None:
            return row[1], PackEntry(object_id, row[0], row[2], row[3])
    return None
