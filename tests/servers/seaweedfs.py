"""SeaweedFS S3 servers for the ``s3:`` backend tests (``.venv/bin/weed``).

Two session-scoped fixtures, both on 127.0.0.1 with explicit free ports (gRPC
ports included) and throwaway data folders under pytest's tmp dir:

``seaweedfs``
    One ``weed server -s3`` process (master, volume server, filer and S3 gateway
    in one), with a bucket ``metasync-tests``.
``seaweedfs_cluster``
    A cluster of separate processes: ``weed master`` (no replication), two
    ``weed volume`` servers, ``weed filer`` and ``weed s3``, with a bucket ``metasync-cluster``.
    :meth:`SeaweedCluster.kill_volume` and :meth:`SeaweedCluster.start_volume`
    stop and restart one volume server (on the same data folder).

Both use one S3 identity whose keys the fixtures put into ``AWS_ACCESS_KEY_ID``
and ``AWS_SECRET_ACCESS_KEY`` for the whole session, so backends opened from a
URI (in this process, in spawned children and in ``metasync`` CLI processes)
find them through the standard AWS chain. Readiness is polled against a
deadline; a server that does not come up fails the fixture with its log.
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
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

WEED = str(Path(sys.executable).with_name("weed"))
ACCESS_KEY = "metasync-test-key"
SECRET_KEY = "metasync-test-secret-0123456789"
#: Seconds a server gets to come up (or shut down) before the fixture fails.
DEADLINE = 60.0
HOST = "127.0.0.1"
#: Seconds a server gets to exit on SIGTERM before it is killed.
STOP_GRACE = 2.0


def free_ports(count: int) -> list[int]:
    """``count`` distinct ports that were free a moment ago (all bound at once, so
    no two are the same)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind((HOST, 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def _tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


class Process:
    """One server process in its own process group, logging to ``log``."""

    def __init__(self, name: str, args: list[str], log: Path, cwd: Path) -> None:
        self.name = name
        self.args = args
        self.log = log
        self.cwd = cwd
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with open(self.log, "ab") as out:
            # A new session: stop() signals the whole group, children included.
            self.proc = subprocess.Popen(
                self.args,
                cwd=self.cwd,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )

    def check_running(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            code = None if self.proc is None else self.proc.returncode
            raise RuntimeError(f"{self.name} exited ({code}); log:\n{_tail(self.log)}")

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """Signal the process group and wait for the process; SIGKILL after a short
        grace period (``weed server`` can hang in its shutdown, and the data folder
        is thrown away anyway)."""
        proc = self.proc
        if proc is None:
            return
        self.proc = None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=STOP_GRACE)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        # Anything left in the group (there should be nothing) goes too.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)


def wait_for(what: str, ready: Callable[[], bool], processes: list[Process]) -> None:
    """Poll ``ready()`` until true; fail with the processes' logs at the deadline or
    as soon as one of them exits."""
    deadline = time.monotonic() + DEADLINE
    while True:
        for process in processes:
            process.check_running()
        try:
            if ready():
                return
        except Exception:
            pass
        if time.monotonic() > deadline:
            logs = "\n".join(f"--- {p.name}:\n{_tail(p.log)}" for p in processes)
            raise RuntimeError(f"{what} not ready after {DEADLINE}s\n{logs}")
        time.sleep(0.1)  # polling interval of a readiness check, not synchronization


def port_open(port: int) -> bool:
    try:
        with socket.create_connection((HOST, port), timeout=1):
            return True
    except OSError:
        return False


def s3_client(endpoint: str) -> Any:
    """A boto3 client for ``endpoint`` with the test identity (short timeouts)."""
    import boto3
    from botocore.config import Config

    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id=ACCESS_KEY,
        aws_secret_access_key=SECRET_KEY,
        region_name="us-east-1",
        config=Config(
            s3={"addressing_style": "path"},
            retries={"total_max_attempts": 1},
            connect_timeout=5,
            read_timeout=30,
        ),
    )


def _write_identity(folder: Path) -> Path:
    path = folder / "s3.json"
    path.write_text(
        json.dumps(
            {
                "identities": [
                    {
                        "name": "metasync",
                        "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
                        "actions": ["Admin", "Read", "Write", "List", "Tagging"],
                    }
                ]
            }
        )
    )
    return path


def _bucket_writable(endpoint: str, bucket: str) -> Callable[[], bool]:
    """A readiness check: the bucket exists (created if needed) and takes a write,
    which needs the volume servers registered with the master."""
    client = s3_client(endpoint)

    def ready() -> bool:
        with contextlib.suppress(Exception):
            client.create_bucket(Bucket=bucket)
        client.put_object(Bucket=bucket, Key="readiness-probe", Body=b"ok")
        client.delete_object(Bucket=bucket, Key="readiness-probe")
        return True

    return ready


@contextlib.contextmanager
def aws_credentials() -> Iterator[None]:
    """The test identity in the environment (inherited by child processes)."""
    names = (
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_PROFILE",
        "AWS_EC2_METADATA_DISABLED",
    )
    saved = {name: os.environ.get(name) for name in names}
    os.environ["AWS_ACCESS_KEY_ID"] = ACCESS_KEY
    os.environ["AWS_SECRET_ACCESS_KEY"] = SECRET_KEY
    os.environ.pop("AWS_PROFILE", None)
    os.environ["AWS_EC2_METADATA_DISABLED"] = "true"  # never probe a cloud metadata service
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@dataclass
class SeaweedS3:
    """A running SeaweedFS S3 endpoint with one bucket."""

    endpoint: str
    port: int
    bucket: str
    processes: list[Process] = field(default_factory=list)

    def client(self) -> Any:
        return s3_client(self.endpoint)

    def uri(self, prefix: str = "", endpoint: str | None = None) -> str:
        """An ``s3:`` URI for ``prefix`` in the bucket (optionally via another endpoint)."""
        path = f"{self.bucket}/{prefix}" if prefix else self.bucket
        return f"s3://{path}?endpoint={endpoint or self.endpoint}"

    def stop(self) -> None:
        for process in reversed(self.processes):
            process.stop()


@contextlib.contextmanager
def run_seaweedfs(root: Path, bucket: str = "metasync-tests") -> Iterator[SeaweedS3]:
    """One ``weed server -s3`` process with data under ``root`` and ``bucket``
    created, stopped when the block exits (the benchmarks use it too)."""
    (root / "data").mkdir(parents=True, exist_ok=True)
    identity = _write_identity(root)
    master, master_grpc, volume, volume_grpc, filer, filer_grpc, s3, s3_grpc = free_ports(8)
    server = Process(
        "weed server",
        [
            WEED,
            "server",
            f"-dir={root / 'data'}",
            f"-ip={HOST}",
            f"-ip.bind={HOST}",
            f"-master.port={master}",
            f"-master.port.grpc={master_grpc}",
            "-master.volumeSizeLimitMB=128",
            f"-volume.port={volume}",
            f"-volume.port.grpc={volume_grpc}",
            "-volume.max=100",
            "-volume.preStopSeconds=0",  # exit at once on SIGTERM (default: drain 10 s)
            f"-filer.port={filer}",
            f"-filer.port.grpc={filer_grpc}",
            "-s3",
            f"-s3.port={s3}",
            f"-s3.port.grpc={s3_grpc}",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            f"-s3.config={identity}",
        ],
        root / "server.log",
        root,
    )
    service = SeaweedS3(f"http://{HOST}:{s3}", s3, bucket, [server])
    with aws_credentials():
        try:
            server.start()
            wait_for("SeaweedFS S3", _bucket_writable(service.endpoint, service.bucket), [server])
            yield service
        finally:
            service.stop()


@pytest.fixture(scope="session")
def seaweedfs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedS3]:
    """One ``weed server -s3`` process with bucket ``metasync-tests``."""
    with run_seaweedfs(tmp_path_factory.mktemp("seaweedfs")) as service:
        yield service


@dataclass
class SeaweedCluster(SeaweedS3):
    """A multi-process SeaweedFS cluster; volume servers can be killed and restarted."""

    volumes: list[Process] = field(default_factory=list)
    volume_ports: list[int] = field(default_factory=list)

    def kill_volume(self, index: int) -> None:
        """SIGKILL volume server ``index`` (as a crash would) and wait until it is gone."""
        self.volumes[index].stop(signal.SIGKILL)
        wait_for(
            f"volume server {index} to stop",
            lambda: not port_open(self.volume_ports[index]),
            [p for p in self.processes if p is not self.volumes[index]],
        )

    def start_volume(self, index: int) -> None:
        """Restart volume server ``index`` on its data folder; wait until writes work."""
        process = self.volumes[index]
        process.start()
        wait_for(
            f"volume server {index}", lambda: port_open(self.volume_ports[index]), self.processes
        )
        wait_for(
            "writes after restart", _bucket_writable(self.endpoint, self.bucket), self.processes
        )


@pytest.fixture(scope="session")
def seaweedfs_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedCluster]:
    """``weed master`` + two ``weed volume`` + ``weed filer`` + ``weed s3`` as separate
    processes; no replication, so after a volume server is killed new writes go to
    the other one, and its own objects are back once it restarts."""
    root = tmp_path_factory.mktemp("seaweedfs-cluster")
    identity = _write_identity(root)
    ports = free_ports(10)
    master, master_grpc, filer, filer_grpc, s3, s3_grpc = ports[:6]
    volume_ports = [ports[6], ports[8]]
    volume_grpc = [ports[7], ports[9]]
    master_address = f"{HOST}:{master}.{master_grpc}"
    for name in ("master", "volume0", "volume1", "filer"):
        (root / name).mkdir()
    processes = [
        Process(
            "weed master",
            [
                WEED,
                "master",
                f"-ip={HOST}",
                f"-ip.bind={HOST}",
                f"-port={master}",
                f"-port.grpc={master_grpc}",
                f"-mdir={root / 'master'}",
                # No replication: a killed volume server's objects come back when it
                # restarts on the same folder; new writes go to the other server.
                "-defaultReplication=000",
                "-volumeSizeLimitMB=128",
            ],
            root / "master.log",
            root,
        )
    ]
    volumes = [
        Process(
            f"weed volume {i}",
            [
                WEED,
                "volume",
                f"-ip={HOST}",
                f"-ip.bind={HOST}",
                f"-port={volume_ports[i]}",
                f"-port.grpc={volume_grpc[i]}",
                f"-dir={root / f'volume{i}'}",
                f"-master={master_address}",
                "-max=100",
                # Stop at once on SIGTERM (the default waits 10 s to drain).
                "-preStopSeconds=0",
            ],
            root / f"volume{i}.log",
            root,
        )
        for i in range(2)
    ]
    processes += volumes
    filer_process = Process(
        "weed filer",
        [
            WEED,
            "filer",
            f"-ip={HOST}",
            f"-ip.bind={HOST}",
            f"-port={filer}",
            f"-port.grpc={filer_grpc}",
            f"-master={master_address}",
            f"-defaultStoreDir={root / 'filer'}",
        ],
        root / "filer.log",
        root,
    )
    processes.append(filer_process)
    s3_process = Process(
        "weed s3",
        [
            WEED,
            "s3",
            f"-ip.bind={HOST}",
            f"-port={s3}",
            f"-port.grpc={s3_grpc}",
            "-port.iceberg=0",
            "-port.lance=0",
            f"-filer={HOST}:{filer}.{filer_grpc}",
            f"-config={identity}",
        ],
        root / "s3.log",
        root,
    )
    processes.append(s3_process)
    cluster = SeaweedCluster(
        f"http://{HOST}:{s3}",
        s3,
        "metasync-cluster",
        processes,
        volumes=volumes,
        volume_ports=volume_ports,
    )
    with aws_credentials():
        try:
            processes[0].start()
            wait_for("weed master", lambda: port_open(master), processes[:1])
            for volume in volumes:
                volume.start()
            filer_process.start()
            wait_for("weed filer", lambda: port_open(filer), processes[:4])
            s3_process.start()
            wait_for(
                "SeaweedFS cluster S3",
                _bucket_writable(cluster.endpoint, cluster.bucket),
                processes,
            )
            yield cluster
        finally:
            cluster.stop()
