"""What the cloud-provider backends (``dropbox:``, ``gdrive:``, ``box:``, ``onedrive:``)
share: sign-in grants and where they are kept, app keys, API endpoints (so tests can
point an SDK at an emulator), the ``metasync auth`` dispatch and throttling answers.

Grants
    A :class:`Grant` is what a provider's sign-in gives this client: a refresh token
    (long-lived), the current access token and its expiry, and the app key it was
    issued to. It is kept *per client* by a :class:`TokenStore` (the OS keyring via
    the ``keyring`` package when a real keyring is available, else a 0600 JSON file
    ``<config dir>/tokens/<provider>-<account>.json`` written atomically) and never
    written to a backend: a repository's configuration names only
    ``dropbox:PATH?account=NAME``. ``METASYNC_TOKEN_STORE=file|keyring`` forces one.

Refresh
    A backend asks its :class:`TokenSource` for an access token before each request.
    An access token within :data:`EXPIRY_MARGIN` of its expiry (or one the service
    called expired: :meth:`TokenSource.expired`) is refreshed with the provider's
    ``refresh`` function under a per-grant file lock, after re-reading the store:
    several processes of one client refresh once, and providers that rotate refresh
    tokens (Box, Microsoft) never see an old one used twice. A refresh the provider
    refuses (``invalid_grant``: revoked, expired) raises :class:`AuthorizationRequired`
    whose message is "... run `metasync auth PROVIDER`".

Config dir
    ``$METASYNC_CONFIG_DIR``, else ``$XDG_CONFIG_HOME/metasync``, else
    ``~/.config/metasync``. Tests set ``METASYNC_CONFIG_DIR`` and
    ``METASYNC_TOKEN_STORE=file`` so they never touch the user's keyring or files.

Endpoints
    ``METASYNC_<PROVIDER>_API_URL`` (or the URI option ``api=``) replaces the
    provider's API base URL, and ``METASYNC_<PROVIDER>_CA_FILE`` (or ``ca=``) names a
    PEM file of CAs to trust for it: how the tests aim the official SDK at an emulator
    in tests/emulators/. :func:`endpoint` reads them.

App keys
    ``METASYNC_<PROVIDER>_APP_KEY`` / ``METASYNC_<PROVIDER>_APP_SECRET`` or
    ``metasync auth PROVIDER --app-key K [--app-secret S]`` select the app a user signs
    in to (:func:`app_credentials`); the grant remembers it, so backends need no key.

URIs
    Every provider's URI is ``PROVIDER:PATH?account=NAME&transfers=N&timeout=S&api=URL&ca=FILE``:
    :func:`parse_cloud_uri` splits it and :meth:`CloudAccess._bind_account` reads the
    options all providers read alike.

Sign-in
    ``metasync auth PROVIDER`` calls :func:`authorize`, which imports the provider's
    backend module (named in :data:`AUTH_PROVIDERS`) and runs its
    ``authorize(request: AuthRequest, ui: AuthUI) -> Grant``, then saves the grant.

What the providers that talk through the ``requests`` library share besides (CA
pinning, pooled sessions, connection failures, streamed responses) is in
:mod:`metasync.backends.http`; the journal of resumable uploads is in
:mod:`metasync.backends.uploads`.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import re
import secrets
import ssl
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol, TypeVar
from urllib.parse import parse_qs, parse_qsl, urlsplit

from metasync.backends import AUTH_PROVIDERS
from metasync.backends.base import check_namespace
from metasync.backends.retry import (
    RetryPolicy,
    TransientError,
    describe,
    parse_retry_after,
    retrying,
    silence_of,
    translated,
)
from metasync.errors import AuthorizationRequired, BackendError, UsageError
from metasync.portable import lock, sync_folder
from metasync.timeouts import network_timeout

T = TypeVar("T")

#: Provider name (as in ``metasync auth NAME``) -> module of metasync.backends that
#: defines its ``authorize``. Imported on use, like BUILTIN_SCHEMES.

#: A token refused within this many seconds of the refresh that issued it means the
#: grant itself is gone; refused later (revoked, clock skew), it is refreshed again.
FRESH_REFUSAL_WINDOW = 60.0
#: An access token this close to its expiry (seconds) is refreshed before use.
EXPIRY_MARGIN = 300.0
#: Account name used when a URI or ``metasync auth`` names none.
DEFAULT_ACCOUNT = "default"
#: Keyring service name under which grants are stored.
KEYRING_SERVICE = "metasync"

_ACCOUNT = re.compile(r"^[A-Za-z0-9._-]{1,64}\Z")
#: The options every cloud-provider URI takes (and no others).
CLOUD_URI_OPTIONS = ("account", "transfers", "timeout", "api", "ca")
#: Requests of one backend instance at once, and seconds one request may take, where
#: the URI does not say (``transfers=``, ``timeout=``).
DEFAULT_TRANSFERS = 4
DEFAULT_TIMEOUT = 60.0


def config_dir() -> Path:
    """metasync's per-user configuration folder (not created here)."""
    explicit = os.environ.get("METASYNC_CONFIG_DIR")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CONFIG_HOME")
    base = Path(xdg) if xdg else Path.home() / ".config"
    return base / "metasync"


def check_account(account: str) -> str:
    """``account`` if it is a valid account name (it becomes part of a file name)."""
    if not _ACCOUNT.match(account) or account in (".", ".."):
        raise UsageError(
            f"invalid account name {account!r}: use up to 64 letters, digits, '.', '_', '-'"
        )
    return account


def auth_hint(provider: str, account: str) -> str:
    """The command that signs ``account`` in to ``provider`` again."""
    if account == DEFAULT_ACCOUNT:
        return f"run `metasync auth {provider}`"
    return f"run `metasync auth {provider} --account {account}`"


# --- grants ------------------------------------------------------------------------


@dataclass(frozen=True)
class Grant:
    """One signed-in account of one provider, as this client keeps it."""

    provider: str
    account: str
    #: The app (OAuth client id) the grant was issued to; refreshes must use it.
    app_key: str
    refresh_token: str | None
    access_token: str | None = None
    #: Unix time the access token expires (None: unknown or never).
    expires_at: float | None = None
    #: Only for apps that have one (confidential clients); PKCE apps have none.
    app_secret: str | None = None
    #: Provider-specific facts (the account's id or e-mail, granted scopes, ...).
    extra: dict[str, Any] = field(default_factory=dict)

    def fresh(self, now: float, margin: float = EXPIRY_MARGIN) -> bool:
        """True if the access token is usable for at least ``margin`` more seconds."""
        if not self.access_token:
            return False
        return self.expires_at is None or self.expires_at - margin > now

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str, where: str) -> Grant:
        try:
            doc = json.loads(text)
            grant = cls(**doc)
            if not isinstance(grant.provider, str) or not isinstance(grant.app_key, str):
                raise TypeError("provider/app_key")
        except (ValueError, TypeError) as exc:
            raise AuthorizationRequired(
                f"the saved sign-in in {where} is damaged ({exc}); sign in again"
            ) from None
        return grant


class TokenStore(Protocol):
    """Where grants are kept on this client."""

    #: Human name of the place, for messages.
    where: str

    def load(self, provider: str, account: str) -> Grant | None: ...

    def save(self, grant: Grant) -> None: ...

    def delete(self, provider: str, account: str) -> None: ...


def _grant_name(provider: str, account: str) -> str:
    return f"{provider}-{check_account(account)}"


class FileTokenStore:
    """Grants as 0600 JSON files in a 0700 folder, each written atomically."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.where = str(folder)

    def path(self, provider: str, account: str) -> Path:
        return self.folder / f"{_grant_name(provider, account)}.json"

    def load(self, provider: str, account: str) -> Grant | None:
        path = self.path(provider, account)
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise BackendError(f"cannot read the saved sign-in {path}: {exc.strerror}") from None
        return Grant.from_json(text, str(path))

    def save(self, grant: Grant) -> None:
        self.folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        path = self.path(grant.provider, grant.account)
        tmp = path.with_name(f".tmp-{secrets.token_hex(6)}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                fh.write(grant.to_json())
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise
        sync_folder(self.folder)

    def delete(self, provider: str, account: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path(provider, account).unlink()


class KeyringTokenStore:
    """Grants in the OS keyring (Secret Service, macOS Keychain, Windows Credential
    Locker), one entry per provider and account under the service ``metasync``."""

    def __init__(self) -> None:
        import keyring

        self._keyring = keyring
        self.where = f"the {type(keyring.get_keyring()).__name__} keyring"

    def load(self, provider: str, account: str) -> Grant | None:
        text = self._keyring.get_password(KEYRING_SERVICE, _grant_name(provider, account))
        return None if text is None else Grant.from_json(text, self.where)

    def save(self, grant: Grant) -> None:
        self._keyring.set_password(
            KEYRING_SERVICE, _grant_name(grant.provider, grant.account), grant.to_json()
        )

    def delete(self, provider: str, account: str) -> None:
        import keyring.errors

        with contextlib.suppress(keyring.errors.PasswordDeleteError):
            self._keyring.delete_password(KEYRING_SERVICE, _grant_name(provider, account))


def _keyring_usable() -> bool:
    """True if ``keyring`` finds a real backend (not its fail/null placeholders)."""
    try:
        import keyring
        from keyring.backends import fail
    except ImportError:
        return False
    try:
        backend = keyring.get_keyring()
    except Exception:
        return False
    if isinstance(backend, fail.Keyring) or type(backend).__module__.endswith(".null"):
        return False
    return not (type(backend).__name__ == "ChainerBackend" and not getattr(backend, "backends", None))


def token_store() -> TokenStore:
    """The store of this client: ``METASYNC_TOKEN_STORE`` if set, else the keyring
    when usable, else files under :func:`config_dir`."""
    choice = os.environ.get("METASYNC_TOKEN_STORE", "").strip().lower()
    if choice not in ("", "file", "keyring"):
        raise UsageError(f"METASYNC_TOKEN_STORE must be 'file' or 'keyring', not {choice!r}")
    if choice == "keyring" or (choice == "" and _keyring_usable()):
        if choice == "keyring" and not _keyring_usable():
            raise UsageError(
                "METASYNC_TOKEN_STORE=keyring, but no OS keyring is available; unset it to "
                "keep sign-ins in files"
            )
        return KeyringTokenStore()
    return FileTokenStore(config_dir() / "tokens")


@contextlib.contextmanager
def grant_lock(provider: str, account: str) -> Iterator[None]:
    """An exclusive lock across processes for refreshing one grant."""
    folder = config_dir() / "locks"
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(folder / f"{_grant_name(provider, account)}.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        lock(fd)
        yield
    finally:
        os.close(fd)  # releases the lock


#: ``refresh(grant) -> grant``: a provider's refresh; raises AuthorizationRequired if
#: the provider refuses the grant, a transient BackendError if it cannot be reached.
Refresher = Callable[[Grant], Grant]


class TokenSource:
    """Valid access tokens for one provider account, refreshed as needed.

    Thread-safe; one per backend instance (or shared). ``clock`` is for tests.
    """

    def __init__(
        self,
        provider: str,
        account: str,
        refresh: Refresher,
        *,
        store: TokenStore | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.provider = provider
        self.account = check_account(account)
        self._refresh = refresh
        self._store = store
        self._clock = clock
        self._lock = threading.Lock()
        self._grant: Grant | None = None
        #: Refreshes made by this source (for tests).
        self.refreshes = 0
        #: The access token the last refresh of this source produced.
        self.refreshed_token: str | None = None
        self._refreshed_at = float("-inf")

    @property
    def store(self) -> TokenStore:
        if self._store is None:
            self._store = token_store()
        return self._store

    def rejected(self, token: str, detail: str) -> TransientError:
        """The service refused ``token`` (``detail`` says why): the error to raise.
        A transient one (after which the next request refreshes) unless ``token`` came
        from a refresh less than ``FRESH_REFUSAL_WINDOW`` seconds ago, then
        :class:`AuthorizationRequired`."""
        just_now = self._clock() - self._refreshed_at < FRESH_REFUSAL_WINDOW
        if token == self.refreshed_token and just_now:
            raise AuthorizationRequired(
                f"{self.provider} refused the sign-in of account {self.account!r} ({detail}); "
                f"{auth_hint(self.provider, self.account)}"
            )
        self.expired(token)
        return TransientError(f"{self.provider} refused the access token ({detail})", retry_after=0.0)

    def _missing(self) -> AuthorizationRequired:
        return AuthorizationRequired(
            f"not signed in to {self.provider} as account {self.account!r} on this "
            f"computer; {auth_hint(self.provider, self.account)}"
        )

    def grant(self) -> Grant:
        """The current grant with a fresh access token (refreshing if needed)."""
        with self._lock:
            grant = self._grant
            if grant is None or not grant.fresh(self._clock()):
                grant = self._renew(stale=grant.access_token if grant else None)
                self._grant = grant
            return grant

    def access_token(self) -> str:
        token = self.grant().access_token
        assert token is not None  # grant() returns only fresh grants
        return token

    def expired(self, token: str) -> None:
        """The service called ``token`` expired or invalid: refresh before next use.

        A provider that calls a token *invalid* (rather than expired) may have revoked
        only the access token: refresh once; if the token a refresh just produced is
        refused too, raise AuthorizationRequired instead."""
        with self._lock:
            if self._grant is not None and self._grant.access_token == token:
                self._grant = replace(self._grant, expires_at=0.0)

    def _renew(self, stale: str | None) -> Grant:
        with grant_lock(self.provider, self.account):
            stored = self.store.load(self.provider, self.account)
            if stored is None:
                raise self._missing()
            # Another process (or thread) may have refreshed already.
            if stored.fresh(self._clock()) and stored.access_token != stale:
                return stored
            if not stored.refresh_token:
                raise AuthorizationRequired(
                    f"the {self.provider} sign-in of account {self.account!r} expired; "
                    f"{auth_hint(self.provider, self.account)}"
                )
            fresh = self._refresh(stored)
            self.refreshes += 1
            self.refreshed_token = fresh.access_token
            self._refreshed_at = self._clock()
            self.store.save(fresh)
            return fresh


# --- URIs ------------------------------------------------------------------------------


def parse_cloud_uri(
    provider: str, uri: str, *, bad_folder_name: Callable[[str], bool] | None = None
) -> tuple[list[str], dict[str, str]]:
    """Split ``PROVIDER:PATH?OPTIONS`` into ``(folder names of PATH, options)``; empty
    parts of PATH are dropped, so ``[]`` is the root of the drive.

    Raises :class:`UsageError` if ``uri`` is not a ``provider:`` URI, names an option
    not in :data:`CLOUD_URI_OPTIONS`, or has a folder name that is ``.`` or ``..``,
    starts or ends with white space, holds a backslash, or (the provider's own rules)
    for which ``bad_folder_name`` is true."""
    if not uri.startswith(f"{provider}:"):
        raise UsageError(f"not a {provider} URI: {uri!r}; use {provider}:PATH")
    rest, _, query = uri[len(provider) + 1 :].partition("?")
    options: dict[str, str] = {}
    for name, value in parse_qsl(query, keep_blank_values=True):
        if name not in CLOUD_URI_OPTIONS:
            raise UsageError(
                f"unknown option {name!r} in {uri!r}; known options: "
                f"{', '.join(CLOUD_URI_OPTIONS)}"
            )
        options[name] = value
    parts = [p for p in rest.split("/") if p]
    for part in parts:
        if (
            part in (".", "..")
            or part.strip() != part
            or "\\" in part
            or (bad_folder_name is not None and bad_folder_name(part))
        ):
            raise UsageError(f"invalid folder name {part!r} in {uri!r}")
    return parts, options


class SdkTokenRefresh(Exception):
    """Raised by a provider's stand-in for its SDK's authentication when the SDK, told
    that the access token is expired or invalid, tries to refresh it itself: the
    :class:`TokenSource` refreshes, so :meth:`CloudAccess._attempt` makes this the
    token's refusal (:meth:`TokenSource.rejected`). ``detail`` is the reason to report."""

    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail


class SdkClients:
    """The SDK client of a backend whose SDK holds one access token per client: made
    again when the token changes, over one HTTP session (connection pool) kept until
    :meth:`close`. ``new_session()`` opens that session; ``new_client(session,
    token)`` makes a client. Thread-safe."""

    def __init__(
        self,
        tokens: TokenSource,
        new_session: Callable[[], Any],
        new_client: Callable[[Any, str], Any],
    ) -> None:
        self._tokens = tokens
        self._new_session = new_session
        self._new_client = new_client
        self._lock = threading.Lock()
        self._session: Any = None
        self._client: Any = None
        self._client_token: str | None = None

    def connect(self) -> tuple[Any, str]:
        """A client holding a fresh access token, and that token (what
        :meth:`CloudAccess._connect` returns)."""
        token = self._tokens.access_token()
        with self._lock:
            if self._session is None:
                self._session = self._new_session()
            if self._client is None or self._client_token != token:
                self._client = self._new_client(self._session, token)
                self._client_token = token
            return self._client, token

    def close(self) -> None:
        """Close the session (the next :meth:`connect` opens another)."""
        with self._lock:
            session, self._session, self._client = self._session, None, None
        if session is not None:
            with contextlib.suppress(Exception):
                session.close()


class CloudAccess:
    """What every cloud-provider backend keeps to reach its service: the account it
    acts as, its limits, where the API is, its access tokens, its retry policy and
    its transfer slots; and how it runs a request. A backend class lists it before its
    storage base class and calls :meth:`_bind_account` from ``__init__`` (it sends no
    request).

    Requests: :meth:`_call` runs ``fn(client)`` on the SDK client of
    :meth:`_connect`, each attempt in a transfer slot with what the SDK raises
    translated by the provider's :meth:`_translate`, and retries transient failures.
    A provider that sends its own HTTP requests (OneDrive) runs each through
    :meth:`_attempt` and retries whole steps with :meth:`_retried`."""

    #: The signed-in account whose grant is used (:func:`check_account`).
    account: str
    #: Most requests of this backend instance at once (at least 1).
    transfers: int
    #: Seconds one request may take (positive).
    timeout: float
    #: Access tokens of ``account``, refreshed as needed.
    tokens: TokenSource
    policy: RetryPolicy
    #: The retries of a change feed's long-poll: a pause of its own.
    feed_policy: RetryPolicy
    #: The API base URL (None: the real service) and the CA file to trust for it.
    _base_url: str | None
    _ca_file: str | None
    #: Held for the duration of each request: at most ``transfers`` at once.
    _slots: threading.BoundedSemaphore

    def _bind_account(
        self,
        provider: str,
        uri: str,
        namespace: str,
        options: dict[str, str],
        refresher: Callable[[str | None, str | None], Refresher],
    ) -> None:
        """Check ``namespace`` and set the attributes above from the ``account=``,
        ``transfers=``, ``timeout=``, ``api=`` and ``ca=`` options of ``uri`` (split
        into ``options`` by :func:`parse_cloud_uri`), with the defaults for those not
        given; ``refresher(base_url, ca_file)`` is the provider's grant refresh.
        Raises :class:`UsageError` for an invalid namespace or account name, a
        non-numeric or non-positive ``transfers=``/``timeout=``, or a bad API URL."""
        check_namespace(namespace)
        self.account = check_account(options.get("account") or DEFAULT_ACCOUNT)
        try:
            self.transfers = int(options.get("transfers", DEFAULT_TRANSFERS))
            self.timeout = float(options.get("timeout", DEFAULT_TIMEOUT))
        except ValueError as exc:
            raise UsageError(f"bad transfers= or timeout= in {uri!r}") from exc
        if self.transfers < 1 or not self.timeout > 0:
            raise UsageError(f"transfers= and timeout= must be positive in {uri!r}")
        # --timeout bounds each wait of the provider's SDK (connect, TLS, read) and
        # the retries of a request.
        self.timeout = network_timeout(self.timeout)
        where = endpoint(provider, options)
        self._base_url = where.base_url
        self._ca_file = where.ca_file
        self.tokens = TokenSource(provider, self.account, refresher(where.base_url, where.ca_file))
        self.policy = RetryPolicy(budget=self.timeout, silence=silence_of(uri))
        # A change feed's long-poll is held open for minutes by a service that is
        # there: it is never the probe a pause lets through for the others.
        self.feed_policy = RetryPolicy(budget=self.timeout)
        self._slots = threading.BoundedSemaphore(self.transfers)

    @property
    def name(self) -> str:
        """The backend's name for messages: each provider's own."""
        raise NotImplementedError

    def _named(self, place: str) -> str:
        """The backend's name from ``place`` (``PROVIDER:PATH``): with
        ``?account=NAME`` unless the account is the default one."""
        return place if self.account == DEFAULT_ACCOUNT else f"{place}?account={self.account}"

    def _what(self, action: str, key: str | None) -> str:
        """``action`` on ``key`` (or on the backend), for messages: :func:`describe`."""
        return describe(action, key, self.name)

    # --- requests: the provider's hooks ---------------------------------------------

    def _connect(self) -> tuple[Any, str | None]:
        """The SDK client the next attempt of :meth:`_call` runs on, and the access
        token it carries (None if the provider's requests fetch their own)."""
        raise NotImplementedError(f"{type(self).__name__} runs no requests through _call")

    def _translate(
        self, exc: Exception, key: str | None, action: str, token: str | None
    ) -> BaseException:
        """The backend-contract error for ``exc``, raised by the SDK or the transport
        while doing ``action`` on ``key`` with ``token`` (:class:`ObjectNotFound`,
        :class:`TransientError` with the service's ``Retry-After``, ...); ``exc`` itself
        if it is not the service's failure (it is then re-raised unchanged)."""
        return exc

    # --- requests: the skeleton -----------------------------------------------------

    def _attempt(
        self, key: str | None, action: str, request: Callable[[], T], token: str | None,
        *, slotted: bool = True,
    ) -> T:
        """One attempt of ``request()`` in a transfer slot (none if not ``slotted``: a
        change feed's long-poll, which must not hold one for minutes), what it raises
        translated (:func:`translated`): an :class:`SdkTokenRefresh` is the refusal of
        ``token``, anything else goes to :meth:`_translate`."""

        def translate(exc: Exception) -> BaseException:
            if isinstance(exc, SdkTokenRefresh) and token is not None:
                return self.tokens.rejected(token, exc.detail)
            return self._translate(exc, key, action, token)

        slots = self._slots if slotted else threading.BoundedSemaphore(1)
        return translated(slots, request, translate)

    def _retried(
        self,
        key: str | None,
        action: str,
        attempt: Callable[[], T],
        on_retry: Callable[[BaseException], None] | None = None,
        policy: RetryPolicy | None = None,
    ) -> T:
        """``attempt()`` with retries of transient failures under the backend's policy
        (:func:`retrying`; ``policy`` instead if given); ``attempt`` must be safe to
        repeat."""
        return retrying(policy or self.policy, self._what(action, key), attempt,
                        on_retry=on_retry)

    def _call(
        self,
        key: str | None,
        action: str,
        fn: Callable[[Any], T],
        on_retry: Callable[[BaseException], None] | None = None,
        *,
        slotted: bool = True,
    ) -> T:
        """``fn(client)`` on the client of :meth:`_connect` (asked again for each
        attempt: the token may have been refreshed), each attempt by
        :meth:`_attempt` (``slotted`` as there), with retries of transient failures;
        ``fn`` must be safe to repeat. A request without a slot (a long-poll) runs under
        :attr:`feed_policy`, out of the backend's pause after a silence."""

        def attempt() -> T:
            client, token = self._connect()
            return self._attempt(key, action, lambda: fn(client), token, slotted=slotted)

        return self._retried(key, action, attempt, on_retry,
                             None if slotted else self.feed_policy)


# --- sign-in ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Endpoint:
    """Where a provider's API is: ``base_url`` None means the real service."""

    base_url: str | None = None
    #: PEM file of CAs to trust (None: the system's).
    ca_file: str | None = None


def endpoint(provider: str, options: dict[str, str] | None = None) -> Endpoint:
    """The API endpoint of ``provider``: URI options ``api=``/``ca=`` first, then
    ``METASYNC_<PROVIDER>_API_URL`` / ``METASYNC_<PROVIDER>_CA_FILE``."""
    options = options or {}
    prefix = f"METASYNC_{provider.upper()}_"
    base = options.get("api") or os.environ.get(prefix + "API_URL") or None
    ca = options.get("ca") or os.environ.get(prefix + "CA_FILE") or None
    if base is not None:
        base = base.rstrip("/")
        if not re.match(r"^https?://[^/?#]+\Z", base):
            raise UsageError(
                f"{provider} API URL {base!r} must be scheme://host[:port] with no path"
            )
    return Endpoint(base, ca)


def app_credentials(
    provider: str, app_key: str | None = None, app_secret: str | None = None
) -> tuple[str, str | None]:
    """``(app key, app secret or None)`` for signing in to ``provider``: the given
    values, else ``METASYNC_<PROVIDER>_APP_KEY`` / ``..._APP_SECRET``."""
    prefix = f"METASYNC_{provider.upper()}_"
    key = app_key or os.environ.get(prefix + "APP_KEY")
    secret = app_secret or os.environ.get(prefix + "APP_SECRET") or None
    if not key:
        raise UsageError(
            f"no {provider} app key: register an app (docs/backends.md, section "
            f"{provider}:) and pass --app-key KEY or set {prefix}APP_KEY"
        )
    return key, secret


@dataclass(frozen=True)
class AuthRequest:
    """What ``metasync auth PROVIDER`` was asked for."""

    provider: str
    account: str = DEFAULT_ACCOUNT
    app_key: str | None = None
    app_secret: str | None = None
    #: Do not start a browser; print the URL (or device code) and read the answer.
    no_browser: bool = False
    #: An authorization code obtained beforehand (skips the prompt).
    code: str | None = None
    endpoint: Endpoint = Endpoint()


class AuthUI(Protocol):
    """How a sign-in talks to the user (the CLI supplies one; tests script one)."""

    def show(self, text: str) -> None:
        """Tell the user something (a URL to open, a device code)."""

    def open_browser(self, url: str) -> bool:
        """Open ``url`` in a browser; False if none could be started."""

    def prompt(self, text: str) -> str:
        """Ask for one line (an authorization code); raises UsageError on EOF."""


def redirect_query(query: str) -> dict[str, str]:
    """The parameters of the query string of a sign-in redirect (``code=...&state=...``
    or ``error=...&state=...``), the first value of each."""
    return {name: values[0] for name, values in parse_qs(query).items()}


def redirect_code(query: Mapping[str, str], state: str, provider: str, service: str) -> str:
    """The authorization code of a sign-in redirect with the parameters ``query``, sent
    by ``service`` (its name in messages) to a sign-in to ``provider`` that sent
    ``state``. Raises :class:`UsageError` if the redirect carries an ``error``, if its
    ``state`` is another (the answer of another sign-in, which must not be used), or if
    it has no code."""
    again = f"run `metasync auth {provider}` again"
    if "error" in query:
        raise UsageError(f"{service} did not sign metasync in ({query['error']}); {again}")
    if query.get("state") != state:
        raise UsageError(f"that address belongs to another sign-in (state differs); {again}")
    code = query.get("code")
    if not code:
        raise UsageError("that address holds no code; sign-in cancelled")
    return code


def pasted_code(answer: str, state: str, provider: str, service: str) -> str:
    """The authorization code in what the user pasted after signing in to ``provider``:
    the bare code, or the address the browser was sent to (whole, from its path on, or
    just its query), checked by :func:`redirect_code`. An answer is an address if it
    holds ``://`` or ``code=`` or starts with ``/``; its parameters are its query, else
    what follows a ``?``, else the whole answer. Raises :class:`UsageError` for an empty
    answer or an address :func:`redirect_code` refuses."""
    answer = answer.strip()
    if not answer:
        raise UsageError("no code given; sign-in cancelled")
    if "://" not in answer and not answer.startswith("/") and "code=" not in answer:
        return answer
    query = urlsplit(answer).query or answer.partition("?")[2] or answer
    return redirect_code(redirect_query(query), state, provider, service)


def authorize(request: AuthRequest, ui: AuthUI, store: TokenStore | None = None) -> Grant:
    """Run ``request.provider``'s sign-in and keep the resulting grant on this client."""
    module = AUTH_PROVIDERS.get(request.provider)
    if module is None:
        known = ", ".join(sorted(AUTH_PROVIDERS))
        raise UsageError(f"unknown provider {request.provider!r} for `metasync auth`; known: {known}")
    check_account(request.account)
    provider_module = importlib.import_module(f"metasync.backends.{module}")
    grant: Grant = provider_module.authorize(request, ui)
    store = store or token_store()
    with grant_lock(grant.provider, grant.account):
        store.save(grant)
    return grant


# --- refresh ---------------------------------------------------------------------------


def oauth2_refresh(
    token_url: str,
    grant: Grant,
    *,
    ca_file: str | None = None,
    extra: dict[str, str] | None = None,
    timeout: float = 30.0,
    clock: Callable[[], float] = time.time,
) -> Grant:
    """A standard OAuth 2 refresh (RFC 6749 §6) of ``grant`` at ``token_url``.

    Keeps the old refresh token unless the provider returns a new one (rotation).
    ``invalid_grant``/``invalid_client`` answers raise AuthorizationRequired; a 429,
    5xx or a network failure raises a transient error (with ``Retry-After``).
    """
    import httpx

    form = {
        "grant_type": "refresh_token",
        "refresh_token": grant.refresh_token or "",
        "client_id": grant.app_key,
        **(extra or {}),
    }
    if grant.app_secret:
        form["client_secret"] = grant.app_secret
    verify: ssl.SSLContext | bool = ssl.create_default_context(cafile=ca_file) if ca_file else True
    try:
        response = httpx.post(
            token_url, data=form, timeout=network_timeout(timeout), verify=verify
        )
    except httpx.HTTPError as exc:
        raise TransientError(
            f"cannot refresh the {grant.provider} sign-in: {exc or type(exc).__name__}"
        ) from None
    if response.status_code == 429 or response.status_code >= 500:
        raise TransientError(
            f"refreshing the {grant.provider} sign-in: HTTP {response.status_code}",
            retry_after=parse_retry_after(response.headers.get("Retry-After")),
        )
    try:
        doc = response.json()
    except ValueError:
        doc = {}
    if response.status_code != 200 or "access_token" not in doc:
        error = doc.get("error") if isinstance(doc, dict) else None
        if response.status_code in (400, 401) or error:
            raise AuthorizationRequired(
                f"{grant.provider} refused the saved sign-in of account {grant.account!r} "
                f"({error or response.status_code}: revoked or expired); "
                f"{auth_hint(grant.provider, grant.account)}"
            )
        raise BackendError(
            f"refreshing the {grant.provider} sign-in: unexpected HTTP {response.status_code}"
        )
    expires_in = doc.get("expires_in")
    return replace(
        grant,
        access_token=str(doc["access_token"]),
        refresh_token=str(doc.get("refresh_token") or grant.refresh_token or "") or None,
        expires_at=clock() + float(expires_in) if expires_in is not None else None,
    )
