"""``metasync auth`` (cloud sign-ins) and ``metasync daemon`` (the background
service): the commands that manage this computer rather than the repository."""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import click

from metasync.cli_common import _open, _say
from metasync.errors import UsageError


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


@click.command(help=_auth_help())
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
    with _open(read_only=True) as repo:
        return repo.root


@click.group(invoke_without_command=True)
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
        pid = running_pid(root)
        raise UsageError(f"a metasync daemon already runs for {root} (pid {pid})" if pid else
                         f"a metasync daemon already runs for {root} (the service runs it; "
                         "see `metasync folders`)")
    args = [sys.executable, "-m", "metasync.cli", "daemon", "--settle", repr(settle),
            "--poll", repr(poll), "--rescan", repr(rescan), "--delete-share", repr(delete_share)]
    with open(root / ".metasync" / LOG_FILE, "ab") as log:
        # Detached from this terminal, so closing it does not stop the daemon.
        if sys.platform == "win32":
            proc = subprocess.Popen(args, cwd=root, stdin=subprocess.DEVNULL, stdout=log,
                                    stderr=log, creationflags=subprocess.DETACHED_PROCESS
                                    | subprocess.CREATE_NEW_PROCESS_GROUP)
        else:
            proc = subprocess.Popen(args, cwd=root, stdin=subprocess.DEVNULL, stdout=log,
                                    stderr=log, start_new_session=True)
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
    """Stop the background daemon (its transfers in progress stop; what was
    uploaded is kept)."""
    import signal

    from metasync.daemon import daemon_running, running_pid

    root = _repo_root()
    pid = running_pid(root)
    if pid is None and daemon_running(root):
        raise UsageError(f"the metasync service runs {root}; stop it there with "
                         "`metasync remove-folder`, or stop the service")
    if pid is None:
        _say("no metasync daemon runs for this folder")
        return
    # On Windows this is TerminateProcess: the daemon stops at once, mid-step, as
    # after a crash (what it uploaded is kept; the next sync goes on from there).
    os.kill(pid, signal.SIGTERM)
    deadline = datetime.now().timestamp() + 60
    while daemon_running(root) and datetime.now().timestamp() < deadline:
        if sys.platform != "win32":
            try:
                os.waitpid(pid, os.WNOHANG)  # reap it if it is our child (tests)
            except ChildProcessError:
                pass
        time.sleep(0.1)  # polling another process's lock: nothing to wait on
    if daemon_running(root):
        raise UsageError(f"the daemon (pid {pid}) did not stop within 60 s; kill it if needed")
    _say(f"metasync daemon stopped (pid {pid})")


@daemon.command("status")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def daemon_status(as_json: bool) -> None:
    """Show the daemon's state, last sync, pending changes, conflicts, backends."""
    from metasync.daemon import read_status
    from metasync.ownership import find_root

    found = find_root(Path.cwd())  # the ownership check of every command
    if found is None:
        raise UsageError(f"{Path.cwd()} is not inside a metasync repository")
    doc = read_status(found)
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
    for line in doc.get("unreadable", []):
        click.echo(f"cannot read: {line}")
    for line in doc.get("skipped", []):
        click.echo(f"skipped:     {line}")


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
    """Run the daemon for this folder from logon on: a systemd user unit on Linux, a
    launchd agent on macOS, a Task Scheduler logon task on Windows; started now.
    (For every folder in one process: `metasync service install`, docs/app.md.)"""
    from metasync.service import install

    _say(install(_repo_root()))


@click.command("install")
def service_install() -> None:
    """Run `metasync service` (every folder added with `metasync add-folder`) from
    logon on: one systemd user unit on Linux, a launchd agent on macOS, a Task
    Scheduler logon task on Windows; started now (docs/app.md)."""
    from metasync.service import install_app

    _say(install_app())
