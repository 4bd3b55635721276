"""``metasync log`` (docs/cli.md, "History")."""

from __future__ import annotations

import click

from metasync.cli_common import _echo_json, _open, json_option
from metasync.history import GraphRow, LogEntry, draw_graph
from metasync.names import display_path
from metasync.retention import commit_datetime


@click.command()
@json_option
@click.option("-n", "--limit", type=int, default=None, help="Show at most this many commits.")
@click.option("--graph", is_flag=True,
              help="Draw the lines of descent, both parents of merges (as git log --graph).")
@click.option("--oneline", is_flag=True, help="One line per commit: short id, version, message.")
def log(as_json: bool, limit: int | None, graph: bool, oneline: bool) -> None:
    """Show the history, newest first: every commit (both sides of merges) with the
    version it became master in, the number `restore --version` takes."""
    with _open(read_only=True) as repo:
        entries = repo.log(limit)
        # Paths each commit changed outside this machine's selection (docs/sparse.md).
        outside = ({e.commit_id: repo.sparse.outside_changes(e.commit_id) for e in entries}
                   if repo.sparse.patterns() else {})
    if as_json:
        _echo_json([{**e.to_json(), **({"outside_selection": outside[e.commit_id]}
                                       if outside else {})} for e in entries])
        return
    rows = draw_graph(entries) if graph else [GraphRow(e, "", "") for e in entries]
    for i, row in enumerate(rows):
        if row.entry is None:
            if not _opens(rows, i) or oneline:
                click.echo(row.prefix)  # (a merge's opening row is shown by its entry)
            continue
        lines = _log_lines(row.entry, oneline, outside.get(row.entry.commit_id, []))
        if not graph:
            click.echo("\n".join(lines))
            continue
        click.echo(f"{row.prefix} {lines[0]}")
        if _opens(rows, i + 1) and not oneline:
            click.echo(rows[i + 1].prefix)  # right below the merge, as git draws it
        pad = row.padding or " "
        for line in lines[1:]:
            click.echo(f"{pad} {line}".rstrip())


def _opens(rows: list[GraphRow], i: int) -> bool:
    """Row ``i`` is the one a merge opens its further parents' columns with."""
    return (0 < i < len(rows) and rows[i].entry is None and rows[i - 1].entry is not None
            and "\\" in rows[i].prefix)


def _log_lines(e: LogEntry, oneline: bool, outside: list[str]) -> list[str]:
    """One log entry as lines (git's format, with the version after the id), and
    the paths it changed ``outside`` this machine's selection."""
    number = f" (version {e.version})" if e.version is not None else ""
    message = e.message or "(no message)"
    mark = ""
    if outside:
        shown = ", ".join(display_path(p) for p in outside[:3])
        more = f" and {len(outside) - 3} more" if len(outside) > 3 else ""
        mark = f"outside this machine's selection: {shown}{more}"
    if oneline:
        return [f"{e.commit_id[:12]}{number} {message.splitlines()[0] if message else ''}"
                + (f" [{len(outside)} outside the selection]" if outside else "")]
    when = commit_datetime(e.time_ns, None).strftime("%Y-%m-%d %H:%M:%S")
    lines = [f"commit {e.commit_id}{number}"]
    if len(e.parents) > 1:
        lines.append("Merge: " + " ".join(p[:12] for p in e.parents))
    lines += [f"Device: {e.device}", f"Date:   {when}", ""]
    lines += [f"    {line}" for line in message.splitlines()] + [""]
    if mark:
        lines += [f"    ({mark})", ""]
    return lines
