"""This machine's sparse selection: which paths of the tree are checked out here.

The patterns are gitignore patterns read the other way round, as git's
sparse-checkout reads them in its pattern (non-cone) mode: a path the patterns
*match* is checked out here; every other path is "outside the selection" -- it
stays in the repository, and this machine neither writes nor deletes it. The
rules, exactly (docs/sparse.md):

* Patterns are matched in order and the last one matching decides; ``!PAT``
  takes a path back out. ``photos/`` matches a folder named ``photos`` anywhere
  and everything in it; ``/photos/`` only the top-level one; ``*.iso`` files
  ending in ``.iso`` in any folder; a folder matches with everything it holds.
* If the first pattern is a ``!`` pattern, the selection starts from everything
  (``/*`` first), so ``!/photos/`` alone means "all but the top-level photos",
  and ``sparse add /photos/2024/`` after it takes that one folder back in.
* No patterns: everything is selected (sparse off).
* A folder not selected itself but holding a selected path exists here as that
  path's parent.

Pure: nothing here reads the disk; the patterns live in the local state
(:attr:`metasync.state.LocalState.sparse_patterns`), never on a backend.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from metasync.errors import UsageError
from metasync.localdb import OUTSIDE, LocalDB

#: What "start from everything" is, when the first pattern takes something out.
EVERYTHING = "/*"


def check_patterns(patterns: Sequence[str]) -> list[str]:
    """``patterns`` as stored, or UsageError (one line) for a selection that cannot
    be one: none at all, an empty or comment-only pattern, a line break in one, one
    gitignore cannot parse."""
    if not patterns:
        raise UsageError("give at least one pattern (e.g. `metasync sparse set '/*' '!/photos/'`); "
                         "`metasync sparse off` selects everything")
    out = []
    for pattern in patterns:
        text = pattern.strip()
        if not text or text.startswith("#") or text in ("!", "/", "!/") or "\n" in pattern:
            raise UsageError(f"not a selection pattern: {pattern!r}; give a gitignore-style "
                             "pattern such as '/docs/', '*.iso' or '!/photos/'")
        out.append(text)
    try:
        Selection(out)
    except Exception as exc:  # pathspec's parse error (any type): bad input, one line
        raise UsageError(f"not a selection pattern: {exc}; see docs/sparse.md") from None
    return out


class Selection:
    """Which paths are checked out on this machine (see the module's rules)."""

    def __init__(self, patterns: Iterable[str] = ()) -> None:
        self.patterns = list(patterns)
        self._spec: Any = None
        if self.patterns:
            import pathspec  # only sparse clones pay for the import

            lines = self.patterns
            if lines[0].startswith("!"):
                lines = [EVERYTHING, *lines]
            self._spec = pathspec.GitIgnoreSpec.from_lines(lines)

    @property
    def active(self) -> bool:
        """True if some path may be outside the selection (there are patterns)."""
        return self._spec is not None

    def selects(self, path: str, is_dir: bool = False) -> bool:
        """True if ``path`` (a folder if ``is_dir``) is checked out here."""
        if self._spec is None:
            return True
        return bool(self._spec.match_file(path + "/" if is_dir else path))

    def keeps(self, path: str, is_dir: bool, needed: set[str]) -> bool:
        """True if ``path`` has a place in this folder: selected, or a folder in
        ``needed`` (the parents of selected paths, see :func:`parents_of`)."""
        return self.selects(path, is_dir) or (is_dir and path in needed)


def parents_of(paths: Iterable[str]) -> set[str]:
    """Every folder above the given paths."""
    out: set[str] = set()
    for path in paths:
        parent = path.rpartition("/")[0]
        while parent and parent not in out:
            out.add(parent)
            parent = parent.rpartition("/")[0]
    return out


def filter_scan(selection: Selection, entries: dict[str, Any]) -> None:
    """Drop from a scan's ``entries`` (path -> an entry with ``type``) every path
    outside ``selection``: files and links not selected, and folders neither
    selected nor holding a path that stays. The scan then never sees what this
    machine does not check out (its index rows stand for it instead)."""
    if not selection.active:
        return
    kept_files = [p for p, e in entries.items()
                  if e.type != "dir" and selection.selects(p)]
    for p, e in list(entries.items()):
        if e.type != "dir" and not selection.selects(p):
            del entries[p]
    dirs = [p for p, e in entries.items() if e.type == "dir"]
    selected_dirs = [d for d in dirs if selection.selects(d, True)]
    needed = parents_of([*kept_files, *selected_dirs])
    for d in dirs:
        if d not in needed and not selection.selects(d, True):
            del entries[d]


def drop_selected_rows(db: LocalDB, selection: Selection, root: Path) -> None:
    """Drop the :data:`~metasync.localdb.OUTSIDE` rows of folders ``selection`` takes
    in that are here (under ``root``; the scan sees them): a stale row would keep
    such a folder in the tree after it is deleted here. A folder not here yet
    keeps its row until a checkout makes it."""
    def here(d: str) -> bool:
        try:
            return stat.S_ISDIR(os.lstat(root / d).st_mode)
        except OSError:
            return False

    db.delete_index([d for d in db.marked_dirs(OUTSIDE)
                     if selection.selects(d, True) and here(d)])
