"""A server that accepts connections and then says nothing does not hang a command.

Issue 17, point 5: ``--timeout`` bounds every network wait (connect, read, TLS
and SSH handshakes, banner, sign-in) of every backend kind, and a request's
retries stop within it; what a library raises reaches the user as one line
naming the backend and the fix, never as a traceback (paramiko logs one per
failed handshake).

Each test runs the real CLI against a loopback :class:`SilentServer` (accepts,
never answers; or answers half and then nothing). A command that has not
returned after :data:`HANG` seconds has hung: that is the failure, the tests
never assert on how long a command took.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.conftest import METASYNC, PASSPHRASE, backend_dirs, one_line_error, run_cli, wait_until
from tests.servers.silent import SilentServer, silent_server

#: Seconds after which a command counts as hung (the bound given is 2 s).
HANG = 60.0
TIMEOUT = "2"


def run_bounded(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """``metasync --timeout 2 ARGS`` as :func:`run_cli` runs it, failing the test if
    it has not returned within :data:`HANG` seconds."""
    env_extra = {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test"}
    try:
        return run_cli("--timeout", TIMEOUT, *args, cwd=cwd, check=False, env_extra=env_extra)
    except subprocess.TimeoutExpired as exc:  # pragma: no cover - the failure itself
        pytest.fail(f"metasync {' '.join(args)} hung: no return within {HANG:g}s ({exc})")


def _uri(kind: str, port: int) -> str:
    return {
        "webdav": f"webdav://user:secret@127.0.0.1:{port}/repo",
        "sftp": f"sftp://user:secret@127.0.0.1:{port}/repo",
        "s3": f"s3://bucket/repo?endpoint=http://127.0.0.1:{port}",
    }[kind]


#: What each kind's server sends before it goes silent, for the "half reply" cases.
HALF_REPLY = {
    "webdav": b"HTTP/1.1 200 OK\r\nContent-Type: text/xml\r\n",
    "sftp": b"SSH-2.0-OpenSSH_9.2\r\n",
    "s3": b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n<?xml",
}


@pytest.fixture(autouse=True)
def _bounded_subprocesses(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every CLI run of these tests gets :data:`HANG` as its subprocess timeout."""
    real = subprocess.run

    def run(*args: object, **kwargs: object) -> object:
        kwargs.setdefault("timeout", HANG)
        return real(*args, **kwargs)  # type: ignore[call-overload]

    monkeypatch.setattr(subprocess, "run", run)


def _assert_clean_failure(proc: subprocess.CompletedProcess[str], server: SilentServer,
                          name: str) -> str:
    assert server.accepted >= 1, "the command never reached the silent server"
    line = one_line_error(proc, name, "--timeout")
    assert "retrying" not in line  # the last attempt's error is not "retrying"
    return line


@pytest.mark.parametrize("half", [False, True], ids=["silent", "half-reply"])
@pytest.mark.parametrize("kind", ["webdav", "sftp", "s3"])
def test_clone_from_a_silent_server_fails_with_one_line(
    kind: str, half: bool, tmp_path: Path
) -> None:
    """``clone`` from a server that accepts and then says nothing (or half a reply)
    returns with one line naming the backend and --timeout, non-zero, no traceback
    (on the code before issue 17: webdav and s3 waited 5 minutes, sftp 1 min 41 s
    and printed paramiko's tracebacks)."""
    with silent_server(HALF_REPLY[kind] if half else b"") as server:
        proc = run_bounded("clone", _uri(kind, server.port), str(tmp_path / "clone"))
        _assert_clean_failure(proc, server, f"127.0.0.1:{server.port}")
    assert "paramiko" not in proc.stderr


#: Connections the silent server may take during a push: the requests in flight when
#: the first of them gives up (the two consensus reads, the client state's write and,
#: if the new pack maps there, its upload: 6 in every run seen), each with its one
#: retry; the pause stops the rest. Before the pause, every request the push made to
#: it waited its own timeout twice (28-32 connections, ~31 s with ``--timeout 2``).
SILENT_PUSH_CONNECTIONS = 10


def _through_proxy(kind: str, request: pytest.FixtureRequest, tmp_path: Path
                   ) -> tuple[tuple[str, int], Callable[[int], str]]:
    """Where ``kind``'s real test server listens, and the URI of a repository on it
    reached through another port (the silent server's)."""
    if kind == "webdav":
        server = request.getfixturevalue("webdav_server")
        name = f"silent17-{tmp_path.name}"
        (server.root_dir / name).mkdir(exist_ok=True)
        return (server.host, server.port), lambda port: server.uri(name, port=port)
    if kind == "sftp":
        sshd = request.getfixturevalue("sshd_server")
        root = sshd.root_dir / f"silent17-{tmp_path.name}"
        return (sshd.host, sshd.port), lambda port: sshd.uri(
            root, port=port, known_hosts=sshd.known_hosts_for(port, tmp_path / "known_hosts"))
    s3 = request.getfixturevalue("seaweedfs")
    return ("127.0.0.1", s3.port), lambda port: s3.uri(
        f"silent17-{tmp_path.name}", endpoint=f"http://127.0.0.1:{port}")


@pytest.mark.parametrize("kind", ["webdav", "sftp", "s3"])
def test_status_and_push_with_a_backend_gone_silent(
    kind: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """A repository on two folders and a server: once the server accepts connections
    but answers nothing, ``status`` and ``push`` still return (the two folders are a
    majority), name the silent backend, and print no traceback. The push asks the
    silent backend only until a request of it has got no answer: the others fail at
    once (:class:`metasync.backends.retry.RetryPolicy`), so it costs one timeout, not
    one per request."""
    dirs = backend_dirs(tmp_path, "b1", "b2")
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "a.txt").write_text("one\n")
    target, uri_at = _through_proxy(kind, request, tmp_path)
    with silent_server(target=target) as server:
        run_cli("init", str(folder), "--backend", f"dir:{dirs['b1']}",
                "--backend", f"dir:{dirs['b2']}", "--backend", uri_at(server.port))
        run_cli("push", cwd=folder)
        server.silence()
        (folder / "b.txt").write_text("two\n")
        status = run_cli("--timeout", TIMEOUT, "status", cwd=folder, check=False)
        assert "Traceback" not in status.stderr, status.stderr
        assert "b.txt" in status.stdout, status.stdout + status.stderr
        before = server.accepted
        # A pause longer than any push: the count below does not depend on how fast
        # this machine is (the default, twice the timeout, is 5 s here).
        push = run_cli("--timeout", TIMEOUT, "push", cwd=folder, check=False,
                       env_extra={"METASYNC_SILENCE_PAUSE": "600"})
        assert "Traceback" not in push.stderr, push.stderr
        assert push.returncode == 0, push.stderr
        assert server.accepted - before <= SILENT_PUSH_CONNECTIONS, (
            f"the push asked the silent server {server.accepted - before} times")
    # What the push committed is on the folders: a clone from one of them has it.
    clone = tmp_path / "clone"
    run_cli("clone", f"dir:{dirs['b1']}", str(clone))
    assert (clone / "b.txt").read_text() == "two\n"


#: Daemon passes made while the server is silent, each committing one new file.
DAEMON_PASSES = 4


def _daemon_version(folder: Path) -> int:
    doc = json.loads((folder / ".metasync" / "daemon.json").read_text())
    return int(doc["version"]) if doc.get("state") == "idle" else -1


def test_a_daemon_asks_a_silent_backend_once_a_pause_not_once_a_pass(
    request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """The daemon opens its backends afresh for each sync pass. A backend that went
    silent is still paused in the next pass (the pause belongs to the backend, not
    to the pass's copy of it): passes committing four changes ask it no more than
    one push does, instead of waiting out the timeout again in every pass (a pass
    per change, each waiting twice the backend's 60 s timeout by default)."""
    dirs = backend_dirs(tmp_path, "b1", "b2")
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "a.txt").write_text("one\n")
    target, uri_at = _through_proxy("webdav", request, tmp_path)
    with silent_server(target=target) as server:
        run_cli("init", str(folder), "--backend", f"dir:{dirs['b1']}",
                "--backend", f"dir:{dirs['b2']}", "--backend", uri_at(server.port))
        run_cli("push", cwd=folder)
        server.silence()
        before = server.accepted
        env = {k: v for k, v in os.environ.items() if not k.startswith("METASYNC_")}
        env.update(METASYNC_PASSPHRASE=PASSPHRASE, METASYNC_SILENCE_PAUSE="600")
        out = tmp_path / "daemon.out"
        with open(out, "wb") as fh:
            proc = subprocess.Popen(
                [METASYNC, "--timeout", TIMEOUT, "daemon", "--settle", "0.2", "--poll", "0.5",
                 "--rescan", "600"],
                cwd=folder, env=env, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            version = wait_until(lambda: _daemon_version(folder) > 0, HANG, "the daemon's first pass",
                                 out.read_text)
            for n in range(DAEMON_PASSES):
                (folder / f"new{n}.txt").write_text(f"{n}\n")
                version = wait_until(lambda v=version: _daemon_version(folder) > v and
                                     _daemon_version(folder), HANG, f"the pass committing new{n}.txt",
                                     out.read_text)
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=HANG)
            except subprocess.TimeoutExpired:  # pragma: no cover - the failure itself
                proc.kill()
                proc.wait()
        assert "Traceback" not in out.read_text(), out.read_text()
        asked = server.accepted - before
        assert asked <= SILENT_PUSH_CONNECTIONS, (
            f"{DAEMON_PASSES + 1} daemon passes asked the silent server {asked} times")
    clone = tmp_path / "clone"
    run_cli("clone", f"dir:{dirs['b1']}", str(clone))
    assert (clone / f"new{DAEMON_PASSES - 1}.txt").read_text() == f"{DAEMON_PASSES - 1}\n"


def test_sync_now_ends_the_pause_of_the_folders_backends(
    request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """The user's "Sync now" (the service's button and API) tries a paused backend
    again at once: it may be back, and the pause can last ten minutes."""
    from metasync.backends import retry
    from metasync.daemon import Daemon
    from metasync.errors import NoAnswer

    dirs = backend_dirs(tmp_path, "b1", "b2")
    folder = tmp_path / "folder"
    folder.mkdir()
    target, uri_at = _through_proxy("webdav", request, tmp_path)
    with silent_server(target=target) as server:
        run_cli("init", str(folder), "--backend", f"dir:{dirs['b1']}",
                "--backend", f"dir:{dirs['b2']}", "--backend", uri_at(server.port))
        daemon = Daemon(folder)
        daemon._open_acceptors()
    webdav = [b for b in daemon._acceptors.values() if b.uri.startswith("webdav")]
    assert len(webdav) == 1, daemon._acceptors
    silence = retry.silence_of(webdav[0].uri)
    silence.went_silent(NoAnswer("no answer within 2s"), 0.0, 2.0)
    assert silence.admit("list")[1] is not None  # paused
    daemon.sync_now()
    assert silence.admit("list") == (0, None)


def test_a_request_to_a_backend_that_just_went_silent_is_not_sent(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """After a request ends with :class:`NoAnswer`, the backend's next requests fail
    at once (:class:`PausedBackend`: never sent, never retried) until the pause is
    over; then one is let through, the others still refused until it is answered.
    An answer, even "not found", ends the pause; a request that was sent before the
    backend's last answer and then timed out does not start one."""
    from metasync.backends import retry
    from metasync.errors import NoAnswer, ObjectNotFound, PausedBackend

    now = [1000.0]
    monkeypatch.setattr(retry.time, "monotonic", lambda: now[0])
    policy = retry.RetryPolicy(attempts=3, base=0.0, budget=2.0)
    assert policy.silence.pause_for(2.0) == 5.0 and policy.silence.pause_for(30.0) == 60.0
    calls: list[str] = []

    def silent() -> None:
        calls.append("silent")
        now[0] += 2.0  # each attempt waits out the timeout
        raise NoAnswer("list 'floor' on webdav://h/x: no answer within 2s")

    def answers() -> str:
        calls.append("answers")
        return "ok"

    with pytest.raises(NoAnswer):
        retry.retrying(policy, "list 'floor'", silent)
    assert calls == ["silent", "silent"]  # one retry within the budget, as before
    now[0] += 4.0  # 4 s into the 5 s pause
    with pytest.raises(PausedBackend, match=r"upload 'a': not sent, .* 4s ago and is asked "
                                            r"again in 1s .*no answer within 2s"):
        retry.retrying(policy, "upload 'a'", answers)
    assert calls == ["silent", "silent"] and policy.silence.skipped == 1

    now[0] += 1.0  # the pause is over: one request is let through

    def probe() -> str:
        calls.append("probe")
        other = ThreadPoolExecutor(1)
        with pytest.raises(PausedBackend):  # the others wait for the probe's answer
            other.submit(retry.retrying, policy, "upload 'b'", answers).result()
        other.shutdown()
        return retry.retrying(policy, "create folder", lambda: "ok")  # its own request goes

    assert retry.retrying(policy, "upload 'a'", probe) == "ok"
    assert retry.retrying(policy, "upload 'b'", answers) == "ok"  # answered: open again

    # A probe out for longer than a silent backend would keep it (three times the
    # budget: a big transfer on a slow link, still answering) does not keep the
    # others out any longer; until then they are.
    now[0] += 1.0  # (a request sent in the same instant as an answer is stale)
    with pytest.raises(NoAnswer):
        retry.retrying(policy, "list 'floor'", silent)
    now[0] += 5.0

    def slow_probe() -> str:
        other = ThreadPoolExecutor(1)
        now[0] += 6.0
        with pytest.raises(PausedBackend):
            other.submit(retry.retrying, policy, "upload 'e'", lambda: "e").result()
        now[0] += 0.5
        assert other.submit(retry.retrying, policy, "upload 'e'", lambda: "e").result() == "e"
        other.shutdown()
        return "ok"

    assert retry.retrying(policy, "upload 'big'", slow_probe) == "ok"
    del calls[-2:]  # the two attempts of this second silence
    assert calls == ["silent", "silent", "probe", "answers"]

    def not_found_meanwhile() -> None:
        """A request in flight while another one gives up: its answer comes after."""
        calls.append("not found")
        policy.silence.went_silent(NoAnswer("list 'floor': no answer"), now[0] - 1, 2.0)
        raise ObjectNotFound("no 'b'")

    with pytest.raises(ObjectNotFound):
        retry.retrying(policy, "read 'b'", not_found_meanwhile)
    assert retry.retrying(policy, "upload 'c'", answers) == "ok"

    def silent_after_an_answer() -> None:
        """A request sent before another got an answer, timing out after it."""
        calls.append("stale")
        policy.silence.answered()
        now[0] += 2.0
        raise NoAnswer("upload 'big': no answer within 2s")

    with pytest.raises(NoAnswer):
        retry.retrying(retry.RetryPolicy(attempts=1, silence=policy.silence), "upload 'big'",
                       silent_after_an_answer)
    assert retry.retrying(policy, "upload 'd'", answers) == "ok"  # not paused
    assert calls == ["silent", "silent", "probe", "answers", "not found", "answers", "stale",
                     "answers"]


def test_a_failure_from_before_a_pause_changes_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A request sent before the silence began that then times out says nothing new:
    it neither shortens the pause nor lets a second probe out beside the first."""
    from metasync.backends import retry
    from metasync.errors import NoAnswer, PausedBackend

    now = [1000.0]
    monkeypatch.setattr(retry.time, "monotonic", lambda: now[0])
    silence = retry.Silence(5.0)
    other = ThreadPoolExecutor(1)
    silence.went_silent(NoAnswer("a"), 999.0, 2.0)
    silence.went_silent(NoAnswer("older"), 998.0, 2.0)
    assert silence._until == 1005.0
    now[0] += 5.0
    t, _ = silence.admit("t")
    silence.went_silent(NoAnswer("older still"), 998.5, 2.0)
    now[0] += 1.0
    u, refused = other.submit(silence.admit, "u").result()
    assert t and not u and isinstance(refused, PausedBackend)  # T is still the probe
    silence.probe_failed(t)  # T refused otherwise: the next request goes in its place
    assert silence.admit("w") == (t + 1, None)
    other.shutdown()


def test_a_probe_that_gets_no_answer_starts_a_longer_pause(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """While probes get no answer, each pause is as long as the whole silence so far,
    up to ten minutes; the others stay refused while a probe waits out its timeouts
    (the backends' default budget, 60 s, as long as the first pause); an answer ends
    it, and the next silence starts from the short pause again. Every object of one
    backend URI shares the pause (the daemon opens its backends for each pass)."""
    from metasync.backends import retry
    from metasync.errors import NoAnswer, PausedBackend

    now = [1000.0]
    monkeypatch.setattr(retry.time, "monotonic", lambda: now[0])
    monkeypatch.delenv("METASYNC_SILENCE_PAUSE", raising=False)
    uri = "webdav://127.0.0.1:9/x"
    policy = retry.RetryPolicy(attempts=3, base=0.0, budget=60.0, silence=retry.silence_of(uri))
    assert retry.silence_of(uri) is policy.silence
    assert retry.silence_of("webdav://127.0.0.1:9/y") is not policy.silence
    sent: list[float] = []
    other = ThreadPoolExecutor(1)

    def silent() -> None:
        sent.append(now[0])
        now[0] += 60.0
        raise NoAnswer("no answer within 60s")

    with pytest.raises(NoAnswer):
        retry.retrying(policy, "list", silent)
    assert len(sent) == 2  # a request's one retry, as before
    pauses = []
    for _ in range(6):
        # The next pass's backend object for the same URI is refused until the end.
        later = retry.RetryPolicy(attempts=3, base=0.0, budget=60.0,
                                  silence=retry.silence_of(uri))
        with pytest.raises(PausedBackend):
            retry.retrying(later, "list", silent)
        until = policy.silence._until
        pauses.append(until - now[0])
        now[0] = until

        def probe() -> None:
            sent.append(now[0])
            now[0] += 60.0
            refused = other.submit(retry.retrying, policy, "upload", lambda: "sent").exception()
            assert isinstance(refused, PausedBackend)  # the probe is out: not sent
            assert "is being asked again now" in str(refused)
            raise NoAnswer("no answer within 60s")

        with pytest.raises(NoAnswer):
            retry.retrying(later, "probe", probe)
    # 60 s after a request's two timeouts; then as long as the silence since that
    # request gave up: 60 + 120 s of probe, then 180 + 180 + 120, ..., at most 600.
    assert pauses == [60.0, 180.0, 480.0, 600.0, 600.0, 600.0]
    now[0] = policy.silence._until
    assert retry.retrying(policy, "probe", lambda: "ok") == "ok"
    now[0] += 1.0
    with pytest.raises(NoAnswer):
        retry.retrying(policy, "list", silent)
    assert policy.silence._until - now[0] == 60.0  # a new silence: a short pause again
    other.shutdown()


def test_rclone_words_only_a_wait_that_ran_out_as_no_answer() -> None:
    """rclone's "i/o timeout", "timed out" and "awaiting response headers" are silence; "504 Gateway Timeout",
    S3's "RequestTimeout" and "408 Request Timeout" are answers (transient)."""
    from types import SimpleNamespace

    from metasync.backends.rclone import RcloneBackend
    from metasync.errors import NoAnswer, TransientError

    fake = SimpleNamespace(name="rclone:remote:x", location="remote:x", options=None)

    def error(text: str) -> Exception:
        return RcloneBackend._error(fake, text, "read 'k'")  # type: ignore[arg-type]

    for text in ("dial tcp 10.0.0.1:443: i/o timeout", "read: connection timed out",
                 "context deadline exceeded", "net/http: TLS handshake timeout",
                 "net/http: timeout awaiting response headers"):
        assert isinstance(error(text), NoAnswer), text
    for text in ("HTTP error 504 (504 Gateway Timeout) returned", "RequestTimeout: Your socket "
                 "connection to the server was not read from or written to", "408 Request Timeout"):
        assert type(error(text)) is TransientError, text


def test_retries_stop_within_the_timeout() -> None:
    """A request whose attempts each fail is not retried once the policy's budget
    has passed since its first attempt: the loop stops by itself, however many
    attempts the policy would otherwise allow."""
    from metasync.backends.retry import RetryPolicy, TransientError, retrying

    calls = 0

    def silent() -> None:
        nonlocal calls
        calls += 1
        raise TransientError("no answer")

    # A budget no backoff fits in: only the first attempt is made.
    with pytest.raises(TransientError):
        retrying(RetryPolicy(attempts=1000, base=1.0, cap=1.0, budget=1e-9), "read", silent)
    assert calls == 1


def test_the_timeout_option_bounds_each_backends_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--timeout`` lowers a backend's own network timeout, never raises it."""
    from metasync.timeouts import network_timeout

    monkeypatch.delenv("METASYNC_TIMEOUT", raising=False)
    assert network_timeout(60.0) == 60.0
    monkeypatch.setenv("METASYNC_TIMEOUT", "2")
    assert network_timeout(60.0) == 2.0
    assert network_timeout(1.0) == 1.0
