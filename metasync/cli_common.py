"""What every ``metasync`` command shares: the global options' state, one-line
failures, progress reporters, the passphrase source and opening the repository."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import click

from metasync.backends.bwlimit import ENV as BWLIMIT_ENV
from metasync.backends.bwlimit import LIMITER, parse_bwlimit
from metasync.errors import UsageError
from metasync.names import text_only
from metasync.progress import NullReporter
from metasync.repository import Repository


class _State:
    debug = False
    quiet = False
    #: ``--json`` given before the subcommand (each command also takes it after).
    json = False


STATE = _State()


def set_bwlimit(text: str) -> None:
    """``--bwlimit``: the process's limit from now on, and its subprocesses' (a daemon
    started in the background) through the environment. :class:`UsageError` (one
    line) for bad syntax."""
    LIMITER.configure(parse_bwlimit(text))
    os.environ[BWLIMIT_ENV] = text


def check_bwlimit_env() -> None:
    """Refuse a bad ``METASYNC_BWLIMIT`` before the command starts (else its first
    transfer would)."""
    text = os.environ.get(BWLIMIT_ENV)
    if text is not None:
        LIMITER.configure(parse_bwlimit(text, BWLIMIT_ENV))


def _fail(message: str, code: int = 2) -> NoReturn:
    click.echo(f"metasync: error: {message}", err=True)
    sys.exit(code)


class RichReporter:
    """Progress bars (bytes, rate, ETA) on a terminal's stderr."""

    def __init__(self) -> None:
        from rich.console import Console

        self.console = Console(stderr=True)
        self._progress: Any = None
        self._task: Any = None

    def start(self, label: str, total: int) -> None:
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            Progress,
            TimeRemainingColumn,
            TransferSpeedColumn,
        )

        self.finish()
        if total <= 0:
            return
        self._progress = Progress(
            f"[bold]{label}",
            BarColumn(),
            DownloadColumn(),
            TransferSpeedColumn(),
            TimeRemainingColumn(),
            console=self.console,
            transient=True,
        )
        self._progress.start()
        self._task = self._progress.add_task(label, total=total)

    def advance(self, amount: int) -> None:
        if self._progress is not None:
            self._progress.advance(self._task, amount)

    def finish(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

    def note(self, message: str) -> None:
        # Notes quote file names: a name like "[/x]" is text, not rich markup.
        self.console.print(message, markup=False, highlight=False)


class PlainReporter(NullReporter):
    """No bars; notes go to stderr unless ``--quiet``."""

    def note(self, message: str) -> None:
        if not STATE.quiet:
            click.echo(message, err=True)


def _reporter() -> RichReporter | PlainReporter:
    if not STATE.quiet and sys.stderr.isatty():
        return RichReporter()
    return PlainReporter()


def _say(message: str) -> None:
    if not STATE.quiet:
        click.echo(message)


def _passphrase_source(passphrase_file: str | None, confirm: bool) -> Callable[[], str]:
    def read() -> str:
        env = os.environ.get("METASYNC_PASSPHRASE")
        if env:
            return env
        if env == "" and not passphrase_file:
            raise UsageError("METASYNC_PASSPHRASE is empty: set it to the passphrase, or unset "
                             "it (then --passphrase-file or a prompt is used)")
        if passphrase_file:
            try:
                return Path(passphrase_file).read_text().rstrip("\r\n")
            except OSError as exc:
                raise UsageError(f"cannot read passphrase file {passphrase_file}: {exc.strerror}") from None
        if not sys.stdin.isatty():
            raise UsageError(
                "this repository is encrypted: set METASYNC_PASSPHRASE or use --passphrase-file"
            )
        value: str = click.prompt("Passphrase", hide_input=True, confirmation_prompt=confirm, err=True)
        return value

    return read


def _open(read_only: bool = False) -> Repository:
    """The repository of the current folder; ``read_only`` for a command that changes
    nothing: it runs while a push or the daemon holds the folder."""
    return Repository.open(Path.cwd(), reporter=_reporter(), read_only=read_only)


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


json_option = click.option(
    "--json", "as_json", is_flag=True,
    help="Machine-readable output (one JSON document; see docs/cli.md).")


def _echo_json(doc: Any) -> None:
    """Print ``doc`` as JSON. A string that is not valid UTF-8 (a file name's raw
    bytes) is given in its quoted display form, which
    :func:`metasync.names.parse_display_path` turns back into the bytes: no lone
    surrogate is ever emitted."""
    click.echo(json.dumps(text_only(doc), indent=2))
