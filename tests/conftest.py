"""Shared fixtures: a small real-text corpus and a runner for the real CLI."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


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


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str

    @property
    def error_lines(self) -> list[str]:
        return [line for line in self.stderr.splitlines() if line.startswith("error:")]


def tiny_overrides(corpus: Path, cache: Path, run_dir: Path) -> list[str]:
    """A 2-layer GPT on the small corpus: a few seconds per run."""
    return [
        "model.hidden_size=32",
        "model.num_layers=2",
        "model.num_heads=2",
        "data=files",
        f"data.paths=[{corpus}]",
        "data.vocab_size=512",
        "data.seq_len=32",
        "data.tokenizer_train_chars=200000",
        "data.val_fraction=0.05",
        f"data.cache_dir={cache}",
        "train.micro_batch_size=4",
        "train.global_batch_size=8",
        "train.max_steps=8",
        "train.eval_every=4",
        "train.eval_batches=2",
        "train.checkpoint_every=4",
        "optim.warmup_steps=2",
        "logging.log_every=2",
        "logging.console=plain",
        "logging.wandb.mode=disabled",
        f"hydra.run.dir={run_dir}",
    ]


def run_cli(*args: str, module: str = "collage_train", timeout: float = 600) -> Result:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "WANDB_SILENT": "true"}
    proc = subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return Result(proc.returncode, proc.stdout, proc.stderr)


@pytest.fixture
def tiny(corpus_dir, cache_dir, tmp_path):
    """Runs the CLI on the tiny setup in ``tmp_path/run``; extra overrides win."""
    run_dir = tmp_path / "run"

    def _run(*extra: str, run_dir: Path = run_dir) -> Result:
        return run_cli(*tiny_overrides(corpus_dir, cache_dir, run_dir), *extra)

    _run.run_dir = run_dir
    return _run
