"""A deterministic, seeded discrete-event simulation of pPaxos under faults.

The simulator drives *exactly* the protocol generators of :mod:`metasync.paxos`
(``get_recent``, ``propose``, ``publish_hint``) against in-memory acceptors, in
virtual time: no threads, no sleeping, no wall clock. Everything random comes
from one ``random.Random(seed)`` (and generators seeded from it), so a seed
replays its schedule bit for bit. docs/simulator.md describes the model.

- **Acceptors** keep, per instance, an append-only list of messages and one hint
  integer; some support conditional appends (append at a position). In Byzantine
  mode up to ``f`` of them lie: they reorder, omit and splice messages that some
  proposer really sent for that instance (messages are MAC'd, so nothing else can
  be returned), lie about conditional appends and replay any hint.
- **Clients** each run a "sync session" modelled on ``metasync push``: make a
  change, learn the newest version, merge, register the commit (the side table
  stands for the commit objects uploaded before proposing), propose it as the
  next version, and on losing learn, merge and try the next instance.
- **Faults**: delays with long tails, failed requests, lost replies, duplicated
  plain appends, torn appends (an undecodable entry), per-request timeouts (a late reply counts as none although the
  request may have been applied), acceptors down and client-acceptor links cut
  for a while (sometimes more than the quorums tolerate), and clients crashing
  mid-protocol and restarting with a new session.
- **Checker**, once all faults are healed, every client has finished and all are
  quiescent: one value chosen per instance (honest acceptor logs and every
  client's decisions agree), every successful push is in the final history, all
  clients converge, and the decided versions form one linear chain.

Run ``bin/simulate --seeds N`` (see :func:`main`).

The modules, each importing only :mod:`metasync.paxos`, :mod:`metasync.objects`
and the standard library (nothing here does I/O but the CLI's output):

- ``params.py``: a schedule's configuration, drawn from its seed (``Params``);
- ``model.py``: the data (``Acceptor``, ``Client``, ``Batch``, ``Result``, commit
  ids) and how the trace shows versions, messages, requests and replies;
- ``world.py``: ``World``, virtual time and its event queue, the acceptors
  (honest and Byzantine), the network, the commit objects and the faults;
- ``simulation.py``: ``Simulation(World)``, the clients' sessions and the
  compactor driven through the real generators, and one schedule's run; ``run``;
- ``checker.py``: ``Checker``, the invariants of a finished schedule;
- ``cli.py``: ``main``, what ``bin/simulate`` (``python -m metasync.simulator``) runs.
"""

from metasync.simulator.checker import Checker
from metasync.simulator.cli import main
from metasync.simulator.model import (
    CONFIG,
    V0,
    Acceptor,
    Batch,
    Client,
    Result,
    Session,
    commit_id,
    short,
    show_message,
    show_reply,
    show_request,
    show_round,
)
from metasync.simulator.params import DEFAULT_BFT_SHARE, Params, draw_params
from metasync.simulator.simulation import (
    FINAL_PASSES,
    HEAL_LIMIT,
    PUSH_ATTEMPTS,
    Simulation,
    recent,
    run,
)
from metasync.simulator.world import EVENT_LIMIT, World

__all__ = [
    "CONFIG",
    "DEFAULT_BFT_SHARE",
    "EVENT_LIMIT",
    "FINAL_PASSES",
    "HEAL_LIMIT",
    "PUSH_ATTEMPTS",
    "V0",
    "Acceptor",
    "Batch",
    "Checker",
    "Client",
    "Params",
    "Result",
    "Session",
    "Simulation",
    "World",
    "commit_id",
    "draw_params",
    "main",
    "recent",
    "run",
    "short",
    "show_message",
    "show_reply",
    "show_request",
    "show_round",
]
