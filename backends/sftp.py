"""The ``sftp:`` backend: a folder on any server reachable over SSH (OpenSSH's SFTP).

``sftp://USER@HOST:PORT/ABSOLUTE/PATH?identity=KEYFILE&known_hosts=FILE`` with
namespace ``ns`` keeps key ``a/b`` in the file ``/ABSOLUTE/PATH/ns/a/b`` on the
server. Options (query string): ``identity`` (private key file; default the SSH
agent and ``~/.ssh/id_*``), ``known_hosts`` (default ``~/.ssh/known_hosts``),
``transfers`` (concurrent SFTP sessions per backend instance, default 4),
``timeout`` (seconds one request may take, default 60) and ``logs`` (``creates``,
the default, or ``registers`` for a server whose rename replaces an existing file:
logs then need only ``put``, see :class:`~metasync.backends.logs.RegisterLogs`). A
password may be given as ``USER:PASSWORD@``, or in ``METASYNC_SFTP_PASSWORD`` for a
URI typed on this machine's command line (:func:`~metasync.backends.uris.typed_uri`);
it never appears in messages. ``identity`` and ``known_hosts`` are local options:
never shared (:mod:`metasync.backends.uris`). The path is percent-decoded (``%20``, UTF-8 as ``%C3%BC`` or raw).

Host keys are checked strictly against ``known_hosts``: an unknown or changed key
is an error naming the host and the fix, never accepted silently.

Atomicity rests on two requests of OpenSSH's ``sftp-server``:

- ``posix-rename@openssh.com`` is ``rename(2)``: ``put`` writes a temporary
  ``.tmp-<16 hex>`` file in the destination folder, fsyncs it
  (``fsync@openssh.com``) and renames it over the key, so readers see the old
  object or the whole new one;
- the plain SFTP ``rename`` request is implemented as ``link(2)`` + ``unlink(2)``
  for regular files, so it fails (``SSH_FX_FAILURE``) if the target exists:
  ``put_if_absent`` (and so every log append, :class:`ObjectStoreLogs`) publishes
  a complete temporary file exclusively. On a filesystem without hard links
  OpenSSH falls back to a racy stat-then-rename; such a server folder must not be
  shared by concurrent writers.

Connections: each backend instance keeps a pool of at most ``transfers`` SSH
connections, each with one SFTP session used by one thread at a time (paramiko's
``SFTPClient`` is not safe for concurrent requests from several threads). A
session whose connection died is dropped and replaced by a fresh connection on
the next request; every request runs under :func:`retrying`. A stream returned by
:meth:`SftpBackend.open` holds one session until it is closed.

Reads and writes are pipelined (up to :data:`PIPELINE_DEPTH` requests of
:data:`REQUEST_SIZE` bytes in flight) through paramiko's request machinery,
because ``SFTPFile``'s own pipelining drops write errors and its prefetch buffers
without bound.
"""

from __future__ import annotations

import base64
import builtins
import contextlib
import getpass
import hashlib
import io
import logging
import os
import posixpath
import secrets
import socket
import stat
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, BinaryIO, TypeVar, cast

import paramiko
from paramiko.sftp import (
    CMD_ATTRS,
    CMD_CLOSE,
    CMD_DATA,
    CMD_EXTENDED,
    CMD_FSTAT,
    CMD_HANDLE,
    CMD_OPEN,
    CMD_READ,
    CMD_STATUS,
    CMD_WRITE,
    SFTP_FLAG_CREATE,
    SFTP_FLAG_EXCL,
    SFTP_FLAG_READ,
    SFTP_FLAG_WRITE,
    int64,
)
from paramiko.sftp_attr import SFTPAttributes

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
    one_line,
    public_uri,
    temp_path_parts,
)
from metasync.backends.capabilities import LOGS_MODES, logs_mode_capabilities
from metasync.backends.retry import RetryPolicy, TransientError, retrying, silence_of
from metasync.errors import (
    BackendError,
    BackendFull,
    BackendUnavailable,
    NoAnswer,
    ObjectNotFound,
    UsageError,
)
from metasync.timeouts import network_timeout

T = TypeVar("T")

# paramiko logs every failed handshake with a full traceback at ERROR level, and
# with no handler configured Python prints those on stderr. The failure reaches the
# user as this backend's one-line error instead, so paramiko's records below
# CRITICAL are dropped, and the rest go only where the application sends logs.
logging.getLogger("paramiko").addHandler(logging.NullHandler())
logging.getLogger("paramiko").setLevel(logging.CRITICAL)

#: Bytes per SFTP read or write request (paramiko's and most servers' safe maximum).
REQUEST_SIZE = 32768
#: Requests in flight per transfer: 2 MiB, enough to fill a fast link's pipe.
PIPELINE_DEPTH = 64
#: Streams are read from the caller, and objects by ``open``, in pieces of this size.
CHUNK_SIZE = 1 << 20
#: Bytes read together with the fstat that follows an open (one round trip for
#: small objects; the rest of a larger one is read once its size is known).
FIRST_READ = 64 * 1024
#: Objects up to this size are hashed into their poll token (see :meth:`SftpBackend.poll`).
POLL_HASH_LIMIT = 256 * 1024
#: Seconds a TCP connect and the SSH handshake may take.
CONNECT_TIMEOUT = 20.0
#: Seconds between SSH keepalives, so idle pooled connections survive NAT timeouts.
KEEPALIVE = 30
DEFAULT_TRANSFERS = 4
DEFAULT_TIMEOUT = 60.0
_OPTIONS = ("identity", "known_hosts", "transfers", "timeout", "logs")
#: A write that fails with a bare SSH_FX_FAILURE while the server has less room
#: than this left is taken for "full" (see :meth:`SftpBackend._failure`).
LOW_SPACE = 1 << 20
#: SFTP status texts of OpenSSH for a failed request whose reason is unknown.
_FAILURE = "Failure"


def _one_line(exc: BaseException) -> str:
    """``exc`` as ``Type: message`` on one line (paramiko's texts may hold newlines)."""
    name, text = type(exc).__name__, one_line(exc)
    return text if text == name else f"{name}: {text}"


def _fingerprint(key: paramiko.PKey) -> str:
    digest = hashlib.sha256(key.asbytes()).digest()
    return "SHA256:" + base64.b64encode(digest).decode().rstrip("=")


#: How paramiko words a handshake that waited out its timeout (a banner that never
#: came has the socket's timeout in its chain).
_SILENT_HANDSHAKE = ("timed out", "timeout", "no existing session")


def _says_silent(exc: BaseException) -> bool:
    """True if ``exc``, or what it was raised from, is a wait that ran out; False if
    the connection was cut off (an end of file or a reset anywhere in the chain)."""
    seen: BaseException | None = exc
    silent = False
    while seen is not None:
        if isinstance(seen, EOFError | ConnectionError):
            return False
        if isinstance(seen, TimeoutError) or any(w in str(seen).lower() for w in _SILENT_HANDSHAKE):
            silent = True
        seen = seen.__cause__ or seen.__context__
    return silent


class _HostKeyError(paramiko.SSHException):
    """The server's host key is not in known_hosts (raised by :class:`_RejectUnknown`)."""

    def __init__(self, hostname: str, key: paramiko.PKey) -> None:
        super().__init__(f"host key of {hostname} is unknown")
        self.hostname = hostname
        self.key = key


class _RejectUnknown(paramiko.MissingHostKeyPolicy):
    """Strict host key checking: an unknown host is an error carrying its key."""

    def missing_host_key(
        self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey
    ) -> None:
        raise _HostKeyError(hostname, key)


class _SourceError(Exception):
    """Wraps an exception raised by the caller's stream, so it is not mistaken for a
    server failure; unwrapped before it reaches the caller."""

    def __init__(self, original: BaseException) -> None:
        super().__init__(str(original))
        self.original = original


class _Replies:
    """Replies to pipelined requests on one SFTP session.

    paramiko hands each reply to ``_async_response`` of the object a request was
    sent with; this collects data and the first error, so a failed write is never
    lost (``SFTPFile``'s pipelined writes discard their status replies).
    """

    def __init__(self, sftp: paramiko.SFTPClient) -> None:
        self.sftp = sftp
        self.pending: set[int] = set()
        self.data: dict[int, bytes] = {}
        self.attrs: dict[int, SFTPAttributes] = {}
        self.error: BaseException | None = None

    def send(self, kind: int, *args: Any) -> int:
        num = int(self.sftp._async_request(self, kind, *args))
        self.pending.add(num)
        return num

    def _async_response(self, kind: int, msg: paramiko.Message, num: int) -> None:
        # Called by paramiko (SFTPClient._read_response) for each reply.
        self.pending.discard(num)
        if kind == CMD_DATA:
            self.data[num] = msg.get_string()
            return
        if kind == CMD_ATTRS:
            self.attrs[num] = SFTPAttributes._from_msg(msg)
            return
        if kind == CMD_STATUS:
            try:
                self.sftp._convert_status(msg)
            except EOFError:
                self.data[num] = b""  # a read at or past the end of the file
            except Exception as exc:  # an SFTP error status, raised in wait()
                if self.error is None:
                    self.error = exc
            return
        if self.error is None:
            self.error = paramiko.SFTPError(f"unexpected SFTP reply type {kind}")

    def wait(self, at_most: int = 0, *, check: bool = True) -> None:
        """Read replies until at most ``at_most`` are outstanding; raise the first
        error (unless ``check`` is False: the caller inspects ``error`` itself)."""
        while len(self.pending) > at_most:
            self.sftp._read_response()
        if check and self.error is not None:
            raise self.error


def _open_handle(sftp: paramiko.SFTPClient, path: str, flags: int) -> bytes:
    """Open ``path`` on the server; return the SFTP handle (closed by :func:`_close_handle`)."""
    kind, msg = sftp._request(CMD_OPEN, path, flags, SFTPAttributes())
    if kind != CMD_HANDLE:
        raise paramiko.SFTPError("expected a file handle")
    return bytes(msg.get_binary())


def _close_handle(sftp: paramiko.SFTPClient, handle: bytes) -> None:
    # Not waited for: the server handles requests in order, so a later request on
    # this session sees the file closed, and the reply is dropped when it arrives.
    # Saves a round trip per operation.
    sftp._async_request(type(None), CMD_CLOSE, handle)


def _stat_and_read(
    sftp: paramiko.SFTPClient, handle: bytes, offset: int, length: int
) -> tuple[SFTPAttributes, bytes, BaseException | None]:
    """fstat the open ``handle`` and read up to ``length`` bytes at ``offset`` in one
    pipelined round: (attributes, the bytes before the first short reply, the read
    error if any). Reading a folder's handle fails; the caller checks the mode first."""
    replies = _Replies(sftp)
    stat_num = replies.send(CMD_FSTAT, handle)
    pieces = _send_reads(replies, handle, offset, length)
    replies.wait(check=False)
    if stat_num not in replies.attrs:
        raise replies.error or paramiko.SFTPError("no reply to fstat")
    return replies.attrs[stat_num], _joined(replies, pieces), replies.error


def _send_reads(
    replies: _Replies, handle: bytes, offset: int, length: int
) -> list[tuple[int, int]]:
    pieces: list[tuple[int, int]] = []  # (request number, size asked)
    position, end = offset, offset + length
    while position < end:
        size = min(REQUEST_SIZE, end - position)
        pieces.append((replies.send(CMD_READ, handle, int64(position), size), size))
        position += size
        replies.wait(PIPELINE_DEPTH, check=False)
    return pieces


def _joined(replies: _Replies, pieces: list[tuple[int, int]]) -> bytes:
    """The replies' data in order, up to (and including) the first short one."""
    out = bytearray()
    for num, size in pieces:
        data = replies.data.pop(num, b"")
        out += data
        if len(data) < size:
            break
    return bytes(out)


def _read_exact(sftp: paramiko.SFTPClient, handle: bytes, offset: int, length: int) -> bytes:
    """``length`` bytes at ``offset`` of the open file ``handle``, read with pipelined
    requests; :class:`EOFError` if the file ends first."""
    out = bytearray()
    while len(out) < length:
        replies = _Replies(sftp)
        pieces = _send_reads(replies, handle, offset + len(out), length - len(out))
        replies.wait()
        got = _joined(replies, pieces)
        # A server may answer a read with fewer bytes than asked: ask again from there.
        if not got:
            raise EOFError(f"file ends at {offset + len(out)}")
        out += got
    return bytes(out)


class _Writer:
    """Pipelined writes to one open file handle, checking every reply."""

    def __init__(self, sftp: paramiko.SFTPClient, handle: bytes) -> None:
        self.replies = _Replies(sftp)
        self.handle = handle
        self.offset = 0

    def write(self, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data).cast("B")
        for start in range(0, len(view), REQUEST_SIZE):
            piece = bytes(view[start : start + REQUEST_SIZE])
            self.replies.send(CMD_WRITE, self.handle, int64(self.offset), piece)
            self.offset += len(piece)
            self.replies.wait(PIPELINE_DEPTH)

    def finish(self) -> None:
        self.replies.wait()


class _Session:
    """One SSH connection with one SFTP session; used by one thread at a time."""

    def __init__(self, client: paramiko.SSHClient, sftp: paramiko.SFTPClient, generation: int):
        self.client = client
        self.sftp = sftp
        self.generation = generation
        self.fsync_supported = True

    def alive(self) -> bool:
        transport = self.client.get_transport()
        channel = self.sftp.get_channel()
        return (
            transport is not None
            and transport.is_active()
            and channel is not None
            and not channel.closed
        )

    def close(self) -> None:
        # Closing a dead connection can raise anything; the session is gone either way.
        with contextlib.suppress(Exception):
            self.sftp.close()
        with contextlib.suppress(Exception):
            self.client.close()


class _Pool:
    """At most ``size`` sessions in use at once; idle ones are reused."""

    def __init__(self, connect: Callable[[int], _Session], size: int) -> None:
        self._connect = connect
        self._slots = threading.BoundedSemaphore(size)
        self._lock = threading.Lock()
        self._idle: list[_Session] = []
        self._generation = 0

    def acquire(self) -> _Session:
        """A live session (reused or new); blocks while ``size`` are in use."""
        self._slots.acquire()
        try:
            while True:
                with self._lock:
                    session = self._idle.pop() if self._idle else None
                    generation = self._generation
                if session is None:
                    return self._connect(generation)
                if session.alive():
                    return session
                session.close()
        except BaseException:
            self._slots.release()
            raise

    def release(self, session: _Session, *, broken: bool) -> None:
        """Give ``session`` back; a broken or dead one is closed instead of reused."""
        try:
            with self._lock:
                keep = not broken and session.generation == self._generation
                if keep and session.alive():
                    self._idle.append(session)
                    return
            session.close()
        finally:
            self._slots.release()

    def close(self) -> None:
        """Close the idle sessions; sessions in use are closed when released."""
        with self._lock:
            idle, self._idle = self._idle, []
            self._generation += 1
        for session in idle:
            session.close()


@dataclass
class _Attempts:
    """What earlier attempts of one retried operation may have done on the server."""

    #: A request that changes the target was sent, its answer unknown (connection lost).
    sent: bool = False
    #: Temporary files earlier attempts may have left behind.
    temps: list[str] = field(default_factory=list)


@register
class SftpBackend(Backend):
    """A folder on an SSH server, URI ``sftp://USER@HOST:PORT/ABSOLUTE/PATH?...``.

    See the module docstring for options and for how writes are made atomic.
    ``case_sensitive`` holds for the usual server filesystems (ext4, xfs, zfs).
    """

    scheme = "sftp"
    capabilities = Capabilities(
        conditional_create=True,
        compare_and_swap=False,
        conditional_append=True,
        range_reads=True,
        max_object_size=None,
        case_sensitive=True,
        long_poll=False,
        temp_files=True,
    )

    def __init__(self, uri: str, namespace: str) -> None:
        """Parse ``uri`` and bind to ``<path>/<namespace>/``. Touches nothing.

        Raises :class:`UsageError` for a malformed URI, a relative path, an unknown
        option or an invalid namespace.
        """
        super().__init__(uri, namespace)
        parts = urllib.parse.urlsplit(uri)
        shown = public_uri(uri)
        if parts.scheme != self.scheme or not parts.hostname:
            raise UsageError(f"not an sftp URI: {shown!r}; use sftp://USER@HOST:PORT/ABSOLUTE/PATH")
        try:
            port = parts.port
        except ValueError as exc:
            raise UsageError(f"bad port in {shown!r}: {exc}") from exc
        path = urllib.parse.unquote(parts.path)
        if not path.startswith("/"):
            raise UsageError(
                f"sftp path must be absolute in {shown!r}; use sftp://USER@HOST/ABSOLUTE/PATH"
            )
        options = urllib.parse.parse_qs(parts.query, keep_blank_values=True)
        unknown = sorted(set(options) - set(_OPTIONS))
        if unknown:
            raise UsageError(
                f"unknown option {unknown[0]!r} in {shown!r}; known options: {', '.join(_OPTIONS)}"
            )
        single = {name: values[-1] for name, values in options.items()}
        check_namespace(namespace)
        self.host: str = parts.hostname
        self.port: int = port or 22
        self.user: str = urllib.parse.unquote(parts.username or "") or getpass.getuser()
        # Only the URI's own password: METASYNC_SFTP_PASSWORD is added to a URI typed
        # on this machine (backends.uris.typed_uri), never to one from the shared
        # configuration, so it goes to no host another client named.
        self._password: str | None = (
            urllib.parse.unquote(parts.password) if parts.password is not None else None
        ) or None
        #: How logs are kept: ``creates`` (the link-based rename) or ``registers`` (for a
        #: server whose rename replaces an existing file; every client uses the same URI).
        self.logs_mode = single.get("logs", "creates")
        if self.logs_mode not in LOGS_MODES:
            raise UsageError(f"option logs in {shown!r} must be creates or registers")
        self.capabilities = logs_mode_capabilities(type(self).capabilities, self.logs_mode)
        identity = single.get("identity")
        self.identity: str | None = os.path.expanduser(identity) if identity else None
        self.known_hosts: str = os.path.expanduser(
            single.get("known_hosts") or "~/.ssh/known_hosts"
        )
        self.transfers: int = self._positive(single, "transfers", DEFAULT_TRANSFERS, shown)
        #: Seconds one request may take (``timeout=``, never more than ``--timeout``).
        self.timeout: float = network_timeout(
            float(self._positive(single, "timeout", DEFAULT_TIMEOUT, shown))
        )
        #: Seconds the TCP connect and each step of the SSH handshake (banner, key
        #: exchange, sign-in, opening the SFTP channel) may take.
        self.connect_timeout: float = min(CONNECT_TIMEOUT, self.timeout)
        #: The folder named in the URI; it must exist before :meth:`create` (``init`` makes
        #: it with :meth:`create_location`).
        self.location: str = posixpath.normpath(path)
        #: The namespace folder holding every key.
        self.root: str = posixpath.join(self.location, namespace)
        self._policy = RetryPolicy(budget=self.timeout, silence=silence_of(self.uri))
        self._pool = _Pool(self._connect, self.transfers)
        #: Folders known to exist (so each is made, or checked, once per instance).
        self._folders: set[str] = set()
        self._folders_lock = threading.Lock()

    @staticmethod
    def _positive(options: dict[str, str], name: str, default: float, shown: str) -> Any:
        if name not in options:
            return default
        try:
            value = int(options[name]) if isinstance(default, int) else float(options[name])
        except ValueError:
            value = 0
        if value <= 0:
            raise UsageError(f"option {name} in {shown!r} must be a positive number")
        return value

    # --- connections ---------------------------------------------------------------
    def _hostport(self) -> str:
        return self.host if self.port == 22 else f"[{self.host}]:{self.port}"

    def _keyscan_hint(self) -> str:
        port = f"-p {self.port} " if self.port != 22 else ""
        return f"ssh-keyscan {port}{self.host} >> {self.known_hosts}"

    def _connect(self, generation: int) -> _Session:
        """Open one SSH connection and its SFTP session, mapping every failure to the
        error contract (unreachable: BackendUnavailable; dropped: TransientError;
        host key, authentication: BackendError)."""
        where = f"{self.host}:{self.port}"
        try:
            sock = socket.create_connection((self.host, self.port), timeout=self.connect_timeout)
        except socket.gaierror as exc:
            raise BackendUnavailable(
                f"{self.name}: cannot resolve host {self.host!r} ({exc.strerror}); check the host name"
            ) from exc
        except TimeoutError as exc:
            raise NoAnswer(
                f"{self.name}: no answer from {where} within {self.connect_timeout:g}s; "
                "is the host up and the port right?"
            ) from exc
        except OSError as exc:
            raise BackendUnavailable(
                f"{self.name}: cannot connect to {where} ({exc.strerror or exc}); "
                "is the SSH server running and the port right?"
            ) from exc
        client = paramiko.SSHClient()
        try:
            self._handshake(client, sock)
            sftp = client.open_sftp()
            channel = sftp.get_channel()
            channel.settimeout(self.timeout)
        except BaseException:
            client.close()
            sock.close()
            raise
        return _Session(client, sftp, generation)

    def _handshake(self, client: paramiko.SSHClient, sock: socket.socket) -> None:
        client.set_missing_host_key_policy(_RejectUnknown())
        if os.path.exists(self.known_hosts):
            try:
                client.load_system_host_keys(self.known_hosts)
            except (OSError, paramiko.SSHException) as exc:
                raise BackendError(
                    f"{self.name}: cannot read known_hosts file {self.known_hosts} ({exc}); "
                    "fix or replace it, or name another with known_hosts="
                ) from exc
        if self.identity is not None and not os.path.isfile(self.identity):
            raise BackendError(
                f"{self.name}: identity file {self.identity} does not exist; "
                "fix identity= in the URI"
            )
        started = time.monotonic()
        try:
            client.connect(
                self.host,
                self.port,
                username=self.user,
                password=self._password,
                key_filename=self.identity,
                # With identity= only that key is offered (like IdentitiesOnly=yes);
                # otherwise the agent's keys and ~/.ssh/id_*, as ssh does.
                allow_agent=self.identity is None,
                look_for_keys=self.identity is None,
                sock=sock,
                timeout=self.connect_timeout,
                banner_timeout=self.connect_timeout,
                auth_timeout=self.connect_timeout,
                channel_timeout=self.connect_timeout,
            )
        except _HostKeyError as exc:
            raise BackendError(
                f"{self.name}: host key of {self._hostport()} ({exc.key.get_name()} "
                f"{_fingerprint(exc.key)}) is not in {self.known_hosts}; check that "
                f"fingerprint with the server's admin, then run: {self._keyscan_hint()}"
            ) from exc
        except paramiko.BadHostKeyException as exc:
            raise BackendError(
                f"{self.name}: HOST KEY OF {self._hostport()} CHANGED: the server sent "
                f"{_fingerprint(exc.key)}, {self.known_hosts} has {_fingerprint(exc.expected_key)}; "
                "someone may be intercepting the connection. If the server was really "
                f"re-keyed, remove the old key (ssh-keygen -R '{self._hostport()}' -f "
                f"{self.known_hosts}) and, after checking the new fingerprint, run: "
                f"{self._keyscan_hint()}"
            ) from exc
        except paramiko.PasswordRequiredException as exc:
            raise BackendError(
                f"{self.name}: the private key {self.identity or '(in ~/.ssh)'} is encrypted; "
                "add it to ssh-agent (ssh-add) and drop identity=, or use an unencrypted key"
            ) from exc
        except paramiko.AuthenticationException as exc:
            if "timeout" in str(exc).lower():  # "Authentication timeout.": no answer
                raise NoAnswer(
                    f"{self.name}: no answer from {self.host}:{self.port} to the SSH "
                    f"authentication within {self.connect_timeout:g}s; check the server, "
                    "or allow longer with --timeout"
                ) from exc
            keys = f"the key {self.identity}" if self.identity else "the agent's and ~/.ssh keys"
            raise BackendError(
                f"{self.name}: authentication as {self.user!r} failed with {keys} ({exc}); "
                f"add the public key to ~{self.user}/.ssh/authorized_keys on the server "
                "or fix identity= / the user name"
            ) from exc
        except (paramiko.SSHException, EOFError, OSError) as exc:
            # Dropped, reset or silent during the handshake: a retry on a new
            # connection may work (the retry loop stops within the timeout).
            # Silent if it waited out the timeout and was not cut off: paramiko says
            # so in many words ("Error reading SSH protocol banner", "No existing
            # session" after a key exchange that never ended).
            silent = time.monotonic() - started >= self.connect_timeout and _says_silent(exc)
            raise (NoAnswer if silent else TransientError)(
                f"{self.name}: the SSH handshake with {self.host}:{self.port} failed or got "
                f"no answer within {self.connect_timeout:g}s ({_one_line(exc)}); check that "
                "an SSH server answers there, or allow longer with --timeout"
            ) from exc

    def _failure(self, exc: BaseException, session: _Session, what: str) -> BackendError:
        """Translate an exception of a request on ``session`` into the error contract."""
        if isinstance(exc, BackendError):
            return exc
        if isinstance(exc, TimeoutError):
            return NoAnswer(
                f"{self.name}: no answer during {what} within {self.timeout:g}s; "
                "check the server, or allow longer with --timeout"
            )
        if not session.alive() or isinstance(exc, EOFError | paramiko.SSHException | ConnectionError):
            return TransientError(
                f"{self.name}: connection lost or silent during {what} ({_one_line(exc)}); "
                "check the server, or allow longer with --timeout"
            )
        if isinstance(exc, PermissionError):
            return BackendError(
                f"{self.name}: permission denied to {what}; user {self.user!r} needs read and "
                f"write access to {self.root} on the server"
            )
        if isinstance(exc, OSError):
            # SFTP v3 has no "no space" status: OpenSSH answers ENOSPC and EDQUOT with
            # a bare SSH_FX_FAILURE. Ask the server how much room is left.
            free = self._free_space(session) if str(exc) == _FAILURE else None
            if free is not None and free < LOW_SPACE:
                return BackendFull.of(
                    self.name, f"the server failed to {what} with {free} bytes left there")
            return BackendError(f"{self.name}: cannot {what}: {exc.strerror or exc}")
        return BackendError(f"{self.name}: cannot {what}: {type(exc).__name__}: {exc}")

    def _free_space(self, session: _Session) -> int | None:
        """Bytes available to this user under the location (OpenSSH's
        ``statvfs@openssh.com``); None where the server cannot say."""
        try:
            _, msg = session.sftp._request(CMD_EXTENDED, "statvfs@openssh.com", self.location)
            bsize, frsize, _blocks, _bfree, bavail = (msg.get_int64() for _ in range(5))
        except (OSError, EOFError, paramiko.SSHException, AttributeError, TypeError):
            return None
        return int(bavail) * int(frsize or bsize)

    def _call(
        self,
        what: str,
        request: Callable[[paramiko.SFTPClient, _Session], T],
        attempts: _Attempts | None = None,
    ) -> T:
        """Run ``request(sftp, session)`` on a pooled session under :func:`retrying`.

        A transient failure drops the session (its connection is suspect) and the
        request runs again on another one. ``attempts`` is marked ``sent`` by the
        request itself before a non-idempotent step.
        """

        def attempt() -> T:
            session = self._pool.acquire()
            broken = False
            try:
                return request(session.sftp, session)
            except _SourceError:
                raise
            except BaseException as exc:
                error = self._failure(exc, session, what)
                broken = error.transient or not isinstance(exc, OSError | BackendError)
                if error is exc:
                    raise
                raise error from exc
            finally:
                self._pool.release(session, broken=broken)

        try:
            return retrying(self._policy, f"{what} on {self.name}", attempt)
        except _SourceError as exc:
            raise exc.original from None

    # --- helpers -------------------------------------------------------------------
    def _key(self, key: str) -> str:
        check_key(key)  # also rejects ".tmp-" parts
        return key

    def _path(self, key: str) -> str:
        return posixpath.join(self.root, *key.split("/"))

    def _namespace_missing(self) -> BackendError:
        return BackendError(
            f"{self.name}: the repository folder {self.root} is missing on the server; "
            "was it deleted or moved? (metasync init creates it)"
        )

    def _require_root(self, sftp: paramiko.SFTPClient) -> None:
        """Raise unless the namespace folder exists: a missing key must not be
        mistaken for a deleted repository, nor the repository recreated by a write."""
        try:
            attrs = sftp.stat(self.root)
        except FileNotFoundError:
            raise self._namespace_missing() from None
        if not stat.S_ISDIR(attrs.st_mode or 0):
            raise self._namespace_missing()

    def _not_found(self, sftp: paramiko.SFTPClient, key: str) -> ObjectNotFound:
        self._require_root(sftp)
        return ObjectNotFound(f"no object {key!r} on {self.name}")

    def _make_parents(self, sftp: paramiko.SFTPClient, key: str) -> None:
        """Create the folders of ``key`` below the namespace folder (never the
        namespace folder itself), one level at a time."""
        self._require_root(sftp)
        folder = self.root
        for part in key.split("/")[:-1]:
            folder = posixpath.join(folder, part)
            try:
                sftp.mkdir(folder)
            except OSError as exc:
                # mkdir of an existing name fails with a generic SFTP failure.
                try:
                    attrs = sftp.stat(folder)
                except FileNotFoundError:
                    raise exc from None
                if not stat.S_ISDIR(attrs.st_mode or 0):
                    raise BackendError(
                        f"{self.name}: cannot write {key!r}: {part!r} is an object, and a key "
                        "cannot be both an object and a folder of other keys"
                    ) from None

    def _ensure_folder(self, sftp: paramiko.SFTPClient, key: str, folder: str) -> None:
        """Make ``folder`` (where ``key`` goes) exist before the first write into it --
        one ``mkdir`` when only it is new, or a ``stat`` when it exists -- and remember
        it: servers differ in how they refuse a file in a missing folder."""
        if folder == self.root:
            return
        with self._folders_lock:
            if folder in self._folders:
                return
        try:
            sftp.mkdir(folder)
        except OSError:
            if not self._is_folder(sftp, folder):
                self._make_parents(sftp, key)
        with self._folders_lock:
            self._folders.add(folder)

    def _write_temp(
        self,
        session: _Session,
        key: str,
        data: bytes | BinaryIO,
        attempts: _Attempts,
    ) -> str:
        """Write ``data`` to a new, fsynced temp file next to ``key``; return its path."""
        sftp = session.sftp
        path = self._path(key)
        folder = posixpath.dirname(path)
        tmp = posixpath.join(folder, TEMP_PREFIX + secrets.token_hex(8))
        flags = SFTP_FLAG_WRITE | SFTP_FLAG_CREATE | SFTP_FLAG_EXCL
        self._ensure_folder(sftp, key, folder)
        try:
            handle = _open_handle(sftp, tmp, flags)
        except OSError:
            # The folder went away since (some servers say "failure", not "no such
            # file"): make it again, or report the first error if it is there.
            if self._is_folder(sftp, folder):
                raise
            self._make_parents(sftp, key)
            handle = _open_handle(sftp, tmp, flags)
        attempts.temps.append(tmp)
        writer = _Writer(sftp, handle)
        try:
            if isinstance(data, bytes | bytearray | memoryview):
                writer.write(data)
            else:
                while True:
                    try:
                        chunk = data.read(CHUNK_SIZE)
                    except Exception as exc:
                        raise _SourceError(exc) from exc
                    if not chunk:
                        break
                    writer.write(chunk)
            writer.finish()
            self._fsync(session, handle)
        except _SourceError:
            with contextlib.suppress(Exception):
                writer.finish()
                _close_handle(sftp, handle)
                sftp.remove(tmp)
            raise
        _close_handle(sftp, handle)
        return tmp

    def _fsync(self, session: _Session, handle: bytes) -> None:
        # The data must be on the server's disk before the rename publishes it.
        if not session.fsync_supported:
            return
        try:
            session.sftp._request(CMD_EXTENDED, "fsync@openssh.com", handle)
        except OSError as exc:
            if "unsupported" not in str(exc).lower():
                raise
            session.fsync_supported = False  # durability is then the server's business

    def _cleanup(self, sftp: paramiko.SFTPClient, attempts: _Attempts) -> None:
        """Remove temp files of earlier attempts (best effort; they are never listed)."""
        for tmp in attempts.temps:
            with contextlib.suppress(OSError):
                sftp.remove(tmp)
        attempts.temps.clear()

    # --- lifecycle -----------------------------------------------------------------
    def exists(self) -> bool:
        """True if the namespace folder exists on the server."""

        def request(sftp: paramiko.SFTPClient, _: _Session) -> bool:
            try:
                return stat.S_ISDIR(sftp.stat(self.root).st_mode or 0)
            except FileNotFoundError:
                return False

        return self._call("check the repository folder", request)

    def probe(self) -> None:
        """Raise :class:`BackendUnavailable` unless the server answers, accepts us and
        has the location folder. Writes nothing."""

        def request(sftp: paramiko.SFTPClient, _: _Session) -> int | None:
            try:
                return sftp.stat(self.location).st_mode or 0
            except FileNotFoundError:
                return None

        # Raised outside the retries: a missing folder does not appear by waiting.
        mode = self._call("check the location folder", request)
        if mode is None:
            raise BackendUnavailable(
                f"{self.name}: the folder {self.location} does not exist on the server; "
                "create it there first (metasync init and backend add create it)"
            )
        if not stat.S_ISDIR(mode):
            raise BackendUnavailable(f"{self.name}: {self.location} is not a folder")

    def create_location(self) -> None:
        """Create the location folder and its missing parents on the server (``init``
        and ``backend add``, as restic's and rclone's sftp backends do)."""

        def request(sftp: paramiko.SFTPClient, _: _Session) -> None:
            if self._is_folder(sftp, self.location):
                return
            folder = "/"
            for part in self.location.strip("/").split("/"):
                folder = posixpath.join(folder, part)
                if self._is_folder(sftp, folder):
                    continue
                try:
                    sftp.mkdir(folder)
                except OSError:
                    if not self._is_folder(sftp, folder):
                        raise

        self._call(f"create the folder {self.location}", request)

    def create(self) -> None:
        """Create the namespace folder (idempotent) inside the existing location folder;
        :class:`BackendUnavailable` naming the location if that is missing."""
        self.probe()

        def request(sftp: paramiko.SFTPClient, _: _Session) -> None:
            folder = self.location
            for part in self.namespace.split("/"):
                folder = posixpath.join(folder, part)
                try:
                    sftp.mkdir(folder)
                except OSError:
                    try:
                        attrs = sftp.stat(folder)
                    except FileNotFoundError:
                        raise BackendUnavailable(
                            f"{self.name}: {self.location} vanished while creating {self.root}"
                        ) from None
                    if not stat.S_ISDIR(attrs.st_mode or 0):
                        raise BackendError(
                            f"{self.name}: cannot create {folder}: a file of that name is in the way"
                        ) from None

        self._call(f"create {self.root}", request)

    def close(self) -> None:
        """Close pooled connections (the backend reconnects if used again)."""
        self._pool.close()

    # --- storage -------------------------------------------------------------------
    def put(self, key: str, data: bytes | BinaryIO) -> None:
        """Store ``data`` at ``key`` atomically: temp file, fsync, ``posix-rename``.

        A file-like ``data`` is streamed in :data:`CHUNK_SIZE` pieces. After a lost
        connection the upload starts again on a new one; a non-seekable stream that
        was partly sent cannot be, and fails.
        """
        self._key(key)
        path = self._path(key)
        attempts = _Attempts()
        start = self._stream_start(data)

        def request(sftp: paramiko.SFTPClient, session: _Session) -> None:
            self._cleanup(sftp, attempts)
            self._rewind(data, start, attempts, key)
            attempts.sent = True
            tmp = self._write_temp(session, key, data, attempts)
            try:
                sftp.posix_rename(tmp, path)
            except OSError as exc:
                with contextlib.suppress(OSError):
                    sftp.remove(tmp)
                attempts.temps.clear()
                if not session.alive():
                    raise
                try:
                    attrs = sftp.stat(path)
                except FileNotFoundError:
                    self._require_root(sftp)
                    raise exc from None
                if stat.S_ISDIR(attrs.st_mode or 0):
                    raise BackendError(
                        f"{self.name}: cannot write {key!r}: it is a folder of other keys"
                    ) from None
                raise
            attempts.temps.clear()

        self._call(f"write {key!r}", request, attempts)

    @staticmethod
    def _stream_start(data: bytes | BinaryIO) -> int | None:
        """Where a seekable stream starts (to rewind it for a retry), else None."""
        if isinstance(data, bytes | bytearray | memoryview):
            return None
        try:
            return data.tell() if data.seekable() else None
        except (OSError, AttributeError, ValueError):
            return None

    def _rewind(
        self, data: bytes | BinaryIO, start: int | None, attempts: _Attempts, key: str
    ) -> None:
        if isinstance(data, bytes | bytearray | memoryview) or not attempts.sent:
            return
        if start is None:
            raise BackendError(
                f"{self.name}: the connection was lost while writing {key!r} from a stream "
                "that cannot be rewound; run the command again"
            )
        try:
            data.seek(start)
        except Exception as exc:
            raise _SourceError(exc) from exc

    def put_if_absent(self, key: str, data: bytes) -> bool:
        """Create ``key`` holding ``data`` unless it exists; True if this call did.

        The temp file is published with the SFTP ``rename`` request, which OpenSSH
        performs with ``link()``: it fails if the key exists, atomically against
        other writers. If a connection was lost after the rename was sent, the retry
        reads the key back and reports True if it holds exactly ``data``.
        """
        self._key(key)
        path = self._path(key)
        attempts = _Attempts()

        def request(sftp: paramiko.SFTPClient, session: _Session) -> bool:
            self._cleanup(sftp, attempts)
            if attempts.sent:
                existing = self._read_if_present(sftp, path)
                if existing is not None:
                    return existing == bytes(data)
            tmp = self._write_temp(session, key, data, attempts)
            try:
                attempts.sent = True
                sftp.rename(tmp, path)
            except OSError:
                if not session.alive():
                    raise
                with contextlib.suppress(OSError):
                    sftp.remove(tmp)
                attempts.temps.clear()
                try:
                    attrs = sftp.stat(path)
                except FileNotFoundError:
                    raise
                if stat.S_ISDIR(attrs.st_mode or 0):
                    raise BackendError(
                        f"{self.name}: cannot create {key!r}: it is a folder of other keys"
                    ) from None
                attempts.sent = False
                return False  # taken: link() refused the existing name
            attempts.temps.clear()  # link + unlink consumed the temp file
            return True

        return self._call(f"create {key!r}", request, attempts)

    def _read_if_present(self, sftp: paramiko.SFTPClient, path: str) -> bytes | None:
        try:
            return self._read_whole(sftp, path, path)
        except ObjectNotFound:
            return None

    def _open_object(
        self, sftp: paramiko.SFTPClient, key: str, path: str, offset: int, length: int
    ) -> tuple[bytes, int, int, bytes]:
        """Open ``path`` (the object ``key``) for reading; return (handle, size, mtime,
        up to ``length`` bytes at ``offset``), read in the same round trip as the
        fstat. ObjectNotFound if absent or a folder. The caller closes the handle."""
        try:
            handle = _open_handle(sftp, path, SFTP_FLAG_READ)
        except FileNotFoundError:
            raise self._not_found(sftp, key) from None
        try:
            attrs, data, error = _stat_and_read(sftp, handle, offset, length)
            if not stat.S_ISREG(attrs.st_mode or 0):  # a folder of other keys is not an object
                raise ObjectNotFound(f"no object {key!r} on {self.name}")
            if error is not None:
                raise error
        except BaseException:
            with contextlib.suppress(Exception):
                _close_handle(sftp, handle)
            raise
        return handle, attrs.st_size or 0, attrs.st_mtime or 0, data

    def _read_whole(self, sftp: paramiko.SFTPClient, key: str, path: str) -> bytes:
        handle, size, _mtime, data = self._open_object(sftp, key, path, 0, FIRST_READ)
        try:
            return self._read_rest(sftp, handle, key, 0, size, data)
        finally:
            _close_handle(sftp, handle)

    def _read_rest(
        self,
        sftp: paramiko.SFTPClient,
        handle: bytes,
        key: str,
        offset: int,
        length: int,
        head: bytes,
    ) -> bytes:
        """``head`` (what was read at ``offset`` already) completed to ``length`` bytes."""
        head = head[:length]
        if len(head) == length:
            return head
        return head + self._read_checked(sftp, handle, key, offset + len(head), length - len(head))

    def get(self, key: str) -> bytes:
        """The whole object at ``key``; :class:`ObjectNotFound` if absent."""
        self._key(key)

        def request(sftp: paramiko.SFTPClient, _: _Session) -> bytes:
            return self._read_whole(sftp, key, self._path(key))

        return self._call(f"read {key!r}", request)

    def _read_checked(
        self,
        sftp: paramiko.SFTPClient,
        handle: bytes,
        key: str,
        offset: int,
        length: int,
    ) -> bytes:
        try:
            data = _read_exact(sftp, handle, offset, length)
        except EOFError:
            data = b""
        if len(data) != length:
            # The file shrank under us: someone rewrote it in place (never metasync).
            raise TransientError(f"{self.name}: {key!r} changed size while being read")
        return data

    def open(self, key: str) -> BinaryIO:
        """A buffered stream of the object at ``key`` (caller closes it).

        Reads are pipelined a window at a time, so memory stays flat however large
        the object. The stream holds one of the ``transfers`` sessions until closed;
        it keeps reading the version it opened even if ``key`` is replaced, and
        resumes on a new connection if its connection is lost (failing if the
        object was replaced meanwhile).
        """
        self._key(key)
        raw = _SftpStream(self, key)
        return cast(BinaryIO, io_buffered(raw))

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        """``length`` bytes at ``offset`` of ``key``; :class:`BackendError` if the
        object is shorter than ``offset + length``."""
        if offset < 0 or length < 0:
            raise ValueError(f"get_range needs offset >= 0 and length >= 0, got {offset}, {length}")
        self._key(key)

        def request(sftp: paramiko.SFTPClient, _: _Session) -> bytes:
            path = self._path(key)
            handle, size, _mtime, head = self._open_object(
                sftp, key, path, offset, min(length, FIRST_READ)
            )
            try:
                if size < offset + length:
                    raise self.truncated_error(key, offset + length, size)
                return self._read_rest(sftp, handle, key, offset, length, head)
            finally:
                _close_handle(sftp, handle)

        return self._call(f"read {key!r}", request)

    def size(self, key: str) -> int:
        """Size of the object at ``key``; :class:`ObjectNotFound` if absent."""
        self._key(key)

        def request(sftp: paramiko.SFTPClient, _: _Session) -> int:
            try:
                attrs = sftp.stat(self._path(key))
            except FileNotFoundError:
                raise self._not_found(sftp, key) from None
            if not stat.S_ISREG(attrs.st_mode or 0):
                raise ObjectNotFound(f"no object {key!r} on {self.name}")
            return int(attrs.st_size or 0)

        return self._call(f"stat {key!r}", request)

    def delete(self, key: str) -> None:
        """Remove ``key``; :class:`ObjectNotFound` if absent. If the connection was
        lost after the remove was sent, a retry that finds the key gone succeeds."""
        self._key(key)
        path = self._path(key)
        attempts = _Attempts()

        def request(sftp: paramiko.SFTPClient, _: _Session) -> None:
            try:
                attrs = sftp.lstat(path)
            except FileNotFoundError:
                if attempts.sent:
                    return  # our earlier remove took effect before the connection died
                raise self._not_found(sftp, key) from None
            if stat.S_ISDIR(attrs.st_mode or 0):
                raise ObjectNotFound(f"no object {key!r} on {self.name}")
            attempts.sent = True
            try:
                sftp.remove(path)
            except FileNotFoundError:
                raise ObjectNotFound(f"no object {key!r} on {self.name}") from None

        self._call(f"delete {key!r}", request, attempts)

    def list(self, prefix: str = "") -> Iterator[str]:
        """Every key under the folder ``prefix`` (``""``: all), recursively.

        Temp files, symlinks and names that are not valid key parts are skipped. A
        missing prefix folder yields nothing. The listing is complete when ``list``
        returns (one folder listing per folder, read eagerly).
        """
        prefix = check_prefix(prefix).rstrip("/")

        def request(sftp: paramiko.SFTPClient, _: _Session) -> builtins.list[str]:
            found: builtins.list[str] = []
            stack = [(self._path(prefix) if prefix else self.root, prefix)]
            while stack:
                folder, rel = stack.pop()
                try:
                    entries = sftp.listdir_attr(folder)
                except FileNotFoundError:
                    # The prefix names no folder, or a folder vanished mid-listing.
                    self._require_root(sftp)
                    continue
                except OSError:
                    # Listing an object (not a folder) fails on OpenSSH with a failure.
                    if rel == prefix and prefix and not self._is_folder(sftp, folder):
                        continue
                    raise
                for entry in entries:
                    name = entry.filename
                    if not is_key_part(name):
                        continue
                    key = f"{rel}/{name}" if rel else name
                    mode = entry.st_mode or 0
                    if stat.S_ISDIR(mode):
                        stack.append((posixpath.join(folder, name), key))
                    elif stat.S_ISREG(mode):
                        found.append(key)
            return found

        return iter(self._call(f"list {prefix or 'all keys'}", request))

    def _temp_files(self) -> Iterator[TempFile]:
        """Every ``.tmp-`` file under the namespace folder, one listing per folder."""

        def request(sftp: paramiko.SFTPClient, _: _Session) -> builtins.list[TempFile]:
            self._require_root(sftp)
            found: builtins.list[TempFile] = []
            stack = [(self.root, "")]
            while stack:
                folder, rel = stack.pop()
                try:
                    entries = sftp.listdir_attr(folder)
                except FileNotFoundError:
                    continue  # removed meanwhile
                for entry in entries:
                    name = entry.filename
                    path = f"{rel}/{name}" if rel else name
                    mode = entry.st_mode or 0
                    if name.startswith(TEMP_PREFIX):
                        if stat.S_ISREG(mode):
                            found.append(TempFile(path, entry.st_size or 0,
                                                  float(entry.st_mtime or 0)))
                    elif stat.S_ISDIR(mode) and is_key_part(name):
                        stack.append((posixpath.join(folder, name), path))
            return found

        return iter(self._call("list temporary files", request))

    def _remove_temp(self, path: str) -> bool:
        parts = temp_path_parts(path)
        full = posixpath.join(self.root, *parts)
        attempts = _Attempts()

        def request(sftp: paramiko.SFTPClient, _: _Session) -> bool:
            again = attempts.sent
            attempts.sent = True
            try:
                sftp.remove(full)
            except FileNotFoundError:
                return again  # gone: by an earlier attempt whose answer was lost?
            return True

        return bool(self._call(f"delete temporary file {path!r}", request, attempts))

    def _is_folder(self, sftp: paramiko.SFTPClient, path: str) -> bool:
        try:
            return stat.S_ISDIR(sftp.stat(path).st_mode or 0)
        except FileNotFoundError:
            return False

    def poll(self, key: str) -> str | None:
        """A token that changes whenever ``key`` is replaced, or None if absent.

        SFTP (v3) reports only whole-second mtimes and no inode, so two same-size
        writes within a second look alike in a stat. The token is therefore
        ``mtime:size`` plus, for objects up to :data:`POLL_HASH_LIMIT` bytes (hints
        and client records, what clients poll), a hash of the content read from the
        same open handle. For larger objects two same-size replacements within the
        same second are not told apart.
        """
        self._key(key)

        def request(sftp: paramiko.SFTPClient, _: _Session) -> str | None:
            try:
                handle, size, mtime, head = self._open_object(
                    sftp, key, self._path(key), 0, FIRST_READ
                )
            except ObjectNotFound:
                return None
            try:
                token = f"{mtime}:{size}"
                if size <= POLL_HASH_LIMIT:
                    data = self._read_rest(sftp, handle, key, 0, size, head)
                    token += ":" + hashlib.blake2b(data, digest_size=12).hexdigest()
                return token
            finally:
                _close_handle(sftp, handle)

        return self._call(f"poll {key!r}", request)


class _SftpStream(io.RawIOBase):
    """A readable stream of one object: pipelined window reads on a leased session.

    Holds its session until closed. If the connection is lost, the next read opens
    the object again on a new session and continues at the same offset, provided the
    object still has the size and mtime it had when opened (else BackendError).
    """

    def __init__(self, backend: SftpBackend, key: str) -> None:
        super().__init__()
        self._backend = backend
        self._key = key
        self._session: _Session | None = None
        self._handle = b""
        self._position = 0
        self._identity: tuple[int, int] | None = None
        self._size = 0
        self._attach()  # raises ObjectNotFound now, not at the first read

    def _attach(self) -> None:
        """Open the object on a leased session (retrying), checking it is unchanged."""
        backend = self._backend

        def attempt() -> None:
            session = backend._pool.acquire()
            try:
                handle, size, mtime, _ = backend._open_object(
                    session.sftp, self._key, backend._path(self._key), 0, 0
                )
            except BaseException as exc:
                error = backend._failure(exc, session, f"read {self._key!r}")
                backend._pool.release(session, broken=error.transient)
                if error is exc:
                    raise
                raise error from exc
            if self._identity is not None and self._identity != (size, mtime):
                _close_handle(session.sftp, handle)
                backend._pool.release(session, broken=False)
                raise BackendError(
                    f"{backend.name}: {self._key!r} was replaced while being read after a "
                    "lost connection; read it again"
                )
            self._session, self._handle = session, handle
            self._identity, self._size = (size, mtime), size

        retrying(backend._policy, f"open {self._key!r} on {backend.name}", attempt)

    def _detach(self, *, broken: bool) -> None:
        session, handle = self._session, self._handle
        self._session, self._handle = None, b""
        if session is not None and not broken:
            with contextlib.suppress(Exception):
                _close_handle(session.sftp, handle)
        if session is not None:
            self._backend._pool.release(session, broken=broken)

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        length = min(len(view), CHUNK_SIZE, self._size - self._position)
        if length <= 0:
            return 0
        backend = self._backend

        def attempt() -> bytes:
            if self._session is None:
                self._attach()
            assert self._session is not None
            try:
                return backend._read_checked(
                    self._session.sftp, self._handle, self._key, self._position, length
                )
            except BaseException as exc:
                error = backend._failure(exc, self._session, f"read {self._key!r}")
                if error.transient:
                    self._detach(broken=True)
                if error is exc:
                    raise
                raise error from exc

        data = retrying(backend._policy, f"read {self._key!r} on {backend.name}", attempt)
        view[: len(data)] = data
        self._position += len(data)
        return len(data)

    def close(self) -> None:
        if not self.closed:
            self._detach(broken=False)
        super().close()


def io_buffered(raw: io.RawIOBase) -> io.BufferedReader:
    """``raw`` behind a buffer of one pipelined window (see :data:`CHUNK_SIZE`)."""
    return io.BufferedReader(raw, buffer_size=CHUNK_SIZE)
