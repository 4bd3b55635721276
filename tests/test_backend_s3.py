"""The ``s3:`` backend against real SeaweedFS S3 servers (tests/servers/seaweedfs.py):
the shared conformance suite on a single ``weed server`` and on a multi-process
cluster, S3-specific behaviour, and an end-to-end push that loses a volume server."""

from __future__ import annotations

import io
import itertools
import os
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import METASYNC, PASSPHRASE, make_tree, run_cli, snapshot
from metasync.backends import open_backend
from metasync.backends.conformance import BackendConformance, Location, pattern_bytes
from metasync.backends.s3 import NAMESPACE_MARKER, S3Backend
from metasync.errors import BackendError, BackendUnavailable, ObjectNotFound, UsageError
from tests.servers.faultproxy import FaultProxy
from tests.servers.seaweedfs import HOST, SECRET_KEY, SeaweedCluster, SeaweedS3, free_ports

MiB = 1 << 20
UNICODE_PREFIX = "ünï cødé ☃/with space"
_counter = itertools.count()


def fresh_namespace() -> str:
    """Unique per test (and per session, as the server's bucket outlives a run's tests)."""
    return f"ns-{next(_counter)}-{uuid.uuid4().hex[:8]}"


class TestS3Backend(BackendConformance):
    """The conformance suite against a single-process SeaweedFS S3 server."""

    backend_class = S3Backend

    @pytest.fixture
    def backend_location(self, seaweedfs: SeaweedS3) -> Location:
        return (seaweedfs.uri("conformance"), fresh_namespace())

    @pytest.fixture
    def unicode_location(self, seaweedfs: SeaweedS3) -> Location:
        return (seaweedfs.uri(UNICODE_PREFIX), fresh_namespace())

    @pytest.fixture
    def faulty_location(self, seaweedfs: SeaweedS3) -> Iterator[tuple[str, str, FaultProxy]]:
        proxy = FaultProxy(HOST, seaweedfs.port)
        try:
            uri = seaweedfs.uri("faulty", endpoint=f"http://{HOST}:{proxy.port}")
            yield (uri, fresh_namespace(), proxy)
        finally:
            proxy.close()


class TestS3Cluster(BackendConformance):
    """The conformance suite against a multi-process SeaweedFS cluster (master, two
    volume servers, filer, S3 gateway)."""

    backend_class = S3Backend

    @pytest.fixture
    def backend_location(self, seaweedfs_cluster: SeaweedCluster) -> Location:
        return (seaweedfs_cluster.uri("conformance"), fresh_namespace())

    @pytest.fixture
    def unicode_location(self, seaweedfs_cluster: SeaweedCluster) -> Location:
        return (seaweedfs_cluster.uri(UNICODE_PREFIX), fresh_namespace())

    @pytest.fixture
    def faulty_location(
        self, seaweedfs_cluster: SeaweedCluster
    ) -> Iterator[tuple[str, str, FaultProxy]]:
        proxy = FaultProxy(HOST, seaweedfs_cluster.port)
        try:
            uri = seaweedfs_cluster.uri("faulty", endpoint=f"http://{HOST}:{proxy.port}")
            yield (uri, fresh_namespace(), proxy)
        finally:
            proxy.close()


# --- S3-specific behaviour ----------------------------------------------------------------


@pytest.fixture
def s3(seaweedfs: SeaweedS3) -> Iterator[S3Backend]:
    """A created backend in the single-server bucket."""
    backend = S3Backend(seaweedfs.uri("specific"), fresh_namespace())
    backend.create()
    yield backend
    backend.close()


def _one_line(exc: BaseException) -> str:
    message = str(exc)
    assert "\n" not in message, message
    return message


def test_uri_options_and_layout(seaweedfs: SeaweedS3) -> None:
    """Keys live at PREFIX/namespace/key; create() writes only the namespace marker,
    which is never listed; exists() sees the marker or any key."""
    namespace = fresh_namespace()
    backend = S3Backend(seaweedfs.uri("lay/out") + "&transfers=2&region=eu-west-1", namespace)
    client = seaweedfs.client()
    try:
        assert backend.transfers == 2
        assert not backend.exists()
        backend.create()
        assert backend.exists()
        names = [
            o["Key"]
            for o in client.list_objects_v2(Bucket=seaweedfs.bucket, Prefix="lay/out/")["Contents"]
        ]
        assert names == [f"lay/out/{namespace}/{NAMESPACE_MARKER}"]
        backend.put("a/b", b"x")
        assert (
            client.get_object(Bucket=seaweedfs.bucket, Key=f"lay/out/{namespace}/a/b")[
                "Body"
            ].read()
            == b"x"
        )
        assert list(backend.list()) == ["a/b"]
        # Without the marker, a namespace holding keys still exists.
        client.delete_object(Bucket=seaweedfs.bucket, Key=f"lay/out/{namespace}/{NAMESPACE_MARKER}")
        assert backend.exists()
    finally:
        backend.close()


@pytest.mark.parametrize(
    ("uri", "match"),
    [
        ("s3://", "no bucket"),
        ("s3:///prefix", "no bucket"),
        ("s3://b/p?colour=red", "unknown option 'colour'"),
        ("s3://b/p?transfers=0", "transfers"),
        ("s3://b/p?transfers=many", "transfers"),
        ("s3://b/p?timeout=0", "timeout"),
    ],
)
def test_bad_uris_are_usage_errors(uri: str, match: str) -> None:
    """Malformed URIs and unknown options fail when opened, before any request."""
    with pytest.raises(UsageError, match=match):
        open_backend(uri, "ns")


def test_missing_bucket_is_a_one_line_error(seaweedfs: SeaweedS3) -> None:
    """A missing bucket is a permanent BackendError naming the bucket and the fix;
    nothing creates it."""
    uri = f"s3://no-such-bucket-here/p?endpoint={seaweedfs.endpoint}"
    backend = open_backend(uri, "ns")
    try:
        for operation in (backend.probe, backend.create, lambda: list(backend.list())):
            with pytest.raises(BackendError) as info:
                operation()
            message = _one_line(info.value)
            assert not info.value.transient
            assert "no-such-bucket-here" in message and "create the bucket" in message
        names = [b["Name"] for b in seaweedfs.client().list_buckets()["Buckets"]]
        assert "no-such-bucket-here" not in names
    finally:
        backend.close()


def test_wrong_credentials_are_a_one_line_error(
    seaweedfs: SeaweedS3, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rejected credentials are a permanent BackendError that says to check them."""
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY + "-wrong")
    backend = open_backend(seaweedfs.uri("specific"), "ns")
    try:
        for operation in (backend.probe, lambda: backend.get("k"), lambda: backend.put("k", b"x")):
            with pytest.raises(BackendError) as info:
                operation()
            assert not info.value.transient
            assert not isinstance(info.value, ObjectNotFound)
            assert "credentials" in _one_line(info.value)
    finally:
        backend.close()


def test_unreachable_endpoint_is_unavailable() -> None:
    """Nothing listening at the endpoint: BackendUnavailable naming it, after retries."""
    (port,) = free_ports(1)
    backend = open_backend(f"s3://bucket/p?endpoint=http://{HOST}:{port}", "ns")
    try:
        for operation in (backend.probe, lambda: backend.get("k"), backend.exists):
            with pytest.raises(BackendUnavailable) as info:
                operation()
            assert f"{HOST}:{port}" in _one_line(info.value)
        assert backend.policy.retries > 0
    finally:
        backend.close()


def test_conditional_writes_are_enforced_by_the_server(s3: S3Backend) -> None:
    """The server itself rejects If-None-Match: * on an existing key and a stale
    If-Match (what put_if_absent and replace_if rely on)."""
    s3.put("k", b"one")
    token = s3.poll("k")
    assert token is not None and token.startswith('"')
    assert s3.put_if_absent("k", b"two") is False
    s3.put("k", b"changed")
    assert s3.replace_if("k", b"three", token) is False
    assert s3.get("k") == b"changed"
    assert s3.replace_if("k", b"three", str(s3.poll("k"))) is True
    assert s3.get("k") == b"three"


def test_multipart_upload_of_a_stream(s3: S3Backend, seaweedfs: SeaweedS3) -> None:
    """A stream longer than two parts is uploaded in parts and reads back exactly; no
    unfinished upload is left behind."""
    size = 2 * 8 * MiB + 12345
    data = pattern_bytes(9, 0, size)
    s3.put("multi", io.BytesIO(data))
    assert s3.size("multi") == size
    assert s3.get_range("multi", 8 * MiB - 3, 6) == data[8 * MiB - 3 : 8 * MiB + 3]
    with s3.open("multi") as f:
        assert f.read() == data
    uploads = seaweedfs.client().list_multipart_uploads(Bucket=seaweedfs.bucket).get("Uploads", [])
    assert not [u for u in uploads if u["Key"].startswith(s3.base)]


class _FailingStream(io.RawIOBase):
    def __init__(self, good: int) -> None:
        super().__init__()
        self.left = good

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        if self.left <= 0:
            raise RuntimeError("source went away")
        n = min(len(buffer), self.left)
        buffer[:n] = b"z" * n
        self.left -= n
        return n


def test_failed_stream_keeps_old_object(s3: S3Backend, seaweedfs: SeaweedS3) -> None:
    """A source stream failing after two parts: its error propagates, the old object
    stays, and the multipart upload is aborted."""
    s3.put("k", b"old")
    with pytest.raises(RuntimeError, match="source went away"):
        s3.put("k", io.BufferedReader(_FailingStream(20 * MiB)))
    assert s3.get("k") == b"old"
    uploads = seaweedfs.client().list_multipart_uploads(Bucket=seaweedfs.bucket).get("Uploads", [])
    assert not [u for u in uploads if u["Key"].startswith(s3.base)]


def test_open_resumes_after_connection_reset(seaweedfs: SeaweedS3) -> None:
    """A stream from open() whose connection breaks mid-object resumes with a ranged
    GET and still returns exactly the object. (The proxy cannot reset a connection
    whose other end is blocked in a read, so the client may see a read timeout
    instead of a reset: both are transient.)"""
    proxy = FaultProxy(HOST, seaweedfs.port)
    backend = S3Backend(
        seaweedfs.uri("resume", endpoint=f"http://{HOST}:{proxy.port}") + "&timeout=3",
        fresh_namespace(),
    )
    try:
        backend.create()
        data = pattern_bytes(13, 0, 24 * MiB)
        backend.put("big", data)
        with backend.open("big") as f:
            first = f.read(MiB)
            before = proxy.injected
            proxy.break_connections(reset_next=1)
            rest = f.read()
        assert proxy.injected > before
        assert first + rest == data
    finally:
        backend.close()
        proxy.close()


def test_open_of_a_replaced_object_fails_instead_of_mixing(seaweedfs: SeaweedS3) -> None:
    """If the object is overwritten while a stream is interrupted, the resumed read
    fails (If-Match) rather than splicing two versions."""
    proxy = FaultProxy(HOST, seaweedfs.port)
    backend = S3Backend(
        seaweedfs.uri("resume", endpoint=f"http://{HOST}:{proxy.port}") + "&timeout=3",
        fresh_namespace(),
    )
    try:
        backend.create()
        backend.put("big", pattern_bytes(14, 0, 24 * MiB))
        with backend.open("big") as f:
            f.read(MiB)
            backend.put("big", pattern_bytes(15, 0, 24 * MiB))
            proxy.break_connections()
            with pytest.raises(BackendError, match="replaced while"):
                f.read()
    finally:
        backend.close()
        proxy.close()


# --- end to end on the cluster ---------------------------------------------------------------


def test_push_survives_losing_a_volume_server(
    seaweedfs_cluster: SeaweedCluster, tmp_path: Path
) -> None:
    """A push to the cluster (plus two dir: backends) loses a volume server midway:
    it succeeds or fails with a one-line error; after the server restarts a push
    completes, a clone is identical and fsck passes."""
    cluster = seaweedfs_cluster
    src = tmp_path / "src"
    make_tree(src, small_files=300, big_mb=16)
    dirs = [tmp_path / "d0", tmp_path / "d1"]
    for d in dirs:
        d.mkdir()
    s3_uri = cluster.uri(f"e2e-{uuid.uuid4().hex[:8]}")
    run_cli(
        "init", str(src), "--replicas", "2",
        "--backend", s3_uri, "--backend", f"dir:{dirs[0]}", "--backend", f"dir:{dirs[1]}",
    )  # fmt: skip
    client = cluster.client()
    prefix = s3_uri.split("?")[0].split("/", 3)[3] + "/"

    def stored() -> int:
        page = client.list_objects_v2(Bucket=cluster.bucket, Prefix=prefix, MaxKeys=1000)
        return int(page.get("KeyCount", 0))

    at_start = stored()
    env = {**os.environ, "METASYNC_PASSPHRASE": PASSPHRASE}
    push = subprocess.Popen(
        [METASYNC, "push", "-m", "first"],
        cwd=src,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
    )
    killed = False
    try:
        # Kill once the push has stored some objects on S3 (or finished first).
        while push.poll() is None:
            if stored() > at_start:
                cluster.kill_volume(1)
                killed = True
                break
        _out, err = push.communicate(timeout=600)
    finally:
        if push.poll() is None:
            push.kill()
            push.wait()
        if not killed:
            cluster.kill_volume(1)  # the push was too quick: still test the restart path
    if push.returncode != 0:
        lines = [line for line in err.splitlines() if line.strip()]
        assert lines and "Traceback" not in err, err
    cluster.start_volume(1)
    # The second push completes whatever the first one left undone.
    (src / "after-restart.txt").write_text("written after the volume server came back\n")
    run_cli("push", "-m", "after restart", cwd=src)
    clone = tmp_path / "clone"
    run_cli("clone", s3_uri, str(clone))
    assert snapshot(clone) == snapshot(src)
    run_cli("fsck", cwd=clone)
