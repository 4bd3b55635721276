"""Retention policies: which versions ``gc`` keeps (``metasync forget``, docs/retention.md).

Pure: no I/O, no clock. :func:`choose` is restic's ``ApplyPolicy``
(``internal/data/snapshot_policy.go``) for ``--keep-last/-hourly/-daily/-weekly/
-monthly/-yearly``: versions newest first, each rule walks them with its own
counter and keeps a version whenever it starts a bucket (hour, day, ISO week,
month, year; ``last``: every version) not seen yet, until the counter is spent;
a rule with count left when the walk reaches the oldest version keeps that one
too ("oldest"). A version kept by several rules is kept once, with every reason.
A count of -1 is restic's ``unlimited``.

:func:`decide` applies a policy to a repository's history: the versions it ranks
are master's first-parent line without the commits that changed nothing (gc's);
the newest of them, the snapshots and everything inside the retention window are
kept whatever the policy says. ``gc`` keeps the content of what :func:`decide`
keeps; ``forget --dry-run`` prints it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, fields
from datetime import UTC, datetime, tzinfo
from typing import Protocol

#: The rules in restic's order: (field, CLI option).
RULES = ("last", "hourly", "daily", "weekly", "monthly", "yearly")
#: Largest count a stored policy may give (read from untrusted configurations).
MAX_COUNT = 1_000_000
#: restic's ``unlimited``: every bucket.
UNLIMITED = -1
#: The last second a datetime holds in any time zone (9999-12-30, UTC).
_LAST_SECOND = 253_402_128_000


def commit_datetime(time_ns: int, tz: tzinfo | None = UTC) -> datetime:
    """An untrusted commit time (ns since the epoch) as an aware datetime in ``tz``
    (None: the local zone), clamped into what any zone's datetime holds (1970..9999) and
    to whole seconds, so no stored time makes this raise."""
    seconds = min(max(time_ns // 10**9, 0), _LAST_SECOND)
    return datetime.fromtimestamp(seconds, tz).astimezone(tz)


@dataclass(frozen=True)
class Policy:
    """How many of the newest buckets of each kind keep a version (0: rule off)."""

    last: int = 0
    hourly: int = 0
    daily: int = 0
    weekly: int = 0
    monthly: int = 0
    yearly: int = 0

    def empty(self) -> bool:
        """No rule is set: such a policy keeps everything (and is never stored)."""
        return not any(getattr(self, f.name) for f in fields(self))

    def counts(self) -> dict[str, int]:
        """The rules that are set, by name."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name)}

    def describe(self) -> str:
        """As the command line gives it: ``--keep-last 3 --keep-daily 7``."""
        if self.empty():
            return "no retention policy"
        return " ".join(f"--keep-{name} {'unlimited' if n == UNLIMITED else n}"
                        for name, n in self.counts().items())

    def to_json(self) -> dict[str, int]:
        """The stored form: only the rules that are set (docs/FORMAT.md, config)."""
        return self.counts()

    @classmethod
    def from_json(cls, raw: object) -> Policy:
        """A policy read from the shared configuration, which nothing trusts: an
        object of known rule names to integers in ``-1..MAX_COUNT``; ValueError
        if not."""
        if not isinstance(raw, dict) or not set(raw) <= set(RULES):
            raise ValueError("malformed retention policy")
        for value in raw.values():
            if (not isinstance(value, int) or isinstance(value, bool)
                    or not UNLIMITED <= value <= MAX_COUNT):
                raise ValueError("retention policy count out of range")
        return cls(**raw)


@dataclass(frozen=True)
class Choice:
    """What a policy keeps: version -> the rules that keep it (in restic's rule
    order; ``"oldest daily"`` for the oldest kept by a rule with count left), and
    the versions it forgets, newest first."""

    keep: dict[str, tuple[str, ...]]
    forget: list[str]


def _bucket(rule: str) -> Callable[[datetime, int], int]:
    """restic's bucket keys: ``always`` (the position), ``ymdh``, ``ymd``, ``yw``
    (ISO year and week), ``ym``, ``y``."""
    return {
        "last": lambda d, nr: nr,
        "hourly": lambda d, nr: d.year * 1000000 + d.month * 10000 + d.day * 100 + d.hour,
        "daily": lambda d, nr: d.year * 10000 + d.month * 100 + d.day,
        "weekly": lambda d, nr: d.isocalendar()[0] * 100 + d.isocalendar()[1],
        "monthly": lambda d, nr: d.year * 100 + d.month,
        "yearly": lambda d, nr: d.year,
    }[rule]


def choose(versions: Sequence[tuple[str, int]], policy: Policy,
           tz: tzinfo = UTC) -> Choice:
    """Apply ``policy`` to ``versions`` (``(id, time in ns since the epoch)``, any
    order; equal times keep their given order, as restic's stable sort does) in
    time zone ``tz`` (default UTC: every client of a repository must bucket alike,
    or two gcs in different zones each forget what the other keeps; restic uses the
    local zone). An empty policy keeps everything (restic's command refuses it; so
    does ``metasync forget``)."""
    ordered = sorted(versions, key=lambda v: -v[1])
    if policy.empty():
        return Choice({vid: ("no policy",) for vid, _ in ordered}, [])
    left = {rule: getattr(policy, rule) for rule in RULES}
    last: dict[str, int | None] = dict.fromkeys(RULES)
    keep: dict[str, tuple[str, ...]] = {}
    forget: list[str] = []
    oldest = len(ordered) - 1
    for nr, (vid, time_ns) in enumerate(ordered):
        # Whole seconds, as restic's snapshot times bucket them; a commit's time is
        # untrusted: clamped into what datetime can hold.
        when = commit_datetime(time_ns, tz)
        reasons: list[str] = []
        for rule in RULES:
            if left[rule] == 0:
                continue
            val = _bucket(rule)(when, nr)
            if val != last[rule] or nr == oldest:
                reasons.append(f"oldest {rule}" if val == last[rule] else rule)
                last[rule] = val
                if left[rule] > 0:
                    left[rule] -= 1
        if reasons:
            keep[vid] = tuple(reasons)
        else:
            forget.append(vid)
    return Choice(keep, forget)


class CommitLike(Protocol):
    """What :func:`decide` reads of a commit (:class:`metasync.objects.Commit`)."""

    @property
    def tree(self) -> str: ...

    @property
    def parents(self) -> tuple[str, ...]: ...

    @property
    def time_ns(self) -> int: ...


def ranked_versions(master: str, history: Mapping[str, CommitLike]) -> list[str]:
    """The versions a policy ranks, newest first: master's first-parent line (the
    versions master went through; a merge's first parent is the version it merged
    into) without the commits whose tree is their first parent's (a gc's commit
    changes nothing: it must not take a ``--keep-last`` place). Stops where
    ``history`` does."""
    line: list[str] = []
    current: str | None = master
    while current is not None and current in history:
        commit = history[current]
        parent = commit.parents[0] if commit.parents else None
        if parent is None or parent not in history or history[parent].tree != commit.tree:
            line.append(current)
        current = parent
    return line


@dataclass(frozen=True)
class Decision:
    """Which commits of a history keep their content, and why."""

    #: Commit id -> reasons: the policy's rules, ``latest``, ``snapshot NAME``,
    #: ``within retention``, ``master`` (a gc's commit on top of the latest version).
    keep: dict[str, tuple[str, ...]]
    #: Ranked versions no reason keeps, newest first.
    forget: list[str]
    #: Every ranked version, newest first.
    ranked: list[str]


def decide(master: str, history: Mapping[str, CommitLike], policy: Policy | None,
           snapshots: Iterable[tuple[str, str]], cutoff_ns: int,
           tz: tzinfo = UTC) -> Decision:
    """What gc keeps of ``history`` (every commit reachable from ``master``):
    master and the newest ranked version (:func:`ranked_versions`), each
    snapshot, every commit at or after ``cutoff_ns`` (the retention window), and
    the ranked versions ``policy`` keeps (:func:`choose`, in ``tz``: UTC for every
    client, never the local zone). Without a policy every
    ranked version is kept unless it is older than the window (the retention in
    days alone decides, as before policies existed)."""
    ranked = ranked_versions(master, history)
    keep: dict[str, list[str]] = {}

    def add(cid: str, why: str) -> None:
        keep.setdefault(cid, []).append(why)

    if policy is not None and not policy.empty():
        chosen = choose([(cid, history[cid].time_ns) for cid in ranked], policy, tz)
        for cid, reasons in chosen.keep.items():
            for why in reasons:
                add(cid, why)
    if ranked:
        add(ranked[0], "latest")
    if master not in ranked:
        add(master, "master")
    for name, cid in snapshots:
        if cid in history:
            add(cid, f"snapshot {name}")
    for cid, commit in history.items():
        if commit.time_ns >= cutoff_ns:
            add(cid, "within retention")
    forget = [cid for cid in ranked if cid not in keep]
    return Decision({cid: tuple(why) for cid, why in keep.items()}, forget, ranked)
