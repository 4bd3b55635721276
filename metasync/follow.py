"""Following configurations to the newest decided version: the decisions, sans-IO.

A version is ``(number, master, config)``; instance ``n + 1`` is decided by the
acceptors of version ``n``'s configuration, so learning the newest version
follows configuration changes hop by hop (docs/FORMAT.md §9). This module
decides *where to look next* and touches nothing, like :mod:`metasync.paxos`:
its functions are generators that *yield* a :data:`Step` and are *sent* its
result, or have the step's error *thrown* into them (``generator.throw``).
:class:`metasync.versions.Versions` drives them with the real
:class:`~metasync.consensus.Consensus` of each configuration; the simulator
(:mod:`metasync.simulator`) drives the very same generators against simulated
acceptors.

The rules:

- **Hop by hop.** :func:`latest` runs ``get_recent`` on the acceptors of the
  configuration it is in; a result of another configuration is a configuration
  change, and the walk goes on on that configuration's acceptors.
- **A configuration without a quorum.** When no quorum of the configuration
  answers (:class:`~metasync.errors.NoQuorum` or
  :class:`~metasync.errors.BackendUnavailable`), a later configuration (which no
  longer waits for lost backends) may have decided newer versions: the walk
  goes on from the newest version that a reachable backend's ``latest`` hint
  names and that a quorum of the hint's configuration confirms
  (:func:`newer_from_hints`). So a majority of the *current* configuration is
  enough, however many configurations ago dead backends were removed.
- **Behind a compaction others decided.** A
  :class:`~metasync.errors.FloorElsewhere` restarts the walk from the newest
  confirmed hint, as a clone does (:func:`version_from_hints`).
- **Hints are only shortcuts**: nothing is believed that the acceptors do not
  confirm (:func:`confirm`): a hint's version is read on its configuration's
  acceptors and, when reading alone cannot show it decided (a version decided in
  the fast round whose accepting acceptors are partly gone), learned by
  finishing its instance -- a Paxos recovery that proposes nothing of its own.
- **A fresh clone** starts from its entry backend's hint once it is confirmed
  (:func:`start`).

Time, retries within one configuration and every request stay with the caller.
"""

from __future__ import annotations

from collections.abc import Generator, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

from metasync.errors import (
    BackendError,
    BackendUnavailable,
    FloorElsewhere,
    MetasyncError,
    NoQuorum,
)
from metasync.objects import Version

T = TypeVar("T")

#: Most configuration changes one read follows (each costs a round trip or two).
MAX_CONFIG_HOPS = 1000


# ================================================================ steps
@dataclass(frozen=True)
class GetRecent:
    """Learn the newest decided version at or after ``known`` on the acceptors of
    configuration ``config`` (``Consensus.get_recent``: it jumps over compaction
    floors those very acceptors decided). Result: that version -- of another
    configuration if the walk stopped at a change. Errors: :class:`NoQuorum` or
    :class:`BackendUnavailable` if no quorum answers, :class:`FloorElsewhere` if the
    client is behind a compaction other acceptors decided; any other error ends
    the walk."""

    config: str
    known: Version


@dataclass(frozen=True)
class ReadHints:
    """Read the ``latest`` hint of every backend of configuration ``storage`` (the
    client's own) and of every acceptor of configuration ``acceptors`` (the one
    that failed to answer). Result: one item per backend, ``(version number,
    config id)`` or ``None`` where the backend has no readable hint or cannot be
    reached."""

    storage: str
    acceptors: str


@dataclass(frozen=True)
class Learn:
    """Read instance ``number`` on the acceptors of configuration ``config``
    (``Consensus.learn``). Result: the version a quorum's logs show decided there,
    or ``None`` (also when the instance was compacted). Any error: not confirmed."""

    config: str
    number: int


@dataclass(frozen=True)
class Finish:
    """Finish instance ``number`` on the acceptors of configuration ``config``
    without a value of one's own (``Consensus.propose(number, None)``, a Paxos
    recovery). Result: the version decided there, or ``None`` if nothing was ever
    accepted (or the instance was compacted). Any error: not confirmed."""

    config: str
    number: int


Step = GetRecent | ReadHints | Learn | Finish
Hint = tuple[int, str]
#: A follow generator: yields steps, is sent their results (or has their errors
#: thrown in), returns ``T``.
Follow = Generator[Step, Any, T]


# ================================================================ the walk
def latest(known: Version, config: str, *, max_hops: int = MAX_CONFIG_HOPS) -> Follow[Version]:
    """The newest decided version, from ``known`` (the client's base) whose
    configuration is ``config`` (the client's own: its backends' hints are read
    when a configuration has no quorum). Follows configuration changes hop by hop
    and falls back on confirmed hints (see the module docstring).

    Raises the :class:`NoQuorum` / :class:`BackendUnavailable` of a configuration
    without a quorum if no newer confirmed hint exists; :class:`BackendError`
    (transient) behind a compaction when no hint can be confirmed, or after
    ``max_hops`` configuration changes; any other error of a step as is."""
    current = config
    for _ in range(max_hops):
        try:
            found = yield GetRecent(current, known)
        except FloorElsewhere as exc:
            # Behind a log compaction that other acceptors than ours decided: start
            # again from the newest version the backends' hints confirm, like a clone.
            known = yield from version_from_hints(config, current, exc)
            current = known.config
            continue
        except (BackendUnavailable, NoQuorum) as exc:
            # No quorum of this configuration answers. If a later configuration
            # (which no longer waits for the lost backends) has decided a newer
            # version, a hint names it and a quorum of that one confirms it.
            newer = yield from newer_from_hints(config, current, known.number)
            if newer is None:
                raise exc
            known, current = newer, newer.config
            continue
        if found.config == current:
            return found
        current, known = found.config, found
    raise BackendError(
        f"the configuration changed more than {max_hops} times while reading; retry",
        transient=True,
    )


def confirm(number: int, config: str) -> Follow[Version | None]:
    """Version ``number`` if the acceptors of ``config`` (the configuration a hint
    names) show it decided and not compacted, else ``None`` (hints are only
    shortcuts). Reads first; finishes the instance only if reading alone cannot
    show it."""
    try:
        decided = yield Learn(config, number)
        if decided is None:
            # Reading alone needs a quorum of matching accepts in view; a version
            # decided in the fast round shows fewer once one of the acceptors that
            # accepted it is gone. Finishing the instance -- a Paxos recovery that
            # proposes nothing of its own -- learns it safely.
            decided = yield Finish(config, number)
    except MetasyncError:
        return None
    return decided if decided is not None and decided.number == number else None


def candidates(hints: Iterable[Hint | None], after: int) -> list[Hint]:
    """The hints worth confirming, in the order to try them: each distinct
    ``(number, config)`` above ``after``, newest first."""
    return sorted({h for h in hints if h is not None and h[0] > after}, reverse=True)


def newer_from_hints(own: str, current: str, after: int) -> Follow[Version | None]:
    """The newest version numbered above ``after`` that some reachable backend's
    ``latest`` hint names and a quorum of the hint's configuration confirms;
    ``None`` if there is none. The hints read are those of every backend of
    ``own`` (the client's configuration) and every acceptor of ``current``."""
    hints = yield ReadHints(own, current)
    for number, config in candidates(hints or (), after):
        decided = yield from confirm(number, config)
        if decided is not None:
            return decided
    return None


def version_from_hints(own: str, current: str, behind: FloorElsewhere) -> Follow[Version]:
    """The newest version at or above the floor of ``behind`` that some backend's
    ``latest`` hint names and the acceptors of the hint's configuration confirm;
    :class:`BackendError` (transient) naming ``behind`` if none can be confirmed.
    A version below the floor would only lead back to it."""
    found = yield from newer_from_hints(own, current, behind.floor - 1)
    if found is None:
        raise BackendError(f"{behind}, and no backend's latest-version hint could be "
                           "confirmed; retry, or clone the repository again", transient=True)
    return found


def start(hint: Hint | None, known: Version) -> Follow[Version | None]:
    """Where a fresh clone starts: the version its entry backend's ``hint`` names,
    once that version's acceptors confirm it (learning from version 0 would need
    the first configuration's backends, which may be long gone); ``None`` -- stay
    at ``known`` -- if there is no hint, it is not ahead of the next instance, or it
    cannot be confirmed."""
    if hint is None or hint[0] <= known.number + 1:
        return None
    return (yield from confirm(*hint))
