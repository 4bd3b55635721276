"""``metasync sparse``: which paths this machine checks out (docs/sparse.md)."""

from __future__ import annotations

import click

from metasync.cli_common import _echo_json, _open, _say, json_option
from metasync.sparse import SparseChange


def _plural(n: int, what: str) -> str:
    return f"{n} {what}{'' if n == 1 else 's'}"


def _report(change: SparseChange, as_json: bool) -> None:
    if as_json:
        _echo_json({"patterns": change.patterns, "removed": change.removed,
                    "written": change.written, "kept": change.kept})
        return
    what = (f"{_plural(len(change.patterns), 'pattern')}" if change.patterns
            else "everything (sparse off)")
    _say(f"Selection: {what}; {_plural(len(change.removed), 'file')} removed, "
         f"{_plural(len(change.written), 'file')} written")


@click.group()
def sparse() -> None:
    """Choose what this machine checks out: gitignore-style patterns of what IS
    here (git's sparse-checkout pattern mode). The rest stays in the repository,
    is never deleted by this machine and is not downloaded. Per machine, never
    shared."""


@sparse.command("set")
@json_option
@click.argument("patterns", nargs=-1)
def sparse_set(patterns: tuple[str, ...], as_json: bool) -> None:
    """Make PATTERNS the selection, e.g. '/*' '!/photos/' (all but photos/).
    Files leaving it are removed only if master has them as they are here."""
    with _open() as repo:
        _report(repo.sparse.set(list(patterns)), as_json)


@sparse.command("add")
@json_option
@click.argument("patterns", nargs=-1)
def sparse_add(patterns: tuple[str, ...], as_json: bool) -> None:
    """Append PATTERNS to the selection (later patterns win), e.g. '/photos/2024/'."""
    with _open() as repo:
        _report(repo.sparse.add(list(patterns)), as_json)


@sparse.command("list")
@json_option
def sparse_list(as_json: bool) -> None:
    """Print the selection's patterns, one a line (nothing: everything is here)."""
    with _open(read_only=True) as repo:
        patterns = repo.sparse.patterns()
        outside = repo.sparse.outside_count()
    if as_json:
        _echo_json({"patterns": patterns, "outside": outside})
        return
    for pattern in patterns:
        click.echo(pattern)


@sparse.command("off")
@json_option
def sparse_off(as_json: bool) -> None:
    """Check out everything again (downloads the files that were outside)."""
    with _open() as repo:
        _report(repo.sparse.off(), as_json)
