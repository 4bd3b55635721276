"""A real OpenSSH server on loopback for the ``sftp:`` backend tests.

Fixtures (session-scoped, registered in tests/conftest.py ``pytest_plugins``):

``sshd_server``
    An :class:`SshServer`, a named tuple ``(host, port, user, identity_file,
    known_hosts_file, root_dir)``: ``/usr/sbin/sshd -D -e`` listening on
    ``127.0.0.1:<free port>`` with a throwaway ed25519 host key, logging in
    ``user`` (the current user, root in CI) with the throwaway key
    ``identity_file`` only (no passwords). ``known_hosts_file`` holds the host key
    for ``[127.0.0.1]:<port>``; ``root_dir`` is an empty folder the tests may fill
    (``server.uri(path)`` builds an ``sftp://`` URI for a path below it). The SFTP
    subsystem is OpenSSH's ``internal-sftp``, i.e. the same code as ``sftp-server``.
    For a :class:`~tests.servers.faultproxy.FaultProxy` in front of the server,
    ``server.known_hosts_for(port, file)`` writes a known_hosts file naming the
    proxy's port.

The server and every per-connection child it forked are stopped at the end of the
session, even if tests failed. If sshd does not accept connections within
:data:`START_TIMEOUT` seconds the fixture fails with sshd's log.
"""

from __future__ import annotations

import contextlib
import getpass
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import pytest

SSHD = shutil.which("sshd") or "/usr/sbin/sshd"
#: Seconds to wait for sshd to accept connections.
START_TIMEOUT = 30.0
HOST = "127.0.0.1"


class SshServer(NamedTuple):
    """Where the test sshd listens and how to log in to it."""

    host: str
    port: int
    user: str
    identity_file: Path
    known_hosts_file: Path
    root_dir: Path

    def host_key_line(self, port: int) -> str:
        """The known_hosts line for this server's host key reached at ``port``."""
        public = (self.known_hosts_file.parent / "ssh_host_ed25519_key.pub").read_text().split()
        return f"[{self.host}]:{port} {public[0]} {public[1]}\n"

    def known_hosts_for(self, port: int, path: Path) -> Path:
        """Write a known_hosts file trusting this server's host key at ``port``."""
        path.write_text(self.host_key_line(port))
        return path

    def uri(
        self,
        path: Path | str,
        *,
        port: int | None = None,
        known_hosts: Path | None = None,
        identity: Path | None = None,
        **options: str,
    ) -> str:
        """An ``sftp://`` URI for the absolute ``path`` on this server (percent-encoded)."""
        query = {
            "identity": str(identity or self.identity_file),
            "known_hosts": str(known_hosts or self.known_hosts_file),
            **options,
        }
        quoted = urllib.parse.quote(str(path))
        return (
            f"sftp://{self.user}@{self.host}:{port or self.port}{quoted}"
            f"?{urllib.parse.urlencode(query)}"
        )


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


def keygen(path: Path) -> None:
    """Make an unencrypted ed25519 key pair ``path`` and ``path.pub``."""
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "metasync-test", "-f", str(path)],
        check=True,
        capture_output=True,
    )


def _answers_ssh(port: int) -> bool:
    """True once something on ``port`` sends an SSH protocol banner."""
    try:
        with socket.create_connection((HOST, port), timeout=2) as sock:
            return sock.recv(8).startswith(b"SSH-")
    except OSError:
        return False


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (per-connection sshd children and their helpers)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        # The command name may contain spaces and parentheses: parse after the last ')'.
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    found: list[int] = []
    stack = [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            found.append(child)
            stack.append(child)
    return found


def _stop(proc: subprocess.Popen[bytes]) -> None:
    # Per-connection children call setsid() and outlive the listener, so collect
    # them while they are still below it, then stop them all.
    victims = [*_descendants(proc.pid), proc.pid]
    for pid in victims:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    for pid in victims[:-1]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@pytest.fixture(scope="session")
def sshd_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SshServer]:
    """A running OpenSSH server on loopback (see the module docstring)."""
    if not os.path.exists(SSHD):
        pytest.fail(f"{SSHD} not found: install openssh-server (bin/setup-system)")
    try:
        with run_sshd(tmp_path_factory.mktemp("sshd")) as server:
            yield server
    except SshdError as exc:
        pytest.fail(str(exc))


class SshdError(RuntimeError):
    """sshd could not be started."""


@contextlib.contextmanager
def run_sshd(base: Path) -> Iterator[SshServer]:
    """sshd with its configuration, keys and served folder under ``base``, stopped
    (with every per-connection child) when the block exits; raises
    :class:`SshdError` if it does not come up (the benchmarks use it too)."""
    if not os.path.exists(SSHD):
        raise SshdError(f"{SSHD} not found: install openssh-server (bin/setup-system)")
    conf_dir = base / "etc"
    conf_dir.mkdir(parents=True)
    root = base / "root"
    root.mkdir()
    host_key = conf_dir / "ssh_host_ed25519_key"
    user_key = conf_dir / "id_ed25519"
    keygen(host_key)
    keygen(user_key)
    authorized = conf_dir / "authorized_keys"
    shutil.copy(f"{user_key}.pub", authorized)
    # sshd refuses to start without its privilege separation folder.
    Path("/run/sshd").mkdir(mode=0o755, parents=True, exist_ok=True)
    port = _free_port()
    user = getpass.getuser()
    config = conf_dir / "sshd_config"
    config.write_text(
        "\n".join(
            [
                f"Port {port}",
                f"ListenAddress {HOST}",
                f"HostKey {host_key}",
                f"PidFile {base / 'sshd.pid'}",
                f"AuthorizedKeysFile {authorized}",
                "AuthenticationMethods publickey",
                "PubkeyAuthentication yes",
                "PasswordAuthentication no",
                "KbdInteractiveAuthentication no",
                "PermitRootLogin prohibit-password",
                f"AllowUsers {user}",
                "StrictModes no",
                "UsePAM no",
                "UseDNS no",
                # The suite opens many connections at once (6 processes, each a pool).
                "MaxStartups 200",
                "MaxSessions 100",
                "Subsystem sftp internal-sftp",
                "LogLevel INFO",
                "",
            ]
        )
    )
    log_path = base / "sshd.log"
    known_hosts = conf_dir / "known_hosts"
    server = SshServer(HOST, port, user, user_key, known_hosts, root)
    server.known_hosts_for(port, known_hosts)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [SSHD, "-D", "-e", "-f", str(config)],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + START_TIMEOUT
        while not _answers_ssh(port):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SshdError(
                    f"sshd did not start on port {port} (exit code {proc.poll()}):\n"
                    + log_path.read_text(errors="replace")
                )
            time.sleep(0.05)  # polling interval while waiting for readiness
        yield server
    finally:
        _stop(proc)
