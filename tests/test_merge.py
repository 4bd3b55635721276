"""The three-way merge of flattened trees (metasync/merge.py).

Example tests pin every rule of the module docstring, including the exact
conflict-copy names; Hypothesis properties check the merge over random small
trees: base, then ours and theirs as random edits of base.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from metasync.merge import MergeConflict, Side, merge_trees
from metasync.objects import TreeEntry, check_name
from metasync.worktree import conflict_name

OURS_DEV, OURS_STAMP = "laptop", "2026-11-22 101500"
THEIRS_DEV, THEIRS_STAMP = "desktop", "2026-11-22 094500"

# ----------------------------------------------------------------------------- helpers


def ref(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


class _Dir:
    def __repr__(self) -> str:
        return "DIR"


DIR: Any = _Dir()


@dataclass(frozen=True)
class Link:
    target: str


@dataclass(frozen=True)
class Exe:
    content: str


@dataclass(frozen=True)
class Chunked:
    content: str


def entry(path: str, spec: Any) -> TreeEntry:
    name = path.rpartition("/")[2]
    if spec is DIR:
        return TreeEntry(name, "dir", ref("tree:" + path))
    if isinstance(spec, Link):
        return TreeEntry(name, "link", spec.target, len(spec.target.encode()))
    if isinstance(spec, Exe):
        return TreeEntry(name, "file", ref(spec.content), len(spec.content), True)
    if isinstance(spec, Chunked):
        return TreeEntry(name, "chunked", ref("chunked:" + spec.content), len(spec.content))
    assert isinstance(spec, str)
    return TreeEntry(name, "file", ref(spec), len(spec))


def tree(spec: dict[str, Any]) -> dict[str, TreeEntry]:
    """A flattened tree from ``{path: DIR | "content" | Exe(..) | Link(..) | Chunked(..)}``;
    parent folders are added."""
    flat: dict[str, TreeEntry] = {}
    for path, value in spec.items():
        parts = path.split("/")
        for i in range(1, len(parts)):
            parent = "/".join(parts[:i])
            assert spec.get(parent, DIR) is DIR, f"{parent} is not a folder"
            flat.setdefault(parent, entry(parent, DIR))
        flat[path] = entry(path, value)
    return flat


def key(e: TreeEntry | None) -> tuple[Any, ...] | None:
    """What a path holds, as content: folders by kind only (their contents are paths too)."""
    if e is None:
        return None
    if e.type == "dir":
        return ("dir",)
    return (e.type, e.ref, e.executable)


def contents(flat: dict[str, TreeEntry]) -> dict[str, tuple[Any, ...] | None]:
    return {p: key(e) for p, e in flat.items()}


def check_valid(merged: dict[str, TreeEntry]) -> None:
    """Every entry is named after its last path component and lives in a merged folder."""
    for path, e in merged.items():
        assert path and not path.startswith("/") and not path.endswith("/") and "//" not in path
        parent, _, name = path.rpartition("/")
        assert e.name == name, f"{path}: entry named {e.name!r}"
        check_name(name)
        if parent:
            holder = merged.get(parent)
            assert holder is not None and holder.type == "dir", f"{path}: parent is {holder}"


def merge(
    base: dict[str, TreeEntry], ours: dict[str, TreeEntry], theirs: dict[str, TreeEntry]
) -> tuple[dict[str, TreeEntry], list[MergeConflict]]:
    merged, conflicts = merge_trees(
        base, Side(ours, OURS_DEV, OURS_STAMP), Side(theirs, THEIRS_DEV, THEIRS_STAMP)
    )
    check_valid(merged)
    return merged, conflicts


def ours_copy(path: str, label: str = OURS_DEV) -> str:
    parent, _, name = path.rpartition("/")
    copy = conflict_name(name, label, OURS_STAMP)
    return f"{parent}/{copy}" if parent else copy


def theirs_copy(path: str, label: str = THEIRS_DEV) -> str:
    parent, _, name = path.rpartition("/")
    copy = conflict_name(name, label, THEIRS_STAMP)
    return f"{parent}/{copy}" if parent else copy


def assert_merged(merged: dict[str, TreeEntry], expected: dict[str, Any]) -> None:
    assert contents(merged) == contents(tree(expected))


# ----------------------------------------------------------------------------- one side, both sides alike

BASE = {
    "keep.txt": "keep",
    "edit.txt": "v1",
    "gone.txt": "old",
    "script.sh": "echo hi",
    "cur": Link("v1"),
    "old/a.txt": "a",
    "old/sub/b.txt": "b",
    "empty": DIR,
}

EDITED = {
    "keep.txt": "keep",
    "edit.txt": "v2",
    "script.sh": Exe("echo hi"),
    "cur": Link("v2"),
    "new.txt": "new",
    "n/m/deep.txt": "deep",
    "new-empty": DIR,
    "empty": DIR,
}


def test_nothing_changed_returns_base() -> None:
    merged, conflicts = merge(tree(BASE), tree(BASE), tree(BASE))
    assert_merged(merged, BASE)
    assert conflicts == []


@pytest.mark.parametrize("editor", ["ours", "theirs"])
def test_changes_on_one_side_apply(editor: str) -> None:
    ours, theirs = (EDITED, BASE) if editor == "ours" else (BASE, EDITED)
    merged, conflicts = merge(tree(BASE), tree(ours), tree(theirs))
    assert_merged(merged, EDITED)
    assert conflicts == []


def test_disjoint_changes_on_both_sides_all_apply() -> None:
    base = tree({"a.txt": "a", "b.txt": "b", "c.txt": "c", "d/x": "x"})
    ours = tree({"a.txt": "a2", "b.txt": "b", "d/x": "x", "mine.txt": "m"})
    theirs = tree({"a.txt": "a", "b.txt": Exe("b"), "c.txt": "c", "d/x": "x", "d/y": "y"})
    merged, conflicts = merge(base, ours, theirs)
    assert_merged(merged, {"a.txt": "a2", "b.txt": Exe("b"), "d/x": "x", "d/y": "y", "mine.txt": "m"})
    assert conflicts == []


def test_same_change_on_both_sides_is_not_a_conflict() -> None:
    base = tree({"a.txt": "a", "gone.txt": "g", "x.sh": "x", "dir/f": "f", "l": Link("1")})
    both = tree({"a.txt": "a2", "x.sh": Exe("x"), "new/same.txt": "s", "l": Link("2"), "f2": "n"})
    merged, conflicts = merge(base, both, dict(both))
    assert_merged(merged, {"a.txt": "a2", "x.sh": Exe("x"), "new/same.txt": "s", "l": Link("2"), "f2": "n"})
    assert conflicts == []


def test_folders_compare_by_kind_not_by_tree_id() -> None:
    base = tree({"d/a": "a"})
    ours = {p: dataclasses.replace(e, ref=ref("other tree")) if e.type == "dir" else e
            for p, e in tree({"d/a": "a", "d/b": "b"}).items()}
    theirs = tree({"d/a": "a", "d/c": "c"})
    merged, conflicts = merge(base, ours, theirs)
    assert_merged(merged, {"d/a": "a", "d/b": "b", "d/c": "c"})
    assert conflicts == []


# ----------------------------------------------------------------------------- delete against modify


@pytest.mark.parametrize("deleter", ["ours", "theirs"])
@pytest.mark.parametrize(
    "modified", ["v2", Exe("v1"), Link("somewhere"), Chunked("v1")], ids=["content", "chmod", "link", "chunked"]
)
def test_delete_against_modify_keeps_the_modified(deleter: str, modified: Any) -> None:
    base = tree({"f.txt": "v1", "other": "o"})
    deleted = tree({"other": "o"})
    changed = tree({"f.txt": modified, "other": "o"})
    ours, theirs = (deleted, changed) if deleter == "ours" else (changed, deleted)
    merged, conflicts = merge(base, ours, theirs)
    assert_merged(merged, {"f.txt": modified, "other": "o"})
    assert conflicts == []


def test_deleted_on_both_sides_is_gone() -> None:
    base = tree({"f.txt": "v1", "d/g": "g"})
    merged, conflicts = merge(base, {}, {})
    assert merged == {}
    assert conflicts == []


# ----------------------------------------------------------------------------- both changed differently


def test_both_modified_theirs_keeps_the_name_ours_goes_to_a_copy() -> None:
    base = tree({"docs/report.final.pdf": "v1"})
    ours = tree({"docs/report.final.pdf": "ours"})
    theirs = tree({"docs/report.final.pdf": "theirs"})
    merged, conflicts = merge(base, ours, theirs)
    copy = "docs/report.final (conflict laptop 2026-11-22 101500).pdf"
    assert conflicts == [MergeConflict("docs/report.final.pdf", copy, "ours")]
    assert merged[copy] == dataclasses.replace(ours["docs/report.final.pdf"], name=copy[5:])
    assert merged["docs/report.final.pdf"] == theirs["docs/report.final.pdf"]
    assert set(merged) == {"docs", "docs/report.final.pdf", copy}


@pytest.mark.parametrize(
    ("name", "copy"),
    [
        ("report.final.pdf", "report.final (conflict laptop 2026-11-22 101500).pdf"),
        ("Makefile", "Makefile (conflict laptop 2026-11-22 101500)"),
        (".bashrc", ".bashrc (conflict laptop 2026-11-22 101500)"),
        (".config.json", ".config (conflict laptop 2026-11-22 101500).json"),
        ("archive.tar.gz", "archive.tar (conflict laptop 2026-11-22 101500).gz"),
        ("with space.txt", "with space (conflict laptop 2026-11-22 101500).txt"),
    ],
)
def test_conflict_copy_names(name: str, copy: str) -> None:
    base = tree({f"d/{name}": "v1"})
    merged, conflicts = merge(base, tree({f"d/{name}": "ours"}), tree({f"d/{name}": "theirs"}))
    assert conflicts == [MergeConflict(f"d/{name}", f"d/{copy}", "ours")]
    assert merged[f"d/{copy}"].name == copy
    assert key(merged[f"d/{copy}"]) == key(entry("", "ours"))
    assert key(merged[f"d/{name}"]) == key(entry("", "theirs"))


def test_both_add_the_same_path_with_different_content() -> None:
    base = tree({"other": "o"})
    ours = tree({"other": "o", "new/plan.md": "ours"})
    theirs = tree({"other": "o", "new/plan.md": "theirs"})
    merged, conflicts = merge(base, ours, theirs)
    copy = "new/plan (conflict laptop 2026-11-22 101500).md"
    assert conflicts == [MergeConflict("new/plan.md", copy, "ours")]
    assert_merged(merged, {"other": "o", "new/plan.md": "theirs", copy: "ours"})


def test_both_add_from_an_empty_base() -> None:
    merged, conflicts = merge({}, tree({"a": "ours"}), tree({"a": "theirs"}))
    assert conflicts == [MergeConflict("a", "a (conflict laptop 2026-11-22 101500)", "ours")]
    assert_merged(merged, {"a": "theirs", "a (conflict laptop 2026-11-22 101500)": "ours"})


def test_taken_conflict_copy_name_gets_device_2() -> None:
    earlier = "notes (conflict laptop 2026-11-22 101500).txt"
    base = tree({"notes.txt": "v1", earlier: "an earlier conflict"})
    ours = tree({"notes.txt": "ours", earlier: "an earlier conflict"})
    theirs = tree({"notes.txt": "theirs", earlier: "an earlier conflict"})
    merged, conflicts = merge(base, ours, theirs)
    copy = "notes (conflict laptop 2 2026-11-22 101500).txt"
    assert conflicts == [MergeConflict("notes.txt", copy, "ours")]
    assert_merged(merged, {"notes.txt": "theirs", earlier: "an earlier conflict", copy: "ours"})


def test_conflict_copy_name_taken_twice_gets_device_3() -> None:
    taken = {
        "notes (conflict laptop 2026-11-22 101500).txt": "1",
        "notes (conflict laptop 2 2026-11-22 101500).txt": "2",
    }
    base = tree({"notes.txt": "v1", **taken})
    merged, conflicts = merge(base, tree({"notes.txt": "ours", **taken}), tree({"notes.txt": "theirs", **taken}))
    copy = "notes (conflict laptop 3 2026-11-22 101500).txt"
    assert conflicts == [MergeConflict("notes.txt", copy, "ours")]
    assert_merged(merged, {"notes.txt": "theirs", copy: "ours", **taken})


def test_conflict_copy_name_taken_by_a_folder_or_by_the_other_side() -> None:
    first = "Makefile (conflict laptop 2026-11-22 101500)"
    # theirs just added a folder of that name; ours added nothing there
    base = tree({"Makefile": "v1"})
    ours = tree({"Makefile": "ours"})
    theirs = tree({"Makefile": "theirs", f"{first}/inside": "i"})
    merged, conflicts = merge(base, ours, theirs)
    copy = "Makefile (conflict laptop 2 2026-11-22 101500)"
    assert conflicts == [MergeConflict("Makefile", copy, "ours")]
    assert_merged(merged, {"Makefile": "theirs", f"{first}/inside": "i", copy: "ours"})


def test_taken_name_deleted_in_the_merge_is_free_again() -> None:
    earlier = ".bashrc (conflict laptop 2026-11-22 101500)"
    base = tree({".bashrc": "v1", earlier: "old copy"})
    ours = tree({".bashrc": "ours", earlier: "old copy"})
    theirs = tree({".bashrc": "theirs"})  # theirs cleaned the old copy up
    merged, conflicts = merge(base, ours, theirs)
    assert conflicts == [MergeConflict(".bashrc", earlier, "ours")]
    assert_merged(merged, {".bashrc": "theirs", earlier: "ours"})


@pytest.mark.parametrize("ours_kind", ["file", "link"])
def test_link_against_file(ours_kind: str) -> None:
    base = tree({"bin/current": Link("v1")})
    as_file, as_link = "a real file now", Link("v2")
    ours_spec, theirs_spec = (as_file, as_link) if ours_kind == "file" else (as_link, as_file)
    merged, conflicts = merge(base, tree({"bin/current": ours_spec}), tree({"bin/current": theirs_spec}))
    copy = "bin/current (conflict laptop 2026-11-22 101500)"
    assert conflicts == [MergeConflict("bin/current", copy, "ours")]
    assert_merged(merged, {"bin/current": theirs_spec, copy: ours_spec})
    assert merged["bin/current"].type == ("link" if ours_kind == "file" else "file")
    assert merged[copy].type == ours_kind


def test_links_retargeted_differently() -> None:
    base = tree({"l": Link("a")})
    merged, conflicts = merge(base, tree({"l": Link("b")}), tree({"l": Link("c")}))
    assert conflicts == [MergeConflict("l", "l (conflict laptop 2026-11-22 101500)", "ours")]
    assert merged["l"].ref == "c"
    assert merged["l (conflict laptop 2026-11-22 101500)"].ref == "b"


@pytest.mark.parametrize("editor", ["ours", "theirs"])
def test_exec_bit_only_change_on_one_side_applies(editor: str) -> None:
    base = tree({"run.sh": "echo"})
    changed = tree({"run.sh": Exe("echo")})
    ours, theirs = (changed, base) if editor == "ours" else (base, changed)
    merged, conflicts = merge(base, ours, theirs)
    assert conflicts == []
    assert merged["run.sh"].executable
    assert key(merged["run.sh"]) == key(changed["run.sh"])


def test_exec_bit_removed_on_one_side_applies() -> None:
    base = tree({"run.sh": Exe("echo")})
    merged, conflicts = merge(base, tree({"run.sh": "echo"}), base)
    assert conflicts == []
    assert not merged["run.sh"].executable


def test_exec_bit_on_one_side_content_on_the_other_is_a_conflict() -> None:
    # Documented rule: both changed the entry differently, so theirs keeps the name
    # (here: old content, now executable) and ours (new content) goes to a copy.
    base = tree({"run.sh": "echo"})
    ours = tree({"run.sh": "echo hello"})
    theirs = tree({"run.sh": Exe("echo")})
    merged, conflicts = merge(base, ours, theirs)
    copy = "run (conflict laptop 2026-11-22 101500).sh"
    assert conflicts == [MergeConflict("run.sh", copy, "ours")]
    assert_merged(merged, {"run.sh": Exe("echo"), copy: "echo hello"})


def test_file_grown_into_chunked_on_one_side_applies() -> None:
    base = tree({"big.bin": "small"})
    merged, conflicts = merge(base, base, tree({"big.bin": Chunked("large")}))
    assert conflicts == []
    assert merged["big.bin"].type == "chunked"


def test_several_conflicts_sorted_by_path() -> None:
    base = tree({"z.txt": "1", "a.txt": "1", "m/x.txt": "1"})
    ours = tree({"z.txt": "o", "a.txt": "o", "m/x.txt": "o"})
    theirs = tree({"z.txt": "t", "a.txt": "t", "m/x.txt": "t"})
    _, conflicts = merge(base, ours, theirs)
    assert [c.path for c in conflicts] == ["a.txt", "m/x.txt", "z.txt"]
    assert all(c.moved == "ours" and c.copy == ours_copy(c.path) for c in conflicts)


# ----------------------------------------------------------------------------- folders against files


def test_theirs_deletes_a_folder_in_which_ours_added_a_file() -> None:
    base = tree({"proj/a.txt": "a", "proj/b.txt": "b", "proj/sub/c.txt": "c", "top": "t"})
    ours = tree({"proj/a.txt": "a", "proj/b.txt": "b", "proj/sub/c.txt": "c", "proj/new.txt": "n", "top": "t"})
    theirs = tree({"top": "t"})
    merged, conflicts = merge(base, ours, theirs)
    assert conflicts == []
    assert_merged(merged, {"proj/new.txt": "n", "top": "t"})


def test_ours_deletes_a_folder_in_which_theirs_added_a_file() -> None:
    base = tree({"proj/a.txt": "a", "proj/sub/c.txt": "c"})
    ours: dict[str, TreeEntry] = {}
    theirs = tree({"proj/a.txt": "a", "proj/sub/c.txt": "c", "proj/sub/new.txt": "n"})
    merged, conflicts = merge(base, ours, theirs)
    assert conflicts == []
    assert_merged(merged, {"proj/sub/new.txt": "n"})


def retag(flat: dict[str, TreeEntry], tag: str) -> dict[str, TreeEntry]:
    """The same tree with other folder ids (as another commit of it would have)."""
    return {p: dataclasses.replace(e, ref=ref(f"{tag}:{p}")) if e.type == "dir" else e
            for p, e in flat.items()}


def test_folder_deleted_on_one_side_and_untouched_on_the_other_is_gone() -> None:
    base = tree({"proj/a.txt": "a", "proj/sub/c.txt": "c", "proj/empty": DIR, "keep": "k"})
    kept = retag(base, "another commit")
    for ours, theirs in [(tree({"keep": "k"}), kept), (kept, tree({"keep": "k"}))]:
        merged, conflicts = merge(base, ours, theirs)
        assert conflicts == []
        assert_merged(merged, {"keep": "k"})


def test_empty_folder_added_on_one_side_is_kept() -> None:
    merged, conflicts = merge({}, tree({"e": DIR}), {})
    assert_merged(merged, {"e": DIR})
    assert conflicts == []


def test_deleted_folder_survives_for_a_change_deep_inside() -> None:
    base = tree({"a/b/c/d.txt": "d", "a/b/e.txt": "e", "a/f.txt": "f", "a/g/h.txt": "h"})
    ours = tree({"a/b/c/d.txt": "d2", "a/b/e.txt": "e", "a/f.txt": "f", "a/g/h.txt": "h"})
    merged, conflicts = merge(base, ours, {})
    assert conflicts == []
    assert_merged(merged, {"a/b/c/d.txt": "d2"})


def test_conflict_deep_in_nested_folders_puts_the_copy_beside_it() -> None:
    base = tree({"a/b/c/d.txt": "d", "a/x": "x"})
    merged, conflicts = merge(base, tree({"a/b/c/d.txt": "ours", "a/x": "x"}),
                              tree({"a/b/c/d.txt": "theirs", "a/x": "x"}))
    copy = "a/b/c/d (conflict laptop 2026-11-22 101500).txt"
    assert conflicts == [MergeConflict("a/b/c/d.txt", copy, "ours")]
    assert_merged(merged, {"a/b/c/d.txt": "theirs", copy: "ours", "a/x": "x"})


def test_ours_replaces_a_folder_by_a_file_while_theirs_added_inside() -> None:
    base = tree({"proj/a.txt": "a", "proj/b.txt": "b"})
    ours = tree({"proj": "now a file"})
    theirs = tree({"proj/a.txt": "a", "proj/b.txt": "b", "proj/new.txt": "n"})
    merged, conflicts = merge(base, ours, theirs)
    copy = "proj (conflict laptop 2026-11-22 101500)"
    assert conflicts == [MergeConflict("proj", copy, "ours")]
    # ours deleted a.txt and b.txt (theirs left them alone); theirs' new file keeps the folder
    assert_merged(merged, {"proj/new.txt": "n", copy: "now a file"})
    assert merged[copy].name == copy


def test_theirs_replaces_a_folder_by_a_file_while_ours_added_inside() -> None:
    base = tree({"proj/a.txt": "a"})
    ours = tree({"proj/a.txt": "a", "proj/new.txt": "n"})
    theirs = tree({"proj": "now a file"})
    merged, conflicts = merge(base, ours, theirs)
    copy = "proj (conflict desktop 2026-11-22 094500)"
    assert conflicts == [MergeConflict("proj", copy, "theirs")]
    assert_merged(merged, {"proj/new.txt": "n", copy: "now a file"})


def test_theirs_replaces_a_folder_by_a_file_while_ours_modified_inside() -> None:
    base = tree({"proj/a.txt": "a", "proj/b.txt": "b"})
    ours = tree({"proj/a.txt": "a2", "proj/b.txt": "b"})
    theirs = tree({"proj": Link("elsewhere")})
    merged, conflicts = merge(base, ours, theirs)
    copy = "proj (conflict desktop 2026-11-22 094500)"
    assert conflicts == [MergeConflict("proj", copy, "theirs")]
    assert_merged(merged, {"proj/a.txt": "a2", copy: Link("elsewhere")})


def test_folder_replaced_by_a_file_when_nothing_merged_remains_inside() -> None:
    base = tree({"proj/a.txt": "a", "proj/b.txt": "b"})
    ours = tree({"proj": "file"})
    theirs = tree({"proj/a.txt": "a"})  # theirs only deleted inside
    merged, conflicts = merge(base, ours, theirs)
    assert conflicts == []
    assert_merged(merged, {"proj": "file"})


@pytest.mark.parametrize("file_side", ["ours", "theirs"])
def test_new_file_against_new_folder_the_folder_keeps_the_name(file_side: str) -> None:
    as_file = tree({"x.txt": "file"})
    as_dir = tree({"x.txt/inner": "i"})
    ours, theirs = (as_file, as_dir) if file_side == "ours" else (as_dir, as_file)
    merged, conflicts = merge({}, ours, theirs)
    copy = ours_copy("x.txt") if file_side == "ours" else theirs_copy("x.txt")
    assert copy == ("x (conflict laptop 2026-11-22 101500).txt" if file_side == "ours"
                    else "x (conflict desktop 2026-11-22 094500).txt")
    assert conflicts == [MergeConflict("x.txt", copy, file_side)]
    assert_merged(merged, {"x.txt/inner": "i", copy: "file"})


@pytest.mark.parametrize("file_side", ["ours", "theirs"])
def test_new_empty_folder_against_new_file(file_side: str) -> None:
    as_file, as_dir = tree({"x": Link("t")}), tree({"x": DIR})
    ours, theirs = (as_file, as_dir) if file_side == "ours" else (as_dir, as_file)
    merged, conflicts = merge({}, ours, theirs)
    copy = ours_copy("x") if file_side == "ours" else theirs_copy("x")
    assert conflicts == [MergeConflict("x", copy, file_side)]
    assert_merged(merged, {"x": DIR, copy: Link("t")})


def test_file_turned_into_folder_against_file_modified() -> None:
    base = tree({"x.txt": "v1"})
    ours = tree({"x.txt/inner": "i"})
    theirs = tree({"x.txt": "v2"})
    merged, conflicts = merge(base, ours, theirs)
    copy = "x (conflict desktop 2026-11-22 094500).txt"
    assert conflicts == [MergeConflict("x.txt", copy, "theirs")]
    assert_merged(merged, {"x.txt/inner": "i", copy: "v2"})


def test_file_turned_into_folder_against_file_deleted() -> None:
    base = tree({"x.txt": "v1"})
    merged, conflicts = merge(base, {}, tree({"x.txt/inner": "i"}))
    assert conflicts == []
    assert_merged(merged, {"x.txt/inner": "i"})


def test_file_turned_into_folder_on_one_side_only() -> None:
    base = tree({"x.txt": "v1"})
    merged, conflicts = merge(base, tree({"x.txt/inner": "i"}), base)
    assert conflicts == []
    assert_merged(merged, {"x.txt/inner": "i"})


def test_folder_and_subfolder_replaced_by_files_on_different_sides() -> None:
    # ours turns a/ into a file, theirs turns a/b/ into a file: theirs' a/b is a
    # merged change living in a/, so a/ stays a folder and ours' file is copied.
    base = tree({"a/b/c.txt": "c"})
    ours = tree({"a": "fa"})
    theirs = tree({"a/b": "fb"})
    merged, conflicts = merge(base, ours, theirs)
    copy = "a (conflict laptop 2026-11-22 101500)"
    assert conflicts == [MergeConflict("a", copy, "ours")]
    assert_merged(merged, {"a/b": "fb", copy: "fa"})


def test_nested_folder_vs_file_at_two_levels() -> None:
    # theirs made a and a/b files; ours kept adding deep inside.
    base = tree({"a/b/c.txt": "c"})
    ours = tree({"a/b/c.txt": "c", "a/b/d.txt": "d"})
    theirs = tree({"a": "fa"})
    merged, conflicts = merge(base, ours, theirs)
    assert conflicts == [MergeConflict("a", theirs_copy("a"), "theirs")]
    assert_merged(merged, {"a/b/d.txt": "d", theirs_copy("a"): "fa"})


@pytest.mark.parametrize("device", ["evil/../..", "a/b", "nul\x00byte"])
def test_hostile_device_name_still_gives_a_valid_tree(device: str) -> None:
    # theirs' file loses the name to our folder, so theirs' device names the copy
    base = tree({"d": DIR})
    ours = tree({"d/x/in": "i"})
    theirs = tree({"d/x": "file"})
    merged, conflicts = merge_trees(
        base, Side(ours, OURS_DEV, OURS_STAMP), Side(theirs, device, THEIRS_STAMP)
    )
    assert [(c.path, c.moved) for c in conflicts] == [("d/x", "theirs")]
    assert conflicts[0].copy.rpartition("/")[0] == "d"
    check_valid(merged)


def test_merge_does_not_mutate_its_inputs() -> None:
    base = tree({"proj/a.txt": "a", "x": "1"})
    ours = tree({"proj": "file", "x": "2"})
    theirs = tree({"proj/a.txt": "a", "proj/n": "n", "x": "3"})
    snapshot = (dict(base), dict(ours), dict(theirs))
    merge(base, ours, theirs)
    assert (base, ours, theirs) == snapshot


# ----------------------------------------------------------------------------- properties

# A plain name, one with an extension, a dotfile, and the name ours' conflict copy
# of "a" gets (so copy names are sometimes taken).
NAMES = ("a", "b.txt", ".c", f"a (conflict {OURS_DEV} {OURS_STAMP})")
PATHS = tuple("/".join(p) for n in (1, 2, 3) for p in itertools.product(NAMES, repeat=n))

# Each edit is one integer (one draw keeps generation fast); decode_op spells it out.
OP_KINDS = ("file", "link", "mkdir", "delete", "chmod")
EXISTING = 60  # targets below this pick an existing path (so edits hit what is there)
OPS = st.integers(0, len(OP_KINDS) * (EXISTING + len(PATHS)) * 4 * 2 * 2 - 1)


def decode_op(code: int) -> tuple[Any, ...]:
    """``(kind, target, n, executable, file type)``; an int target indexes existing paths."""
    code, kind = divmod(code, len(OP_KINDS))
    code, t = divmod(code, EXISTING + len(PATHS))
    code, n = divmod(code, 4)
    chunked, exe = divmod(code, 2)
    target: int | str = t if t < EXISTING else PATHS[t - EXISTING]
    return OP_KINDS[kind], target, n, bool(exe), "chunked" if chunked else "file"


def _remove(flat: dict[str, TreeEntry], path: str) -> None:
    for p in [p for p in flat if p == path or p.startswith(path + "/")]:
        del flat[p]


def _put(flat: dict[str, TreeEntry], path: str, new: TreeEntry) -> None:
    parts = path.split("/")
    for i in range(1, len(parts)):
        parent = "/".join(parts[:i])
        held = flat.get(parent)
        if held is None or held.type != "dir":  # a file on the way turns into a folder
            flat[parent] = TreeEntry(parts[i - 1], "dir", ref("tree"))
    old = flat.get(path)
    if old is not None and old.type == "dir" and new.type != "dir":
        _remove(flat, path)  # a folder turns into a file or link
    if old is None or old.type != "dir" or new.type != "dir":
        flat[path] = new


def apply_ops(start: dict[str, TreeEntry], ops: list[Any], tag: str) -> dict[str, TreeEntry]:
    """``ops`` applied to a copy of ``start``; building base (``start`` empty), every
    target is a fresh path."""
    flat = dict(start)
    for op in ops:
        kind, target, n, exe, ftype = decode_op(op) if isinstance(op, int) else op
        if isinstance(target, int):
            if not start:
                target = PATHS[target % len(PATHS)]
            elif flat:
                target = sorted(flat)[target % len(flat)]
            else:
                continue
        name = target.rpartition("/")[2]
        if kind == "file":
            _put(flat, target, TreeEntry(name, ftype, ref(f"{ftype}:{n}"), n, exe))
        elif kind == "link":
            _put(flat, target, TreeEntry(name, "link", f"target{n % 3}", 7))
        elif kind == "mkdir":
            _put(flat, target, TreeEntry(name, "dir", ref("tree")))
        elif kind == "delete":
            _remove(flat, target)
        elif kind == "chmod":
            held = flat.get(target)
            if held is not None and held.type in ("file", "chunked"):
                flat[target] = dataclasses.replace(held, executable=not held.executable)
    # Real folder ids differ between commits; the merge must compare folders by kind.
    return {p: dataclasses.replace(e, ref=ref(f"tree:{tag}:{p}")) if e.type == "dir" else e
            for p, e in flat.items()}


Scenario = tuple[dict[str, TreeEntry], dict[str, TreeEntry], dict[str, TreeEntry]]


@st.composite
def scenarios(draw: st.DrawFn) -> Scenario:
    base = apply_ops({}, draw(st.lists(OPS, min_size=2, max_size=10)), "base")
    ours = apply_ops(base, draw(st.lists(OPS, min_size=1, max_size=6)), "ours")
    theirs = apply_ops(base, draw(st.lists(OPS, min_size=1, max_size=6)), "theirs")
    return base, ours, theirs


def sides(ours: dict[str, TreeEntry], theirs: dict[str, TreeEntry],
          ours_dev: str = OURS_DEV, theirs_dev: str = THEIRS_DEV) -> tuple[Side, Side]:
    return Side(ours, ours_dev, OURS_STAMP), Side(theirs, theirs_dev, THEIRS_STAMP)


def test_generator_makes_valid_trees() -> None:
    ops = [("file", "a/b.txt/.c", 1, False, "file"), ("file", "a/b.txt", 2, True, "file"),
           ("mkdir", "a/b.txt", 0, False, "file"), ("link", ".c", 1, False, "file"),
           ("chmod", "a/b.txt", 0, False, "file")]
    flat = apply_ops({}, ops, "t")
    check_valid(flat)
    assert contents(flat) == {"a": ("dir",), "a/b.txt": ("dir",), ".c": ("link", "target1", False)}


def property_no_content_is_lost(s: Scenario) -> None:
    base, ours, theirs = s
    o_side, t_side = sides(ours, theirs)
    merged, conflicts = merge_trees(base, o_side, t_side)
    for side in (ours, theirs):
        for path, e in side.items():
            if e.type == "dir" or key(e) == key(base.get(path)):
                continue
            places = [path] + [c.copy for c in conflicts if c.path == path]
            assert any(key(merged.get(p)) == key(e) for p in places), (path, e)


def property_merged_is_a_valid_tree_with_sound_conflicts(s: Scenario) -> None:
    base, ours, theirs = s
    o_side, t_side = sides(ours, theirs)
    merged, conflicts = merge_trees(base, o_side, t_side)
    check_valid(merged)
    assert [c.path for c in conflicts] == sorted(c.path for c in conflicts)
    copies = {c.copy for c in conflicts}
    assert len(copies) == len(conflicts)
    for c in conflicts:
        who = o_side if c.moved == "ours" else t_side
        moved = who.tree[c.path]
        assert moved.type != "dir"
        parent, _, name = c.path.rpartition("/")
        copy_parent, _, copy_name = c.copy.rpartition("/")
        assert copy_parent == parent
        labels = [who.device] + [f"{who.device} {n}" for n in range(2, 100)]
        assert copy_name in {conflict_name(name, label, who.stamp) for label in labels}
        assert key(merged[c.copy]) == key(moved)
        assert key(merged[c.path]) != key(moved)
    for path, e in merged.items():
        if path in copies:
            continue
        o, t = ours.get(path), theirs.get(path)
        # nothing invented: every merged entry is one of the two sides' at that path
        assert key(e) in (key(o), key(t)), path


def property_per_path_rules(s: Scenario) -> None:
    base, ours, theirs = s
    merged, conflicts = merge_trees(base, *sides(ours, theirs))
    copies = {c.copy for c in conflicts}
    moved = {(c.path, c.moved): c.copy for c in conflicts}
    for path in set(base) | set(ours) | set(theirs):
        b, o, t = base.get(path), ours.get(path), theirs.get(path)
        if o is None and t is None:
            assert path not in merged or path in copies
        elif o is not None and t is not None and key(o) == key(t):
            assert key(merged[path]) == key(o)  # the same change (or none) on both sides
        elif o is not None and t is not None and "dir" not in (o.type, t.type) and key(b) not in (key(o), key(t)):
            # changed differently on both sides: theirs keeps the name, ours is copied
            assert key(merged[path]) == key(t)
            assert key(merged[moved[path, "ours"]]) == key(o)
        elif b is not None and b.type == "dir" and (o is None) != (t is None) and (o or t).type == "dir":
            # a folder deleted on one side and kept on the other (whatever its tree id)
            # survives only while something merged lives in it (its name may be
            # reused by a conflict copy, which is then not a folder)
            kept = path in merged and merged[path].type == "dir"
            assert kept == any(q.startswith(path + "/") for q in merged), path
            assert kept or path not in merged or path in copies, path
        elif (o is not None and t is not None and (o.type == "dir") != (t.type == "dir")
              and (b is None or b.type != "dir")):
            # a folder against a file or link that both differ from base: the folder wins
            file_side, f = ("ours", o) if t.type == "dir" else ("theirs", t)
            if key(f) != key(b):
                assert merged[path].type == "dir"
                assert key(merged[moved[path, file_side]]) == key(f)


def property_deterministic(s: Scenario) -> None:
    base, ours, theirs = s
    first = merge_trees(base, *sides(ours, theirs))
    again = merge_trees(base, *sides(ours, theirs))
    reordered = merge_trees(
        dict(reversed(base.items())), *sides(dict(reversed(ours.items())), dict(reversed(theirs.items())))
    )
    assert first == again == reordered
    assert (base, ours, theirs) == s  # inputs untouched


def property_one_unchanged_side_gives_the_other(s: Scenario) -> None:
    base, ours, theirs = s
    merged, conflicts = merge_trees(base, *sides(base, theirs))
    assert contents(merged) == contents(theirs)
    assert conflicts == []
    merged, conflicts = merge_trees(base, *sides(ours, base))
    assert contents(merged) == contents(ours)
    assert conflicts == []


def property_identical_sides_give_that_side(s: Scenario) -> None:
    base, ours, _ = s
    same = {p: dataclasses.replace(e, ref=ref("other tree id")) if e.type == "dir" else e
            for p, e in ours.items()}
    merged, conflicts = merge_trees(base, *sides(ours, same))
    assert contents(merged) == contents(ours)
    assert conflicts == []


def _without(merged: dict[str, TreeEntry], conflicts: list[MergeConflict]) -> dict[str, Any]:
    copies = {c.copy for c in conflicts}
    return {p: (e.name, key(e)) for p, e in merged.items() if p not in copies}


def property_swapping_device_names_only_changes_copy_names(s: Scenario) -> None:
    base, ours, theirs = s
    m1, c1 = merge_trees(base, *sides(ours, theirs, OURS_DEV, THEIRS_DEV))
    m2, c2 = merge_trees(base, *sides(ours, theirs, THEIRS_DEV, OURS_DEV))
    assert _without(m1, c1) == _without(m2, c2)
    assert [(c.path, c.moved) for c in c1] == [(c.path, c.moved) for c in c2]
    for a, b in zip(c1, c2, strict=True):
        assert key(m1[a.copy]) == key(m2[b.copy])
        assert a.copy.rpartition("/")[0] == b.copy.rpartition("/")[0]
    assert len(m1) == len(m2)


def property_same_device_and_stamp_on_both_sides_still_valid(s: Scenario) -> None:
    base, ours, theirs = s
    merged, conflicts = merge_trees(base, Side(ours, "box", OURS_STAMP), Side(theirs, "box", OURS_STAMP))
    check_valid(merged)
    assert len({c.copy for c in conflicts}) == len(conflicts)
    expected, _ = merge_trees(base, *sides(ours, theirs))
    assert len(merged) == len(expected)


PROPERTIES = [v for k, v in sorted(globals().items()) if k.startswith("property_")]


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_merge_properties(s: Scenario) -> None:
    """Every property on each random scenario (one generation for all keeps this fast)."""
    for prop in PROPERTIES:
        prop(s)


def test_all_properties_are_run() -> None:
    assert len(PROPERTIES) == 8


def test_conflict_copy_of_a_long_name_fits_a_file_name() -> None:
    """A copy of a name near the 255-byte limit shortens the stem, keeps the
    marker and the extension, and stays a valid name (multi-byte characters are
    never cut in half)."""
    from metasync.objects import check_name
    from metasync.worktree import conflict_name

    for name in ("n" * 250 + ".txt", "é" * 125 + ".md", "x" * 255):
        copy = conflict_name(name, "laptop", "2026-11-22 101500")
        assert len(copy.encode()) <= 255
        assert " (conflict laptop 2026-11-22 101500)" in copy
        assert copy.endswith(".txt" if name.endswith(".txt") else ".md" if name.endswith(".md") else ")")
        check_name(copy)
