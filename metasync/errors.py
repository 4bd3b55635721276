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


class FolderBusy(UsageError):
    """Another process (the daemon's sync step, another command) has the folder and
    did not let go within the wait allowed."""


class Interrupted(MetasyncError):
    """The user stopped the command (Ctrl-C, SIGTERM): transfers in flight were
    cancelled. The message says what was kept and what the next command does."""

    exit_code = 130


class NotARepository(MetasyncError):
    """A folder or backend holds no metasync repository."""


class WrongPassphrase(MetasyncError):
    """The passphrase does not unwrap the repository key."""


class NotTrusted(MetasyncError):
    """What a backend returned is not vouched for by the repository's key or by what
    the user pinned (an unauthenticated descriptor, another repository's key file, a
    fingerprint that differs, an unencrypted repository not asked for): refused."""


class KeyRevoked(NotTrusted):
    """This client's key slot was removed from the repository, so it cannot open the
    keys of a rotation made since: clone again with a passphrase still valid."""


class FormatError(MetasyncError):
    """Data on a backend is not in a format this version understands."""


class CorruptObject(MetasyncError):
    """A copy read from a backend fails its integrity check (hash, MAC, size or name)."""


class ObjectUnavailable(MetasyncError):
    """No backend that should hold an object returned a good copy of it."""


class BackendError(MetasyncError):
    """A backend failed. ``transient`` says whether a retry may succeed."""

    def __init__(self, message: str, *, transient: bool = False) -> None:
        super().__init__(message)
        self.transient = transient


class BackendUnavailable(BackendError):
    """The backend cannot be reached at all (folder gone, server down)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, transient=True)


class NoAnswer(BackendUnavailable):
    """The backend took the connection or the request and said nothing within its
    network timeout (a hung server, a firewall that drops replies). After a request
    ends this way its backend's next requests fail at once for a while
    (:class:`metasync.backends.retry.Silence`): a silent backend costs a command
    one timeout, not one per request."""


class PausedBackend(NoAnswer):
    """A request not sent at all: its backend is paused after another request got
    no answer (:class:`metasync.backends.retry.Silence`). Never retried by the
    request's own loop."""


class PrimitiveMissing(BackendUnavailable):
    """A backend accepts the requests of an atomic primitive metasync's logs need (an
    exclusive create, a lock) but does not honour it. Not transient: no retry cures
    it. For agreement the backend then counts as unavailable, so the pPaxos driver
    reports it at once, naming the backend and carrying this message."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.transient = False


class BackendFull(BackendError):
    """The backend refused a write for want of space: its disk is full (ENOSPC), a
    quota is used up (EDQUOT, HTTP 507, a provider's quota error). Not transient,
    and not unreachable: the backend still answers and its copies stay readable; new
    copies spill to other backends (metasync.replicator) until it has room. Make one
    with :meth:`of`, so every backend kind words it alike."""

    @classmethod
    def of(cls, name: str, detail: str) -> BackendFull:
        """``backend NAME is full (DETAIL); free space or add a backend``."""
        return cls(f"backend {name} is full ({detail}); free space there or add a backend")


class ObjectNotFound(BackendError):
    """The key does not exist on this backend."""


class TransientError(BackendError):
    """A failure worth retrying (:mod:`metasync.backends.retry` retries it);
    ``retry_after`` is the service's requested wait, if it named one."""

    def __init__(self, message: str, *, retry_after: float | None = None) -> None:
        super().__init__(message, transient=True)
        self.retry_after = retry_after


class InvalidKey(BackendError):
    """A key is not a safe relative name (empty part, '..', absolute, bad character)."""


class AuthorizationRequired(BackendError):
    """A cloud provider has no usable sign-in for this client: never signed in, or the
    grant expired or was revoked. The message says which ``metasync auth`` to run."""


# --- pPaxos outcomes (raised by the sans-IO core in metasync.paxos) -------------------
class ProtocolError(MetasyncError):
    """An agreement could not be reached or read as asked; never a safety problem."""


class NoQuorum(ProtocolError):
    """Too few acceptors answered to decide anything (liveness, never safety)."""

    def __init__(self, answered: int, needed: int, instance: int) -> None:
        super().__init__(f"{answered} acceptors answered, {needed} needed (instance {instance})")
        self.answered = answered
        self.needed = needed
        self.instance = instance


class Compacted(ProtocolError):
    """The instance is below the acceptors' compaction floor: it was decided long
    ago and its logs may be gone, so nothing may be proposed or learned there. The
    caller is behind; it learns from instance ``floor`` (which is kept) instead."""

    def __init__(self, instance: int, floor: int) -> None:
        super().__init__(f"instance {instance} is below the compaction floor {floor}")
        self.instance = instance
        self.floor = floor


class Contended(ProtocolError):
    """Proposers kept pre-empting each other for ``attempts`` attempts."""

    def __init__(self, instance: int, attempts: int) -> None:
        super().__init__(f"no decision in instance {instance} after {attempts} attempts")
        self.instance = instance
        self.attempts = attempts


class FloorElsewhere(ProtocolError):
    """The client is behind a log compaction whose floor instance was decided by
    other acceptors than this configuration's: it must find the newest version
    another way (the backends' hints, as a fresh clone does)."""

    def __init__(self, floor: int) -> None:
        super().__init__(f"this client is behind the log compaction at version {floor}, "
                         "which other backends decided")
        self.floor = floor


class Retired(ProtocolError):
    """This client's configuration lost its majority for good and the repository was
    recovered on the backends that survived (``metasync recover``): it must not
    propose there. The message says to clone the repository again."""


class UnsafeRepository(MetasyncError):
    """A ``.metasync`` folder another user owns or can write to: opening it would
    let that user decide what this user's commands read, push and write."""
