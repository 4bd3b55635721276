"""``metasync key``: the passphrases that open a repository (like restic's keys).

``list`` shows every key slot (label, date, this device's marked); ``add``
writes a slot for a new passphrase; ``remove`` takes one away from every
backend; ``passwd`` changes this device's passphrase. The new passphrase comes
from ``METASYNC_NEW_PASSPHRASE``, ``--new-passphrase-file`` or a prompt.
"""

from __future__ import annotations

import json
import os
import sys

import click

from metasync.cli_common import _open, _say, passphrase_text, read_passphrase_file
from metasync.errors import UsageError

new_passphrase_option = click.option(
    "--new-passphrase-file", type=click.Path(dir_okay=False),
    help="Read the new passphrase from this file (else METASYNC_NEW_PASSPHRASE, else a prompt).")


def _new_passphrase(path: str | None) -> str:
    """The new passphrase from its source; a clean error if there is none or it is empty."""
    value = passphrase_text(os.environ.get("METASYNC_NEW_PASSPHRASE", ""),
                            "METASYNC_NEW_PASSPHRASE")
    if not value and path:
        value = read_passphrase_file(path)
    if not value and not path:
        if not sys.stdin.isatty():
            raise UsageError("give the new passphrase: set METASYNC_NEW_PASSPHRASE or use "
                             "--new-passphrase-file")
        value = passphrase_text(
            click.prompt("New passphrase", hide_input=True, confirmation_prompt=True, err=True),
            "the passphrase typed")
    if not value:
        raise UsageError("the new passphrase is empty")
    return value


def _warn_missed(missed: list[str]) -> None:
    if missed:
        click.echo(f"metasync: warning: not written to {'; '.join(missed)}; run the command "
                   "again when they can be reached", err=True)


@click.group("key")
def key() -> None:
    """Manage the passphrases (key slots) that open this repository."""


@key.command("list")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def key_list(as_json: bool) -> None:
    """Show every key slot: id, label, date; * marks this device's."""
    with _open() as repo:
        slots = repo.key_slots().list()
    if as_json:
        click.echo(json.dumps([s.__dict__ for s in slots], indent=2))
        return
    for s in slots:
        flag = "" if s.vouched else "  NOT VOUCHED FOR (planted on a backend?): remove it"
        click.echo(f"{'*' if s.mine else ' '} {s.slot}  {s.created or '-':20}  {s.label}{flag}")


@key.command("add")
@click.option("--label", default=None, help="Who or what this passphrase is for (default: "
              "this device's name); shown by `metasync key list`.")
@new_passphrase_option
def key_add(label: str | None, new_passphrase_file: str | None) -> None:
    """Add a passphrase (one per person or device) that opens this repository."""
    phrase = _new_passphrase(new_passphrase_file)
    with _open() as repo:
        report = repo.key_slots().add(phrase, label)
    _warn_missed(report.unreachable)
    _say(f"Added key slot {report.slot}")


@key.command("remove")
@click.argument("slot")
@click.option("--force", is_flag=True, help="Also remove this device's own slot.")
def key_remove(slot: str, force: bool) -> None:
    """Remove key slot SLOT from every backend: its passphrase opens nothing after.
    Keys it already opened stay valid until `metasync key rotate`."""
    with _open() as repo:
        report = repo.key_slots().remove(slot, force)
    _warn_missed(report.unreachable)
    _say(f"Removed key slot {report.slot}; rotate the keys (metasync key rotate) if its "
         "passphrase or a device that used it may have leaked")


@key.command("passwd")
@new_passphrase_option
def key_passwd(new_passphrase_file: str | None) -> None:
    """Change this device's passphrase on every backend."""
    phrase = _new_passphrase(new_passphrase_file)
    with _open() as repo:
        report = repo.key_slots().passwd(phrase)
    _warn_missed(report.unreachable)
    _say(f"Changed the passphrase of key slot {report.slot}")


@key.command("rotate")
def key_rotate() -> None:
    """Give the repository a new data key, re-encrypt everything under it and retire
    the old one (after `key remove`, when a passphrase or a device may have leaked).
    Safe to interrupt: run it again to finish."""
    with _open() as repo:
        report = repo.rotate_keys(progress=_say)
    if report.notes:
        click.echo(f"metasync: warning: {report.notes}", err=True)
    if not report.retired:
        left = [*report.left[:3], *(f"{b}: {why}" for b, why in report.unreachable.items())]
        raise UsageError(
            f"key epoch {report.epoch} is in use but {len(report.left)} stored item(s) are still "
            f"under an older key ({'; '.join(left[:3])}); run `metasync key rotate` again once "
            "every backend answers")
    _say(f"Rotated the repository's key: data key epoch {report.epoch}, {report.rewritten} "
         f"stored item(s) re-encrypted, older keys retired; sealed to key slots "
         f"{', '.join(report.slots)}")
