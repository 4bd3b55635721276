"""The ``box:`` backend through Box's official SDK (boxsdk 10, ``box_sdk_gen``) against
the Box API emulator (tests/emulators/box.py): the shared conformance suite (with TCP
resets and injected 429s/5xx), Box-specific behaviour (exclusive create by ``409``,
compare-and-swap by ``If-Match``, chunked uploads and their resumption, throttling and
per-user rate limits, token refresh and revocation), `metasync auth box` against the
emulator's OAuth endpoints, `metasync share`, an end-to-end run, and live tests
(``--live``)."""

from __future__ import annotations

import io
import os
import ssl
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import httpx
import pytest

from conftest import run_cli
from metasync.backends import open_backend
from metasync.backends.box import CHUNK_SIZE, SINGLE_UPLOAD_LIMIT, BoxBackend
from metasync.backends.cloud import FileTokenStore, Grant, config_dir, token_store
from metasync.backends.conformance import pattern_bytes
from metasync.backends.retry import TransientError
from metasync.errors import AuthorizationRequired, ObjectNotFound, UsageError
from tests.emulators.base import LOST_ANSWER, RESET, SERVER_ERROR, THROTTLE, UNAVAILABLE
from tests.emulators.box import (
    BAD_GATEWAY,
    BOX_FAULTS,
    NAME_TEMPORARILY_RESERVED,
    TEST_CLIENT_ID,
    TEST_CLIENT_SECRET,
    TEST_LOGIN,
    BoxService,
)
from tests.providers_common import (
    FailingSource,
    MiB,
    ProviderConformance,
    call_delta,
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


def _location(service: BoxService, folder: str) -> str:
    return emulator_location(service, "box", folder)


class TestBoxBackend(ProviderConformance):
    """The conformance suite through the Box SDK against the emulator."""

    backend_class = BoxBackend

    @pytest.fixture
    def service(self, box_service: BoxService) -> BoxService:
        return box_service


# --- Box-specific behaviour -------------------------------------------------------------------


@pytest.fixture
def box(box_service: BoxService) -> Iterator[BoxBackend]:
    with specific_backend(box_service, _location(box_service, "/specific")) as backend:
        assert isinstance(backend, BoxBackend)
        yield backend
        box_service.emulator.limit_rates(None, None)


@pytest.mark.parametrize(
    ("uri", "match"),
    [
        ("box:/a?colour=red", "unknown option 'colour'"),
        ("box:/a/../b", "invalid folder name"),
        ("box:/a?transfers=0", "positive"),
        ("box:/a?account=../x", "invalid account"),
        ("box:/a?api=https://h/with/path", "no path"),
        ("dropbox:/a", "unknown option|not a box URI"),
    ],
)
def test_bad_uris_are_usage_errors(uri: str, match: str) -> None:
    with pytest.raises(UsageError, match=match):
        BoxBackend(uri, "ns") if uri.startswith("dropbox:") else open_backend(uri, "ns")


def test_layout_and_names(box_service: BoxService) -> None:
    """Key k of namespace ns is the file /PATH/ns/k (folders made on demand, by id);
    the account appears in the name; create() needs the location folder to exist and
    makes nothing else."""
    backend = open_backend("box:/specific?account=default", "layout")
    assert backend.name == "box:/specific"
    box_service.emulator.make_folder("/specific")
    backend.create()
    backend.put("a/b", b"x")
    assert box_service.emulator.file_bytes("/specific/layout/a/b") == b"x"
    backend.close()
    missing = open_backend("box:/no such folder", "ns")
    with pytest.raises(Exception) as info:
        missing.create()
    assert "create it there first" in one_line(info.value)
    assert box_service.emulator.lookup("/no such folder") is None
    assert open_backend("box:?account=work", "ns").name == "box:/?account=work"


def test_exclusive_create_even_for_identical_bytes(box: BoxBackend) -> None:
    """put_if_absent refuses an existing key even when the bytes are identical (Box's
    409 item_name_in_use does not look at content): two appenders of the same message
    never both win one log position; a folder of that name is not an object."""
    assert box.put_if_absent("log/0000000000", b"same") is True
    assert box.put_if_absent("log/0000000000", b"same") is False
    assert box.logs.append("log", b"same") == 1
    assert box.logs.fetch("log") == [(0, b"same"), (1, b"same")]
    box.put("dir/inside", b"x")
    assert box.put_if_absent("dir", b"x") is False
    with pytest.raises(ObjectNotFound):
        box.get("dir")


def test_case_insensitive_names(box: BoxBackend) -> None:
    """Box names ignore case (capability case_sensitive=False): 'Case' and 'case' are
    one file, and listing keeps the case it was written with."""
    box.put("Dir/Case", b"upper")
    assert box.get("dir/case") == b"upper"
    assert box.put_if_absent("DIR/CASE", b"x") is False
    assert list(box.list()) == ["Dir/Case"]


def _raw_upload_start(service: BoxService, folder_id: str, name: str,
                      token: str) -> tuple[ssl.SSLSocket, bytes]:
    """Begin a multipart upload of ``name`` by hand: send the headers, the attributes
    part and part of the file, and keep the connection open (an upload in flight)."""
    import json
    import socket

    boundary = "xXx" + uuid.uuid4().hex
    head = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"attributes\"\r\n\r\n"
            f"{json.dumps({'name': name, 'parent': {'id': folder_id}})}\r\n"
            f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; "
            f"filename=\"{name}\"\r\nContent-Type: application/octet-stream\r\n\r\n").encode()
    payload = b"the other writer"
    tail = f"\r\n--{boundary}--\r\n".encode()
    context = ssl.create_default_context(cafile=service.ca_file)
    sock = context.wrap_socket(socket.create_connection(
        (service.server.host, service.server.port)), server_hostname="127.0.0.1")
    request = (f"POST /api/2.0/files/content HTTP/1.1\r\nHost: 127.0.0.1:{service.server.port}\r\n"
               f"Authorization: Bearer {token}\r\n"
               f"Content-Type: multipart/form-data; boundary={boundary}\r\n"
               f"Content-Length: {len(head) + len(payload) + len(tail)}\r\n\r\n").encode()
    sock.sendall(request + head + payload[:4])
    return sock, payload[4:] + tail


def test_upload_race_reserved_name_then_conflict(
    box: BoxBackend, box_service: BoxService
) -> None:
    """While another client's upload of a name is still streaming, Box answers a second
    upload of that name 409 name_temporarily_reserved; put_if_absent waits that out
    (retries), then sees 409 item_name_in_use and reports False: exactly one writer won,
    and the object holds the other writer's bytes."""
    emulator = box_service.emulator
    box.put("race/seed", b"")
    folder = emulator.lookup(f"/specific/{box.namespace}/race")
    assert folder is not None
    emulator.reservation_made.clear()
    sock, rest = _raw_upload_start(box_service, folder.id, "k", box.tokens.access_token())
    # The other writer's upload must hold the name before ours starts (else ours
    # reserves it first and the roles swap).
    assert emulator.reservation_made.wait(60), "the other writer's upload did not reserve the name"
    box.policy.attempts = 60
    outcome: list[object] = []
    worker = threading.Thread(target=lambda: outcome.append(box.put_if_absent("race/k", b"mine")))
    try:
        # The event stays set from any earlier refusal (the emulator is shared).
        emulator.reserved_event.clear()
        before = emulator.reserved_refusals
        worker.start()
        assert emulator.reserved_event.wait(60), "the second upload was not refused"
        assert emulator.reserved_refusals > before
        sock.sendall(rest)
        answer = sock.recv(65536)
        assert answer.startswith(b"HTTP/1.1 201"), answer[:200]
    finally:
        worker.join(120)
        sock.close()
    assert outcome == [False]
    assert box.get("race/k") == b"the other writer"


def test_if_match_compare_and_swap(box: BoxBackend, box_service: BoxService) -> None:
    """replace_if is an upload of a new version with If-Match on the etag: a second
    writer holding the old token gets 412 (False); a token from before a delete and
    re-create (same etag, new file id) loses too; the emulator enforces Box's If-Match
    table on the wire."""
    box.put("cas", b"v0")
    token = box.poll("cas")
    assert token is not None and token.endswith(":0")
    assert box.replace_if("cas", b"v1", token) is True
    assert box.poll("cas") == token.split(":")[0] + ":1"
    assert box.replace_if("cas", b"stale", token) is False
    box.delete("cas")
    box.put("cas", b"again")  # a new file: etag 0 again, another id
    fresh = box.poll("cas")
    assert fresh is not None and fresh.endswith(":0") and fresh != token
    assert box.replace_if("cas", b"old id", token) is False
    assert box.get("cas") == b"again"
    # On the wire: If-Match with a wrong etag is 412, a trashed file 404.
    client, _ = box._connect()
    from box_sdk_gen.box.errors import BoxAPIError
    from box_sdk_gen.managers.uploads import UploadFileVersionAttributes

    file_id = fresh.split(":")[0]
    with pytest.raises(BoxAPIError) as info:
        client.uploads.upload_file_version(file_id, UploadFileVersionAttributes("cas"),
                                           io.BytesIO(b"x"), if_match="7")
    assert info.value.response_info.status_code == 412
    assert info.value.response_info.code == "precondition_failed"
    old_id = token.split(":")[0]
    with pytest.raises(BoxAPIError) as info:
        client.uploads.upload_file_version(old_id, UploadFileVersionAttributes("cas"),
                                           io.BytesIO(b"x"), if_match="5")
    assert info.value.response_info.status_code == 404
    assert info.value.response_info.code == "trashed"


def test_conditional_writes_with_lost_answers_are_recognised(
    box: BoxBackend, box_service: BoxService
) -> None:
    """An exclusive create or compare-and-swap that took effect but whose answer was
    lost reports success on the retry (the file now holds our SHA-1), while a genuine
    conflict still reports False."""
    faults = box_service.emulator.faults
    faults.inject(LOST_ANSWER, only=r"/api/2\.0/files/content$")
    assert box.put_if_absent("k", b"mine") is True
    token = box.poll("k")
    assert token is not None
    faults.inject(LOST_ANSWER, only=r"/api/2\.0/files/[0-9]+/content$")
    assert box.replace_if("k", b"mine v2", token) is True
    assert box.get("k") == b"mine v2"
    assert box.replace_if("k", b"stale", token) is False
    assert box.put_if_absent("k", b"other") is False
    faults.inject(THROTTLE, only=r"/api/2\.0/files/content$")  # throttled: nothing done
    assert box.put_if_absent("k", b"mine v2") is False
    assert faults.pending() == 0


#: Box opens chunked sessions from 20 MB; the backend's switch point (50 MB) is lowered
#: to that in these tests so they move less data (the 100 MB conformance object goes
#: through a session at the real switch point).
SESSION_FROM = 20_000_000
BIG = 3 * 8 * MiB + MiB + 17  # 4 parts of 8 MiB (the last one shorter)
PARTS = 4


@pytest.fixture
def chunked(box: BoxBackend) -> BoxBackend:
    box.single_upload_limit = SESSION_FROM
    assert SESSION_FROM < BIG < SINGLE_UPLOAD_LIMIT
    return box


def test_large_object_goes_through_a_chunked_session(
    chunked: BoxBackend, box_service: BoxService
) -> None:
    """Above the switch point a stream goes through a chunked upload session (parts of Box's
    part_size with SHA-1 digests, a commit with the whole file's SHA-1), also as a new
    version of an existing file; a part cut off is sent again, and a part or commit
    whose answer was lost is recognised (part list, file SHA-1); below it, one upload."""
    emulator = box_service.emulator
    data = pattern_bytes(41, 0, BIG)
    before = dict(emulator.calls)
    emulator.faults.inject(RESET, LOST_ANSWER, only=r"/upload_sessions/[0-9A-F]+$")
    chunked.put("big", io.BytesIO(data))
    delta = call_delta(before, emulator.calls)
    assert delta.get("upload_sessions/create") == 1
    assert delta.get("upload_sessions/part") == PARTS + 1  # one part arrived twice
    assert delta.get("upload_sessions/parts", 0) >= 1  # ...and found in the part list
    assert delta.get("upload_sessions/commit") == 1 and "files/upload" not in delta
    assert chunked.size("big") == BIG and chunked.get_range("big", BIG - 5, 5) == data[-5:]
    emulator.faults.inject(LOST_ANSWER, only=r"/commit$")
    before = dict(emulator.calls)
    chunked.put("big", io.BytesIO(data[::-1]))  # a new version, through a session too
    delta = call_delta(before, emulator.calls)
    assert delta.get("upload_sessions/create_version") == 1
    assert delta.get("upload_sessions/commit") == 2  # committed but lost; then 404
    assert chunked.get_range("big", 0, 100) == data[::-1][:100]
    assert emulator.faults.pending() == 0
    before = dict(emulator.calls)
    chunked.put("small", io.BytesIO(data[: 2 * CHUNK_SIZE]))
    assert call_delta(before, emulator.calls).get("files/upload") == 1


def test_chunked_upload_resumes_after_an_interrupted_put(
    chunked: BoxBackend, box_service: BoxService
) -> None:
    """A put whose source fails after two parts leaves its upload session journaled
    on this client; the next put of the same key checks the parts Box has (their
    SHA-1s and the journaled SHA-256) and sends only the missing ones into the same
    session. A changed source, or an expired session (410), starts over (the old
    session aborted); a commit Box answers 202 (still processing) is asked again;
    nothing is left in the journal."""
    emulator = box_service.emulator
    data = pattern_bytes(42, 0, BIG)
    journal = config_dir() / "uploads"
    with pytest.raises(OSError, match="went away"):
        chunked.put("big", FailingSource(data, 2 * 8 * MiB))
    assert len(list(journal.glob("box-*.json"))) == 1
    sessions = set(emulator.sessions)
    before = dict(emulator.calls)
    chunked.put("big", io.BytesIO(data))
    delta = call_delta(before, emulator.calls)
    assert "upload_sessions/create" not in delta
    assert delta["upload_sessions/part"] == PARTS - 2
    assert chunked.get_range("big", 0, 1000) == data[:1000] and chunked.size("big") == BIG
    assert not list(journal.glob("box-*.json"))
    assert not set(emulator.sessions) & sessions  # committed, gone
    # A different source for the key: the old session is aborted, a new one made.
    with pytest.raises(OSError):
        chunked.put("big2", FailingSource(data, 8 * MiB))
    before = dict(emulator.calls)
    chunked.put("big2", io.BytesIO(data[::-1]))
    delta = call_delta(before, emulator.calls)
    assert delta["upload_sessions/abort"] == 1 and delta["upload_sessions/create"] == 1
    assert chunked.get_range("big2", 0, 100) == data[::-1][:100]
    # An expired session: start over.
    with pytest.raises(OSError):
        chunked.put("big3", FailingSource(data, 8 * MiB))
    emulator.expire_upload_sessions()
    emulator.commit_processing = 2  # and Box answers 202 (processing) twice
    before = dict(emulator.calls)
    chunked.put("big3", io.BytesIO(data))
    delta = call_delta(before, emulator.calls)
    assert delta["upload_sessions/create"] == 1 and delta["upload_sessions/commit"] == 3
    assert emulator.commit_processing == 0
    assert chunked.get_range("big3", BIG - 10, 10) == data[-10:]
    assert not list(journal.glob("box-*.json"))


def test_throttling_answers_become_retry_after(box: BoxBackend, box_service: BoxService) -> None:
    """429 rate_limit_exceeded and 503 carry Box's Retry-After into TransientError;
    with retries, 429/500/502/503 are ridden out; a 409 name_temporarily_reserved is
    retried too."""
    faults = box_service.emulator.faults
    box.put("k", b"v")
    box.policy.attempts = 1
    faults.retry_after = 7
    try:
        for kind in (THROTTLE, UNAVAILABLE):
            faults.inject(kind)
            with pytest.raises(TransientError) as info:
                box.get("k")
            assert info.value.retry_after == 7.0, kind
        assert "throttling" in one_line(info.value) or "503" in one_line(info.value)
    finally:
        faults.retry_after = 0
    box.policy.attempts = 5
    faults.inject(THROTTLE, SERVER_ERROR, BAD_GATEWAY, UNAVAILABLE,
                  only=r"/api/2\.0/files/[0-9]+/content$")
    box.put("k", b"after")
    assert box.get("k") == b"after"
    faults.inject(NAME_TEMPORARILY_RESERVED, only=r"/api/2\.0/files/content$")
    assert box.put_if_absent("fresh", b"x") is True


def test_per_user_rate_limits_are_honoured(box: BoxBackend, box_service: BoxService) -> None:
    """With Box's per-user limits in force (scaled down: 12 calls and 6 uploads a
    second), requests over the limit get 429 with the Retry-After until a slot frees
    up; the backend waits exactly that and every operation succeeds."""
    emulator = box_service.emulator
    emulator.limit_rates(api=(12, 1.0), uploads=(6, 1.0))
    for i in range(15):
        box.put(f"r/{i}", f"v{i}".encode())
    assert sorted(box.list("r")) == sorted(f"r/{i}" for i in range(15))
    assert [box.get(f"r/{i}") for i in range(15)] == [f"v{i}".encode() for i in range(15)]
    assert emulator.limiter is not None and emulator.limiter.refused > 0
    assert box.policy.retries > 0


def test_expired_token_is_refreshed_and_rotation_saved(
    box: BoxBackend, box_service: BoxService
) -> None:
    """When Box refuses the access token (401 invalid_token), the backend refreshes it
    once through the OAuth endpoint, saves the new pair for other processes (Box
    rotates refresh tokens: the old one is dead), and the request succeeds."""
    box.put("k", b"v")
    oauth = box_service.emulator.oauth
    old = token_store().load("box", "default")
    assert old is not None
    before = oauth.refreshes
    oauth.expire_access_tokens()
    assert box.get("k") == b"v"
    assert oauth.refreshes == before + 1
    saved = token_store().load("box", "default")
    assert saved is not None and saved.access_token == box.tokens.access_token()
    assert saved.refresh_token != old.refresh_token and saved.app_secret == TEST_CLIENT_SECRET


def test_revoked_grant_says_run_metasync_auth(box_service: BoxService) -> None:
    """A grant revoked on Box's side fails with one line naming `metasync auth box
    --account ...`, from the backend and from the CLI (no traceback)."""
    box_service.sign_in("revoked")
    grant = token_store().load("box", "revoked")
    assert grant is not None and grant.refresh_token
    box_service.emulator.oauth.revoke(grant.refresh_token)
    uri = _location(box_service, "/revoked") + "?account=revoked"
    backend = open_backend(uri, "ns")
    with pytest.raises(AuthorizationRequired) as info:
        backend.get("x")
    assert "run `metasync auth box --account revoked`" in one_line(info.value)
    proc = run_cli("clone", uri, "/tmp/never-" + uuid.uuid4().hex, check=False)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert "metasync auth box --account revoked" in proc.stderr
    nobody = open_backend("box:/revoked?account=nobody", "ns")
    with pytest.raises(AuthorizationRequired, match="not signed in"):
        nobody.exists()


def test_open_resumes_the_same_version(box: BoxBackend, box_service: BoxService) -> None:
    """A download cut off mid-file resumes with a ranged download of the same file
    version: the stream returns the version it started with even if the file was
    replaced meanwhile."""
    old = pattern_bytes(43, 0, 6 * MiB)
    box.put("k", old)
    with box.open("k") as stream:
        first = stream.read(MiB)
        box.put("k", pattern_bytes(44, 0, 6 * MiB))
        box_service.server._server.close_all()  # every open connection drops
        rest = stream.read()
    assert first + rest == old


def test_listing_pages_and_skips_foreign_names(box: BoxBackend, box_service: BoxService) -> None:
    """Listings follow next_marker page by page; files other tools left with names
    that are not keys are skipped; the emulator pages by offset too."""
    emulator = box_service.emulator
    emulator.page_size = 7
    try:
        for i in range(30):
            box.put(f"p/{i:02d}", b"")
        box.put("other", b"")
        folder = emulator.lookup(f"/specific/{box.namespace}")
        assert folder is not None
        with emulator._lock:
            seed = emulator.items[folder.children["other"]]
            emulator._new_file(folder, "stray name", seed.current.blob, 0, seed.current.sha1)
        before = emulator.calls.get("folders/items", 0)
        assert sorted(box.list()) == sorted([f"p/{i:02d}" for i in range(30)] + ["other"])
        assert emulator.calls["folders/items"] - before >= 5
        client, _ = box._connect()
        p = emulator.lookup(f"/specific/{box.namespace}/p")
        assert p is not None
        page = client.folders.get_folder_items(p.id, offset=28, limit=5)
        assert page.total_count == 30 and [e.name for e in page.entries] == ["28", "29"]
    finally:
        emulator.page_size = 1000


# --- sign-in and sharing through the CLI -------------------------------------------------------


def _auth(args: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
    return start_auth("box", args, env)


def _check_saved_grant(service: BoxService, account: str) -> None:
    store = token_store()
    assert isinstance(store, FileTokenStore)
    path = store.path("box", account)
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    assert str(path).startswith(str(config_dir()))
    grant = store.load("box", account)
    assert isinstance(grant, Grant) and grant.refresh_token
    assert grant.app_key == TEST_CLIENT_ID and grant.app_secret == TEST_CLIENT_SECRET
    assert grant.extra.get("email") == TEST_LOGIN
    backend = open_backend(_location(service, "/authed") + f"?account={account}", "ns")
    try:
        backend.create()
        backend.put("k", b"signed in")
        assert backend.get("k") == b"signed in"
    finally:
        backend.close()


def test_auth_box_no_browser(box_service: BoxService) -> None:
    """`metasync auth box --no-browser` prints Box's authorize address (client id,
    loopback redirect URI, state); the user signs in elsewhere and pastes the address
    the browser was sent to; the code in it is exchanged (with the client secret), the
    grant kept in a 0600 file, and a backend with ?account= then works."""
    proc = _auth(["--no-browser", "--account", "cli"], {**os.environ})
    assert proc.stdout is not None and proc.stdin is not None
    url = read_printed_url(proc, "https://")
    assert url.startswith(box_service.base_url + "/api/oauth2/authorize?"), url
    query = parse_qs(urlsplit(url).query)
    assert query["client_id"] == [TEST_CLIENT_ID] and query["response_type"] == ["code"]
    assert query["redirect_uri"][0].startswith("http://127.0.0.1:") and query["state"][0]
    ca = ssl.create_default_context(cafile=box_service.ca_file)
    answer = httpx.get(url, verify=ca, follow_redirects=False)  # the user allows it
    assert answer.status_code == 302
    location = answer.headers["Location"]
    assert location.startswith(query["redirect_uri"][0]) and "code=" in location
    out, err = proc.communicate(location + "\n", timeout=120)
    assert proc.returncode == 0, err
    assert f"Signed in to box as {TEST_LOGIN}" in out
    _check_saved_grant(box_service, "cli")


_FAKE_BROWSER = '''#!{python}
"""A browser for the test: follow the sign-in page's redirect to the loopback."""
import os, ssl, sys
import httpx
url = sys.argv[1]
ca = ssl.create_default_context(cafile=os.environ["METASYNC_BOX_CA_FILE"])
answer = httpx.get(url, verify=ca, follow_redirects=False)
assert answer.status_code == 302, answer.text
page = httpx.get(answer.headers["Location"])
sys.exit(0 if page.status_code == 200 else 1)
'''


def test_auth_box_loopback_redirect(box_service: BoxService, tmp_path: Path) -> None:
    """`metasync auth box` on a desktop listens on the redirect URI, opens the authorize
    page in the browser ($BROWSER here: a script that follows Box's redirect) and takes
    the code from the redirect to the loopback address, with no typing."""
    from tests.emulators.base import free_port

    browser = tmp_path / "browser"
    browser.write_text(_FAKE_BROWSER.format(python=sys.executable))
    browser.chmod(0o755)
    env = {**os.environ, "DISPLAY": ":99", "BROWSER": str(browser),
           "METASYNC_BOX_REDIRECT_URI": f"http://127.0.0.1:{free_port()}/callback"}
    proc = _auth(["--account", "desk"], env)
    out, err = proc.communicate("", timeout=120)
    assert proc.returncode == 0, err
    assert "A browser window asks you to allow metasync" in out
    assert f"Signed in to box as {TEST_LOGIN}" in out
    _check_saved_grant(box_service, "desk")


class _ScriptedUI:
    """An AuthUI with no browser whose user answers with ``reply(url)``."""

    def __init__(self, reply: Any) -> None:
        self.reply = reply
        self.shown: list[str] = []

    def show(self, text: str) -> None:
        self.shown.append(text)

    def open_browser(self, url: str) -> bool:
        return False

    def prompt(self, text: str) -> str:
        url = next(line.strip() for line in "\n".join(self.shown).splitlines()
                   if line.strip().startswith("https://"))
        return str(self.reply(url))


def test_auth_box_refusals(box_service: BoxService, monkeypatch: pytest.MonkeyPatch) -> None:
    """A code Box rejects (through the CLI: one line, non-zero exit, nothing saved), an
    empty answer, a missing client secret, a code older than Box's 30 seconds and an
    address from another sign-in (state) each end in a UsageError naming the problem;
    a bare code pasted instead of the address works."""
    from metasync.backends.box import authorize
    from metasync.backends.cloud import AuthRequest, endpoint

    proc = _auth(["--no-browser", "--account", "bad", "--code", "not-a-code"], {**os.environ})
    _, err = proc.communicate(timeout=120)
    assert proc.returncode != 0 and "Traceback" not in err
    assert "did not accept the code" in err and len(err.strip().splitlines()) == 1
    assert token_store().load("box", "bad") is None

    ca = ssl.create_default_context(cafile=box_service.ca_file)
    request = AuthRequest("box", "late", no_browser=True, endpoint=endpoint("box"))
    emulator = box_service.emulator
    with pytest.raises(UsageError, match="cancelled"):
        authorize(request, _ScriptedUI(lambda url: ""))
    monkeypatch.delenv("METASYNC_BOX_APP_SECRET")
    with pytest.raises(UsageError, match="METASYNC_BOX_APP_SECRET"):
        authorize(request, _ScriptedUI(lambda url: ""))
    monkeypatch.undo()

    def late(url: str) -> str:
        location = httpx.get(url, verify=ca, follow_redirects=False).headers["Location"]
        monkeypatch.setattr(emulator, "clock", lambda: __import__("time").time() + 31)
        return location

    with pytest.raises(UsageError, match="did not accept the code"):
        authorize(request, _ScriptedUI(late))
    monkeypatch.undo()

    def other_sign_in(url: str) -> str:
        location = httpx.get(url, verify=ca, follow_redirects=False).headers["Location"]
        return location.replace("state=", "state=x")

    with pytest.raises(UsageError, match="another sign-in"):
        authorize(request, _ScriptedUI(other_sign_in))
    grant = authorize(request, _ScriptedUI(
        lambda url: parse_qs(urlsplit(httpx.get(url, verify=ca, follow_redirects=False)
                                      .headers["Location"]).query)["code"][0]))
    assert grant.refresh_token and grant.extra["email"] == TEST_LOGIN  # a bare code works


def test_share_invites_on_box_and_lists_the_rest(box_service: BoxService, tmp_path: Path) -> None:
    """`metasync share EMAIL` on a repository over box: + dir: invites EMAIL as an
    editor of the Box namespace folder (a collaboration; sharing again is harmless)
    and names dir: as one to share by hand."""
    folder = _location(box_service, "/shared")
    namespace = fresh_namespace()
    work, store = init_repository_to_share(tmp_path, folder, namespace)
    check_share(work, store, "box:/shared")
    node = box_service.emulator.lookup(f"/shared/{namespace}")
    assert node is not None
    again = open_backend(folder, namespace)  # a second time: harmless
    assert "already a collaborator" in again.share("friend@example.com")
    again.close()
    collab = box_service.emulator.collaborations[f"{node.id}:friend@example.com"]
    assert collab["role"] == "editor" and collab["item"]["id"] == node.id


def test_repository_over_a_throttling_box(
    box_service: BoxService, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """init, push, clone (from Box), edit, push, pull over box: + two dir: backends
    (R=2) while Box answers a seeded 35% of requests with 429s (with and without
    Retry-After), 500, 502 and 503: every command succeeds (8 attempts per request, as
    a user on a throttled account would set METASYNC_RETRY_ATTEMPTS), the clones
    match, and fsck passes."""
    monkeypatch.setenv("METASYNC_RETRY_ATTEMPTS", "8")
    check_repository_over_throttling(
        box_service, _location(box_service, f"/e2e-{uuid.uuid4().hex[:6]}"), tmp_path,
        rate=0.35, seed=8, kinds=BOX_FAULTS, small_files=25, provider="Box",
    )


# --- live tests (real Box; `pytest --live`) ------------------------------------------------------


@pytest.mark.live
def test_live_box_round_trip(monkeypatch: pytest.MonkeyPatch) -> None:
    """Against real Box: put, exclusive create, append, fetch, CAS, delete in a fresh
    namespace below METASYNC_LIVE_BOX_PATH. Needs METASYNC_LIVE_BOX_CLIENT_ID,
    METASYNC_LIVE_BOX_CLIENT_SECRET and METASYNC_LIVE_BOX_REFRESH_TOKEN (from
    `metasync auth box`; Box rotates it, so the test prints the new one)."""
    client_id = os.environ.get("METASYNC_LIVE_BOX_CLIENT_ID")
    secret = os.environ.get("METASYNC_LIVE_BOX_CLIENT_SECRET")
    refresh = os.environ.get("METASYNC_LIVE_BOX_REFRESH_TOKEN")
    if not client_id or not secret or not refresh:
        pytest.fail("--live needs METASYNC_LIVE_BOX_CLIENT_ID, METASYNC_LIVE_BOX_CLIENT_SECRET "
                    "and METASYNC_LIVE_BOX_REFRESH_TOKEN")
    token_store().save(Grant("box", "live", client_id, refresh, app_secret=secret))
    backend = open_live_backend("box", monkeypatch)
    try:
        check_live_round_trip(backend)
    finally:
        backend.close()
        saved = token_store().load("box", "live")
        if saved is not None and saved.refresh_token != refresh:
            print(f"METASYNC_LIVE_BOX_REFRESH_TOKEN is now {saved.refresh_token}")


def test_faults_helper_counts_both_kinds(box_service: BoxService) -> None:
    """EmulatorFaults (faulty_location) injects TCP resets and Box's HTTP faults alike."""
    check_faults_helper(box_service, _location(box_service, "/faulty"), ["429", "503"])


def test_ids_looked_up_again_when_gone(box: BoxBackend, box_service: BoxService) -> None:
    """Box addresses items by id: when another client deletes a file and writes the key
    again (a new id), this client's cached id answers 404 and is looked up afresh for
    reads, writes and deletes; a folder deleted behind its back is looked up (and made)
    again too."""
    other = open_backend("box:/specific", box.namespace)
    try:
        box.put("d/k", b"one")
        assert box.get("d/k") == b"one"  # id cached
        other.delete("d/k")
        other.put("d/k", b"two")
        assert box.get("d/k") == b"two" and box.size("d/k") == 3
        other.delete("d/k")
        other.put("d/k", b"three")
        box.put("d/k", b"four")
        assert other.get("d/k") == b"four"
        other.delete("d/k")
        other.put("d/k", b"five")
        box.delete("d/k")
        with pytest.raises(ObjectNotFound):
            other.get("d/k")
        emulator = box_service.emulator
        folder = emulator.lookup(f"/specific/{box.namespace}/d")
        assert folder is not None
        with emulator._lock:  # the user removes the folder in Box's web app
            folder.trashed = True
            parent = emulator.items[folder.parent or "0"]
            del parent.children["d"]
        assert list(box.list("d")) == []
        box.put("d/again", b"x")
        assert other.get("d/again") == b"x"
    finally:
        other.close()


# --- change feed -----------------------------------------------------------------------------


def test_change_feed(box_service: BoxService) -> None:
    """Box's event stream (stream_position=now, OPTIONS /events, the realtime server's
    long-poll, GET /events): fires after another client's write or deletion in the
    namespace, not on an idle namespace nor for events in a sibling namespace,
    survives a 503 of its requests, close() unblocks a waiter, and an idle namespace
    costs at most 120 requests an hour (a long-poll per retry_timeout, 610 s: the
    emulator shortens the realtime server's wait for the test)."""
    emulator = box_service.emulator
    emulator.realtime_scale = 0.0005
    try:
        check_change_feed(
            box_service, _location(box_service, "/feeds"), kind="longpoll",
            feed_routes=r"^/(2\.0/events|subscribe)$",
        )
    finally:
        emulator.realtime_scale = 1.0


def test_change_feed_reconnects_through_options(box_service: BoxService) -> None:
    """After a realtime long-poll answers ``reconnect`` (nothing happened within its
    wait), OPTIONS /events is asked for a server again: one OPTIONS per reconnect. The
    long-polls carry no access token (the realtime server needs none)."""
    emulator = box_service.emulator
    emulator.realtime_scale = 0.0005
    backend = open_backend(_location(box_service, "/feeds"), fresh_namespace())
    backend.create()
    feed = backend.change_feed()
    assert feed is not None
    signed = emulator.realtime_signed
    try:
        before = dict(emulator.calls)
        assert feed.wait(1.0) is False
        feed.close()
        assert feed.join(30)
        delta = call_delta(before, dict(emulator.calls))
        polls = delta.get("events/realtime", 0)
        assert polls >= 1
        assert delta.get("events/options", 0) == polls
        assert emulator.realtime_signed == signed  # the access token stays with the API
    finally:
        emulator.realtime_scale = 1.0
        feed.close()
        backend.close()
