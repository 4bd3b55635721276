"""The ``rclone:`` backend: the conformance suite against an rclone local remote
and an rclone sftp remote on a real OpenSSH server, plus URI and error-message tests."""

from __future__ import annotations

import itertools
import os
import uuid
from pathlib import Path
from typing import Any

import pytest

from metasync.backends import open_backend
from metasync.backends.conformance import BackendConformance, Location
from metasync.backends.rclone import RcloneBackend, parse_uri
from metasync.errors import BackendError, UsageError
from tests.servers.rclone import RcloneEnv

_counter = itertools.count()


def _namespace() -> str:
    return f"ns{next(_counter)}-{uuid.uuid4().hex[:8]}"


class TestRcloneLocal(BackendConformance):
    """The suite against a configured ``type = local`` remote; the unicode location
    uses a ``:local:`` connection string instead of a configured remote."""

    backend_class = RcloneBackend
    # rcd removes a partial upload: the put is killed with its upload complete.
    kill_put_before = "_move"
    # Disk Paxos over rclone rcd costs ~15 rc calls an append: 6 x 8 keeps the
    # 6-way contention at a quarter of the test's time.
    appends_per_worker = 8
    # A listing is one rc call that answers everything (rclone pages the remote
    # itself): no page of ours to go beyond, and each key costs a put through rcd
    # (1,537 keys: 25-29 s a class; 300: ~2 s).
    many_keys = 300
    # A local remote has no connection to break. Its faulty_location could only be
    # the sftp remote behind the fault proxy, which TestRcloneSftp tests already
    # (the same URI, rclone config and proxy): a second run would repeat it exactly,
    # at ~60 s (rclone's backoff between SSH reconnects, see TestRcloneSftp).
    transient_faults = False

    @pytest.fixture
    def backend_location(self, rclone_env: RcloneEnv) -> Location:
        return (rclone_env.uri(f"local:{rclone_env.local_dir}"), _namespace())

    @pytest.fixture
    def unicode_location(self, rclone_env: RcloneEnv) -> Location:
        folder = rclone_env.local_dir / "ünï cødé ☃ 名前"
        folder.mkdir(exist_ok=True)
        return (rclone_env.uri(f":local:{folder}"), _namespace())


class TestRcloneSftp(BackendConformance):
    """The suite against an rclone sftp remote on the real OpenSSH server."""

    backend_class = RcloneBackend
    # rcd removes a partial upload: the put is killed with its upload complete.
    kill_put_before = "_move"
    # Disk Paxos over rclone rcd costs ~15 rc calls an append: 6 x 8 keeps the
    # 6-way contention at a quarter of the test's time.
    appends_per_worker = 8
    # A listing is one rc call that answers everything (rclone pages the remote
    # itself): no page of ours to go beyond, and each key costs a put through rcd
    # (1,537 keys: 25-29 s a class; 300: ~2 s).
    many_keys = 300

    @pytest.fixture
    def backend_location(self, rclone_env: RcloneEnv) -> Location:
        return (rclone_env.uri(f"ssh:{rclone_env.ssh_root}/store"), _namespace())

    @pytest.fixture
    def unicode_location(self, rclone_env: RcloneEnv) -> Location:
        return (rclone_env.uri(f"ssh:{rclone_env.ssh_root}/ünï cødé ☃"), _namespace())

    # rclone's sftp backend paces new SSH connections itself (the wait doubles after
    # each failed connect, up to 2 s, and shrinks by a quarter after each good one):
    # with two failed connects per operation, test_transient_errors_are_retried took
    # 60.9 s here, all of it that backoff (~3 s on the paramiko sftp: backend); one
    # per operation still makes every operation reconnect and retry, in 30.9 s.
    failed_reconnects = 1

    @pytest.fixture
    def faulty_location(self, rclone_env: RcloneEnv) -> tuple[str, str, Any]:
        return (rclone_env.uri(f"sshfaulty:{rclone_env.ssh_root}/faulty"), _namespace(), rclone_env.proxy)


# --- URIs and error messages ------------------------------------------------------------


def test_parse_uri_options() -> None:
    """Options after the last '?' are parsed; the remote path keeps its colons."""
    opts = parse_uri("rclone::webdav,url='http://h:1':dir/sub?config=/c%20d.conf&transfers=7")
    assert opts.location == ":webdav,url='http://h:1':dir/sub"
    assert opts.config == "/c d.conf"
    assert opts.transfers == 7
    assert opts.binary is None
    assert parse_uri("rclone:remote:").transfers == 4


@pytest.mark.parametrize(
    "uri", ["rclone:nocolon", "rclone::", "rclone:r:x?bogus=1", "rclone:r:x?transfers=0"]
)
def test_bad_uris_rejected(uri: str) -> None:
    """A URI without REMOTE: or with an unknown/invalid option is a UsageError."""
    with pytest.raises(UsageError):
        open_backend(uri, "ns")


def test_missing_remote_is_one_clean_error(rclone_env: RcloneEnv) -> None:
    """A remote name absent from the config: one line naming it and the fix, not
    retried as transient."""
    backend = open_backend(rclone_env.uri("nosuchremote:x"), "ns")
    try:
        with pytest.raises(BackendError) as info:
            backend.exists()
        message = str(info.value)
        assert "'nosuchremote:'" in message and "rclone config" in message
        assert "\n" not in message
        assert not info.value.transient
    finally:
        backend.close()


def test_missing_binary_is_one_clean_error(rclone_env: RcloneEnv, tmp_path: Path) -> None:
    """A binary that does not exist: one line telling how to install rclone."""
    missing = tmp_path / "no-rclone-here"
    backend = open_backend(
        rclone_env.uri(f"local:{rclone_env.local_dir}", binary=str(missing)), "ns"
    )
    try:
        with pytest.raises(BackendError) as info:
            backend.exists()
        message = str(info.value)
        assert str(missing) in message and "install rclone" in message
        assert "\n" not in message
        assert not info.value.transient
    finally:
        backend.close()


def test_missing_location_is_unavailable(rclone_env: RcloneEnv) -> None:
    """create() of a namespace in a missing location names it; nothing is created."""
    missing = rclone_env.local_dir / "not-there"
    backend = open_backend(rclone_env.uri(f"local:{missing}"), "ns")
    try:
        with pytest.raises(BackendError, match="does not exist"):
            backend.create()
        assert not missing.exists()
    finally:
        backend.close()


def test_close_stops_rcd(rclone_env: RcloneEnv) -> None:
    """The rcd process an instance started is gone after close()."""
    backend = open_backend(rclone_env.uri(f"local:{rclone_env.local_dir}"), _namespace())
    assert isinstance(backend, RcloneBackend)
    backend.create()
    daemon = backend._daemon
    assert daemon is not None and daemon.proc is not None
    proc = daemon.proc
    backend.close()
    assert proc.poll() is not None


def _rclone_processes() -> dict[int, list[bytes]]:
    """pid -> argv of every rclone process this test process started (its children)."""
    found: dict[int, list[bytes]] = {}
    me = os.getpid()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue  # gone meanwhile
        ppid = int(stat.rpartition(")")[2].split()[1])
        if ppid == me and argv and Path(argv[0].decode(errors="replace")).name == "rclone":
            found[int(entry.name)] = argv
    return found


def test_rc_credentials_are_not_on_the_command_line(rclone_env: RcloneEnv) -> None:
    """Any local user can read /proc/PID/cmdline, and rclone's remote control can dump
    every remote's credentials: the rc user and password must not be in rclone's argv
    (they go through its environment, readable only by this user). The backend still
    works with them."""
    backend = open_backend(rclone_env.uri(f"local:{rclone_env.local_dir}"), _namespace())
    assert isinstance(backend, RcloneBackend)
    try:
        backend.create()
        backend.put("a/b", b"payload")
        assert backend.get("a/b") == b"payload"
        daemon = backend._daemon
        assert daemon is not None and daemon.proc is not None
        user, password = daemon.auth
        processes = _rclone_processes()
        assert daemon.proc.pid in processes
        for argv in processes.values():
            joined = b" ".join(argv)
            assert password.encode() not in joined and user.encode() not in joined
            assert b"--rc-pass" not in argv and b"--rc-user" not in argv
    finally:
        backend.close()


def test_a_claim_without_its_key_is_never_swept(rclone_env: RcloneEnv) -> None:
    """An old claim ``.tmp-<hex>.<name>`` stands for key ``<name>`` while that key is
    missing (a put killed between its two moves): sweeping it would delete the
    object, so it is kept; once the key exists the claim is a leftover and goes,
    with the plain ``.tmp-<hex>`` uploads."""
    namespace = _namespace()
    backend = open_backend(rclone_env.uri(f"local:{rclone_env.local_dir}"), namespace)
    try:
        backend.create()
        folder = Path(rclone_env.local_dir) / namespace / "objects"
        folder.mkdir()
        standing = folder / ".tmp-0123456789abcdef.alone"
        leftover = folder / ".tmp-00112233445566ff.kept"
        upload = folder / ".tmp-fedcba9876543210"
        for path in (standing, leftover, upload):
            path.write_bytes(b"object")
            os.utime(path, (1_000_000_000, 1_000_000_000))
        backend.put("objects/kept", b"object")
        assert sorted(backend.list()) == ["objects/alone", "objects/kept"]
        swept = backend.sweep_temp_files(2_000_000_000, delete=True)
        assert sorted(t.path for t in swept) == [
            "objects/.tmp-00112233445566ff.kept", "objects/.tmp-fedcba9876543210"]
        assert standing.exists() and not leftover.exists() and not upload.exists()
    finally:
        backend.close()
