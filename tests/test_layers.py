"""The code keeps its shape: layers call downward only, nothing imports in a
circle, and no core module or class grows past what one person can hold.

The layers are read from the table in docs/design.md ("Layers"), so the map
there and the code cannot drift apart: a new module must be placed in the
table, and an import that goes upward fails here. Every import counts --
top-level, inside functions and under ``TYPE_CHECKING`` -- so a function-level
import cannot hide a cycle.
"""

from __future__ import annotations

import ast
import fnmatch
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
#: Source folders and the package each installs as (pyproject.toml).
PACKAGES = {"metasync": "metasync", "backends": "metasync.backends",
            "translators": "metasync.translators"}
#: Size limits of the core (metasync/): lines per module, lines per class.
MAX_MODULE_LINES = 800
MAX_CLASS_LINES = 400


def modules() -> dict[str, Path]:
    """Every module, by dotted name."""
    found: dict[str, Path] = {}
    for folder, package in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT / folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            found[".".join([package, *parts])] = path
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The project modules ``name`` imports anywhere in its file."""
    tree = ast.parse(path.read_text(), str(path))
    out: set[str] = set()

    def resolve(target: str) -> str | None:
        while target and target not in known:
            target = target.rpartition(".")[0]
        return target or None

    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join([*anchor, base]) if base else ".".join(anchor)
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base
                       for a in node.names]
        else:
            continue
        for target in targets:
            if target.split(".")[0] != "metasync":
                continue
            resolved = resolve(target)
            if resolved is not None and resolved != name:
                out.add(resolved)
    return out


def layer_table() -> list[tuple[str, list[str]]]:
    """``(layer, module patterns)`` from docs/design.md, top layer first."""
    text = (ROOT / "docs" / "design.md").read_text()
    match = re.search(r"<!-- layers: begin -->(.*?)<!-- layers: end -->", text, re.S)
    assert match, "docs/design.md has no layer table between <!-- layers: begin/end --> markers"
    rows = []
    for line in match.group(1).splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or not cells[1] or cells[0] in ("Layer",) or set(cells[0]) <= {"-"}:
            continue
        rows.append((cells[0], re.findall(r"`([^`]+)`", cells[1])))
    assert rows, "the layer table in docs/design.md is empty"
    return rows


KNOWN = modules()
GRAPH = {name: imports(name, path, KNOWN) for name, path in KNOWN.items()}


def rank_of() -> dict[str, tuple[int, str]]:
    """Module -> (rank, layer name); the bottom layer has rank 0."""
    table = layer_table()
    ranks: dict[str, tuple[int, str]] = {}
    for position, (layer, patterns) in enumerate(table):
        rank = len(table) - 1 - position
        for module in KNOWN:
            if any(fnmatch.fnmatchcase(module, p) for p in patterns):
                assert module not in ranks, f"{module} is in two layers ({ranks[module][1]}, {layer})"
                ranks[module] = (rank, layer)
    return ranks


def test_every_module_has_a_layer() -> None:
    ranks = rank_of()
    missing = sorted(set(KNOWN) - set(ranks))
    assert not missing, f"place these in docs/design.md's layer table: {missing}"


def test_imports_go_downward_only() -> None:
    """A module imports only from its own layer or the layers below it."""
    ranks = rank_of()
    upward = [f"{src} ({ranks[src][1]}) imports {dst} ({ranks[dst][1]})"
              for src, targets in GRAPH.items() for dst in sorted(targets)
              if src in ranks and dst in ranks and ranks[dst][0] > ranks[src][0]]
    assert not upward, "upward imports:\n" + "\n".join(upward)


def test_no_import_cycles() -> None:
    """No cycle anywhere, counting imports inside functions and TYPE_CHECKING
    blocks (so a lazy import cannot hide one)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    counter = 0

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        nonlocal counter
        index[v] = low[v] = counter
        counter += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(GRAPH[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for module in sorted(GRAPH):
        if module not in index:
            visit(module)
    assert not cycles, f"import cycles: {cycles}"


@pytest.mark.parametrize("name", sorted(n for n in KNOWN if n.split(".")[1:2] not in (
    ["backends"], ["translators"])))
def test_core_modules_and_classes_stay_small(name: str) -> None:
    """No module under metasync/ over MAX_MODULE_LINES lines, no class over
    MAX_CLASS_LINES: a part that grows past them holds more than one job."""
    path = KNOWN[name]
    source = path.read_text()
    lines = source.count("\n")
    assert lines <= MAX_MODULE_LINES, f"{path} has {lines} lines (limit {MAX_MODULE_LINES})"
    big = [(node.name, node.end_lineno - node.lineno + 1)
           for node in ast.walk(ast.parse(source))
           if isinstance(node, ast.ClassDef) and node.end_lineno is not None
           and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES]
    assert not big, f"{path}: classes over {MAX_CLASS_LINES} lines: {big}"


def test_the_check_catches_an_upward_import_and_a_cycle(tmp_path: Path) -> None:
    """The checker itself: an upward edge and a two-module cycle are both found."""
    global GRAPH
    saved = GRAPH
    try:
        GRAPH = {**saved, "metasync.store": {*saved["metasync.store"], "metasync.repository"}}
        with pytest.raises(AssertionError, match="upward imports"):
            test_imports_go_downward_only()
        with pytest.raises(AssertionError, match="import cycles"):
            test_no_import_cycles()
    finally:
        GRAPH = saved
