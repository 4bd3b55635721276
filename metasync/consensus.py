"""The pPaxos I/O driver: runs the pure protocol of :mod:`metasync.paxos` on backends.

The driver only appends, fetches and reads or writes the hint, concurrently
across acceptors (one round trip per batch), each request bounded by the
configured wait. Everything it decides comes from the protocol generators.

Messages are JSON, passed through the translator chain with the instance as
associated data: with encryption on (always, in Byzantine mode) each one is
authenticated under the repository key, so a backend can neither read nor forge
nor move a message between instances. A message that fails to decode is
dropped, exactly like one never written.
"""

from __future__ import annotations

import json
import random
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from metasync.backends import Backend
from metasync.codec import Codec
from metasync.errors import (
    BackendError,
    BackendUnavailable,
    CorruptObject,
    MetasyncError,
    ObjectNotFound,
)
from metasync.faults import crash_point
from metasync.objects import Version
from metasync.paxos import (
    Append,
    Backoff,
    Contended,
    Fetch,
    Message,
    NoQuorum,
    Quorums,
    ReadHint,
    Reading,
    Reply,
    Request,
    Run,
    Setup,
    WriteHint,
    get_recent,
    propose,
    publish_hint,
    read,
)

HINT_KEY = "latest"
#: Longest log a reader accepts (a hostile backend could claim any position).
MAX_LOG = 100_000
#: Default bound, in seconds, on how long consensus waits without progress.
DEFAULT_TIMEOUT = 30.0

T = TypeVar("T")


def log_key(instance: int) -> str:
    return f"log/{instance:012d}"


def encode_hint(codec: Codec, number: int, config_id: str) -> bytes:
    """The stored ``latest`` hint: version ``number`` was decided by the acceptors of
    configuration ``config_id``."""
    return codec.encode("hint", HINT_KEY, json.dumps({"version": number, "config": config_id}).encode())


def read_hint(codec: Codec, backend: Backend) -> tuple[int, str] | None:
    """``(version, config id)`` of ``backend``'s ``latest`` hint; ``None`` if it is
    missing or unreadable (a hint is only ever a shortcut)."""
    try:
        raw = json.loads(codec.decode("hint", HINT_KEY, backend.get(HINT_KEY)))
        number, config_id = raw["version"], raw["config"]
    except ObjectNotFound:
        return None
    except (CorruptObject, ValueError, KeyError, TypeError, RecursionError):
        return None
    if type(number) is not int or number < 0 or not isinstance(config_id, str):
        return None
    return number, config_id


@dataclass
class _Outcome:
    reply: Reply = None
    error: BaseException | None = None


class Consensus:
    """pPaxos over the acceptor backends (paper Table 1: ``propose``, ``get_recent``).

    ``timeout`` bounds every wait: a request that has not answered by then counts
    as failed, and an operation that goes that long without a quorum answering
    fails with :class:`BackendUnavailable`. It also fails at once when more
    acceptors report themselves unreachable than the quorums tolerate.
    """

    def __init__(
        self,
        acceptors: dict[str, Backend],
        codec: Codec,
        client_id: str,
        *,
        quorums: Quorums | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        sleep: Callable[[float], None] = time.sleep,
        rng: random.Random | None = None,
        max_attempts: int = 10,
        backoff: float = 0.05,
        fast_path: bool = True,
        conditional: bool = True,
        names: dict[str, str] | None = None,
        config_id: str = "",
    ) -> None:
        self.acceptors = acceptors
        #: The configuration whose acceptors these are. Hints name it, so a reader
        #: jumps only to versions this very acceptor set decided (docs/FORMAT.md §9).
        self.config_id = config_id
        self.codec = codec
        self.quorums = quorums or Quorums.crash(len(acceptors))
        # ``conditional=False`` ignores conditional appends (the paper's plain logs).
        with_position = frozenset(
            a for a, b in acceptors.items() if conditional and b.capabilities.conditional_append
        )
        # A fresh proposer id per session: a round is never reused, even by a
        # client that crashed and restarted while one of its requests was in flight.
        self.setup = Setup(
            tuple(acceptors), with_position, self.quorums, f"{client_id}.{secrets.token_hex(4)}",
            max_attempts=max_attempts, backoff=backoff, fast_path=fast_path,
        )
        self.timeout = timeout
        self.sleep = sleep
        self.rng = rng or random.Random()
        self.names = names or {a: b.name for a, b in acceptors.items()}
        #: Round trips (batches of concurrent requests) and requests made so far.
        self.round_trips = 0
        self.requests = 0
        self._next: Reading | None = None
        self._errors: dict[str, str] = {}
        self._wrote = False

    # --- the API ---------------------------------------------------------------------
    def get_recent(self, known: Version) -> Version:
        """The newest decided version at or after ``known``."""
        version, reading = self.run(get_recent(self.setup, known, self.rng))
        self._next = reading
        return version

    def propose(self, instance: int, value: Version | None) -> Version | None:
        """Run ``instance`` to a decision; return the decided value (maybe another's).
        Starts from the logs the last :meth:`get_recent` read, if of this instance."""
        cached = self._next if self._next is not None and self._next.instance == instance else None
        self._next = None
        return self.run(
            propose(self.setup, instance, value, self.rng, cached.logs if cached else None)
        )

    def learn(self, instance: int) -> Version | None:
        """The value decided in ``instance``, if a quorum's logs show one."""
        return self.run(read(self.setup, instance, self.rng)).decided

    def publish(self, version: Version) -> None:
        """Record ``version`` as the latest on every acceptor (best effort)."""
        self.run(publish_hint(self.setup, version))

    @property
    def last_errors(self) -> dict[str, str]:
        """Acceptor id -> why it failed, for the last operation's failed requests."""
        return dict(self._errors)

    # --- driving -----------------------------------------------------------------------
    def run(self, protocol: Run[T]) -> T:
        """Drive a protocol generator to its result, doing its I/O."""
        self._errors = {}
        self._wrote = False
        progress = time.monotonic()
        replies: list[Reply] | None = None
        try:
            while True:
                step = protocol.send(replies)
                if isinstance(step, Backoff):
                    self._check_stall(progress)
                    self.sleep(min(step.seconds, max(0.0, progress + self.timeout - time.monotonic())))
                    replies = None
                    continue
                self._wrote = self._wrote or any(isinstance(r, Append) for r in step)
                replies = self._execute(step)
                crash_point("paxos:batch")
                answered = {r.acceptor for r, reply in zip(step, replies, strict=True)
                            if reply is not None}
                if len(answered) >= self.quorums.classic or len(answered) == len(
                        {r.acceptor for r in step}):
                    progress = time.monotonic()
                self._check_down()
        except StopIteration as stop:
            result: T = stop.value
            return result
        except NoQuorum as exc:
            raise self._unavailable(exc.answered) from None
        except Contended as exc:
            raise BackendError(
                f"could not agree on version {exc.instance}: other clients kept "
                f"committing at the same time; retry",
                transient=True,
            ) from None

    def _check_stall(self, progress: float) -> None:
        if time.monotonic() - progress > self.timeout:
            answered = len(self.acceptors) - len(self._errors)
            raise self._unavailable(answered)

    def _check_down(self) -> None:
        """Fail at once when more acceptors are unreachable than the quorums tolerate."""
        if len(self._errors) > self.quorums.faults and all(
            e.startswith("unreachable") for e in self._errors.values()
        ):
            raise self._unavailable(len(self.acceptors) - len(self._errors))

    def _unavailable(self, answered: int) -> BackendUnavailable:
        failing = sorted(self._errors.items())
        names = ", ".join(self.names[a] for a, _ in failing)
        first = f" ({failing[0][1]})" if failing else ""
        outcome = (
            "Whether this version was made is unknown until they are back; the next "
            "push or pull settles it" if self._wrote
            else "Nothing was changed; retry when they are reachable"
        )
        return BackendUnavailable(
            f"only {max(answered, 0)} of {len(self.acceptors)} backends answered and "
            f"{self.quorums.classic} are needed to agree on a version; not answering: "
            f"{names}{first}. {outcome}"
        )

    def _execute(self, batch: Sequence[Request]) -> list[Reply]:
        """Run one batch concurrently (one round trip); ``None`` for each request that
        failed or did not answer within the timeout."""
        self.round_trips += 1
        self.requests += len(batch)
        outcomes = [_Outcome() for _ in batch]
        threads = [
            # Daemon threads: a backend that never answers must not keep the process alive.
            threading.Thread(target=self._one, args=(req, out), daemon=True)
            for req, out in zip(batch, outcomes, strict=True)
        ]
        for t in threads:
            t.start()
        deadline = time.monotonic() + self.timeout
        replies: list[Reply] = []
        for req, out, t in zip(batch, outcomes, threads, strict=True):
            t.join(max(0.0, deadline - time.monotonic()))
            if t.is_alive():
                self._errors[req.acceptor] = f"no answer within {self.timeout:g} s"
                replies.append(None)
            elif out.error is not None:
                err = out.error
                why = "unreachable" if isinstance(err, BackendUnavailable) else "failed"
                self._errors[req.acceptor] = f"{why}: {err}"
                replies.append(None)
            else:
                self._errors.pop(req.acceptor, None)
                replies.append(out.reply)
        return replies

    def _one(self, request: Request, out: _Outcome) -> None:
        try:
            out.reply = self._perform(request)
        except BaseException as exc:  # reported per request, never raised in a thread
            out.error = exc

    def _perform(self, request: Request) -> Reply:
        backend = self.acceptors[request.acceptor]
        if isinstance(request, Fetch):
            entries = backend.fetch(log_key(request.instance))
            # One slot per position, None where nothing decodes (or nothing is):
            # conditional appends go at the log's real length.
            length = max((pos + 1 for pos, _ in entries if 0 <= pos < MAX_LOG), default=0)
            messages: list[Message | None] = [None] * length
            for pos, raw in entries:
                if 0 <= pos < MAX_LOG and messages[pos] is None:
                    messages[pos] = self._decode(request.instance, raw)
            return messages
        if isinstance(request, Append):
            data = self._encode(request.instance, request.message)
            if request.position is None:
                backend.append(log_key(request.instance), data)
                return True
            return backend.append_at(log_key(request.instance), request.position, data)
        if isinstance(request, ReadHint):
            hint = read_hint(self.codec, backend)
            # A hint of another acceptor set cannot be confirmed on this one.
            return hint[0] if hint is not None and hint[1] == self.config_id else None
        if isinstance(request, WriteHint):
            backend.put(HINT_KEY, encode_hint(self.codec, request.number, self.config_id))
            return True
        raise TypeError(f"unknown request {request!r}")

    def _encode(self, instance: int, msg: Message) -> bytes:
        return self.codec.encode("log", str(instance), json.dumps(msg.to_json()).encode())

    def _decode(self, instance: int, data: bytes) -> Message | None:
        try:
            return Message.from_json(json.loads(self.codec.decode("log", str(instance), data)))
        except (CorruptObject, ValueError, RecursionError, MetasyncError):
            return None

