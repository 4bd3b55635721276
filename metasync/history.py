"""History: the log of versions, and bringing back a file or folder as it was.

``log`` lists every commit of the history (through every parent of a merge, each
commit once, children before parents, newest first) with the version number it
became master in, as far as this client saw it; :func:`draw_graph` lays it out as
``git log --graph`` does. ``standing`` says where the folder is against master.
``restore`` finds the version to restore from (a commit id prefix, a snapshot,
``~N``, or by default the newest version where the path differs from the
folder) and writes it with the checkout's :class:`~metasync.filewriter.FileWriter`:
to a temporary file, flushed, renamed; a file in the way whose content is in no
version is kept as a conflict copy first. Every parent folder is opened by
:class:`~metasync.worktree.Folders`, never through a symbolic link: a link where
a folder was is replaced by the folder if the current version holds that link,
and kept as a conflict copy if not, so nothing is written outside the folder.
"""

from __future__ import annotations

import heapq
import os
import stat
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import Any

from metasync.checkout import now_stamp, replace_name
from metasync.context import RepoContext
from metasync.errors import UsageError
from metasync.filewriter import FileWriter
from metasync.fstraits import (
    DROPS_DOT,
    NAME_REFUSED,
    FolderTraits,
    cannot_hold,
    cannot_write,
    clash_reason,
    not_written_note,
    probe_traits,
)
from metasync.graph import ANCESTRY_LIMIT, ObjectGraph
from metasync.names import display_path
from metasync.objects import Commit, Config, TreeEntry
from metasync.retention import commit_datetime
from metasync.scanner import name_clashes, nfc
from metasync.versions import Versions
from metasync.worktree import (
    META_DIR,
    FileChanged,
    Folders,
    InTheWay,
    ScanEntry,
    is_ignored,
    lstat_at,
)


@dataclass(frozen=True)
class LogEntry:
    commit_id: str
    device: str
    client: str
    time_ns: int
    message: str
    parents: tuple[str, ...]
    #: The version this commit became master in (None: it never was on its own,
    #: e.g. the other side of a merge, or this client did not see that version).
    version: int | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "commit": self.commit_id,
            "version": self.version,
            "device": self.device,
            "client": self.client,
            "time": commit_datetime(self.time_ns, None).isoformat(),
            "message": self.message,
            "parents": list(self.parents),
        }


@dataclass(frozen=True)
class Standing:
    """Where this client's folder is against the newest version (``status``)."""

    #: The version this client last synchronised with, and the newest decided one.
    version: int
    latest: int
    #: Versions decided since ``version`` (a pull takes them).
    behind: int
    #: Local commits not pushed yet (a push publishes them).
    ahead: int


@dataclass(frozen=True)
class GraphRow:
    """One row of :func:`draw_graph`: a commit (``entry``) or a connector line."""

    entry: LogEntry | None
    #: What goes before the row's text: ``"* |"``, ``"|\\"``, ``"|/"``...
    prefix: str
    #: What goes before an entry's further lines (the columns below it).
    padding: str


def draw_graph(entries: Iterable[LogEntry]) -> list[GraphRow]:
    """``entries`` (children before parents, as :meth:`History.log` returns them)
    laid out in columns as ``git log --graph`` does: ``*`` is the commit, ``|`` a
    line of descent, ``\\`` a merge's further parent opening a column, ``/`` two
    columns waiting for the same commit joining. Parents not among ``entries`` (a
    limited log) end their column."""
    entries = list(entries)
    listed = {e.commit_id for e in entries}
    columns: list[str] = []
    rows: list[GraphRow] = []
    for e in entries:
        if e.commit_id not in columns:
            columns.append(e.commit_id)
        idx = columns.index(e.commit_id)
        parents = [p for p in dict.fromkeys(e.parents) if p in listed]
        opened = [p for p in parents[1:] if p not in columns]
        after = columns[idx + 1:]
        columns = columns[:idx] + parents[:1] + opened + after
        padding = " ".join("|" * len(columns))
        star = " ".join("*" if i == idx else "|" for i in range(idx + 1 + len(after)))
        if opened:
            star = star[:2 * idx + 1].ljust(len(padding)) if not after else star
        rows.append(GraphRow(e, star, padding))
        if opened:
            line = " ".join("|" * (idx + 1)) + "\\" + " \\" * (len(opened) - 1 + len(after))
            rows.append(GraphRow(None, line, padding))
        while len(set(columns)) < len(columns):
            j = next(j for j, c in enumerate(columns) if c in columns[:j])
            chars = [" "] * (2 * len(columns) - 1)
            for i in range(len(columns)):
                if i < j:
                    chars[2 * i] = "|"
                else:
                    chars[2 * i - 1] = "/"
            del columns[j]
            rows.append(GraphRow(None, "".join(chars).rstrip(), " ".join("|" * len(columns))))
    return rows


@dataclass
class RestoreResult:
    """What ``restore`` brought back, from which version."""

    commit_id: str
    time_ns: int
    target: str
    restored: list[str] = field(default_factory=list)
    conflicts: list[str] = field(default_factory=list)
    #: Paths (relative to the folder written into) this file system cannot hold:
    #: each said in a note (docs/design.md, "Folders that cannot hold everything").
    not_written: list[str] = field(default_factory=list)


def _date_order(history: dict[str, Commit]) -> list[tuple[str, Commit]]:
    """The commits of ``history`` (a closed set: every parent listed that is in
    it) children first, the newest ready one next (ties: by id, to be stable)."""
    children = dict.fromkeys(history, 0)
    for c in history.values():
        for p in set(c.parents):
            if p in children:
                children[p] += 1
    ready = [(-c.time_ns, cid) for cid, c in history.items() if children[cid] == 0]
    heapq.heapify(ready)
    out: list[tuple[str, Commit]] = []
    while ready:
        _, cid = heapq.heappop(ready)
        commit = history[cid]
        out.append((cid, commit))
        for p in set(commit.parents):
            if p in children:
                children[p] -= 1
                if children[p] == 0:
                    heapq.heappush(ready, (-history[p].time_ns, p))
    return out


def repo_path(path: str) -> str:
    """A path inside the repository, as trees name it: relative, ``/``-separated,
    with no ``.`` or ``..`` parts."""
    parts = [p for p in path.replace(os.sep, "/").split("/") if p not in ("", ".")]
    if not parts or ".." in parts or parts[0] == META_DIR:
        raise UsageError(f"{path!r} is not a path inside the repository")
    return "/".join(parts)


class History:
    """The history of one repository, read and restored from."""

    def __init__(self, ctx: RepoContext, versions: Versions, graph: ObjectGraph,
                 traits: Callable[[], FolderTraits]) -> None:
        self.ctx = ctx
        self.versions = versions
        self.graph = graph
        #: The traits of the repository's folder (the scanner's, probed once).
        self.traits = traits
        self.writer = FileWriter(ctx, graph)

    def log(self, limit: int | None = None) -> list[LogEntry]:
        """Every commit reachable from head (this client's latest commit, else
        master) through every parent, each once: children before their parents,
        and among the commits whose children are all listed the newest first (git's
        ``--date-order``). A merge's first parent is the version it merged into.
        Each commit carries the version it became master in where this client
        knows it (it remembers the versions it synchronised with)."""
        if limit is not None and limit <= 0:
            return []
        state = self.ctx.state
        top = state.head or state.prev.master
        if top is None:
            return []
        history = self.graph.history(top)
        numbers = self.ctx.db.master_numbers()
        prev = state.prev
        if prev.master is not None:
            numbers[prev.master] = min(prev.number, numbers.get(prev.master, prev.number))
        out: list[LogEntry] = []
        for cid, c in _date_order(history):
            out.append(LogEntry(cid, c.device, c.client, c.time_ns, c.message, c.parents,
                                numbers.get(cid)))
            if limit is not None and len(out) >= limit:
                break
        return out

    def standing(self) -> Standing:
        """Where the folder is against master: versions decided since this client's
        last sync (learned from the backends) and its local commits not pushed."""
        state = self.ctx.state
        latest = self.versions.learn_latest()
        prev, head = state.prev, state.head
        ahead = 0
        if head is not None and head != prev.master:
            # Local commits are few; a head off prev's line stops at the cap, not the root.
            for cid, _ in islice(self.graph.first_parents(head), ANCESTRY_LIMIT):
                if cid == prev.master:
                    break
                ahead += 1
        return Standing(prev.number, latest.number, max(0, latest.number - prev.number), ahead)

    def restore(self, path: str, version: str | None = None,
                to: str | Path | None = None) -> RestoreResult:
        """Bring back ``path`` (a file or a folder, relative to the repository) as it
        was in an earlier version: ``version`` is a commit id prefix, a snapshot
        name or ``~N`` (N versions back); by default the newest version in which it
        existed and differed from the folder. Written to ``to`` (default: ``path``);
        a file in the way whose content is not in history is kept as a conflict copy."""
        path = repo_path(path)
        latest = self.versions.learn_latest()
        config = self.versions.load_config(latest.config)
        if latest.master is None:
            raise UsageError("nothing has been pushed yet")
        with self.versions.reading_with(config):
            commit_id, tree = self._find_version(path, version, latest.master, config)
            commit = self.graph.load_commit(commit_id)
            wanted = {p: e for p, e in tree.items() if p == path or p.startswith(path + "/")}
            if to is None:
                # In place: what the current version holds may be replaced (it survives).
                head = self.graph.head_commit()
                current = self.graph.flatten(head.tree) if head is not None else {}
                root, prefix = self.ctx.root, path
                traits = self.traits()
            else:
                dest = Path(to).absolute()
                dest.parent.mkdir(parents=True, exist_ok=True)  # named by the user: followed
                current, root, prefix = {}, dest.parent, dest.name
                probed = probe_traits(root, root)
                traits = probed or FolderTraits(0, *FolderTraits.POSIX)
            result = RestoreResult(commit_id, commit.time_ns, str(root / prefix))
            stamp = now_stamp()
            dests = {(f"{prefix}/{p[len(path):].lstrip('/')}" if p != path else prefix): e
                     for p, e in wanted.items()}
            parts = prefix.split("/")[:-1]
            above = ["/".join(parts[: i + 1]) for i in range(len(parts))]
            with Folders(root) as folders:
                aside = self._in_the_way(folders, current, stamp, result)
                names = RestoreNames(folders, [*above, *dests], traits)
                for up in above:  # as the disk spells them, or not at all
                    why = names.place(up)[1]
                    if why is not None:
                        result.not_written.append(prefix)
                        self.ctx.reporter.note(not_written_note(prefix, why))
                        break
                for dest_rel, entry in sorted(dests.items()):
                    if any(dest_rel == f or dest_rel.startswith(f + "/")
                           for f in result.not_written):
                        continue  # in a folder already said
                    where, why = names.place(dest_rel)
                    if why is not None:
                        result.not_written.append(dest_rel)
                        self.ctx.reporter.note(not_written_note(dest_rel, why))
                        continue
                    self._restore_entry(folders, aside, entry, where, current.get(dest_rel),
                                        stamp, result)
        return result

    def _find_version(
        self, path: str, version: str | None, master: str, config: Config
    ) -> tuple[str, dict[str, TreeEntry]]:
        chain = [cid for cid, _ in self.graph.first_parents(master)]
        history = self.graph.history(master)

        # What earlier gcs collected (not what today's policy would keep: versions
        # pushed since, or a policy raised since, change that, not what is stored).
        collected = self.graph.collected_test(master, config.gc_cutoff_ns)

        def pruned(cid: str) -> bool:
            return collected(history.get(cid) or self.graph.load_commit(cid))

        if version is not None:
            if config.snapshot(version) is not None:
                commit_id = config.snapshot(version)
            elif version.isdigit() and self._numbered(int(version), history):
                commit_id = self._numbered(int(version), history)
            elif version.isdigit() and len(version) < 4:
                raise UsageError(f"version {int(version)} is not one this machine synced with "
                                 "(see `metasync log`); give a commit id, a snapshot or ~N")
            elif version.startswith("~") and version[1:].isdigit():
                n = int(version[1:])
                if n >= len(chain):
                    raise UsageError(f"history has only {len(chain)} versions; {version} is too far back")
                commit_id = chain[n]
            else:
                found = [c for c in history if c.startswith(version.lower())] if len(version) >= 4 else []
                if len(found) != 1:
                    raise UsageError(f"{version!r} names {'no' if not found else 'more than one'} "
                                     "version; give a commit id (metasync log), a snapshot or ~N")
                commit_id = found[0]
            assert commit_id is not None
            if pruned(commit_id):
                policy = " and not kept by the retention policy" if config.policy else ""
                raise UsageError(f"version {commit_id[:12]} is forgotten: gc collected its files "
                                 f"(it was older than the retention{policy} when gc ran); "
                                 "snapshot versions you want to keep")
            tree = self.graph.tree_at(commit_id)
            if path not in tree:
                raise UsageError(f"{display_path(path)} is not in version {commit_id[:12]}")
            return commit_id, tree
        for cid in chain:
            if pruned(cid):
                continue  # (a policy keeps some versions older than ones it forgets)
            tree = self.graph.tree_at(cid)
            if path in tree and not self._same_as_folder(path, tree):
                return cid, tree
        raise UsageError(f"no kept version has a {display_path(path)} that differs from the folder's; "
                         "see `metasync log` and use --version")

    def _numbered(self, number: int, history: dict[str, Commit]) -> str | None:
        """The master of version ``number`` if this client knows it (and it is in
        ``history``)."""
        known, master = self.ctx.db.version_master(number)
        prev = self.ctx.state.prev
        if not known and prev.number == number:
            master = prev.master
        return master if master in history else None

    def _same_as_folder(self, path: str, tree: dict[str, TreeEntry]) -> bool:
        """True if every file of ``tree`` at or under ``path`` is in the folder as is
        (a path through a link is not: links are not followed)."""
        with Folders(self.ctx.root) as folders:
            for p, entry in tree.items():
                if p != path and not p.startswith(path + "/"):
                    continue
                parent, _, name = p.rpartition("/")
                with folders.opened(parent) as fd:
                    if fd is None or not self._matches(fd, name, entry):
                        return False
        return True

    def _restore_entry(self, folders: Folders, aside: InTheWay, entry: TreeEntry, path: str,
                       in_head: TreeEntry | None, stamp: str, result: RestoreResult) -> None:
        """Write ``entry`` at ``path`` (relative to ``folders``' root); what this file
        system cannot hold is said and left out."""
        try:
            self._write_entry(folders, aside, entry, path, in_head, stamp, result)
        except OSError as exc:
            why = cannot_write(entry.type, exc) or (cannot_hold(exc) if exc.errno in NAME_REFUSED
                                                    else None)
            if why is None:
                raise
            result.not_written.append(path)
            self.ctx.reporter.note(not_written_note(path, why))

    def _write_entry(self, folders: Folders, aside: InTheWay, entry: TreeEntry, path: str,
                     in_head: TreeEntry | None, stamp: str, result: RestoreResult) -> None:
        if entry.type == "dir":
            folders.release(folders.make(path, aside))
            return
        parent, _, name = path.rpartition("/")
        with folders.made(parent, aside) as fd:
            existing = lstat_at(fd, name)
            if existing is not None:
                if self._matches(fd, name, entry, existing):
                    return  # already as it was
                if in_head is None or not self._matches(fd, name, in_head, existing):
                    # Its content is in no version: keep it under a conflict name.
                    result.conflicts.append(str(folders.root / self._move_aside(
                        folders, fd, path, stamp)))
                elif stat.S_ISDIR(existing.st_mode):
                    # The current version's folder where the file goes: removed if
                    # empty, else kept aside (a file cannot replace a folder).
                    try:
                        os.rmdir(name, dir_fd=fd)
                        folders.forget(path)
                    except OSError:
                        result.conflicts.append(str(folders.root / self._move_aside(
                            folders, fd, path, stamp)))
            chunks = [] if entry.type == "link" else self.graph.file_chunks(entry)
            tmp, _ = self.writer.write_temp(fd, entry, chunks, durable=True)
            try:
                replace_name(fd, tmp, name)
            except BaseException:
                if lstat_at(fd, tmp) is not None:
                    os.unlink(tmp, dir_fd=fd)
                raise
        result.restored.append(str(folders.root / path))

    def _in_the_way(self, folders: Folders, current: dict[str, TreeEntry], stamp: str,
                    result: RestoreResult) -> InTheWay:
        """What :class:`Folders` does with a file or link where a folder must be: one
        the current version holds is replaced (it survives in history); anything
        else is kept as a conflict copy. Never followed."""

        def aside(fd: int, name: str, path: str) -> None:
            in_head = current.get(path)
            if in_head is not None and self._matches(fd, name, in_head):
                os.unlink(name, dir_fd=fd)
                return
            result.conflicts.append(str(folders.root / self._move_aside(folders, fd, path, stamp)))

        return aside

    def _move_aside(self, folders: Folders, fd: int, path: str, stamp: str) -> str:
        return folders.move_aside(fd, path, self.ctx.device, stamp)

    def _matches(self, fd: int, name: str, entry: TreeEntry,
                 st: os.stat_result | None = None) -> bool:
        """True if the file, link or folder ``name`` in the open folder ``fd`` (whose
        stat is ``st``, if the caller has it) is exactly ``entry``."""
        if st is None:
            st = lstat_at(fd, name)
            if st is None:
                return False
        if entry.type == "dir":
            return stat.S_ISDIR(st.st_mode)
        if entry.type == "link":
            return stat.S_ISLNK(st.st_mode) and os.readlink(name, dir_fd=fd) == entry.ref
        if not stat.S_ISREG(st.st_mode) or st.st_size != entry.size:
            return False
        scanned = ScanEntry(name, "file", st.st_size, st.st_mtime_ns, st.st_ino,
                            bool(st.st_mode & stat.S_IXUSR))
        try:
            hashed = self.ctx.chunker.hash_file(name, scanned, None, dir_fd=fd)
        except (OSError, FileChanged):
            return False
        return hashed.ref == entry.ref


class RestoreNames:
    """Where each path of a restore is written in a folder that may hold one name
    for two of history's (:func:`~metasync.scanner.name_clashes`, as a checkout):
    a path whose name is on disk in another Unicode form is written under that
    spelling (the scan takes it for the path); one that is one name with another
    file here, or another restored path, is not written (its caller says so), so a
    restore never moves a file aside to write its twin and the next push never
    turns that into a deletion. Nor is a name ending in a dot where the folder
    drops trailing dots (:meth:`~metasync.fstraits.FolderTraits.drops_dot`)."""

    def __init__(self, folders: Folders, dests: list[str], traits: FolderTraits) -> None:
        self.folders = folders
        self.case_insensitive = traits.case_insensitive
        self.traits = traits
        #: The names to restore in each folder (by its path in the restore).
        self.wanted: dict[str, set[str]] = {}
        for d in dests:
            parent, _, name = d.rpartition("/")
            self.wanted.setdefault(parent, set()).add(name)
        #: Folders of the restore spelled otherwise on disk: path -> path on disk.
        self.spelled: dict[str, str] = {}
        #: Per folder: the names on disk, and the clashes (loser -> winner) there.
        self.looked: dict[str, tuple[set[str], dict[str, str]]] = {}

    def place(self, path: str) -> tuple[str, str | None]:
        """The path to write ``path`` at, and None; or ``path`` and why it cannot be
        written here. Parents are placed before their children (sorted order)."""
        parent, _, name = path.rpartition("/")
        if self.traits.drops_dot(name):
            return path, DROPS_DOT
        disk_parent = self.spelled.get(parent, parent)
        if parent not in self.looked:
            on_disk: set[str] = set()
            with self.folders.opened(disk_parent) as fd:
                if fd is not None:
                    on_disk = {n for n in os.listdir(fd) if not is_ignored(n)}
            names = self.wanted.get(parent, set())
            self.looked[parent] = (on_disk, name_clashes(names | on_disk, on_disk,
                                                         self.case_insensitive))
        on_disk, clashes = self.looked[parent]
        winner = clashes.get(name)
        if winner is None or name in on_disk:
            written = name
        elif (winner in on_disk and winner not in self.wanted.get(parent, ())
              and nfc(winner) == nfc(name)):
            written = winner  # this file, spelled otherwise on disk
        else:
            return path, clash_reason(path, f"{parent}/{winner}" if parent else winner)
        where = f"{disk_parent}/{written}" if disk_parent else written
        if where != path:
            self.spelled[path] = where
        return where, None
