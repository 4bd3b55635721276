"""Every exception metasync raises on purpose.

The CLI prints ``str(error)`` of any :class:`MetasyncError` as one line and exits
non-zero; anything else is a bug and gets a traceback only under ``--debug``.
Messages name the problem and, where there is one, the fix.
"""

from __future__ import annotations


class MetasyncError(Exception):
    """Base of every deliberate failure. ``exit_code`` is what the CLI returns."""

    exit_code = 2


class UsageError(MetasyncError):
    """The user asked for something that cannot be done as asked (bad URI, bad DIR, ...)."""


class NotARepository(MetasyncError):
    """A folder or backend holds no metasync repository."""


class WrongPassphrase(MetasyncError):
    """The passphrase does not unwrap the repository key."""


class FormatError(MetasyncError):
    """Data on a backend is not in a format this version understands."""


class CorruptObject(MetasyncError):
    """A copy read from a backend fails its integrity check (hash, MAC, size or name)."""


class ObjectUnavailable(MetasyncError):
    """No backend that should hold an object returned a good copy of it."""


class MasterMoved(MetasyncError):
    """Someone else advanced master since this client's last pull."""


class Conflict(MetasyncError):
    """Local and remote changes touch the same paths and cannot be applied without loss."""


class BackendError(MetasyncError):
    """A backend failed. ``transient`` says whether a retry may succeed."""

    def __init__(self, message: str, *, transient: bool = False) -> None:
        super().__init__(message)
        self.transient = transient


class BackendUnavailable(BackendError):
    """The backend cannot be reached at all (folder gone, server down)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, transient=True)


class ObjectNotFound(BackendError):
    """The key does not exist on this backend."""


class AlreadyExists(BackendError):
    """An exclusive create found the key already present."""


class InvalidKey(BackendError):
    """A key is not a safe relative name (empty part, '..', absolute, bad character)."""


class AuthorizationRequired(BackendError):
    """A cloud provider has no usable sign-in for this client: never signed in, or the
    grant expired or was revoked. The message says which ``metasync auth`` to run."""
