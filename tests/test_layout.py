"""tests/ mirrors the package: a folder per subpackage, the scripts' tests in tests/scripts/,
shared helpers in tests/support/ (docs/development.md, "Development")."""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
PACKAGE = TESTS.parent / "collage_train"
OWN_FOLDERS = {"scripts", "support"}


def test_each_folder_is_a_subpackage_or_the_scripts_or_support():
    subpackages = {p.parent.name for p in PACKAGE.glob("*/__init__.py")}
    folders = {p.name for p in TESTS.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert folders - OWN_FOLDERS <= subpackages, folders - OWN_FOLDERS - subpackages
    assert not list((TESTS / "support").glob("test_*.py"))  # helpers only


def test_test_file_names_are_unique_across_folders():
    names = Counter(p.name for p in TESTS.rglob("test_*.py"))
    assert not [name for name, count in names.items() if count > 1]


@pytest.mark.slow
def test_no_test_module_imports_another():
    """Shared helpers live in tests/support/, not in test files other tests import."""
    for path in TESTS.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                assert not node.module.startswith("test_"), (path, node.module)
            elif isinstance(node, ast.Import):
                assert not any(a.name.startswith("test_") for a in node.names), path


# The package's map (docs/design.md): the CLI, the trainer and the ``python -m`` entry
# points at the top of collage_train/, everything else in the subpackage of its concern.
MAX_TOP_LEVEL_MODULES = 16


def test_the_package_top_level_holds_at_most_16_modules():
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL_MODULES, top
