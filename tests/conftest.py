"""Shared fixtures: a small real-text corpus and a runner for the real CLI."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import pytest
from cli_runner import Result, run_cli, tiny_overrides
from tiny_config import compose_tiny

from collage_train.config import register_schemas

register_schemas()


_LAUNCH_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                     "MASTER_PORT")  # fmt: skip


@pytest.fixture(autouse=True)
def _launch_environment_is_restored():
    """Undo launch variables a test exported (a lone process group exports them, and a
    LOCAL_RANK left behind makes later in-process runs wait for another rank's data)."""
    import os

    saved = {name: os.environ.get(name) for name in _LAUNCH_VARIABLES}
    yield
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture(scope="session")
def corpus_dir(tmp_path_factory) -> Path:
    """About 400 KB of real Python source (a slice of the stdlib) as .txt documents."""
    root = tmp_path_factory.mktemp("corpus")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    total = 0
    for path in sorted(stdlib.glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        (root / f"{path.stem}.txt").write_text(text)
        total += len(text)
        if total > 400_000:
            break
    return root


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")


@pytest.fixture
def tiny(corpus_dir, cache_dir, tmp_path):
    """Runs the CLI on the tiny setup in ``tmp_path/run``; extra overrides win."""
    run_dir = tmp_path / "run"

    def _run(*extra: str, run_dir: Path = run_dir) -> Result:
        return run_cli(*tiny_overrides(corpus_dir, cache_dir, run_dir), *extra)

    _run.run_dir = run_dir
    return _run


@pytest.fixture
def make_cfg(corpus_dir, cache_dir):
    """Composes the real config for a tiny in-process run; extra overrides win."""

    def _make(*overrides):
        run_length = ["train.max_steps=4", "train.eval_every=2", "logging.log_every=1"]
        return compose_tiny(corpus_dir, cache_dir, *run_length, *overrides)

    return _make
