"""Every name of this repository that the documentation cites exists.

Checked in README.md and docs/*.md (not docs/results-history.md: its dated entries are
never edited and cite names as they were), and in the comments and docstrings of
collage_train's own sources (.py, .c):

- paths starting ``collage_train/``, ``tests/``, ``scripts/``, ``configs/`` or ``docs/``
  (a file or folder), with ``::test_name`` (a function or class of that test file);
- dotted names starting ``collage_train.``: the longest prefix that is a module, then
  each further part an attribute of it (looked up in the module's source; imported and
  ``getattr``'d only where the source does not show it);
- in Markdown's inline code only, short forms of such names: ``errors.first_line``
  (a top-level module of collage_train and an attribute) or ``optim.collage.kernels.X``
  (a subpackage and at least two more parts), and of such paths: ``optim/adamw.py``
  (a subpackage's .py or .c file). Config keys (the first column of
  docs/config.md: ``optim.lr``), file names (``metrics.jsonl``) and ``NOT_OURS`` are not
  names of the package.

Other projects' names (``torch.optim.AdamW``), URLs and placeholders (``configs/<group>``,
``tests/**``) are not checked.
"""

from __future__ import annotations

import ast
import functools
import importlib
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "collage_train"
DOCS = [
    REPO / "README.md",
    *(p for p in sorted((REPO / "docs").glob("*.md")) if p.name != "results-history.md"),
]
SOURCES = sorted(p for p in PACKAGE.rglob("*") if p.suffix in {".py", ".c"})

PATH = re.compile(
    r"(?<![\w/.~$-])((?:collage_train|tests|scripts|configs|docs)/[\w./-]*)((?:::[\w\[\]-]+)*)"
)
DOTTED = re.compile(r"(?<![\w./-])(collage_train(?:\.\w+)+)")
SHORT = re.compile(r"(?<![\w./-])([A-Za-z_]\w*(?:\.\w+)+)")
IN_PACKAGE = re.compile(r"(?<![\w./-])([a-z_]+/[\w/]*\.(?:py|c))(?![\w/])")
PLACEHOLDER = "*<{"
FILE_SUFFIXES = {"py", "c", "json", "jsonl", "pt", "safetensors", "yaml", "md", "txt", "log"}
# a variable named like one of our modules: the torch tensor ``loss``
NOT_OURS = {"loss.backward"}


@functools.cache
def config_keys() -> frozenset[str]:
    """The configuration's keys (``optim.lr``), as docs/config.md's tables list them."""
    text = (REPO / "docs" / "config.md").read_text()
    return frozenset(re.findall(r"^\| `([\w.]+)` \|", text, re.MULTILINE))


@functools.cache
def top_level() -> tuple[frozenset[str], frozenset[str]]:
    """collage_train's top-level modules and its subpackages, by name."""
    modules = {p.stem for p in PACKAGE.glob("*.py")}
    packages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    return frozenset(modules), frozenset(packages)


@functools.cache
def module_tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text())


def defined(body: list[ast.stmt]) -> dict[str, ast.AST]:
    """The names a module's or class's body binds, with what binds them."""
    names: dict[str, ast.AST] = {}
    for node in body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names[node.name] = node
        elif isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                for name in ast.walk(target):
                    if isinstance(name, ast.Name):
                        names[name.id] = node
        elif isinstance(node, ast.Import | ast.ImportFrom):
            for alias in node.names:
                names[(alias.asname or alias.name).split(".")[0]] = node
        elif isinstance(node, ast.If | ast.Try):
            for inner in (node.body, node.orelse, *(h.body for h in getattr(node, "handlers", ()))):
                names.update(defined(inner))
    return names


def module_file(parts: list[str]) -> Path | None:
    """The source file of the module ``collage_train.<parts>``, if there is one."""
    base = PACKAGE.joinpath(*parts)
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if parts and candidate.is_file():
            return candidate
    return None


def attribute_exists(module: str, source: Path, attributes: list[str]) -> bool:
    body = module_tree(source).body
    for position, attribute in enumerate(attributes):
        node = defined(body).get(attribute)
        if isinstance(node, ast.ClassDef):
            body = node.body
        elif node is not None and position == len(attributes) - 1:
            return True
        else:
            break  # not visible in the source (or bound by an import): ask Python
    else:
        return True
    try:
        value = importlib.import_module(module)
        for attribute in attributes:
            value = getattr(value, attribute)
    except (ImportError, AttributeError):
        return False
    return True


@functools.cache
def dotted_missing(name: str) -> bool:
    """Whether ``collage_train.x.y...`` names no module or attribute of the package."""
    parts = name.split(".")[1:]
    if not parts:
        return False
    for split in range(len(parts), 0, -1):
        source = module_file(parts[:split])
        if source is not None:
            module = ".".join(["collage_train", *parts[:split]])
            return not attribute_exists(module, source, parts[split:])
    return True


def selector_exists(path: Path, selector: str) -> bool:
    """Whether ``path::a::b`` names a function or class (and a method of it) of a test file."""
    body = module_tree(path).body
    for part in selector.strip(":").split("::"):
        node = defined(body).get(re.sub(r"\[.*\]$", "", part))
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            return False
        body = node.body if isinstance(node, ast.ClassDef) else []
    return True


def path_missing(path: str, selector: str) -> bool:
    target = REPO / path
    if not target.exists():
        # a placeholder: configs/model/NAME.yaml
        return not any(re.fullmatch(r"[A-Z]+", Path(part).stem) for part in Path(path).parts)
    return bool(selector) and not (target.suffix == ".py" and selector_exists(target, selector))


def short_form(name: str) -> str | None:
    """The full ``collage_train.`` name an inline-code short form stands for, or None
    where it is not one (a config key, a file name, another object's attribute)."""
    parts = name.split(".")
    modules, packages = top_level()
    if name in NOT_OURS or parts[-1] in FILE_SUFFIXES or ".".join(parts[:2]) in config_keys():
        return None
    if parts[0] in modules or (parts[0] in packages and len(parts) >= 3):
        return "collage_train." + name
    return None


def inline_code(text: str) -> list[str]:
    """The inline code spans of a Markdown text (not its fenced blocks)."""
    spans, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
        elif not fenced:
            spans += re.findall(r"`([^`]+)`", line)
    return spans


def stale_names(text: str, *, markdown: bool) -> list[str]:
    """Each cited name of ``text`` that does not exist, in order, once."""
    stale: list[str] = []
    for match in PATH.finditer(text):
        path, selector = match[1].rstrip("."), match[2]
        if text[match.end(1) : match.end(1) + 1] in tuple(PLACEHOLDER):
            continue
        if path_missing(path, selector):
            stale.append(path + selector)
    for match in DOTTED.finditer(text):
        if dotted_missing(match[1]):
            stale.append(match[1])
    if markdown:
        for span in inline_code(text):
            for match in IN_PACKAGE.finditer(span):
                top = match[1].split("/")[0]
                if top in top_level()[1] and not (PACKAGE / match[1]).is_file():
                    stale.append(match[1])
            for match in SHORT.finditer(span):
                full = short_form(match[1])
                if full is not None and dotted_missing(full):
                    stale.append(match[1])
    return list(dict.fromkeys(stale))


def prose_of_source(path: Path) -> str:
    """A source file's comments and triple-quoted strings (docstrings), or a .c file's
    comments: the code's one-line strings (``"collage_train.token_shards"``, a format
    name) are values, not citations. Line by line, not tokenized: this runs on every
    file of the package."""
    text = path.read_text()
    if path.suffix == ".c":
        return "\n".join(re.findall(r"/\*.*?\*/|//[^\n]*", text, re.DOTALL))
    kept, in_string = [], False
    for line in text.splitlines():
        quotes = line.count('"""') + line.count("'''")
        if in_string or quotes:
            kept.append(line)
        elif "#" in line:
            kept.append(line[line.index("#") :])
        in_string ^= quotes % 2 == 1
    return "\n".join(kept)


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_name_the_documentation_cites_exists(path):
    assert not stale_names(path.read_text(), markdown=True)


def test_every_name_the_package_cites_in_its_comments_exists():
    stale = {
        str(path.relative_to(REPO)): names
        for path in SOURCES
        if (names := stale_names(prose_of_source(path), markdown=False))
    }
    assert not stale


def test_a_stale_name_is_found_and_other_projects_names_are_not():
    fine = (
        "`collage_train.planning.memory_plan.recompute_peak`, `errors.first_line`,\n"
        "`planning.memory_plan.STEP_TRANSIENT`,\n"
        "`optim.collage.kernels.compiled_matches_eager`, `optim/collage/adamw.py`,\n"
        "`optim.lr`, `metrics.edq_every`, `metrics.jsonl`, `loss.backward()`,\n"
        "`torch.optim.AdamW`, `engine.compile()`, python -m collage_train.plan,\n"
        "tests/engine/test_zero.py, scripts/bench_train.py, configs/precision/collage_plus.yaml,\n"
        "tests/test_docs_names.py::test_a_stale_name_is_found_and_other_projects_names_are_not,\n"
        "configs/<group>/<option>.yaml, configs/model/NAME.yaml, docs/*.md, docs/design.md.\n"
        "https://github.com/x/y/tests/test_gone.py, collage_train.optim.adamw.AdamW.step.\n"
        "```\nfrom collage_train.metrics.edq import partials_close\n```\n"
    )
    assert stale_names(fine, markdown=True) == []
    stale = (
        "tests/test_zero.py, tests/test_docs_names.py::test_gone, scripts/gone.py,\n"
        "configs/precision/gone.yaml, collage_train.gone, collage_train.optim.adamw.Gone,\n"
        "`metrics.descent.partials_close`, `optim.kernels.compiled_matches_eager`,\n"
        "`errors.GONE`, `optim/gone.py`.\n"
    )
    assert stale_names(stale, markdown=True) == [
        "tests/test_zero.py",
        "tests/test_docs_names.py::test_gone",
        "scripts/gone.py",
        "configs/precision/gone.yaml",
        "collage_train.gone",
        "collage_train.optim.adamw.Gone",
        "metrics.descent.partials_close",
        "optim.kernels.compiled_matches_eager",
        "errors.GONE",
        "optim/gone.py",
    ]
    # outside Markdown only full names and paths count: code reads ``self.optim.x``
    assert stale_names(stale, markdown=False) == stale_names(stale, markdown=True)[:6]
