"""The ``gdrive:`` backend through the official Google API client against the Drive v3
emulator (tests/emulators/gdrive.py): the shared conformance suite (with TCP resets
and injected 429s/403 rate limits/5xx), Drive-specific behaviour (duplicate names,
logs by reserved ids, resumable uploads, the daily upload cap, token refresh and
revocation), `metasync auth gdrive` against the emulator's OAuth endpoints,
`metasync share`, an end-to-end repository, and live tests (``--live``)."""

from __future__ import annotations

import hashlib
import io
import itertools
import os
import ssl
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlsplit

import httpx
import pytest

from conftest import run_cli
from metasync.backends import open_backend
from metasync.backends.cloud import FileTokenStore, Grant, config_dir, token_store
from metasync.backends.conformance import pattern_bytes
from metasync.backends.feeds import ChangeFeed
from metasync.backends.gdrive import CHUNK_SIZE, DriveFeed, GDriveBackend
from metasync.backends.retry import TransientError
from metasync.errors import (
    AuthorizationRequired,
    BackendError,
    BackendUnavailable,
    FormatError,
    ObjectNotFound,
    UsageError,
)
from tests.emulators.base import LOST_ANSWER, RESET, SERVER_ERROR, THROTTLE, UNAVAILABLE
from tests.emulators.gdrive import (
    GDRIVE_FAULTS,
    RATE_LIMIT_403,
    TEST_EMAIL,
    USER_RATE_LIMIT,
    GDriveService,
)
from tests.providers_common import (
    FailingSource,
    MiB,
    ProviderConformance,
    call_delta,
    check_change_feed,
    check_repository_over_throttling,
    check_share,
    emulator_location,
    fresh_namespace,
    init_repository_to_share,
    one_line,
    open_live_backend,
    read_printed_url,
    specific_backend,
    start_auth,
)


def _location(service: GDriveService, folder: str) -> str:
    return emulator_location(service, "gdrive", folder)


class TestGDriveBackend(ProviderConformance):
    """The conformance suite through the Google API client against the emulator."""

    backend_class = GDriveBackend
    folder_root = ""

    @pytest.fixture
    def service(self, gdrive_service: GDriveService) -> GDriveService:
        return gdrive_service


# --- Drive-specific behaviour -----------------------------------------------------------------


@pytest.fixture
def gd(gdrive_service: GDriveService) -> Iterator[GDriveBackend]:
    with specific_backend(gdrive_service, _location(gdrive_service, "specific")) as backend:
        assert isinstance(backend, GDriveBackend)
        yield backend


@pytest.mark.parametrize(
    ("uri", "match"),
    [
        ("gdrive:a?colour=red", "unknown option 'colour'"),
        ("gdrive:a/../b", "invalid folder name"),
        ("gdrive:a?transfers=0", "positive"),
        ("gdrive:a?account=../x", "invalid account"),
        ("gdrive:a?api=https://h/with/path", "no path"),
    ],
)
def test_bad_uris_are_usage_errors(uri: str, match: str) -> None:
    with pytest.raises(UsageError, match=match):
        open_backend(uri, "ns")


def test_layout_and_location(gdrive_service: GDriveService) -> None:
    """Key a/b of namespace ns is the file b in folder a of PATH/ns; the location must
    exist and be unambiguous; the name carries the account, never a secret."""
    emulator = gdrive_service.emulator
    namespace = fresh_namespace()
    backend = open_backend(_location(gdrive_service, "layout/deep") + "?account=default", namespace)
    assert backend.name == "gdrive:layout/deep"
    backend.create()
    backend.put("a/b", b"x")
    (item,) = emulator.path_items(f"layout/deep/{namespace}/a/b")
    assert emulator.content(item.id) == b"x"
    backend.close()
    missing = open_backend("gdrive:no such folder", "ns")
    with pytest.raises(BackendUnavailable) as info:
        missing.create()
    assert "create it there first" in one_line(info.value)
    twice = emulator.make_folder("twice")
    emulator.add_item(emulator.items[twice].parents[0], "twice", None)
    with pytest.raises(BackendError, match="2 folders named 'twice'"):
        open_backend("gdrive:twice", "ns").exists()
    assert open_backend("gdrive:?account=work", "ns").name == "gdrive:/?account=work"


def test_duplicate_names_are_resolved_deterministically(
    gd: GDriveBackend, gdrive_service: GDriveService
) -> None:
    """Drive allows several items of one name in a folder. Folders of one name are one
    folder (a file another client put into a duplicate folder is found and listed);
    of several files of one name the most recently modified is the object, on every
    client; delete removes them all."""
    emulator = gdrive_service.emulator
    gd.put("dir/one", b"1")
    (ns,) = emulator.path_items(f"specific/{gd.namespace}")
    twin = emulator.add_item(ns.id, "dir", None)  # a racing creator's duplicate folder
    emulator.add_item(twin, "two", b"2")
    assert gd.get("dir/two") == b"2"
    assert sorted(gd.list("dir")) == ["dir/one", "dir/two"]
    emulator.add_item(twin, "one", b"newer")  # a newer file of the same name
    other = open_backend(gd.uri, gd.namespace)
    assert other.get("dir/one") == b"newer"
    assert gd.poll("dir/one") == other.poll("dir/one")
    assert sorted(other.list()) == ["dir/one", "dir/two"]
    other.put("dir/one", b"rewritten")
    assert gd.size("dir/one") == len(b"rewritten") and other.get("dir/one") == b"rewritten"
    gd.delete("dir/one")
    assert [i.name for i in emulator.path_items(f"specific/{gd.namespace}/dir/one")] == []
    with pytest.raises(ObjectNotFound):
        other.get("dir/one")
    other.close()


def test_racing_namespace_creators_agree(gdrive_service: GDriveService) -> None:
    """Two namespace folders of one name (two `init`s at once): every client uses the
    first made, and a create() that finds one made meanwhile keeps it."""
    emulator = gdrive_service.emulator
    location = _location(gdrive_service, "racing")
    namespace = fresh_namespace()
    first = open_backend(location, namespace)
    first.create()
    emulator.add_item(emulator.make_folder("racing"), namespace, None)  # a later duplicate
    second = open_backend(location, namespace)
    second.create()
    second.put("k", b"v")
    assert first.get("k") == b"v"
    assert len(emulator.path_items(f"racing/{namespace}")) == 2
    # A creator that did not see the other's folder before making its own removes
    # its own once it sees it is the later one.
    late_ns = fresh_namespace()
    early = open_backend(location, late_ns)
    early.create()
    late = open_backend(location, late_ns)
    assert isinstance(late, GDriveBackend)
    real = late._find_namespace
    blind = [True]

    def not_yet_visible() -> dict[str, Any] | None:
        if blind.pop() if blind else False:
            return None
        return real()

    late._find_namespace = not_yet_visible  # type: ignore[method-assign]
    late.create()
    (survivor,) = emulator.path_items(f"racing/{late_ns}")
    assert survivor.id == early.namespace_folder()["id"] == late.namespace_folder()["id"]


def test_drive_refuses_a_second_create_of_one_id(gd: GDriveBackend) -> None:
    """The primitive the logs rest on: files.create with a reserved id succeeds once;
    every later create with that id is 409 (even with other bytes), and an id Drive
    did not issue is refused."""
    folder = str(gd.namespace_folder()["id"])
    (reserved,) = gd.reserve_ids(1)
    body = {"name": "x", "parents": [folder]}
    assert gd.create_with_id(reserved, body, b"one", "test") is True
    assert gd.create_with_id(reserved, body, b"two", "test") is False
    assert gd.read_by_id(reserved, "test") == b"one"
    with pytest.raises(BackendError, match="not usable"):
        gd.create_with_id("1" + "x" * 32, body, b"three", "test")


def test_log_appends_race_for_reserved_ids(gd: GDriveBackend, gdrive_service: GDriveService) -> None:
    """Two clients that both believe they append at the end race for the same reserved
    id: one wins, the other reads the winner and takes the next position. An append
    whose answer was lost is recognised as its own (no duplicate entry). An
    uncontended append with a current view is one files.create; a fetch that finds
    nothing new is one read."""
    emulator = gdrive_service.emulator
    other = open_backend(gd.uri, gd.namespace)
    assert gd.logs.append("log/x", b"a") == 0
    assert other.logs.fetch("log/x") == [(0, b"a")]
    assert gd.logs.append("log/x", b"b") == 1  # other's view is now stale
    assert other.logs.append("log/x", b"c") == 2  # lost the race for position 1, then won 2
    assert other.logs.append_at("log/x", 2, b"late") is False
    emulator.faults.inject(LOST_ANSWER, only=r"^/upload/drive/v3/files$")
    assert gd.logs.append("log/x", b"d") == 3
    before = dict(emulator.calls)
    assert gd.logs.append("log/x", b"e") == 4
    assert call_delta(before, emulator.calls) == {"files.create": 1}
    before = dict(emulator.calls)
    assert other.logs.fetch("log/x", 3) == [(3, b"d"), (4, b"e")]
    assert gd.logs.fetch("log/x", 5) == []
    # entry 3, then entries 4 and 5 at once (5 is missing), then entry 5 again
    assert call_delta(before, emulator.calls)["files.get"] == 4
    assert gd.logs.fetch("log/x") == other.logs.fetch("log/x") == [
        (0, b"a"), (1, b"b"), (2, b"c"), (3, b"d"), (4, b"e")]
    assert sorted(gd.list()) == []  # the log machinery is not keys
    other.close()


def test_damaged_log_entry_is_refused(gd: GDriveBackend, gdrive_service: GDriveService) -> None:
    """A log entry whose bytes were changed on the service fails with a format error
    instead of being believed (backends are untrusted)."""
    gd.logs.append("log/y", b"a")
    gd.logs.append("log/y", b"b")
    emulator = gdrive_service.emulator
    (entry,) = [i for i in emulator.items.values() if i.name == "log log-y 0000000001"]
    revision = entry.revisions[-1]
    path = emulator.blobs.path(revision.blob)
    stored = path.read_bytes()
    path.write_bytes(stored[:-1] + bytes([stored[-1] ^ 0xFF]))  # always a change
    fresh = open_backend(gd.uri, gd.namespace)
    with pytest.raises(FormatError):
        fresh.logs.fetch("log/y")


def test_resumable_upload_continues_after_an_interrupted_put(
    gd: GDriveBackend, gdrive_service: GDriveService
) -> None:
    """A put whose source fails after two pieces leaves its resumable session
    journaled on this client; the next put of the same key re-reads and checks the
    part Drive holds and sends only the rest into the same session (no new session).
    A different source starts over; nothing stays in the journal."""
    calls = gdrive_service.emulator.calls
    data = pattern_bytes(31, 0, 4 * CHUNK_SIZE + 99)
    with pytest.raises(OSError, match="went away"):
        gd.put("big", FailingSource(data, 2 * CHUNK_SIZE + 10))
    journal = config_dir() / "uploads"
    assert len(list(journal.glob("gdrive-*.json"))) == 1
    before = dict(calls)
    gd.put("big", io.BytesIO(data))
    delta = call_delta(before, calls)
    assert "files.create" not in delta  # the session was not opened again
    assert delta["upload.put"] == 1 + 3  # a status query, then the 3 pieces Drive lacked
    assert gd.get("big") == data
    with pytest.raises(OSError):
        gd.put("big2", FailingSource(data, 2 * CHUNK_SIZE + 10))
    before = dict(calls)
    gd.put("big2", io.BytesIO(data[::-1]))
    assert call_delta(before, calls)["files.create"] == 1
    assert gd.get("big2") == data[::-1]
    assert not list(journal.glob("gdrive-*.json"))


def test_resumable_pieces_lost_in_flight(gd: GDriveBackend, gdrive_service: GDriveService) -> None:
    """A piece lost before it arrives, one whose answer is lost, 5xx and 403 rate
    limits on pieces, and a lost final answer: the upload asks Drive for its offset
    and completes with the exact bytes, once."""
    faults = gdrive_service.emulator.faults
    data = pattern_bytes(22, 0, 3 * CHUNK_SIZE + 7)
    faults.inject(RESET, LOST_ANSWER, SERVER_ERROR, USER_RATE_LIMIT, only=r"upload_id=|^/upload/")
    gd.put("resumed", io.BytesIO(data))
    assert faults.pending() == 0
    assert gd.get("resumed") == data
    faults.inject(LOST_ANSWER, only=r"^/upload/drive/v3/files")
    gd.put("resumed", io.BytesIO(data[::-1]))
    assert gd.get("resumed") == data[::-1]
    with gd.open("resumed") as stream:
        assert stream.read() == data[::-1]


def test_throttling_answers_are_retried(gd: GDriveBackend, gdrive_service: GDriveService) -> None:
    """429 (with Retry-After) and 403 userRateLimitExceeded/rateLimitExceeded are
    transient, carrying Drive's Retry-After; with retries each is ridden out."""
    faults = gdrive_service.emulator.faults
    gd.put("k", b"v")
    gd.policy.attempts = 1
    faults.retry_after = 7
    try:
        faults.inject(THROTTLE)
        with pytest.raises(TransientError) as info:
            gd.get("k")
        assert info.value.retry_after == 7.0
        for kind in (USER_RATE_LIMIT, RATE_LIMIT_403):
            faults.inject(kind)
            with pytest.raises(TransientError, match="throttling"):
                gd.get("k")
    finally:
        faults.retry_after = 0
    gd.policy.attempts = 5
    faults.inject(THROTTLE, USER_RATE_LIMIT, RATE_LIMIT_403, UNAVAILABLE)
    gd.put("k", b"after")
    assert gd.get("k") == b"after"


def test_daily_upload_cap_is_not_retried(gd: GDriveBackend, gdrive_service: GDriveService) -> None:
    """403 uploadLimitExceeded (the daily upload cap) fails the put at once, with one
    line saying the copy is postponed, instead of retrying for hours."""
    emulator = gdrive_service.emulator
    emulator.uploads_blocked = True
    before = gd.policy.retries
    try:
        with pytest.raises(BackendError) as info:
            gd.put("k", b"v")
        assert not isinstance(info.value, TransientError)
        assert "daily upload limit" in one_line(info.value) and "postponed" in str(info.value)
        with pytest.raises(BackendError, match="daily upload limit"):
            gd.put("big", io.BytesIO(pattern_bytes(3, 0, CHUNK_SIZE + 1)))
        assert gd.policy.retries == before
    finally:
        emulator.uploads_blocked = False


def test_daily_upload_cap_postpones_the_replica(
    gdrive_service: GDriveService, tmp_path: Path
) -> None:
    """A push while Drive refuses uploads (daily cap) succeeds on the other backends
    and records the Drive copies as missing; once Drive accepts uploads again the
    next push writes them, and fsck then finds every copy."""
    from conftest import make_tree

    emulator = gdrive_service.emulator
    dirs = [tmp_path / "d0", tmp_path / "d1"]
    for d in dirs:
        d.mkdir()
    uri = _location(gdrive_service, f"cap-{uuid.uuid4().hex[:6]}")
    src = tmp_path / "src"
    make_tree(src, small_files=12)
    run_cli("init", str(src), "--replicas", "3", "--backend", uri,
            "--backend", f"dir:{dirs[0]}", "--backend", f"dir:{dirs[1]}")
    emulator.uploads_blocked = True
    try:
        proc = run_cli("push", "-m", "capped", cwd=src)
    finally:
        emulator.uploads_blocked = False
    assert "fewer copies than the configuration asks for" in proc.stderr
    assert "Traceback" not in proc.stderr
    run_cli("push", "-m", "again", cwd=src)
    proc = run_cli("fsck", cwd=src)
    assert "ok:" in proc.stdout


def test_expired_token_is_refreshed_and_saved(gd: GDriveBackend, gdrive_service: GDriveService) -> None:
    """When Drive answers 401 for an expired access token, the backend refreshes it
    at the token endpoint once, saves it for other processes, and the request
    succeeds."""
    gd.put("k", b"v")
    oauth = gdrive_service.emulator.oauth
    before = oauth.refreshes
    oauth.expire_access_tokens()
    assert gd.get("k") == b"v"
    assert oauth.refreshes == before + 1
    saved = token_store().load("gdrive", "default")
    assert saved is not None and saved.access_token == gd.tokens.access_token()


def test_revoked_grant_says_run_metasync_auth(gdrive_service: GDriveService) -> None:
    """A grant revoked at Google fails with one line naming `metasync auth gdrive
    --account ...`, from the backend and from the CLI (no traceback)."""
    gdrive_service.sign_in("revoked")
    grant = token_store().load("gdrive", "revoked")
    assert grant is not None and grant.refresh_token
    gdrive_service.emulator.oauth.revoke(grant.refresh_token)
    uri = _location(gdrive_service, "revoked") + "?account=revoked"
    backend = open_backend(uri, "ns")
    with pytest.raises(AuthorizationRequired) as info:
        backend.get("x")
    assert "run `metasync auth gdrive --account revoked`" in one_line(info.value)
    proc = run_cli("clone", uri, "/tmp/never-" + uuid.uuid4().hex, check=False)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert "metasync auth gdrive --account revoked" in proc.stderr
    with pytest.raises(AuthorizationRequired, match="not signed in"):
        open_backend("gdrive:revoked?account=nobody", "ns").exists()


def test_open_reads_one_revision(gd: GDriveBackend, gdrive_service: GDriveService) -> None:
    """open() reads ranges of the revision it started with: a replace while reading,
    and connections dropped meanwhile, never mix versions."""
    old = pattern_bytes(23, 0, 2 * CHUNK_SIZE + 5)
    gd.put("k", old)
    with gd.open("k") as stream:
        first = stream.read(MiB)
        gd.put("k", pattern_bytes(24, 0, 2 * CHUNK_SIZE + 5))
        gdrive_service.server._server.close_all()  # every open connection drops
        rest = stream.read()
    assert first + rest == old


def _colliding_log_names() -> tuple[str, str]:
    """Two log names in one index bucket (same first two bytes of SHA-256)."""
    seen: dict[bytes, str] = {}
    for i in itertools.count():
        name = f"bucket/{i}"
        prefix = hashlib.sha256(name.encode()).digest()[:2]
        if prefix in seen:
            return seen[prefix], name
        seen[prefix] = name
    raise AssertionError("unreachable")


def test_logs_sharing_an_index_bucket(gd: GDriveBackend) -> None:
    """Two logs whose names hash to one bucket: the second log's head is chained
    after the first's, each keeps its own entries, and a client new to both finds
    them through the chain (including the log that does not exist yet)."""
    first, second = _colliding_log_names()
    assert gd.logs.append(first, b"1a") == 0
    other = open_backend(gd.uri, gd.namespace)
    assert other.logs.fetch(second) == []
    assert other.logs.append(second, b"2a") == 0
    assert gd.logs.append(second, b"2b") == 1
    assert gd.logs.append(first, b"1b") == 1
    fresh = open_backend(gd.uri, gd.namespace)
    assert fresh.logs.fetch(first) == [(0, b"1a"), (1, b"1b")]
    assert fresh.logs.fetch(second) == [(0, b"2a"), (1, b"2b")]
    assert fresh.logs.append_at(second, 0, b"no") is False
    assert fresh.logs.append_at(second, 2, b"2c") is True
    assert gd.logs.fetch(second, 2) == [(2, b"2c")]
    other.close()
    fresh.close()


def test_listing_pages(gd: GDriveBackend, gdrive_service: GDriveService) -> None:
    """Listings follow nextPageToken through short and empty pages; files other apps
    left with names that are not keys are skipped."""
    emulator = gdrive_service.emulator
    emulator.page_size, emulator.short_pages = 7, True
    try:
        for i in range(30):
            gd.put(f"p/{i:02d}", b"")
        (folder,) = emulator.path_items(f"specific/{gd.namespace}/p")
        emulator.add_item(folder.id, "stray name", b"")
        before = emulator.calls.get("files.list", 0)
        assert sorted(gd.list()) == [f"p/{i:02d}" for i in range(30)]
        assert emulator.calls["files.list"] - before >= 5
    finally:
        emulator.page_size, emulator.short_pages = 1000, False


# --- sign-in and sharing through the CLI ---------------------------------------------------------


def _auth(args: list[str]) -> subprocess.Popen[str]:
    return start_auth("gdrive", args)


def _approve(url: str, ca_file: str) -> str:
    """The user approves in the browser: the emulator redirects to the loopback."""
    answer = httpx.get(url, verify=ssl.create_default_context(cafile=ca_file))
    assert answer.status_code == 302, answer.text
    location = answer.headers["location"]
    assert location.startswith("http://localhost:"), location
    assert "code=" in location and "state=" in location
    return location


def _check_grant(gdrive_service: GDriveService, account: str) -> None:
    store = token_store()
    assert isinstance(store, FileTokenStore)
    path = store.path("gdrive", account)
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    grant = store.load("gdrive", account)
    assert isinstance(grant, Grant) and grant.refresh_token and grant.app_secret
    backend = open_backend(_location(gdrive_service, "authed") + f"?account={account}",
                           fresh_namespace())
    backend.create()
    backend.put("k", b"signed in")
    assert backend.get("k") == b"signed in"
    backend.close()


def test_auth_gdrive_loopback(gdrive_service: GDriveService) -> None:
    """`metasync auth gdrive`: the installed-app flow with PKCE and offline access;
    the browser's redirect to the loopback address reaches metasync's one-shot local
    server, which finishes the sign-in by itself."""
    proc = _auth(["--account", "loopback"])
    url = read_printed_url(proc, gdrive_service.base_url + "/o/oauth2/auth?")
    for part in ("code_challenge_method=S256", "access_type=offline",
                 "redirect_uri=http%3A%2F%2Flocalhost%3A"):
        assert part in url
    location = _approve(url, gdrive_service.ca_file)
    page = httpx.get(location)  # the browser follows the redirect
    assert "signed in" in page.text
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert f"Signed in to gdrive as {TEST_EMAIL}" in out
    _check_grant(gdrive_service, "loopback")


def test_auth_gdrive_no_browser(gdrive_service: GDriveService) -> None:
    """`--no-browser` starts no server: the user opens the address anywhere and pastes
    the address the browser ended up at; a pasted address of another sign-in, an
    empty answer and a bad code each fail in one line with nothing saved."""
    proc = _auth(["--no-browser", "--account", "headless"])
    url = read_printed_url(proc, gdrive_service.base_url + "/o/oauth2/auth?")
    location = _approve(url, gdrive_service.ca_file)
    _out, err = proc.communicate(location + "\n", timeout=120)
    assert proc.returncode == 0, err
    _check_grant(gdrive_service, "headless")
    proc = _auth(["--no-browser", "--account", "bad"])
    url = read_printed_url(proc, gdrive_service.base_url)
    location = _approve(url, gdrive_service.ca_file).replace("state=", "state=x")
    _, err = proc.communicate(location + "\n", timeout=120)
    assert proc.returncode != 0 and "state differs" in err and "Traceback" not in err
    # A code from an abandoned --no-browser run, passed later with --code.
    proc = _auth(["--no-browser", "--account", "later"])
    location = _approve(read_printed_url(proc, gdrive_service.base_url), gdrive_service.ca_file)
    proc.communicate("", timeout=120)
    code = dict(parse_qsl(urlsplit(location).query))["code"]
    proc = _auth(["--account", "later", "--code", code])
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    _check_grant(gdrive_service, "later")
    proc = _auth(["--no-browser", "--account", "bad", "--code", "not-a-code"])
    _, err = proc.communicate(timeout=120)
    assert proc.returncode != 0 and "did not accept" in err and len(err.strip().splitlines()) == 1
    proc = _auth(["--no-browser", "--account", "bad"])
    _, err = proc.communicate("", timeout=120)
    assert proc.returncode != 0 and "cancelled" in err
    assert token_store().load("gdrive", "bad") is None


def test_share_invites_a_writer(gdrive_service: GDriveService, tmp_path: Path) -> None:
    """`metasync share EMAIL` on a repository over gdrive: + dir: gives EMAIL a writer
    permission on the namespace folder (once, however often it runs) and names dir:
    as manual."""
    namespace = fresh_namespace()
    work, store = init_repository_to_share(tmp_path, _location(gdrive_service, "shared"), namespace)
    for _ in range(2):
        check_share(work, store, "gdrive:shared")
    (ns,) = gdrive_service.emulator.path_items(f"shared/{namespace}")
    granted = gdrive_service.emulator.permissions[ns.id]
    assert [(p["emailAddress"], p["role"]) for p in granted] == [("friend@example.com", "writer")]
    proc = run_cli("share", "not-an-address@", cwd=work, check=False)
    assert proc.returncode != 0 or "by hand" in proc.stdout + proc.stderr


def test_repository_over_a_throttling_gdrive(
    gdrive_service: GDriveService, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """init, push, clone (from Drive), edit, push, pull over gdrive: + two dir:
    backends (R=2) while Drive answers a seeded 30% of requests with 429s, 403 rate
    limits, 503 and 500: every command succeeds, the clones match, fsck passes."""
    monkeypatch.setenv("METASYNC_RETRY_ATTEMPTS", "8")
    check_repository_over_throttling(
        gdrive_service, _location(gdrive_service, f"e2e-{uuid.uuid4().hex[:6]}"), tmp_path,
        rate=0.3, seed=9, kinds=GDRIVE_FAULTS, small_files=40, provider="Drive",
    )


# --- live tests (real Google Drive; `pytest --live`) ------------------------------------------------


@pytest.mark.live
def test_live_gdrive_round_trip(monkeypatch: pytest.MonkeyPatch) -> None:
    """Against real Google Drive: put, get, append (reserved ids), fetch, delete in a
    fresh namespace below METASYNC_LIVE_GDRIVE_PATH (a folder that exists). Needs
    METASYNC_LIVE_GDRIVE_APP_KEY, METASYNC_LIVE_GDRIVE_APP_SECRET and
    METASYNC_LIVE_GDRIVE_REFRESH_TOKEN (from `metasync auth gdrive`)."""
    names = ("METASYNC_LIVE_GDRIVE_APP_KEY", "METASYNC_LIVE_GDRIVE_APP_SECRET",
             "METASYNC_LIVE_GDRIVE_REFRESH_TOKEN")
    values = [os.environ.get(n) for n in names]
    if not all(values):
        pytest.fail(f"--live needs {', '.join(names)}")
    app_key, app_secret, refresh = (str(v) for v in values)
    token_store().save(Grant("gdrive", "live", app_key, refresh, app_secret=app_secret))
    backend = open_live_backend("gdrive", monkeypatch)
    try:
        backend.create()
        backend.put("k", b"v1")
        assert backend.get("k") == b"v1"
        assert backend.logs.append("log", b"a") == 0 and backend.logs.append("log", b"b") == 1
        assert backend.logs.append_at("log", 1, b"x") is False
        assert backend.logs.fetch("log") == [(0, b"a"), (1, b"b")]
        backend.delete("k")
        with pytest.raises(ObjectNotFound):
            backend.get("k")
    finally:
        backend.close()


# --- change feed -----------------------------------------------------------------------------


def _hasten(feed: ChangeFeed) -> None:
    """Ask every 0.05 s instead of every 30 s (the cost per ask is what is measured)."""
    assert isinstance(feed, DriveFeed)
    feed.interval = feed.active_interval = 0.05


def test_change_feed(gdrive_service: GDriveService) -> None:
    """changes.list from a saved page token: fires after another client's write or
    deletion in the namespace, not on an idle namespace nor for changes in a sibling
    namespace (their folders are looked up and found outside), survives a 503 of
    changes.list, close() unblocks a waiter, and an idle namespace costs one request
    per ask: 120 an hour at the 30 s interval."""
    check_change_feed(
        gdrive_service, _location(gdrive_service, "feeds"), kind="cursor",
        feed_routes=r"^/drive/v3/changes$", hasten=_hasten,
    )


def test_change_feed_learns_folders_once(gdrive_service: GDriveService) -> None:
    """Changes outside the namespace cost a look-up of each unknown folder above them
    once; later changes there cost nothing more than the ask."""
    location = _location(gdrive_service, "feeds")
    watcher = open_backend(location, fresh_namespace())
    watcher.create()
    other = open_backend(location, fresh_namespace())
    other.create()
    other.put("objects/a", b"1")
    feed = watcher.change_feed()
    assert isinstance(feed, DriveFeed)
    _hasten(feed)
    emulator = gdrive_service.emulator
    try:
        assert feed.wait(0) is False
        other.put("objects/b", b"2")
        before = dict(emulator.calls)
        assert feed.wait(0.3) is False
        first = call_delta(before, dict(emulator.calls)).get("files.get", 0)
        assert first >= 1  # the folders above objects/b were looked up
        other.put("objects/c", b"3")
        before = dict(emulator.calls)
        assert feed.wait(0.3) is False
        assert call_delta(before, dict(emulator.calls)).get("files.get", 0) == 0
    finally:
        feed.close()
        watcher.close()
        other.close()
