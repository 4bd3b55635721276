"""A deterministic, seeded discrete-event simulation of pPaxos under faults,
configuration changes and backend losses.

The simulator drives *exactly* the protocol generators of :mod:`metasync.paxos`
(``get_recent``, ``propose``, ``past_floor``, ``publish_hint``, ``compact``) and
the configuration-following generators of :mod:`metasync.follow` (``latest``,
``start``) against in-memory backends, and places pushed objects with the real
:class:`~metasync.mapping.StableMapping` of each configuration, in virtual time:
no threads, no sleeping, no wall clock. Everything random comes from
``random.Random(seed)`` (and streams seeded from it or from the seed), so a seed
replays its schedule bit for bit. docs/simulator.md describes the model.

- **Backends** are acceptors -- per instance an append-only list of messages, a
  ``latest`` hint naming its configuration, a compaction floor -- and stores of
  object copies and spill records; some support conditional appends. In
  Byzantine mode up to ``f`` of them lie about their logs, hints and floors.
- **Configurations** are versions: clients add backends, remove live or dead
  ones and change R, each change decided on the old configuration's acceptors.
- **Clients** push (learn by following configurations, upload with spills,
  repair and hand copies home, propose, merge, retry), make configuration
  changes (copy first, decide, publish, rebalance), sleep through changes, or
  join late as fresh clones from a backend's hint.
- **Faults**: delays with long tails, failed requests, lost replies, duplicated
  plain appends, torn appends, per-request timeouts, acceptors down and links
  cut for a while (sometimes more than the quorums tolerate), clients crashing
  mid-protocol, and backends lost for good (never more than the configuration
  tolerates).
- **Checker**, once all faults are healed and all is quiescent: one value chosen
  per instance on the acceptors that ran it, every successful push in the final
  history, every client that can reach the current configuration converging on
  the newest version, one linear chain of versions, and every object of every
  push acknowledged with R copies still readable.

Run ``bin/simulate --seeds N`` (see :func:`main`).

The modules, importing only :mod:`metasync.paxos`, :mod:`metasync.follow`,
:mod:`metasync.objects`, :mod:`metasync.mapping`, :mod:`metasync.errors` and the
standard library (nothing here does I/O but the CLI's output):

- ``params.py``: a schedule's configuration and plan, drawn from its seed;
- ``model.py``: the data (configurations, backends, clients, round trips,
  results, ids) and how the trace shows them;
- ``world.py``: ``World``, virtual time and its event queue, the backends, the
  configurations, the network and the faults; ``byzantine.py``: what a lying
  acceptor answers;
- ``storage.py``: ``Storage``, the object copies placed by the production rules;
- ``following.py``: ``Following(World)``, the follow generator driven on
  simulated acceptors; ``sessions.py``: ``Sessions(Following)``, push,
  configuration changes, clones, the final learning;
- ``simulation.py``: ``Simulation(Sessions)``, driving the sessions, the
  compactor, the plan (changes, losses, sleepers, clones) and one schedule's
  run; ``run``;
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
    Change,
    Client,
    Result,
    Session,
    SimConfig,
    commit_id,
    short,
    show_message,
    show_reply,
    show_request,
    show_round,
)
from metasync.simulator.params import DEFAULT_BFT_SHARE, Params, Plan, draw_params, draw_plan
from metasync.simulator.simulation import (
    CHANGE_ATTEMPTS,
    FINAL_PASSES,
    HEAL_LIMIT,
    PUSH_ATTEMPTS,
    Simulation,
    run,
)
from metasync.simulator.world import EVENT_LIMIT, World

__all__ = [
    "CHANGE_ATTEMPTS",
    "CONFIG",
    "DEFAULT_BFT_SHARE",
    "EVENT_LIMIT",
    "FINAL_PASSES",
    "HEAL_LIMIT",
    "PUSH_ATTEMPTS",
    "V0",
    "Acceptor",
    "Batch",
    "Change",
    "Checker",
    "Client",
    "Params",
    "Plan",
    "Result",
    "Session",
    "SimConfig",
    "Simulation",
    "World",
    "commit_id",
    "draw_params",
    "draw_plan",
    "main",
    "run",
    "short",
    "show_message",
    "show_reply",
    "show_request",
    "show_round",
]
