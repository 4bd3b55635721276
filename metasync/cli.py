"""The ``metasync`` command: a thin layer over :class:`metasync.Repository`.

Every failure the user can cause ends in one line on stderr and a non-zero exit;
a traceback appears only with ``--debug``.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import socket
import sys
import threading
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import click

from metasync import watch_client
from metasync.backends import public_uri
from metasync.cli_common import (
    STATE,
    _add_global_options,
    _echo_json,
    _fail,
    _global_options,
    _human,
    _open,
    _passphrase_source,
    _reporter,
    _say,
    check_bwlimit_env,
    json_option,
)
from metasync.cli_install import completion, version_option
from metasync.committer import problems_json
from metasync.errors import Interrupted, MetasyncError, UsageError
from metasync.names import display_path
from metasync.progress import CANCEL
from metasync.repository import DEFAULT_NAMESPACE, Repository
from metasync.retention import commit_datetime
from metasync.watch_status import scan_answer

if TYPE_CHECKING:  # loaded by gc and fsck only (start-up time)
    from metasync.maintenance.gc import TempSweep


#: The commands defined in the ``cli_*`` modules, by name: the attribute of the module
#: :func:`_command_module` imports. Each module is imported only when its command runs
#: or is listed (``--help``): a command pays start-up time for its own module only.
LAZY_COMMANDS = {
    "auth": "auth", "daemon": "daemon", "log": "log", "key": "key", "gui": "gui",
    "forget": "forget", "mount": "mount", "sparse": "sparse", "service": "service",
    "add-folder": "add_folder", "remove-folder": "remove_folder", "folders": "folders",
}


def _command_module(name: str) -> ModuleType:
    """The module defining command ``name`` of :data:`LAZY_COMMANDS`, imported."""
    if name in ("auth", "daemon"):
        import metasync.cli_daemon
        return metasync.cli_daemon
    if name == "log":
        import metasync.cli_history
        return metasync.cli_history
    if name == "key":
        import metasync.cli_keys
        return metasync.cli_keys
    if name == "gui":
        import metasync.cli_gui
        return metasync.cli_gui
    if name == "forget":
        import metasync.cli_forget
        return metasync.cli_forget
    if name == "mount":
        import metasync.cli_mount
        return metasync.cli_mount
    if name == "sparse":
        import metasync.cli_sparse
        return metasync.cli_sparse
    import metasync.cli_app
    return metasync.cli_app


class LazyGroup(click.Group):
    """The ``metasync`` group: a command of :data:`LAZY_COMMANDS` is imported (and
    given the global options) the first time it is looked up."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*self.commands, *LAZY_COMMANDS})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in self.commands and cmd_name in LAZY_COMMANDS:
            command = getattr(_command_module(cmd_name), LAZY_COMMANDS[cmd_name])
            _add_global_options(command)
            self.add_command(command, cmd_name)
        return super().get_command(ctx, cmd_name)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]},
             params=_global_options())
@click.option("--json", "as_json", is_flag=True,
              help="Machine-readable output from commands that have it (as their --json).")
@version_option
def cli(as_json: bool) -> None:
    """Keep one folder in sync across several untrusted storage services.
    Global options may also follow the subcommand (metasync pull -q)."""
    STATE.json = as_json


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
        if repo.fingerprint:
            _say(f"Fingerprint: {repo.fingerprint} (clone elsewhere with --fingerprint to pin it)")
        if not bft:
            _say("note: crash mode: a backend that loses or hides log entries can fork "
                 "history; use --bft (4+ backends) to tolerate one that lies")


@cli.command()
@click.argument("uri")
@click.argument("directory", required=False)
@click.option("--namespace", default=DEFAULT_NAMESPACE, show_default=True,
              help="Folder name of the repository on the backend (as given to init).")
@click.option("--fingerprint", default=None, metavar="F",
              help="Refuse the clone unless the repository's fingerprint is F (as init printed it).")
@click.option("--no-encrypt", is_flag=True,
              help="Accept an unencrypted repository (refused otherwise: a backend can make an "
                   "encrypted repository look unencrypted).")
@click.option("--backend", "others", multiple=True, metavar="URI",
              help="Another backend of the repository to use at once, as this machine "
                   "reaches it (repeatable); others are used once connected.")
@click.option("--sparse", "sparse", multiple=True, metavar="PATTERN",
              help="Check out only what these patterns select (repeatable; docs/sparse.md).")
@passphrase_file_option
@json_option
def clone(uri: str, directory: str | None, namespace: str, fingerprint: str | None,
          no_encrypt: bool, others: tuple[str, ...], sparse: tuple[str, ...],
          passphrase_file: str | None, as_json: bool) -> None:
    """Rebuild a repository from any one of its backends (URI) into DIRECTORY."""
    target = directory or namespace
    repo = Repository.clone(uri, target, namespace=namespace,
                            passphrase=_passphrase_source(passphrase_file, confirm=False),
                            reporter=_reporter(), allow_unencrypted=no_encrypt,
                            fingerprint=fingerprint, connect=list(others),
                            sparse=list(sparse) if sparse else None)
    with repo:
        if as_json:
            _echo_json({"version": repo.prev.number, "root": str(repo.root),
                        "fingerprint": repo.fingerprint or None,
                        "encrypted": bool(repo.fingerprint)})
            return
        _say(f"Cloned version {repo.prev.number} into {repo.root}")
        _say(f"Fingerprint: {repo.fingerprint}" if repo.fingerprint
             else "The repository is NOT encrypted")


@cli.command()
@click.argument("directory", required=False)
@click.option("--backend", "backends", multiple=True, required=True, metavar="URI",
              help="A backend that survived (repeat for each).")
@click.option("--add-backend", "added", multiple=True, metavar="URI",
              help="A new, empty backend to add to the recovered repository (repeatable).")
@click.option("--namespace", default=DEFAULT_NAMESPACE, show_default=True)
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
@click.option("--no-encrypt", is_flag=True,
              help="The repository is not encrypted (refused otherwise: a backend can say so).")
@passphrase_file_option
def recover(directory: str | None, backends: tuple[str, ...], added: tuple[str, ...],
            namespace: str, yes: bool, no_encrypt: bool, passphrase_file: str | None) -> None:
    """Rebuild a repository whose majority of backends is gone for good from the
    backends that survived, into DIRECTORY (see docs/design.md, "Recovery")."""

    def confirm(explanation: str) -> bool:
        click.echo(explanation, err=True)
        if yes:
            return True
        if not sys.stdin.isatty():
            raise UsageError("recover changes the repository for every client; "
                             "confirm with --yes")
        return click.confirm("Go on?", default=False, err=True)

    repo, result = Repository.recover(
        list(backends), directory or namespace, add=list(added), namespace=namespace,
        passphrase=_passphrase_source(passphrase_file, confirm=False), confirm=confirm,
        reporter=_reporter(), allow_unencrypted=no_encrypt)
    with repo:
        assert result.version is not None
        _say(f"Recovered version {result.restored.number} into {repo.root}: the repository "
             f"now goes on from version {result.version.number} on "
             f"{len(result.backends)} backend(s) with R = {result.replicas} "
             f"({result.rebalance.copied} copies written)")


@cli.command()
@click.argument("folder", type=click.Path(file_okay=False))
@click.option("--remove", is_flag=True, help="Stop trusting FOLDER.")
def trust(folder: str, remove: bool) -> None:
    """Open FOLDER's repository although another user owns its .metasync (as git's
    safe.directory); per user. METASYNC_SAFE_DIRECTORIES does the same for a session."""
    path = Repository.trust(folder, not remove)
    _say(f"{'no longer trusted' if remove else 'trusted'}: {path}")


#: Exit status of a push that pushed but could not read some paths (restic's 3).
PARTIAL_EXIT = 3


@cli.command()
@json_option
@click.option("--offline", is_flag=True,
              help="Do not ask the backends for the newest version (no behind/ahead line).")
@click.option("--scan", is_flag=True,
              help="Scan the folder even when its daemon could answer from its watch.")
def status(as_json: bool, offline: bool, scan: bool) -> None:
    """Show changes in the folder that are not committed yet, and whether the folder
    is behind master (versions to pull) or ahead (local commits to push). A daemon
    or service watching the folder answers without a scan (docs/daemon.md)."""
    answer = None if scan else watch_client.ask(os.getcwd(), offline)
    if answer is None:
        with _open(read_only=True) as repo:
            answer = scan_answer(repo, offline)
    elif STATE.debug:
        click.echo(f"metasync: status answered by the daemon ({answer['how']})", err=True)
    watch_client.emit(answer, as_json, STATE.quiet)


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
@json_option
def push(message: str, as_json: bool) -> None:
    """Commit pending changes and publish them as the new master."""
    with _open() as repo:
        result = repo.push(message)
        config = repo.config
        # A backend whose log appends fail is outvoted silently otherwise; say so.
        failing = {repo.backend_name(b): why for b, why in repo.versions.failing_appends().items()}
    # Each conflict copy was said as it was made (the reporter's note); not again here.
    warnings = [f"warning: {result.fork}"] if result.fork else []
    warnings += [f"warning: backend {name} took no part in agreeing on the version ({why}); "
                 "the others carry the history until it works again" for name, why in failing.items()]
    notes = []
    if result.short:
        wanted = f"R = {config.replicas}" + (
            f", or {config.erasure[1]} fragments" if config.erasure else "")
        what = f"version {result.version.number}" if result.version else "the upload"
        warnings.append(f"warning: {what} has fewer copies than the configuration asks for "
                        f"({wanted}) of {len(result.short)} object(s): too few backends took "
                        "writes; a later push or the daemon adds the missing copies when they "
                        "answer")
    for why in result.full.values():
        # Not "unreachable", and no data at risk: its copies went to other backends.
        warnings.append(f"warning: {why} (its new copies go to other backends until it "
                        "has room; they move home then)")
    unreadable = result.problems.unreadable
    warnings += [f"warning: cannot read {display_path(u.display())}: {u.reason}; not synced "
                 "(what was committed of it stays)" for u in unreadable]
    if unreadable:
        # As restic backup: the rest was pushed (exit 3), but the folder is not all synced.
        warnings.append(f"warning: {len(unreadable)} path(s) could not be read and are not "
                        "synced; give them read permission or add them to .metasyncignore")
    settled = not (result.short or result.full)  # else: said above, copies wait for room
    if settled and result.spilled:
        notes.append(f"note: {result.spilled} copies went to other backends while their "
                     "holders did not answer; they move home once those are back (any push "
                     "or daemon does it)")
    elif settled and result.missing_copies:
        warnings.append(f"warning: {result.missing_copies} object copies are not on their "
                        "backends yet (one is unreachable); the next push retries them")
    if as_json:
        _echo_json({
            "version": result.version.number if result.version else None,
            "up_to_date": result.up_to_date,
            "commit": result.commit.commit_id if result.commit else None,
            "objects_uploaded": result.objects_uploaded,
            "bytes_uploaded": result.bytes_uploaded,
            "conflicts": result.conflicts,
            "skipped": result.skipped,
            **problems_json(result.problems),
            "warnings": [w.removeprefix("warning: ") for w in warnings] + notes,
        })
        sys.exit(PARTIAL_EXIT if unreadable else 0)
    if result.fork:
        click.echo(warnings[0], err=True)  # said even with --quiet: the user must act on it
    for u in result.problems.special:
        _say(f"skipped: {display_path(u.display())} ({u.reason})")
    skipped = len(result.skipped) + len(unreadable)
    noun = "path" if any(u.folder for u in unreadable) else "file"
    left_out = (f"; {skipped} {noun}{'' if skipped == 1 else 's'} skipped (see above)"
                if skipped else "")
    if result.up_to_date and skipped:
        _say(f"Nothing new to push{left_out}")
    elif result.up_to_date:
        _say("Everything up to date")
    elif result.version is not None:
        _say(f"Pushed version {result.version.number}: {result.objects_uploaded} objects, "
             f"{_human(result.bytes_uploaded)} uploaded{left_out}")
    for line in warnings[1 if result.fork else 0:]:
        click.echo(line, err=True)
    for line in notes:
        _say(line)
    if unreadable:
        sys.exit(PARTIAL_EXIT)


@cli.command()
@json_option
def pull(as_json: bool) -> None:
    """Bring the latest master into the folder."""
    with _open() as repo:
        result = repo.pull()
    if as_json:
        _echo_json({"version": result.version.number, "up_to_date": result.up_to_date,
                    "written": result.written, "deleted": result.deleted,
                    "conflicts": result.conflicts,
                    "warnings": [result.fork] if result.fork else []})
        return
    _warn_fork(result.fork)
    if result.up_to_date:
        _say("Already up to date")
    else:
        _say(f"Updated to version {result.version.number}: {result.written} written, "
             f"{result.deleted} deleted, {len(result.conflicts)} conflict copies")


def _warn_fork(fork: str) -> None:
    """A forked history is said even with ``--quiet``: the user must act on it."""
    if fork:
        click.echo(f"warning: {fork}", err=True)


@cli.command()
@click.option("--quick", is_flag=True, help="Only check that every copy is there (no download).")
@click.option("--repair", is_flag=True, help="Re-create missing or corrupt copies from good ones.")
@json_option
def fsck(quick: bool, repair: bool, as_json: bool) -> None:
    """Verify every copy of every object reachable from master on every backend."""
    with _open() as repo:
        report = repo.fsck(quick=quick, repair=repair)
        names = {p.backend: repo.backend_name(p.backend) for p in report.problems}
        names.update({b: repo.backend_name(b) for b, _ in report.temp_files.found})
        names.update({b: repo.backend_name(b) for b in report.temp_files.errors})
        full = {b for b, why in repo.health().items() if why.startswith("full:")}
    fixed = set(report.repaired)
    if as_json:
        _echo_json({
            "ok": report.ok, "quick": quick, "objects": report.objects,
            "checked_copies": report.checked_copies,
            "problems": [{"problem": p.problem, "kind": p.kind, "object": p.object_id,
                          "backend": p.backend, "backend_name": names.get(p.backend, p.backend),
                          "backend_full": p.backend in full,
                          "repaired": p in fixed} for p in report.problems],
            "temp_files": {"count": len(report.temp_files.found),
                           "bytes": report.temp_files.size,
                           "removed": report.temp_files.removed},
        })
        if not report.ok:
            sys.exit(1)
        return
    for p in report.problems:
        where = names.get(p.backend, p.backend)
        if p in fixed:
            _say(f"repaired: {p.problem} {p.kind} {p.object_id} on {where}")
        else:
            # A full backend's copies wait for room; their spilled copies hold the data.
            why = " (the backend is full; the copy waits for room)" if p.backend in full else ""
            click.echo(f"{p.problem}: {p.kind} {p.object_id} on {where}{why}")
    _report_temp_files(report.temp_files, names)
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


def _report_temp_files(sweep: TempSweep, names: dict[str, str]) -> None:
    """What fsck and gc found of killed uploads' temporary files (see TempSweep)."""
    if sweep.found:
        count = len(sweep.found)
        where = ", ".join(sorted({names.get(b, b) for b, _ in sweep.found}))
        what = (f"{count} temporary file(s) of interrupted uploads, "
                f"{_human(sweep.size)}, older than the grace period")
        if sweep.removed:
            _say(f"removed {what} (on {where})")
        else:
            click.echo(f"{what} on {where}; `metasync fsck --repair` or `metasync gc` "
                       "removes them")
    for backend, why in sorted(sweep.errors.items()):
        click.echo(f"note: could not look for temporary files on {names.get(backend, backend)}: "
                   f"{why}", err=True)


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


@backend.command("connect")
@click.argument("name")
@click.argument("uri", required=False)
def backend_connect(name: str, uri: str | None) -> None:
    """Use backend NAME (its id), which another client added, from now on: by URI as
    this machine reaches it (with its own options and credentials), or by the
    shared URI (without local options or environment passwords)."""
    with _open() as repo:
        spec, own = repo.connect_backend(name, uri)
    _say(f"connected backend {spec.id} ({public_uri(own)})")


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
    with _open(read_only=True) as repo:
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
              help="Compact the logs of versions decided at least this long ago, and delete "
                   "temporary files of interrupted uploads older than this. Below the default, "
                   "a push suspended for over half of it may have to merge again (or upload "
                   "again).")
def gc(log_grace_hours: float) -> None:
    """Delete objects no kept version, snapshot or push in progress needs, and
    compact the agreement logs of old versions."""
    with _open() as repo:
        report = repo.gc(log_grace_s=log_grace_hours * 3600)
        names = {b: repo.backend_name(b) for b, _ in report.temp_files.found}
        names.update({b: repo.backend_name(b) for b in report.temp_files.errors})
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
    _report_temp_files(report.temp_files, names)


@cli.command()
@click.argument("name", required=False)
@click.option("--delete", "delete", is_flag=True, help="Delete snapshot NAME instead.")
def snapshot(name: str | None, delete: bool) -> None:
    """Keep the current master as NAME for ever (gc never collects it); without NAME,
    list the snapshots."""
    with _open(read_only=name is None) as repo:
        if name is None:
            for snap, commit_id in repo.snapshots():
                click.echo(f"{snap}\t{commit_id}")
            return
        version = repo.delete_snapshot(name) if delete else repo.snapshot(name)
    _say(f"{'deleted' if delete else 'kept'} snapshot {name}; now version {version.number}")


@cli.command()
@click.argument("path")
@click.option("--version", "version", default=None, metavar="V",
              help="A version number or commit id prefix (as metasync log shows them), a "
                   "snapshot name, or ~N (N versions back).")
@click.option("--to", "to", default=None, type=click.Path(), metavar="DEST",
              help="Write it here instead of at PATH.")
def restore(path: str, version: str | None, to: str | None) -> None:
    """Bring back PATH (a file or folder) as it was in an earlier version."""
    with _open() as repo:
        rel = os.path.relpath(Path(path).absolute(), repo.root)
        result = repo.restore(rel, version, to)
    when = commit_datetime(result.time_ns, None).strftime("%Y-%m-%d %H:%M:%S")
    for copy in result.conflicts:
        _say(f"kept the file that was in the way as {display_path(copy)}")
    _say(f"restored {len(result.restored)} file(s) to {display_path(result.target)} from {result.commit_id[:12]} "
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


cli.add_command(completion)
_add_global_options(cli)  # those of LAZY_COMMANDS get them as they load


_QUIT = threading.Lock()
#: The signals that stop a command.
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _announce_stop() -> None:
    """The first Ctrl-C or SIGTERM: every transfer stops at its next piece and the
    command says what it kept. Whichever of the two listeners below sees the signal
    first says so, once."""
    if CANCEL.request():
        sys.stderr.write("metasync: stopping transfers (press Ctrl-C again to quit at once)\n")
        sys.stderr.flush()


def _quit_at_once() -> None:
    """A second signal: quit without joining worker threads blocked in a backend call
    (nothing half-written is referenced: every write is atomic and a commit is
    proposed only after its objects). The lock keeps the line to one."""
    with _QUIT:
        sys.stdout.flush()
        sys.stderr.write("metasync: interrupted again: stopped at once; the next command "
                         "continues\n")
        sys.stderr.flush()
        os._exit(130)


#: Signals the Python-level handler has run for (each listener counts its own).
_HANDLED = itertools.count(1)


def _on_signal(signum: int, frame: object) -> None:
    """The Python-level handler, run by the main thread when it next runs Python code:
    the first unwinds the command, which then reports what it kept."""
    if next(_HANDLED) > 1:
        _quit_at_once()
    _announce_stop()
    raise KeyboardInterrupt


def _watch_signals(wakeup: socket.socket) -> None:
    """Count signals as they arrive, whichever thread the kernel gave them to.

    The Python-level handler runs only when the main thread next runs Python code;
    while it waits on a transfer stuck in a backend call, a signal the kernel
    delivered to another thread does not wake it. The C-level handler also writes
    each signal's number to ``wakeup`` (:func:`signal.set_wakeup_fd`), read here: the
    first stops every transfer, a second quits at once."""
    seen = itertools.count(1)
    while signum := wakeup.recv(1):
        if signum[0] not in _STOP_SIGNALS:  # a signal some library listens for
            continue
        if next(seen) > 1:
            _quit_at_once()
        _announce_stop()


#: The pair the C-level handler writes to and the watcher reads, kept open for the
#: process's life (closing the write end would end the watcher).
_WAKEUP: list[socket.socket] = []


def _listen_for_signals() -> None:
    """Install both listeners for SIGINT and SIGTERM (from the main thread)."""
    # A non-blocking socket, not os.pipe: on Windows set_wakeup_fd takes only sockets.
    _WAKEUP[:] = read_end, write_end = socket.socketpair()
    write_end.setblocking(False)
    signal.set_wakeup_fd(write_end.fileno(), warn_on_full_buffer=False)
    threading.Thread(target=_watch_signals, args=(read_end,), name="signals",
                     daemon=True).start()
    for sig in _STOP_SIGNALS:
        signal.signal(sig, _on_signal)


def main() -> None:
    """Console-script entry point."""
    # pythonw.exe (the Windows service) has no standard streams: output goes nowhere.
    sys.stdout, sys.stderr = (s or open(os.devnull, "w") for s in (sys.stdout, sys.stderr))  # noqa: SIM115
    _listen_for_signals()
    try:
        check_bwlimit_env()
        cli.main(standalone_mode=False)
    except click.exceptions.Abort:
        _fail("interrupted" if CANCEL.requested() else "aborted", 130)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except Interrupted as exc:
        click.echo(f"metasync: interrupted: {exc}", err=True)
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
        where = f" ({display_path(os.fsdecode(exc.filename))})" if exc.filename else ""
        _fail(f"{exc.strerror or exc}{where}; run with --debug for details")
    except Exception as exc:  # a bug: one line naming it; the traceback with --debug
        if STATE.debug:
            raise
        _fail(f"unexpected {type(exc).__name__}: {exc}; rerun with --debug for the "
              "traceback and report it", 1)
    sys.exit(0)


if __name__ == "__main__":
    main()
