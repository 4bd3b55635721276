"""The ``dropbox:`` backend through the official Dropbox SDK against the Dropbox API
emulator (tests/emulators/dropbox.py): the shared conformance suite (with TCP resets
and injected 429s/5xx), Dropbox-specific behaviour, `metasync auth dropbox` against
the emulator's OAuth endpoints, `metasync share`, and live tests (``--live``)."""

from __future__ import annotations

import io
import os
import re
import ssl
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from conftest import PASSPHRASE, run_cli
from metasync.backends import open_backend
from metasync.backends.cloud import FileTokenStore, Grant, config_dir, token_store
from metasync.backends.conformance import pattern_bytes
from metasync.backends.dropbox import CHUNK_SIZE, DropboxBackend, DropboxFeed
from metasync.backends.retry import TransientError
from metasync.errors import AuthorizationRequired, UsageError
from tests.emulators.base import LOST_ANSWER, RESET, THROTTLE
from tests.emulators.dropbox import (
    DROPBOX_FAULTS,
    TEST_EMAIL,
    TOO_MANY_WRITE_OPERATIONS,
    WRITE_CONFLICT_THROTTLE,
    DropboxService,
)
from tests.providers_common import (
    FailingSource,
    MiB,
    ProviderConformance,
    check_change_feed,
    check_faults_helper,
    check_live_round_trip,
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


def _location(service: DropboxService, folder: str) -> str:
    return emulator_location(service, "dropbox", folder)


class TestDropboxBackend(ProviderConformance):
    """The conformance suite through the Dropbox SDK against the emulator."""

    backend_class = DropboxBackend

    @pytest.fixture
    def service(self, dropbox_service: DropboxService) -> DropboxService:
        return dropbox_service


# --- Dropbox-specific behaviour -------------------------------------------------------------


@pytest.fixture
def dbx(dropbox_service: DropboxService) -> Iterator[DropboxBackend]:
    with specific_backend(dropbox_service, _location(dropbox_service, "/specific")) as backend:
        assert isinstance(backend, DropboxBackend)
        yield backend


@pytest.mark.parametrize(
    ("uri", "match"),
    [
        ("dropbox:/a?colour=red", "unknown option 'colour'"),
        ("dropbox:/a/../b", "invalid folder name"),
        ("dropbox:/a?transfers=0", "positive"),
        ("dropbox:/a?account=../x", "invalid account"),
        ("dropbox:/a?api=http://127.0.0.1:9", "only https"),
        ("dropbox:/a?api=https://h/with/path", "no path"),
    ],
)
def test_bad_uris_are_usage_errors(uri: str, match: str) -> None:
    with pytest.raises(UsageError, match=match):
        open_backend(uri, "ns")


def test_layout_and_names(dropbox_service: DropboxService) -> None:
    """Key k of namespace ns is the file /PATH/ns/k; the root form and the account
    appear in the name; create() needs the location folder to exist."""
    backend = open_backend("dropbox:/specific?account=default", "layout")
    assert backend.name == "dropbox:/specific"
    dropbox_service.emulator.make_folder("/specific")
    backend.create()
    backend.put("a/b", b"x")
    assert dropbox_service.emulator.file_bytes("/specific/layout/a/b") == b"x"
    backend.close()
    missing = open_backend("dropbox:/no such folder", "ns")
    with pytest.raises(Exception) as info:
        missing.create()
    assert "create it there first" in one_line(info.value)
    assert "/no such folder" not in dropbox_service.emulator.nodes
    assert open_backend("dropbox:?account=work", "ns").name == "dropbox:/?account=work"


def test_exclusive_create_even_for_identical_bytes(dbx: DropboxBackend) -> None:
    """put_if_absent refuses an existing key even when the bytes are identical (Dropbox
    would accept identical bytes without strict_conflict): two appenders of the same
    message must not both win one log position."""
    assert dbx.put_if_absent("log/0000000000", b"same") is True
    assert dbx.put_if_absent("log/0000000000", b"same") is False
    assert dbx.logs.append("log", b"same") == 1
    assert dbx.logs.fetch("log") == [(0, b"same"), (1, b"same")]


def test_case_insensitive_paths(dbx: DropboxBackend) -> None:
    """Dropbox paths ignore case (capability case_sensitive=False): 'Case' and 'case'
    are one file, and listing keeps the case it was written with."""
    dbx.put("Dir/Case", b"upper")
    assert dbx.get("dir/case") == b"upper"
    assert dbx.put_if_absent("DIR/CASE", b"x") is False
    assert list(dbx.list()) == ["Dir/Case"]


def test_stream_uses_an_upload_session(dbx: DropboxBackend, dropbox_service: DropboxService) -> None:
    """A stream longer than one chunk goes through upload_session start/append/finish
    and reads back exactly; a short one is a single upload."""
    calls = dropbox_service.emulator.calls
    before = dict(calls)
    size = 2 * CHUNK_SIZE + 12345
    data = pattern_bytes(21, 0, size)
    dbx.put("big", io.BytesIO(data))
    delta = {k: calls.get(k, 0) - before.get(k, 0) for k in calls}
    assert delta.get("files/upload_session/start") == 1
    assert delta.get("files/upload_session/append_v2") == 2
    assert delta.get("files/upload_session/finish") == 1
    assert delta.get("files/upload", 0) == 0
    assert dbx.size("big") == size and dbx.get("big") == data


def test_interrupted_upload_session_resumes(
    dbx: DropboxBackend, dropbox_service: DropboxService
) -> None:
    """A connection lost before an append arrives, and one lost after it arrived
    (answer lost), and a finish whose answer is lost: the upload resumes at the offset
    Dropbox reports and commits the exact bytes once."""
    faults = dropbox_service.emulator.faults
    data = pattern_bytes(22, 0, 3 * CHUNK_SIZE + 7)
    faults.inject(RESET, LOST_ANSWER, only="append_v2")
    dbx.put("resumed", io.BytesIO(data))
    assert dbx.get("resumed") == data
    faults.inject(LOST_ANSWER, only="upload_session/finish")
    dbx.put("resumed", io.BytesIO(data[::-1]))
    assert dbx.get("resumed") == data[::-1]
    assert faults.pending() == 0


def test_upload_resumes_after_an_interrupted_put(
    dbx: DropboxBackend, dropbox_service: DropboxService
) -> None:
    """A put whose source fails after two pieces leaves its upload session journaled
    on this client; the next put of the same key re-reads and checks the part Dropbox
    has and sends only the rest into the same session. A different source for a key
    starts over; nothing is left in the journal."""
    calls = dropbox_service.emulator.calls
    data = pattern_bytes(31, 0, 4 * CHUNK_SIZE + 99)
    with pytest.raises(OSError, match="went away"):
        dbx.put("big", FailingSource(data, 2 * CHUNK_SIZE))
    journal = config_dir() / "uploads"
    assert len(list(journal.glob("dropbox-*.json"))) == 1
    before = dict(calls)
    dbx.put("big", io.BytesIO(data))
    delta = {k: calls.get(k, 0) - before.get(k, 0) for k in calls}
    assert delta.get("files/upload_session/start", 0) == 0
    # one empty append to check the session, then the 3 pieces Dropbox lacked
    assert delta["files/upload_session/append_v2"] == 4
    assert dbx.get("big") == data
    with pytest.raises(OSError):
        dbx.put("big2", FailingSource(data, 2 * CHUNK_SIZE))
    before = dict(calls)
    dbx.put("big2", io.BytesIO(data[::-1]))
    assert calls["files/upload_session/start"] - before["files/upload_session/start"] == 1
    assert dbx.get("big2") == data[::-1]
    assert not list(journal.glob("dropbox-*.json"))


def test_conditional_write_with_lost_answer_is_recognised(
    dbx: DropboxBackend, dropbox_service: DropboxService
) -> None:
    """An exclusive create or compare-and-swap that took effect but whose answer was
    lost reports success on the retry (the stored content hash is ours), while a
    genuine conflict still reports False."""
    faults = dropbox_service.emulator.faults
    faults.inject(LOST_ANSWER, only="files/upload$")
    assert dbx.put_if_absent("k", b"mine") is True
    token = dbx.poll("k")
    assert token is not None
    faults.inject(LOST_ANSWER, only="files/upload$")
    assert dbx.replace_if("k", b"mine v2", token) is True
    assert dbx.get("k") == b"mine v2"
    assert dbx.replace_if("k", b"stale", token) is False
    assert dbx.put_if_absent("k", b"other") is False


def test_throttling_answers_become_retry_after(
    dbx: DropboxBackend, dropbox_service: DropboxService
) -> None:
    """429 too_many_requests / too_many_write_operations carry Dropbox's retry_after
    into TransientError; the 409 write-error form of too_many_write_operations is
    transient too; with retries, each is ridden out."""
    faults = dropbox_service.emulator.faults
    dbx.put("k", b"v")
    dbx.policy.attempts = 1
    faults.retry_after = 7
    try:
        for kind in (THROTTLE, TOO_MANY_WRITE_OPERATIONS):
            faults.inject(kind)
            with pytest.raises(TransientError) as info:
                dbx.get("k")
            assert info.value.retry_after == 7.0, kind
            assert "throttling" in one_line(info.value)
        faults.inject(WRITE_CONFLICT_THROTTLE, only="files/upload$")
        with pytest.raises(TransientError, match="busy"):
            dbx.put("k", b"w")
    finally:
        faults.retry_after = 0
    dbx.policy.attempts = 5
    faults.inject(THROTTLE, TOO_MANY_WRITE_OPERATIONS, WRITE_CONFLICT_THROTTLE, only="files/upload$")
    dbx.put("k", b"after")
    assert dbx.get("k") == b"after"


def test_expired_token_is_refreshed_and_saved(
    dbx: DropboxBackend, dropbox_service: DropboxService
) -> None:
    """When Dropbox calls the access token expired, the backend refreshes it through
    the OAuth endpoint once, saves it for other processes, and the request succeeds."""
    dbx.put("k", b"v")
    before = dropbox_service.emulator.oauth.refreshes
    dropbox_service.emulator.oauth.expire_access_tokens()
    assert dbx.get("k") == b"v"
    assert dropbox_service.emulator.oauth.refreshes == before + 1
    saved = token_store().load("dropbox", "default")
    assert saved is not None and saved.access_token == dbx.tokens.access_token()


def test_revoked_grant_says_run_metasync_auth(dropbox_service: DropboxService) -> None:
    """A grant revoked on Dropbox's side fails with one line naming `metasync auth
    dropbox --account ...`, from the backend and from the CLI (no traceback)."""
    dropbox_service.sign_in("revoked")
    grant = token_store().load("dropbox", "revoked")
    assert grant is not None and grant.refresh_token
    dropbox_service.emulator.oauth.revoke(grant.refresh_token)
    uri = _location(dropbox_service, "/revoked") + "?account=revoked"
    backend = open_backend(uri, "ns")
    with pytest.raises(AuthorizationRequired) as info:
        backend.get("x")
    assert "run `metasync auth dropbox --account revoked`" in one_line(info.value)
    proc = run_cli("clone", uri, "/tmp/never-" + uuid.uuid4().hex, check=False)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert "metasync auth dropbox --account revoked" in proc.stderr
    nobody = open_backend("dropbox:/revoked?account=nobody", "ns")
    with pytest.raises(AuthorizationRequired, match="not signed in"):
        nobody.exists()


def test_open_resumes_the_same_revision(dbx: DropboxBackend, dropbox_service: DropboxService) -> None:
    """A download cut off mid-file resumes with a ranged download of the same rev:
    the stream returns the version it started with even if the file was replaced."""
    old = pattern_bytes(23, 0, 6 * MiB)
    dbx.put("k", old)
    with dbx.open("k") as stream:
        first = stream.read(MiB)
        dbx.put("k", pattern_bytes(24, 0, 6 * MiB))
        dropbox_service.server._server.close_all()  # every open connection drops
        rest = stream.read()
    assert first + rest == old


def test_listing_pages_and_skips_foreign_names(
    dbx: DropboxBackend, dropbox_service: DropboxService
) -> None:
    """Listings follow has_more cursors; files other tools left with names that are not
    keys are skipped."""
    emulator = dropbox_service.emulator
    emulator.page_size = 7
    try:
        for i in range(30):
            dbx.put(f"p/{i:02d}", b"")
        dbx.put("other", b"")
        upload = dropbox_service.emulator.nodes[f"{dbx.root}/other".lower()]
        emulator.nodes[f"{dbx.root}/stray name".lower()] = type(upload)(
            False, f"{dbx.root}/stray name", "id:stray", upload.rev + "1", 0, upload.blob,
            upload.content_hash, upload.server_modified,
        )
        before = emulator.calls.get("files/list_folder/continue", 0)
        assert sorted(dbx.list()) == sorted([f"p/{i:02d}" for i in range(30)] + ["other"])
        assert emulator.calls["files/list_folder/continue"] - before >= 4
    finally:
        emulator.page_size = 500


# --- sign-in and sharing through the CLI -----------------------------------------------------


def _auth(args: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
    return start_auth("dropbox", args, env)


def test_auth_dropbox_no_browser(dropbox_service: DropboxService) -> None:
    """`metasync auth dropbox --no-browser` prints the authorize URL (PKCE, offline
    access), reads the code the user copied from Dropbox's page on stdin, keeps the
    grant in a 0600 file, and a backend with ?account= then works."""
    env = {**os.environ}
    proc = _auth(["--no-browser", "--account", "cli"], env)
    assert proc.stdout is not None and proc.stdin is not None
    url = read_printed_url(proc, "https://")
    assert url.startswith(dropbox_service.base_url + "/oauth2/authorize?"), url
    assert "code_challenge_method=S256" in url and "token_access_type=offline" in url
    ca = ssl.create_default_context(cafile=dropbox_service.ca_file)
    page = httpx.get(url, verify=ca).text  # the user approves
    code = re.search(r"code into metasync: (\S+)", page)
    assert code is not None, page
    out, err = proc.communicate(code.group(1) + "\n", timeout=120)
    assert proc.returncode == 0, err
    assert f"Signed in to dropbox as {TEST_EMAIL}" in out
    store = token_store()
    assert isinstance(store, FileTokenStore)
    path = store.path("dropbox", "cli")
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    assert str(path).startswith(str(config_dir()))
    grant = store.load("dropbox", "cli")
    assert isinstance(grant, Grant) and grant.refresh_token and grant.app_key
    backend = open_backend(_location(dropbox_service, "/authed") + "?account=cli", "ns")
    backend.create()
    backend.put("k", b"signed in")
    assert backend.get("k") == b"signed in"
    backend.close()


def test_auth_dropbox_bad_code_and_missing_app_key(dropbox_service: DropboxService) -> None:
    """A code Dropbox rejects, an empty answer and a missing app key each end in one
    line and a non-zero exit, with nothing saved."""
    env = {**os.environ}
    proc = _auth(["--no-browser", "--account", "bad", "--code", "not-a-code"], env)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode != 0 and "Traceback" not in err
    assert "did not accept the code" in err and len(err.strip().splitlines()) == 1
    proc = _auth(["--no-browser", "--account", "bad"], env)
    _, err = proc.communicate("", timeout=120)
    assert proc.returncode != 0 and "cancelled" in err
    env.pop("METASYNC_DROPBOX_APP_KEY")
    proc = _auth(["--no-browser", "--account", "bad"], env)
    _, err = proc.communicate("", timeout=120)
    assert proc.returncode != 0 and "METASYNC_DROPBOX_APP_KEY" in err
    assert token_store().load("dropbox", "bad") is None


def test_share_invites_on_dropbox_and_lists_the_rest(
    dropbox_service: DropboxService, tmp_path: Path
) -> None:
    """`metasync share EMAIL` on a repository over dropbox: + dir: shares the Dropbox
    namespace folder (invitation as editor, idempotent) and names dir: as manual."""
    namespace = fresh_namespace()
    work, store = init_repository_to_share(tmp_path, _location(dropbox_service, "/shared"), namespace)
    for _ in range(2):
        check_share(work, store, "dropbox:/shared")
    node = dropbox_service.emulator.nodes[f"/shared/{namespace}"]
    assert node.shared_folder_id is not None
    assert dropbox_service.emulator.members[node.shared_folder_id] == {"friend@example.com"}
    assert PASSPHRASE  # the repository is encrypted like any other


def test_repository_over_a_throttling_dropbox(
    dropbox_service: DropboxService, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """init, push, clone (from Dropbox), edit, push, pull over dropbox: + two dir:
    backends (R=2) while Dropbox answers a seeded 35% of requests with 429s
    (with and without Retry-After), too_many_write_operations, 503 and 500: every
    command succeeds (8 attempts per request, as a user on a throttled account would
    set METASYNC_RETRY_ATTEMPTS), the clones match, and fsck passes."""
    monkeypatch.setenv("METASYNC_RETRY_ATTEMPTS", "8")
    check_repository_over_throttling(
        dropbox_service, _location(dropbox_service, f"/e2e-{uuid.uuid4().hex[:6]}"), tmp_path,
        rate=0.35, seed=8, kinds=DROPBOX_FAULTS, small_files=60, provider="Dropbox",
    )


# --- live tests (real Dropbox; `pytest --live`) ------------------------------------------------


@pytest.mark.live
def test_live_dropbox_round_trip(monkeypatch: pytest.MonkeyPatch) -> None:
    """Against real Dropbox: put, exclusive create, append, fetch, CAS, delete in a
    fresh namespace below METASYNC_LIVE_DROPBOX_PATH. Needs METASYNC_LIVE_DROPBOX_APP_KEY
    and METASYNC_LIVE_DROPBOX_REFRESH_TOKEN (from `metasync auth dropbox`)."""
    app_key = os.environ.get("METASYNC_LIVE_DROPBOX_APP_KEY")
    refresh = os.environ.get("METASYNC_LIVE_DROPBOX_REFRESH_TOKEN")
    if not app_key or not refresh:
        pytest.fail("--live needs METASYNC_LIVE_DROPBOX_APP_KEY and METASYNC_LIVE_DROPBOX_REFRESH_TOKEN")
    token_store().save(Grant("dropbox", "live", app_key, refresh))
    backend = open_live_backend("dropbox", monkeypatch)
    try:
        check_live_round_trip(backend)
    finally:
        backend.close()


def test_faults_helper_counts_both_kinds(dropbox_service: DropboxService) -> None:
    """EmulatorFaults (faulty_location) injects TCP resets and HTTP faults alike."""
    check_faults_helper(
        dropbox_service, _location(dropbox_service, "/faulty"), ["429", "too_many_write_operations"]
    )


# --- change feed -----------------------------------------------------------------------------


def test_change_feed(dropbox_service: DropboxService) -> None:
    """files/list_folder/longpoll on a cursor of the namespace folder: fires after
    another client's write, not on an idle namespace nor on a sibling namespace,
    survives a 503 of the long-poll or list_folder/continue, close() unblocks a
    waiter, and an idle namespace costs at most 120 requests an hour (one per 480 s
    long-poll: the emulator shortens Dropbox's seconds for the test)."""
    emulator = dropbox_service.emulator
    emulator.longpoll_scale = 0.0005
    try:
        check_change_feed(
            dropbox_service, _location(dropbox_service, "/feeds"), kind="longpoll",
            feed_routes=r"/2/files/list_folder/(longpoll|continue)$",
        )
    finally:
        emulator.longpoll_scale = 1.0


def test_change_feed_honours_backoff(dropbox_service: DropboxService) -> None:
    """A long-poll answer's ``backoff`` pauses the next long-poll for that long:
    with a backoff of an hour, one round is made, and close() ends the pause."""
    emulator = dropbox_service.emulator
    emulator.longpoll_scale = 0.0005
    emulator.longpoll_backoff = 3600
    backend = open_backend(_location(dropbox_service, "/feeds"), fresh_namespace())
    backend.create()
    feed = backend.change_feed()
    assert isinstance(feed, DropboxFeed)
    try:
        before = emulator.calls.get("files/list_folder/longpoll", 0)
        assert feed.wait(0.5) is False
        feed.close()
        assert feed.join(30)
        assert feed.rounds == 1
        assert emulator.calls.get("files/list_folder/longpoll", 0) - before == 1
    finally:
        emulator.longpoll_scale = 1.0
        emulator.longpoll_backoff = None
        feed.close()
        backend.close()


def test_longpoll_is_unsigned_and_bounded(dropbox_service: DropboxService) -> None:
    """The emulator's long-poll takes no sign-in (the notify host) and refuses a
    timeout outside 30..480 s, as Dropbox documents; a cursor Dropbox does not know
    is ``reset``."""
    ca = ssl.create_default_context(cafile=dropbox_service.ca_file)
    url = f"{dropbox_service.base_url}/2/files/list_folder/longpoll"
    answer = httpx.post(url, json={"cursor": "nope", "timeout": 30}, verify=ca)
    assert answer.status_code == 409 and answer.json()["error"][".tag"] == "reset"
    answer = httpx.post(url, json={"cursor": "nope", "timeout": 10}, verify=ca)
    assert answer.status_code == 400
