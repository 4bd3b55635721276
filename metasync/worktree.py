"""The user's folder: scanning it, hashing files into objects, writing files back.

Scanning never follows symbolic links (a link is recorded as a link) and skips
``.metasync`` and our temporary files. Hashing streams each file through
FastCDC, so a large file is never held in memory and an edit re-creates only
the chunks around it. Writing goes to a temporary file beside the target and
is renamed over it only after the data is flushed, so a reader (or a crash)
sees the old file or the new one, never a mix.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from pyfastcdc import FastCDC

from metasync.objects import Chunk, FileObject, ObjectHasher

META_DIR = ".metasync"
TEMP_PREFIX = ".metasync-tmp-"

#: FastCDC parameters: 1 MiB average chunks, as restic; part of the format because
#: they decide chunk ids (and so deduplication), not of correctness.
CHUNK_AVG = 1024 * 1024
CHUNK_MIN = 256 * 1024
CHUNK_MAX = 4 * 1024 * 1024
READ_SIZE = 1024 * 1024

#: Sink for objects a hash produced: (kind, id, canonical bytes).
ObjectSink = Callable[[str, str, bytes], None]


class ScanEntry(NamedTuple):
    """One path found in the working tree (``path`` is ``/``-separated, relative).
    A named tuple: a scan makes one per path."""

    path: str
    type: str  # "file", "dir" or "link"
    size: int
    mtime_ns: int
    ino: int
    executable: bool
    target: str = ""


def is_ignored(name: str) -> bool:
    return name == META_DIR or name.startswith(TEMP_PREFIX)


#: Patterns (gitignore syntax) of paths not to synchronise; the file itself is synced.
IGNORE_FILE = ".metasyncignore"


class IgnoreRules:
    """The patterns of ``.metasyncignore``, as git applies ``.gitignore``: they keep
    *untracked* paths out; a path already tracked stays synchronised."""

    def __init__(self, lines: list[str], tracked: Iterable[str] = ()) -> None:
        import pathspec  # only repositories with an ignore file pay for the import

        self.spec = pathspec.GitIgnoreSpec.from_lines(lines)
        self.tracked = set(tracked)
        self.tracked_dirs = {p.rpartition("/")[0] for p in self.tracked}
        for d in list(self.tracked_dirs):
            while d:
                d = d.rpartition("/")[0]
                self.tracked_dirs.add(d)

    @classmethod
    def load(cls, root: Path, tracked: Iterable[str] = ()) -> IgnoreRules | None:
        """The rules of ``root``, or None if it has no (readable) ignore file."""
        try:
            text = (root / IGNORE_FILE).read_text(errors="replace")
        except OSError:
            return None
        return cls(text.splitlines(), tracked)

    def ignores(self, path: str, is_dir: bool) -> bool:
        if path in self.tracked or (is_dir and path in self.tracked_dirs):
            return False
        return self.spec.match_file(path + "/" if is_dir else path)


def scan(root: Path, ignore: IgnoreRules | None = None) -> dict[str, ScanEntry]:
    """Every file, folder and link under ``root`` (not following links), except
    what ``ignore`` excludes."""
    found: dict[str, ScanEntry] = {}
    stack: list[tuple[str, str]] = [(str(root), "")]
    while stack:
        abs_dir, rel_dir = stack.pop()
        try:
            it = os.scandir(abs_dir)
        except FileNotFoundError:
            continue  # vanished while scanning: it is simply not there
        with it:
            for de in it:
                if is_ignored(de.name):
                    continue
                rel = f"{rel_dir}/{de.name}" if rel_dir else de.name
                try:
                    st = de.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                mode = st.st_mode
                if ignore is not None and ignore.ignores(rel, stat.S_ISDIR(mode)):
                    continue
                if stat.S_ISLNK(mode):
                    target = os.readlink(de.path)
                    size = len(os.fsencode(target))
                    found[rel] = ScanEntry(rel, "link", size, st.st_mtime_ns, st.st_ino, False, target)
                elif stat.S_ISDIR(mode):
                    found[rel] = ScanEntry(rel, "dir", 0, st.st_mtime_ns, st.st_ino, False)
                    stack.append((de.path, rel))
                elif stat.S_ISREG(mode):
                    found[rel] = ScanEntry(
                        rel, "file", st.st_size, st.st_mtime_ns, st.st_ino, bool(mode & stat.S_IXUSR)
                    )
                # sockets, fifos and devices are not synchronised.
    return found


class FileChanged(Exception):
    """The file changed while it was being read; try again later."""


@dataclass(frozen=True)
class HashedFile:
    """A file's content as objects: ``type`` is ``file`` (one blob) or ``chunked``."""

    type: str
    ref: str
    size: int
    blobs: int


class Chunker:
    """Splits files into content-defined chunks and names them."""

    def __init__(self, hasher: ObjectHasher) -> None:
        self.hasher = hasher

    def hash_file(self, path: Path, expect: ScanEntry, sink: ObjectSink | None) -> HashedFile:
        """Read ``path`` once, stream its chunks to ``sink`` and return its reference.

        Raises :class:`FileChanged` if the file's size or mtime moved during the read
        (a file still being written must not be committed half-written).
        """
        chunks: list[Chunk] = []
        with open(path, "rb", buffering=0) as fh:
            st = os.fstat(fh.fileno())
            if st.st_size != expect.size or st.st_mtime_ns != expect.mtime_ns:
                raise FileChanged(str(path))
            if st.st_size <= CHUNK_MIN:
                self._emit(fh.readall(), 0, chunks, sink)
            else:
                # FastCDC objects are not thread-safe; one per call is cheap.
                cdc = FastCDC(CHUNK_AVG, min_size=CHUNK_MIN, max_size=CHUNK_MAX)
                for piece in cdc.cut_stream(fh):
                    self._emit(piece.data, piece.offset, chunks, sink)
            after = os.fstat(fh.fileno())
        size = sum(c.length for c in chunks)
        if after.st_size != expect.size or after.st_mtime_ns != expect.mtime_ns or size != expect.size:
            raise FileChanged(str(path))
        if len(chunks) == 1:
            return HashedFile("file", chunks[0].blob_id, size, 1)
        if not chunks:  # an empty file is one empty blob
            empty = self.hasher.id_of("blob", b"")
            if sink is not None:
                sink("blob", empty, b"")
            return HashedFile("file", empty, 0, 1)
        obj = FileObject(size, tuple(chunks))
        data = obj.to_bytes()
        file_id = self.hasher.id_of("file", data)
        if sink is not None:
            sink("file", file_id, data)
        return HashedFile("chunked", file_id, size, len(chunks))

    def _emit(
        self, data: bytes | memoryview, offset: int, chunks: list[Chunk], sink: ObjectSink | None
    ) -> None:
        if not data:
            return
        blob_id = self.hasher.id_of("blob", data)
        chunks.append(Chunk(blob_id, offset, len(data)))
        if sink is not None:
            sink("blob", blob_id, bytes(data))


def temp_path_for(target: Path) -> Path:
    return target.parent / f"{TEMP_PREFIX}{os.urandom(6).hex()}"


def remove_stale_temps(root: Path) -> int:
    """Delete temporary files a crashed command left behind; return how many."""
    removed = 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d != META_DIR]
        for name in filenames:
            if name.startswith(TEMP_PREFIX):
                try:
                    os.unlink(os.path.join(dirpath, name))
                    removed += 1
                except FileNotFoundError:
                    pass
    return removed


def file_mode(executable: bool) -> int:
    umask = os.umask(0)
    os.umask(umask)
    return (0o777 if executable else 0o666) & ~umask


#: Longest file name, in bytes, most filesystems accept.
MAX_NAME_BYTES = 255


def conflict_name(name: str, device: str, when: str) -> str:
    """``NAME (conflict DEVICE YYYY-MM-DD HHMMSS).EXT``: the extension stays last so
    applications still open the copy. NAME is shortened if the result would pass
    MAX_NAME_BYTES."""
    stem, dot, ext = name.rpartition(".")
    if not dot or not stem:
        stem, ext = name, ""
    suffix = f" (conflict {device} {when})" + (f".{ext}" if ext else "")
    budget = MAX_NAME_BYTES - len(os.fsencode(suffix))
    while len(os.fsencode(stem)) > budget and stem:
        stem = stem[:-1]
    return f"{stem}{suffix}"


def write_durable(path: Path, data: bytes) -> None:
    """Temp file, fsync, rename: ``path`` holds all of ``data`` or does not exist."""
    tmp = path.with_name(f".tmp-{os.urandom(6).hex()}")
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def write_private(path: Path, data: bytes) -> None:
    """Create ``path`` readable by its owner only (0600), durably; fails if it exists."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
