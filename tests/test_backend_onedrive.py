"""The ``onedrive:`` backend (Microsoft Graph REST + the msal SDK) against the Graph and
identity-platform emulator (tests/emulators/onedrive.py): the shared conformance suite
(with TCP resets and injected 429s/503s/500s), OneDrive-specific behaviour (exclusive
create by conflictBehavior=fail, If-Match compare-and-swap, upload sessions and their
resumption, throttling, token refresh and revocation, names OneDrive refuses),
`metasync auth onedrive` (device code through the CLI, browser flow with a loopback
redirect), `metasync share`, an end-to-end run, and live tests (``--live``)."""

from __future__ import annotations

import base64
import io
import os
import random
import re
import ssl
import subprocess
import threading
import uuid
from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path

import httpx
import pytest

from conftest import METASYNC, run_cli
from metasync.backends import open_backend
from metasync.backends.cloud import (
    AuthRequest,
    Endpoint,
    FileTokenStore,
    Grant,
    authorize,
    config_dir,
    token_store,
)
from metasync.backends.conformance import pattern_bytes
from metasync.backends.feeds import ChangeFeed
from metasync.backends.onedrive import (
    CHUNK_SIZE,
    FRAGMENT_UNIT,
    SIMPLE_UPLOAD_LIMIT,
    OneDriveBackend,
    OneDriveFeed,
    QuickXorHash,
    decode_name,
    encode_name,
    quick_xor,
)
from metasync.backends.retry import TransientError
from metasync.errors import AuthorizationRequired, ObjectNotFound, UsageError
from tests.emulators.base import (
    LOST_ANSWER,
    RESET,
    SERVER_ERROR,
    THROTTLE,
    THROTTLE_NO_RETRY_AFTER,
    UNAVAILABLE,
)
from tests.emulators.onedrive import (
    ONEDRIVE_FAULTS,
    TEST_APP_ID,
    TEST_EMAIL,
    UNAVAILABLE_NO_RETRY_AFTER,
    OneDriveService,
    check_name,
)
from tests.providers_common import (
    FailingSource,
    MiB,
    ProviderConformance,
    call_delta,
    check_change_feed,
    check_live_round_trip,
    check_repository_over_throttling,
    check_share,
    emulator_location,
    fresh_namespace,
    init_repository_to_share,
    one_line,
    open_live_backend,
    specific_backend,
)


def _location(service: OneDriveService, folder: str) -> str:
    return emulator_location(service, "onedrive", folder)


class TestOneDriveBackend(ProviderConformance):
    """The conformance suite through Graph and MSAL against the emulator."""

    backend_class = OneDriveBackend
    unicode_folder = "ünï cødé ☃/with space & 100%"

    @pytest.fixture
    def service(self, onedrive_service: OneDriveService) -> OneDriveService:
        return onedrive_service


# --- OneDrive-specific behaviour ------------------------------------------------------------


@pytest.fixture
def od(onedrive_service: OneDriveService) -> Iterator[OneDriveBackend]:
    with specific_backend(onedrive_service, _location(onedrive_service, "/specific")) as backend:
        assert isinstance(backend, OneDriveBackend)
        yield backend
        onedrive_service.emulator.faults.retry_after = 0


@pytest.mark.parametrize(
    ("uri", "match"),
    [
        ("onedrive:/a?colour=red", "unknown option 'colour'"),
        ("onedrive:/a/../b", "invalid folder name"),
        ("onedrive:/a:b", "invalid folder name"),
        ("onedrive:/a?transfers=0", "positive"),
        ("onedrive:/a?account=../x", "invalid account"),
        ("onedrive:/a?api=https://h/with/path", "no path"),
    ],
)
def test_bad_uris_are_usage_errors(uri: str, match: str) -> None:
    with pytest.raises(UsageError, match=match):
        open_backend(uri, "ns")


def test_quickxorhash_matches_published_vectors_and_the_plain_algorithm() -> None:
    """QuickXorHash gives the published test vectors (rclone's, from Microsoft's
    reference code) however the input is split, and equals the byte-by-byte definition
    on random data crossing many 160-byte periods."""
    vectors = [
        ("", "AAAAAAAAAAAAAAAAAAAAAAAAAAA="),
        ("Sg==", "SgAAAAAAAAAAAAAAAQAAAAAAAAA="),
        ("tbQ=", "taAFAAAAAAAAAAAAAgAAAAAAAAA="),
        ("2fuxhBJXtpWFe8dOfdGeHw==", "O9tHLAghgSvYohKFyMMxnNCHaHg="),
        ("jyibxJSzO6ZiZ0O1qe3tG/bvIAYssvukh9suIT5wEy1JBINVgPiqdsTW0cOpP0aUfP7mgqLfADkzI/m/"
         "GgCuVhr8oFLrOCoTx1/psBOWwhltCbhUx51Icm9aH8tY4Z3ccU+6BKpYQkLCy0B/A9Zc",
         "hZfLIilSITC6N3e3tQ/iSgEzkto="),
    ]
    for given, expected in vectors:
        data = base64.b64decode(given)
        for step in (1, 7, 160, 1000):
            hasher = QuickXorHash()
            for at in range(0, len(data), step):
                hasher.update(data[at : at + step])
            assert hasher.b64digest() == expected, (len(data), step)

    def plain(data: bytes) -> str:
        state = 0
        for i, byte in enumerate(data):
            shift = 11 * i % 160
            bits = byte << shift
            state ^= (bits | (bits >> 160)) & ((1 << 160) - 1)
        out = bytearray(state.to_bytes(20, "little"))
        for i, byte in enumerate(len(data).to_bytes(8, "little")):
            out[12 + i] ^= byte
        return base64.b64encode(bytes(out)).decode()

    rng = random.Random(8)
    data = rng.randbytes(70_001)
    hasher = QuickXorHash()
    at = 0
    while at < len(data):
        step = rng.choice((1, 159, 160, 161, 4096, 65537))
        hasher.update(data[at : at + step])
        at += step
    assert hasher.b64digest() == plain(data) == quick_xor(data)


def test_names_onedrive_refuses_are_escaped(od: OneDriveBackend, onedrive_service: OneDriveService) -> None:
    """Key parts OneDrive refuses (trailing '.', reserved names, '_vti_') are stored
    under fullwidth escapes the emulator accepts, list and read back as the keys, and
    the escaping is a bijection; files whose names are no escaped key are skipped."""
    for part in ("...", "trailing.", "CON", "con.txt", "Lpt9", "desktop.ini", ".lock", "a_vti_b",
                 "_vti_vti_", "plain", "-dash"):
        name = encode_name(part)
        check_name(name)  # OneDrive accepts the stored name
        assert decode_name(name) == part
    for refused in ("trailing.", "CON", "desktop.ini", "a_vti_b"):
        with pytest.raises(Exception, match="invalid characters"):
            check_name(refused)
    assert encode_name("trailing.") == "trailing．"
    assert decode_name("trailing.") is None and decode_name("x y") is None
    assert decode_name("ａ") is None  # not how key part 'a' is stored
    od.put("x/trailing.", b"t")
    od.put("CON", b"c")
    assert onedrive_service.emulator.file_bytes(f"{od.root}/x/trailing．") == b"t"
    assert onedrive_service.emulator.file_bytes(f"{od.root}/ＣON") == b"c"
    assert sorted(od.list()) == ["CON", "x/trailing."]


def test_exclusive_create_race_has_one_winner(od: OneDriveBackend, onedrive_service: OneDriveService) -> None:
    """put_if_absent is PUT content with conflictBehavior=fail: of 8 threads creating
    one key with identical bytes exactly one wins; the losers got Graph's 409
    nameAlreadyExists. A session upload (above the simple-upload limit) with
    conflictBehavior=fail refuses an existing name too."""
    results: list[bool] = []
    barrier = threading.Barrier(8)

    def racer() -> None:
        barrier.wait()
        results.append(od.put_if_absent("race", b"same bytes"))

    threads = [threading.Thread(target=racer) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(results) == [False] * 7 + [True]
    big = pattern_bytes(3, 0, SIMPLE_UPLOAD_LIMIT + FRAGMENT_UNIT + 1)
    assert od.put_if_absent("big", big) is True
    assert od.put_if_absent("big", big[::-1]) is False
    assert od.get("big") == big
    assert onedrive_service.emulator.sessions() == 0, "a refused session was left open"
    # The raw answer, as Graph spells it.
    token = od.tokens.access_token()
    url = f"{od._item_url(od._path('race'))}/content?@microsoft.graph.conflictBehavior=fail"
    answer = httpx.put(url, content=b"x", headers={"Authorization": f"Bearer {token}"},
                       verify=ssl.create_default_context(cafile=onedrive_service.ca_file))
    assert answer.status_code == 409
    error = answer.json()["error"]
    assert error["code"] == "nameAlreadyExists" and "request-id" in error["innerError"]


def test_if_match_compare_and_swap(od: OneDriveBackend, onedrive_service: OneDriveService) -> None:
    """replace_if is PUT /items/{id}/content with If-Match on the eTag: a stale token
    gets 412 (False), a deleted or deleted-and-recreated key never matches, and large
    objects swap through an upload session with If-Match."""
    od.put("cas", b"v1")
    token = od.poll("cas")
    assert token is not None
    assert od.replace_if("cas", b"v2", token) is True
    assert od.replace_if("cas", b"v3", token) is False
    fresh = od.poll("cas")
    assert fresh is not None and fresh != token
    od.delete("cas")
    od.put("cas", b"recreated")
    assert od.replace_if("cas", b"v4", fresh) is False
    assert od.get("cas") == b"recreated"
    assert od.replace_if("cas", b"v5", "not a token") is False
    big = pattern_bytes(4, 0, SIMPLE_UPLOAD_LIMIT + 2 * FRAGMENT_UNIT)
    current = od.poll("cas")
    assert current is not None
    assert od.replace_if("cas", big, current) is True
    assert od.replace_if("cas", big[::-1], current) is False
    assert od.get("cas") == big
    token = od.tokens.access_token()
    item_id, etag = current.split("|", 1)
    answer = httpx.put(f"{od.drive}/items/{item_id}/content", content=b"x",
                       headers={"Authorization": f"Bearer {token}", "If-Match": etag},
                       verify=ssl.create_default_context(cafile=onedrive_service.ca_file))
    assert answer.status_code == 412 and answer.json()["error"]["code"] == "resourceModified"


def test_conditional_writes_and_deletes_with_lost_answers(
    od: OneDriveBackend, onedrive_service: OneDriveService
) -> None:
    """A create, compare-and-swap or delete that took effect but whose answer was lost
    reports success on the retry (the stored quickXorHash is ours; the item is gone),
    while a genuine conflict still reports False."""
    faults = onedrive_service.emulator.faults
    faults.inject(LOST_ANSWER, only="/content$")
    assert od.put_if_absent("k", b"mine") is True
    token = od.poll("k")
    assert token is not None
    faults.inject(LOST_ANSWER, only="/content$")
    assert od.replace_if("k", b"mine v2", token) is True
    assert od.get("k") == b"mine v2"
    assert od.replace_if("k", b"stale", token) is False
    assert od.put_if_absent("k", b"other") is False
    faults.inject(LOST_ANSWER, only=r"/items/[^/]+$")
    od.delete("k")
    with pytest.raises(ObjectNotFound):
        od.get("k")
    assert faults.pending() == 0


@pytest.fixture
def small_fragments(monkeypatch: pytest.MonkeyPatch) -> int:
    """Fragments of 2 x 320 KiB and simple uploads up to 512 KiB, so that session tests
    move a few MiB instead of tens (the protocol is the same)."""
    from metasync.backends import onedrive

    monkeypatch.setattr(onedrive, "CHUNK_SIZE", 2 * FRAGMENT_UNIT)
    monkeypatch.setattr(onedrive, "SIMPLE_UPLOAD_LIMIT", 512 * 1024)
    return 2 * FRAGMENT_UNIT


def test_upload_sessions_use_aligned_fragments_and_survive_lost_requests(
    od: OneDriveBackend, onedrive_service: OneDriveService, small_fragments: int
) -> None:
    """A stream above the simple-upload limit goes through createUploadSession and
    fragments whose sizes are multiples of 320 KiB (only the last is shorter). A
    fragment lost before it arrived, one whose answer was lost (the resend finds it in
    nextExpectedRanges), and a lost answer to the committing fragment all end in the
    exact bytes, committed once."""
    emulator = onedrive_service.emulator
    chunk = small_fragments
    size = 2 * chunk + 12345
    data = pattern_bytes(21, 0, size)
    before, fragments = dict(emulator.calls), len(emulator.fragments)
    emulator.faults.inject(RESET, LOST_ANSWER, only="^/up/")
    od.put("big", io.BytesIO(data))
    delta = call_delta(before, emulator.calls)
    assert delta["create upload session"] == 1 and "put content" not in delta
    sent = emulator.fragments[fragments:]
    assert [start for start, _, _ in sent] == [0, chunk, 2 * chunk]
    assert all(length % FRAGMENT_UNIT == 0 for _, length, _ in sent[:-1])
    assert all(start % FRAGMENT_UNIT == 0 for start, _, _ in sent)
    assert delta["upload status"] >= 1  # the resend asked which bytes arrived
    assert od.get("big") == data
    emulator.faults.inject(LOST_ANSWER, only="^/up/")
    small = pattern_bytes(22, 0, chunk)  # one fragment: it commits
    od.put("big", io.BytesIO(small))
    assert od.get("big") == small and emulator.faults.pending() == 0
    assert emulator.sessions() == 0


def test_upload_resumes_after_an_interrupted_put(
    od: OneDriveBackend, onedrive_service: OneDriveService, small_fragments: int
) -> None:
    """A put whose source fails after two fragments leaves its upload session
    journaled on this client; the next put of the same key re-reads and checks the
    part the session has, asks it for nextExpectedRanges and sends only the rest, at
    the same 320 KiB-aligned offsets. A different source for a key starts over."""
    emulator = onedrive_service.emulator
    chunk = small_fragments
    data = pattern_bytes(31, 0, 4 * chunk + 99)
    with pytest.raises(OSError, match="went away"):
        od.put("big", FailingSource(data, 2 * chunk))
    journal = config_dir() / "uploads"
    assert len(list(journal.glob("onedrive-*.json"))) == 1
    before, fragments = dict(emulator.calls), len(emulator.fragments)
    od.put("big", io.BytesIO(data))
    delta = call_delta(before, emulator.calls)
    assert "create upload session" not in delta
    assert delta["upload status"] == 1 and delta["upload fragment"] == 3
    assert [s for s, _, _ in emulator.fragments[fragments:]] == [2 * chunk, 3 * chunk, 4 * chunk]
    assert od.get("big") == data
    with pytest.raises(OSError):
        od.put("big2", FailingSource(data, 2 * chunk))
    before = dict(emulator.calls)
    od.put("big2", io.BytesIO(data[::-1]))
    assert call_delta(before, emulator.calls)["create upload session"] == 1
    assert od.get("big2") == data[::-1]
    assert not list(journal.glob("onedrive-*.json"))
    assert emulator.sessions() == 0, "the abandoned session was not cancelled"


def test_throttling_answers_become_retry_after(
    od: OneDriveBackend, onedrive_service: OneDriveService
) -> None:
    """Graph throttling: 429 activityLimitReached and 503 serviceNotAvailable with a
    Retry-After carry it into TransientError, without one the backoff decides, 500 is
    transient; with retries every kind is ridden out, on reads and writes."""
    faults = onedrive_service.emulator.faults
    od.put("k", b"v")
    od.policy.attempts = 1
    faults.retry_after = 7
    for kind, retry_after in ((THROTTLE, 7.0), (UNAVAILABLE, 7.0), (THROTTLE_NO_RETRY_AFTER, None),
                              (UNAVAILABLE_NO_RETRY_AFTER, None), (SERVER_ERROR, None)):
        faults.inject(kind)
        with pytest.raises(TransientError) as info:
            od.get("k")
        assert info.value.retry_after == retry_after, kind
        assert "throttling" in one_line(info.value) or "answered 500" in str(info.value)
    faults.retry_after = 0
    od.policy.attempts = 5
    faults.inject(*ONEDRIVE_FAULTS[:4], only="/content$")
    od.put("k", b"after")
    faults.inject(*ONEDRIVE_FAULTS[:4])
    assert od.get("k") == b"after"


def test_expired_token_is_refreshed_with_msal_and_saved(
    od: OneDriveBackend, onedrive_service: OneDriveService
) -> None:
    """When Graph calls the access token expired (401 InvalidAuthenticationToken), the
    backend refreshes through MSAL's acquire_token_silent once, keeps Microsoft's
    rotated refresh token and the MSAL cache in the saved grant, and the request
    succeeds; a second client then uses the saved grant without refreshing again."""
    od.put("k", b"v")
    emulator = onedrive_service.emulator
    grant_before = token_store().load("onedrive", "default")
    assert grant_before is not None
    before = emulator.oauth.refreshes
    emulator.oauth.expire_access_tokens()
    assert od.get("k") == b"v"
    assert emulator.oauth.refreshes == before + 1
    saved = token_store().load("onedrive", "default")
    assert saved is not None and saved.access_token == od.tokens.access_token()
    assert saved.refresh_token != grant_before.refresh_token  # rotated, and kept
    assert saved.refresh_token in saved.extra["msal_cache"]
    assert "AccessToken" not in saved.extra["msal_cache"]  # the grant holds it once
    other = open_backend(od.uri, od.namespace)
    assert other.get("k") == b"v"
    assert emulator.oauth.refreshes == before + 1
    other.close()
    # The identity platform throttling or failing during a refresh is transient too.
    emulator.oauth.expire_access_tokens()
    emulator.faults.inject(THROTTLE, SERVER_ERROR, UNAVAILABLE, only=r"/oauth2/v2\.0/token|well-known")
    third = open_backend(od.uri, od.namespace)
    assert third.get("k") == b"v"
    assert emulator.oauth.refreshes == before + 2 and emulator.faults.pending() == 0
    third.close()


def test_open_resumes_the_same_version(od: OneDriveBackend, onedrive_service: OneDriveService) -> None:
    """A download cut off mid-file resumes with a Range request to the same download
    URL: the stream returns the version it started with even if the file was replaced,
    and its quickXorHash is checked."""
    old = pattern_bytes(23, 0, 6 * MiB)
    od.put("k", old)
    with od.open("k") as stream:
        first = stream.read(MiB)
        od.put("k", pattern_bytes(24, 0, 6 * MiB))
        onedrive_service.server._server.close_all()  # every open connection drops
        rest = stream.read()
    assert first + rest == old


def test_listing_pages_and_missing_parents(od: OneDriveBackend, onedrive_service: OneDriveService) -> None:
    """Listings follow @odata.nextLink pages; files other tools left with names that
    are no key are skipped. A service that does not create the parent folders of a path
    upload (404) gets them created first."""
    emulator = onedrive_service.emulator
    emulator.page_size = 7
    try:
        for i in range(30):
            od.put(f"p/{i:02d}", b"")
        od.put("other", b"")
        token = od.tokens.access_token()
        for stray in ("stray name", "ａ"):
            answer = httpx.put(
                f"{od._item_url(od.root + '/' + stray)}/content", content=b"",
                headers={"Authorization": f"Bearer {token}"},
                verify=ssl.create_default_context(cafile=onedrive_service.ca_file))
            assert answer.status_code == 201
        before = emulator.calls.get("list children", 0)
        assert sorted(od.list()) == sorted([f"p/{i:02d}" for i in range(30)] + ["other"])
        assert emulator.calls["list children"] - before >= 6
    finally:
        emulator.page_size = 200
    emulator.auto_create_parents = False
    try:
        od.put("deep/er/key", b"made")
        assert od.put_if_absent("deep/other/key", b"x") is True
    finally:
        emulator.auto_create_parents = True
    assert od.get("deep/er/key") == b"made"


# --- sign-in and sharing -------------------------------------------------------------------


class _Form(HTMLParser):
    """The action and hidden fields of the first form of a page."""

    def __init__(self) -> None:
        super().__init__()
        self.action = ""
        self.fields: dict[str, str] = {}

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        values = {k: v or "" for k, v in attrs}
        if tag == "form" and not self.action:
            self.action = values.get("action", "")
        if tag == "input" and values.get("type") == "hidden":
            self.fields[values["name"]] = values.get("value", "")


class _NoUI:
    def show(self, text: str) -> None:
        raise AssertionError(f"nothing should be shown: {text}")

    def open_browser(self, url: str) -> bool:
        raise AssertionError("no browser should open")

    def prompt(self, text: str) -> str:
        raise AssertionError("no prompt expected")


class TestOneDriveSignInAndCLI:
    """Sign-in, sharing and whole repositories through the `metasync` CLI (a class of
    its own, so that the test workers run it beside the conformance suite and the
    backend tests)."""

    def test_revoked_grant_says_run_metasync_auth(self, onedrive_service: OneDriveService) -> None:
        """A grant revoked on Microsoft's side (invalid_grant) fails with one line naming
        `metasync auth onedrive --account ...`, from the backend and from the CLI (no
        traceback); an account never signed in says so."""
        onedrive_service.sign_in("revoked")
        grant = token_store().load("onedrive", "revoked")
        assert grant is not None and grant.refresh_token
        onedrive_service.emulator.oauth.revoke(grant.refresh_token)
        uri = _location(onedrive_service, "/revoked") + "?account=revoked"
        backend = open_backend(uri, "ns")
        with pytest.raises(AuthorizationRequired) as info:
            backend.get("x")
        assert "run `metasync auth onedrive --account revoked`" in one_line(info.value)
        proc = run_cli("clone", uri, "/tmp/never-" + uuid.uuid4().hex, check=False)
        assert proc.returncode != 0 and "Traceback" not in proc.stderr
        assert "metasync auth onedrive --account revoked" in proc.stderr
        nobody = open_backend("onedrive:/revoked?account=nobody", "ns")
        with pytest.raises(AuthorizationRequired, match="not signed in"):
            nobody.exists()

    def test_auth_onedrive_device_code_through_the_cli(self, onedrive_service: OneDriveService) -> None:
        """`metasync auth onedrive --no-browser` runs MSAL's device-code flow against the
        emulator: it prints the verification page and code, the user enters the code there,
        and the CLI finishes, keeping the grant (MSAL cache included) in a 0600 file; a
        backend with ?account= then works."""
        proc = subprocess.Popen(
            [METASYNC, "auth", "onedrive", "--no-browser", "--account", "cli"],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        assert proc.stdout is not None
        code = None
        for line in proc.stdout:
            found = re.search(r"open the page (\S+) and enter the code (\S+)", line)
            if found:
                assert found.group(1) == f"{onedrive_service.base_url}/devicelogin"
                code = found.group(2)
                break
        assert code is not None, proc.stderr.read() if proc.stderr else ""
        ca = ssl.create_default_context(cafile=onedrive_service.ca_file)
        page = httpx.post(f"{onedrive_service.base_url}/devicelogin", data={"otc": code}, verify=ca)
        assert page.status_code == 200
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        assert f"Signed in to onedrive as {TEST_EMAIL}" in out
        store = token_store()
        assert isinstance(store, FileTokenStore)
        path = store.path("onedrive", "cli")
        assert oct(path.stat().st_mode & 0o777) == "0o600"
        grant = store.load("onedrive", "cli")
        assert isinstance(grant, Grant) and grant.refresh_token and grant.app_key == TEST_APP_ID
        assert grant.extra["tenant"] == "common" and "RefreshToken" in grant.extra["msal_cache"]
        backend = open_backend(_location(onedrive_service, "/authed") + "?account=cli", "ns")
        backend.create()
        backend.put("k", b"signed in")
        assert backend.get("k") == b"signed in"
        backend.close()

    def test_auth_onedrive_in_a_browser(self, onedrive_service: OneDriveService) -> None:
        """With a browser, sign-in is MSAL's authorization-code flow (PKCE, nonce): the
        browser opens the authorize page, Microsoft answers with a form posted to the
        loopback redirect (response_mode=form_post), MSAL redeems the code."""
        ca = ssl.create_default_context(cafile=onedrive_service.ca_file)
        shown: list[str] = []
        errors: list[BaseException] = []

        def browse(url: str) -> None:
            try:
                assert "code_challenge_method=S256" in url and "nonce=" in url
                page = httpx.get(url, verify=ca)
                form = _Form()
                form.feed(page.text)
                assert form.action.startswith("http://localhost:"), form.action
                answer = httpx.post(form.action, data=form.fields)
                assert answer.status_code == 200, answer.text
            except BaseException as exc:  # reported by the test thread below
                errors.append(exc)

        class UI:
            def show(self, text: str) -> None:
                shown.append(text)

            def open_browser(self, url: str) -> bool:
                threading.Thread(target=browse, args=(url,), daemon=True).start()
                return True

            def prompt(self, text: str) -> str:
                raise AssertionError("no prompt in the browser flow")

        grant = authorize(AuthRequest("onedrive", "browser", TEST_APP_ID, None, False, None,
                                      Endpoint(onedrive_service.base_url, onedrive_service.ca_file)), UI())
        assert not errors, errors
        assert grant.extra["email"] == TEST_EMAIL and grant.refresh_token
        assert any("browser window" in text for text in shown)
        backend = open_backend(_location(onedrive_service, "/browser") + "?account=browser", "ns")
        backend.create()
        assert backend.exists()
        backend.close()

    def test_auth_onedrive_refusals(self, onedrive_service: OneDriveService) -> None:
        """--code and --app-secret (OneDrive apps are public clients) are refused before
        anything is sent; through the CLI, a missing app key ends in one line naming the
        variable and a non-zero exit, with nothing saved."""
        where = Endpoint(onedrive_service.base_url, onedrive_service.ca_file)
        for code, secret, match in (("abc", None, "takes no --code"), (None, "s3cret", "public client")):
            with pytest.raises(UsageError, match=match):
                authorize(AuthRequest("onedrive", "bad", TEST_APP_ID, secret, True, code, where),
                          _NoUI())
        env = {k: v for k, v in os.environ.items() if k != "METASYNC_ONEDRIVE_APP_KEY"}
        proc = subprocess.run([METASYNC, "auth", "onedrive", "--no-browser", "--account", "bad"],
                              capture_output=True, text=True, env=env, stdin=subprocess.DEVNULL)
        assert proc.returncode != 0 and "Traceback" not in proc.stderr
        assert "METASYNC_ONEDRIVE_APP_KEY" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
        assert token_store().load("onedrive", "bad") is None

    def test_share_invites_on_onedrive_and_lists_the_rest(
        self, onedrive_service: OneDriveService, tmp_path: Path
    ) -> None:
        """`metasync share EMAIL` on a repository over onedrive: + dir: invites the address
        to write to the OneDrive namespace folder (driveItem invite, idempotent) and names
        dir: as manual."""
        folder = _location(onedrive_service, "/shared")
        namespace = fresh_namespace()
        work, store = init_repository_to_share(tmp_path, folder, namespace)
        for _ in range(2):
            check_share(work, store, "onedrive:/shared")
        item = onedrive_service.emulator.item_at(f"/shared/{namespace}")
        assert onedrive_service.emulator.members[item.id] == {"friend@example.com"}
        backend = open_backend(folder, namespace)
        with pytest.raises(UsageError, match="refused"):
            backend.share("not-an-address@")
        backend.close()

    def test_repository_over_a_throttling_onedrive(
        self, onedrive_service: OneDriveService, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """init, push, clone (from OneDrive), edit, push, pull over onedrive: + two dir:
        backends (R=2) while OneDrive answers a seeded 35% of requests with 429s and 503s
        (with and without Retry-After) and 500s: every command succeeds (8 attempts per
        request), the clones match, and fsck passes."""
        monkeypatch.setenv("METASYNC_RETRY_ATTEMPTS", "8")
        check_repository_over_throttling(
            onedrive_service, _location(onedrive_service, f"/e2e-{uuid.uuid4().hex[:6]}"),
            tmp_path, rate=0.35, seed=8, kinds=ONEDRIVE_FAULTS, small_files=40,
            provider="OneDrive",
        )


# --- live tests (real OneDrive; `pytest --live`) ----------------------------------------------


@pytest.mark.live
def test_live_onedrive_round_trip(monkeypatch: pytest.MonkeyPatch) -> None:
    """Against real OneDrive: put, exclusive create, append, fetch, CAS, a session
    upload, delete in a fresh namespace below METASYNC_LIVE_ONEDRIVE_PATH. Needs
    METASYNC_LIVE_ONEDRIVE_GRANT: the JSON of a grant `metasync auth onedrive` saved
    (tokens/onedrive-<account>.json with METASYNC_TOKEN_STORE=file)."""
    saved = os.environ.get("METASYNC_LIVE_ONEDRIVE_GRANT")
    if not saved:
        pytest.fail("--live needs METASYNC_LIVE_ONEDRIVE_GRANT (a saved `metasync auth "
                    "onedrive` grant, as JSON)")
    grant = Grant.from_json(saved, "METASYNC_LIVE_ONEDRIVE_GRANT")
    token_store().save(Grant(**{**grant.__dict__, "account": "live", "access_token": None}))
    backend = open_live_backend("onedrive", monkeypatch)
    try:
        check_live_round_trip(backend)
        big = pattern_bytes(9, 0, CHUNK_SIZE + 5)
        backend.put("big", io.BytesIO(big))
        assert backend.get("big") == big
    finally:
        backend.close()


# --- change feed -----------------------------------------------------------------------------


def _hasten(feed: ChangeFeed) -> None:
    """Ask every 0.05 s instead of every 30 s (the cost per ask is what is measured)."""
    assert isinstance(feed, OneDriveFeed)
    feed.interval = feed.active_interval = 0.05


def test_change_feed(onedrive_service: OneDriveService) -> None:
    """The namespace folder's delta from a saved deltaLink (token=latest at the start):
    fires after another client's write or deletion in the namespace, not on an idle
    namespace nor for a sibling namespace (the folder's delta lists only what is below
    it), survives a 503 of the delta, close() unblocks a waiter, and an idle namespace
    costs one request per ask: 120 an hour at the 30 s interval."""
    check_change_feed(
        onedrive_service, _location(onedrive_service, "/feeds"), kind="cursor",
        feed_routes=r"/delta$", hasten=_hasten,
    )


def test_change_feed_resyncs_an_expired_link(onedrive_service: OneDriveService) -> None:
    """A delta link Graph no longer honours (410 resyncRequired) is replaced by a new
    one and counts as a change: a false alarm, never a miss."""
    backend = open_backend(_location(onedrive_service, "/feeds"), fresh_namespace())
    backend.create()
    feed = backend.change_feed()
    assert isinstance(feed, OneDriveFeed)
    _hasten(feed)
    try:
        assert feed.wait(0) is False
        feed._link = feed._link.replace("token=", "token=99999")  # a link from elsewhere
        before = dict(onedrive_service.emulator.calls)
        assert feed.wait(30) is True
        assert call_delta(before, dict(onedrive_service.emulator.calls))["delta"] >= 2
        assert feed.wait(0.3) is False
    finally:
        feed.close()
        backend.close()


def test_delta_enumerates_then_follows_links(onedrive_service: OneDriveService) -> None:
    """The emulator's delta without a token lists the folder's hierarchy in pages
    (nextLink), ending with a deltaLink that then lists only later changes, each item
    once, deleted ones with the deleted facet and no parentReference.path."""
    backend = open_backend(_location(onedrive_service, "/feeds"), fresh_namespace())
    backend.create()
    emulator = onedrive_service.emulator
    for i in range(5):
        backend.put(f"d/k{i}", b"x")
    folder = backend._metadata(backend.root, None, "stat")
    session = backend._http_session()
    headers = {"Authorization": f"Bearer {backend.tokens.access_token()}"}
    page_size, emulator.page_size = emulator.page_size, 3
    try:
        url = f"{backend.drive}/items/{folder['id']}/delta"
        names: list[str] = []
        while True:
            doc = session.get(url, headers=headers, timeout=30).json()
            names += [item["name"] for item in doc["value"]]
            if "@odata.deltaLink" in doc:
                break
            url = doc["@odata.nextLink"]
        assert sorted(names) == sorted([folder["name"], "d", *(f"k{i}" for i in range(5))])
        backend.put("d/k0", b"new")
        backend.put("d/k0", b"newer")
        backend.delete("d/k1")
        doc = session.get(doc["@odata.deltaLink"], headers=headers, timeout=30).json()
        changed = {item["name"]: item for item in doc["value"]}
        assert sorted(changed) == ["k0", "k1"]
        assert "deleted" in changed["k1"] and "deleted" not in changed["k0"]
        assert "path" not in changed["k0"]["parentReference"]
    finally:
        emulator.page_size = page_size
        backend.close()


def test_change_feed_asks_often_right_after_a_change(onedrive_service: OneDriveService) -> None:
    """A cursor feed asks at its idle interval until a change, then at the short
    active interval for ``active_span`` seconds after it: the next changes of a burst
    are seen within seconds, an idle namespace costs only the idle pace."""
    location = _location(onedrive_service, "/feeds")
    watcher = open_backend(location, fresh_namespace())
    watcher.create()
    writer = open_backend(watcher.uri, watcher.namespace)
    feed = watcher.change_feed()
    assert isinstance(feed, OneDriveFeed)
    feed.interval, feed.active_interval, feed.active_span = 3600.0, 0.05, 3600.0
    try:
        assert feed.wait(0) is False
        asks = feed.checks
        assert feed.wait(0.3) is False
        assert feed.checks == asks  # idle: the next ask is an hour away
        feed._next = 0.0  # due now (as after an idle interval)
        writer.put("k", b"v")
        assert feed.wait(30) is True
        asks = feed.checks
        assert feed.wait(0.3) is False
        assert feed.checks > asks  # active: asked again within the 0.3 s
        feed.active_span = 0.0  # the burst is over: back to the idle pace
        writer.put("k2", b"v")
        assert feed.wait(30) is True
        asks = feed.checks
        assert feed.wait(0.3) is False
        assert feed.checks <= asks + 1
    finally:
        feed.close()
        watcher.close()
        writer.close()
