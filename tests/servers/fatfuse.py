"""A FAT32 FUSE driver for the tests: ``python -m tests.servers.fatfuse IMAGE MOUNTPOINT``.

The kernel's vfat module cannot be loaded on the test machines and fusefat 0.1a
(Debian's only FAT driver) loses a folder's contents when it is renamed, so the
"fat" image of :mod:`tests.servers.fsimages` is served by this: pyfatfs's on-disk
structures (FAT, 8.3 + VFAT long-name directory entries) driven through mfusepy's
libfuse binding, behaving as Linux's vfat does with its default options:

- lookups are case-insensitive (ASCII, as vfat with ``utf8``) and case-preserving,
  and trailing dots of a name are dropped (``a.`` is ``a``);
- a name holding ``: ? " < > | * \\`` or a control character, or ending in a space
  (after its trailing dots are dropped), is refused with EINVAL, a name over 255
  bytes or 255 UTF-16 units with ENAMETOOLONG (vfat_valid_longname, xlate_to_uni);
- no symbolic links, hard links or device nodes (EPERM); every file and folder is
  ``0755`` and owned by the mounting user; chmod keeps only the write bit (the
  read-only attribute) and silently ignores the rest, chown to another owner and
  set-id bits are EPERM;
- rename moves files and folders (contents kept), replaces a file or an empty
  folder atomically and refuses the rest as rename(2) does; no renameat2 flags
  (libfuse 2 has no rename2, so the kernel answers EINVAL for RENAME_NOREPLACE);
- an unlinked file stays readable through open handles until the last is closed.

Everything is kept in memory and written to the image on fsync, release (close)
and unmount, so data survives an unmount. Only FAT32 is served. The process runs
in the foreground, single-threaded, and prints ``ready`` on stdout once the kernel
has sent FUSE's INIT, that is once the mount is live. In /proc/self/mountinfo the
mount's type is ``fuse.fatfuse`` and its source the image file.
"""

from __future__ import annotations

import array
import errno
import math
import os
import stat
import sys
import time
import zlib
from typing import Any

import mfusepy
from pyfatfs.EightDotThree import EightDotThree
from pyfatfs.FATDirectoryEntry import FATDirectoryEntry, FATLongDirectoryEntry
from pyfatfs.PyFat import PyFat

Entry = FATDirectoryEntry

#: Characters vfat refuses in a long name (besides those below 0x20 and "/").
FORBIDDEN = set(':?"<>|*\\')
#: Permission bits every file and folder shows (vfat's default fmask/dmask 022).
PERM = 0o755


def _fold(name: str) -> str:
    """The key two names are equal under: vfat drops trailing dots and, with
    ``utf8``, folds ASCII letters only."""
    return name.rstrip(".").translate(_ASCII_LOWER)


_ASCII_LOWER = {c: c + 32 for c in range(ord("A"), ord("Z") + 1)}


def _err(code: int) -> mfusepy.FuseOSError:
    return mfusepy.FuseOSError(code)


def _name_of(entry: Entry) -> str:
    """The entry's long name, else its 8.3 one (kept on the entry: decoding long
    names on every lookup made a folder of thousands of entries crawl)."""
    name: str | None = getattr(entry, "_fatfuse_name", None)
    if name is None:
        try:
            name = entry.get_long_name()
        except Exception:  # no long name
            name = entry.get_short_name()
        entry._fatfuse_name = name
    return name


def _dos_time(ts: float) -> tuple[int, int]:
    """(date, time) of a POSIX time in local time, 2-second granularity, clamped
    to FAT's 1980..2107 as vfat does."""
    t = time.localtime(max(int(ts), 315532800))
    if t.tm_year < 1980:
        return (0 << 9) | (1 << 5) | 1, 0
    if t.tm_year > 2107:
        return (127 << 9) | (12 << 5) | 31, (23 << 11) | (59 << 5) | 29
    return ((t.tm_year - 1980) << 9) | (t.tm_mon << 5) | t.tm_mday, \
        (t.tm_hour << 11) | (t.tm_min << 5) | (t.tm_sec // 2)


def _posix_time(date: int, tm: int) -> float:
    if date == 0:
        return 315532800.0
    return time.mktime(((date >> 9) + 1980, max((date >> 5) & 0xF, 1), max(date & 0x1F, 1),
                        tm >> 11, (tm >> 5) & 0x3F, (tm & 0x1F) * 2, 0, 0, -1))


#: Characters an 8.3 name holds besides letters and digits.
_SHORT_OK = set("!#$%&'()-@^_`{}~")


def _short_name(name: str, taken: set[str]) -> str:
    """An 8.3 alias for ``name`` not in ``taken`` (upper-case aliases of the
    folder): ``name`` itself if it is one, else its first letters with ``~N``, and
    after four of those a hash of the name, as vfat makes them (pyfatfs's helper
    tries ~1, ~2, ... against a list: quadratic in a folder of similar names)."""
    if EightDotThree.is_8dot3_conform(name) and name not in taken:
        return name

    def mapped(part: str) -> str:
        return "".join(c.upper() if c.isascii() and (c.isalnum() or c in _SHORT_OK)
                       else "" if c in " ." else "_" for c in part)

    stem, dot, ext = name.rpartition(".")
    if not dot:
        stem, ext = name, ""
    base, ext = mapped(stem), mapped(ext)
    if not base:  # ".hidden": the part after the dot is all there is
        base, ext = ext or "_", ""
    base, ext = base[:8], ext[:3]
    suffix = f".{ext}" if ext else ""
    for i in range(1, 5):
        short = f"{base[:6]}~{i}{suffix}"
        if short not in taken:
            return short
    digest = f"{zlib.crc32(name.encode('utf-8', 'surrogateescape')) & 0xFFFF:04X}"
    for i in range(1, 10):
        short = f"{base[:2]}{digest}~{i}{suffix}"
        if short not in taken:
            return short
    for i in range(10, 1_000_000):
        tail = f"~{i}"
        short = f"{base[:8 - len(tail)]}{tail}{suffix}"
        if short not in taken:
            return short
    raise mfusepy.FuseOSError(errno.ENOSPC)


def _lfn_entry(name: str, short: EightDotThree) -> FATLongDirectoryEntry:
    """VFAT long-name entries for ``name`` (pyfatfs's own helper limits names to
    255 UTF-16 bytes instead of 255 units)."""
    lfn = FATLongDirectoryEntry()
    raw = name.encode("utf-16-le")
    if len(raw) % 26:
        raw += b"\0\0"
        raw += b"\xff" * (-len(raw) % 26)
    checksum = short.checksum()
    count = len(raw) // 26
    for i in range(count):
        part = raw[i * 26:(i + 1) * 26]
        lfn.add_lfn_entry(LDIR_Ord=(0x40 if i == count - 1 else 0) | (i + 1),
                          LDIR_Name1=part[:10], LDIR_Attr=Entry.ATTR_LONG_NAME, LDIR_Type=0,
                          LDIR_Chksum=checksum, LDIR_Name2=part[10:22], LDIR_FstClusLO=0,
                          LDIR_Name3=part[22:26])
    return lfn


class FatFuse(mfusepy.Operations):
    """The FUSE operations over one FAT32 image (single-threaded: no locking)."""

    use_ns = True
    #: An unlinked file's open handles get no path (hard_remove): they use ``fh``.
    flag_nullpath_ok = True

    def __init__(self, image: str) -> None:
        self.fat = PyFat(lazy_load=True)
        self.fat.open(image)
        if self.fat.fat_type != PyFat.FAT_TYPE_FAT32:
            raise SystemExit(f"fatfuse: {image} is not FAT32 (make it with mkfs.vfat -F 32)")
        self.root: Entry = self.fat.root_dir
        self.bpc: int = self.fat.bytes_per_cluster
        self.eoc: int = PyFat.FAT_CLUSTER_VALUES[PyFat.FAT_TYPE_FAT32]["END_OF_CLUSTER_MAX"]
        bpb = self.fat.bpb_header
        data_start = bpb["BPB_RsvdSecCnt"] + bpb["BPB_NumFATs"] * bpb["BPB_FATSz32"]
        #: Data clusters of the volume (the FAT itself may have room for more).
        self.clusters: int = (self.fat._get_total_sectors() - data_start) // bpb["BPB_SecPerClus"]
        self.uid, self.gid = os.getuid(), os.getgid()
        self.handles: dict[int, Entry] = {}
        self.next_fh = 1
        #: Files unlinked while open: their clusters are freed at the last close.
        self.orphans: set[int] = set()
        self.dirty_dirs: dict[int, Entry] = {}
        self.chains: dict[int, list[int]] = {}
        assert array.array("I").itemsize == 4
        #: The FAT as last written to the image (what _flush_fat compares with).
        self.flushed_fat = array.array("I", self.fat.fat).tobytes()
        self.fat_dirty = False

    # -- lookup -----------------------------------------------------------------

    @staticmethod
    def _children(d: Entry) -> list[Entry]:
        dirs, files, _ = d.get_entries()
        return dirs + files

    def _index(self, d: Entry) -> dict[str, Entry]:
        """``d``'s entries by folded long and short name (long names win), built
        at the first lookup in ``d`` and kept up to date by _attach and _detach."""
        index: dict[str, Entry] | None = getattr(d, "_fatfuse_index", None)
        if index is None:
            index = {}
            children = self._children(d)
            for e in children:
                index[_fold(e.get_short_name())] = e
            for e in children:
                index[_fold(_name_of(e))] = e
            d._fatfuse_index = index
        return index

    def _short_names(self, d: Entry) -> set[str]:
        return {e.get_short_name().upper() for e in self._children(d)}

    def _find(self, d: Entry, name: str) -> Entry | None:
        return self._index(d).get(_fold(name))

    def _resolve(self, path: str) -> Entry:
        e = self.root
        for part in filter(None, path.split("/")):
            if not e.is_directory():
                raise _err(errno.ENOTDIR)
            found = self._find(e, part)
            if found is None:
                raise _err(errno.ENOENT)
            e = found
        return e

    def _parent(self, path: str) -> tuple[Entry, str]:
        head, _, name = path.rstrip("/").rpartition("/")
        d = self._resolve(head)
        if not d.is_directory():
            raise _err(errno.ENOTDIR)
        return d, name

    @staticmethod
    def _check_name(name: str) -> str:
        """The name vfat stores for ``name`` (trailing dots dropped), or the errno
        vfat_valid_longname gives."""
        stored = name.rstrip(".")
        if not stored:
            raise _err(errno.ENOENT)
        if stored.endswith(" "):
            raise _err(errno.EINVAL)
        if len(stored.encode("utf-8", "surrogateescape")) >= 256 \
                or len(stored.encode("utf-16-le", "surrogatepass")) // 2 > 255:
            raise _err(errno.ENAMETOOLONG)
        if any(c in FORBIDDEN or ord(c) < 0x20 for c in stored):
            raise _err(errno.EINVAL)
        return stored

    def _is_open(self, e: Entry) -> bool:
        return any(h is e for h in self.handles.values())

    # -- on-disk structures -----------------------------------------------------

    def _chain(self, first: int) -> list[int]:
        """The cluster chain starting at ``first`` (cached: walking a 100 MB file's
        chain on every 128 KiB write would be quadratic). Only _grow changes it."""
        if not first:
            return []
        chain = self.chains.get(first)
        if chain is None:
            chain = self.chains[first] = list(self.fat.get_cluster_chain(first))
        return chain

    def _runs(self, chain: list[int], pos: int, size: int) -> list[tuple[int, int]]:
        """(image address, length) of the contiguous pieces holding bytes
        ``pos..pos+size`` of a file or folder whose clusters are ``chain``."""
        runs: list[tuple[int, int]] = []
        end = pos + size
        while pos < end:
            i, off = divmod(pos, self.bpc)
            n = min(self.bpc - off, end - pos)
            address = self.fat.get_data_cluster_address(chain[i]) + off
            if runs and runs[-1][0] + runs[-1][1] == address:
                runs[-1] = (runs[-1][0], runs[-1][1] + n)
            else:
                runs.append((address, n))
            pos += n
        return runs

    def _allocate(self, count: int) -> list[int]:
        try:
            clusters = self.fat.allocate_bytes(count * self.bpc)
        except Exception as exc:
            raise _err(errno.ENOSPC) from exc
        self.fat_dirty = True
        if clusters and clusters[-1] >= self.clusters + 2:
            # pyfatfs looks through the whole FAT, whose last sector may describe
            # clusters past the end of the volume: the volume is full.
            for c in clusters:
                self.fat.fat[c] = 0
            raise _err(errno.ENOSPC)
        return clusters

    def _grow(self, e: Entry, clusters: int, chain: list[int]) -> list[int]:
        """``chain`` (``e``'s) made at least ``clusters`` long."""
        if len(chain) >= clusters:
            return chain
        new = self._allocate(clusters - len(chain))
        if chain:
            self.fat.fat[chain[-1]] = new[0]
            chain.extend(new)  # the cached list
            return chain
        e.set_cluster(new[0])
        self.chains[new[0]] = new
        return new

    def _free(self, first: int) -> None:
        if first:
            self.chains.pop(first, None)
            self.fat.free_cluster_chain(first)
            self.fat_dirty = True

    def _mark(self, d: Entry) -> None:
        self.dirty_dirs[id(d)] = d

    def _write_dir(self, d: Entry) -> None:
        """``d``'s entries written over its whole cluster chain (the tail zeroed, so
        entries removed from it do not come back when the image is read again)."""
        data = b"".join(bytes(e) for e in d._get_entries_raw())
        chain = self._chain(d.get_cluster())
        need = max(1, math.ceil(len(data) / self.bpc))
        chain = self._grow(d, need, chain)
        data += b"\0" * (len(chain) * self.bpc - len(data))
        done = 0
        for address, n in self._runs(chain, 0, len(data)):
            self.fat._write_data_to_address(data[done:done + n], address)
            done += n

    def _sync(self, to_disk: bool = False) -> None:
        """Everything held in memory written to the image file; with ``to_disk``
        (unmount only) the image fsynced too. An fsync of a file here needs no
        fsync of the image: the data is in the host's page cache, which outlives
        this process, and the image is a test's, never kept across a host crash."""
        for d in list(self.dirty_dirs.values()):
            self._write_dir(d)
        self.dirty_dirs.clear()
        if self.fat_dirty:
            self._flush_fat()
            self.fat_dirty = False
        if to_disk:
            self._write_fsinfo()
        fp = self.fat._PyFat__fp
        fp.flush()
        if to_disk:
            os.fsync(fp.fileno())

    def _flush_fat(self) -> None:
        """The sectors of the FAT that changed since the last flush, written to
        every copy of it (pyfatfs's flush_fat packs and writes all of it, which on
        each close of a written file dominated the run time)."""
        bpb = self.fat.bpb_header
        sector = bpb["BPB_BytsPerSec"]
        data = array.array("I", self.fat.fat).tobytes()
        old = self.flushed_fat
        first_fat = bpb["BPB_RsvdSecCnt"] * sector
        fat_size = bpb["BPB_FATSz32"] * sector
        for start in range(0, len(data), sector):
            piece = data[start:start + sector]
            if old[start:start + sector] != piece:
                for copy in range(bpb["BPB_NumFATs"]):
                    self.fat._write_data_to_address(piece, first_fat + copy * fat_size + start)
        self.flushed_fat = data

    def _write_fsinfo(self) -> None:
        """FAT32's FSInfo sector told the free cluster count (as vfat keeps it), so
        fsck.fat finds nothing to correct."""
        sector = self.fat.bpb_header["BPB_FSInfo"]
        if sector in (0, 0xFFFF):
            return
        free = self.statfs("/")["f_bfree"]
        self.fat._write_data_to_address(
            free.to_bytes(4, "little") + (0xFFFFFFFF).to_bytes(4, "little"),
            sector * self.fat.bpb_header["BPB_BytsPerSec"] + 488)

    def _touch(self, e: Entry) -> None:
        e.wrtdate, e.wrttime = _dos_time(time.time())
        e.lstaccessdate = e.wrtdate
        e.attr |= Entry.ATTR_ARCHIVE
        self._mark(e.get_parent_dir())

    def _new_entry(self, d: Entry, name: str, attr: int, cluster: int = 0) -> Entry:
        short = EightDotThree()
        short.set_str_name(_short_name(name, self._short_names(d)))
        e = Entry.new(name=short, tz=None, encoding=short.encoding, attr=attr, cluster=cluster)
        self._set_name(e, name, short)
        e.wrtdate, e.wrttime = _dos_time(time.time())
        e.crtdate, e.crttime, e.lstaccessdate = e.wrtdate, e.wrttime, e.wrtdate
        return e

    @staticmethod
    def _set_name(e: Entry, name: str, short: EightDotThree) -> None:
        e._fatfuse_name = name
        e.name = short
        e.lfn_entry = None if short.get_unpadded_filename() == name else _lfn_entry(name, short)

    def _attach(self, d: Entry, e: Entry) -> None:
        index = self._index(d)
        e._parent = None
        d.add_subdirectory(e)
        index.setdefault(_fold(e.get_short_name()), e)
        index[_fold(_name_of(e))] = e
        self._mark(d)

    def _detach(self, e: Entry) -> Entry:
        d = e.get_parent_dir()
        d._get_entries_raw().remove(e)
        index = self._index(d)
        for key in (_fold(e.get_short_name()), _fold(_name_of(e))):
            if index.get(key) is e:
                del index[key]
        self._mark(d)
        return d

    # -- file data --------------------------------------------------------------

    def _read(self, e: Entry, size: int, offset: int) -> bytes:
        size = max(0, min(size, e.filesize - offset))
        if not size:
            return b""
        fp, base = self.fat._PyFat__fp, self.fat._PyFat__fp_offset
        out = bytearray()
        for address, n in self._runs(self._chain(e.get_cluster()), offset, size):
            fp.seek(base + address)
            out += fp.read(n)
        return bytes(out)

    def _write(self, e: Entry, data: bytes, offset: int) -> int:
        if offset + len(data) > Entry.MAX_FILE_SIZE:
            raise _err(errno.EFBIG)
        if offset > e.filesize:
            self._write(e, b"\0" * (offset - e.filesize), e.filesize)
        chain = self._grow(e, math.ceil((offset + len(data)) / self.bpc),
                           self._chain(e.get_cluster()))
        done = 0
        for address, n in self._runs(chain, offset, len(data)):
            self.fat._write_data_to_address(data[done:done + n], address)
            done += n
        e.filesize = max(e.filesize, offset + len(data))
        self._touch(e)
        return len(data)

    def _truncate(self, e: Entry, length: int) -> None:
        if e.is_directory():
            raise _err(errno.EISDIR)
        if length > Entry.MAX_FILE_SIZE:
            raise _err(errno.EFBIG)
        if length > e.filesize:
            step = 1 << 20
            while e.filesize < length:
                self._write(e, b"\0" * min(step, length - e.filesize), e.filesize)
            return
        keep = math.ceil(length / self.bpc)
        chain = self._chain(e.get_cluster())
        if len(chain) > keep:
            self._free(chain[keep])
            if keep:
                self.fat.fat[chain[keep - 1]] = self.eoc
                del chain[keep:]
            else:
                self.chains.pop(e.get_cluster(), None)
                e.set_cluster(0)
        e.filesize = length
        self._touch(e)

    def _release_data(self, e: Entry) -> None:
        """Free an unlinked file's clusters, or leave that to its last close."""
        if self._is_open(e):
            self.orphans.add(id(e))
        else:
            self._free(e.get_cluster())

    # -- FUSE operations --------------------------------------------------------

    def init(self, path: str) -> None:
        print("ready", flush=True)

    def destroy(self, path: str) -> None:
        self._sync(to_disk=True)
        self.fat.close()

    def getattr(self, path: str, fh: int | None = None) -> dict[str, Any]:
        e = self.handles[fh] if fh else self._resolve(path)
        perm = PERM & ~(0o222 if e.attr & Entry.ATTR_READ_ONLY else 0)
        base = {"st_uid": self.uid, "st_gid": self.gid, "st_blksize": self.bpc}
        if e is self.root:
            return {**base, "st_mode": stat.S_IFDIR | PERM, "st_nlink": 2, "st_size": 0,
                    "st_mtime": 0, "st_atime": 0, "st_ctime": 0}
        mtime = int(_posix_time(e.wrtdate, e.wrttime) * 1e9)
        atime = int(_posix_time(e.lstaccessdate, 0) * 1e9)
        if e.is_directory():
            subdirs = len(e.get_entries()[0])
            return {**base, "st_mode": stat.S_IFDIR | perm, "st_nlink": 2 + subdirs,
                    "st_size": len(self._chain(e.get_cluster())) * self.bpc,
                    "st_mtime": mtime, "st_ctime": mtime, "st_atime": atime}
        return {**base, "st_mode": stat.S_IFREG | perm, "st_nlink": 1, "st_size": e.filesize,
                "st_blocks": len(self._chain(e.get_cluster())) * self.bpc // 512,
                "st_mtime": mtime, "st_ctime": mtime, "st_atime": atime}

    def readdir(self, path: str, fh: int) -> list[str]:
        d = self._resolve(path)
        if not d.is_directory():
            raise _err(errno.ENOTDIR)
        return [".", "..", *(_name_of(e) for e in self._children(d))]

    def statfs(self, path: str) -> dict[str, int]:
        total = self.clusters
        free = self.fat.fat[2:total + 2].count(0)
        return {"f_bsize": self.bpc, "f_frsize": self.bpc, "f_blocks": total, "f_bfree": free,
                "f_bavail": free, "f_files": 0, "f_ffree": 0, "f_namemax": 1530}

    def _handle(self, e: Entry) -> int:
        fh = self.next_fh
        self.next_fh += 1
        self.handles[fh] = e
        return fh

    def create(self, path: str, mode: int, fi: Any = None) -> int:
        d, name = self._parent(path)
        stored = self._check_name(name)
        e = self._find(d, stored)
        if e is not None:
            if e.is_directory():
                raise _err(errno.EISDIR)
            return self._handle(e)
        e = self._new_entry(d, stored, Entry.ATTR_ARCHIVE)
        self._attach(d, e)
        return self._handle(e)

    def open(self, path: str, flags: int) -> int:
        e = self._resolve(path)
        if e.is_directory():
            raise _err(errno.EISDIR)
        if flags & os.O_ACCMODE != os.O_RDONLY and e.attr & Entry.ATTR_READ_ONLY:
            raise _err(errno.EACCES)
        return self._handle(e)

    def read(self, path: str, size: int, offset: int, fh: int) -> bytes:
        return self._read(self.handles[fh], size, offset)

    def write(self, path: str, data: bytes, offset: int, fh: int) -> int:
        return self._write(self.handles[fh], data, offset)

    def truncate(self, path: str, length: int, fh: int | None = None) -> int:
        self._truncate(self.handles[fh] if fh else self._resolve(path), length)
        return 0

    def flush(self, path: str, fh: int) -> int:
        return 0

    def fsync(self, path: str, datasync: int, fh: int) -> int:
        self._sync()
        return 0

    def fsyncdir(self, path: str, datasync: int, fh: int) -> int:
        self._sync()
        return 0

    def release(self, path: str, fh: int) -> int:
        e = self.handles.pop(fh, None)
        if e is not None and id(e) in self.orphans and not self._is_open(e):
            self.orphans.discard(id(e))
            self._free(e.get_cluster())
        self._sync()
        return 0

    def unlink(self, path: str) -> int:
        e = self._resolve(path)
        if e.is_directory():
            raise _err(errno.EISDIR)
        self._detach(e)
        self._release_data(e)
        return 0

    def mkdir(self, path: str, mode: int) -> int:
        d, name = self._parent(path)
        stored = self._check_name(name)
        if self._find(d, stored) is not None:
            raise _err(errno.EEXIST)
        cluster = self._allocate(1)[0]
        self.fat._write_data_to_address(b"\0" * self.bpc, self.fat.get_data_cluster_address(cluster))
        e = self._new_entry(d, stored, Entry.ATTR_DIRECTORY, cluster)
        for special, target in ((b".          ", cluster),
                                (b"..         ", 0 if d is self.root else d.get_cluster())):
            sn = EightDotThree()
            sn.set_byte_name(special)
            dot = Entry.new(name=sn, tz=None, encoding=sn.encoding,
                            attr=Entry.ATTR_DIRECTORY, cluster=target)
            dot.wrtdate, dot.wrttime, dot.crtdate, dot.crttime = (e.wrtdate, e.wrttime,
                                                                   e.crtdate, e.crttime)
            e.add_subdirectory(dot)
        self._mark(e)
        self._attach(d, e)
        return 0

    def rmdir(self, path: str) -> int:
        e = self._resolve(path)
        if e is self.root:
            raise _err(errno.EBUSY)
        if not e.is_directory():
            raise _err(errno.ENOTDIR)
        if self._children(e):
            raise _err(errno.ENOTEMPTY)
        self._detach(e)
        self.dirty_dirs.pop(id(e), None)
        self._free(e.get_cluster())
        return 0

    def rename(self, old: str, new: str) -> int:
        src = self._resolve(old)
        if src is self.root:
            raise _err(errno.EBUSY)
        d, name = self._parent(new)
        stored = self._check_name(name)
        if src.is_directory():
            up: Entry | None = d
            while up is not None:  # a folder into itself or below it
                if up is src:
                    raise _err(errno.EINVAL)
                up = up._parent
        dst = self._find(d, stored)
        if dst is src:
            if _name_of(src) == stored:
                return 0
            dst = None  # the same entry under another case: renamed in place
        if dst is not None:
            if src.is_directory() and not dst.is_directory():
                raise _err(errno.ENOTDIR)
            if not src.is_directory() and dst.is_directory():
                raise _err(errno.EISDIR)
            if dst.is_directory() and self._children(dst):
                raise _err(errno.ENOTEMPTY)
            self._detach(dst)
            if dst.is_directory():
                self.dirty_dirs.pop(id(dst), None)
                self._free(dst.get_cluster())
            else:
                self._release_data(dst)
        old_parent = self._detach(src)
        short = EightDotThree()
        short.set_str_name(_short_name(stored, self._short_names(d)))
        self._set_name(src, stored, short)
        self._attach(d, src)
        if src.is_directory() and old_parent is not d:
            for e in src._get_entries_raw():
                if bytes(e.name) == b"..         ":
                    e.set_cluster(0 if d is self.root else d.get_cluster())
            self._mark(src)
        return 0

    def utimens(self, path: str, times: tuple[int, int] | None = None) -> int:
        e = self._resolve(path)
        if e is self.root:
            return 0
        now = time.time_ns()
        atime, mtime = times if times is not None else (now, now)
        e.wrtdate, e.wrttime = _dos_time(mtime / 1e9)
        e.lstaccessdate = _dos_time(atime / 1e9)[0]
        self._mark(e.get_parent_dir())
        return 0

    def chmod(self, path: str, mode: int) -> int:
        e = self._resolve(path)
        if mode & ~(stat.S_IFMT(mode) | 0o777):
            raise _err(errno.EPERM)  # set-id and sticky bits: not FAT_VALID_MODE
        perm = mode & PERM
        # vfat's fat_sanitize_mode: the r and x bits cannot change and the w bits
        # are all or none; anything else is ignored without an error.
        if e is self.root or (perm & 0o555) != (PERM & 0o555):
            return 0
        if e.is_directory():
            return 0  # a folder cannot hold the read-only attribute (no rodir)
        if perm & 0o222:
            e.attr &= ~Entry.ATTR_READ_ONLY
        else:
            e.attr |= Entry.ATTR_READ_ONLY
        self._mark(e.get_parent_dir())
        return 0

    def chown(self, path: str, uid: int, gid: int) -> int:
        self._resolve(path)
        if uid not in (-1, 0xFFFFFFFF, self.uid) or gid not in (-1, 0xFFFFFFFF, self.gid):
            raise _err(errno.EPERM)
        return 0

    def symlink(self, target: str, source: str) -> int:
        raise _err(errno.EPERM)

    def link(self, target: str, source: str) -> int:
        raise _err(errno.EPERM)

    def mknod(self, path: str, mode: int, dev: int) -> int:
        raise _err(errno.EPERM)

    def readlink(self, path: str) -> str:
        raise _err(errno.EINVAL)


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m tests.servers.fatfuse IMAGE MOUNTPOINT", file=sys.stderr)
        return 2
    image, mountpoint = argv
    mfusepy.FUSE(FatFuse(image), mountpoint, foreground=True, nothreads=True,
                 hard_remove=True, big_writes=True, fsname=os.path.abspath(image), subtype="fatfuse")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
