"""The ``sftp:`` backend against a real OpenSSH server on loopback (tests/servers/sshd.py):
the shared conformance suite, plus host key, authentication and location errors."""

from __future__ import annotations

import itertools
import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from metasync.backends import open_backend
from metasync.backends.conformance import BackendConformance, Location
from metasync.backends.sftp import TEMP_PREFIX, SftpBackend
from metasync.errors import BackendError, BackendUnavailable, UsageError
from tests.servers.faultproxy import fault_proxy
from tests.servers.sshd import SshServer, keygen

_counter = itertools.count()


def _fresh_namespace() -> str:
    return f"ns{next(_counter)}-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="session")
def sftp_store(sshd_server: SshServer) -> Path:
    """The location folder every conformance test shares (namespaces keep them apart)."""
    store = sshd_server.root_dir / "store"
    store.mkdir(exist_ok=True)
    return store


class TestSftpBackend(BackendConformance):
    """The conformance suite against ``sftp://root@127.0.0.1:<port>/<tmp>/store``."""

    backend_class = SftpBackend

    @pytest.fixture
    def backend_location(self, sshd_server: SshServer, sftp_store: Path) -> Location:
        return (sshd_server.uri(sftp_store), _fresh_namespace())

    @pytest.fixture
    def unicode_location(self, sshd_server: SshServer) -> Location:
        store = sshd_server.root_dir / f"ünï cødé ☃ {uuid.uuid4().hex[:6]}"
        store.mkdir()
        return (sshd_server.uri(store), "ns")

    @pytest.fixture
    def faulty_location(
        self, sshd_server: SshServer, sftp_store: Path, tmp_path: Path
    ) -> Iterator[tuple[str, str, Any]]:
        with fault_proxy(sshd_server.host, sshd_server.port) as proxy:
            known_hosts = sshd_server.known_hosts_for(proxy.port, tmp_path / "known_hosts")
            uri = sshd_server.uri(sftp_store, port=proxy.port, known_hosts=known_hosts)
            yield (uri, _fresh_namespace(), proxy)


# --- sftp-only behaviour -------------------------------------------------------------


def _one_line(error: BaseException) -> str:
    message = str(error)
    assert "\n" not in message, message
    return message


def test_raw_utf8_path_is_the_same_location(sshd_server: SshServer, sftp_store: Path) -> None:
    """A path given as raw UTF-8 (not percent-encoded) names the same folder."""
    folder = sshd_server.root_dir / "raw ünï ☃"
    folder.mkdir()
    encoded = open_backend(sshd_server.uri(folder), "ns")
    query = encoded.uri.split("?", 1)[1]
    raw_uri = f"sftp://{sshd_server.user}@{sshd_server.host}:{sshd_server.port}{folder}?{query}"
    assert "%" in encoded.uri.split("?")[0] and "ü" in raw_uri
    raw = open_backend(raw_uri, "ns")
    try:
        encoded.create()
        encoded.put("k", b"v")
        assert raw.get("k") == b"v"
        assert (folder / "ns" / "k").read_bytes() == b"v"
    finally:
        encoded.close()
        raw.close()


def test_unknown_host_key_is_rejected(
    sshd_server: SshServer, sftp_store: Path, tmp_path: Path
) -> None:
    """A host missing from known_hosts is refused with one line naming it, its
    fingerprint and the ssh-keyscan fix; nothing is added to known_hosts."""
    empty = tmp_path / "known_hosts"
    empty.write_text("")
    backend = open_backend(sshd_server.uri(sftp_store, known_hosts=empty), "ns")
    try:
        with pytest.raises(BackendError) as info:
            backend.exists()
    finally:
        backend.close()
    message = _one_line(info.value)
    assert not info.value.transient
    assert f"[{sshd_server.host}]:{sshd_server.port}" in message
    assert "SHA256:" in message
    assert f"ssh-keyscan -p {sshd_server.port} {sshd_server.host} >> {empty}" in message
    assert empty.read_text() == ""


def test_changed_host_key_is_rejected(
    sshd_server: SshServer, sftp_store: Path, tmp_path: Path
) -> None:
    """A known_hosts entry with another key for the host is refused as a changed key."""
    other = tmp_path / "other_key"
    keygen(other)
    public = (tmp_path / "other_key.pub").read_text().split()
    known = tmp_path / "known_hosts"
    known.write_text(f"[{sshd_server.host}]:{sshd_server.port} {public[0]} {public[1]}\n")
    backend = open_backend(sshd_server.uri(sftp_store, known_hosts=known), "ns")
    try:
        with pytest.raises(BackendError) as info:
            backend.exists()
    finally:
        backend.close()
    message = _one_line(info.value)
    assert not info.value.transient
    assert "CHANGED" in message and "ssh-keygen -R" in message


def test_wrong_key_is_a_clean_auth_error(
    sshd_server: SshServer, sftp_store: Path, tmp_path: Path
) -> None:
    """A key the server does not accept is a one-line, non-transient auth error."""
    stranger = tmp_path / "stranger"
    keygen(stranger)
    backend = open_backend(sshd_server.uri(sftp_store, identity=stranger), "ns")
    try:
        with pytest.raises(BackendError) as info:
            backend.exists()
    finally:
        backend.close()
    message = _one_line(info.value)
    assert not info.value.transient
    assert "authentication" in message and sshd_server.user in message
    assert str(stranger) in message


def test_missing_identity_file(sshd_server: SshServer, sftp_store: Path, tmp_path: Path) -> None:
    """A missing identity file is named in a one-line error."""
    missing = tmp_path / "nope"
    backend = open_backend(sshd_server.uri(sftp_store, identity=missing), "ns")
    with pytest.raises(BackendError, match="identity file") as info:
        backend.probe()
    assert str(missing) in _one_line(info.value)


def test_missing_location_is_unavailable(sshd_server: SshServer) -> None:
    """probe() and create() on a location folder that does not exist fail with one line
    naming the folder; nothing is created."""
    missing = sshd_server.root_dir / "not-there"
    backend = open_backend(sshd_server.uri(missing), "ns")
    try:
        assert not backend.exists()
        for operation in (backend.probe, backend.create):
            with pytest.raises(BackendUnavailable) as info:
                operation()
            message = _one_line(info.value)
            assert str(missing) in message and "create it" in message
        assert not missing.exists()
    finally:
        backend.close()


def test_deleted_namespace_is_an_error_not_empty(sshd_server: SshServer, sftp_store: Path) -> None:
    """Once the namespace folder is gone, reads and writes fail naming it (a missing
    key is not reported) and nothing recreates it."""
    namespace = _fresh_namespace()
    backend = open_backend(sshd_server.uri(sftp_store), namespace)
    try:
        backend.create()
        backend.put("a/k", b"x")
        folder = sftp_store / namespace
        (folder / "a" / "k").unlink()
        (folder / "a").rmdir()
        folder.rmdir()
        for operation in (
            lambda: backend.get("a/k"),
            lambda: backend.put("a/k", b"y"),
            lambda: backend.put_if_absent("b", b"y"),
            lambda: list(backend.list()),
            lambda: backend.poll("k"),
            lambda: backend.logs.append("log", b"m"),
        ):
            with pytest.raises(BackendError) as info:
                operation()
            assert "missing" in _one_line(info.value)
        assert not folder.exists()
    finally:
        backend.close()


def test_unreachable_server_is_unavailable(sshd_server: SshServer, sftp_store: Path) -> None:
    """A port nobody listens on is BackendUnavailable naming host and port."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    backend = open_backend(sshd_server.uri(sftp_store, port=port), "ns")
    with pytest.raises(BackendUnavailable) as info:
        backend.probe()
    assert f"127.0.0.1:{port}" in _one_line(info.value)


@pytest.mark.parametrize(
    "uri",
    [
        "sftp://host",
        "sftp://host:notaport/x",
        "sftp://host/x?colour=blue",
        "sftp://host/x?transfers=0",
        "sftp:/x",
    ],
)
def test_bad_uris_are_usage_errors(uri: str) -> None:
    """Malformed URIs, relative paths and unknown or bad options are UsageErrors."""
    with pytest.raises(UsageError):
        SftpBackend(uri, "ns")


def test_password_never_shown(sshd_server: SshServer) -> None:
    """A password in the URI does not appear in the backend's name or errors."""
    backend = SftpBackend("sftp://u:s3cret@127.0.0.1:1/x", "ns")
    assert "s3cret" not in backend.name
    with pytest.raises(BackendError) as info:
        backend.probe()
    assert "s3cret" not in str(info.value)


def test_temp_files_are_not_listed_and_writes_leave_none(
    sshd_server: SshServer, sftp_store: Path
) -> None:
    """Leftover temp files are never listed; put, put_if_absent (both outcomes) and
    append leave none behind."""
    namespace = _fresh_namespace()
    backend = open_backend(sshd_server.uri(sftp_store), namespace)
    try:
        backend.create()
        backend.put("d/k", b"x")
        assert backend.put_if_absent("d/p", b"1")
        assert not backend.put_if_absent("d/p", b"2")
        backend.logs.append("d/log", b"m")
        names = [n for _, dirs, files in os.walk(sftp_store / namespace) for n in dirs + files]
        assert not [n for n in names if n.startswith(TEMP_PREFIX)], names
        (sftp_store / namespace / "d" / f"{TEMP_PREFIX}0000000001").write_bytes(b"torn")
        assert sorted(backend.list()) == ["d/k", "d/log/0000000000", "d/p"]
        assert backend.logs.fetch("d/log") == [(0, b"m")]
    finally:
        backend.close()


def test_transfers_bounds_sessions(sshd_server: SshServer, sftp_store: Path) -> None:
    """With transfers=1 one session serves everything, including after an open stream
    is closed, from several threads."""
    from concurrent.futures import ThreadPoolExecutor

    namespace = _fresh_namespace()
    backend = open_backend(sshd_server.uri(sftp_store, transfers="1"), namespace)
    try:
        backend.create()
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda i: backend.put(f"k/{i}", str(i).encode()), range(32)))
        with backend.open("k/3") as f:
            assert f.read() == b"3"
        assert sorted(backend.list("k")) == sorted(f"k/{i}" for i in range(32))
        assert isinstance(backend, SftpBackend) and backend.transfers == 1
    finally:
        backend.close()
