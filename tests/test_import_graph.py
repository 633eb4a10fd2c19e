"""The package's units import each other in one direction: no cycle between the top-level
modules and subpackages of collage_train, lazy (function-level) imports included."""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

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


def test_no_import_cycle_between_units():
    graph = unit_graph()
    cycle = find_cycle(graph)
    if cycle:
        edges = [f"{a} -> {b} ({', '.join(graph[a][b][:2])})" for a, b in itertools.pairwise(cycle)]
        raise AssertionError("import cycle: " + "; ".join(edges))


def test_the_check_finds_a_cycle_and_lazy_imports_count():
    graph = {"a": {"b": ["a.py:1"]}, "b": {"c": ["b.py:9"]}, "c": {"a": ["c.py:3"]}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b": []}, "b": {}}) is None
    lazy = "def f():\n    from collage_train.optim import AdamW\n"
    (node,) = [n for n in ast.walk(ast.parse(lazy)) if isinstance(n, ast.ImportFrom)]
    assert _imported(node, "collage_train.precision.base", False) == ["collage_train.optim"]
    relative = ast.parse("from ..metrics import descent").body[0]
    assert _imported(relative, "collage_train.optim.base", False) == ["collage_train.metrics"]
