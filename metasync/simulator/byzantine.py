"""What a Byzantine acceptor answers: anything the MAC lets it get away with.

Messages, hints and floor records are authenticated in production, so a lying
acceptor can only return things some client really wrote (for a log: of that
very instance), in any order or subset, and lie about whether it stored them.
"""

from __future__ import annotations

import random

from metasync.paxos import (
    Append,
    DropLogs,
    Fetch,
    Message,
    ReadFloor,
    ReadHint,
    Reply,
    Request,
    Round,
    WriteFloor,
)
from metasync.simulator.model import Acceptor, ReadRawHint


def _by_round(msg: Message) -> Round:
    return msg.round


class Liar:
    """The Byzantine acceptors' behaviour, over what every proposer sent
    (``sent``, per instance) and every hint ever written (``hints``)."""

    def __init__(self, rng: random.Random, sent: dict[int, list[Message]],
                 hints: list[tuple[int, str]]) -> None:
        self.rng = rng
        self.sent = sent
        self.hints = hints

    def apply(self, acc: Acceptor, req: Request | ReadRawHint, config: str) -> Reply | tuple[int, str]:
        """Acceptor ``acc``'s answer to ``req`` from a client of configuration ``config``
        (but ``WriteFloor`` and ``DropLogs``, which the world handles)."""
        rng = self.rng
        if isinstance(req, Fetch):
            reply = self.log(acc, req.instance)
            if reply and rng.random() < 0.15:
                # Garbage that fails its MAC: the reader sees an undecodable entry.
                reply.insert(rng.randrange(len(reply) + 1), None)
            return reply
        if isinstance(req, Append):
            log = acc.logs.setdefault(req.instance, [])
            fits = req.position is None or len(log) == req.position
            if fits and rng.random() < 0.8:
                log.append(req.message if rng.random() < 0.9 else None)
            if req.position is None:
                return True
            return fits if rng.random() < 0.6 else rng.random() < 0.5
        if isinstance(req, ReadHint):
            # Any hint ever written; the driver takes only one of its own configuration.
            if self.hints and rng.random() < 0.7:
                number, of = rng.choice(self.hints)
                return number if of == config else None
            if rng.random() < 0.5 and acc.hint is not None and acc.hint[1] == config:
                return acc.hint[0]
            return None
        if isinstance(req, ReadRawHint):
            if self.hints and rng.random() < 0.7:
                return rng.choice(self.hints)
            return acc.hint if rng.random() < 0.5 and acc.hint is not None else False
        if isinstance(req, ReadFloor):
            # Hide the floor, tell it, or claim a higher one. Claiming a floor nobody
            # recorded is more than production lets a backend do (a floor counts only
            # once its record authenticates: consensus.FloorRecords), so this also
            # covers a planted floor/999999999999 (issue 16).
            how = rng.random()
            return 0 if how < 0.3 else acc.floor if how < 0.7 else acc.floor + rng.randint(1, 6)
        assert not isinstance(req, WriteFloor | DropLogs)  # the world's: they change its records
        acc.hint = (req.number, config)
        self.hints.append(acc.hint)
        return True

    def log(self, acc: Acceptor, instance: int) -> list[Message | None]:
        """What a Byzantine acceptor claims its log is: reordered, cut and spliced real
        messages (of this instance only: the MAC binds the instance)."""
        rng = self.rng
        own = list(acc.logs.get(instance, ()))
        sent: list[Message] = self.sent.get(instance, [])
        claim: list[Message | None]
        how = rng.random()
        if how < 0.2:
            claim = own
        elif how < 0.35:
            claim = [m for m in own if rng.random() < 0.6]
        elif how < 0.5:
            claim = own
            rng.shuffle(claim)
        elif how < 0.7:
            claim = [m for m in own + [m for m in sent if rng.random() < 0.5] if rng.random() < 0.7]
            if rng.random() < 0.5:
                rng.shuffle(claim)
        elif how < 0.8:
            # Claim to have accepted everything ever sent, promising nothing first.
            accepted = sorted((m for m in sent if m.type == "accept"), key=_by_round)
            claim = list(accepted)
        elif how < 0.87:
            # Claim the highest promise seen, to pre-empt everyone.
            everything = sorted(sent, key=_by_round)
            claim = list(everything)
        elif how < 0.95:
            # Grant the newest prepare while reporting the oldest accepted value.
            accepts = [m for m in sent if m.type == "accept"]
            prepares = [m for m in sent if m.type == "prepare"]
            claim = []
            if accepts:
                claim.append(min(accepts, key=_by_round))
            if prepares:
                claim.append(max(prepares, key=_by_round))
        else:
            claim = []
        return claim
