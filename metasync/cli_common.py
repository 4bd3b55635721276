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
            return passphrase_text(env, "METASYNC_PASSPHRASE")
        if env == "" and not passphrase_file:
            raise UsageError("METASYNC_PASSPHRASE is empty: set it to the passphrase, or unset "
                             "it (then --passphrase-file or a prompt is used)")
        if passphrase_file:
            return read_passphrase_file(passphrase_file)
        if not sys.stdin.isatty():
            raise UsageError(
                "this repository is encrypted: set METASYNC_PASSPHRASE or use --passphrase-file"
            )
        value: str = click.prompt("Passphrase", hide_input=True, confirmation_prompt=confirm, err=True)
        return passphrase_text(value, "the passphrase typed")

    return read


def read_passphrase_file(path: str) -> str:
    """The passphrase in file ``path`` (its first line's end dropped); a usage error
    if it cannot be read or is not UTF-8 text."""
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise UsageError(f"cannot read passphrase file {path}: {exc.strerror}") from None
    try:
        return raw.decode("utf-8").rstrip("\r\n")
    except UnicodeDecodeError:
        raise UsageError(f"passphrase file {path} is not UTF-8 text; save the passphrase in it "
                         "as UTF-8") from None


def passphrase_text(passphrase: str, where: str) -> str:
    """``passphrase`` if it is text (a key is derived from its UTF-8 bytes); a usage
    error naming ``where`` it came from if it holds bytes that are not UTF-8 (the
    environment and the terminal hand those over as lone surrogates)."""
    try:
        passphrase.encode("utf-8")
    except UnicodeEncodeError:
        raise UsageError(f"{where} is not UTF-8 text (it holds bytes no character is made "
                         "of); use a passphrase of UTF-8 text") from None
    return passphrase


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


def _set_state(ctx: click.Context, param: click.Parameter, value: Any) -> None:
    """Record a global option wherever it was given (before or after the subcommand)."""
    if param.name == "timeout":
        if value is not None:
            os.environ["METASYNC_TIMEOUT"] = repr(value)
    elif param.name == "bwlimit":
        if value is not None:
            set_bwlimit(value)
    elif value:
        setattr(STATE, str(param.name), True)


def _global_options() -> list[click.Option]:
    """``--debug``, ``-q`` and ``--timeout``: taken by the group and by every command,
    so ``metasync pull -q`` works as ``metasync -q pull`` does."""
    return [
        click.Option(["--debug"], is_flag=True, expose_value=False, callback=_set_state,
                     help="Show tracebacks on errors."),
        click.Option(["-q", "--quiet"], is_flag=True, expose_value=False, callback=_set_state,
                     help="Print nothing but errors."),
        click.Option(["--timeout"], type=click.FloatRange(min=0, min_open=True), default=None,
                     metavar="SECONDS", expose_value=False, callback=_set_state,
                     help="Longest wait for any backend's answer (each connect, read, "
                          "handshake, and a request's retries) and for backends to agree "
                          "(default 30; also METASYNC_TIMEOUT)."),
        click.Option(["--bwlimit"], default=None, metavar="RATE", expose_value=False,
                     callback=_set_state,
                     help="Limit the bytes sent to and read from backends by this process, "
                          "e.g. 2M (MiB/s both ways), 10M:2M (up:down), off, or a "
                          "timetable \"08:00,512k 19:00,10M 23:00,off\" (also "
                          "METASYNC_BWLIMIT; see docs/bwlimit.md)."),
    ]


def _add_global_options(command: click.Command) -> None:
    """Give every command under ``command`` the global options it lacks."""
    if isinstance(command, click.Group):
        for sub in command.commands.values():
            _add_global_options(sub)
        if not command.invoke_without_command:
            return  # a group that also runs alone (daemon, service) takes them too
    taken = {opt for p in command.params for opt in p.opts}
    command.params += [o for o in _global_options() if not taken & set(o.opts)]
    for param in command.params:
        if "--json" in param.opts:
            # ``metasync --json CMD`` as ``metasync CMD --json``: read when CMD's
            # arguments are parsed, after the group's options.
            param.default = lambda: STATE.json
