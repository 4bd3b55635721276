"""What the installed command says about itself: ``--version`` (the package and the
repository format it writes and reads) and ``completion`` (the shell completion
script, click's own, for bash, zsh and fish)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import click

import metasync
from metasync.objects import FORMAT_VERSION, READABLE_FORMATS

_F = TypeVar("_F", bound=Callable[..., object])

#: The shells click writes completion scripts for, in the order help lists them.
SHELLS = ("bash", "zsh", "fish")


def version_option(f: _F) -> _F:
    """``--version``: ``metasync 0.1.0 (repository format 4; reads formats 3, 4)``. The
    format is the one docs/FORMAT.md describes and ``FORMAT_VERSION`` is checked
    against, so two machines can tell whether they can share a repository."""
    readable = ", ".join(str(v) for v in READABLE_FORMATS)
    return click.version_option(
        metasync.__version__,
        message=f"%(prog)s %(version)s (repository format {FORMAT_VERSION}; "
                f"reads formats {readable})",
    )(f)


@click.command()
@click.argument("shell", type=click.Choice(SHELLS), metavar="SHELL")
@click.pass_context
def completion(ctx: click.Context, shell: str) -> None:
    """Print the script that makes SHELL complete metasync's commands and options.

    \b
    bash:  metasync completion bash > ~/.metasync-complete.bash
           and in ~/.bashrc:  . ~/.metasync-complete.bash
    zsh:   metasync completion zsh > ~/.metasync-complete.zsh
           and in ~/.zshrc:   . ~/.metasync-complete.zsh
    fish:  metasync completion fish > ~/.config/fish/completions/metasync.fish
    """
    # Imported here: only this command needs it (start-up time of every other one).
    from click.shell_completion import get_completion_class

    root = ctx.find_root()
    prog = root.info_name or "metasync"
    # The variable the script sets when it asks for completions: the one click's
    # ``main`` answers for a program of this name (as ``_METASYNC_COMPLETE``).
    complete_var = f"_{prog}_COMPLETE".replace("-", "_").upper()
    cls = get_completion_class(shell)
    assert cls is not None  # every name in SHELLS is one click has
    # As click prints it for ``_METASYNC_COMPLETE=bash_source``: the script ends in a newline.
    click.echo(cls(root.command, {}, prog, complete_var).source(), nl=False)
