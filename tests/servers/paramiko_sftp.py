"""A small SFTP server (paramiko) with the quirks of some non-OpenSSH servers.

OpenSSH's ``sftp-server`` performs the plain SFTP ``rename`` request with ``link()``,
so it refuses an existing target, which metasync's logs rely on (docs/FORMAT.md
§11.2). Other servers -- and OpenSSH on a filesystem without hard links -- replace
the target instead. This server is such a server, built from real parts: paramiko's
SSH transport and SFTP subsystem serving a folder on disk, in a process of its own
on loopback, with public-key login and its own host key. Its quirks:

- ``rename`` replaces an existing target (``os.replace``), as does
  ``posix-rename@openssh.com``;
- an ``open`` that creates a file in a missing folder answers ``SSH_FX_FAILURE``
  (a generic failure) rather than ``SSH_FX_NO_SUCH_FILE``;
- no ``fsync@openssh.com`` extension (answered "unsupported").

Fixture ``sftp_rename_overwrites`` (session-scoped): an
:class:`~tests.servers.sshd.SshServer` describing it (``uri(path)`` builds the
``sftp://`` URI; ``root_dir`` is the folder it serves, in which paths are the same
as on disk). Run as a script, the module is the server itself.
"""

from __future__ import annotations

import contextlib
import errno
import getpass
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.servers.sshd import HOST, SshServer, keygen

#: Seconds the server gets to start answering.
START_TIMEOUT = 30.0


def _serve(port: int, host_key_file: str, authorized_file: str) -> None:
    """The server process: accept SSH connections forever (until killed)."""
    import paramiko
    from paramiko import (
        SFTP_FAILURE,
        SFTP_OK,
        SFTPAttributes,
        SFTPHandle,
        SFTPServer,
        SFTPServerInterface,
    )

    host_key = paramiko.Ed25519Key.from_private_key_file(host_key_file)
    allowed = Path(authorized_file).read_text().split()[1]

    class Server(paramiko.ServerInterface):
        def check_auth_publickey(self, username: str, key: paramiko.PKey) -> int:
            if key.get_base64() == allowed:
                return paramiko.AUTH_SUCCESSFUL
            return paramiko.AUTH_FAILED

        def get_allowed_auths(self, username: str) -> str:
            return "publickey"

        def check_channel_request(self, kind: str, chanid: int) -> int:
            if kind == "session":
                return paramiko.OPEN_SUCCEEDED
            return paramiko.OPEN_FAILED_ADMINISTRATIVELY_PROHIBITED

    def status(exc: OSError) -> int:
        return SFTPServer.convert_errno(exc.errno)

    class Handle(SFTPHandle):
        def stat(self) -> Any:
            try:
                return SFTPAttributes.from_stat(os.fstat(self.readfile.fileno()))
            except OSError as exc:
                return status(exc)

        def chattr(self, attr: Any) -> int:
            return SFTP_OK

    class Files(SFTPServerInterface):
        """Paths are the client's paths, absolute on this machine's disk."""

        def canonicalize(self, path: str) -> str:
            return os.path.normpath(path if path.startswith("/") else "/" + path)

        def list_folder(self, path: str) -> Any:
            try:
                out = []
                for name in os.listdir(path):
                    attr = SFTPAttributes.from_stat(os.lstat(os.path.join(path, name)))
                    attr.filename = name
                    out.append(attr)
                return out
            except OSError as exc:
                return status(exc)

        def stat(self, path: str) -> Any:
            try:
                return SFTPAttributes.from_stat(os.stat(path))
            except OSError as exc:
                return status(exc)

        lstat = stat

        def open(self, path: str, flags: int, attr: Any) -> Any:
            if flags & os.O_CREAT and not os.path.isdir(os.path.dirname(path)):
                return SFTP_FAILURE  # quirk: not "no such file"
            try:
                fd = os.open(path, flags | getattr(os, "O_BINARY", 0), 0o644)
            except OSError as exc:
                return status(exc)
            mode = "r+b" if flags & os.O_RDWR else ("wb" if flags & os.O_WRONLY else "rb")
            if flags & os.O_APPEND:
                mode = "ab"
            handle = Handle(flags)
            stream = os.fdopen(fd, mode)
            handle.readfile = stream
            handle.writefile = stream
            handle.filename = path
            return handle

        def remove(self, path: str) -> int:
            try:
                os.remove(path)
            except OSError as exc:
                return status(exc)
            return SFTP_OK

        def rename(self, oldpath: str, newpath: str) -> int:
            try:
                os.replace(oldpath, newpath)  # quirk: replaces an existing target
            except OSError as exc:
                return status(exc)
            return SFTP_OK

        posix_rename = rename

        def mkdir(self, path: str, attr: Any) -> int:
            try:
                os.mkdir(path)
            except OSError as exc:
                return status(exc)
            return SFTP_OK

        def rmdir(self, path: str) -> int:
            try:
                os.rmdir(path)
            except OSError as exc:
                return status(exc)
            return SFTP_OK

        def chattr(self, path: str, attr: Any) -> int:
            return SFTP_OK

    def session(conn: socket.socket) -> None:
        transport = paramiko.Transport(conn)
        transport.add_server_key(host_key)
        transport.set_subsystem_handler("sftp", SFTPServer, Files)
        try:
            transport.start_server(server=Server())
            while transport.is_active():
                time.sleep(0.5)  # the transport's own threads serve; this only waits
        except (paramiko.SSHException, EOFError, OSError):
            pass
        finally:
            transport.close()

    listener = socket.create_server((HOST, port), backlog=128)
    while True:
        conn, _ = listener.accept()
        threading.Thread(target=session, args=(conn,), daemon=True).start()


def _answers_ssh(port: int) -> bool:
    try:
        with socket.create_connection((HOST, port), timeout=2) as sock:
            return sock.recv(8).startswith(b"SSH-")
    except OSError:
        return False


@contextlib.contextmanager
def run_paramiko_sftp(base: Path) -> Iterator[SshServer]:
    """The server in a process of its own, its keys and served folder under ``base``;
    stopped when the block exits."""
    conf = base / "etc"
    conf.mkdir(parents=True)
    root = base / "root"
    root.mkdir()
    host_key, user_key = conf / "ssh_host_ed25519_key", conf / "id_ed25519"
    keygen(host_key)
    keygen(user_key)
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        port = int(sock.getsockname()[1])
    known_hosts = conf / "known_hosts"
    server = SshServer(HOST, port, getpass.getuser(), user_key, known_hosts, root)
    server.known_hosts_for(port, known_hosts)
    log = base / "server.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, __file__, str(port), str(host_key), f"{user_key}.pub"],
            stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])},
        )
    try:
        deadline = time.monotonic() + START_TIMEOUT
        while not _answers_ssh(port):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the paramiko SFTP server did not start:\n{log.read_text()}")
            time.sleep(0.05)  # polling interval while waiting for readiness
        yield server
    finally:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="session")
def sftp_rename_overwrites(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SshServer]:
    """An SFTP server whose rename replaces an existing target (module docstring)."""
    with run_paramiko_sftp(tmp_path_factory.mktemp("paramiko-sftp")) as server:
        yield server


if __name__ == "__main__":
    try:
        _serve(int(sys.argv[1]), sys.argv[2], sys.argv[3])
    except KeyboardInterrupt:
        sys.exit(errno.EINTR)
