"""collage_train.model.hf_modeling: transformers' modeling classes without the quantization
libraries transformers would import, so that a run's output starts with its own lines."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import os
import re
import subprocess
import sys

import pytest
from cli_runner import REPO, tiny_overrides

from collage_train.model.hf_modeling import __all__ as MODELING_NAMES
from collage_train.model.hf_modeling import import_without

# Libraries of the dev extras that the default run never uses.
UNUSED = ("torchao", "bitsandbytes", "lm_eval")


@pytest.fixture
def probe(tmp_path, monkeypatch):
    """A package ``hidden_pkg`` and a module ``probe_mod`` that records, at its import,
    what ``find_spec`` answers for it (transformers' availability check)."""
    (tmp_path / "hidden_pkg").mkdir()
    (tmp_path / "hidden_pkg" / "__init__.py").write_text("VALUE = 7\n")
    (tmp_path / "probe_mod.py").write_text(
        "import importlib.util\nFOUND = importlib.util.find_spec('hidden_pkg')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    for name in ("hidden_pkg", "probe_mod"):
        sys.modules.pop(name, None)


def test_a_hidden_package_looks_uninstalled_during_the_import_only(probe):
    import_without("probe_mod", ("hidden_pkg",))
    assert sys.modules["probe_mod"].FOUND is None
    assert "hidden_pkg" not in sys.modules
    assert importlib.import_module("hidden_pkg").VALUE == 7  # importable afterwards


def test_an_imported_package_is_left_as_it_is(probe):
    hidden = importlib.import_module("hidden_pkg")
    import_without("probe_mod", ("hidden_pkg",))
    assert sys.modules["probe_mod"].FOUND is not None
    assert sys.modules["hidden_pkg"] is hidden


def test_the_package_takes_the_modeling_classes_from_hf_modeling():
    """Importing them from transformers would import its modeling stack, torchao with it."""
    direct = []
    for path in sorted((REPO / "collage_train").rglob("*.py")):
        if path.relative_to(REPO).as_posix() == "collage_train/model/hf_modeling.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("transformers"):
                names = {alias.name for alias in node.names} & set(MODELING_NAMES)
                if names or node.module == "transformers.modeling_utils":
                    direct.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert not direct, f"import these from collage_train.model.hf_modeling: {direct}"


# ``python -m collage_train ARGS`` that writes, as it exits, the modules it imported
# (``-X importtime`` misses those imported through importlib, as transformers imports its own).
RECORDING_CLI = """
import atexit, os, runpy, sys
atexit.register(lambda: open(os.environ["MODULES_FILE"], "w").write("\\n".join(sys.modules)))
runpy.run_module("collage_train", run_name="__main__", alter_sys=True)
"""


@pytest.mark.slow
def test_the_cli_imports_no_unused_library_and_starts_with_its_own_lines(
    corpus_dir, cache_dir, tmp_path
):
    assert importlib.util.find_spec("torchao"), "the dev extras install torchao"
    modules_file = tmp_path / "modules.txt"
    tiny = tiny_overrides(corpus_dir, cache_dir, tmp_path / "run")
    proc = subprocess.run(
        [sys.executable, "-c", RECORDING_CLI, *tiny, "train.max_steps=1", "train.export_hf=false"],
        cwd=REPO,
        env={**os.environ, "MODULES_FILE": str(modules_file), "WANDB_SILENT": "true"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    imported = set(modules_file.read_text().splitlines())
    assert {"collage_train.trainer", "transformers.modeling_utils"} <= imported
    assert not {name for name in imported if name.split(".")[0] in UNUSED}
    assert not re.search(r"torchao|_pytree|Failed to load", proc.stderr)
    # everything before the start line is a line the trainer's own loggers wrote
    lines = proc.stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("gpt_tiny ("))
    assert all(re.match(r"\[[^]]*\]\[collage_train\.", line) for line in lines[:start])
