"""Helpers the benchmark scripts share: run the real CLI, describe the machine, record."""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "docs" / "RESULTS.md"


def run_training(
    overrides: list[str], run_dir: Path, env: dict[str, str] | None = None
) -> tuple[dict, list[dict]]:
    """Run ``python -m collage_train`` with ``overrides`` in ``run_dir``.

    ``env`` adds to (or replaces in) this process's environment. Returns the summary and
    the metric records; raises with the CLI's error on failure.
    """
    command = [sys.executable, "-m", "collage_train", *overrides, f"hydra.run.dir={run_dir}"]
    proc = subprocess.run(
        command, cwd=REPO, capture_output=True, text=True, env={**os.environ, **(env or {})}
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{proc.stderr[-2000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return summary, records


def machine() -> str:
    """The device a benchmark ran on, in words."""
    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name()}, torch {torch.__version__}"
    return f"{os.cpu_count()}-core {platform.machine()} CPU, torch {torch.__version__}"


def append_results(title: str, description: str, table: str) -> None:
    """Append a dated entry, with the command that produced it, to docs/RESULTS.md."""
    script = Path(sys.argv[0]).resolve().relative_to(REPO).as_posix()
    command = "python " + " ".join([script, *sys.argv[1:]])
    entry = (
        f"\n## {title} ({datetime.date.today()})\n\n"
        f"Command: `{command}`. Machine: {machine()}. {description}\n\n{table}\n"
    )
    with RESULTS.open("a") as handle:
        handle.write(entry)
