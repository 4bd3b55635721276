"""The benchmarks' backend servers, each behind an emulated wide-area link.

The servers are the ones the tests use (``tests/servers/``), started the same
way: SeaweedFS (S3), OpenSSH (SFTP), wsgidav (WebDAV), on loopback with data
under ``bench/work/servers/``. In front of each, a :class:`wanproxy.WanProxy`
with the profile's link; metasync, rclone and restic all connect through the
proxies, so every tool crosses the same links.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from benchlib import RCLONE, ROOT, WORK_DIR, log
from wanproxy import BACKEND_KINDS, PROFILES, LinkSpec, WanProxy

sys.path.insert(0, str(ROOT))
from tests.servers.seaweedfs import (
    ACCESS_KEY,
    SECRET_KEY,
    SeaweedS3,
    aws_credentials,
    run_seaweedfs,
)
from tests.servers.sshd import SshServer, run_sshd
from tests.servers.webdav import WebdavServer, run_wsgidav

BUCKET = "metasync-bench"


@dataclass
class Servers:
    """The three running servers."""

    s3: SeaweedS3
    sftp: SshServer
    webdav: WebdavServer
    base: Path

    def port(self, kind: str) -> int:
        return {"s3": self.s3.port, "sftp": self.sftp.port, "webdav": self.webdav.port}[kind]


@contextlib.contextmanager
def running_servers(base: Path = WORK_DIR / "servers") -> Iterator[Servers]:
    """Start S3, SFTP and WebDAV servers with fresh data under ``base``."""
    if base.exists():
        shutil.rmtree(base)
    base.mkdir(parents=True)
    log("starting SeaweedFS (S3), OpenSSH (SFTP) and wsgidav (WebDAV) on loopback")
    with aws_credentials(), run_seaweedfs(base / "s3", BUCKET) as s3, \
            run_sshd(base / "sshd") as sftp, run_wsgidav(base / "webdav") as webdav:
        try:
            yield Servers(s3, sftp, webdav, base)
        finally:
            log("stopping the servers")
    shutil.rmtree(base, ignore_errors=True)


class Links:
    """One proxy per backend kind, with a profile's links; URIs and configs for
    every tool that go through them."""

    def __init__(self, servers: Servers, profile: str, scratch: Path) -> None:
        self.servers = servers
        self.profile = profile
        self.specs: dict[str, LinkSpec] = PROFILES[profile]
        self.proxies = {k: WanProxy("127.0.0.1", servers.port(k), self.specs[k])
                        for k in BACKEND_KINDS}
        scratch.mkdir(parents=True, exist_ok=True)
        self.known_hosts = scratch / "known_hosts"
        sftp = servers.sftp
        self.known_hosts.write_text(
            sftp.host_key_line(sftp.port) + sftp.host_key_line(self.proxies["sftp"].port))
        self.rclone_config = scratch / "rclone.conf"
        self._write_rclone_config()

    def close(self) -> None:
        for proxy in self.proxies.values():
            proxy.close()

    def stats(self) -> dict[str, dict[str, int]]:
        return {k: p.stats() for k, p in self.proxies.items()}

    # -- locations ---------------------------------------------------------------------
    def make_location(self, kind: str, path: str) -> None:
        """Create the folder ``path`` on server ``kind`` (SFTP and WebDAV need it)."""
        if kind == "sftp":
            (self.servers.sftp.root_dir / path).mkdir(parents=True, exist_ok=True)
        elif kind == "webdav":
            (self.servers.webdav.root_dir / path).mkdir(parents=True, exist_ok=True)

    def metasync_uri(self, kind: str, path: str) -> str:
        port = self.proxies[kind].port
        if kind == "s3":
            return f"s3://{BUCKET}/{path}?endpoint=http://127.0.0.1:{port}"
        if kind == "sftp":
            return self.servers.sftp.uri(self.servers.sftp.root_dir / path, port=port,
                                         known_hosts=self.known_hosts)
        return self.servers.webdav.uri(path, port=port)

    def rclone_remote(self, kind: str, path: str) -> str:
        if kind == "s3":
            return f"s3:{BUCKET}/{path}"
        if kind == "sftp":
            return f"sftp:{self.servers.sftp.root_dir / path}"
        return f"webdav:{path}"

    def restic_repo(self, path: str) -> str:
        return f"s3:http://127.0.0.1:{self.proxies['s3'].port}/{BUCKET}/{path}"

    def env(self) -> dict[str, str]:
        """Credentials every tool reads from the environment."""
        web = self.servers.webdav
        return {
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_EC2_METADATA_DISABLED": "true",
            "METASYNC_WEBDAV_USER": web.user,
            "METASYNC_WEBDAV_PASSWORD": web.password,
            "RCLONE_CONFIG": str(self.rclone_config),
        }

    def _write_rclone_config(self) -> None:
        sftp, web = self.servers.sftp, self.servers.webdav
        obscured = subprocess.run([str(RCLONE), "obscure", web.password], check=True,
                                  capture_output=True, text=True).stdout.strip()
        p = {k: v.port for k, v in self.proxies.items()}
        self.rclone_config.write_text(
            f"[s3]\ntype = s3\nprovider = SeaweedFS\naccess_key_id = {ACCESS_KEY}\n"
            f"secret_access_key = {SECRET_KEY}\nendpoint = http://127.0.0.1:{p['s3']}\n\n"
            f"[sftp]\ntype = sftp\nhost = 127.0.0.1\nport = {p['sftp']}\nuser = {sftp.user}\n"
            f"key_file = {sftp.identity_file}\nknown_hosts_file = {self.known_hosts}\n"
            "shell_type = none\nmd5sum_command = none\nsha1sum_command = none\n\n"
            f"[webdav]\ntype = webdav\nurl = http://127.0.0.1:{p['webdav']}/\nvendor = other\n"
            f"user = {web.user}\npass = {obscured}\n"
        )
