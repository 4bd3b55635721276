"""pPaxos (paper 3.3, Figure 5): agreeing on the next version through passive logs.

Each acceptor is an append-only log on a backend (``log/<instance>``); one
single-decree Paxos instance decides each version. The decision logic is pure:
:func:`replay` turns one log's messages into that acceptor's state, and the
``*_outcome`` functions decide from those states. :class:`Consensus` is the I/O
driver: it appends and fetches, concurrently across acceptors.

Messages are JSON, passed through the translator chain with the instance as
associated data, so with encryption on a backend can neither read nor forge
nor move a message between instances; a message that fails to decode is
ignored, exactly like one never written.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from metasync.backends import Backend
from metasync.codec import Codec
from metasync.errors import BackendError, CorruptObject, MetasyncError, ObjectNotFound
from metasync.objects import Version

HINT_KEY = "latest"


def log_key(instance: int) -> str:
    return f"log/{instance:012d}"


@dataclass(frozen=True, order=True)
class Round:
    """A proposal number: unique per client because the client id breaks ties."""

    number: int
    client: str


@dataclass(frozen=True)
class Message:
    type: str  # "prepare" or "accept"
    round: Round
    value: Version | None = None

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"type": self.type, "round": [self.round.number, self.round.client]}
        if self.value is not None:
            doc["value"] = self.value.to_json()
        return doc

    @classmethod
    def from_json(cls, raw: Any) -> Message:
        if not isinstance(raw, dict) or raw.get("type") not in ("prepare", "accept"):
            raise CorruptObject("bad pPaxos message")
        rnd = raw.get("round")
        if not (isinstance(rnd, list) and len(rnd) == 2 and isinstance(rnd[0], int)
                and isinstance(rnd[1], str)):
            raise CorruptObject("bad pPaxos round")
        value = Version.from_json(raw.get("value")) if raw["type"] == "accept" else None
        if raw["type"] == "accept" and value is None:
            raise CorruptObject("accept without value")
        return cls(raw["type"], Round(rnd[0], rnd[1]), value)


@dataclass
class AcceptorState:
    """What an acceptor 'decided', reconstructed from its log (Figure 5 UPDATE)."""

    promised: Round | None = None
    accepted: tuple[Round, Version] | None = None
    #: For each granted prepare: the value accepted before it (reported in the promise).
    grants: dict[Round, tuple[Round, Version] | None] = field(default_factory=dict)
    #: Accepts that took effect, by round.
    accepts: dict[Round, Version] = field(default_factory=dict)
    highest_seen: int = 0


def replay(messages: list[Message]) -> AcceptorState:
    """Process one log in order: a prepare is granted if its round exceeds every
    earlier promise; an accept takes effect if its round is at least the promise."""
    state = AcceptorState()
    for msg in messages:
        state.highest_seen = max(state.highest_seen, msg.round.number)
        if msg.type == "prepare":
            if state.promised is None or msg.round > state.promised:
                state.promised = msg.round
                state.grants[msg.round] = state.accepted
        elif msg.value is not None and (state.promised is None or msg.round >= state.promised):
            state.promised = msg.round
            state.accepted = (msg.round, msg.value)
            state.accepts[msg.round] = msg.value
    return state


def quorum(acceptors: int) -> int:
    return acceptors // 2 + 1


def decided(states: list[AcceptorState], needed: int) -> Version | None:
    """The value accepted in one round by ``needed`` acceptors, if any."""
    counts: dict[Round, int] = {}
    values: dict[Round, Version] = {}
    for s in states:
        for rnd, value in s.accepts.items():
            counts[rnd] = counts.get(rnd, 0) + 1
            values[rnd] = value
    for rnd, count in counts.items():
        if count >= needed:
            return values[rnd]
    return None


def prepare_outcome(
    states: list[AcceptorState], rnd: Round, needed: int, own: Version | None
) -> tuple[bool, Version | None]:
    """After PREPARE: (granted by a quorum?, value to propose).

    The value is the highest-round value any granting acceptor had accepted, else
    ``own`` (which may be ``None`` when only completing an instance)."""
    granted = [s.grants[rnd] for s in states if rnd in s.grants]
    if len(granted) < needed:
        return False, None
    prior = [g for g in granted if g is not None]
    if prior:
        return True, max(prior, key=lambda g: g[0])[1]
    return True, own


class Consensus:
    """Runs pPaxos instances over the acceptor backends."""

    def __init__(
        self,
        acceptors: dict[str, Backend],
        codec: Codec,
        client_id: str,
        executor: ThreadPoolExecutor,
        *,
        sleep: Callable[[float], None] = time.sleep,
        max_attempts: int = 8,
    ) -> None:
        self.acceptors = acceptors
        self.codec = codec
        self.client_id = client_id
        self.executor = executor
        self.needed = quorum(len(acceptors))
        self.sleep = sleep
        self.max_attempts = max_attempts
        #: Round trips to acceptors made so far (one per concurrent append or fetch).
        self.round_trips = 0

    # --- I/O -----------------------------------------------------------------------
    def _encode(self, instance: int, msg: Message) -> bytes:
        return self.codec.encode("log", str(instance), json.dumps(msg.to_json()).encode())

    def _decode(self, instance: int, data: bytes) -> Message | None:
        try:
            return Message.from_json(json.loads(self.codec.decode("log", str(instance), data)))
        except (CorruptObject, ValueError, RecursionError):
            return None

    def _append_all(self, instance: int, msg: Message) -> int:
        data = self._encode(instance, msg)
        self.round_trips += 1

        def one(backend: Backend) -> bool:
            try:
                backend.append(log_key(instance), data)
                return True
            except MetasyncError:
                return False

        return sum(self.executor.map(one, self.acceptors.values()))

    def _fetch_all(self, instance: int) -> list[AcceptorState]:
        self.round_trips += 1

        def one(backend: Backend) -> AcceptorState | None:
            try:
                entries = backend.fetch(log_key(instance))
            except MetasyncError:
                return None
            msgs = [m for _, raw in entries if (m := self._decode(instance, raw)) is not None]
            return replay(msgs)

        states = [s for s in self.executor.map(one, self.acceptors.values()) if s is not None]
        if len(states) < self.needed:
            raise BackendError(
                f"only {len(states)} of {len(self.acceptors)} acceptors answered; "
                f"{self.needed} are needed to agree on a version",
                transient=True,
            )
        return states

    # --- protocol -----------------------------------------------------------------
    def learn(self, instance: int) -> Version | None:
        """The value decided in ``instance``, if a quorum's logs show one."""
        return decided(self._fetch_all(instance), self.needed)

    def propose(self, instance: int, value: Version | None) -> Version | None:
        """Run Figure 5 until ``instance`` decides; return the decided value.

        With ``value=None`` this only completes an instance some proposer left
        half-done (returns ``None`` if nothing was ever accepted).
        """
        for attempt in range(self.max_attempts):
            states = self._fetch_all(instance)
            done = decided(states, self.needed)
            if done is not None:
                return done
            rnd = Round(max(s.highest_seen for s in states) + 1, self.client_id)
            self._append_all(instance, Message("prepare", rnd))
            states = self._fetch_all(instance)
            granted, chosen = prepare_outcome(states, rnd, self.needed, value)
            if granted:
                if chosen is None:
                    return None
                self._append_all(instance, Message("accept", rnd, chosen))
                states = self._fetch_all(instance)
                done = decided(states, self.needed)
                if done is not None:
                    return done
            # Lost to a concurrent proposer: randomized exponential backoff.
            self.sleep(random.uniform(0, 0.05 * (2**attempt)))
        raise BackendError(
            f"could not agree on version {instance} after {self.max_attempts} attempts",
            transient=True,
        )

    def latest(self, known: Version) -> Version:
        """The most recent decided version at or after ``known`` (get_recent).

        Starts from the highest hint an acceptor gives (hints are only trusted
        once the logs confirm them) and walks forward until an instance is
        undecided, completing any instance a crashed proposer left half-done.
        """
        current = known
        hint = self._read_hint()
        if hint is not None and hint > current.number:
            value = self.learn(hint)
            if value is not None and value.number == hint:
                current = value
        while True:
            states = self._fetch_all(current.number + 1)
            nxt = decided(states, self.needed)
            if nxt is None:
                if not any(s.accepts for s in states):
                    return current  # nothing proposed there: no writes needed to learn
                nxt = self.propose(current.number + 1, None)
                if nxt is None:
                    return current
            if nxt.number != current.number + 1:
                raise CorruptObject(f"instance {current.number + 1} decided a wrong version")
            current = nxt

    def _read_hint(self) -> int | None:
        def one(backend: Backend) -> int | None:
            try:
                raw = self.codec.decode("hint", HINT_KEY, backend.get(HINT_KEY))
                number = json.loads(raw)["version"]
                return number if isinstance(number, int) else None
            except (ObjectNotFound, MetasyncError, ValueError, KeyError, TypeError, RecursionError):
                return None

        hints = [h for h in self.executor.map(one, self.acceptors.values()) if h is not None]
        return max(hints) if hints else None

    def write_hint(self, version: Version) -> None:
        """Record ``version`` as the latest on every acceptor (best effort)."""
        data = self.codec.encode("hint", HINT_KEY, json.dumps({"version": version.number}).encode())

        def one(backend: Backend) -> None:
            try:
                backend.put(HINT_KEY, data)
            except MetasyncError:
                pass

        list(self.executor.map(one, self.acceptors.values()))
