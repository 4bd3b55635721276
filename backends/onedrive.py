"""The ``onedrive:`` backend: a folder in the signed-in user's OneDrive, through
Microsoft Graph v1.0 (plain REST over a pooled ``requests`` session) with sign-in by
the official ``msal`` SDK.

URI: ``onedrive:PATH?account=NAME&transfers=N&timeout=S`` (and, for tests and
emulators, ``api=https://HOST:PORT&ca=FILE``). ``PATH`` is a folder below the root of
the user's drive (``/me/drive/root``); ``onedrive:`` alone is the root. With namespace
``ns``, key ``a/b`` is the file ``/PATH/ns/a/b``. The sign-in is this client's grant for
``NAME`` (default ``default``), made by ``metasync auth onedrive``.

What Graph guarantees and this module relies on:

- a simple upload (``PUT .../content``) and the last fragment of an upload session
  commit atomically: readers see the old file or the whole new one;
- ``@microsoft.graph.conflictBehavior=fail`` (a query parameter on ``PUT content``, the
  ``item`` property of ``createUploadSession``) refuses an existing name with ``409
  nameAlreadyExists``: an atomic exclusive create, hence ``put_if_absent`` and the
  logs of :class:`ObjectStoreLogs`;
- ``If-Match: <eTag>`` on ``PUT /items/{id}/content``, ``createUploadSession`` and
  ``DELETE /items/{id}`` fails with ``412`` once the item changed: ``replace_if``
  (compare-and-swap) and a delete that never removes a newer object. A poll token is
  ``<item id>|<eTag>``; addressing the CAS by item id means a deleted (or deleted and
  re-created) file never matches;
- every file's metadata carries ``file.hashes.quickXorHash``, so uploads and downloads
  are verified end to end (:class:`QuickXorHash`), and a write whose answer was lost is
  recognised as ours without downloading it;
- an upload session accepts fragments whose sizes are multiples of 320 KiB, says which
  bytes it still expects (``nextExpectedRanges``) and outlives the process: a later
  ``put`` continues it (:class:`~metasync.backends.cloud.UploadJournal`);
- paths are case-insensitive (``case_sensitive=False``), and some names are not allowed
  (a trailing ``.``, ``CON``, ``desktop.ini``, ``_vti_`` ...): such key parts are stored
  under an escaped name (:func:`encode_name`, docs/FORMAT.md §11.5).

Every request goes through :func:`retrying`, which knows which writes are
conditional; Graph's throttling (429 and 503, with or without ``Retry-After``) and 5xx
answers are transient. Access tokens come from a
:class:`~metasync.backends.cloud.TokenSource`; the refresh runs MSAL's
``acquire_token_silent`` on the MSAL token cache kept in the grant.
"""

from __future__ import annotations

import builtins
import contextlib
import functools
import hashlib
import io
import json
import logging
import os
import re
import tempfile
import threading
import time
from base64 import b64encode
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any, BinaryIO, cast
from urllib.parse import quote

from metasync.backends import register
from metasync.backends.base import (
    Backend,
    Capabilities,
    check_key,
    check_prefix,
    is_key_part,
    one_line,
    read_full,
)
from metasync.backends.cloud import (
    DEFAULT_TIMEOUT,
    AuthRequest,
    AuthUI,
    CloudAccess,
    Grant,
    app_credentials,
    auth_hint,
    parse_cloud_uri,
    parse_retry_after,
)
from metasync.backends.cloudfeeds import CursorFeed
from metasync.backends.feeds import ChangeFeed
from metasync.backends.http import (
    ResponseReader,
    pin_ca,
    pooled_session,
    range_of_chunks,
    requests_failure,
)
from metasync.backends.retry import RetryMark, TransientError
from metasync.backends.uploads import PendingUpload, UploadJournal
from metasync.errors import (
    AuthorizationRequired,
    BackendError,
    BackendFull,
    BackendUnavailable,
    ObjectNotFound,
    UsageError,
)
from metasync.timeouts import network_timeout

log = logging.getLogger("metasync.backends")

#: The real service: Graph and the Microsoft identity platform (Entra ID).
GRAPH_API = "https://graph.microsoft.com"
LOGIN_API = "https://login.microsoftonline.com"
#: The tenant signed in to unless ``METASYNC_ONEDRIVE_TENANT`` names another:
#: ``common`` takes personal and work/school accounts, ``consumers`` only personal ones,
#: ``organizations`` only work/school ones, or a tenant id / domain.
DEFAULT_TENANT = "common"
#: Delegated permission metasync asks for (MSAL adds openid, profile, offline_access).
SCOPES = ("Files.ReadWrite",)
#: Upload-session fragments must be multiples of this (Graph: 320 KiB).
FRAGMENT_UNIT = 320 * 1024
#: Fragment size of upload sessions (a multiple of 320 KiB, below Graph's 60 MiB cap);
#: at most one fragment is in memory per upload.
CHUNK_SIZE = 32 * FRAGMENT_UNIT
#: Largest body of one simple upload (``PUT content``). Graph documents 250 MB today
#: but 4 MB for years; larger objects go through an upload session, which also makes
#: them resumable.
SIMPLE_UPLOAD_LIMIT = 4 * 1024 * 1024
#: Largest file OneDrive accepts.
MAX_FILE_SIZE = 250 * (1 << 30)
#: Children asked for per listing page.
LIST_PAGE_SIZE = 1000
#: How long the browser sign-in waits for the user (seconds).
BROWSER_SIGN_IN_TIMEOUT = 600
_TENANT = re.compile(r"^[A-Za-z0-9.-]{1,128}\Z")


# --- names -------------------------------------------------------------------------------

_DEVICE_NAMES = frozenset(
    ["con", "prn", "aux", "nul"] + [f"com{i}" for i in range(10)] + [f"lpt{i}" for i in range(10)]
)
_RESERVED_NAMES = frozenset([".lock", "desktop.ini"]) | _DEVICE_NAMES
#: ASCII ``!``..``~`` and their fullwidth forms U+FF01..U+FF5E differ by this.
_FULLWIDTH = 0xFEE0


def _to_fullwidth(char: str) -> str:
    return chr(ord(char) + _FULLWIDTH)


def encode_name(part: str) -> str:
    """The OneDrive file name of key part ``part`` (docs/FORMAT.md §11.5).

    OneDrive refuses names ending in ``.``, the names ``.lock``, ``desktop.ini`` and
    the DOS device names (``CON``, ``COM1`` ...), and ``_vti_`` anywhere in a name. Such
    a part is stored with the offending ASCII character replaced by its fullwidth form
    (as rclone does): the trailing ``.`` becomes ``．`` (U+FF0E), the first character of
    a reserved name, the first ``_`` of ``_vti_``. Key parts are ASCII, so the mapping
    is reversible (:func:`decode_name`)."""
    name = part
    if name.lower() in _RESERVED_NAMES or name.split(".", 1)[0].lower() in _DEVICE_NAMES:
        name = _to_fullwidth(name[0]) + name[1:]
    while "_vti_" in name.lower():
        at = name.lower().index("_vti_")
        name = name[:at] + _to_fullwidth("_") + name[at + 1 :]
    if name.endswith("."):
        name = name[:-1] + _to_fullwidth(".")
    return name


def decode_name(name: str) -> str | None:
    """The key part stored as OneDrive name ``name``, or None if no key part is
    (a file another program put there)."""
    plain = "".join(
        chr(ord(c) - _FULLWIDTH) if 0xFF01 <= ord(c) <= 0xFF5E else c for c in name
    )
    if not is_key_part(plain) or encode_name(plain) != name:
        return None
    return plain


# --- quickXorHash --------------------------------------------------------------------------


class QuickXorHash:
    """Microsoft's quickXorHash (the ``file.hashes.quickXorHash`` of every OneDrive
    file): byte *i* of the input is XORed into a 160-bit circular register at bit
    ``11·i mod 160``; the file length (64-bit little-endian) is XORed into the last 8
    of the 20 result bytes.

    Bytes whose positions are congruent modulo 160 land at the same rotation, so the
    input is folded (XORed) into 160 byte lanes with big-integer operations, and the
    lanes are rotated into place once, in :meth:`digest`."""

    WIDTH = 160
    _LANE_BITS = WIDTH * 8
    _MASK = (1 << WIDTH) - 1
    #: Input is folded in pieces of this size (small integers fold fastest).
    _STEP = 1 << 16

    def __init__(self) -> None:
        self._lanes = 0
        self.length = 0

    def update(self, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data).cast("B")
        for start in range(0, len(view), self._STEP):
            self._fold(view[start : start + self._STEP])

    def _fold(self, view: memoryview) -> None:
        n = len(view)
        if not n:
            return
        phase = self.length % self.WIDTH
        pad = -(phase + n) % self.WIDTH
        blocks = (phase + n + pad) // self.WIDTH
        value = int.from_bytes(b"".join((bytes(phase), view, bytes(pad))), "little")
        while blocks > 1:
            if blocks & 1:  # fold the odd top block into the rest
                blocks -= 1
                shift = blocks * self._LANE_BITS
                value = (value & ((1 << shift) - 1)) ^ (value >> shift)
            blocks //= 2
            shift = blocks * self._LANE_BITS
            value = (value & ((1 << shift) - 1)) ^ (value >> shift)
        self._lanes ^= value
        self.length += n

    def digest(self) -> bytes:
        state = 0
        for lane, byte in enumerate(self._lanes.to_bytes(self.WIDTH, "little")):
            if byte:
                bits = byte << (lane * 11 % self.WIDTH)
                state ^= (bits | (bits >> self.WIDTH)) & self._MASK
        out = bytearray(state.to_bytes(20, "little"))
        for i, byte in enumerate(self.length.to_bytes(8, "little")):
            out[12 + i] ^= byte
        return bytes(out)

    def b64digest(self) -> str:
        """The hash as Graph spells it (base64)."""
        return b64encode(self.digest()).decode()


def quick_xor(data: bytes | bytearray | memoryview) -> str:
    hasher = QuickXorHash()
    hasher.update(data)
    return hasher.b64digest()


# --- URIs and small helpers ------------------------------------------------------------------


def _parse_uri(uri: str) -> tuple[str, dict[str, str]]:
    """``(location path, options)``: the path is ``""`` (the root) or ``/a/b``."""
    parts, options = parse_cloud_uri("onedrive", uri, bad_folder_name=lambda part: ":" in part)
    return ("/" + "/".join(parts)) if parts else "", options


def _graph_error(response: Any) -> tuple[builtins.list[str], str]:
    """``(codes, message)`` of a Graph error body ``{"error": {"code", "message",
    "innerError": {"code", ...}}}``: the outer code first, then the inner ones."""
    try:
        doc = response.json()
    except ValueError:
        return [], " ".join((response.text or "").split())[:200]
    codes: builtins.list[str] = []
    error = doc.get("error") if isinstance(doc, dict) else None
    message = ""
    if isinstance(error, dict):
        message = str(error.get("message") or "")
        node: Any = error
        for _ in range(8):
            if not isinstance(node, dict):
                break
            code = node.get("code")
            if isinstance(code, str) and code:
                codes.append(code)
            node = node.get("innerError") or node.get("innererror")
    elif isinstance(error, str):  # the identity platform's OAuth errors
        codes.append(error)
        message = str(doc.get("error_description") or "")
    return codes, " ".join(message.split())[:300]


def _json(response: Any, what: str) -> dict[str, Any]:
    try:
        doc = response.json()
    except ValueError:
        raise TransientError(f"{what}: OneDrive sent a malformed answer") from None
    if not isinstance(doc, dict):
        raise BackendError(f"{what}: OneDrive sent an unexpected answer")
    return doc


def _file_hash(item: dict[str, Any]) -> str | None:
    hashes = (item.get("file") or {}).get("hashes") or {}
    value = hashes.get("quickXorHash")
    return value if isinstance(value, str) and value else None


def _first_expected(state: dict[str, Any]) -> int | None:
    """The first byte an upload session still expects (None: it has them all)."""
    ranges = state.get("nextExpectedRanges")
    if not isinstance(ranges, list) or not ranges:
        return None
    first = str(ranges[0]).split("-", 1)[0]
    if not first.isdigit():
        raise BackendError(f"OneDrive sent a malformed upload range {ranges[0]!r}")
    return int(first)


#: Outcomes of one upload-session fragment besides a committed item.
_ARRIVED = "arrived"  # the service has the fragment; more are expected
_CONFLICT = "conflict"  # the commit was refused: name taken (fail) or eTag changed
_GONE = "gone"  # the session no longer exists (committed, or expired)


# --- sign-in -----------------------------------------------------------------------------


def _authority(base_url: str | None, tenant: str) -> str:
    return f"{base_url or LOGIN_API}/{tenant}"


def _msal_app(app_key: str, base_url: str | None, ca_file: str | None, tenant: str,
              cache: Any) -> Any:
    """An MSAL public client application for ``tenant`` keeping tokens in ``cache``.

    Against an emulator (``base_url`` set) instance discovery is off: MSAL would ask
    login.microsoftonline.com whether the host is a Microsoft authority. The OpenID
    discovery document is always fetched from the authority itself."""
    import msal
    import requests

    session = pin_ca(requests.Session(), ca_file)
    session.headers["User-Agent"] = "metasync"
    session.request = functools.partial(session.request, timeout=network_timeout(DEFAULT_TIMEOUT))
    try:
        return msal.PublicClientApplication(
            app_key,
            authority=_authority(base_url, tenant),
            token_cache=cache,
            http_client=session,
            instance_discovery=False if base_url is not None else None,
        )
    except requests.RequestException as exc:
        raise BackendUnavailable(
            f"cannot reach the Microsoft sign-in service: {one_line(exc)}"
        ) from None
    except msal.exceptions.MsalServiceError as exc:  # a 5xx answer to the discovery
        raise TransientError(f"the Microsoft sign-in service failed: {one_line(exc)}") from None
    except ValueError as exc:
        # MSAL reports every 4xx answer to the OpenID discovery as a ValueError; only a
        # throttling one (or a malformed document) is worth another try.
        cause = f"{exc} {exc.__context__ or ''}"  # MSAL re-raises the discovery's error
        if isinstance(exc.__context__ or exc, json.JSONDecodeError) or "HTTP status: 429" in cause:
            raise TransientError(f"the Microsoft sign-in service is busy: {one_line(exc)}") from None
        raise UsageError(f"the Microsoft sign-in service refused tenant {tenant!r}: {one_line(exc)}") from None


def _tenant() -> str:
    tenant = os.environ.get("METASYNC_ONEDRIVE_TENANT") or DEFAULT_TENANT
    if not _TENANT.match(tenant):
        raise UsageError(f"METASYNC_ONEDRIVE_TENANT={tenant!r} is not a tenant name or id")
    return tenant


def _kept_cache(cache: Any) -> tuple[str, str | None, str | None]:
    """``(serialized cache, refresh token, home account id)``: the part of an MSAL
    token cache a grant keeps (the account and its refresh token; the access token is
    the grant's own field and the ID token is not needed to refresh)."""
    doc = json.loads(cache.serialize() or "{}")
    kept = {k: doc[k] for k in ("Account", "RefreshToken", "AppMetadata") if k in doc}
    refresh: dict[str, Any] = next(iter((kept.get("RefreshToken") or {}).values()), {})
    account: dict[str, Any] = next(iter((kept.get("Account") or {}).values()), {})
    return json.dumps(kept, sort_keys=True), refresh.get("secret"), account.get("home_account_id")


def _token_failure(result: dict[str, Any], provider_account: str) -> BackendError:
    """The error for an MSAL result carrying ``error``."""
    error = str(result.get("error") or "error")
    description = str(result.get("error_description") or "").strip().splitlines()
    detail = f"{error}: {description[0]}" if description else error
    if error in ("temporarily_unavailable", "server_error", "service_unavailable"):
        return TransientError(f"the Microsoft sign-in service is unavailable ({detail})")
    return AuthorizationRequired(
        f"Microsoft refused the saved OneDrive sign-in of account {provider_account!r} "
        f"({detail}: revoked or expired); {auth_hint('onedrive', provider_account)}"
    )


def refresher(base_url: str | None, ca_file: str | None) -> Callable[[Grant], Grant]:
    """The refresh function of OneDrive grants: MSAL's ``acquire_token_silent``
    (forced) on the grant's token cache, keeping the rotated refresh token."""

    def refresh(grant: Grant) -> Grant:
        import msal
        import requests

        cache = msal.SerializableTokenCache()
        try:
            cache.deserialize(grant.extra.get("msal_cache") or "{}")
        except ValueError:
            raise AuthorizationRequired(
                f"the saved OneDrive sign-in of account {grant.account!r} is damaged; "
                f"{auth_hint('onedrive', grant.account)}"
            ) from None
        tenant = str(grant.extra.get("tenant") or DEFAULT_TENANT)
        try:
            app = _msal_app(grant.app_key, base_url, ca_file, tenant, cache)
            accounts = app.get_accounts()
            wanted = grant.extra.get("home_account_id")
            account = next((a for a in accounts if a.get("home_account_id") == wanted),
                           accounts[0] if accounts else None)
            result = (
                None if account is None
                else app.acquire_token_silent_with_error(list(SCOPES), account, force_refresh=True)
            )
        except requests.RequestException as exc:
            raise TransientError(f"cannot refresh the OneDrive sign-in: {one_line(exc)}") from None
        except msal.exceptions.MsalServiceError as exc:  # a 5xx from the token endpoint
            raise TransientError(f"cannot refresh the OneDrive sign-in: {one_line(exc)}") from None
        except ValueError as exc:  # a non-JSON answer (a 429 page, a proxy's error)
            raise TransientError(f"cannot refresh the OneDrive sign-in: {one_line(exc)}") from None
        if result is None:
            raise AuthorizationRequired(
                f"the saved OneDrive sign-in of account {grant.account!r} holds no refresh "
                f"token; {auth_hint('onedrive', grant.account)}"
            )
        if "access_token" not in result:
            raise _token_failure(result, grant.account)
        kept, refresh_token, _ = _kept_cache(cache)
        return replace(
            grant,
            access_token=str(result["access_token"]),
            refresh_token=refresh_token or grant.refresh_token,
            expires_at=time.time() + float(result.get("expires_in") or 3600),
            extra={**grant.extra, "msal_cache": kept},
        )

    return refresh


def authorize(request: AuthRequest, ui: AuthUI) -> Grant:
    """``metasync auth onedrive``: MSAL's interactive sign-in where a browser can be
    opened (authorization code with PKCE, answered to a loopback redirect on
    ``http://localhost:PORT``), else (``--no-browser``, no desktop) the device-code
    flow: the user opens the verification page on any device and types the code."""
    import msal
    import requests

    app_key, app_secret = app_credentials("onedrive", request.app_key, request.app_secret)
    if app_secret:
        raise UsageError(
            "OneDrive signs in as a public client: register the app for 'Mobile and desktop "
            "applications' (docs/backends.md) and drop --app-secret"
        )
    if request.code:
        raise UsageError(
            "`metasync auth onedrive` takes no --code: it shows a device code to enter at "
            "Microsoft (--no-browser) or opens a browser"
        )
    tenant = _tenant()
    base = request.endpoint.base_url
    cache = msal.SerializableTokenCache()
    app = _msal_app(app_key, base, request.endpoint.ca_file, tenant, cache)
    try:
        result = None if request.no_browser else _browser_sign_in(app, ui)
        if result is None:
            result = _device_sign_in(app, ui)
    except requests.RequestException as exc:
        raise BackendUnavailable(
            f"cannot reach the Microsoft sign-in service: {one_line(exc)}"
        ) from None
    except (ValueError, msal.exceptions.MsalServiceError) as exc:
        raise BackendError(f"the Microsoft sign-in failed: {one_line(exc)}") from None
    if "access_token" not in result:
        error = result.get("error") or "no token"
        description = (str(result.get("error_description") or "").strip().splitlines() or [""])[0]
        raise UsageError(
            f"the OneDrive sign-in did not complete ({error}{': ' + description if description else ''}); "
            "run `metasync auth onedrive` again"
        )
    kept, refresh_token, home_account_id = _kept_cache(cache)
    if not refresh_token:
        raise UsageError("Microsoft returned no refresh token; the app must allow offline_access")
    claims = result.get("id_token_claims") or {}
    extra: dict[str, Any] = {"msal_cache": kept, "home_account_id": home_account_id,
                             "tenant": tenant}
    who = claims.get("preferred_username") or claims.get("email")
    if who:
        extra["email"] = str(who)
    return Grant(
        "onedrive", request.account, app_key, refresh_token, str(result["access_token"]),
        time.time() + float(result.get("expires_in") or 3600), None, extra,
    )


def _browser_sign_in(app: Any, ui: AuthUI) -> dict[str, Any] | None:
    """The authorization-code flow through the user's browser; None if no browser
    could be opened (the caller falls back to a device code)."""
    from msal.oauth2cli.authcode import AuthCodeReceiver

    with AuthCodeReceiver(port=0) as receiver:
        flow = app.initiate_auth_code_flow(
            list(SCOPES), redirect_uri=f"http://localhost:{receiver.get_port()}",
            response_mode="form_post",
        )
        url = str(flow["auth_uri"])
        if not ui.open_browser(url):
            return None
        ui.show(f"A browser window asks you to sign in to Microsoft and allow metasync; "
                f"if it did not open, visit:\n  {url}")
        answer = receiver.get_auth_response(state=flow["state"], timeout=BROWSER_SIGN_IN_TIMEOUT)
    if not answer:
        raise UsageError(
            f"no answer from the browser within {BROWSER_SIGN_IN_TIMEOUT // 60} minutes; "
            "sign-in cancelled (`metasync auth onedrive --no-browser` shows a device code)"
        )
    return cast(dict[str, Any], app.acquire_token_by_auth_code_flow(flow, answer))


def _device_sign_in(app: Any, ui: AuthUI) -> dict[str, Any]:
    """The device-code flow: show the code, then poll until the user entered it."""
    flow = app.initiate_device_flow(scopes=list(SCOPES))
    if "user_code" not in flow:
        raise BackendError(
            f"Microsoft did not start a device sign-in ({flow.get('error')}: "
            f"{(str(flow.get('error_description') or '').splitlines() or [''])[0]}); is the app "
            "registered with 'Allow public client flows' on?"
        )
    ui.show(str(flow.get("message") or (
        f"To sign in, open {flow.get('verification_uri')} and enter the code {flow['user_code']}"
    )))
    return cast(dict[str, Any], app.acquire_token_by_device_flow(flow))


# --- the backend --------------------------------------------------------------------------------


@register
class OneDriveBackend(CloudAccess, Backend):
    """A folder in OneDrive, URI ``onedrive:PATH?account=NAME`` (see the module docstring).

    Thread-safe: one requests session (connection pool) shared by all threads, at most
    ``transfers`` requests at once.
    """

    scheme = "onedrive"
    capabilities = Capabilities(
        conditional_create=True,
        compare_and_swap=True,
        conditional_append=True,
        range_reads=True,
        max_object_size=MAX_FILE_SIZE,
        case_sensitive=False,
        long_poll=False,
        change_feed="cursor",
        sharing=True,
    )

    def __init__(self, uri: str, namespace: str) -> None:
        """Parse the URI; sends no request (the sign-in is read on first use).

        Raises :class:`UsageError` for a malformed URI, option or namespace."""
        super().__init__(uri, namespace)
        self.location, options = _parse_uri(uri)
        self._bind_account("onedrive", uri, namespace, options, refresher)
        #: ``.../v1.0/me/drive``: every request starts here.
        self.drive = f"{self._base_url or GRAPH_API}/v1.0/me/drive"
        #: The namespace folder (a drive path); every key lives below it.
        self.root = f"{self.location}/{encode_name(namespace)}"
        self._session: Any = None
        self._session_lock = threading.Lock()

    @property
    def name(self) -> str:
        """``onedrive:PATH`` (with ``?account=`` if not the default account)."""
        return self._named(f"onedrive:{self.location or '/'}")

    # --- plumbing ------------------------------------------------------------------
    def _http_session(self) -> Any:
        with self._session_lock:
            if self._session is None:
                session = pooled_session(self._ca_file, self.transfers + 4)
                session.headers["User-Agent"] = "metasync"
                self._session = session
            return self._session

    def _path(self, key: str) -> str:
        """The drive path of ``key`` (names escaped as OneDrive needs)."""
        return self.root + "/" + "/".join(encode_name(p) for p in check_key(key).split("/"))

    def _item_url(self, path: str) -> str:
        """The Graph URL addressing the item at drive path ``path`` (``""``: the root)."""
        return f"{self.drive}/root:{quote(path)}:" if path else f"{self.drive}/root"

    def _status_error(self, response: Any, key: str | None, action: str,
                      token: str | None) -> BaseException:
        """The backend-contract error for a Graph error answer."""
        status = response.status_code
        codes, message = _graph_error(response)
        summary = "/".join(codes) or str(status)
        what = self._what(action, key)
        retry_after = parse_retry_after(response.headers.get("Retry-After"))
        if status == 401 and token is not None:
            # Refresh and retry; refused again after a refresh: sign in again.
            return self.tokens.rejected(token, summary)
        if status == 404:
            return ObjectNotFound(f"no object {key!r} on {self.name}" if key is not None
                                  else f"cannot {what}: not found ({summary})")
        if status in (429, 503, 509) or {"activityLimitReached", "throttledRequest"} & set(codes):
            return TransientError(f"cannot {what}: OneDrive is throttling ({summary})",
                                  retry_after=retry_after)
        # Before the 5xx rule: 507 Insufficient Storage is no passing trouble.
        if status == 507 or "quotaLimitReached" in codes:
            return BackendFull.of(self.name, f"the OneDrive quota is used up: {summary}")
        if status in (408, 425) or status >= 500:
            return TransientError(f"cannot {what}: OneDrive answered {status} ({summary})",
                                  retry_after=retry_after)
        if status == 403:
            return BackendError(f"cannot {what}: no permission ({summary}: {message})")
        if "invalidPath" in codes:
            return BackendError(f"cannot {what}: OneDrive refused the name ({message})")
        return BackendError(f"cannot {what}: HTTP {status} {summary}: {message}")

    def _translate(self, exc: Exception, key: str | None, action: str,
                   token: str | None) -> BaseException:
        """The backend-contract error for a failure to get an answer (an error answer is
        :meth:`_status_error`'s)."""
        what = self._what(action, key)
        return requests_failure(exc, what, "OneDrive", self._base_url or GRAPH_API) or exc

    def _http(
        self,
        method: str,
        url: str,
        *,
        key: str | None,
        action: str,
        auth: bool = True,
        expect: tuple[int, ...] = (),
        headers: dict[str, str] | None = None,
        **kwargs: Any,
    ) -> Any:
        """One attempt of one request in a transfer slot: a response whose status is
        2xx or in ``expect``; any other answer or failure raised as a contract error.
        ``auth=False`` for pre-authenticated URLs (upload sessions, downloads), which
        must not carry the bearer token."""
        session = self._http_session()
        token = self.tokens.access_token() if auth else None
        sent = dict(headers or {})
        if token is not None:
            sent["Authorization"] = f"Bearer {token}"
        response = self._attempt(key, action, lambda: session.request(
            method, url, headers=sent, timeout=(self.timeout, self.timeout), **kwargs), token)
        if response.status_code < 300 or response.status_code in expect:
            return response
        try:
            error = self._status_error(response, key, action, token)
        finally:
            response.close()
        raise error

    def _metadata(self, path: str, key: str | None, action: str = "stat") -> dict[str, Any]:
        """The driveItem at drive path ``path`` (ObjectNotFound if missing)."""
        url = self._item_url(path)
        return self._retried(key, action, lambda: _json(
            self._http("GET", url, key=key, action=action), self._what(action, key)))

    def _file(self, key: str, action: str = "stat") -> dict[str, Any]:
        """The driveItem of ``key``, checked; a folder is not an object (ObjectNotFound)."""
        item = self._metadata(self._path(key), key, action)
        if "file" not in item:
            raise ObjectNotFound(f"no object {key!r} on {self.name}")
        return self._checked(item, key)

    def _checked(self, item: dict[str, Any], key: str) -> dict[str, Any]:
        size, item_id, etag = item.get("size"), item.get("id"), item.get("eTag")
        if not isinstance(size, int) or size < 0 or not isinstance(item_id, str) \
                or not item_id or "|" in item_id or not isinstance(etag, str) or not etag:
            raise BackendError(f"OneDrive sent malformed metadata for {key!r} on {self.name}")
        return item

    # --- lifecycle -----------------------------------------------------------------
    def probe(self) -> None:
        """Check the sign-in and that the location folder exists. Never writes."""
        if not self.location:
            self._retried(None, "reach", lambda: self._http("GET", self.drive, key=None,
                                                            action="reach").close())
            return
        try:
            item = self._metadata(self.location, None, "reach")
        except ObjectNotFound:
            item = {}
        if "folder" not in item:
            raise BackendUnavailable(
                f"the folder {self.location!r} does not exist in OneDrive ({self.name}); "
                "create it there first (or fix the URI)"
            )

    def exists(self) -> bool:
        try:
            item = self._metadata(self.root, None, "check")
        except ObjectNotFound:
            return False
        return "folder" in item

    def _make_folder(self, parent: str, name: str, action: str) -> bool:
        """Create folder ``name`` in the folder at drive path ``parent`` unless the
        name exists (``conflictBehavior=fail``); False if it existed (409)."""
        url = (f"{self._item_url(parent)}/children" if parent
               else f"{self.drive}/root/children")
        body = {"name": name, "folder": {}, "@microsoft.graph.conflictBehavior": "fail"}

        def make() -> bool:
            response = self._http("POST", url, key=None, action=action, json=body,
                                  expect=(409,))
            response.close()
            return bool(response.status_code != 409)

        return self._retried(None, action, make)

    def create(self) -> None:
        """Create the namespace folder (idempotent); the location must exist."""
        self.probe()
        made = self._make_folder(self.location, self.root.rsplit("/", 1)[-1],
                                 "create the namespace on")
        if not made and not self.exists():
            raise BackendError(f"cannot create the namespace on {self.name}: a file is in the way")

    def close(self) -> None:
        with self._session_lock:
            session, self._session = self._session, None
        if session is not None:
            with contextlib.suppress(Exception):
                session.close()

    # --- writes ---------------------------------------------------------------------
    def _make_parents(self, key: str) -> None:
        """Create the folders above ``key`` below the namespace folder."""
        parts = [encode_name(p) for p in key.split("/")[:-1]]
        parent = self.root
        for part in parts:
            self._make_folder(parent, part, "write")
            parent = f"{parent}/{part}"

    def _simple_upload(self, key: str, data: bytes, mode: str, item_id: str | None = None,
                       etag: str | None = None) -> dict[str, Any] | None:
        """One ``PUT content`` of ``data``: by path with ``conflictBehavior=mode``
        (``replace``/``fail``), or by item id with ``If-Match: etag``. None if the
        condition failed (409 name taken, 412 changed, 404 gone). A condition failing
        after a retried attempt whose answer was lost is ours if the file now holds
        our bytes (size and quickXorHash)."""
        digest = quick_xor(data)
        if item_id is not None:
            url = f"{self.drive}/items/{quote(item_id, safe='!')}/content"
            headers = {"If-Match": etag or "", "Content-Type": "application/octet-stream"}
            params: dict[str, str] = {}
            expect: tuple[int, ...] = (404, 409, 412)
        else:
            url = f"{self._item_url(self._path(key))}/content"
            headers = {"Content-Type": "application/octet-stream"}
            params = {"@microsoft.graph.conflictBehavior": mode}
            expect = (404, 409, 412)
        retried = RetryMark()

        def attempt() -> dict[str, Any] | None:
            for tries in range(2):
                response = self._http("PUT", url, key=key, action="write", data=data,
                                      headers=headers, params=params, expect=expect)
                if response.status_code not in expect:
                    break
                codes, _ = _graph_error(response)
                response.close()
                parent_missing = item_id is None and (
                    response.status_code == 404
                    or (response.status_code == 409 and "nameAlreadyExists" not in codes))
                if not parent_missing:
                    return None
                if tries:
                    raise BackendError(f"cannot write {key!r} on {self.name}: its folder "
                                       f"cannot be made ({'/'.join(codes)})")
                # A service that does not create missing parent folders itself.
                self._make_parents(key)
            item = self._checked(_json(response, self._what("write", key)), key)
            if item.get("size") != len(data) or _file_hash(item) not in (None, digest):
                raise BackendError(f"OneDrive stored other bytes than sent for {key!r}")
            return item

        item = self._retried(key, "write", attempt, on_retry=retried)
        if item is not None or not retried.marked:
            return item
        try:
            stored = self._file(key)
        except ObjectNotFound:
            return None
        if item_id is not None and stored["id"] != item_id:
            return None
        ours = stored["size"] == len(data) and _file_hash(stored) == digest
        return stored if ours else None

    def put(self, key: str, data: bytes | BinaryIO) -> None:
        """Store ``data`` at ``key`` (``conflictBehavior=replace``, committed atomically).

        Up to :data:`SIMPLE_UPLOAD_LIMIT` bytes are one ``PUT content``; more go through
        an upload session in :data:`CHUNK_SIZE` fragments (one in memory at a time). A
        stream whose size cannot be known beforehand (not seekable) and that is longer
        than a simple upload is first spooled to a temporary file: Graph needs the
        total size in every fragment."""
        path = self._path(key)
        if isinstance(data, bytes | bytearray | memoryview):
            body = bytes(data)
            if len(body) <= SIMPLE_UPLOAD_LIMIT:
                self._simple_upload(key, body, "replace")
            else:
                self._upload_session(key, path, io.BytesIO(body), 0, len(body), "replace")
            return
        self._put_stream(key, path, data, "replace")

    def _put_stream(self, key: str, path: str, data: BinaryIO, mode: str) -> dict[str, Any] | None:
        try:
            seekable = bool(data.seekable())
        except (AttributeError, OSError, ValueError):
            seekable = False
        if seekable:
            start = data.tell()
            total = data.seek(0, io.SEEK_END) - start
            data.seek(start)
            if total <= SIMPLE_UPLOAD_LIMIT:
                body = read_full(data, total)
                if len(body) != total:
                    raise BackendError(f"the source of {key!r} changed while it was read")
                return self._simple_upload(key, body, mode)
            return self._upload_session(key, path, data, start, total, mode)
        first = read_full(data, SIMPLE_UPLOAD_LIMIT + 1)
        if len(first) <= SIMPLE_UPLOAD_LIMIT:
            return self._simple_upload(key, first, mode)
        with tempfile.TemporaryFile(prefix="metasync-onedrive-") as spool:
            spool.write(first)
            while True:
                piece = data.read(CHUNK_SIZE)
                if not piece:
                    break
                spool.write(piece)
            total = spool.tell()
            spool.seek(0)
            return self._upload_session(key, path, cast(BinaryIO, spool), 0, total, mode)

    def _create_session(self, key: str, path: str, mode: str, item_id: str | None,
                        etag: str | None) -> str | None:
        """``createUploadSession`` for ``path`` (``conflictBehavior=mode``) or for
        item ``item_id`` with ``If-Match``; the upload URL, or None if the condition
        already fails."""
        if item_id is not None:
            url = f"{self.drive}/items/{quote(item_id, safe='!')}/createUploadSession"
            headers = {"If-Match": etag or ""}
            body: dict[str, Any] = {"item": {"@microsoft.graph.conflictBehavior": "replace"}}
        else:
            url = f"{self._item_url(path)}/createUploadSession"
            headers = {}
            body = {"item": {"@microsoft.graph.conflictBehavior": mode}}

        def create() -> str | None:
            response = self._http("POST", url, key=key, action="start upload of", json=body,
                                  headers=headers, expect=(404, 409, 412))
            if response.status_code in (404, 409, 412):
                response.close()
                return None
            upload_url = _json(response, self._what("start upload of", key)).get("uploadUrl")
            if not isinstance(upload_url, str) or not re.match(r"^https?://", upload_url):
                raise BackendError(f"OneDrive sent no upload URL for {key!r}")
            return upload_url

        return self._retried(key, "start upload of", create)

    def _session_state(self, key: str, upload_url: str) -> dict[str, Any] | None:
        """The upload session's status (``nextExpectedRanges``), None if it is gone."""
        response = self._http("GET", upload_url, key=key, action="check upload of",
                              auth=False, expect=(404,))
        if response.status_code == 404:
            response.close()
            return None
        return _json(response, self._what("check upload of", key))

    def _cancel_session(self, upload_url: str) -> None:
        with contextlib.suppress(BackendError):
            self._http("DELETE", upload_url, key=None, action="cancel an upload on",
                       auth=False, expect=(404,)).close()

    def _send_fragment(self, key: str, upload_url: str, piece: bytes, at: int,
                       total: int) -> str | dict[str, Any]:
        """PUT one fragment (``Content-Range: bytes at-end/total``) and return the
        committed item (last fragment), :data:`_ARRIVED`, :data:`_CONFLICT` or
        :data:`_GONE`. A resend first asks the session which bytes it expects: an
        earlier attempt whose answer was lost may have arrived."""
        attempts = 0
        end = at + len(piece)

        def attempt() -> str | dict[str, Any]:
            nonlocal attempts
            attempts += 1
            if attempts > 1:
                state = self._session_state(key, upload_url)
                if state is None:
                    return _GONE
                expected = _first_expected(state)
                if expected is None:
                    return _CONFLICT  # every byte is there, yet nothing was committed
                if expected >= end:
                    return _ARRIVED
                if expected != at:
                    raise BackendError(
                        f"the upload session of {key!r} expects byte {expected}, not {at}"
                    )
            response = self._http(
                "PUT", upload_url, key=key, action="upload part of", auth=False, data=piece,
                headers={"Content-Range": f"bytes {at}-{end - 1}/{total}"},
                expect=(404, 409, 412, 416),
            )
            status = response.status_code
            if status == 202:
                response.close()
                return _ARRIVED
            if status in (200, 201):
                return self._checked(_json(response, self._what("write", key)), key)
            codes, message = _graph_error(response)
            response.close()
            if status == 404:
                return _GONE
            if status == 412 or (status == 409 and "nameAlreadyExists" in codes):
                return _CONFLICT
            if status == 416:  # overlaps what the session has: look again
                raise TransientError(f"an upload part of {key!r} overlapped ({message})",
                                     retry_after=0)
            raise BackendError(f"cannot write {key!r} on {self.name}: HTTP {status} "
                               f"{'/'.join(codes)}: {message}")

        return self._retried(key, "upload part of", attempt)

    def _upload_session(self, key: str, path: str, source: BinaryIO, start: int, total: int,
                        mode: str, item_id: str | None = None,
                        etag: str | None = None) -> dict[str, Any] | None:
        """Upload ``total`` bytes of ``source`` (seekable, from ``start``) through an
        upload session; the committed item, or None if its condition failed.

        The session is journaled (:class:`UploadJournal`): a later ``put`` of the same
        key in the same mode after an interruption (the source failing, retries running
        out, the process killed) re-reads and checks (SHA-256) the part the session
        has, asks the session which bytes it expects (``nextExpectedRanges``) and sends
        only the rest; a changed source or an expired session starts over."""
        if total > MAX_FILE_SIZE:
            raise BackendError(f"cannot write {key!r} on {self.name}: larger than "
                               f"{MAX_FILE_SIZE} bytes, the most OneDrive accepts")
        conditional = f"if-match:{item_id}:{etag}" if item_id is not None else mode
        target = f"{self.drive}|{self.account}|{path.lower()}|{conditional}"
        with UploadJournal("onedrive", target) as journal:
            resumed = self._resume(key, journal, source, start)
            if resumed is None:
                source.seek(start)
                upload_url = self._create_session(key, path, mode, item_id, etag)
                if upload_url is None:
                    return None
                offset, sha, qx, started = 0, hashlib.sha256(), QuickXorHash(), time.time()
                journal.record(PendingUpload(upload_url, 0, sha.hexdigest(), started))
            else:
                upload_url, offset, sha, qx, started = resumed
            item: dict[str, Any] | None = None
            while offset < total:
                want = min(CHUNK_SIZE, total - offset)
                piece = read_full(source, want)
                if len(piece) != want:
                    raise BackendError(f"the source of {key!r} ended at byte {offset + len(piece)}"
                                       f" of {total}: it changed while it was uploaded")
                sha.update(piece)
                qx.update(piece)
                outcome = self._send_fragment(key, upload_url, piece, offset, total)
                offset += len(piece)
                if outcome == _CONFLICT:
                    self._cancel_session(upload_url)
                    journal.clear()
                    return None
                if outcome == _GONE:
                    journal.clear()
                    if offset < total:
                        raise TransientError(f"the upload session of {key!r} on {self.name} "
                                             "expired; write it again")
                    item = self._committed_meanwhile(key, total, qx.b64digest())
                    if item is None:
                        raise TransientError(f"the upload session of {key!r} on {self.name} "
                                             "vanished before it was committed")
                    break
                if isinstance(outcome, dict):
                    item = outcome
                else:
                    journal.record(PendingUpload(upload_url, offset, sha.hexdigest(), started))
            journal.clear()
        if item is None:
            raise BackendError(f"the upload session of {key!r} on {self.name} took every "
                               "byte but committed nothing")
        if item.get("size") != total or _file_hash(item) not in (None, qx.b64digest()):
            raise BackendError(f"OneDrive stored other bytes than sent for {key!r}")
        return item

    def _committed_meanwhile(self, key: str, total: int, digest: str) -> dict[str, Any] | None:
        """The item at ``key`` if it holds exactly our bytes (our last fragment
        committed but its answer was lost), else None."""
        try:
            item = self._file(key)
        except ObjectNotFound:
            return None
        return item if item["size"] == total and _file_hash(item) == digest else None

    def _resume(self, key: str, journal: UploadJournal, source: BinaryIO, start: int
                ) -> tuple[str, int, Any, QuickXorHash, float] | None:
        """Continue the journaled session of this target if the source's first bytes
        are the ones the session has and it still expects the next byte; else None."""
        pending = journal.pending()
        if pending is None:
            return None
        journal.clear()  # used now; re-recorded as the upload goes on
        source.seek(start)
        sha, qx = hashlib.sha256(), QuickXorHash()
        have = 0
        while have < pending.offset:
            piece = read_full(source, min(CHUNK_SIZE, pending.offset - have))
            if not piece:
                break
            sha.update(piece)
            qx.update(piece)
            have += len(piece)
        usable = have == pending.offset and sha.hexdigest() == pending.prefix_sha256
        if usable:
            try:
                state = self._retried(key, "resume upload of",
                                      lambda: self._session_state(key, pending.session))
            except BackendError:
                state = None
            usable = state is not None and _first_expected(state) == pending.offset
        if not usable:
            self._cancel_session(pending.session)
            return None
        log.info("resuming the upload of %r on %s at byte %d", key, self.name, pending.offset)
        return pending.session, pending.offset, sha, qx, pending.started

    def _conditional_write(self, key: str, data: bytes, mode: str, item_id: str | None = None,
                           etag: str | None = None) -> bool:
        if len(data) <= SIMPLE_UPLOAD_LIMIT:
            return self._simple_upload(key, data, mode, item_id, etag) is not None
        return self._upload_session(key, self._path(key), io.BytesIO(data), 0, len(data), mode,
                                    item_id, etag) is not None

    def put_if_absent(self, key: str, data: bytes) -> bool:
        """``PUT content`` with ``conflictBehavior=fail`` (atomic on OneDrive); False if
        ``key`` existed (``409 nameAlreadyExists``)."""
        return self._conditional_write(key, bytes(data), "fail")

    def replace_if(self, key: str, data: bytes, token: str) -> bool:
        """``PUT /items/{id}/content`` with ``If-Match: eTag``: False if the item
        changed (412) or is gone (404)."""
        item_id, sep, etag = token.partition("|")
        if not sep or not item_id or not etag:
            return False  # not a token of this backend: it cannot match
        self._path(key)  # check the key
        return self._conditional_write(key, bytes(data), "replace", item_id, etag)

    def delete(self, key: str) -> None:
        """Remove the file at ``key``: its metadata, then ``DELETE /items/{id}`` with
        ``If-Match`` on its eTag, so a retry never removes a newer object. OneDrive
        keeps deleted files in its recycle bin."""
        for _ in range(8):
            item = self._file(key, "delete")
            url = f"{self.drive}/items/{quote(item['id'], safe='!')}"
            headers = {"If-Match": item["eTag"]}
            attempts = [0]

            def remove(url: str = url, headers: dict[str, str] = headers,
                       attempts: builtins.list[int] = attempts) -> bool:
                attempts[0] += 1
                response = self._http("DELETE", url, key=key, action="delete",
                                      headers=headers, expect=(404, 412))
                response.close()
                if response.status_code == 412:
                    return False  # replaced meanwhile: look again
                if response.status_code == 404 and attempts[0] == 1:
                    raise ObjectNotFound(f"no object {key!r} on {self.name}")
                return True  # 204, or gone after an attempt whose answer was lost

            if self._retried(key, "delete", remove):
                return
        raise TransientError(f"cannot delete {key!r} on {self.name}: it keeps changing")

    # --- reads ---------------------------------------------------------------------
    def _download_url(self, item: dict[str, Any], key: str) -> str:
        url = item.get("@microsoft.graph.downloadUrl")
        if not isinstance(url, str) or not re.match(r"^https?://", url):
            raise BackendError(f"OneDrive sent no download URL for {key!r}")
        return url

    def get(self, key: str) -> bytes:
        """The whole file: its metadata (size, quickXorHash, pre-authenticated download
        URL), then the download; checked against size and hash, retried whole."""

        def read() -> bytes:
            item = self._checked(self._metadata_once(key), key)
            response = self._http("GET", self._download_url(item, key), key=key,
                                  action="read", auth=False)
            with contextlib.closing(response):
                data = cast(bytes, response.content)
            if len(data) != item["size"] or _file_hash(item) not in (None, quick_xor(data)):
                raise TransientError(f"reading {key!r} on {self.name} returned other bytes "
                                     "than its metadata describe (replaced meanwhile?)")
            return data

        return self._retried(key, "read", read)

    def _metadata_once(self, key: str) -> dict[str, Any]:
        """One attempt of the metadata of the file ``key`` (for retried read loops)."""
        url = self._item_url(self._path(key))
        item = _json(self._http("GET", url, key=key, action="read"), self._what("read", key))
        if "file" not in item:
            raise ObjectNotFound(f"no object {key!r} on {self.name}")
        return item

    def open(self, key: str) -> BinaryIO:
        """A stream of the file; a connection lost while reading is resumed with a
        ranged request to the same download URL, and the whole stream is checked
        against the quickXorHash the file had when it was opened."""

        def start() -> tuple[dict[str, Any], Any]:
            item = self._checked(self._metadata_once(key), key)
            response = self._http("GET", self._download_url(item, key), key=key,
                                  action="read", auth=False, stream=True)
            return item, response

        item, response = self._retried(key, "read", start)
        return cast(BinaryIO, io.BufferedReader(_GraphReader(self, key, item, response), 1 << 20))

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        """``length`` bytes at ``offset``: metadata, then the download URL with a
        ``Range`` header."""
        if offset < 0 or length < 0:
            raise ValueError(f"get_range needs offset >= 0 and length >= 0, got {offset}, {length}")
        self._path(key)

        def read() -> tuple[bytes, int]:
            item = self._checked(self._metadata_once(key), key)
            size = int(item["size"])
            if offset + length > size or length == 0:
                return b"", size
            response = self._http(
                "GET", self._download_url(item, key), key=key, action="read", auth=False,
                headers={"Range": f"bytes={offset}-{offset + length - 1}"}, expect=(416,),
            )
            with contextlib.closing(response):
                if response.status_code == 416:
                    return b"", size
                if response.status_code == 206:
                    return cast(bytes, response.content), size
                # The whole file: keep only the range.
                return range_of_chunks(response.iter_content(1 << 20), offset, length), size

        data, size = self._retried(key, "read", read)
        if offset + length > size:
            raise self.truncated_error(key, offset + length, size)
        if len(data) != length:
            raise TransientError(f"reading {key!r} on {self.name} ended early")
        return data

    def size(self, key: str) -> int:
        return int(self._file(key)["size"])

    def poll(self, key: str) -> str | None:
        """``<item id>|<eTag>`` (changes with every new content), None if missing."""
        try:
            item = self._file(key)
        except ObjectNotFound:
            return None
        return f"{item['id']}|{item['eTag']}"

    def list(self, prefix: str = "") -> Iterator[str]:
        """Every key below the folder ``prefix``: the folder's metadata, then its
        children (``$top`` pages, following ``@odata.nextLink``), folder by folder,
        each level's folders listed concurrently. Names that are not encoded key parts
        (files other tools put there) are skipped."""
        check_prefix(prefix)
        folder = prefix.rstrip("/")
        return iter(self._walk(folder))

    def _walk(self, folder: str) -> builtins.list[str]:
        path = self._path(folder) if folder else self.root
        try:
            top = self._metadata(path, None, "list")
        except ObjectNotFound:
            return []
        if "folder" not in top or not isinstance(top.get("id"), str):
            return []  # an object, not a folder
        keys: builtins.list[str] = []
        level = [(str(top["id"]), folder)]
        with ThreadPoolExecutor(max_workers=self.transfers) as pool:
            while level:
                next_level: builtins.list[tuple[str, str]] = []
                ids = [i for i, _ in level]
                # One folder (a log, a leaf): no thread hand-off.
                pages = [self._children(ids[0])] if len(ids) == 1 else pool.map(self._children, ids)
                for children, base in zip(pages, [b for _, b in level], strict=True):
                    for child in children:
                        part = decode_name(str(child.get("name") or ""))
                        if part is None:
                            continue
                        name = f"{base}/{part}" if base else part
                        if "folder" in child and isinstance(child.get("id"), str):
                            next_level.append((child["id"], name))
                        elif "file" in child:
                            keys.append(name)
                level = next_level
        return keys

    def _children(self, item_id: str) -> builtins.list[dict[str, Any]]:
        """Every child of folder ``item_id``, each page retried on its own."""
        url: str | None = f"{self.drive}/items/{quote(item_id, safe='!')}/children"
        params: dict[str, str] | None = {"$top": str(LIST_PAGE_SIZE),
                                         "$select": "id,name,size,file,folder"}
        children: builtins.list[dict[str, Any]] = []
        while url is not None:
            page_url, page_params = url, params

            def page(page_url: str = page_url, page_params: Any = page_params) -> dict[str, Any]:
                return _json(self._http("GET", page_url, key=None, action="list",
                                        params=page_params), self._what("list", None))

            doc = self._retried(None, "list", page)
            value = doc.get("value")
            if not isinstance(value, builtins.list):
                raise BackendError(f"OneDrive sent a malformed listing of {self.name}")
            children.extend(v for v in value if isinstance(v, dict))
            next_link = doc.get("@odata.nextLink")
            if next_link is not None and (not isinstance(next_link, str)
                                          or not next_link.startswith(self.drive.split("/v1.0")[0])):
                raise BackendError(f"OneDrive sent a foreign next page link listing {self.name}")
            url, params = next_link, None
        return children

    # --- change feed -----------------------------------------------------------------
    def change_feed(self, watch_key: str | None = None) -> ChangeFeed:
        """A :class:`OneDriveFeed`: the namespace folder's ``delta`` from a saved
        ``@odata.deltaLink``."""
        return OneDriveFeed(self)

    def _graph_link(self, link: Any) -> str:
        """``link`` (a next or delta link Graph sent) if it points at this backend's
        Graph host; else :class:`BackendError` (never follow a link elsewhere)."""
        if not isinstance(link, str) or not link.startswith(self.drive.split("/v1.0")[0] + "/"):
            raise BackendError(f"OneDrive sent a foreign change link watching {self.name}")
        return link

    def delta_now(self) -> str:
        """The ``@odata.deltaLink`` of "now" for the namespace folder
        (``GET /items/{id}/delta?token=latest``: no enumeration)."""
        try:
            folder = self._metadata(self.root, None, "watch")
        except ObjectNotFound:
            folder = {}
        folder_id = folder.get("id")
        if "folder" not in folder or not isinstance(folder_id, str):
            raise BackendError(
                f"cannot watch {self.name}: the namespace folder {self.root!r} is missing")
        url = f"{self.drive}/items/{quote(folder_id, safe='!')}/delta"
        params: dict[str, str] | None = {"token": "latest"}
        while True:
            answer = self._delta_page(url, params)
            if answer is None:
                raise TransientError(f"cannot watch {self.name}: OneDrive refused a new delta")
            _, link, next_link = answer
            if link is not None:
                return link
            url, params = cast(str, next_link), None

    def _delta_page(self, url: str, params: dict[str, str] | None
                    ) -> tuple[builtins.list[dict[str, Any]], str | None, str | None] | None:
        """One page of a delta: ``(items, delta link, next link)`` (one link is None);
        None if Graph answered ``410`` (the link expired: resync)."""
        def page() -> dict[str, Any] | None:
            response = self._http("GET", url, key=None, action="watch", params=params,
                                  expect=(410,))
            if response.status_code == 410:
                response.close()
                return None
            return _json(response, self._what("watch", None))

        doc = self._retried(None, "watch", page)
        if doc is None:
            return None
        value = doc.get("value")
        if not isinstance(value, builtins.list):
            raise BackendError(f"OneDrive sent a malformed delta watching {self.name}")
        items = [v for v in value if isinstance(v, dict)]
        next_link = doc.get("@odata.nextLink")
        if next_link is not None:
            return items, None, self._graph_link(next_link)
        return items, self._graph_link(doc.get("@odata.deltaLink")), None

    def delta_since(self, link: str) -> tuple[builtins.list[dict[str, Any]], str] | None:
        """The items changed since the delta link ``link`` (every page) and the delta
        link to ask next; None if Graph wants a resync (``410``: the link expired)."""
        items: builtins.list[dict[str, Any]] = []
        url = self._graph_link(link)
        while True:
            answer = self._delta_page(url, None)
            if answer is None:
                return None
            page, delta_link, next_link = answer
            items.extend(page)
            if delta_link is not None:
                return items, delta_link
            url = cast(str, next_link)

    # --- sharing -------------------------------------------------------------------
    def share(self, email: str) -> str:
        """Invite ``email`` to edit the namespace folder (``POST /items/{id}/invite``
        with ``roles=["write"]``, ``requireSignIn``, ``sendInvitation``). The invitee
        adds the shared folder to their OneDrive ("Add shortcut to My files") and uses
        that as their ``onedrive:`` location."""
        item = self._metadata(self.root, None, "share")
        if "folder" not in item or not isinstance(item.get("id"), str):
            raise BackendError(f"{self.name}: the namespace folder {self.root!r} is missing")
        url = f"{self.drive}/items/{quote(item['id'], safe='!')}/invite"
        body = {
            "recipients": [{"email": email}],
            "message": "metasync shares a repository folder with you",
            "requireSignIn": True,
            "sendInvitation": True,
            "roles": ["write"],
        }

        def invite() -> None:
            response = self._http("POST", url, key=None, action="share", json=body,
                                  expect=(400,))
            if response.status_code == 400:
                codes, message = _graph_error(response)
                response.close()
                raise UsageError(f"OneDrive refused {email!r} as a collaborator "
                                 f"({'/'.join(codes)}: {message})")
            response.close()

        self._retried(None, "share", invite)
        return f"invited {email} to edit the OneDrive folder {self.root}"


class OneDriveFeed(CursorFeed):
    """The namespace's changes through Graph's ``delta`` of the namespace folder: a
    delta link of "now" (``token=latest``) at the start, then that link asked every
    :data:`~metasync.backends.cloudfeeds.CURSOR_INTERVAL` seconds (one request when
    nothing changed), saving the ``@odata.deltaLink`` each answer ends with. The
    folder's delta lists only items below it, so any item counts. A link Graph no
    longer honours (``410``) is replaced by a new one and counts as a change."""

    def __init__(self, backend: OneDriveBackend) -> None:
        super().__init__(backend.name)
        self._backend = backend
        self._link = ""

    def _begin(self) -> None:
        self._link = self._backend.delta_now()

    def _changed_since(self) -> bool:
        answer = self._backend.delta_since(self._link)
        if answer is None:
            self._link = self._backend.delta_now()
            return True
        items, self._link = answer
        return bool(items)


class _GraphReader(ResponseReader):
    """The body of one download, resumed at the current position (a ``Range``
    request to the same download URL) if the connection fails, and checked against
    the file's quickXorHash at the end."""

    _backend: OneDriveBackend

    def __init__(self, backend: OneDriveBackend, key: str, item: dict[str, Any],
                 response: Any) -> None:
        super().__init__(backend, key, int(item["size"]), response)
        self._url = str(item["@microsoft.graph.downloadUrl"])
        self._expected = _file_hash(item)
        self._hasher = QuickXorHash()

    def _next_piece(self, wanted: int) -> bytes:
        # Bytes past the stated size are never handed out (nor hashed).
        return self._backend._retried(self._key, "read", self._next)[: self._size - self._pos]

    def _handed_out(self, data: bytes) -> None:
        self._hasher.update(data)
        if self._pos >= self._size and self._expected not in (None, self._hasher.b64digest()):
            raise BackendError(f"{self._key!r} on {self._backend.name} changed while it was "
                               "read (its quickXorHash does not match)")

    def _next(self) -> bytes:
        if self._chunks is None:
            self._response = self._backend._http(
                "GET", self._url, key=self._key, action="read", auth=False, stream=True,
                headers={"Range": f"bytes={self._pos}-"},
            )
            if self._response.status_code != 206:
                self._drop()
                raise BackendError(f"{self._key!r} on {self._backend.name}: the download could "
                                   "not be resumed (no partial content)")
            self._open(self._response)
        try:
            return self._next_chunk()
        except Exception as exc:
            translated = self._backend._transport_error(exc, self._key, "read")
            if translated is exc:
                raise
            raise translated from exc
