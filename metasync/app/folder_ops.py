"""What the REST API does with one folder's repository (docs/api.md, "Activity,
history, files" and "Conflicts"), through the facade :class:`metasync.Repository`
only.

Every function opens the repository for the length of one call, in the calling
thread (SQLite handles stay in the thread that made them): reads open it
``read_only`` (never waiting for, nor blocking, a sync in progress), changes open
it exclusively, waiting at most :data:`LOCK_WAIT` seconds for the folder's sync to
finish. Changes on disk (restore, resolving a conflict) are left for the folder's
watch to commit and push, with its deletion guard, as if the user had made them.

Paths arrive untrusted (:func:`parse_path`): ``..``, absolute paths, NUL and
``.metasync`` are refused. Every failure is an :class:`ApiError` carrying its HTTP
status and one line naming the problem and the fix.
"""

from __future__ import annotations

import os
import re
import stat
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from metasync.errors import (
    BackendError,
    CorruptObject,
    FolderBusy,
    MetasyncError,
    NotARepository,
    ObjectUnavailable,
    UsageError,
)
from metasync.merge import device_label
from metasync.names import display_path, parse_display_path
from metasync.objects import TreeEntry
from metasync.portable import O_CLOEXEC, O_DIRECTORY, O_NOFOLLOW, O_NONBLOCK
from metasync.repository import Repository
from metasync.worktree import META_DIR

#: Seconds a change waits for the folder's sync in progress to finish.
LOCK_WAIT = 30.0
#: Bytes read from the backends per step of a download (memory stays bounded).
READ_GROUP = 8 * 1024 * 1024
#: Bytes per step of a download of a file on disk.
DISK_CHUNK = 1024 * 1024
#: Changes listed per version in the activity (more are counted).
MAX_CHANGES = 200
#: Commits searched for which device made a conflict copy (when names do not say).
OWNER_SEARCH = 50
#: ``NAME (conflict DEVICE[ N] YYYY-MM-DD HHMMSS)[.EXT]``, as worktree.conflict_name
#: makes them; DEVICE is device_label's alphabet.
CONFLICT_RE = re.compile(
    r"(?P<stem>.*) \(conflict (?P<device>[A-Za-z0-9_-]+)(?: (?P<n>\d+))? "
    r"(?P<stamp>\d{4}-\d{2}-\d{2} \d{6})\)(?:\.(?P<ext>[^.]*))?", re.S)


class ApiError(Exception):
    """A request that fails: ``status`` is its HTTP status, ``str()`` its one line."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def error_status(exc: BaseException) -> int:
    """The HTTP status of an error raised by the repository."""
    if isinstance(exc, ApiError):
        return exc.status
    if isinstance(exc, FolderBusy):
        return 409
    if isinstance(exc, (UsageError, NotARepository)):
        return 400
    if isinstance(exc, (BackendError, ObjectUnavailable, CorruptObject)):
        return 502
    return 500


# ---------------------------------------------------------------- parameters
def parse_path(text: object, *, root_ok: bool = False) -> str:
    """A folder-relative path from a request (display form, ``/``-separated), as
    trees name it; ``""`` for the root if ``root_ok``. Refuses (400) anything that
    could leave the folder or reach ``.metasync``."""
    if text is None and root_ok:
        return ""
    if not isinstance(text, str):
        raise ApiError(400, "give the path as a string (folder-relative, /-separated)")
    try:
        raw = parse_display_path(text)
    except ValueError as exc:
        raise ApiError(400, f"{exc}; give the path as `metasync status` shows it") from None
    if b"\0" in raw:
        raise ApiError(400, "a path cannot hold a NUL byte")
    path = os.fsdecode(raw)
    if path.startswith("/") or os.path.isabs(path) or (os.sep != "/" and os.sep in path):
        raise ApiError(400, f"{text!r} is absolute; give a path relative to the folder")
    parts = [p for p in path.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise ApiError(400, f"{text!r} leaves the folder (..); give a path inside it")
    # Case-folded: on a case-insensitive disk (macOS, Windows, exFAT) ".METASYNC"
    # is metasync's own folder too.
    if parts and parts[0].casefold() == META_DIR.casefold():
        raise ApiError(400, f"{META_DIR} is metasync's own folder; give a path of your files")
    if not parts and not root_ok:
        raise ApiError(400, "give a path inside the folder (it is empty)")
    return "/".join(parts)


def _shown(path: str) -> str:
    return display_path(path)


# ---------------------------------------------------------------- opening
@contextmanager
def reading(root: Path) -> Iterator[Repository]:
    """The repository of ``root`` for reading: at once, whether or not its sync runs."""
    with Repository.open(root, read_only=True) as repo:
        yield repo


@contextmanager
def changing(root: Path) -> Iterator[Repository]:
    """The repository of ``root`` held exclusively (waiting at most LOCK_WAIT s)."""
    try:
        repo = Repository.open(root, wait=LOCK_WAIT)
    except FolderBusy as exc:
        raise ApiError(409, f"{exc}") from None
    with repo:
        yield repo


def _newest(repo: Repository) -> str:
    top = repo.head or repo.prev.master
    if top is None:
        raise ApiError(404, "nothing has been pushed yet; add files and let the folder sync")
    return top


def resolve_version(repo: Repository, version: object) -> str:
    """The commit id of ``version``: a version number this device synced with (as
    activity lists them), a commit id or a prefix of 4+ hex digits; the newest this
    device has if None. 404 if it names none."""
    if version is None or version == "":
        return _newest(repo)
    text = str(version).strip().lower()
    if isinstance(version, bool) or not re.fullmatch(r"[0-9a-f]+", text):
        raise ApiError(400, f"version {version!r} is not a version number or commit id")
    entries = repo.log()
    if text.isdigit():
        number = int(text)
        for e in entries:
            if e.version == number:
                return e.commit_id
        if len(text) < 4:
            raise ApiError(404, f"version {number} is not one this device synced with; "
                                "pick one from the activity list")
    found = [e.commit_id for e in entries if e.commit_id.startswith(text)] if len(text) >= 4 else []
    if len(found) != 1:
        raise ApiError(404, f"{text!r} names {'no' if not found else 'more than one'} version; "
                            "pick one from the activity list")
    return found[0]


# ---------------------------------------------------------------- activity
def _files(tree: dict[str, TreeEntry]) -> dict[str, TreeEntry]:
    return {p: e for p, e in tree.items() if e.type != "dir"}


def _kind(before: TreeEntry | None, after: TreeEntry | None) -> str | None:
    if before is None:
        return "added"
    if after is None:
        return "deleted"
    same = (before.type == after.type and before.ref == after.ref
            and before.executable == after.executable)
    return None if same else "modified"


def activity(root: Path, limit: int) -> list[dict[str, Any]]:
    """The newest ``limit`` versions (commits), newest first, each with the files
    it changed against its first parent (a merge: what it brought into the line)."""
    with reading(root) as repo:
        entries = repo.log(limit)
        trees: dict[str, dict[str, TreeEntry]] = {}

        def files_of(cid: str) -> dict[str, TreeEntry]:
            if cid not in trees:
                trees[cid] = _files(repo.tree_at(cid))
            return trees[cid]

        out = []
        for e in entries:
            after = files_of(e.commit_id)
            before = files_of(e.parents[0]) if e.parents else {}
            changes = []
            for path in sorted(set(before) | set(after)):
                kind = _kind(before.get(path), after.get(path))
                if kind is not None:
                    changes.append({"path": _shown(path), "kind": kind})
            out.append({"version": e.version, "commit": e.commit_id, "time": e.time_ns / 1e9,
                        "device": e.device, "message": e.message,
                        "changes": changes[:MAX_CHANGES],
                        "more": max(0, len(changes) - MAX_CHANGES)})
        return out


# ---------------------------------------------------------------- tree and files
def tree(root: Path, version: object, folder: str) -> list[dict[str, Any]]:
    """The entries directly under ``folder`` ("" for the root) in ``version``."""
    with reading(root) as repo:
        flat = repo.tree_at(resolve_version(repo, version))
    if folder and (folder not in flat or flat[folder].type != "dir"):
        raise ApiError(404, f"{_shown(folder)} is not a folder in that version")
    out = []
    for path, e in flat.items():
        if path.rpartition("/")[0] != folder:
            continue
        kind = {"dir": "dir", "link": "link"}.get(e.type, "file")
        out.append({"name": _shown(e.name), "path": _shown(path), "type": kind,
                    "size": e.size if kind != "dir" else 0})
    out.sort(key=lambda x: (x["type"] != "dir", x["name"]))
    return out


@dataclass
class Download:
    """A file to send: its name, its length, and its bytes in pieces (reading them
    holds what they come from open; :meth:`close` releases it early)."""

    name: str
    size: int
    pieces: Iterator[bytes]

    def close(self) -> None:
        close = getattr(self.pieces, "close", None)
        if close is not None:
            close()


def version_file(root: Path, path: str, version: object) -> Download:
    """File ``path`` as stored in ``version``, read in groups of READ_GROUP bytes,
    each verified as every read from the backends is, and its length checked."""
    repo = Repository.open(root, read_only=True)
    try:
        entry = repo.tree_at(resolve_version(repo, version)).get(path)
        if entry is None or entry.type not in ("file", "chunked"):
            raise ApiError(404, f"{_shown(path)} is not a file in that version")
        chunks = repo.graph.file_chunks(entry)
    except BaseException:
        repo.close()
        raise

    def pieces() -> Iterator[bytes]:
        try:
            group: list[tuple[str, int]] = []
            size = 0
            for i, (blob_id, length) in enumerate(chunks):
                group.append((blob_id, length))
                size += length
                if size < READ_GROUP and i + 1 < len(chunks):
                    continue
                data = repo.graph.read_blobs(group)
                for blob, want in group:
                    if len(data[blob]) != want:
                        raise CorruptObject(f"blob {blob[:12]} has the wrong length")
                    yield data[blob]
                group, size = [], 0
        finally:
            repo.close()

    return Download(path.rpartition("/")[2], entry.size, pieces())


def _open_folder(root: Path, rel: str) -> int:
    """A descriptor of folder ``rel`` of ``root``, each part opened from its parent
    without following a symbolic link (nothing outside the folder is reached)."""
    fd = os.open(root, os.O_RDONLY | O_DIRECTORY | O_CLOEXEC)
    try:
        for part in [p for p in rel.split("/") if p]:
            nxt = os.open(part, os.O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC, dir_fd=fd)
            os.close(fd)
            fd = nxt
    except OSError:
        os.close(fd)
        raise
    return fd


def disk_file(root: Path, path: str) -> Download:
    """File ``path`` as it is on disk now (never through a symbolic link)."""
    parent, _, name = path.rpartition("/")
    try:
        folder = _open_folder(root, parent)
        try:
            # Non-blocking open: a FIFO in the folder would block the open forever
            # (a thread lost per request); it is refused below, then reads block.
            fd = os.open(name, os.O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK, dir_fd=folder)
        finally:
            os.close(folder)
    except OSError:
        raise ApiError(404, f"{_shown(path)} is not a file in the folder") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise ApiError(404, f"{_shown(path)} is not a file in the folder")
    if sys.platform != "win32":
        os.set_blocking(fd, True)

    def pieces() -> Iterator[bytes]:
        with os.fdopen(fd, "rb") as fh:
            while piece := fh.read(DISK_CHUNK):
                yield piece

    return Download(name, st.st_size, pieces())


# ---------------------------------------------------------------- restore
def restore(root: Path, path: str, version: object) -> list[str]:
    """Restore ``path`` (a file or folder) from ``version`` into the folder, as
    ``metasync restore PATH --version V`` does (the newest version where it differs
    if None); returns the restored paths (folder-relative). The folder's watch
    commits and pushes it."""
    with changing(root) as repo:
        commit = None if version is None or version == "" else resolve_version(repo, version)
        result = repo.restore(path, commit)
        base = repo.root
    return [_shown(os.path.relpath(p, base).replace(os.sep, "/")) for p in result.restored]


# ---------------------------------------------------------------- conflicts
@dataclass(frozen=True)
class Conflict:
    #: The original's path, the copy's path, the device that made the copy's version.
    path: str
    copy: str
    device: str
    #: Which of the two holds this device's version: "path" or "copy".
    mine: str

    def to_json(self) -> dict[str, Any]:
        return {"path": _shown(self.path), "copy": _shown(self.copy), "device": self.device,
                "mine": self.mine}


def _copies(root: Path) -> list[tuple[str, str, str]]:
    """``(original, copy, device)`` of every conflict copy on disk (files and links)."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel = os.path.relpath(dirpath, root).replace(os.sep, "/")
        rel = "" if rel == "." else rel
        if not rel:
            dirnames[:] = [d for d in dirnames if d != META_DIR]
        links = [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]
        for name in [*filenames, *links]:
            m = CONFLICT_RE.fullmatch(name)
            if m is None:
                continue
            original = m["stem"] + (f".{m['ext']}" if m["ext"] is not None else "")
            prefix = f"{rel}/" if rel else ""
            found.append((prefix + original, prefix + name, m["device"]))
    return sorted(found)


def _made_here(repo: Repository, copy: str) -> bool:
    """Whether this device (this client) made the conflict copy ``copy``: the
    newest commit along first parents that lacks it is followed by one this client
    made -- or no commit holds it yet (a copy a pull made here, not synced yet)."""
    current: str | None = repo.head or repo.prev.master
    introduced_by: str | None = None
    for _ in range(OWNER_SEARCH):
        if current is None:
            break
        commit = repo.load_commit(current)
        if copy not in repo.tree_at(current):
            break
        introduced_by = commit.client
        current = commit.parents[0] if commit.parents else None
    return introduced_by is None or introduced_by == repo.client_id


def _conflicts(repo: Repository) -> list[Conflict]:
    mine = device_label(repo.device)
    out = []
    for path, copy, device in _copies(repo.root):
        # Another device's name: the copy is theirs. This device's name: ask the
        # history (two devices may share a name).
        side = "path" if device != mine or not _made_here(repo, copy) else "copy"
        out.append(Conflict(path, copy, device, side))
    return out


def conflicts(root: Path) -> list[dict[str, Any]]:
    """Every conflict copy in the folder with its original (docs/api.md)."""
    with reading(root) as repo:
        return [c.to_json() for c in _conflicts(repo)]


def _free_name(folder: int, stem: str, device: str, ext: str | None) -> str:
    n = 1
    while True:
        label = device if n == 1 else f"{device} {n}"
        name = f"{stem} ({label})" + (f".{ext}" if ext is not None else "")
        try:
            os.lstat(name, dir_fd=folder)
        except FileNotFoundError:
            return name
        n += 1


def resolve(root: Path, copy_text: object, keep: object) -> list[dict[str, Any]]:
    """Resolve the conflict of copy ``copy_text``: keep ``mine``, ``theirs`` or
    ``both`` (docs/app.md, "Conflicts"); returns the conflicts left. The version
    dropped must already be in a commit (it stays in history); one with changes
    not committed yet is refused (409) until the folder has synced."""
    if keep not in ("mine", "theirs", "both"):
        raise ApiError(400, "keep must be \"mine\", \"theirs\" or \"both\"")
    copy = parse_path(copy_text)
    with changing(root) as repo:
        found = {c.copy: c for c in _conflicts(repo)}
        c = found.get(copy)
        if c is None:
            raise ApiError(404, f"{_shown(copy)} is not a conflict copy in the folder; "
                                "reload the conflict list")
        parent, _, copy_name = copy.rpartition("/")
        path_name = c.path.rpartition("/")[2]
        folder = _open_folder(repo.root, parent)
        try:
            original_here = _exists(folder, path_name)
            if keep == "both":
                m = CONFLICT_RE.fullmatch(copy_name)
                assert m is not None
                new = _free_name(folder, m["stem"], c.device, m["ext"])
                os.rename(copy_name, new, src_dir_fd=folder, dst_dir_fd=folder)
            else:
                winner = c.mine if keep == "mine" else ("copy" if c.mine == "path" else "path")
                if not original_here:
                    raise ApiError(409, f"{_shown(c.path)} is gone from the folder; keep both, "
                                        "or rename the copy yourself")
                dropped = copy if winner == "path" else c.path
                if any(ch.path == dropped for ch in repo.status().changes):
                    raise ApiError(409, f"{_shown(dropped)} has changes not synced yet; wait "
                                        "for the folder to sync, then resolve again")
                if winner == "path":
                    os.unlink(copy_name, dir_fd=folder)
                else:
                    os.replace(copy_name, path_name, src_dir_fd=folder, dst_dir_fd=folder)
        finally:
            os.close(folder)
        return [x.to_json() for x in _conflicts(repo)]


def _exists(folder: int, name: str) -> bool:
    try:
        os.lstat(name, dir_fd=folder)
    except FileNotFoundError:
        return False
    return True


# ---------------------------------------------------------------- status
def status(root: Path) -> dict[str, Any]:
    """The same JSON as ``metasync status --json`` in the folder."""
    with reading(root) as repo:
        doc = repo.status().to_json()
        try:
            standing = repo.history.standing()
        except MetasyncError:
            standing = None
    doc.update({"latest": standing.latest if standing else None,
                "behind": standing.behind if standing else None,
                "ahead": standing.ahead if standing else None})
    return doc
