"""The ``webdav:`` backend against a real wsgidav server: the shared conformance suite,
plus WebDAV-only behaviour (error messages, temp files, URIs)."""

from __future__ import annotations

import io
import itertools
import os
import socket
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from metasync.backends import open_backend, typed_uri
from metasync.backends.conformance import BackendConformance, Location
from metasync.backends.logs import RegisterLogs
from metasync.backends.webdav import TEMP_PREFIX, WebdavBackend, WebdavLockLogs, WebdavsBackend
from metasync.errors import BackendError, BackendUnavailable, ObjectNotFound, UsageError
from tests.servers.faultproxy import FaultProxy
from tests.servers.webdav import WebdavServer

_counter = itertools.count()


def _namespace() -> str:
    # Unique per test within the session (the server lives for the whole session).
    return f"ns-{os.getpid()}-{next(_counter)}"


def _folder(server: WebdavServer, name: str) -> str:
    """Create the location folder ``name`` on the server's disk; return its path."""
    (server.root_dir / name).mkdir(parents=True, exist_ok=True)
    return name


class TestWebdavBackend(BackendConformance):
    """The conformance suite against wsgidav (cheroot), basic auth, on loopback."""

    backend_class = WebdavBackend

    @pytest.fixture
    def backend_location(self, webdav_server: WebdavServer) -> Location:
        return (webdav_server.uri(_folder(webdav_server, "store")), _namespace())

    @pytest.fixture
    def unicode_location(self, webdav_server: WebdavServer) -> Location:
        folder = _folder(webdav_server, "ünï cødé ☃/sub folder")
        return (webdav_server.uri(folder), _namespace())

    @pytest.fixture
    def faulty_location(self, webdav_server: WebdavServer) -> Iterator[tuple[str, str, Any]]:
        proxy = FaultProxy(webdav_server.host, webdav_server.port)
        try:
            uri = webdav_server.uri(_folder(webdav_server, "store"), port=proxy.port)
            yield (uri, _namespace(), proxy)
        finally:
            proxy.close()


# --- WebDAV-only behaviour --------------------------------------------------------------


@pytest.fixture
def dav(webdav_server: WebdavServer) -> Iterator[WebdavBackend]:
    """A created backend in a fresh namespace."""
    backend = open_backend(webdav_server.uri(_folder(webdav_server, "store")), _namespace())
    assert isinstance(backend, WebdavBackend)
    backend.create()
    yield backend
    backend.close()


def _one_line_error(excinfo: pytest.ExceptionInfo[BaseException], password: str) -> str:
    message = str(excinfo.value)
    assert "\n" not in message
    assert password not in message
    return message


def test_wrong_password_is_one_clean_line(webdav_server: WebdavServer) -> None:
    """A wrong password fails at once (not retried as transient) with one line naming
    the server and the fix, without the password."""
    uri = webdav_server.uri("store", password="wrong-password")
    backend = open_backend(uri, _namespace())
    try:
        assert "wrong-password" not in backend.name
        for operation in (backend.probe, backend.exists, lambda: backend.get("k")):
            with pytest.raises(BackendError) as info:
                operation()
            assert not info.value.transient
            assert not isinstance(info.value, BackendUnavailable | ObjectNotFound)
            message = _one_line_error(info, "wrong-password")
            assert "401" in message and "password" in message
            assert f"127.0.0.1:{webdav_server.port}" in message
    finally:
        backend.close()


def test_unreachable_port_is_unavailable(webdav_server: WebdavServer) -> None:
    """A port nobody listens on is BackendUnavailable naming the server."""
    with socket.socket() as sock:  # a port just free: nothing listens on it
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    backend = open_backend(webdav_server.uri("store", port=port), _namespace())
    try:
        with pytest.raises(BackendUnavailable) as info:
            backend.probe()
        message = _one_line_error(info, webdav_server.password)
        assert f"127.0.0.1:{port}" in message and "server running" in message
    finally:
        backend.close()


def test_missing_location_is_a_clean_error(webdav_server: WebdavServer) -> None:
    """create() at a location folder that does not exist fails with one line asking to
    create it, and creates nothing; a missing namespace is unavailable, not empty."""
    backend = open_backend(webdav_server.uri("no such folder"), _namespace())
    try:
        assert not backend.exists()
        with pytest.raises(BackendUnavailable) as info:
            backend.create()
        message = _one_line_error(info, webdav_server.password)
        assert "does not exist" in message and "create that folder" in message
        assert not (webdav_server.root_dir / "no such folder").exists()
        with pytest.raises(BackendUnavailable):
            backend.put("a/b", b"x")
        with pytest.raises(BackendUnavailable):
            list(backend.list())
        assert not (webdav_server.root_dir / "no such folder").exists()
    finally:
        backend.close()


def test_writes_leave_no_temp_files(dav: WebdavBackend, webdav_server: WebdavServer) -> None:
    """put (bytes, stream), put_if_absent (both outcomes) and append leave no temp file;
    temp files on the server are never listed."""
    dav.put("deep/er/k", b"x")
    dav.put("deep/er/s", io.BytesIO(b"y" * (3 << 20)))
    assert dav.put_if_absent("deep/p", b"1")
    assert not dav.put_if_absent("deep/p", b"2")
    dav.logs.append("deep/log", b"m")
    folder = webdav_server.root_dir / "store" / dav.namespace
    names = [n for _, dirs, files in os.walk(folder) for n in dirs + files]
    assert not [n for n in names if n.startswith(TEMP_PREFIX)], names
    (folder / "deep" / f"{TEMP_PREFIX}leftover").write_bytes(b"half")
    (folder / "stray name").write_bytes(b"by hand")
    assert f"deep/{TEMP_PREFIX}leftover" not in set(dav.list())
    assert sorted(dav.list("deep/er")) == ["deep/er/k", "deep/er/s"]


def test_uri_forms_and_password_redaction(webdav_server: WebdavServer) -> None:
    """webdavs: selects HTTPS; options are parsed; the password never shows in name;
    env credentials are used only for a typed URI without any (plain HTTP only with
    plain_http=1), never by the backend itself."""
    b = open_backend("webdavs://u:topsecret@example.invalid:8443/a/b?transfers=2", "ns")
    assert isinstance(b, WebdavsBackend)
    assert b.transfers == 2
    assert "topsecret" not in b.name and "u:***@example.invalid:8443/a/b" in b.name
    b.close()
    with pytest.raises(UsageError):
        open_backend("webdav://host/x?bogus=1", "ns")
    with pytest.raises(UsageError):
        open_backend("webdav://host/x?transfers=0", "ns")
    with pytest.raises(UsageError):
        open_backend("webdav:///x", "ns")
    env = os.environ.copy()
    try:
        os.environ["METASYNC_WEBDAV_USER"] = webdav_server.user
        os.environ["METASYNC_WEBDAV_PASSWORD"] = webdav_server.password
        (webdav_server.root_dir / "store").mkdir(exist_ok=True)
        uri = f"webdav://127.0.0.1:{webdav_server.port}/store"
        # The backend itself never takes them (a URI from the shared configuration).
        backend = open_backend(uri, _namespace())
        try:
            with pytest.raises(BackendError, match="401"):
                backend.probe()
        finally:
            backend.close()
        # A typed URI does, over plain HTTP only with plain_http=1.
        with pytest.raises(UsageError, match="plain_http=1"):
            typed_uri(uri)
        backend = open_backend(typed_uri(f"{uri}?plain_http=1"), _namespace())
        try:
            backend.probe()
        finally:
            backend.close()
    finally:
        os.environ.clear()
        os.environ.update(env)


def test_folder_is_not_an_object(dav: WebdavBackend) -> None:
    """A folder of other keys is not an object: get/size/delete say not found, poll is
    None, and delete never removes the folder."""
    dav.put("x/y", b"data")
    with pytest.raises(ObjectNotFound):
        dav.get("x")
    with pytest.raises(ObjectNotFound):
        dav.size("x")
    with pytest.raises(ObjectNotFound):
        dav.delete("x")
    assert dav.poll("x") is None
    assert dav.get("x/y") == b"data"


def test_register_logs_mode(webdav_server: WebdavServer) -> None:
    """With ``logs=registers`` (servers without locks) logs are Disk Paxos logs:
    positions are contiguous and exact, append_at writes only at the end, 3 threads
    appending at once lose and duplicate nothing, and no register is left behind."""
    folder = _folder(webdav_server, "store")
    uri = webdav_server.uri(folder) + "?logs=registers"
    namespace = _namespace()
    backend = open_backend(uri, namespace)
    assert isinstance(backend, WebdavBackend) and backend.logs_mode == "registers"
    assert isinstance(backend.logs, RegisterLogs)
    assert isinstance(open_backend(webdav_server.uri(folder), namespace).logs, WebdavLockLogs)
    backend.create()
    try:
        assert backend.logs.append("log", b"a") == 0
        assert backend.logs.append_at("log", 0, b"x") is False
        assert backend.logs.append_at("log", 1, b"b") is True
        assert backend.logs.append_at("log", 3, b"x") is False
        assert backend.logs.fetch("log") == [(0, b"a"), (1, b"b")]
        results: dict[int, list[int]] = {}

        def appender(worker: int) -> None:
            other = open_backend(uri, namespace)
            try:
                results[worker] = [other.logs.append("race", f"{worker}-{i}".encode()) for i in range(4)]
            finally:
                other.close()

        threads = [threading.Thread(target=appender, args=(w,)) for w in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        entries = backend.logs.fetch("race")
        assert [p for p, _ in entries] == list(range(12))
        assert sorted(m for _, m in entries) == sorted(
            f"{w}-{i}".encode() for w in range(3) for i in range(4)
        )
        for worker, positions in results.items():
            for i, position in enumerate(positions):
                assert entries[position][1] == f"{worker}-{i}".encode()
        # Only entries remain: every attempt removed its registers.
        names = os.listdir(webdav_server.root_dir / folder / namespace / "race")
        assert sorted(names) == [f"{p:010d}" for p in range(12)]
    finally:
        backend.close()
