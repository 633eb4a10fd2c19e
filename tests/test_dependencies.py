"""Declared dependencies: floors that cover what the code uses, each one used. (The Docker
image and its pins against them: tests/test_docker_image.py.)"""

from __future__ import annotations

from importlib import metadata

import pytest
from cli_runner import REPO
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version


def declared() -> dict[str, Requirement]:
    """pyproject.toml's dependencies, as the installed package's metadata has them
    (``make`` reinstalls when pyproject.toml changes); extras left out."""
    requirements = [Requirement(r) for r in metadata.requires("collage_train") or []]
    return {canonicalize_name(r.name): r for r in requirements if r.marker is None}


def floor(requirement: Requirement) -> Version:
    (lowest,) = [Version(s.version) for s in requirement.specifier if s.operator == ">="]
    return lowest


def test_floors_cover_what_the_code_uses_and_deepspeed_is_capped():
    ranges = declared()
    assert floor(ranges["torch"]) >= Version("2.6")
    assert floor(ranges["transformers"]) >= Version("4.53")  # transformers.masking_utils
    assert floor(ranges["deepspeed"]) >= Version("0.18.3")  # bf16 optimizer states
    assert any(s.operator == "<" for s in ranges["deepspeed"].specifier)


@pytest.mark.slow
def test_every_declared_dependency_is_imported_by_the_package():
    """Declared means used: each dependency provides a module that collage_train imports."""
    import ast
    from importlib.metadata import packages_distributions

    imported: set[str] = set()
    for path in (REPO / "collage_train").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                imported.add(node.module.split(".")[0])
    provided: dict[str, set[str]] = {}
    for module, distributions in packages_distributions().items():
        for distribution in distributions:
            provided.setdefault(canonicalize_name(distribution), set()).add(module)
    unused = [name for name in declared() if not provided.get(name, set()) & imported]
    assert not unused, f"declared but never imported: {unused}"
