"""The ``dir:`` backend: a folder on a local disk, USB stick or mounted share.

``dir:/srv/store`` with namespace ``ns`` keeps everything under ``/srv/store/ns/``;
a key ``a/b`` is the file ``/srv/store/ns/a/b``. The location folder is never
created by metasync (only the namespace folder inside it, by :meth:`create`), so
an unmounted disk shows up as :class:`BackendUnavailable` instead of a fresh,
empty folder silently filling the wrong disk.

Crash safety relies on three guarantees of the filesystem:

- ``rename`` over an existing file is atomic (``put``);
- an exclusive publish -- ``link()``, or a no-replace rename where there are no hard
  links (exFAT, FAT) -- fails if the name exists and gives a complete file its name
  in one step (``put_if_absent`` and log appends; :mod:`.publish`). Which one a
  folder honours is probed once per backend instance, at its first exclusive write
  (so every command, and a disk mounted anew at the same path, is probed again). On
  a filesystem with neither, a new namespace folder is marked for Disk Paxos register
  logs (:data:`REGISTERS_MARKER`), which need no exclusive publish; a folder holding
  entry-file logs there is refused with one line naming the filesystem
  (:class:`PrimitiveMissing`);
- after ``fsync`` of a file and of its folder, both survive power loss.

Every write first goes to a temporary ``.tmp-<random>`` file in the destination
folder; a writer that crashes leaves one behind, which is never listed nor read
as a log entry. Names starting with ``.tmp-`` are therefore reserved: keys
containing such a part are rejected with :class:`InvalidKey`.
"""

from __future__ import annotations

import builtins
import errno
import os
import secrets
import stat
import threading
from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import Any, BinaryIO, overload

from metasync.backends import register
from metasync.backends.base import (
    TEMP_PREFIX,
    Backend,
    Capabilities,
    TempFile,
    check_key,
    check_namespace,
    check_prefix,
    is_key_part,
    temp_path_parts,
)
from metasync.backends.dirfeed import dir_feed, watchable
from metasync.backends.feeds import ChangeFeed
from metasync.backends.logs import LogStore, RegisterLogs, entry_name, entry_position
from metasync.backends.publish import (
    NAMES,
    UNSUPPORTED,
    describe_filesystem,
    is_fuse,
    probe_publish,
    publish,
)
from metasync.errors import (
    BackendError,
    BackendFull,
    BackendUnavailable,
    InvalidKey,
    ObjectNotFound,
    PrimitiveMissing,
    UsageError,
)

#: Streams are copied in pieces of this size, so memory use does not grow with the object.
CHUNK_SIZE = 1 << 20

def _errnos(*names: str) -> frozenset[int]:
    # Not every platform defines every errno; take the ones that exist.
    return frozenset(getattr(errno, n) for n in names if hasattr(errno, n))


# The filesystem itself is gone (dead network mount, FUSE daemon exited).
_UNREACHABLE = _errnos("ENOTCONN", "ESTALE", "ENODEV", "ENXIO", "EHOSTDOWN", "EHOSTUNREACH")
#: Out of space or over a quota: :class:`BackendFull`.
_FULL = _errnos("ENOSPC", "EDQUOT")
# A retry may well succeed.
_TRANSIENT = _errnos("EAGAIN", "EBUSY", "EINTR", "ETIMEDOUT", "EIO")
# fsync on a folder is not supported everywhere; durability is then best effort.
_FSYNC_DIR_UNSUPPORTED = _errnos("EINVAL", "ENOTSUP", "EOPNOTSUPP", "EBADF", "EACCES", "EPERM")


def _fsync_dir(path: str) -> None:
    """Make the folder's entries (creates, renames, links, unlinks) durable."""
    if os.name == "nt":  # Windows cannot open a folder as a file; NTFS journals metadata.
        return
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in _FSYNC_DIR_UNSUPPORTED:
            raise
    finally:
        os.close(fd)


def _unlink_quietly(path: str) -> None:
    # Cleanup of our own temporary file; a failure here must not hide the real outcome.
    try:
        os.unlink(path)
    except OSError:
        pass


def _write_all(fd: int, data: bytes | bytearray | memoryview) -> None:
    # os.write may write less than asked (signals, pipes, some FUSE filesystems).
    view = memoryview(data).cast("B")
    while view:
        written = os.write(fd, view)
        view = view[written:]


#: A ``dir:`` folder whose logs are entry files published exclusively (a filesystem
#: with hard links or a no-replace rename): what the class declares.
ENTRY_CAPABILITIES = Capabilities(
    local=True,
    conditional_create=True,
    compare_and_swap=False,
    conditional_append=True,
    range_reads=True,
    max_object_size=None,
    case_sensitive=True,
    long_poll=False,
    change_feed="notify",
    temp_files=True,
)
#: A ``dir:`` folder whose logs are Disk Paxos registers (:data:`REGISTERS_MARKER`): a
#: filesystem with neither primitive, so creates are not exclusive (``put_if_absent``
#: checks, then renames) and ``append_at`` is RegisterLogs' own (which never replaces
#: a file). An instance also declares ``case_sensitive`` and ``atomic_replace`` False
#: where its filesystem ignores case or is a FUSE one (:meth:`declared_capabilities`).
REGISTER_CAPABILITIES = replace(ENTRY_CAPABILITIES, conditional_create=False)
#: The file in a namespace folder saying that its logs are Disk Paxos registers
#: (docs/FORMAT.md), written by ``create`` on a filesystem without an exclusive
#: publish. ``=`` is no key character, so it is never listed nor taken by a key.
REGISTERS_MARKER = "logs=registers"
#: The repository format version that introduced :data:`REGISTERS_MARKER`.
REGISTER_LOGS_FORMAT = 5


class _Declared:
    """The ``capabilities`` attribute of :class:`LocalBackend`: the class's
    declaration read on the class (the conformance suite selects tests by it), the
    folder's (:meth:`LocalBackend.declared_capabilities`) read on an instance."""

    @overload
    def __get__(self, obj: None, owner: Any) -> Capabilities: ...
    @overload
    def __get__(self, obj: LocalBackend, owner: Any) -> Capabilities: ...

    def __get__(self, obj: LocalBackend | None, owner: Any) -> Capabilities:
        return ENTRY_CAPABILITIES if obj is None else obj.declared_capabilities()


@register
class LocalBackend(Backend):
    """A folder on a filesystem, URI ``dir:/absolute/path``.

    ``case_sensitive`` is declared True, which holds on the usual Linux filesystems;
    on case-insensitive ones (macOS APFS/HFS+ by default, Windows, FAT) keys that
    differ only in case name the same file.
    """

    scheme = "dir"
    location_needs_mkdir = True
    #: What the backend declares: :data:`ENTRY_CAPABILITIES` on the class, and on an
    #: instance what its folder gives (:meth:`declared_capabilities`).
    capabilities = _Declared()

    def __init__(self, uri: str, namespace: str) -> None:
        """Bind to ``<path>/<namespace>/``. Touches nothing on disk.

        Raises :class:`UsageError` for a relative path or an invalid namespace.
        """
        super().__init__(uri, namespace)
        path = uri[len("dir:") :] if uri.startswith("dir:") else uri
        # A relative path would depend on the current folder of whichever client
        # runs, and the URI is stored in the shared configuration.
        if not path or not os.path.isabs(path):
            raise UsageError(f"backend path must be absolute: {path!r}; use dir:/absolute/path")
        check_namespace(namespace)
        #: The folder named in the URI; it must exist before :meth:`create`.
        self.location: str = os.path.normpath(path)
        #: The namespace folder holding every key.
        self.root: str = os.path.join(self.location, *namespace.split("/"))
        # The exclusive publish the folder honours: probed at first use (publish_method).
        self._method: str | None = None
        self._method_lock = threading.Lock()
        # Whether the folder's logs are registers (REGISTERS_MARKER), and whether
        # its filesystem ignores case: read at first need (declared_capabilities).
        self._registers: bool | None = None
        self._case_sensitive: bool | None = None
        self._fuse: bool | None = None
        # Whether the kernel sees every write to it (not a network filesystem).
        self._watchable: bool | None = None

    # --- helpers -------------------------------------------------------------------
    def _key(self, key: str) -> str:
        """Validate ``key``: :func:`check_key` plus this backend's reserved temp names."""
        check_key(key)
        self._check_reserved(key)
        return key

    def _check_reserved(self, key: str) -> None:
        if any(part.startswith(TEMP_PREFIX) for part in key.split("/")):
            raise InvalidKey(
                f"invalid backend key {key!r}: names starting with {TEMP_PREFIX!r} are reserved"
            )

    def _path(self, key: str) -> str:
        return os.path.join(self.root, *key.split("/"))

    def _unavailable(self, exc: OSError | None = None) -> BackendUnavailable:
        detail = f" ({exc.strerror})" if exc is not None and exc.strerror else ""
        return BackendUnavailable(
            f"backend folder {self.root} is missing or unreachable{detail}; "
            "is the disk mounted, or was the folder deleted?"
        )

    def _require_root(self) -> None:
        """Raise :class:`BackendUnavailable` unless the namespace folder exists.

        Checked before every operation: a deleted or unmounted folder must never be
        mistaken for an empty repository, nor recreated by a write.
        """
        try:
            st = os.stat(self.root)
        except OSError as exc:
            raise self._unavailable(exc) from exc
        if not stat.S_ISDIR(st.st_mode):
            raise BackendUnavailable(f"backend folder {self.root} is not a folder")

    def _error(self, exc: OSError, key: str, action: str, *, not_found: bool) -> BackendError:
        """Translate ``exc`` from an operation on ``key`` into the backend error contract.

        ``not_found``: a missing path means the key is missing (reads). Otherwise a
        missing path is a plain failure (e.g. a folder removed under a write).
        """
        if exc.errno in _UNREACHABLE or not os.path.isdir(self.root):
            return self._unavailable(exc)
        if exc.errno in _FULL:
            return BackendFull.of(self.name, exc.strerror or str(exc))
        if not_found and isinstance(
            exc, FileNotFoundError | NotADirectoryError | IsADirectoryError
        ):
            return ObjectNotFound(f"no object {key!r} on {self.name}")
        hint = ""
        if isinstance(exc, NotADirectoryError | FileExistsError | IsADirectoryError):
            hint = "; a key cannot be both an object and a folder of other keys"
        return BackendError(
            f"cannot {action} {key!r} on {self.name}: {exc.strerror or exc}{hint}",
            transient=exc.errno in _TRANSIENT,
        )

    def _make_dirs(self, parts: Sequence[str]) -> None:
        """Create ``root/parts[0]/parts[1]/...`` as needed, never ``root`` itself.

        One ``mkdir`` per level (rather than ``os.makedirs``) so that a vanished
        namespace folder fails instead of being recreated.
        """
        parent = self.root
        for part in parts:
            path = os.path.join(parent, part)
            try:
                os.mkdir(path)
            except FileExistsError:
                pass
            else:
                _fsync_dir(parent)  # the new folder's name must survive a crash too
            parent = path

    def _write_temp(self, folder: str, key: str, data: bytes | BinaryIO) -> str:
        """Write ``data`` to a new fsynced temp file in ``folder``; return its path.

        Errors of the filesystem become :class:`BackendError`; errors raised by the
        caller's stream propagate unchanged. The temp file is removed on failure.
        """
        while True:
            tmp = os.path.join(folder, TEMP_PREFIX + secrets.token_hex(8))
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0)
            try:
                fd = os.open(tmp, flags | getattr(os, "O_CLOEXEC", 0), 0o666)
                break
            except FileExistsError:
                continue  # 64 random bits collided; pick another name
            except OSError as exc:
                raise self._error(exc, key, "write", not_found=False) from exc
        complete = False
        try:
            if isinstance(data, bytes | bytearray | memoryview):
                self._write_chunk(fd, key, data)
            else:
                while True:
                    chunk = data.read(CHUNK_SIZE)
                    if not chunk:
                        break
                    self._write_chunk(fd, key, chunk)
            try:
                os.fsync(fd)
            except OSError as exc:
                raise self._error(exc, key, "write", not_found=False) from exc
            complete = True
        finally:
            os.close(fd)
            if not complete:
                _unlink_quietly(tmp)
        return tmp

    def _write_chunk(self, fd: int, key: str, chunk: bytes | bytearray | memoryview) -> None:
        try:
            _write_all(fd, chunk)
        except OSError as exc:
            raise self._error(exc, key, "write", not_found=False) from exc

    def _create_exclusive(self, key: str, data: bytes, folder: str, name: str) -> bool:
        """Publish ``data`` as ``folder/name`` if absent: complete or not at all.
        Exclusive, except in a folder whose logs are registers (no primitive there):
        then a check and a rename (``conditional_create`` is declared False)."""
        tmp = self._write_temp(folder, key, data)
        target = os.path.join(folder, name)
        try:
            if self.uses_registers():
                if os.path.lexists(target):
                    return False
                os.replace(tmp, target)
                return True
            return self.publish(tmp, target, key, "create")
        except OSError as exc:
            raise self._error(exc, key, "create", not_found=False) from exc
        finally:
            _unlink_quietly(tmp)

    def publish_method(self) -> str:
        """The exclusive publish (:data:`~.publish.LINK` or :data:`~.publish.RENAME`)
        this backend's folder honours, probed (:func:`~.publish.probe_publish`) at
        the first call on this instance. Raises :class:`PrimitiveMissing`, one line
        naming the filesystem and what it lacks, if it honours neither."""
        with self._method_lock:
            if self._method is None:
                self._require_root()
                try:
                    method = probe_publish(
                        self.root, lambda data: self._write_temp(self.root, "probe", data))
                except OSError as exc:
                    raise self._error(exc, "probe", "write", not_found=False) from exc
                if method is None:
                    raise PrimitiveMissing(self.lacks_publish_message())
                self._method = method
            return self._method

    def lacks_publish_message(self) -> str:
        """The one line for a folder whose filesystem has no exclusive publish."""
        return (
            f"{self.name} cannot hold metasync's logs: {describe_filesystem(self.location)} "
            "has neither hard links nor a no-replace rename, one of which the dir: backend "
            "needs to give a file its name only if the name is free; use a folder on "
            "another filesystem (ext4, NTFS, APFS), or mount this disk with the kernel's "
            "own exfat or vfat driver rather than a FUSE one"
        )

    def publish(self, tmp: str, target: str, key: str, action: str) -> bool:
        """Give the complete temp file ``tmp`` the name ``target`` unless it exists; True
        if this call did. ``tmp`` may remain (the caller removes it). A primitive that
        held when probed and is refused now means another disk is mounted at the path
        meanwhile: the folder is probed again, once. Errors follow the backend contract
        (``key`` and ``action`` name the operation in them)."""
        try:
            for again in (False, True):
                method = self.publish_method()
                try:
                    return publish(method, tmp, target)
                except OSError as exc:
                    if exc.errno not in UNSUPPORTED or again:
                        raise
                    with self._method_lock:
                        self._method = None
        except OSError as exc:
            raise self._error(exc, key, action, not_found=False) from exc
        raise AssertionError("unreachable")

    # --- lifecycle -----------------------------------------------------------------
    def exists(self) -> bool:
        """True if the namespace folder exists."""
        return os.path.isdir(self.root)

    def create(self) -> None:
        """Create the namespace folder (idempotent) inside the existing location folder,
        and probe its exclusive publish (:meth:`publish_method`).

        Raises :class:`PrimitiveMissing` if the filesystem has none. Raises :class:`BackendUnavailable` naming the location if it does not exist:
        creating it could silently write onto the wrong disk when a drive is unmounted.
        """
        self.probe()
        self._create_namespace(self.location)
        # Choose the logs now, before anything of a repository is written (init,
        # backend add): entry files where the filesystem has an exclusive publish,
        # else registers for a new folder.
        self._choose_logs()

    def create_location(self) -> None:
        """Create the location folder and its parents (``--mkdir``)."""
        try:
            os.makedirs(self.location, exist_ok=True)
        except OSError as exc:
            raise BackendUnavailable(
                f"cannot create backend location {self.location} ({exc.strerror})"
            ) from exc

    def probe(self) -> None:
        """Raise :class:`BackendUnavailable` unless the location folder exists."""
        try:
            st = os.stat(self.location)
        except FileNotFoundError as exc:
            raise BackendUnavailable(
                f"backend location {self.location} does not exist (an unmounted disk?); "
                "create that folder first, or give --mkdir to create it"
            ) from exc
        except OSError as exc:
            raise BackendUnavailable(
                f"backend location {self.location} cannot be reached ({exc.strerror})"
            ) from exc
        if not stat.S_ISDIR(st.st_mode):
            raise BackendUnavailable(f"backend location {self.location} is not a folder")

    def _create_namespace(self, parent: str) -> None:
        for part in self.namespace.split("/"):
            path = os.path.join(parent, part)
            try:
                os.mkdir(path)
                _fsync_dir(parent)
            except FileExistsError:
                pass
            except FileNotFoundError as exc:
                raise BackendUnavailable(
                    f"backend location {self.location} vanished while creating {self.root}"
                ) from exc
            except OSError as exc:
                raise BackendError(f"cannot create {path}: {exc.strerror or exc}") from exc
            parent = path
        if not os.path.isdir(self.root):
            raise BackendError(f"cannot create {self.root}: a file of that name is in the way")

    # --- storage -------------------------------------------------------------------
    def _parent_folder(self, key: str) -> tuple[str, str]:
        """Validate ``key``, create its parent folders; return (folder, file name)."""
        self._key(key)
        self._require_root()
        parts = key.split("/")
        try:
            self._make_dirs(parts[:-1])
        except OSError as exc:
            raise self._error(exc, key, "write", not_found=False) from exc
        return os.path.join(self.root, *parts[:-1]), parts[-1]

    def put(self, key: str, data: bytes | BinaryIO) -> None:
        """Store ``data`` at ``key`` atomically (temp file, fsync, rename, fsync folder).

        Readers see the previous object or the complete new one. A file-like ``data``
        is copied in :data:`CHUNK_SIZE` pieces. Missing parent folders are created.
        """
        folder, _ = self._parent_folder(key)
        tmp = self._write_temp(folder, key, data)
        try:
            os.replace(tmp, self._path(key))
            _fsync_dir(folder)
        except OSError as exc:
            _unlink_quietly(tmp)
            raise self._error(exc, key, "write", not_found=False) from exc

    def put_if_absent(self, key: str, data: bytes) -> bool:
        """Create ``key`` holding ``data`` unless it exists; True if this call created it.

        Atomic among concurrent processes (an exclusive publish of a complete temp
        file: :meth:`publish`), and a reader never sees the object partially written.
        """
        folder, name = self._parent_folder(key)
        try:
            created = self._create_exclusive(key, data, folder, name)
            if created:
                _fsync_dir(folder)
        except OSError as exc:
            raise self._error(exc, key, "create", not_found=False) from exc
        return created

    def get(self, key: str) -> bytes:
        """The whole object at ``key``; :class:`ObjectNotFound` if absent."""
        self._key(key)
        self._require_root()
        try:
            with open(self._path(key), "rb") as f:
                return f.read()
        except OSError as exc:
            raise self._error(exc, key, "read", not_found=True) from exc

    def open(self, key: str) -> BinaryIO:
        """An open binary file of the object at ``key``; the caller closes it.

        The file stays readable (and unchanged) even if ``key`` is overwritten or
        deleted meanwhile, because writes replace the file rather than modify it.
        """
        self._key(key)
        self._require_root()
        try:
            return open(self._path(key), "rb")
        except OSError as exc:
            raise self._error(exc, key, "read", not_found=True) from exc

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        """``length`` bytes at ``offset`` of ``key``.

        Raises :class:`BackendError` if the object is shorter than ``offset + length``
        and :class:`ValueError` for a negative ``offset`` or ``length``.
        """
        if offset < 0 or length < 0:
            raise ValueError(f"get_range needs offset >= 0 and length >= 0, got {offset}, {length}")
        self._key(key)
        self._require_root()
        try:
            with open(self._path(key), "rb") as f:
                size = os.fstat(f.fileno()).st_size
                f.seek(offset)
                data = f.read(length) if size >= offset + length else b""
        except OSError as exc:
            raise self._error(exc, key, "read", not_found=True) from exc
        # Check the size too: a zero-length range past the end is out of bounds as well.
        if size < offset + length or len(data) != length:
            raise self.truncated_error(key, offset + length, size)
        return data

    def size(self, key: str) -> int:
        """Size of the object at ``key`` in bytes; :class:`ObjectNotFound` if absent."""
        self._key(key)
        self._require_root()
        try:
            st = os.stat(self._path(key))
        except OSError as exc:
            raise self._error(exc, key, "stat", not_found=True) from exc
        if not stat.S_ISREG(st.st_mode):  # a folder of other keys is not an object
            raise ObjectNotFound(f"no object {key!r} on {self.name}")
        return st.st_size

    def delete(self, key: str) -> None:
        """Remove ``key``; :class:`ObjectNotFound` if absent.

        Emptied folders are left in place: removing them would race with a
        concurrent ``put`` that has just created them for a new key.
        """
        self._key(key)
        self._require_root()
        path = self._path(key)
        try:
            # unlink() of a folder fails differently per OS (EISDIR, EPERM); check first.
            if stat.S_ISDIR(os.lstat(path).st_mode):
                raise ObjectNotFound(f"no object {key!r} on {self.name}")
            os.unlink(path)
            _fsync_dir(os.path.dirname(path))
        except OSError as exc:
            raise self._error(exc, key, "delete", not_found=True) from exc

    def _temp_files(self) -> Iterator[TempFile]:
        """Every ``.tmp-`` file under the namespace folder (symlinks not followed)."""
        self._require_root()
        found = []
        try:
            for folder, dirs, files in os.walk(self.root):
                dirs[:] = [d for d in dirs if not d.startswith(TEMP_PREFIX)]
                for name in files:
                    if not name.startswith(TEMP_PREFIX):
                        continue
                    path = os.path.join(folder, name)
                    try:
                        st = os.lstat(path)
                    except FileNotFoundError:
                        continue  # its writer published or removed it meanwhile
                    if stat.S_ISREG(st.st_mode):
                        rel = os.path.relpath(path, self.root).replace(os.sep, "/")
                        found.append(TempFile(rel, st.st_size, st.st_mtime))
        except OSError as exc:
            raise self._error(exc, "", "list temporary files", not_found=False) from exc
        return iter(found)

    def _remove_temp(self, path: str) -> bool:
        parts = temp_path_parts(path)
        full = os.path.join(self.root, *parts)
        try:
            os.unlink(full)
        except FileNotFoundError:
            return False
        except OSError as exc:
            raise self._error(exc, path, "delete temporary file", not_found=False) from exc
        _fsync_dir(os.path.dirname(full))
        return True

    def list(self, prefix: str = "") -> Iterator[str]:
        """Yield every key under the folder ``prefix`` (``""``: all keys), recursively.

        Temp files and names that are not valid key parts (stray files put there by
        hand) are skipped. A missing prefix folder yields nothing. The namespace
        folder is checked when ``list`` is called, not when iteration starts.
        """
        return (key for key, _ in self._listing(prefix, sizes=False))

    def list_sizes(self, prefix: str = "") -> Iterator[tuple[str, int]]:
        return self._listing(prefix, sizes=True)

    def _listing(self, prefix: str, sizes: bool) -> Iterator[tuple[str, int]]:
        prefix = check_prefix(prefix)
        if prefix:
            self._check_reserved(prefix)
        self._require_root()
        return self._walk(prefix, sizes)

    def _walk(self, prefix: str, sizes: bool) -> Iterator[tuple[str, int]]:
        """``(key, size)`` under ``prefix``; without ``sizes`` the size is -1 and a
        file is named as each folder's read found it: one removed before its type
        could be checked is still named. A listing is then one moment of each
        folder, as register logs need (a decided attempt creates the entry, then
        removes its blocks: a listing that took the names before the entry existed
        and dropped the blocks it could no longer stat showed neither, and another
        attempt decided a second value). Sizes need a stat, so ``list_sizes``
        leaves such a file out."""
        stack = [(self._path(prefix) if prefix else self.root, prefix)]
        while stack:
            folder, rel = stack.pop()
            try:
                with os.scandir(folder) as it:
                    entries = list(it)
            except (FileNotFoundError, NotADirectoryError) as exc:
                # The prefix names no folder (or a folder vanished mid-listing): no keys.
                if not os.path.isdir(self.root):
                    raise self._unavailable(exc) from exc
                continue
            except OSError as exc:
                raise self._error(exc, rel, "list", not_found=False) from exc
            for entry in entries:
                if not is_key_part(entry.name):
                    continue
                key = f"{rel}/{entry.name}" if rel else entry.name
                try:
                    # Not following folder symlinks keeps a symlink loop from hanging us.
                    if entry.is_dir(follow_symlinks=False):
                        stack.append((entry.path, key))
                        continue
                    if entry.is_file():
                        size = entry.stat().st_size if sizes else -1
                    elif sizes or os.path.lexists(entry.path):
                        continue  # not a regular file (or no size to give)
                    else:
                        # is_dir and is_file say False for a name removed since the
                        # folder was read (where the read gave no type, they stat it).
                        size = -1
                except OSError:
                    continue  # removed while we were listing, and a size was asked
                yield key, size

    def poll(self, key: str) -> str | None:
        """A token of (mtime_ns, size, inode), or None if ``key`` does not exist.

        ``put`` always installs a new inode, so the token changes on every overwrite
        even when size and timestamp (coarse on some filesystems) stay equal.
        """
        self._key(key)
        self._require_root()
        try:
            st = os.stat(self._path(key))
        except (FileNotFoundError, NotADirectoryError) as exc:
            if not os.path.isdir(self.root):
                raise self._unavailable(exc) from exc
            return None
        except OSError as exc:
            raise self._error(exc, key, "poll", not_found=False) from exc
        if not stat.S_ISREG(st.st_mode):
            return None
        return f"{st.st_mtime_ns}:{st.st_size}:{st.st_ino}"

    def change_feed(self, watch_key: str | None = None) -> ChangeFeed | None:
        """Watches the namespace folder and its log folder (:mod:`.dirfeed`); polls
        ``watch_key`` where the kernel cannot see other machines' writes."""
        self._require_root()
        return dir_feed(self, self.root, watch_key)

    # --- logs ----------------------------------------------------------------------
    def specific_logs(self) -> LogStore:
        """Logs as folders of exclusively published entry files (:class:`LocalLogs`),
        or Disk Paxos registers in a folder marked so: :class:`DirLogs` decides at
        the first use."""
        return DirLogs(self)

    # --- which logs: entries or registers ---------------------------------------------
    def format_needed(self) -> int:
        """Format 5 for a folder of register logs: older clients would read its logs as
        entry files and find none (docs/FORMAT.md, §11.1)."""
        return REGISTER_LOGS_FORMAT if self.uses_registers() else 0

    def uses_registers(self) -> bool:
        """Whether this folder's logs are Disk Paxos registers: its namespace folder
        holds :data:`REGISTERS_MARKER`. Read once per instance, and remembered only
        when it could be read: a missing namespace folder answers False, not
        remembered (its operations then fail as unreachable); a marker that cannot
        be read (an I/O error, a dead mount) raises the backend's one-line
        :class:`BackendError`, not remembered either."""
        if self._registers is None:
            try:
                st = os.stat(os.path.join(self.root, REGISTERS_MARKER))
            except FileNotFoundError:
                if not os.path.isdir(self.root):
                    return False
                marked = False
            except OSError as exc:
                # Not "absent": guessing entry logs here would write entry files into
                # a folder of registers, which no other client reads.
                raise self._error(exc, REGISTERS_MARKER, "read", not_found=False) from exc
            else:
                marked = stat.S_ISREG(st.st_mode)
            self._registers = marked
        return self._registers

    def declared_capabilities(self) -> Capabilities:
        """What this folder gives: :data:`REGISTER_CAPABILITIES` where its logs are
        registers, else :data:`ENTRY_CAPABILITIES`; ``atomic_replace`` False on a FUSE
        filesystem (:func:`~.publish.is_fuse`); ``case_sensitive`` False where the
        filesystem ignores case (the namespace folder is found under another case
        that its parent does not list; asked once)."""
        try:
            registers = self.uses_registers()
        except BackendError:
            # Unreadable now: its operations fail on their own. A declaration must not
            # raise (a consensus reads every acceptor's, one of them may be down).
            registers = False
        capabilities = REGISTER_CAPABILITIES if registers else ENTRY_CAPABILITIES
        if self._case_sensitive is None and os.path.isdir(self.root):
            swapped = self.namespace.swapcase()
            if swapped == self.namespace:
                self._case_sensitive = True  # no letter to tell by: as declared
            else:
                parent = os.path.dirname(self.root)
                try:
                    # Found under the swapped case though no entry is named so: the
                    # filesystem ignores case. (Inode numbers cannot tell: FUSE
                    # drivers give each spelling its own.)
                    os.stat(os.path.join(parent, os.path.basename(swapped)))
                    self._case_sensitive = os.path.basename(swapped) in os.listdir(parent)
                except FileNotFoundError:
                    self._case_sensitive = True
                except OSError:
                    pass  # unreachable now: left unknown, asked again later
        if self._case_sensitive is False:
            capabilities = replace(capabilities, case_sensitive=False)
        if self._fuse is None:
            self._fuse = is_fuse(self.location)
        if self._fuse:
            capabilities = replace(capabilities, atomic_replace=False)
        if self._watchable is None:
            self._watchable = watchable(self.location)
        if not self._watchable:
            capabilities = replace(capabilities, change_feed="poll")
        return capabilities

    def _choose_logs(self) -> None:
        """At ``create``: an exclusive publish if the filesystem has one, else mark a
        new, empty namespace folder for register logs. A folder that already holds a
        repository with entry logs is refused instead (:class:`PrimitiveMissing`):
        its entries must stay readable as they are."""
        if self.uses_registers():
            return
        try:
            self.publish_method()
            return
        except PrimitiveMissing:
            try:
                names = os.listdir(self.root)
            except OSError as exc:
                raise self._error(exc, REGISTERS_MARKER, "write", not_found=False) from exc
            if any(not name.startswith(TEMP_PREFIX) for name in names):
                raise
        tmp = self._write_temp(self.root, REGISTERS_MARKER, b"registers\n")
        try:
            os.replace(tmp, os.path.join(self.root, REGISTERS_MARKER))
            _fsync_dir(self.root)
        except OSError as exc:
            _unlink_quietly(tmp)
            raise self._error(exc, REGISTERS_MARKER, "write", not_found=False) from exc
        self._registers = True


class DirLogs(LogStore):
    """The logs of a ``dir:`` folder: :class:`LocalLogs` (entry files), or
    :class:`~metasync.backends.logs.RegisterLogs` where the folder is marked for
    registers (:meth:`LocalBackend.uses_registers`), chosen at the first call."""

    def __init__(self, backend: LocalBackend) -> None:
        self.backend = backend
        self._store: LogStore | None = None
        self._lock = threading.Lock()

    def store(self) -> LogStore:
        """The construction in use, decided once: at the first call that finds the
        namespace folder and reads whether it is marked. Until then each call raises
        :class:`BackendUnavailable` (or the marker's read error) and remembers
        nothing, so a stick unplugged at the first call is asked again."""
        with self._lock:
            if self._store is None:
                backend = self.backend
                backend._require_root()
                registers = backend.uses_registers()
                if backend._registers is None:  # the folder vanished since: not decided
                    raise backend._unavailable()
                self._store = RegisterLogs(backend) if registers else LocalLogs(backend)
            return self._store

    @property
    def primitive(self) -> str:
        return self.store().primitive

    def append(self, log: str, message: bytes) -> int:
        return self.store().append(log, message)

    def append_at(self, log: str, position: int, message: bytes) -> bool:
        return self.store().append_at(log, position, message)

    def fetch(self, log: str, start: int = 0) -> builtins.list[tuple[int, bytes]]:
        return self.store().fetch(log, start)

    def delete_log(self, log: str) -> int:
        return self.store().delete_log(log)


class LocalLogs(LogStore):
    """The logs of a ``dir:`` backend: log ``L`` is the folder ``L/`` and entry *p*
    the file ``L/<p:010d>``, published complete by an exclusive ``link()`` or a
    no-replace rename, whichever the filesystem has (docs/FORMAT.md §11.1; the same
    file either way). Entries are read from disk on every fetch (no cache:
    a local read costs little)."""

    def __init__(self, backend: LocalBackend) -> None:
        #: The backend whose folder holds the logs.
        self.backend = backend

    @property
    def primitive(self) -> str:
        """The exclusive publish in use (once probed), for messages and records."""
        method = self.backend._method
        return NAMES[method] if method else "an exclusive hard link or a no-replace rename"

    def append(self, log: str, message: bytes) -> int:
        """Append ``message`` to the log folder ``log/``; return its position.

        Entry ``n`` is the file ``log/%010d``. The message is written once to a temp
        file, then linked under the first free position after the highest existing
        one; if another process takes that position first (``EEXIST``) the next one
        is tried. Entries are only ever created complete, never modified or deleted,
        and a position is only taken when the one before it exists, so positions
        stay contiguous and every reader sees the same order.
        """
        self.backend._key(log)
        self.backend._require_root()
        parts = log.split("/")
        folder = self.backend._path(log)
        try:
            self.backend._make_dirs(parts)
            tmp = self.backend._write_temp(folder, log, message)
            try:
                # Listed after the slow part (writing), so the guess is as fresh as possible.
                position = self._next_position(folder)
                target = os.path.join(folder, entry_name(position))
                while not self.backend.publish(tmp, target, log, "append to"):
                    position += 1
                    target = os.path.join(folder, entry_name(position))
            finally:
                _unlink_quietly(tmp)
            _fsync_dir(folder)
        except OSError as exc:
            raise self.backend._error(exc, log, "append to", not_found=False) from exc
        return position

    def append_at(self, log: str, position: int, message: bytes) -> bool:
        """Link ``message`` as entry ``position`` if it is free and entry
        ``position - 1`` exists (entries are never removed, so the log then has
        exactly ``position`` entries); the exclusive link makes racers agree."""
        if position < 0:
            raise ValueError(f"append_at needs position >= 0, got {position}")
        self.backend._key(log)
        self.backend._require_root()
        folder = self.backend._path(log)
        try:
            self.backend._make_dirs(log.split("/"))
            if position > 0 and not os.path.exists(os.path.join(folder, entry_name(position - 1))):
                return False
            tmp = self.backend._write_temp(folder, log, message)
            try:
                written = self.backend.publish(
                    tmp, os.path.join(folder, entry_name(position)), log, "append to")
            finally:
                _unlink_quietly(tmp)
            if written:
                _fsync_dir(folder)
        except OSError as exc:
            raise self.backend._error(exc, log, "append to", not_found=False) from exc
        return written

    def _next_position(self, folder: str) -> int:
        """One past the highest entry in ``folder`` (0 for an empty log)."""
        highest = -1
        with os.scandir(folder) as it:
            for entry in it:
                position = entry_position(entry.name)
                if position is not None and position > highest:
                    highest = position
        return highest + 1

    def delete_log(self, log: str) -> int:
        """Unlink the entries of the log folder ``log/``, highest first (a reader sees
        a prefix meanwhile), then the folder itself; stray temp files go too."""
        self.backend._key(log)
        self.backend._require_root()
        folder = self.backend._path(log)
        try:
            names = os.listdir(folder)
        except (FileNotFoundError, NotADirectoryError):
            return 0
        except OSError as exc:
            raise self.backend._error(exc, log, "delete", not_found=False) from exc
        entries = sorted(((p, n) for n in names if (p := entry_position(n)) is not None),
                         reverse=True)
        removed = 0
        try:
            for _, name in entries:
                _unlink_quietly(os.path.join(folder, name))
                removed += 1
            for name in os.listdir(folder):
                _unlink_quietly(os.path.join(folder, name))
            os.rmdir(folder)
        except FileNotFoundError:
            pass
        except OSError as exc:
            if exc.errno != errno.ENOTEMPTY:  # else a late writer added an entry: kept
                raise self.backend._error(exc, log, "delete", not_found=False) from exc
        return removed

    def fetch(self, log: str, start: int = 0) -> builtins.list[tuple[int, bytes]]:
        """``(position, message)`` for each entry of ``log`` at ``position >= start``,
        in position order. A missing log is ``[]``; temp files and other names in the
        log folder are ignored."""
        if start < 0:
            raise ValueError(f"fetch needs start >= 0, got {start}")
        self.backend._key(log)
        self.backend._require_root()
        folder = self.backend._path(log)
        try:
            names = os.listdir(folder)
        except (FileNotFoundError, NotADirectoryError) as exc:
            if not os.path.isdir(self.backend.root):
                raise self.backend._unavailable(exc) from exc
            return []
        except OSError as exc:
            raise self.backend._error(exc, log, "read", not_found=False) from exc
        positions = sorted(
            position
            for position in map(entry_position, names)
            if position is not None and position >= start
        )
        entries: builtins.list[tuple[int, bytes]] = []
        for position in positions:
            try:
                with open(os.path.join(folder, entry_name(position)), "rb") as f:
                    entries.append((position, f.read()))
            except OSError as exc:
                # Entries are never removed by metasync, so a vanished one is an error.
                raise self.backend._error(exc, log, "read", not_found=False) from exc
        return entries
