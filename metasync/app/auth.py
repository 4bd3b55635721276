"""Who may use the service's page and API (docs/api.md, "Authentication").

Three credentials, checked in :class:`Gate`:

- the ``X-API-Key`` header (scripts; Syncthing's convention), compared in
  constant time with the key kept 0600 in the user's config folder;
- a one-time login token (``metasync gui``), made by :func:`make_token` from the
  same key without talking to the service: ``NONCE.EXPIRY.MAC``, MAC being
  HMAC-SHA256(key, ``NONCE.EXPIRY``). The service takes each nonce once and only
  before its expiry, and answers with a random session id in an ``HttpOnly``,
  ``SameSite=Strict`` cookie (Jupyter's token login). Anyone who can read the key
  file can make a token -- exactly who could send the key itself;
- that session cookie. A state-changing call made with it must repeat the
  ``metasync-csrf`` cookie's value in the ``X-CSRF-Token`` header (double submit):
  a page from another site can make the browser send the cookie, but cannot read
  it to set the header.

Whatever the credential, a ``Host`` header that is not a loopback name is refused
(DNS rebinding: a hostile name resolving to 127.0.0.1 makes the browser call us as
that name). Sessions live in memory: a restarted service asks for a new login.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import threading
import time

#: Seconds a login token stays valid: long enough to open a browser, short enough
#: that one left in a shell history or a process list is soon worthless.
TOKEN_TTL = 120
#: The session cookie and the CSRF cookie (and its header).
SESSION_COOKIE = "metasync-session"
CSRF_COOKIE = "metasync-csrf"
CSRF_HEADER = "X-CSRF-Token"
API_KEY_HEADER = "X-API-Key"
#: Host names a loopback-only service answers to (with or without its port).
LOOPBACK_NAMES = ("127.0.0.1", "localhost", "[::1]")
#: Methods that change state: they need the CSRF header when sent with the cookie.
UNSAFE_METHODS = frozenset({"POST", "PUT", "DELETE", "PATCH"})


def _mac(api_key: str, nonce: str, expiry: int) -> str:
    return hmac.new(api_key.encode(), f"{nonce}.{expiry}".encode(), hashlib.sha256).hexdigest()


def make_token(api_key: str, now: float | None = None, ttl: int = TOKEN_TTL) -> str:
    """A one-time login token for the service that holds ``api_key``
    (``NONCE.EXPIRY.MAC``; see the module docstring)."""
    nonce = secrets.token_urlsafe(16)  # no "." in the URL-safe alphabet
    expiry = int((time.time() if now is None else now) + ttl)
    return f"{nonce}.{expiry}.{_mac(api_key, nonce, expiry)}"


class Gate:
    """The checks of one running service: its key, the nonces already taken, the
    sessions it opened. Thread-safe (handlers may run in several threads)."""

    def __init__(self, api_key: str, port: int = 0) -> None:
        self._key = api_key
        #: The port the service listens on (0 until known): the Host header may carry it.
        self.port = port
        self._lock = threading.Lock()
        #: nonce -> expiry, for tokens already redeemed (forgotten once expired).
        self._used: dict[str, int] = {}
        #: session id -> CSRF token of that session.
        self._sessions: dict[str, str] = {}

    # ---------------------------------------------------------------- host
    def host_ok(self, host: str | None) -> bool:
        """True if ``host`` (the Host header) is a loopback name, bare or with this
        service's port."""
        if not host:
            return False
        host = host.strip().lower()
        for name in LOOPBACK_NAMES:
            if host == name or (self.port and host == f"{name}:{self.port}"):
                return True
        return False

    # ---------------------------------------------------------------- key
    def key_ok(self, presented: str | None) -> bool:
        """True if ``presented`` is the API key (compared in constant time)."""
        if not presented:
            return False
        return hmac.compare_digest(presented.encode(), self._key.encode())

    # ---------------------------------------------------------------- tokens and sessions
    def redeem(self, token: str, now: float | None = None) -> tuple[str, str] | None:
        """Open a session for a valid, unexpired, unused login token: returns
        ``(session id, csrf token)``; None for any other token (said no more
        precisely: the caller answers 401 either way)."""
        now = time.time() if now is None else now
        parts = token.split(".")
        if len(parts) != 3 or not parts[1].isdigit():
            return None
        nonce, expiry_text, mac = parts
        expiry = int(expiry_text)
        if not hmac.compare_digest(mac.encode(), _mac(self._key, nonce, expiry).encode()):
            return None
        # A token claiming a far expiry was not made by make_token: refuse it too.
        if expiry < now or expiry > now + TOKEN_TTL * 10:
            return None
        with self._lock:
            self._used = {n: e for n, e in self._used.items() if e >= now}
            if nonce in self._used:
                return None
            self._used[nonce] = expiry
            session, csrf = secrets.token_urlsafe(32), secrets.token_urlsafe(32)
            self._sessions[session] = csrf
        return session, csrf

    def session_csrf(self, session: str | None) -> str | None:
        """The CSRF token of an open session; None if ``session`` is not one."""
        if not session:
            return None
        with self._lock:
            for known, csrf in self._sessions.items():
                if hmac.compare_digest(known.encode(), session.encode()):
                    return csrf
        return None

    def csrf_ok(self, session: str | None, cookie: str | None, header: str | None) -> bool:
        """The double-submit check of a state-changing call made with the session
        cookie: the header equals the cookie, and both are the session's token."""
        expected = self.session_csrf(session)
        if expected is None or not cookie or not header:
            return False
        return (hmac.compare_digest(cookie.encode(), header.encode())
                and hmac.compare_digest(header.encode(), expected.encode()))
