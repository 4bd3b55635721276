"""``metasync service`` (one process for every registered folder, with its web
page) and ``add-folder`` / ``remove-folder`` / ``folders`` (the registry in the
user's config folder): docs/app.md, "The service"."""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
from pathlib import Path
from typing import Any

import click

from metasync.cli_common import _say
from metasync.cli_daemon import _settings_options
from metasync.errors import UsageError


def _registry() -> Any:
    from metasync.app.registry import Registry

    return Registry()


def parse_listen(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:PORT`` for IPv6) as a pair; UsageError otherwise."""
    host, sep, port = text.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise UsageError(f"--listen {text!r}: expected HOST:PORT, e.g. 127.0.0.1:8384")
    return host, int(port)


@click.group(invoke_without_command=True)
@click.option("--listen", metavar="HOST:PORT", default=None,
              help="Where the web page and API listen (default: service.json, else "
                   "127.0.0.1:8384; port 0: any free port).")
@click.option("--failing-after", type=click.FloatRange(min=0), default=300.0,
              show_default=True, help="Seconds a backend fails before a notice.")
@_settings_options
@click.pass_context
def service(ctx: click.Context, listen: str | None, failing_after: float, settle: float,
            poll: float, rescan: float, delete_share: float) -> None:
    """Sync every registered folder (see `metasync folders`) and serve the web page,
    in the foreground (for systemd or launchd) until SIGTERM or Ctrl-C."""
    if ctx.invoked_subcommand is not None:
        return
    from metasync.daemon import Settings

    settings = Settings(settle, poll, rescan, delete_share, failing_after=failing_after)
    run_service(_registry(), settings, parse_listen(listen) if listen else None)


def run_service(registry: Any, settings: Any, listen: tuple[str, int] | None) -> None:
    """The service until SIGTERM/SIGINT: every folder's daemon, and the web server."""
    from metasync.app.fleet import Fleet
    from metasync.app.web import WebServer

    host, port = listen or registry.listen()
    lock_fd = registry.hold_service_lock()
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    app_log = logging.getLogger("metasync.app")
    app_log.addHandler(handler)
    app_log.setLevel(logging.INFO)
    stop = threading.Event()
    # The CLI's signal watcher (a second signal quits at once) is for commands; the
    # service stops at its own pace: each folder finishes or stops its step.
    signal.set_wakeup_fd(-1)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    fleet = Fleet(registry, settings)
    # Every event in the service's own log too (journalctl, launchd's log).
    fleet.events.subscribe(lambda e: app_log.info("event %s %s: %s", e.kind, e.folder or "-",
                                                  e.message))
    web = WebServer(fleet, registry, host, port)
    try:
        fleet.start()
        try:
            web.start()
        except OSError as exc:
            raise UsageError(f"cannot listen on {host}:{port} ({exc.strerror or exc}); "
                             "choose another address with --listen HOST:PORT") from exc
        registry.write_running(host, web.port)
        _say(f"metasync service: {len(fleet.runners())} folder(s), page and API at {web.url} "
             f"(config: {registry.config_dir})")
        while not stop.wait(1.0):  # a signal handler runs between waits
            pass
        _say("metasync service: stopping")
    finally:
        web.stop()
        fleet.stop(cancel=True)
        registry.clear_running()
        os.close(lock_fd)


@service.command("api-key")
def service_api_key() -> None:
    """Print the API key of the web page and REST API (made on first use, kept 0600
    in the config folder)."""
    click.echo(_registry().api_key())


@click.command("add-folder")
@click.argument("path", type=click.Path(path_type=Path))
def add_folder(path: Path) -> None:
    """Register the metasync folder PATH with the service (a running service starts
    syncing it within seconds)."""
    registry = _registry()
    folder = registry.add(path)
    running = registry.read_running()
    tail = (f"the service (pid {running['pid']}) starts syncing it now" if running
            else "run `metasync service` to sync it")
    _say(f"registered {folder.path} (id {folder.id}); {tail}")


@click.command("remove-folder")
@click.argument("path_or_id")
def remove_folder(path_or_id: str) -> None:
    """Stop syncing a registered folder (by path or id) and forget it; nothing on
    disk or on the backends is touched."""
    folder = _registry().remove(path_or_id)
    _say(f"removed {folder.path} (id {folder.id}); its files and backends are untouched")


@click.command("folders")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def folders(as_json: bool) -> None:
    """List the registered folders, with each one's state when the service runs."""
    from metasync.daemon import read_status
    from metasync.worktree import META_DIR

    registry = _registry()
    running = registry.read_running()
    rows = []
    for f in registry.folders():
        # Each folder's daemon.json, which the service's thread for it keeps as a
        # `metasync daemon` does (the same answer as `daemon status` there).
        doc: dict[str, Any] = {"state": "paused" if running else "stopped",
                               "reason": f"{f.path} or its {META_DIR} folder is gone"}
        if (f.path / META_DIR).is_dir():
            doc = read_status(f.path)
        rows.append({"id": f.id, "path": str(f.path), "state": doc.get("state", "stopped"),
                     "reason": doc.get("reason") or "", "version": doc.get("version", 0),
                     "last_sync": doc.get("last_sync")})
    if as_json:
        click.echo(json.dumps({"service": running, "folders": rows}, indent=2))
        return
    if not rows:
        click.echo("no folders registered; add one with `metasync add-folder PATH`")
    for r in rows:
        click.echo(f"{r['id']}  {r['state']:<8} {r['path']}"
                   + (f"  ({r['reason']})" if r["reason"] else ""))
    if running is None:
        click.echo("the service is not running (start it with `metasync service`)", err=True)


#: What metasync/cli.py adds to the command line.
APP_COMMANDS = (service, add_folder, remove_folder, folders)

__all__ = ["APP_COMMANDS", "parse_listen", "run_service"]
