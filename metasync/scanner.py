"""Scanning the folder into tree entries, and building trees from them.

A scan stats every path, trusts the working-tree index for files whose size,
mtime and inode are unchanged since they were hashed (and not "racily clean"),
and reads the rest, many at once, streaming their chunks to a sink (the
commit's pack writer) when there is one. It returns a :class:`ScanResult`;
nothing about a scan is kept anywhere else.
"""

from __future__ import annotations

import hashlib
import os
import stat
import time
import unicodedata
from collections import deque
from collections.abc import Callable, Container, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

from metasync.context import RepoContext
from metasync.fstraits import FolderTraits, probe_traits
from metasync.localdb import NOT_ON_DISK, OUTSIDE, IndexRow, index_row
from metasync.objects import FORMAT_VERSION, Tree, TreeEntry
from metasync.portable import cores
from metasync.selection import Selection, filter_scan
from metasync.store import Windowed
from metasync.worktree import (
    META_DIR,
    FileChanged,
    IgnoreRules,
    ObjectSink,
    ScanEntry,
    ScanProblems,
    Unsynced,
    scan,
)

#: An index entry is trusted only if the file's mtime is this much older than the
#: moment it was hashed (a write within the filesystem's timestamp granularity
#: could otherwise go unnoticed; git calls these entries "racily clean").
RACY_NS = 2_000_000_000
#: Index rows a commit's scan writes at once (see :meth:`Scanner.scan`).
INDEX_FLUSH = 20_000
#: Batches being hashed or queued per hashing thread (bounds memory on huge trees).
HASH_WINDOW = 4
#: Files one hashing task reads, at most (one task per file cost more than small
#: files' hashing), and the bytes that close a batch early.
HASH_BATCH = 32
HASH_BATCH_BYTES = 4 << 20
#: Names the fingerprint's format (and the local setting that keeps the last one).
TREE_MEMO = "tree_memo_v1"


@dataclass
class ScanResult:
    """What one scan of the folder found."""

    #: File and link entries by path.
    files: dict[str, TreeEntry]
    #: Folders.
    dirs: set[str]
    #: Working-tree index rows of files read again (only the last, partial batch
    #: with ``flush_index``).
    rows: list[IndexRow]
    #: Paths skipped because they changed while being read.
    skipped: list[str]
    #: Paths not synced: unreadable ones (also those found so only when read) and
    #: special files. A caller keeps the last committed version of every path in
    #: ``skipped`` and ``problems.unreadable`` (see :meth:`Committer.keep_unread`).
    problems: ScanProblems = field(default_factory=ScanProblems)
    #: Files whose content was read (the index saved the rest).
    files_hashed: int = 0
    #: Everything seen, by path (empty unless the scan was asked to keep it).
    seen: dict[str, ScanEntry] = field(default_factory=dict)
    #: Paths of the tree outside this machine's selection that are not here, kept
    #: in ``files`` and ``dirs`` from their index rows (:data:`~metasync.localdb.OUTSIDE`).
    outside: set[str] = field(default_factory=set)


class Scanner:
    """Scans one repository's folder."""

    def __init__(self, ctx: RepoContext) -> None:
        self.ctx = ctx
        self._traits: FolderTraits | None = None

    @property
    def traits(self) -> FolderTraits:
        """What the folder's file system can hold: the recorded probe while the
        folder is on the same file system (device number), else probed again (and
        recorded, when this command has the folder)."""
        if self._traits is None:
            known = self.ctx.state.folder_traits
            device = os.stat(self.ctx.root).st_dev
            # An older record has not probed trailing dots (None): probed again.
            if known is None or known.device != device or known.trailing_dots is None:
                before = known
                known = probe_traits(self.ctx.root, self.ctx.root / META_DIR)
                recorded = known is not None
                if known is None:  # not recorded: probed again next time
                    known = FolderTraits(device, *FolderTraits.POSIX)
                if before is not None and not before.exec_bits:
                    # Copied off a file system without exec bits (cp -a from exFAT):
                    # the bits on disk are that system's (all set), not the user's.
                    known = replace(known, exec_bits=False)
                if recorded and self.ctx.exclusive:
                    self.ctx.state.folder_traits = known
            self._traits = known
        return self._traits

    def selection(self) -> Selection:
        """This machine's sparse selection (:mod:`metasync.selection`), as stored now."""
        return Selection(self.ctx.state.sparse_patterns)

    def scan(self, sink: ObjectSink | None, *, flush_index: bool = False,
             keep_seen: bool = True) -> ScanResult:
        """Scan the folder, hashing what the index cannot vouch for.

        With ``flush_index``, refreshed rows are written to the index in batches as
        files are hashed and only the last, partial batch is returned (a huge tree
        then never holds them all). That is safe before the commit is recorded: a
        commit trusts a row only if its content is in a recorded pack, and status
        compares the row's content id, which is right whether committed or not.

        ``keep_seen=False`` leaves :attr:`ScanResult.seen` empty and lets each
        scanned entry go as soon as it is used (a checkout always scans again
        before it compares)."""
        db = self.ctx.db
        root = self.ctx.root
        # Tracked paths are read only if there is an ignore file (load is lazy).
        problems = ScanProblems()
        entries = scan(root, IgnoreRules.load(root, db.index_paths()), problems)
        # What this machine does not check out is not looked at, even if a file is
        # there: the index rows of those paths (OUTSIDE) stand for them.
        selection = self.selection()
        filter_scan(selection, entries)
        # Where exec bits do not stick (core.fileMode=false), a file's is the index's.
        exec_bits = self.traits.exec_bits
        executable: set[str] = set()
        missing: list[IndexRow] = []  # rows of names not found, not ASCII

        def rows(found: dict[str, ScanEntry]) -> Iterator[tuple[Any, ...]]:
            # Plain tuples in IndexRow's field order (no object per row): this loop
            # runs once per file of every status.
            yield from db.iter_index_tuples()
            # Then those of indexed names found in another Unicode form (all rows
            # are read by now, so ``missing`` is complete).
            if missing:
                yield from respell(found, missing)

        result = ScanResult({}, set(), [], [], problems, seen=entries if keep_seen else {})
        files = result.files
        to_hash: list[ScanEntry] = []
        # Index rows stream from SQLite and are dropped once used (only those of files
        # to read again are kept), so a huge tree never holds the whole index as well
        # as the scan. Names from scandir are safe components by construction (scan
        # skips .metasync), so the untrusted-name check is not needed here.
        kinds = {"file": "file", "chunked": "chunked"}  # one str object per kind
        not_on_disk: list[IndexRow] = []
        outside: list[IndexRow] = []
        get = entries.get
        for row in rows(entries):
            # row: path, type, ref, size, executable, mtime_ns, ino, hashed_at_ns;
            # e: path, type, size, mtime_ns, ino, executable, ...
            path = row[0]
            if path.__class__ is not str or row[2].__class__ is not str:
                row = index_row(row)  # a BLOB: a name (or link target) not in UTF-8
                path = row[0]
            e = get(path)
            if not exec_bits and row[4]:
                executable.add(path)
            if e is None:
                mtime_ns = row[5]
                if mtime_ns == NOT_ON_DISK:
                    not_on_disk.append(IndexRow._make(row))
                elif mtime_ns == OUTSIDE or (
                        selection.active and not selection.selects(path, row[1] == "dir")):
                    # Outside the selection, whatever its row says: never taken for deleted.
                    outside.append(IndexRow._make(row))
                elif not path.isascii():
                    missing.append(IndexRow._make(row))
                continue
            if (
                e[1] == "file"
                and row[3] == e[2]
                and row[5] == e[3]
                and row[6] == e[4]
                and row[5] + RACY_NS < row[7]
                # `status` caches hashes without storing content: a commit must
                # read a file again unless its content is in some pack.
                and (sink is None or db.is_located(row[2]))
            ):
                kind = kinds.get(row[1], row[1])
                files[path] = TreeEntry(path.rpartition("/")[2], kind, row[2], e[2],
                                        e[5] if exec_bits else row[4])
        for path, e in entries.items():
            if e.type == "dir":
                result.dirs.add(path)
            elif e.type == "link":
                files[path] = TreeEntry(path.rpartition("/")[2], "link", e.target, e.size)
            elif path not in files:
                to_hash.append(e if exec_bits else e._replace(executable=path in executable))
        if not_on_disk:
            self._keep_not_on_disk(not_on_disk, entries, result)
        if outside:
            self._keep_outside(outside, result)
        del entries  # kept only in result.seen, if at all
        result.files_hashed = len(to_hash)
        if to_hash:
            self._hash_all(to_hash, sink, result, flush_index)
        return result

    @staticmethod
    def _keep_not_on_disk(rows: list[IndexRow], entries: dict[str, ScanEntry],
                          result: ScanResult) -> None:
        """Keep the tree's entries for paths this file system refused to create (see
        :data:`~metasync.localdb.NOT_ON_DISK`): they are not deleted by being absent.
        Only while their folder is still here: deleting the folder deletes them."""
        for row in sorted(rows, key=lambda r: r.path.count("/")):
            parent = row.path.rpartition("/")[0]
            here = entries.get(parent)
            if parent and (here is None or here.type != "dir") and parent not in result.dirs:
                continue
            if row.type == "dir":
                result.dirs.add(row.path)
            else:
                result.files[row.path] = TreeEntry(row.path.rpartition("/")[2], row.type,  # type: ignore[arg-type]
                                                   row.ref, row.size, row.executable)

    @staticmethod
    def _keep_outside(rows: list[IndexRow], result: ScanResult) -> None:
        """Keep the tree's entries for paths outside the selection (see
        :data:`~metasync.localdb.OUTSIDE`): whether or not their folder is here,
        and whatever the selection is now (a widening not finished yet leaves
        rows of paths selected again: the next checkout writes them)."""
        for row in rows:
            result.outside.add(row.path)
            if row.type == "dir":
                result.dirs.add(row.path)
            else:
                result.files[row.path] = TreeEntry(row.path.rpartition("/")[2], row.type,  # type: ignore[arg-type]
                                                   row.ref, row.size, row.executable)

    def _hash_all(self, to_hash: list[ScanEntry], sink: ObjectSink | None,
                  result: ScanResult, flush_index: bool) -> None:
        db = self.ctx.db
        reporter = self.ctx.reporter
        hashed_at = time.time_ns()
        # One thread per core: reading a file rarely waits (the page cache, an SSD),
        # and a third thread on two cores only contended for the interpreter lock
        # (a push of the Linux tree: median 2.57 s with 2, 2.84 s with 3).
        workers = min(len(to_hash), cores())
        reporter.start("pack" if sink else "hash", sum(e.size for e in to_hash))
        # Handed out one by one, so each entry is freed once hashed.
        queue = deque(to_hash)
        to_hash.clear()
        consume = (queue.popleft() for _ in range(len(queue)))
        files = result.files
        root = os.fspath(self.ctx.root)

        def read_batch(batch: list[ScanEntry]) -> list[tuple[str, str, ScanEntry] | str | None]:
            return [self.read_one(e, sink, root) for e in batch]

        with ThreadPoolExecutor(workers, thread_name_prefix="metasync-hash") as pool:
            for scanned, hashed in (
                pair
                for batch, got in Windowed(pool, read_batch, _batches(consume),
                                           HASH_WINDOW * workers)
                for pair in zip(batch, got.result(), strict=True)
            ):
                reporter.advance(scanned.size)
                if hashed is None:
                    result.skipped.append(scanned.path)
                    continue
                if isinstance(hashed, str):
                    result.problems.unreadable.append(Unsynced(scanned.path, hashed))
                    continue
                # The file as it was read: a file that changed during a first read
                # was read again at its new size, mtime and inode.
                kind, ref, e = hashed
                name = e.path.rpartition("/")[2]
                files[e.path] = TreeEntry(name, kind, ref, e.size, e.executable)  # type: ignore[arg-type]
                result.rows.append(
                    IndexRow(e.path, kind, ref, e.size, e.executable, e.mtime_ns, e.ino, hashed_at)
                )
                if flush_index and len(result.rows) >= INDEX_FLUSH:
                    with db.transaction():
                        db.upsert_index(result.rows)
                    result.rows = []
        reporter.finish()

    def hash_one(self, e: ScanEntry, sink: ObjectSink | None) -> tuple[str, str] | None:
        """``(type, ref)`` of one file's content (its chunks go to ``sink``), read
        again if it changed while being read; None if it keeps changing, is gone,
        is no longer a regular file or cannot be read."""
        got = self.read_one(e, sink)
        return got[:2] if isinstance(got, tuple) else None

    def read_one(self, e: ScanEntry, sink: ObjectSink | None, root: str | None = None
                 ) -> tuple[str, str, ScanEntry] | str | None:
        """As :meth:`hash_one`, with the entry as the content was read (its size,
        mtime and inode differ from ``e``'s if the file changed during a first
        read); a file that cannot be read gives the reason (``Permission denied``)
        instead of None. ``root`` is the folder's path as a string (saves a Path per file)."""
        path = os.path.join(os.fspath(self.ctx.root) if root is None else root, e.disk or e.path)
        for _ in range(3):
            try:
                hashed = self.ctx.chunker.hash_file(path, e, sink)
                return hashed.type, hashed.ref, e
            except FileChanged:
                try:
                    st = os.lstat(path)
                except FileNotFoundError:
                    return None
                if not stat.S_ISREG(st.st_mode):
                    return None  # a folder, a link or a FIFO now: the next scan sees it
                e = e._replace(size=st.st_size, mtime_ns=st.st_mtime_ns, ino=st.st_ino)
            except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
                return None
            except OSError as exc:  # EACCES, EIO: the reason is what the user needs
                return exc.strerror or str(exc)
        return None

    def build_trees(
        self,
        files: dict[str, TreeEntry],
        dirs: set[str],
        emit: Callable[[str, bytes], None] | None = None,
    ) -> tuple[str, dict[str, bytes]]:
        """Root tree id and every tree's canonical bytes, built bottom-up. With
        ``emit``, each tree goes to ``emit(id, bytes)`` as it is built instead of
        into the returned dict, and ``files`` is emptied once read (so a huge tree
        never holds every tree's bytes, nor the path index next to the trees)."""
        children: dict[str, list[TreeEntry]] = {d: [] for d in dirs}
        children[""] = []
        for path, entry in files.items():
            parent = path.rpartition("/")[0]
            children.setdefault(parent, []).append(entry)
        if emit is not None:
            files.clear()
        trees: dict[str, bytes] = {}
        order = sorted((d for d in children if d), key=lambda p: p.count("/"), reverse=True)
        root_id = ""
        for d in [*order, ""]:
            data = Tree.build(children.pop(d)).to_bytes()
            tid = self.ctx.codec.id_of("tree", data)
            if emit is None:
                trees[tid] = data
            else:
                emit(tid, data)
            if d:
                parent, _, name = d.rpartition("/")
                children.setdefault(parent, []).append(TreeEntry(name, "dir", tid))
            else:
                root_id = tid
        return root_id, trees


def nfc(path: str) -> str:
    """``path`` in Unicode normal form C, the one form names are compared in (a name
    that is not valid UTF-8 is compared as it is)."""
    if path.isascii():
        return path
    try:
        return unicodedata.normalize("NFC", path)
    except UnicodeError:  # pragma: no cover - normalize takes any str
        return path


def respell(entries: dict[str, ScanEntry], missing: list[IndexRow]) -> list[IndexRow]:
    """Take each path of ``entries`` (a scan) that is an indexed name of ``missing``
    (not found as spelled) in another Unicode form -- macOS gives back decomposed
    (NFD) the names another client wrote composed (NFC), as git's
    ``core.precomposeUnicode`` knows -- for that indexed name: it is re-keyed under
    the index's spelling (its ``disk`` field keeps the one on disk, to read and
    write it by), and so are folders on the way to such names, with everything in
    them (a file added there goes in the index's folder, not a second one spelled
    otherwise). Returns the rows whose names were found so."""
    rows = {nfc(r.path): r for r in missing}
    folders: dict[str, str] = {}
    for r in missing:
        parent = r.path.rpartition("/")[0]
        while parent and nfc(parent) not in folders:
            folders[nfc(parent)] = parent
            parent = parent.rpartition("/")[0]
    found: list[IndexRow] = []
    moved: dict[str, str] = {}  # folders re-keyed: path on disk -> the index's
    # Folders before what they hold, so a path's folder is re-keyed first.
    for path in sorted((p for p in entries if not p.isascii()), key=lambda p: p.count("/")):
        e = entries[path]
        parent, _, name = path.rpartition("/")
        spelled = f"{moved[parent]}/{name}" if parent in moved else path
        key = nfc(spelled)
        row = rows.get(key) if e.type != "dir" else None
        target = row.path if row is not None else folders.get(key) if e.type == "dir" else None
        target = target or spelled
        if target == path or target in entries:
            continue
        del entries[path]
        entries[target] = e._replace(path=target, disk=path)
        if e.type == "dir":
            moved[path] = target
        if row is not None:
            found.append(row)
    return found


def name_clashes(paths: Iterable[str], on_disk: Container[str],
                 case_insensitive: bool) -> dict[str, str]:
    """The paths of a tree (``paths``) that are one name in this folder with another
    of them -- equal in Unicode normal form C (everywhere: names are compared in one
    form), or also but for case where the folder does not tell case apart -- each
    mapped to the one of its group that is written: the one on disk (``on_disk``),
    else one in normal form C, else the first in code point order (``Foo.txt``
    before ``foo.txt``). On a case-sensitive folder only names that are not ASCII
    are looked at."""
    groups: dict[str, list[str]] = {}
    for path in paths:
        if path.isascii() and not case_insensitive:
            continue
        key = nfc(path)
        groups.setdefault(key.casefold() if case_insensitive else key, []).append(path)
    out: dict[str, str] = {}
    for group in groups.values():
        if len(group) > 1:
            group.sort(key=lambda p: (p not in on_disk, nfc(p) != p, p))
            out.update((p, group[0]) for p in group[1:])
    return out


def tree_fingerprint(files: dict[str, TreeEntry], dirs: set[str]) -> str:
    """A digest of everything :meth:`Scanner.build_trees` reads: equal
    fingerprints give equal root trees (same key, same format)."""
    # No field holds a NUL (POSIX names and link targets cannot), every field ends
    # with one, and the counts come first, so the hashed text decodes one way only.
    h = hashlib.blake2b(digest_size=32)
    h.update(f"{TREE_MEMO}\0{FORMAT_VERSION}\0{len(files)}\0{len(dirs)}\0".encode())
    batch: list[str] = []
    for path in sorted(files):
        e = files[path]
        batch.append(f"{path}\0{e.type}\0{e.ref}\0{e.size}\0{'x' if e.executable else '-'}\0")
        if len(batch) == 4096:
            h.update("".join(batch).encode("utf-8", "surrogatepass"))
            batch.clear()
    batch.extend(f"{d}\0" for d in sorted(dirs))
    h.update("".join(batch).encode("utf-8", "surrogatepass"))
    return h.hexdigest()


def _batches(entries: Iterable[ScanEntry]) -> Iterator[list[ScanEntry]]:
    """``entries`` in lists of at most HASH_BATCH files or about HASH_BATCH_BYTES."""
    batch: list[ScanEntry] = []
    size = 0
    for e in entries:
        batch.append(e)
        size += e.size
        if len(batch) >= HASH_BATCH or size >= HASH_BATCH_BYTES:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch
