"""The package's units import each other in one direction: no cycle between the top-level
modules and subpackages of collage_train, nor between its module files, lazy
(function-level) and ``TYPE_CHECKING`` imports included."""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "collage_train"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _unit(module: str) -> str:
    """``collage_train.optim.adamw`` -> ``optim``; the package's own ``__init__`` -> itself."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "collage_train"


def _imported(node: ast.AST, module: str, is_package: bool) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if isinstance(node, ast.ImportFrom):
        if node.level == 0:
            return [node.module or ""]
        base = module.split(".")
        base = base[: len(base) - node.level + (1 if is_package else 0)]
        return [".".join([*base, *([node.module] if node.module else [])])]
    return []


def unit_graph() -> dict[str, dict[str, list[str]]]:
    """unit -> {imported unit: ["file:line", ...]} over every import statement, wherever it
    stands in the file."""
    graph: dict[str, dict[str, list[str]]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        module = _module_name(path)
        source = _unit(module)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            for target in _imported(node, module, path.name == "__init__.py"):
                if not target.startswith("collage_train."):
                    continue
                unit = _unit(target)
                if unit != source:
                    where = f"{path.relative_to(PACKAGE.parent)}:{node.lineno}"
                    graph.setdefault(source, {}).setdefault(unit, []).append(where)
    return graph


def _files() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its ``__init__``)."""
    return {_module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def _file_targets(node: ast.AST, module: str, is_package: bool, modules: set[str]) -> list[str]:
    """The package's modules an import statement imports: ``from pkg import name`` imports
    ``pkg.name`` where that is a module, else ``pkg`` itself."""
    targets = []
    for target in _imported(node, module, is_package):
        if isinstance(node, ast.ImportFrom):
            submodules = [f"{target}.{alias.name}" for alias in node.names]
            targets += [sub if sub in modules else target for sub in submodules]
        else:
            targets.append(target)
    return [target for target in dict.fromkeys(targets) if target in modules]


def file_graph() -> dict[str, dict[str, list[str]]]:
    """module -> {imported module: ["file:line", ...]} over every import statement of every
    module file (top-level, in functions, under ``TYPE_CHECKING``)."""
    files = _files()
    graph: dict[str, dict[str, list[str]]] = {}
    for module, path in files.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            for target in _file_targets(node, module, path.name == "__init__.py", set(files)):
                if target != module:
                    where = f"{path.relative_to(PACKAGE.parent)}:{node.lineno}"
                    graph.setdefault(module, {}).setdefault(target, []).append(where)
    return graph


def find_cycle(graph: dict[str, dict[str, list[str]]]) -> list[str] | None:
    """One cycle of the graph as [a, b, ..., a], or None."""
    state: dict[str, str] = {}
    trail: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        trail.append(node)
        for nxt in sorted(graph.get(node, {})):
            if state.get(nxt) == "open":
                return [*trail[trail.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        trail.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


@pytest.mark.slow
def test_no_import_cycle_between_units():
    graph = unit_graph()
    cycle = find_cycle(graph)
    if cycle:
        edges = [f"{a} -> {b} ({', '.join(graph[a][b][:2])})" for a, b in itertools.pairwise(cycle)]
        raise AssertionError("import cycle: " + "; ".join(edges))


# Known file-level cycles, each by the edge that closes it, to be removed (not added to):
# the test fails once the edge is gone, so that its entry goes with it.
KNOWN_BACK_EDGES: set[tuple[str, str]] = set()  # (importer, imported) pairs still to untangle


@pytest.mark.slow
def test_no_import_cycle_between_files():
    graph = file_graph()
    for source, target in KNOWN_BACK_EDGES:
        closes = target in graph.get(source, {}) and source in graph.get(target, {})
        assert closes, f"{source} and {target} no longer import each other: drop the entry"
        del graph[source][target]
    cycle = find_cycle(graph)
    if cycle:
        edges = [f"{a} -> {b} ({', '.join(graph[a][b][:2])})" for a, b in itertools.pairwise(cycle)]
        raise AssertionError("import cycle: " + "; ".join(edges))


@pytest.mark.slow
def test_the_file_graph_counts_every_kind_of_import():
    modules = {
        "collage_train.data",
        "collage_train.data.tokenizer",
        "collage_train.data.hf_files",
        "collage_train.checkpoint",
        "collage_train.checkpoint.native",
    }
    source = (
        "from typing import TYPE_CHECKING\n"
        "import collage_train.checkpoint.native\n"
        "from . import hf_files, DataError\n"
        "if TYPE_CHECKING:\n"
        "    from collage_train.checkpoint import native\n"
        "def f():\n"
        "    from collage_train.data.hf_files import write_transformers_files\n"
    )
    found = [
        _file_targets(node, "collage_train.data.tokenizer", False, modules)
        for node in ast.walk(ast.parse(source))
    ]
    assert sorted(target for targets in found for target in targets) == [
        "collage_train.checkpoint.native",
        "collage_train.checkpoint.native",
        "collage_train.data",
        "collage_train.data.hf_files",
        "collage_train.data.hf_files",
    ]  # "from . import hf_files, DataError": the submodule, and the package for the name
    # the graph is over the package's real files and holds the edges of a known import
    graph = file_graph()
    assert "collage_train.checkpoint.full_state" in graph["collage_train.checkpoint.native"]


def test_the_check_finds_a_cycle_and_lazy_imports_count():
    graph = {"a": {"b": ["a.py:1"]}, "b": {"c": ["b.py:9"]}, "c": {"a": ["c.py:3"]}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b": []}, "b": {}}) is None
    lazy = "def f():\n    from collage_train.optim import AdamW\n"
    (node,) = [n for n in ast.walk(ast.parse(lazy)) if isinstance(n, ast.ImportFrom)]
    assert _imported(node, "collage_train.precision.base", False) == ["collage_train.optim"]
    relative = ast.parse("from ..metrics import descent").body[0]
    assert _imported(relative, "collage_train.optim.base", False) == ["collage_train.metrics"]


# Units a unit must not import: the model knows nothing of precision, parallelism, the
# planner or the run; the configuration's schema is plain data.
FORBIDDEN_IMPORTS = {
    "model": {"comm", "engine", "optim", "planning", "precision", "run", "scalify", "trainer"},
    "config": {"checkpoint", "comm", "data", "engine", "evaluation", "metrics", "model",
               "optim", "planning", "precision", "run", "scalify", "trainer"},
}  # fmt: skip


@pytest.mark.slow
def test_lower_units_import_nothing_of_the_layers_above():
    graph = unit_graph()
    found = {
        f"{unit} -> {target} ({', '.join(graph[unit][target][:2])})"
        for unit, forbidden in FORBIDDEN_IMPORTS.items()
        for target in set(graph.get(unit, {})) & forbidden
    }
    assert not found, sorted(found)
