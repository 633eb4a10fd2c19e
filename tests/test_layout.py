"""tests/ mirrors the package: a folder per subpackage, the scripts' tests in tests/scripts/,
shared helpers in tests/support/ (docs/development.md, "Development")."""

from __future__ import annotations

import ast
import re
from collections import Counter
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
PACKAGE = TESTS.parent / "collage_train"
DOCS = TESTS.parent / "docs"
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


# A module docstring says what the module is for and its contract; the reasoning,
# measurements and alternatives weighed live in docs/, under a heading the docstring names
# (docs/development.md, "Development").
MAX_MODULE_DOCSTRING_LINES = 15
# docs/design.md, "The chunked loss head": a page and one of its headings, in double quotes
CITED_HEADING = re.compile(r'docs/([\w-]+\.md),\s+"([^"]+)"')


def test_every_module_docstring_is_at_most_15_lines():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        doc = ast.get_docstring(ast.parse(path.read_text()), clean=False) or ""
        if len(doc.splitlines()) > MAX_MODULE_DOCSTRING_LINES:
            offenders.append(f"{path.relative_to(PACKAGE.parent)} ({len(doc.splitlines())})")
    assert not offenders, (
        f"module docstrings over {MAX_MODULE_DOCSTRING_LINES} lines (move the reasoning to"
        f" docs/ and name its heading): {', '.join(offenders)}"
    )


def heading_text(text: str) -> str:
    """A heading or a citation of it, compared without backticks and line breaks."""
    return " ".join(text.replace("`", "").split())


def headings(page: Path) -> set[str]:
    if not page.exists():
        return set()
    return {
        heading_text(line.lstrip("#"))
        for line in page.read_text().splitlines()
        if line.startswith("#")
    }


def test_cited_doc_headings_exist():
    """Each ``docs/PAGE.md, "Heading"`` in the package's sources names a heading there."""
    missing = [
        f'{path.relative_to(PACKAGE.parent)}: docs/{page}, "{cited}"'
        for path in sorted(PACKAGE.rglob("*.py"))
        for page, cited in CITED_HEADING.findall(path.read_text())
        if heading_text(cited) not in headings(DOCS / page)
    ]
    assert not missing, missing
