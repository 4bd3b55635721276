"""``metasync forget`` (docs/retention.md): restic's keep rules as the repository's
retention policy."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import click

from metasync.cli_common import _echo_json, _open, _say, json_option
from metasync.errors import UsageError
from metasync.retention import MAX_COUNT, RULES, UNLIMITED, Policy, commit_datetime

if TYPE_CHECKING:  # gc and the rest of maintenance load when `forget` runs (start-up time)
    from metasync.maintenance.forget import ForgetPlan


def _count(option: str, raw: str | None) -> int:
    """A rule's count: 0..MAX_COUNT or ``unlimited`` (restic's -1)."""
    if raw is None:
        return 0
    if raw.strip().lower() == "unlimited":
        return UNLIMITED
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if not 0 <= value <= MAX_COUNT:
        raise UsageError(f"--keep-{option} takes a count from 0 to {MAX_COUNT} or "
                         f"'unlimited', not {raw!r}")
    return value


def _when(time_ns: int) -> str:
    return commit_datetime(time_ns, None).strftime("%Y-%m-%d %H:%M:%S")


def _print_plan(plan: ForgetPlan, dry_run: bool) -> None:
    for row in plan.rows:
        what = "gone  " if row.collected else "keep  " if row.reasons else "forget"
        number = f"v{row.version}" if row.version is not None else "v?"
        why = f"  ({', '.join(row.reasons)})" if row.reasons else ""
        if row.collected:
            why += "  (an earlier gc collected its files)"
        # A commit's message is untrusted: its first line, printable characters only.
        first = row.message.splitlines()[0] if row.message.strip() else ""
        message = "".join(c if c.isprintable() else "?" for c in first[:80])
        click.echo(f"{what} {row.commit_id[:12]} {number:>6} {_when(row.time_ns)}  "
                   f"{message}{why}")
    verb = "would forget" if dry_run else "the policy forgets"
    _say(f"{verb} {len(plan.forgotten)} of {len(plan.rows)} versions "
         "(gc collects what only they use)")
    gone = sum(1 for row in plan.rows if row.collected)
    if gone:
        _say(f"{gone} versions are gone already: an earlier gc collected their files, "
             "and no policy brings them back")
    if plan.retention_days:
        _say(f"note: versions younger than {plan.retention_days} days stay whatever the policy "
             "says (`metasync config retention 0` leaves it to the policy)")


_UNITS = {"last": "", "hourly": "hours", "daily": "days", "weekly": "weeks (ISO)",
          "monthly": "months", "yearly": "years"}


def _options(f: Callable[..., None]) -> Callable[..., None]:
    """One ``--keep-RULE N`` option per rule, in restic's order."""
    for rule in reversed(RULES):
        text = ("Keep the N newest versions" if rule == "last" else
                f"Keep the newest version of each of the last N {_UNITS[rule]} that have one")
        f = click.option(f"--keep-{rule}", rule, metavar="N",
                         help=f"{text} ('unlimited': all).")(f)
    return f


@click.command()
@_options
@click.option("--dry-run", "-n", is_flag=True,
              help="List which versions would be forgotten and why each other is kept; "
                   "change nothing.")
@click.option("--prune", is_flag=True, help="Run gc right after storing the policy.")
@click.option("--show", is_flag=True, help="Print the stored policy and exit.")
@click.option("--clear", is_flag=True,
              help="Drop the stored policy (only the retention in days and snapshots remain).")
@json_option
def forget(dry_run: bool, prune: bool, show: bool, clear: bool, as_json: bool,
           **counts: str | None) -> None:
    """Keep versions by restic's --keep-* rules; gc collects what only the others use.

    The policy is stored in the repository and every later gc, by any client,
    applies it. The newest version, snapshots and versions younger than `config
    retention` are always kept (docs/retention.md)."""
    policy = Policy(**{rule: _count(rule, counts[rule]) for rule in RULES})
    with _open(read_only=dry_run or show) as repo:
        if show:
            stored = repo.retention.policy()
            _say(f"retention policy: {stored.describe() if stored else 'none'}")
            return
        if clear:
            if not policy.empty():
                raise UsageError("--clear takes no --keep-* rule")
            version = repo.retention.store(None)
            _say("retention policy cleared" + (f"; now version {version.number}" if version
                                               else " (there was none)"))
            return
        if policy.empty():
            raise UsageError("no keep rule given: pass at least one of --keep-last, "
                             "--keep-hourly, --keep-daily, --keep-weekly, --keep-monthly, "
                             "--keep-yearly (nothing was forgotten)")
        plan = repo.retention.plan(policy)
        if as_json:
            _echo_json({"policy": policy.to_json(), "dry_run": dry_run, "versions": [
                {"commit": r.commit_id, "version": r.version, "keep": list(r.reasons),
                 "collected": r.collected}
                for r in plan.rows]})
        else:
            _print_plan(plan, dry_run)
        if dry_run:
            return
        version = repo.retention.store(policy)
        _say(f"retention policy set: {policy.describe()}; "
             + (f"now version {version.number}" if version else "it was already")
             + ("" if prune else "; `metasync gc` collects what only forgotten versions use"))
        if prune:
            report = repo.gc()
            _say("nothing to collect" if report.version is None else
                 f"collected {report.deleted} object copies; now version {report.version.number}")
