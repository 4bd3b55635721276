"""The ``metasync`` command: a thin layer over :class:`metasync.Repository`.

Every failure the user can cause ends in one line on stderr and a non-zero exit;
a traceback appears only with ``--debug``.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any, NoReturn

import click

from metasync.errors import MetasyncError, UsageError
from metasync.repository import DEFAULT_NAMESPACE, Repository


class _State:
    debug = False
    quiet = False


STATE = _State()


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
        self.console.print(message)


class PlainReporter:
    """No bars; notes go to stderr unless ``--quiet``."""

    def start(self, label: str, total: int) -> None:
        pass

    def advance(self, amount: int) -> None:
        pass

    def finish(self) -> None:
        pass

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


def _open() -> Repository:
    return Repository.open(Path.cwd(), reporter=_reporter())


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--debug", is_flag=True, help="Show tracebacks on errors.")
@click.option("-q", "--quiet", is_flag=True, help="Print nothing but errors.")
@click.option("--timeout", type=click.FloatRange(min=0, min_open=True), default=None,
              metavar="SECONDS",
              help="Longest wait for backends to agree before failing (default 30; "
                   "also METASYNC_TIMEOUT).")
@click.version_option(package_name="metasync")
def cli(debug: bool, quiet: bool, timeout: float | None) -> None:
    """Keep one folder in sync across several untrusted storage services."""
    STATE.debug = debug
    STATE.quiet = quiet
    if timeout is not None:
        os.environ["METASYNC_TIMEOUT"] = repr(timeout)


mkdir_option = click.option(
    "--mkdir", is_flag=True,
    help="Create a missing dir: folder (refused otherwise: a missing local folder is "
         "usually an unmounted disk). WebDAV and SFTP folders are always created.",
)

passphrase_file_option = click.option(
    "--passphrase-file",
    type=click.Path(dir_okay=False),
    help="Read the passphrase from this file (else METASYNC_PASSPHRASE, else a prompt).",
)


@cli.command()
@click.argument("directory", required=False, default=".")
@click.option("--backend", "backends", multiple=True, metavar="URI",
              help="A storage location, e.g. dir:/mnt/usb/sync. Repeat for each backend.")
@click.option("--replicas", type=int, default=None, help="Copies of each object (default 2, or 1 with one backend).")
@click.option("--namespace", default=DEFAULT_NAMESPACE, show_default=True,
              help="Folder name of this repository on every backend.")
@click.option("--no-encrypt", is_flag=True, help="Store objects unencrypted (not recommended).")
@click.option("--bft", is_flag=True,
              help="Tolerate backends that lie about their logs (needs 4+ backends: 3f+1).")
@click.option("--erasure", default=None, metavar="K/N",
              help="Store objects of 1 MiB or more as N fragments on N backends, any K of "
                   "which rebuild them (e.g. 2/3: 1.5x storage, survives losing one backend).")
@mkdir_option
@passphrase_file_option
def init(directory: str, backends: tuple[str, ...], replicas: int | None, namespace: str,
         no_encrypt: bool, bft: bool, erasure: str | None, mkdir: bool,
         passphrase_file: str | None) -> None:
    """Create a repository in DIRECTORY on the given backends."""
    if not backends:
        raise UsageError("give at least one --backend URI, e.g. --backend dir:/mnt/usb/sync")
    scheme = None
    if erasure is not None:
        from metasync.erasure import ErasureScheme

        parsed = ErasureScheme.parse(erasure)
        scheme = (parsed.k, parsed.n)
    # Small objects of an erasure-coded repository are copied as often as it may
    # lose backends plus one (N - K + 1), so both survive the same losses.
    default_r = scheme[1] - scheme[0] + 1 if scheme else min(2, len(backends))
    r = replicas if replicas is not None else min(default_r, len(backends))
    repo = Repository.init(
        directory, list(backends), replicas=r, namespace=namespace, encrypt=not no_encrypt,
        byzantine=bft, erasure=scheme,
        passphrase=None if no_encrypt else _passphrase_source(passphrase_file, confirm=True),
        reporter=_reporter(), mkdir=mkdir,
    )
    with repo:
        layout = f"{r} replica(s)" + (f", erasure {erasure} from 1 MiB" if scheme else "")
        _say(f"Initialized metasync repository in {repo.root} on {len(backends)} backend(s), "
             f"{layout}, {'encrypted' if not no_encrypt else 'NOT encrypted'}")


@cli.command()
@click.argument("uri")
@click.argument("directory", required=False)
@click.option("--namespace", default=DEFAULT_NAMESPACE, show_default=True)
@passphrase_file_option
def clone(uri: str, directory: str | None, namespace: str, passphrase_file: str | None) -> None:
    """Rebuild a repository from any one of its backends (URI) into DIRECTORY."""
    target = directory or namespace
    repo = Repository.clone(uri, target, namespace=namespace,
                            passphrase=_passphrase_source(passphrase_file, confirm=False),
                            reporter=_reporter())
    with repo:
        _say(f"Cloned version {repo.prev.number} into {repo.root}")


@cli.command()
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def status(as_json: bool) -> None:
    """Show changes in the folder that are not committed yet."""
    with _open() as repo:
        st = repo.status()
    if as_json:
        click.echo(json.dumps(st.to_json(), indent=2))
        return
    _say(f"On version {st.version}" + (" (local commits not pushed)" if st.unpushed else ""))
    if not st.changes:
        _say("Nothing to commit, folder clean")
    symbols = {"added": "A", "modified": "M", "deleted": "D"}
    for c in st.changes:
        suffix = "/" if c.type == "dir" else ""
        _say(f"  {symbols[c.kind]} {c.path}{suffix}")


@cli.command()
@click.option("-m", "--message", default="", help="Commit message.")
def commit(message: str) -> None:
    """Record the folder's changes as a local commit."""
    with _open() as repo:
        result = repo.commit(message)
    if result is None:
        _say("Nothing to commit")
    else:
        _say(f"Committed {result.commit_id[:12]} ({sum(result.new_objects.values())} new objects)")


@cli.command()
@click.option("-m", "--message", default="", help="Message for the commit of pending changes.")
def push(message: str) -> None:
    """Commit pending changes and publish them as the new master."""
    with _open() as repo:
        result = repo.push(message)
    for copy in result.conflicts:
        _say(f"conflict: kept the other version as {copy}")
    if result.up_to_date:
        _say("Everything up to date")
    elif result.version is not None:
        _say(f"Pushed version {result.version.number}: {result.objects_uploaded} objects, "
             f"{_human(result.bytes_uploaded)} uploaded")
    if result.missing_copies:
        click.echo(f"warning: {result.missing_copies} object copies could not be written "
                   "(a backend is unreachable); the next push retries them", err=True)


@cli.command()
def pull() -> None:
    """Bring the latest master into the folder."""
    with _open() as repo:
        result = repo.pull()
    if result.up_to_date:
        _say("Already up to date")
    else:
        _say(f"Updated to version {result.version.number}: {result.written} written, "
             f"{result.deleted} deleted, {len(result.conflicts)} conflict copies")


@cli.command()
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("-n", "--limit", type=int, default=None, help="Show at most this many commits.")
def log(as_json: bool, limit: int | None) -> None:
    """Show the history, newest first."""
    with _open() as repo:
        entries = repo.log(limit)
    if as_json:
        click.echo(json.dumps([e.to_json() for e in entries], indent=2))
        return
    for e in entries:
        when = datetime.fromtimestamp(e.time_ns / 1e9).strftime("%Y-%m-%d %H:%M:%S")
        click.echo(f"commit {e.commit_id}\nDevice: {e.device}\nDate:   {when}\n\n    {e.message or '(no message)'}\n")


@cli.command()
@click.option("--quick", is_flag=True, help="Only check that every copy is there (no download).")
@click.option("--repair", is_flag=True, help="Re-create missing or corrupt copies from good ones.")
def fsck(quick: bool, repair: bool) -> None:
    """Verify every copy of every object reachable from master on every backend."""
    with _open() as repo:
        report = repo.fsck(quick=quick, repair=repair)
        names = {p.backend: repo.backend_name(p.backend) for p in report.problems}
    fixed = set(report.repaired)
    for p in report.problems:
        where = names.get(p.backend, p.backend)
        if p in fixed:
            _say(f"repaired: {p.problem} {p.kind} {p.object_id} on {where}")
        else:
            click.echo(f"{p.problem}: {p.kind} {p.object_id} on {where}")
    how = "found" if quick else "verified"
    if report.ok:
        extra = f", {len(report.repaired)} repaired" if report.repaired else ""
        _say(f"ok: {report.objects} objects, {report.checked_copies} copies {how}{extra}")
        return
    left = len(report.problems) - len(fixed)
    hint = "" if repair else "; `metasync fsck --repair` re-creates them from good copies"
    click.echo(f"{left} problem(s) in {report.checked_copies} copies checked; see above{hint}",
               err=True)
    sys.exit(1)


# ============================================================== storage changes
def _report_change(what: str, change: Any) -> None:
    r = change.report
    ratio = f", {r.copied / r.minimum:.2f}x" if r.minimum else ""
    _say(f"{what}; now version {change.version.number}")
    _say(f"moved {r.copied} object copies ({_human(r.bytes_copied)}; theoretical minimum "
         f"{r.minimum}{ratio}), dropped {r.dropped} no longer needed")
    _warn_leftovers(r)


def _warn_leftovers(r: Any) -> None:
    if r.lost:
        click.echo(f"warning: {len(r.lost)} object(s) have no good copy on any reachable "
                   "backend", err=True)
    if r.kept:
        click.echo(f"warning: kept {r.kept} copies that are no longer needed (a backend was "
                   "unreachable or too few copies were verified); run `metasync rebalance` later",
                   err=True)
    for backend, why in sorted(r.unreachable.items()):
        click.echo(f"note: could not list {backend}: {why}", err=True)


@cli.group()
def backend() -> None:
    """Add, remove, resize and list the repository's backends."""


@backend.command("add")
@click.argument("uri")
@click.option("--capacity", type=float, default=None, metavar="GB",
              help="Its capacity; objects are spread in proportion (default: the others' mean).")
@mkdir_option
def backend_add(uri: str, capacity: float | None, mkdir: bool) -> None:
    """Add the storage location URI; move to it the copies it should hold."""
    with _open() as repo:
        change = repo.add_backend(uri, capacity, mkdir)
        added = next(b for b in change.new.backends if b.id not in change.old.backend_ids)
    _report_change(f"added backend {added.id} ({added.uri})", change)


@backend.command("remove")
@click.argument("name")
def backend_remove(name: str) -> None:
    """Remove backend NAME (its id or URI), keeping every object on the others."""
    with _open() as repo:
        change = repo.remove_backend(name)
        removed = next(b for b in change.old.backends if b.id not in change.new.backend_ids)
    _report_change(f"removed backend {removed.id} ({removed.uri})", change)


@backend.command("resize")
@click.argument("name")
@click.argument("capacity", type=float)
def backend_resize(name: str, capacity: float) -> None:
    """Set backend NAME's capacity to CAPACITY GB."""
    with _open() as repo:
        change = repo.resize_backend(name, capacity)
    _report_change(f"resized backend {name} to {capacity:g} GB", change)


@backend.command("list")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def backend_list(as_json: bool) -> None:
    """Each backend: id, URI, capacity, objects and bytes held, health."""
    with _open() as repo:
        listing = repo.backend_list()
    if as_json:
        click.echo(json.dumps(listing.to_json(), indent=2))
        return
    click.echo(f"{'ID':<10} {'CAPACITY':>8} {'SHARE':>6} {'OBJECTS':>8} {'BYTES':>10}  {'HEALTH':<8} URI")
    for b in listing.backends:
        click.echo(f"{b.id:<10} {b.capacity:>8g} {b.share:>6.1%} {b.objects:>8} "
                   f"{_human(b.bytes):>10}  {b.health.split(':')[0]:<8} {b.uri}")
    scheme = (f"erasure {listing.erasure[0]}/{listing.erasure[1]}" if listing.erasure
              else f"{listing.replicas} replica(s)")
    click.echo(f"{listing.objects} objects, {_human(listing.logical_bytes)} of content stored as "
               f"{_human(listing.stored_bytes)} ({listing.overhead:.2f}x, {scheme})")
    if listing.rebalance_pending:
        click.echo("a configuration change was interrupted: run `metasync rebalance`", err=True)
    for b in listing.backends:
        if b.health != "ok":
            click.echo(f"{b.id}: {b.health}", err=True)


@cli.group("config")
def config_group() -> None:
    """Change repository-wide settings (decided with the other clients)."""


@config_group.command("replicas")
@click.argument("replicas", type=int)
def config_replicas(replicas: int) -> None:
    """Keep REPLICAS copies of every object."""
    with _open() as repo:
        change = repo.set_replicas(replicas)
    _report_change(f"replicas set to {replicas}", change)


@config_group.command("retention")
@click.argument("days", type=int)
def config_retention(days: int) -> None:
    """Keep every version DAYS days before gc may collect what only it needs."""
    with _open() as repo:
        version = repo.set_retention(days)
    _say(f"retention set to {days} days; now version {version.number}")


@cli.command()
@click.option("--log-grace", "log_grace_hours", type=click.FloatRange(min=0), default=24.0,
              show_default=True, metavar="HOURS",
              help="Compact the logs of versions decided at least this long ago. Below the "
                   "default, a push suspended for over half of it may have to merge again.")
def gc(log_grace_hours: float) -> None:
    """Delete objects no kept version, snapshot or push in progress needs, and
    compact the agreement logs of old versions."""
    with _open() as repo:
        report = repo.gc(log_grace_s=log_grace_hours * 3600)
    if report.lost_race:
        _say("another client committed meanwhile: nothing was deleted; run `metasync gc` again")
    elif report.version is None:
        _say(f"nothing to collect ({report.objects} objects, all in use)")
    else:
        _say(f"collected {report.deleted} object copies ({_human(report.bytes_deleted)}) of "
             f"{report.objects} objects; {report.pruned_commits} older versions pruned; "
             f"now version {report.version.number}")
    if report.log_floor:
        _say(f"compacted the logs of versions before {report.log_floor} "
             f"({report.logs_removed} log objects removed)")
    if report.failed:
        click.echo(f"warning: {report.failed} copies could not be deleted (a backend is "
                   "unreachable); the next gc retries them", err=True)
    if report.log_compaction_error:
        click.echo(f"warning: log compaction postponed ({report.log_compaction_error}); "
                   "the next gc tries again", err=True)


@cli.command()
@click.argument("name", required=False)
@click.option("--delete", "delete", is_flag=True, help="Delete snapshot NAME instead.")
def snapshot(name: str | None, delete: bool) -> None:
    """Keep the current master as NAME for ever (gc never collects it); without NAME,
    list the snapshots."""
    with _open() as repo:
        if name is None:
            for snap, commit_id in repo.snapshots():
                click.echo(f"{snap}\t{commit_id}")
            return
        version = repo.delete_snapshot(name) if delete else repo.snapshot(name)
    _say(f"{'deleted' if delete else 'kept'} snapshot {name}; now version {version.number}")


@cli.command()
@click.argument("path")
@click.option("--version", "version", default=None, metavar="V",
              help="A commit id prefix (metasync log), a snapshot name, or ~N (N versions back).")
@click.option("--to", "to", default=None, type=click.Path(), metavar="DEST",
              help="Write it here instead of at PATH.")
def restore(path: str, version: str | None, to: str | None) -> None:
    """Bring back PATH (a file or folder) as it was in an earlier version."""
    with _open() as repo:
        rel = os.path.relpath(Path(path).absolute(), repo.root)
        result = repo.restore(rel, version, to)
    when = datetime.fromtimestamp(result.time_ns / 1e9).strftime("%Y-%m-%d %H:%M:%S")
    for copy in result.conflicts:
        _say(f"kept the file that was in the way as {copy}")
    _say(f"restored {len(result.restored)} file(s) to {result.target} from {result.commit_id[:12]} "
         f"({when})")


@cli.command()
def rebalance() -> None:
    """Put every object where the configuration says; finish interrupted changes."""
    with _open() as repo:
        report = repo.rebalance()
    _say(f"{report.objects} objects: copied {report.copied} copies "
         f"({_human(report.bytes_copied)}), dropped {report.dropped}")
    _warn_leftovers(report)


@cli.command()
@click.argument("email")
def share(email: str) -> None:
    """Share the repository folder with EMAIL on every backend that can."""
    with _open() as repo:
        results = repo.share(email)
    manual = 0
    for r in results:
        if r.shared:
            _say(f"shared:  {r.backend}: {r.detail}")
        else:
            manual += 1
            click.echo(f"by hand: {r.backend}: {r.detail}")
    if manual:
        click.echo(f"{manual} of {len(results)} backend(s) need sharing by hand (see above)",
                   err=True)


class ClickAuthUI:
    """``metasync auth`` talking to the terminal: URLs on stdout, codes from stdin."""

    def __init__(self, no_browser: bool) -> None:
        self.no_browser = no_browser

    def show(self, text: str) -> None:
        click.echo(text)

    def open_browser(self, url: str) -> bool:
        if self.no_browser:
            return False
        if sys.platform.startswith("linux") and not (
            os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY")
        ):
            return False  # no desktop: a text browser would take over the terminal
        import webbrowser

        try:
            return webbrowser.open(url)
        except webbrowser.Error:
            return False

    def prompt(self, text: str) -> str:
        click.echo(text, nl=False, err=True)
        line = sys.stdin.readline()
        if not line:
            raise UsageError("no answer on standard input; sign-in cancelled")
        return line.strip()


def _auth_help() -> str:
    from metasync.backends import AUTH_PROVIDERS

    return (f"Sign in to a cloud PROVIDER ({', '.join(sorted(AUTH_PROVIDERS))}) and keep "
            "the grant on this computer (OS keyring, else a private file).")


@cli.command(help=_auth_help())
@click.argument("provider")
@click.option("--account", default="default", show_default=True,
              help="Name for this sign-in; a backend URI selects it with ?account=NAME.")
@click.option("--no-browser", is_flag=True,
              help="Do not open a browser: print the address to visit and read the code.")
@click.option("--app-key", default=None, help="Your own app's key (else METASYNC_<PROVIDER>_APP_KEY).")
@click.option("--app-secret", default=None,
              help="Your own app's secret, if it has one (else METASYNC_<PROVIDER>_APP_SECRET).")
@click.option("--code", default=None, help="An authorization code obtained already.")
def auth(provider: str, account: str, no_browser: bool, app_key: str | None,
         app_secret: str | None, code: str | None) -> None:
    from metasync.backends.cloud import AuthRequest, authorize, endpoint, token_store

    store = token_store()
    request = AuthRequest(provider.lower(), account, app_key, app_secret, no_browser, code,
                          endpoint(provider.lower()))
    grant = authorize(request, ClickAuthUI(no_browser), store)
    who = grant.extra.get("email") or grant.extra.get("account_id") or grant.account
    _say(f"Signed in to {grant.provider} as {who} (account {grant.account!r}); "
         f"the sign-in is kept in {store.where}")


# ============================================================== daemon
def _settings_options(f: Callable[..., Any]) -> Callable[..., Any]:
    f = click.option("--settle", type=click.FloatRange(min=0), default=3.0, show_default=True,
                     help="Quiet seconds after a local change before syncing it.")(f)
    f = click.option("--poll", type=click.FloatRange(min=0.1), default=10.0, show_default=True,
                     help="Seconds between checks of the backends for others' changes.")(f)
    f = click.option("--rescan", type=click.FloatRange(min=1), default=60.0, show_default=True,
                     help="Seconds between full checks, whatever the events say.")(f)
    f = click.option("--delete-share", type=click.FloatRange(0, 1), default=0.5,
                     show_default=True,
                     help="Pause instead of syncing one change that deletes more than this "
                          "share of the files.")(f)
    return f


def _repo_root() -> Path:
    with _open() as repo:
        return repo.root


@cli.group(invoke_without_command=True)
@_settings_options
@click.pass_context
def daemon(ctx: click.Context, settle: float, poll: float, rescan: float,
           delete_share: float) -> None:
    """Keep this folder in sync in the background. Without a subcommand, run in
    the foreground (for systemd or launchd)."""
    if ctx.invoked_subcommand is not None:
        return
    from metasync.daemon import Daemon, Settings

    root = _repo_root()
    code = Daemon(root, Settings(settle, poll, rescan, delete_share)).run()
    sys.exit(code)


@daemon.command("start")
@_settings_options
def daemon_start(settle: float, poll: float, rescan: float, delete_share: float) -> None:
    """Start the daemon in the background (log: .metasync/daemon.log)."""
    import subprocess

    from metasync.daemon import LOG_FILE, daemon_running, running_pid

    root = _repo_root()
    if daemon_running(root):
        raise UsageError(f"a metasync daemon already runs for {root} (pid {running_pid(root)})")
    args = [sys.executable, "-m", "metasync.cli", "daemon", "--settle", repr(settle),
            "--poll", repr(poll), "--rescan", repr(rescan), "--delete-share", repr(delete_share)]
    with open(root / ".metasync" / LOG_FILE, "ab") as log:
        proc = subprocess.Popen(args, cwd=root, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                start_new_session=True)
    # Wait until it holds its pid file (or died), so `status` right after is accurate.
    for _ in range(200):
        if daemon_running(root) or proc.poll() is not None:
            break
        try:
            proc.wait(timeout=0.05)
        except subprocess.TimeoutExpired:
            pass
    if proc.poll() is not None:
        raise UsageError(f"the daemon exited at once (status {proc.returncode}); "
                         f"see {root / '.metasync' / LOG_FILE}")
    _say(f"metasync daemon started for {root} (pid {proc.pid})")


@daemon.command("stop")
def daemon_stop() -> None:
    """Stop the background daemon after its current step."""
    import signal

    from metasync.daemon import daemon_running, running_pid

    root = _repo_root()
    pid = running_pid(root)
    if pid is None:
        _say("no metasync daemon runs for this folder")
        return
    os.kill(pid, signal.SIGTERM)
    deadline = datetime.now().timestamp() + 60
    while daemon_running(root) and datetime.now().timestamp() < deadline:
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass
        import select

        select.select([], [], [], 0.1)
    if daemon_running(root):
        raise UsageError(f"the daemon (pid {pid}) did not stop within 60 s; kill it if needed")
    _say(f"metasync daemon stopped (pid {pid})")


@daemon.command("status")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def daemon_status(as_json: bool) -> None:
    """Show the daemon's state, last sync, pending changes, conflicts, backends."""
    from metasync.daemon import read_status

    root = Path.cwd()
    for candidate in (root, *root.parents):
        if (candidate / ".metasync").is_dir():
            root = candidate
            break
    else:
        raise UsageError(f"{root} is not inside a metasync repository")
    doc = read_status(root)
    if as_json:
        click.echo(json.dumps(doc, indent=2))
        return
    last = doc.get("last_sync")
    when = datetime.fromtimestamp(last).strftime("%Y-%m-%d %H:%M:%S") if last else "never"
    click.echo(f"state:        {doc.get('state')}" + (f" ({doc['reason']})" if doc.get("reason") else ""))
    click.echo(f"last sync:    {when} (version {doc.get('version', 0)})")
    click.echo(f"pending:      {doc.get('pending_changes', 0)} change(s)"
               + (", local commits not pushed" if doc.get("unpushed") else ""))
    click.echo(f"conflicts:    {len(doc.get('conflicts', []))}")
    for name in doc.get("conflicts", [])[-5:]:
        click.echo(f"  {name}")
    for backend, health in sorted(doc.get("backends", {}).items()):
        click.echo(f"backend:      {backend}: {health}")


@daemon.command("resume")
def daemon_resume() -> None:
    """Let a paused daemon sync what it paused on (e.g. a mass deletion)."""
    from metasync.daemon import RESUME_FILE, daemon_running

    root = _repo_root()
    if not daemon_running(root):
        raise UsageError("no metasync daemon runs for this folder; start it with `metasync daemon start`")
    (root / ".metasync" / RESUME_FILE).write_text("resume\n")
    _say("the daemon will sync the paused change now")


@daemon.command("install-service")
def daemon_install_service() -> None:
    """Write a systemd user unit for this folder and enable it."""
    import hashlib
    import shutil
    import subprocess

    root = _repo_root()
    unit_dir = Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config") / "systemd" / "user"
    name = f"metasync-{hashlib.sha256(str(root).encode()).hexdigest()[:12]}.service"
    exe = Path(sys.executable).with_name("metasync")
    unit = (
        "[Unit]\n"
        f"Description=metasync: keep {root} in sync\n"
        "After=network-online.target\n\n"
        "[Service]\n"
        f"WorkingDirectory={root}\n"
        f"ExecStart={exe if exe.exists() else 'metasync'} daemon\n"
        "Restart=on-failure\n"
        "RestartSec=10\n"
        "KillSignal=SIGTERM\n"
        "TimeoutStopSec=90\n\n"
        "[Install]\n"
        "WantedBy=default.target\n"
    )
    unit_dir.mkdir(parents=True, exist_ok=True)
    tmp = unit_dir / f".{name}.tmp"
    tmp.write_text(unit)
    os.replace(tmp, unit_dir / name)
    systemctl = shutil.which("systemctl")
    if systemctl is None:
        raise UsageError(f"wrote {unit_dir / name}, but systemctl is not available to enable it; "
                         f"run `systemctl --user enable --now {name}` where it is")
    for args in (["daemon-reload"], ["enable", "--now", name]):
        proc = subprocess.run([systemctl, "--user", *args], capture_output=True, text=True)
        if proc.returncode != 0:
            raise UsageError(f"wrote {unit_dir / name}, but `systemctl --user {' '.join(args)}` "
                             f"failed: {proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else proc.returncode}")
    _say(f"installed and started {name} ({unit_dir / name})")


def main() -> None:
    """Console-script entry point."""
    try:
        cli.main(standalone_mode=False)
    except click.exceptions.Abort:
        _fail("aborted", 130)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except MetasyncError as exc:
        if STATE.debug:
            raise
        _fail(str(exc), exc.exit_code)
    except KeyboardInterrupt:
        _fail("interrupted", 130)
    except OSError as exc:
        if STATE.debug:
            raise
        where = f" ({exc.filename})" if exc.filename else ""
        _fail(f"{exc.strerror or exc}{where}; run with --debug for details")
    sys.exit(0)


if __name__ == "__main__":
    main()
