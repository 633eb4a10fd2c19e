"""Declared dependencies, the Docker image and the pinned constraints agree."""

from __future__ import annotations

import re
from importlib import metadata

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


def test_the_docker_base_image_has_a_torch_the_project_accepts():
    (base,) = re.findall(r"^FROM (\S+)", (REPO / "docker/Dockerfile").read_text(), re.MULTILINE)
    match = re.fullmatch(r"pytorch/pytorch:(\d+\.\d+\.\d+)-cuda[\d.]+-cudnn\d+-devel", base)
    assert match, f"{base}: expected an official pytorch/pytorch devel image"
    torch = declared()["torch"]
    assert Version(match[1]) in torch.specifier, (base, str(torch))
    assert Version(match[1]) >= Version("2.6")  # transformers 5 disables torch below 2.6


def test_the_pinned_constraints_satisfy_the_declared_ranges():
    ranges = declared()
    text = (REPO / "docker/constraints.txt").read_text()
    pins = dict(re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)$", text, re.MULTILINE))
    assert pins, "no pins in docker/constraints.txt"
    assert "torch" not in pins  # the base image's CUDA build stays
    for name, version in pins.items():
        requirement = ranges.get(canonicalize_name(name))
        if requirement is not None:
            assert Version(version) in requirement.specifier, (name, version, str(requirement))
    missing = set(ranges) - {canonicalize_name(n) for n in pins} - {"torch"}
    assert not missing, f"declared but not pinned: {sorted(missing)}"


def test_floors_cover_what_the_code_uses_and_deepspeed_is_capped():
    ranges = declared()
    assert floor(ranges["torch"]) >= Version("2.6")
    assert floor(ranges["transformers"]) >= Version("4.53")  # transformers.masking_utils
    assert floor(ranges["deepspeed"]) >= Version("0.18.3")  # bf16 optimizer states
    assert any(s.operator == "<" for s in ranges["deepspeed"].specifier)


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
