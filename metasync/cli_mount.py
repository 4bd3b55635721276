"""``metasync mount`` (docs/mount.md): every version as a read-only folder."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import click

from metasync.cli_common import _open
from metasync.errors import UsageError

_UNITS = {"": 1, "k": 1024, "m": 1024**2, "g": 1024**3, "t": 1024**4}


def parse_size(text: str) -> int:
    """``1G``, ``500M``, ``64k``, ``0`` (binary units; a trailing ``B``/``iB`` is
    allowed) as bytes; UsageError naming ``--cache-size`` otherwise."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*", text, re.IGNORECASE)
    if match is None:
        raise UsageError(f"--cache-size {text!r} is not a size; give e.g. 2G, 500M or 0")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def check_mountpoint(point: Path, repo_root: Path) -> None:
    """A mount point must be an existing, empty folder outside the repository's
    folder (the scanner would otherwise read the mount as new files)."""
    if not point.exists():
        raise UsageError(f"{point} does not exist; create an empty folder to mount on")
    if not point.is_dir():
        raise UsageError(f"{point} is not a folder; give an empty folder to mount on")
    if os.path.ismount(point) and point != Path(point.anchor):
        raise UsageError(f"{point} is already a mount point; unmount it first "
                         "(fusermount -u) or give another empty folder")
    if any(point.iterdir()):
        raise UsageError(f"{point} is not empty; give an empty folder to mount on")
    resolved, root = point.resolve(), repo_root.resolve()
    if resolved == root or root in resolved.parents:
        raise UsageError(f"{point} is inside the repository's folder {root}; "
                         "mount outside it")


def _fuse_missing() -> str | None:
    """Why FUSE cannot be used here, or None."""
    if sys.platform.startswith("linux") and not os.path.exists("/dev/fuse"):
        return ("FUSE is not available: /dev/fuse is missing (load the fuse module, or in "
                "a container pass --device /dev/fuse)")
    return None


@click.command()
@click.argument("mountpoint", type=click.Path(path_type=Path))
@click.option("--poll", type=click.FloatRange(min=0.1), default=30.0, show_default=True,
              metavar="SECONDS",
              help="Look for a new version (latest/) at most this often.")
@click.option("--cache-size", default="1G", show_default=True, metavar="SIZE",
              help="Keep at most this much fetched file content on disk (0: none).")
def mount(mountpoint: Path, poll: float, cache_size: str) -> None:
    """Show every version as a read-only folder at MOUNTPOINT: latest/, versions/N/,
    snapshots/NAME/, by-date/YYYY-MM-DD-HHMMSS/. Files are fetched when read, only
    the parts read. Runs until Ctrl-C, SIGTERM or `fusermount -u MOUNTPOINT`."""
    size = parse_size(cache_size)
    point = Path(os.path.abspath(mountpoint.expanduser()))
    why = _fuse_missing()
    if why is not None:
        raise UsageError(why)
    try:
        from metasync import mount as view
    except ImportError as exc:
        raise UsageError(f"FUSE is not available: {exc}; install metasync with its "
                         "dependencies (pip install mfusepy)") from None
    except OSError as exc:  # mfusepy loads libfuse when imported
        raise UsageError(f"FUSE is not available: libfuse could not be loaded ({exc}); "
                         "install it (Debian: apt install fuse3 libfuse2)") from None
    with _open(read_only=True) as repo:
        check_mountpoint(point, repo.root)
        reader = repo.version_reader(cache_size=size, poll=poll, share_folder=True)
        reader.latest()  # fails here, in one line, if no version can be learned
        click.echo(f"metasync: mounted {repo.root} at {point}; stop with Ctrl-C or "
                   f"fusermount -u {point}", err=True)
        view.serve(reader, str(point))
