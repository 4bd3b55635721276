"""Shared settings are data, never instructions (issue 16, points 1 and 4).

The repository configuration every client follows is written by whoever holds the
key (and, before it is authenticated, by whoever stores it). Nothing in it may make
this client run a program, read a file, or send its credentials somewhere:

- a backend URI's local options (rclone's ``binary=``, ``config=``, sftp's
  ``identity=``...) never go into the configuration, and one found there is dropped;
- a backend another client added is used only once this client has connected it
  (``metasync backend connect``), except a ``dir:`` folder that already holds this
  repository's descriptor for that backend; until then it is reported and counted
  as unavailable, and the rest keeps working;
- environment passwords go only to the host of a URI typed on this machine.

The attacker here is a key holder: an in-process client that decides a
configuration change whose new backend carries a URI of its choosing (what a
forged configuration or old code would hold), through the real change machinery.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import socket
import stat
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import METASYNC, PASSPHRASE, backend_dirs, run_cli
from metasync.maintenance import reconfig
from metasync.objects import FORMAT_VERSION, BackendSpec, Config
from metasync.repository import Repository
from tests.servers.webdav import WebdavServer

RCLONE = str(Path(sys.executable).with_name("rclone"))
FAST = ["--settle", "0.5", "--poll", "0.5", "--rescan", "5"]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["METASYNC_PASSPHRASE"] = PASSPHRASE
    return env


def _wait_until(condition: Callable[[], Any], what: str, timeout: float = 60.0) -> Any:
    """Poll ``condition`` every 0.2 s until it is truthy (failing with ``what``)."""
    import time

    deadline = time.monotonic() + timeout
    pause = threading.Event()
    while True:
        try:
            result = condition()
            if result:
                return result
        except (OSError, ValueError):
            pass
        if time.monotonic() >= deadline:
            pytest.fail(f"timed out after {timeout:g}s waiting for {what}")
        pause.wait(0.2)


def _forge_backend(root: Path, typed: str, shared: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """As the key holder in ``root``: add the backend at ``typed`` (which it reaches
    itself) under the shared URI ``shared`` -- a configuration change every client
    follows. Returns the new backend's id."""
    real = reconfig.new_backend_spec

    def forged(uri: str, capacity: float | None, current: Config) -> BackendSpec:
        spec = real(uri, capacity, current)
        return BackendSpec(spec.id, shared, spec.capacity)

    with monkeypatch.context() as patch:
        patch.setattr(reconfig, "new_backend_spec", forged)
        patch.setenv("METASYNC_PASSPHRASE", PASSPHRASE)
        with Repository.open(root) as repo:
            change = repo.add_backend(typed)
    added = next(b for b in change.new.backends if b.id not in change.old.backend_ids)
    assert added.uri == shared
    return added.id


@pytest.fixture
def three_clients(tmp_path: Path) -> tuple[Path, Path, Path]:
    """A key holder ``a`` and two victims, on two ``dir:`` backends."""
    b = backend_dirs(tmp_path, "b1", "b2")
    a, v1, v2 = tmp_path / "a", tmp_path / "victim", tmp_path / "victim2"
    a.mkdir()
    (a / "notes.txt").write_text("hello\n")
    run_cli("init", str(a), "--backend", f"dir:{b['b1']}", "--backend", f"dir:{b['b2']}")
    run_cli("push", "-m", "first", cwd=a)
    run_cli("clone", f"dir:{b['b1']}", str(v1))
    run_cli("clone", f"dir:{b['b2']}", str(v2))
    return a, v1, v2


def _status(root: Path) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((root / ".metasync" / "daemon.json").read_text())
    return doc


def test_a_shared_rclone_binary_is_never_run(
    three_clients: tuple[Path, Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Point 1: the key holder commits an executable ``payload`` (which leaves a marker
    naming the folder it ran in, then runs rclone) and adds a backend
    ``rclone::local:/x?binary=./payload`` to the configuration. Neither the victim's
    ``pull`` nor the other victim's daemon runs it: the backend is reported as not
    connected, with the command that connects it, and everything else keeps working."""
    a, v1, v2 = three_clients
    payload = a / "payload"
    payload.write_text(
        "#!/bin/sh\n"
        'touch "$PWD/../PWNED-$(basename "$PWD")"\n'
        f'exec {RCLONE} "$@"\n'
    )
    payload.chmod(payload.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    run_cli("push", "-m", "a tool", cwd=a)
    for victim in (v1, v2):
        run_cli("pull", cwd=victim)
        assert os.access(victim / "payload", os.X_OK)
    store = tmp_path / "x"
    store.mkdir()
    evil = f"rclone::local:{store}?binary=./payload"
    monkeypatch.chdir(a)  # where the key holder's own ./payload is
    evil_id = _forge_backend(a, evil, evil, monkeypatch)
    (a / "after.txt").write_text("pushed after the change\n")
    run_cli("push", "-m", "after", cwd=a)

    pulled = run_cli("pull", cwd=v1)
    assert not (tmp_path / "PWNED-victim").exists(), "the victim's pull ran the payload"
    assert f"metasync backend connect {evil_id}" in pulled.stderr
    assert (v1 / "after.txt").read_text() == "pushed after the change\n"

    log = open(tmp_path / "daemon.out", "ab")  # noqa: SIM115
    daemon = subprocess.Popen([METASYNC, "daemon", *FAST], cwd=v2, env=_env(),
                              stdin=subprocess.DEVNULL, stdout=log, stderr=log)
    log.close()
    try:
        _wait_until(lambda: (v2 / "after.txt").exists() and _status(v2)["state"] == "idle",
                    "the daemon to sync the version after the change")
    finally:
        daemon.send_signal(signal.SIGTERM)
        assert daemon.wait(timeout=60) == 0
    assert not (tmp_path / "PWNED-victim2").exists(), "the victim's daemon ran the payload"


class CredentialTrap:
    """A loopback HTTP listener that answers every request 500 and records each
    request's ``Authorization`` header (a foreign host a URI may name)."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port: int = self.sock.getsockname()[1]
        self.requests = 0
        self.credentials: list[str] = []
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(5)
                data = b""
                try:
                    while b"\r\n\r\n" not in data:
                        chunk = conn.recv(65536)
                        if not chunk:
                            break
                        data += chunk
                except OSError:
                    continue
                head = data.partition(b"\r\n\r\n")[0].decode(errors="replace")
                self.requests += 1
                for line in head.split("\r\n")[1:]:
                    name, _, value = line.partition(":")
                    if name.strip().lower() == "authorization":
                        self.credentials.append(value.strip())
                try:
                    conn.sendall(b"HTTP/1.1 500 Trap\r\nContent-Length: 0\r\n"
                                 b"Connection: close\r\n\r\n")
                except OSError:
                    pass

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def trap() -> Iterator[CredentialTrap]:
    t = CredentialTrap()
    yield t
    t.close()


def test_environment_credentials_go_to_no_foreign_host(
    three_clients: tuple[Path, Path, Path], webdav_server: WebdavServer,
    trap: CredentialTrap, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Point 4: the victim keeps its WebDAV password in the environment. The key
    holder adds a WebDAV backend whose shared URI names a loopback listener of its
    own, over plain HTTP. The victim's pull, ``backend connect ID`` (the shared URI)
    and ``backend connect ID URI`` (typed, plain HTTP) send it no credential."""
    a, v1, _ = three_clients
    folder = "trapped"
    (webdav_server.root_dir / folder).mkdir()
    foreign = f"webdav://127.0.0.1:{trap.port}/{folder}"
    backend_id = _forge_backend(a, webdav_server.uri(folder), foreign, monkeypatch)
    monkeypatch.setenv("METASYNC_WEBDAV_USER", webdav_server.user)
    monkeypatch.setenv("METASYNC_WEBDAV_PASSWORD", webdav_server.password)
    secret = base64.b64encode(
        f"{webdav_server.user}:{webdav_server.password}".encode()).decode()

    run_cli("pull", cwd=v1)
    assert not trap.credentials, "the victim's pull sent its password to the listener"

    refused = run_cli("backend", "connect", backend_id, cwd=v1, check=False)
    assert refused.returncode != 0 and "Traceback" not in refused.stderr
    typed = run_cli("backend", "connect", backend_id, foreign, cwd=v1, check=False)
    assert typed.returncode != 0 and "Traceback" not in typed.stderr
    assert "plain_http=1" in typed.stderr.strip().splitlines()[-1]
    assert all(secret not in c for c in trap.credentials) and not trap.credentials


def test_every_local_option_is_an_option_of_its_backend() -> None:
    """The local option lists name real options (a typo would share the option)."""
    from metasync.backends import LOCAL_OPTIONS, cloud, rclone, s3, sftp

    known = {"rclone": set(rclone._OPTIONS), "sftp": set(sftp._OPTIONS),
             "s3": set(s3._OPTIONS), "webdav": {"transfers", "timeout", "ca", "logs", "plain_http"}}
    known["webdavs"] = known["webdav"]
    for provider in ("dropbox", "box", "onedrive", "gdrive"):
        known[provider] = set(cloud.CLOUD_URI_OPTIONS)
    for scheme, local in LOCAL_OPTIONS.items():
        assert local <= known[scheme], scheme


@pytest.mark.parametrize(("uri", "shared"), [
    ("rclone::local:/x?binary=./payload", "rclone::local:/x"),
    ("rclone:r:a?b?config=/c&transfers=3&binary=x", "rclone:r:a?b?transfers=3"),
    ("sftp://u:pw@h:2/p?identity=%2Fk&logs=registers&known_hosts=/kh", "sftp://u@h:2/p?logs=registers"),
    ("webdavs://u:pw@h/p?ca=/ca.pem&plain_http=1&transfers=2", "webdavs://u@h/p?transfers=2"),
    ("s3://b/p?endpoint=http://h:1&profile=work", "s3://b/p?endpoint=http://h:1"),
    ("dropbox:/f?account=work&api=http://evil&ca=/x&timeout=5", "dropbox:/f?timeout=5"),
    ("dir:/a?b", "dir:/a?b"),
])
def test_public_uri_drops_passwords_and_local_options(uri: str, shared: str) -> None:
    from metasync.backends import public_uri

    assert public_uri(uri) == shared


def _config_doc(root: Path) -> str:
    import sqlite3

    conn = sqlite3.connect(root / ".metasync" / "state.db")
    try:
        return str(conn.execute(
            "SELECT value FROM settings WHERE key = 'config_doc'").fetchone()[0])
    finally:
        conn.close()


def test_local_options_stay_local_and_connect_brings_them(tmp_path: Path) -> None:
    """Point 1 (a) and (c): ``backend add`` of an rclone URI with ``config=`` and
    ``binary=`` shares neither (this client keeps them); another client reports the
    backend as not connected, with its id, until ``backend connect ID URI`` gives
    its own; then it uses it (real rclone) and reports nothing."""
    b = backend_dirs(tmp_path, "b1", "b2")
    store = tmp_path / "rstore"
    store.mkdir()
    a, other = tmp_path / "a", tmp_path / "other"
    a.mkdir()
    (a / "f.txt").write_text("one\n")
    run_cli("init", str(a), "--backend", f"dir:{b['b1']}", "--backend", f"dir:{b['b2']}")
    run_cli("push", cwd=a)
    run_cli("clone", f"dir:{b['b1']}", str(other))
    conf = tmp_path / "rclone.conf"
    conf.write_text("[here]\ntype = local\n")
    uri = f"rclone:here:{store}?config={conf}&binary={RCLONE}"
    run_cli("backend", "add", uri, cwd=a)
    listing = json.loads(run_cli("backend", "list", "--json", cwd=a).stdout)
    added = next(x for x in listing["backends"] if x["uri"].startswith("rclone:"))
    assert added["uri"] == f"rclone:here:{store}"
    for doc in (_config_doc(a), _config_doc(other)):
        assert str(conf) not in doc and RCLONE not in doc

    pulled = run_cli("pull", cwd=other)
    assert f"metasync backend connect {added['id']}" in pulled.stderr
    # The rest keeps working: a push goes to the backends this client has.
    (other / "h.txt").write_text("before connecting\n")
    run_cli("push", cwd=other)
    # Without a URI: the shared one has no config=, so rclone does not know 'here:'.
    assert run_cli("backend", "connect", added["id"], cwd=other, check=False).returncode != 0
    wrong = run_cli("backend", "connect", added["id"], f"dir:{b['b2']}", cwd=other, check=False)
    assert wrong.returncode != 0 and "another repository or backend" in wrong.stderr
    done = run_cli("backend", "connect", added["id"], uri, cwd=other)
    assert f"connected backend {added['id']}" in done.stdout and str(conf) not in done.stdout
    (other / "g.txt").write_text("two\n")
    pushed = run_cli("push", cwd=other)
    assert "not connected" not in pushed.stderr
    run_cli("pull", cwd=a)
    assert (a / "g.txt").read_text() == "two\n"
    assert (a / "h.txt").read_text() == "before connecting\n"
    assert run_cli("fsck", cwd=other, check=False).returncode == 0


def test_a_folder_of_older_metasync_keeps_using_its_backends_after_the_upgrade(
        tmp_path: Path) -> None:
    """Older metasync (local format 3) kept a URI of its own only for backends with a
    password, and used every other one as the configuration named it. After the
    upgrade its folder still uses them all, once, as it reached them: an rclone
    remote defined in rclone's environment is not 'not connected'."""
    from metasync.localdb import LocalDB
    from metasync.state import LocalState

    b = backend_dirs(tmp_path, "b1")
    store = tmp_path / "rstore"
    store.mkdir()
    env = {"RCLONE_CONFIG_ENVREMOTE_TYPE": "local"}
    a = tmp_path / "a"
    a.mkdir()
    (a / "f.txt").write_text("one\n")
    run_cli("init", str(a), "--backend", f"dir:{b['b1']}", "--backend",
            f"rclone:envremote:{store}", env_extra=env)
    db = LocalDB(a / ".metasync" / "state.db")
    try:
        state = LocalState(db)
        with state.transaction():  # as older metasync left it
            state.uri_overrides = {}
            state.format = 3
    finally:
        db.close()
    pushed = run_cli("push", cwd=a, env_extra=env)
    assert "not connected" not in pushed.stderr, pushed.stderr
    assert any(store.rglob("objects/*/*")), "nothing was pushed to the rclone backend"
    db = LocalDB(a / ".metasync" / "state.db")
    try:
        state = LocalState(db)
        assert state.format == FORMAT_VERSION and len(state.uri_overrides) == 2
    finally:
        db.close()
