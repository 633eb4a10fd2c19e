"""Helpers the benchmark scripts share: run the real CLI, describe the machine, record."""

from __future__ import annotations

import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "docs" / "RESULTS.md"
HISTORY = REPO / "docs" / "results-history.md"


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


def launch_worker_ranks(
    script: Path, worker_args: list[str], ranks: int, *, repo: Path = REPO, label: str
) -> list[dict]:
    """Run ``script --worker-out OUT WORKER_ARGS`` as one process or ``ranks`` torchrun
    ranks (OpenMP threads shared out), each writing its row to ``OUT.rankR``; return the
    rows in rank order, or exit with the launch's error naming ``label``."""
    scratch = Path(tempfile.mkdtemp(prefix=f"{script.stem}_"))
    out = scratch / "row.json"
    args = ["--worker-out", str(out), *worker_args]
    env = {**os.environ, "PYTHONPATH": f"{repo}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // ranks))
    if ranks == 1:
        command = [sys.executable, str(script), *args]
    else:
        torchrun = shutil.which("torchrun") or str(Path(sys.executable).parent / "torchrun")
        command = [torchrun, "--nproc_per_node", str(ranks), str(script), *args]
    proc = subprocess.run(command, cwd=repo, env=env, capture_output=True, text=True)
    rows = [json.loads(p.read_text()) for p in sorted(scratch.glob("row.json.rank*"))]
    shutil.rmtree(scratch, ignore_errors=True)
    if proc.returncode != 0 or len(rows) != ranks:
        sys.exit(f"{label} on {ranks} rank(s) failed:\n{proc.stderr[-3000:]}")
    return rows


def machine() -> str:
    """The device a benchmark ran on, in words."""
    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name()}, torch {torch.__version__}"
    return f"{os.cpu_count()}-core {platform.machine()} CPU, torch {torch.__version__}"


def append_results(title: str, description: str, table: str) -> None:
    """Append a dated entry, with the command that produced it and the machine, to the
    dated log docs/results-history.md, and say which section of docs/RESULTS.md (the
    current numbers, curated by hand) to update with it."""
    script = Path(sys.argv[0]).resolve().relative_to(REPO).as_posix()
    command = "python " + " ".join([script, *sys.argv[1:]])
    entry = (
        f"\n## {title} ({datetime.date.today()})\n\n"
        f"Command: `{command}`. Machine: {machine()}. {description}\n\n{table}\n"
    )
    with HISTORY.open("a") as handle:
        handle.write(entry)
    print(
        f"appended to {HISTORY.relative_to(REPO)}: if it is the newest run of its measure, "
        f"update the matching section of {RESULTS.relative_to(REPO)} with it ({title!r})"
    )
