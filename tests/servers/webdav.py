"""A real WsgiDAV server (cheroot) on loopback for the ``webdav:`` backend tests.

Fixtures (registered in ``tests/conftest.py``'s ``pytest_plugins``):

``webdav_server``
    Session-scoped :class:`WebdavServer`: ``.venv/bin/wsgidav`` started as a separate
    process on ``127.0.0.1`` on a free port, serving a throwaway folder under the
    session's pytest tmp dir, with HTTP basic auth for one test user. Its
    filesystem provider renames in one step on MOVE (``wsgidav_atomic_move.py``:
    stock wsgidav deletes the destination first, so a replaced key briefly vanishes). Its fields:
    ``base_url`` (``http://127.0.0.1:PORT``), ``user``, ``password``, ``root_dir`` (the
    served folder on disk), ``host``, ``port`` and ``uri(path)`` giving a
    ``webdav://user:password@127.0.0.1:PORT/<path>`` backend URI. Readiness is
    awaited by polling the HTTP endpoint against a deadline; the server's log is in
    ``<tmp>/wsgidav.log`` and shown if it does not come up. The server and its
    children are stopped at the end of the session, also on failure.

End-to-end tests can use it directly, e.g.::

    def test_sync(webdav_server, tmp_path):
        (webdav_server.root_dir / "repo").mkdir()
        uri = webdav_server.uri("repo")
"""

from __future__ import annotations

import contextlib
import json
import os
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

#: Seconds the server gets to start answering.
START_DEADLINE = 30.0
WSGIDAV = str(Path(sys.executable).with_name("wsgidav"))


@dataclass(frozen=True)
class WebdavServer:
    """A running wsgidav server (see the module docstring)."""

    host: str
    port: int
    user: str
    password: str
    root_dir: Path
    log_file: Path

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def uri(self, path: str, *, port: int | None = None, password: str | None = None) -> str:
        """A ``webdav:`` URI for the server folder ``path`` (may be non-ASCII)."""
        segments = "/".join(quote(s, safe="") for s in path.split("/") if s)
        secret = quote(self.password if password is None else password, safe="")
        return f"webdav://{self.user}:{secret}@{self.host}:{port or self.port}/{segments}"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _log_tail(log_file: Path) -> str:
    try:
        return log_file.read_text(errors="replace")[-4000:]
    except OSError:
        return "(no log)"


def _wait_ready(proc: subprocess.Popen[bytes], server: WebdavServer) -> None:
    """Poll the endpoint until it answers, the process dies or the deadline passes."""
    deadline = time.monotonic() + START_DEADLINE
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(
                f"wsgidav exited with code {proc.returncode}:\n{_log_tail(server.log_file)}"
            )
        try:
            response = httpx.request(
                "PROPFIND",
                server.base_url + "/",
                headers={"Depth": "0"},
                auth=(server.user, server.password),
                timeout=2.0,
            )
        except httpx.HTTPError:
            # Not listening yet: wait for the process (bounded), then poll again.
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=0.1)
            continue
        if response.status_code == 207:
            return
        raise RuntimeError(
            f"wsgidav answered {response.status_code} to a PROPFIND:\n"
            f"{_log_tail(server.log_file)}"
        )
    raise RuntimeError(
        f"wsgidav did not answer within {START_DEADLINE}s:\n{_log_tail(server.log_file)}"
    )


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """Stop the server's whole process group (it was started in its own session)."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


#: wsgidav's own middleware stack (its default), which ``quirks`` extend.
_MIDDLEWARE = [
    "wsgidav.mw.cors.Cors",
    "wsgidav.error_printer.ErrorPrinter",
    "wsgidav.http_authenticator.HTTPAuthenticator",
    "wsgidav.dir_browser.WsgiDavDirBrowser",
    "wsgidav.request_resolver.RequestResolver",
]


@contextlib.contextmanager
def run_wsgidav(workdir: Path, quirks: tuple[str, ...] = ()) -> Iterator[WebdavServer]:
    """Run wsgidav serving ``workdir/root`` until the block exits. ``quirks`` names
    middlewares of ``wsgidav_faults.py`` (e.g. ``"RefuseLockedMove"``), placed after
    authentication, that make the server answer some requests as other servers do."""
    root = workdir / "root"
    root.mkdir(parents=True, exist_ok=True)
    user, password = "metasync-test", "s3cret pass/wörd"
    port = _free_port()
    config = {
        "host": "127.0.0.1",
        "port": port,
        "server": "cheroot",
        # Enough workers for 6 client processes plus 8-thread object stores.
        "server_args": {"numthreads": 40},
        # Stock wsgidav deletes a MOVE's destination before renaming onto it; this
        # provider renames in one step (see wsgidav_atomic_move.py for why).
        "provider_mapping": {
            "/": {"class": "wsgidav_atomic_move.AtomicMoveProvider", "args": [str(root)]}
        },
        "http_authenticator": {
            "domain_controller": None,
            "accept_basic": True,
            "accept_digest": False,
            "default_to_digest": False,
        },
        "simple_dc": {"user_mapping": {"*": {user: {"password": password}}}},
        "dir_browser": {"enable": False},
        "middleware_stack": [*_MIDDLEWARE[:3], *(f"wsgidav_faults.{q}" for q in quirks),
                             *_MIDDLEWARE[3:]],
        "lock_storage": True,
        "property_manager": None,
        "verbose": 2,
        "logging": {"enable_loggers": []},
    }
    config_file = workdir / "wsgidav.json"
    config_file.write_text(json.dumps(config))
    log_file = workdir / "wsgidav.log"
    server = WebdavServer("127.0.0.1", port, user, password, root, log_file)
    with open(log_file, "wb") as log:
        proc = subprocess.Popen(
            [WSGIDAV, "--config", str(config_file)],
            cwd=workdir,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, "PYTHONPATH": str(Path(__file__).parent)},
        )
    try:
        _wait_ready(proc, server)
        yield server
    finally:
        _stop(proc)


@pytest.fixture(scope="session")
def webdav_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WebdavServer]:
    """A wsgidav server for the whole session (see the module docstring)."""
    with run_wsgidav(tmp_path_factory.mktemp("wsgidav")) as server:
        yield server


@pytest.fixture(scope="session")
def webdav_refusing_locked_move(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WebdavServer]:
    """A wsgidav server that grants LOCK but answers 412 to every MOVE carrying a
    lock token (``wsgidav_faults.RefuseLockedMove``)."""
    with run_wsgidav(tmp_path_factory.mktemp("wsgidav-lockmove"), ("RefuseLockedMove",)) as server:
        yield server


@pytest.fixture(scope="session")
def webdav_500_for_missing_folder(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[WebdavServer]:
    """A wsgidav server that answers 500, not 409, to a PUT into a missing folder
    (``wsgidav_faults.Answer500ForMissingFolder``)."""
    with run_wsgidav(tmp_path_factory.mktemp("wsgidav-500"), ("Answer500ForMissingFolder",)) as server:
        yield server
