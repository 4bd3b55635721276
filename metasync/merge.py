"""Three-way merge of two commits' trees against their common base.

Trees are compared flattened (``path -> TreeEntry``, folders included). The
merge is a pure function of its inputs, so it does not matter which client
computes it, and it never looks at modification times.

Rules, per path:

- changed on one side only: that side's version;
- the same change on both sides: it;
- deleted on one side, modified on the other: the modified version;
- changed differently on both (files or links): *theirs* -- the version ppaxos
  decided first -- keeps the name, and *ours* is kept beside it as
  ``NAME (conflict DEVICE YYYY-MM-DD HHMMSS).EXT``, DEVICE being the device that
  made it. Every client therefore resolves the same way: the earlier commit
  keeps the name, the later one gets the conflict copy;
- a folder against a file or link: the folder keeps the name and the file or
  link becomes a conflict copy (of the device that made it);
- a folder survives while anything merged still lives in it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from metasync.objects import TreeEntry, same_entry
from metasync.worktree import conflict_name


@dataclass(frozen=True)
class Side:
    """One side of a merge: its flattened tree and who made it, when."""

    tree: dict[str, TreeEntry]
    device: str
    #: ``YYYY-MM-DD HHMMSS`` of the side's commit, used in conflict-copy names.
    stamp: str


@dataclass(frozen=True)
class MergeConflict:
    #: The path both sides changed; it holds the version that kept the name.
    path: str
    #: Where the other version went.
    copy: str
    #: Which side went to the copy: ``"ours"`` or ``"theirs"``.
    moved: str


def merge_trees(
    base: dict[str, TreeEntry], ours: Side, theirs: Side,
    outside: Callable[[str, bool], bool] | None = None,
) -> tuple[dict[str, TreeEntry], list[MergeConflict]]:
    """Merge ``ours`` and ``theirs`` (decided first) against ``base``.

    ``outside(path, is_dir)`` is true for a path outside the merging machine's
    sparse selection: that machine never changes it, so theirs is taken as is
    (never a conflict there).

    Returns the merged flattened tree (folder entries carry no meaningful ref:
    trees are rebuilt from paths) and the conflicts, sorted by path.
    """
    merged: dict[str, TreeEntry] = {}
    conflicts: list[MergeConflict] = []
    displaced: list[tuple[str, TreeEntry, str]] = []  # (path, entry, side) needing a copy
    for path in sorted(set(base) | set(ours.tree) | set(theirs.tree)):
        b, o, t = base.get(path), ours.tree.get(path), theirs.tree.get(path)
        some = o or t or b
        theirs_only = outside is not None and some is not None and outside(path, some.type == "dir")
        if theirs_only or same_entry(o, t) or same_entry(o, b):
            chosen = t
        elif same_entry(t, b):
            chosen = o
        elif o is None or t is None:
            chosen = o if t is None else t  # delete against modify keeps the modified
        elif o.type == "dir" and t.type != "dir":
            chosen = o
            displaced.append((path, t, "theirs"))
        elif t.type == "dir":
            chosen = t
            if o.type != "dir":
                displaced.append((path, o, "ours"))
        else:
            chosen = t
            displaced.append((path, o, "ours"))
        if chosen is not None:
            merged[path] = chosen

    # A file or link where a merged path needs a folder: the folder wins the name.
    for path in sorted(merged, key=lambda p: (p.count("/"), p)):
        parent = path.rpartition("/")[0]
        while parent:
            holder = merged.get(parent)
            if holder is not None and holder.type != "dir":
                side = "ours" if same_entry(holder, ours.tree.get(parent)) else "theirs"
                displaced.append((parent, holder, side))
                merged[parent] = TreeEntry(parent.rpartition("/")[2], "dir", "0" * 64)
            elif holder is None:
                merged[parent] = TreeEntry(parent.rpartition("/")[2], "dir", "0" * 64)
            parent = parent.rpartition("/")[0]

    for path, entry, side in sorted(displaced, key=lambda d: d[0]):
        who = ours if side == "ours" else theirs
        copy = _free_name(merged, path, who.device, who.stamp)
        merged[copy] = dataclasses.replace(entry, name=copy.rpartition("/")[2])
        conflicts.append(MergeConflict(path, copy, side))
    return merged, conflicts


#: Longest device label a conflict-copy name carries.
MAX_DEVICE = 32


def device_label(device: str) -> str:
    """A device name safe inside a file name: the other side's name comes from a
    commit read from a backend (untrusted), so only letters, digits, ``-`` and
    ``_`` survive, at most MAX_DEVICE of them."""
    kept = "".join(ch for ch in device if ch.isalnum() or ch in "-_")[:MAX_DEVICE]
    return kept or "device"


def _free_name(taken: dict[str, TreeEntry], path: str, device: str, stamp: str) -> str:
    parent, _, name = path.rpartition("/")
    device = device_label(device)
    n = 1
    while True:
        label = device if n == 1 else f"{device} {n}"
        candidate = conflict_name(name, label, stamp)
        full = f"{parent}/{candidate}" if parent else candidate
        if full not in taken:
            return full
        n += 1
