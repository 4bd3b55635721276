"""The user's registry of folders and the service's settings, in the user's config
folder (``$XDG_CONFIG_HOME/metasync`` on Linux, via platformdirs):

| file | what |
|---|---|
| ``folders.json`` | ``{"version": 1, "folders": [{"id": "f3a9c1d2", "path": "/home/ann/Sync"}]}`` |
| ``service.json`` | ``{"host": "127.0.0.1", "port": 8384}``: where the service listens (optional) |
| ``api-key`` | the web page's and REST API's key, ``0600`` |
| ``running.json`` | ``{"pid": N, "host": H, "port": P}`` while a service runs |
| ``registry.lock`` | held while a command changes ``folders.json`` |
| ``service.lock`` | held while a service runs (one per config folder) |

Every file is written atomically (a temporary file, fsync, rename). Every file is
read as input that may be damaged (a hand edit, a disk fault): a damaged file is a
one-line :class:`UsageError` naming it and the fix, never a traceback.
"""

from __future__ import annotations

import json
import os
import re
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from metasync.errors import UsageError
from metasync.portable import lock, process_alive, try_lock
from metasync.worktree import META_DIR

FOLDERS_FILE = "folders.json"
SERVICE_FILE = "service.json"
API_KEY_FILE = "api-key"
RUNNING_FILE = "running.json"
LOCK_FILE = "registry.lock"
SERVICE_LOCK_FILE = "service.lock"
DEFAULT_LISTEN = ("127.0.0.1", 8384)
_ID = re.compile(r"^[0-9a-f]{8}\Z")
_KEY = re.compile(r"^[A-Za-z0-9_-]{16,128}\Z")


@dataclass(frozen=True)
class RegisteredFolder:
    """One folder the service syncs: ``id`` is random (8 hex digits) and never
    changes once assigned; ``path`` is absolute."""

    id: str
    path: Path


def default_config_dir() -> Path:
    """The user's config folder for metasync (honours ``$XDG_CONFIG_HOME`` on Linux)."""
    import platformdirs

    return Path(platformdirs.user_config_dir("metasync", appauthor=False))


def write_atomic(path: Path, data: bytes, mode: int = 0o600) -> None:
    """Replace ``path`` with ``data`` so a reader sees the old or the new content,
    never a part, even after a crash: a temporary file beside it, fsync'd, renamed,
    and the folder fsync'd."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    try:
        dfd = os.open(path.parent, os.O_RDONLY)
    except OSError:
        return  # Windows: no folder handles; the rename is what counts
    try:
        os.fsync(dfd)
    except OSError:
        pass
    finally:
        os.close(dfd)


class Registry:
    """The registry in ``config_dir`` (created ``0700`` on the first write)."""

    def __init__(self, config_dir: Path | None = None) -> None:
        self.config_dir = (config_dir or default_config_dir()).absolute()

    # --- folders -----------------------------------------------------------------
    def folders(self) -> list[RegisteredFolder]:
        """The registered folders, in the order they were added."""
        path = self.config_dir / FOLDERS_FILE
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise UsageError(f"cannot read {path}: {exc.strerror or exc}") from exc
        fix = (f"{path} is damaged ({{}}); repair it, or move it away and register the "
               "folders again with `metasync add-folder PATH`")
        try:
            doc = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as exc:
            raise UsageError(fix.format(f"not JSON: {str(exc).splitlines()[0]}")) from exc
        if not isinstance(doc, dict) or not isinstance(doc.get("folders"), list):
            raise UsageError(fix.format('no "folders" list'))
        out: list[RegisteredFolder] = []
        for item in doc["folders"]:
            if not (isinstance(item, dict) and isinstance(item.get("id"), str)
                    and _ID.match(item["id"]) and isinstance(item.get("path"), str)
                    and os.path.isabs(item["path"]) and "\0" not in item["path"]):
                raise UsageError(fix.format(f"a bad entry {json.dumps(item)[:80]}"))
            if any(f.id == item["id"] or str(f.path) == item["path"] for f in out):
                raise UsageError(fix.format(f"{item['path']} or id {item['id']} listed twice"))
            out.append(RegisteredFolder(item["id"], Path(item["path"])))
        return out

    def add(self, path: Path) -> RegisteredFolder:
        """Register the metasync folder ``path``. UsageError if it is not the root of
        a metasync folder, or is registered already."""
        root = Path(os.path.abspath(path))
        try:
            root = root.resolve(strict=True)
        except OSError as exc:
            raise UsageError(f"{root} does not exist ({exc.strerror or exc}); give the path "
                             "of a metasync folder") from exc
        if not (root / META_DIR / "state.db").is_file():
            raise UsageError(f"{root} is not a metasync folder (no {META_DIR}/ in it); run "
                             "`metasync init` or `metasync clone` there first")
        with self._locked():
            folders = self.folders()
            for f in folders:
                if f.path == root:
                    raise UsageError(f"{root} is registered already (id {f.id})")
            used = {f.id for f in folders}
            new_id = secrets.token_hex(4)
            while new_id in used:
                new_id = secrets.token_hex(4)
            added = RegisteredFolder(new_id, root)
            self._write_folders([*folders, added])
        return added

    def remove(self, path_or_id: str) -> RegisteredFolder:
        """Forget a folder, named by its id or its path (nothing on disk or on the
        backends is touched). UsageError if it is not registered."""
        with self._locked():
            folders = self.folders()
            wanted = {path_or_id, os.path.abspath(path_or_id)}
            try:
                wanted.add(str(Path(path_or_id).resolve()))
            except (OSError, RuntimeError):
                pass  # a folder deleted already is named by its registered path
            for f in folders:
                if f.id == path_or_id or str(f.path) in wanted:
                    self._write_folders([g for g in folders if g.id != f.id])
                    return f
        raise UsageError(f"{path_or_id} is not a registered folder; see `metasync folders`")

    def _write_folders(self, folders: list[RegisteredFolder]) -> None:
        doc = {"version": 1, "folders": [{"id": f.id, "path": str(f.path)} for f in folders]}
        write_atomic(self.config_dir / FOLDERS_FILE, (json.dumps(doc, indent=2) + "\n").encode())

    @contextmanager
    def _locked(self) -> Iterator[None]:
        """One writer of ``folders.json`` at a time (read, change, write)."""
        self._ensure_dir()
        fd = os.open(self.config_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            lock(fd)
            yield
        finally:
            os.close(fd)

    def _ensure_dir(self) -> None:
        try:
            self.config_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        except OSError as exc:
            raise UsageError(f"cannot create the config folder {self.config_dir}: "
                             f"{exc.strerror or exc}") from exc

    # --- the service's settings -----------------------------------------------------
    def api_key(self) -> str:
        """The API key, created (random, ``0600``) on the first call."""
        path = self.config_dir / API_KEY_FILE
        try:
            key = path.read_text("ascii").strip()
        except FileNotFoundError:
            self._ensure_dir()
            key = secrets.token_urlsafe(32)
            # Published by a hard link, which fails if the file exists: of two first
            # calls at once (the service starting while `metasync gui` runs), one
            # key wins and both return it; a rename would let the loser's process
            # keep a key the file no longer holds.
            temp = path.with_name(f".{API_KEY_FILE}.{secrets.token_hex(6)}.tmp")
            write_atomic(temp, (key + "\n").encode(), 0o600)
            try:
                os.link(temp, path)
            except FileExistsError:
                return self.api_key()
            except OSError:
                os.replace(temp, path)  # no hard links in this folder's file system
            finally:
                temp.unlink(missing_ok=True)
            return key
        except (OSError, UnicodeDecodeError) as exc:
            raise UsageError(f"cannot read the API key {path} ({exc}); delete it to make "
                             "a new one") from exc
        if not _KEY.match(key):
            raise UsageError(f"the API key {path} is damaged; delete it to make a new one")
        if os.name == "posix" and path.stat().st_mode & 0o077:
            os.chmod(path, 0o600)  # a secret: nobody else may read it
        return key

    def listen(self) -> tuple[str, int]:
        """Where the service listens: ``service.json``'s ``host`` and ``port``, else
        127.0.0.1:8384."""
        doc = self._read_json(self.config_dir / SERVICE_FILE, "the service settings")
        if doc is None:
            return DEFAULT_LISTEN
        host, port = doc.get("host", DEFAULT_LISTEN[0]), doc.get("port", DEFAULT_LISTEN[1])
        if not (isinstance(host, str) and host and isinstance(port, int)
                and not isinstance(port, bool) and 0 <= port <= 65535):
            raise UsageError(f"{self.config_dir / SERVICE_FILE} is damaged (host must be a "
                             "name, port 0-65535); repair or delete it")
        return host, port

    def hold_service_lock(self) -> int:
        """One service per config folder: an exclusive lock on ``service.lock``,
        held while the returned descriptor is open. UsageError if another holds it."""
        self._ensure_dir()
        fd = os.open(self.config_dir / SERVICE_LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
        if not try_lock(fd):
            os.close(fd)
            running = self.read_running() or {}
            where = f" (pid {running['pid']}, port {running['port']})" if running else ""
            raise UsageError(f"a metasync service already runs for {self.config_dir}{where}; "
                             "stop it first, or give another config folder ($XDG_CONFIG_HOME)")
        return fd

    def write_running(self, host: str, port: int) -> None:
        """Say where this process's service listens (``running.json``)."""
        self._ensure_dir()
        doc = {"pid": os.getpid(), "host": host, "port": port}
        write_atomic(self.config_dir / RUNNING_FILE, json.dumps(doc).encode(), 0o600)

    def read_running(self) -> dict[str, Any] | None:
        """``{"pid", "host", "port"}`` of the running service; None if none runs (no
        file, a damaged one, or its process is gone)."""
        try:
            doc = self._read_json(self.config_dir / RUNNING_FILE, "")
        except UsageError:
            return None
        if doc is None:
            return None
        pid, port = doc.get("pid"), doc.get("port")
        if not (isinstance(pid, int) and pid > 0 and isinstance(port, int)
                and isinstance(doc.get("host"), str) and process_alive(pid)):
            return None
        return doc

    def clear_running(self) -> None:
        """Remove ``running.json`` if this process wrote it."""
        doc = self.read_running()
        if doc is not None and doc.get("pid") == os.getpid():
            (self.config_dir / RUNNING_FILE).unlink(missing_ok=True)

    def _read_json(self, path: Path, what: str) -> dict[str, Any] | None:
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise UsageError(f"cannot read {path}: {exc.strerror or exc}") from exc
        try:
            doc = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as exc:
            raise UsageError(f"{path} ({what}) is damaged: not JSON; repair or delete it") from exc
        if not isinstance(doc, dict):
            raise UsageError(f"{path} ({what}) is damaged: not a JSON object; repair or delete it")
        return doc
