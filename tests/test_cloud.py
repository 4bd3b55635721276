"""The shared cloud-provider framework (metasync.backends.cloud): where sign-ins are
kept, how access tokens are refreshed, endpoints and app keys, and the emulator
plumbing every provider test uses (tests/emulators/base.py)."""

from __future__ import annotations

import json
import os
import stat
import threading
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import httpx
import pytest

from metasync.backends.cloud import (
    CloudAccess,
    FileTokenStore,
    Grant,
    SdkTokenRefresh,
    TokenSource,
    app_credentials,
    endpoint,
    oauth2_refresh,
    parse_cloud_uri,
    parse_retry_after,
    pasted_code,
    redirect_code,
    redirect_query,
    token_store,
)
from metasync.backends.http import range_of_chunks
from metasync.backends.retry import RetryPolicy, TransientError
from metasync.errors import AuthorizationRequired, ObjectNotFound, UsageError
from tests.emulators.base import (
    SERVER_ERROR,
    THROTTLE,
    Emulator,
    OAuth2Server,
    Request,
    Response,
    json_response,
    route,
    serve,
)


def _grant(**changes: object) -> Grant:
    base = Grant("dropbox", "default", "app", "refresh-1", "access-1", 1000.0)
    return Grant(**{**base.__dict__, **changes})  # type: ignore[arg-type]


def test_tests_never_use_the_users_config() -> None:
    """conftest points the config dir at a throwaway folder and forces file storage,
    so no test touches the real keyring or ~/.config."""
    assert os.environ["METASYNC_TOKEN_STORE"] == "file"
    folder = Path(os.environ["METASYNC_CONFIG_DIR"])
    assert "metasync-test-config-" in folder.name
    store = token_store()
    assert isinstance(store, FileTokenStore) and store.folder == folder / "tokens"


def test_file_store_is_private_and_atomic(tmp_path: Path) -> None:
    """A saved grant is a 0600 file in a 0700 folder, holds exactly the grant, and a
    damaged file is an AuthorizationRequired error, not a traceback."""
    store = FileTokenStore(tmp_path / "tokens")
    assert store.load("dropbox", "default") is None
    grant = _grant(extra={"email": "a@b.c"})
    store.save(grant)
    path = store.path("dropbox", "default")
    assert path.name == "dropbox-default.json"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert store.load("dropbox", "default") == grant
    assert sorted(os.listdir(path.parent)) == ["dropbox-default.json"]  # no temp left
    path.write_text("{not json")
    with pytest.raises(AuthorizationRequired, match="damaged"):
        store.load("dropbox", "default")
    store.delete("dropbox", "default")
    assert store.load("dropbox", "default") is None
    with pytest.raises(UsageError):
        store.path("dropbox", "../escape")


def test_token_source_refreshes_once_and_saves(tmp_path: Path) -> None:
    """An expired access token is refreshed before use, the refreshed grant is saved
    (another source then uses it without refreshing), and a token the service calls
    expired is refreshed on the next request."""
    store = FileTokenStore(tmp_path)
    now = [1000.0]
    calls: list[str] = []

    def refresh(grant: Grant) -> Grant:
        calls.append(grant.access_token or "")
        return Grant(**{**grant.__dict__, "access_token": f"access-{len(calls) + 1}",
                        "expires_at": now[0] + 3600})

    store.save(_grant(expires_at=now[0] + 10))  # within the margin: stale
    source = TokenSource("dropbox", "default", refresh, store=store, clock=lambda: now[0])
    assert source.access_token() == "access-2"
    assert source.access_token() == "access-2"
    assert calls == ["access-1"]
    other = TokenSource("dropbox", "default", refresh, store=store, clock=lambda: now[0])
    assert other.access_token() == "access-2" and other.refreshes == 0
    source.expired("access-2")
    assert source.access_token() == "access-3"
    assert store.load("dropbox", "default").access_token == "access-3"  # type: ignore[union-attr]


class _ScriptedProvider(CloudAccess):
    """A provider whose SDK client is a name holding the access token, and whose
    translation makes a KeyError a missing object."""

    def __init__(self, tokens: TokenSource) -> None:
        self.account = tokens.account
        self.tokens = tokens
        self.policy = RetryPolicy(attempts=3, base=0.0)
        self._slots = threading.BoundedSemaphore(1)

    @property
    def name(self) -> str:
        return "dropbox:/scripted"

    def _connect(self) -> tuple[str, str]:
        token = self.tokens.access_token()
        return f"client with {token}", token

    def _translate(self, exc: Exception, key: str | None, action: str,
                   token: str | None) -> BaseException:
        return ObjectNotFound(f"cannot {self._what(action, key)}") if isinstance(exc, KeyError) else exc


def test_cloud_access_calls_retry_refresh_and_translate(tmp_path: Path) -> None:
    """``_call`` runs ``fn`` on a client of ``_connect`` per attempt: an SDK's attempt
    to refresh a token itself (SdkTokenRefresh) refreshes it and retries on a new
    client, and the same from a token just refreshed means signing in again; other
    exceptions go through the provider's ``_translate``."""
    store = FileTokenStore(tmp_path)
    store.save(_grant(expires_at=None))
    refreshed = iter(["access-2", "access-3"])
    source = TokenSource("dropbox", "default",
                         lambda grant: replace(grant, access_token=next(refreshed)), store=store)
    provider = _ScriptedProvider(source)
    clients: list[str] = []

    def expired_once(client: str) -> str:
        clients.append(client)
        if len(clients) == 1:
            raise SdkTokenRefresh("expired_access_token")
        return "done"

    assert provider._call("k", "read", expired_once) == "done"
    assert clients == ["client with access-1", "client with access-2"]
    assert provider.policy.retries == 1 and source.refreshes == 1

    def expired(client: str) -> str:
        raise SdkTokenRefresh("expired_access_token")

    with pytest.raises(AuthorizationRequired, match="expired_access_token"):
        provider._call("k", "read", expired)
    assert provider.policy.retries == 1  # refused right after a refresh: not retried

    def missing(client: str) -> str:
        raise KeyError("k")

    with pytest.raises(ObjectNotFound, match="cannot list dropbox:/scripted"):
        provider._call(None, "list", missing)


def test_token_source_threads_refresh_once(tmp_path: Path) -> None:
    """Eight threads needing a token at once cause one refresh."""
    store = FileTokenStore(tmp_path)
    store.save(_grant(access_token=None))
    count = [0]
    lock = threading.Lock()

    def refresh(grant: Grant) -> Grant:
        with lock:
            count[0] += 1
        return Grant(**{**grant.__dict__, "access_token": "new", "expires_at": None})

    source = TokenSource("dropbox", "default", refresh, store=store)
    results: list[str] = []
    threads = [threading.Thread(target=lambda: results.append(source.access_token()))
               for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == ["new"] * 8 and count == [1]


def test_missing_or_revoked_sign_in_names_the_command(tmp_path: Path) -> None:
    """No saved grant, a grant without refresh token, and a refused token each give
    one line saying which `metasync auth` to run."""
    store = FileTokenStore(tmp_path)
    source = TokenSource("dropbox", "work", lambda g: g, store=store)
    with pytest.raises(AuthorizationRequired, match=r"run `metasync auth dropbox --account work`"):
        source.access_token()
    store.save(_grant(account="work", refresh_token=None, access_token=None))
    with pytest.raises(AuthorizationRequired, match="expired; run `metasync auth dropbox"):
        source.access_token()
    # A token refused right after the refresh that issued it: the grant is gone.
    now = [5000.0]
    store.save(_grant(access_token=None))
    fresh = TokenSource("dropbox", "default",
                        lambda g: replace(g, access_token="tok", expires_at=now[0] + 3600),
                        store=store, clock=lambda: now[0])
    assert fresh.access_token() == "tok"
    with pytest.raises(AuthorizationRequired, match="run `metasync auth dropbox`"):
        fresh.rejected("tok", "invalid_access_token")
    assert isinstance(fresh.rejected("older", "expired_access_token"), TransientError)
    # Refused much later (a revoked access token, clock skew): refresh again.
    now[0] += 600
    assert isinstance(fresh.rejected("tok", "invalid_access_token"), TransientError)


def test_endpoint_and_app_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    """URI options beat the environment; a bad URL or a missing app key is a usage
    error naming the fix."""
    monkeypatch.setenv("METASYNC_BOX_API_URL", "https://127.0.0.1:9/")
    monkeypatch.setenv("METASYNC_BOX_CA_FILE", "/ca.pem")
    assert endpoint("box").base_url == "https://127.0.0.1:9"
    assert endpoint("box", {"api": "http://h:1", "ca": "/x"}) == endpoint("box").__class__(
        "http://h:1", "/x")
    with pytest.raises(UsageError, match="no path"):
        endpoint("box", {"api": "https://h/path"})
    monkeypatch.delenv("METASYNC_BOX_APP_KEY", raising=False)
    # The Box emulator's session fixture may have set a secret in this worker.
    monkeypatch.delenv("METASYNC_BOX_APP_SECRET", raising=False)
    with pytest.raises(UsageError, match="METASYNC_BOX_APP_KEY"):
        app_credentials("box")
    monkeypatch.setenv("METASYNC_BOX_APP_KEY", "k")
    assert app_credentials("box") == ("k", None)
    assert app_credentials("box", "given", "s") == ("given", "s")


def test_parse_retry_after() -> None:
    assert parse_retry_after("7") == 7.0
    assert parse_retry_after(None) is None and parse_retry_after("soon") is None
    assert parse_retry_after("Wed, 21 Oct 2015 07:28:10 GMT", now=1445412480.0) == 10.0


class _TokenEmulator(Emulator):
    name = "token-test"

    def __init__(self) -> None:
        super().__init__()
        self.oauth = OAuth2Server({"app": None, "confidential": "sekret"},
                                  rotate_refresh_tokens=True)

    @route("POST", "/token")
    def token(self, request: Request) -> Response:
        from tests.emulators.base import OAuthError

        try:
            return json_response(200, self.oauth.token(request.form()))
        except OAuthError as exc:
            return json_response(exc.status, {"error": exc.error})


def test_parse_cloud_uri() -> None:
    """Folder names and options of PROVIDER:PATH?OPTIONS; the shared folder-name rules
    and a provider's own (``bad_folder_name``) both refuse a name."""
    assert parse_cloud_uri("box", "box:/a//b/?account=w&timeout=5") == (
        ["a", "b"], {"account": "w", "timeout": "5"})
    assert parse_cloud_uri("gdrive", "gdrive:") == ([], {})
    for uri, match in [("dropbox:/a", "not a box URI"), ("box:/a?x=1", "unknown option 'x'"),
                       ("box:/a/ b", "invalid folder name"), ("box:/a\\b", "invalid folder name")]:
        with pytest.raises(UsageError, match=match):
            parse_cloud_uri("box", uri)
    with pytest.raises(UsageError, match="invalid folder name 'a:b'"):
        parse_cloud_uri("onedrive", "onedrive:/a:b", bad_folder_name=lambda name: ":" in name)


def test_pasted_code_takes_an_address_or_a_code_and_checks_state() -> None:
    """What a user pastes after signing in (Box and Google ask for it): the whole
    redirect address, its path and query, its bare query, a query behind a fragment,
    or the bare code all give the code; an address of another sign-in (state), one
    carrying an error, one without a code and an empty answer are refused."""
    for answer in ["http://127.0.0.1:53687/?code=C1&state=S", " /callback?state=S&code=C1 ",
                   "code=C1&state=S", "http://localhost:1/#?code=C1&state=S",
                   "http://localhost:1/?code=C1&state=S&code=C2", "C1"]:
        assert pasted_code(answer, "S", "box", "Box") == "C1", answer
    assert pasted_code("4/0AbC-d_e", "S", "gdrive", "Google") == "4/0AbC-d_e"
    for answer, match in [
        ("http://127.0.0.1:53687/?code=C1&state=T", r"another sign-in \(state differs\); "
                                                    r"run `metasync auth box` again"),
        ("http://127.0.0.1:53687/?code=C1", "another sign-in"),
        ("/callback", "another sign-in"),
        ("http://127.0.0.1:53687/?error=access_denied&state=S",
         r"Box did not sign metasync in \(access_denied\)"),
        ("http://127.0.0.1:53687/?state=S", "holds no code"),
        ("  ", "no code given; sign-in cancelled"),
    ]:
        with pytest.raises(UsageError, match=match):
            pasted_code(answer, "S", "box", "Box")
    assert redirect_code(redirect_query("state=S&code=C1"), "S", "box", "Box") == "C1"


def test_range_of_chunks() -> None:
    """The range from a whole object sent in chunks (a service that ignored Range),
    cut at chunk boundaries correctly, shorter only where the object ends, and not
    reading past the range."""
    data = bytes(range(100))

    def chunks(size: int) -> list[bytes]:
        return [data[i : i + size] for i in range(0, len(data), size)]

    for size in (1, 7, 10, 100):
        assert range_of_chunks(chunks(size), 13, 20) == data[13:33]
        assert range_of_chunks(chunks(size), 0, 100) == data
        assert range_of_chunks(chunks(size), 95, 10) == data[95:]
    taken: list[bytes] = []

    def counted() -> Iterator[bytes]:
        for piece in chunks(10):
            taken.append(piece)
            yield piece

    assert range_of_chunks(counted(), 5, 10) == data[5:15]
    assert len(taken) == 2


def test_oauth2_refresh_against_the_emulator_token_endpoint() -> None:
    """oauth2_refresh keeps a rotated refresh token, turns invalid_grant into
    AuthorizationRequired and 429/5xx into transient errors with Retry-After; the
    emulator base's TLS, fault injection and OAuth server work together."""
    emulator = _TokenEmulator()
    with serve(emulator) as server:
        code = emulator.oauth.approve({"client_id": "confidential", "response_type": "code"})
        first = emulator.oauth.token({"grant_type": "authorization_code", "code": code,
                                      "client_id": "confidential", "client_secret": "sekret"})
        grant = Grant("box", "default", "confidential", first["refresh_token"],
                      app_secret="sekret")
        url = f"{server.base_url}/token"
        refreshed = oauth2_refresh(url, grant, ca_file=server.ca_file)
        assert refreshed.refresh_token != grant.refresh_token  # rotated
        assert emulator.oauth.check(refreshed.access_token)[0] is not None
        with pytest.raises(AuthorizationRequired, match="run `metasync auth box`"):
            oauth2_refresh(url, grant, ca_file=server.ca_file)  # the old one is spent
        emulator.faults.retry_after = 3
        emulator.faults.inject(THROTTLE)
        with pytest.raises(TransientError) as info:
            oauth2_refresh(url, refreshed, ca_file=server.ca_file)
        assert info.value.retry_after == 3.0
        emulator.faults.inject(SERVER_ERROR)
        with pytest.raises(TransientError):
            oauth2_refresh(url, refreshed, ca_file=server.ca_file)
        assert emulator.faults.injected == 2
        # Without the test CA the emulator's certificate is refused.
        with pytest.raises(httpx.ConnectError):
            httpx.post(url, data={}, verify=True)


def test_grant_json_round_trip() -> None:
    grant = _grant(extra={"scopes": ["a"]})
    assert Grant.from_json(grant.to_json(), "x") == grant
    assert json.loads(grant.to_json())["provider"] == "dropbox"


def test_upload_journal_is_exclusive_private_and_expires() -> None:
    """A journal record survives its writer, is 0600, is held by one upload at a time
    (a second writer of the same target goes without), and is dropped when older than
    the providers keep sessions."""
    from metasync.backends.uploads import UPLOAD_SESSION_MAX_AGE, PendingUpload, UploadJournal

    record = PendingUpload("session-1", 8, "ab" * 32, 1000.0)
    with UploadJournal("test", "target-1") as journal:
        assert journal.active and journal.pending(now=1000.0) is None
        journal.record(record)
        with UploadJournal("test", "target-1") as second:
            assert not second.active and second.pending() is None
            second.record(PendingUpload("other", 1, "", 0.0))  # ignored
    assert stat.S_IMODE(journal.path.stat().st_mode) == 0o600
    with UploadJournal("test", "target-1") as again:
        assert again.pending(now=1001.0) == record
        assert again.pending(now=1000.0 + UPLOAD_SESSION_MAX_AGE + 1) is None
        assert not again.path.exists()
