"""Hydra sweeps: ``python -m collage_train -m precision=mixed_fp32,collage_plus,bf16 ...``.

Each job runs in its own directory under the sweep directory (``hydra.sweep.dir``) and is
validated and its directory locked here, as ``run.directory.RunDirectoryCallback`` does
for a single run (Hydra does not call it for a sweep's jobs); unless
``logging.wandb.group`` is set, every job streams to one W&B group named after the sweep
directory. A failed job prints its ``error:`` line, writes it to ``failed.json`` and
returns NaN (a failed trial for an optimising sweeper); a finished job returns its final
validation loss. At the end ``SweepVerdict`` (a Hydra callback registered in
``configs/config.yaml``) names the failed jobs in one error line and exits non-zero. A
stop signal ends the sweep after the current job's checkpoint
(``collage_train.run.sweep_stop``); with ``train.resume=true`` the same command skips the
jobs whose ``summary.json`` says they finished and resumes or starts the others.
What a user sees: docs/wandb.md, "Sweeps: several strategies as one command".
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, open_dict

from collage_train.engine.launch import launched_world_size
from collage_train.errors import BAD_INPUT, CollageError, ConfigError

FAILED_FILE = "failed.json"
SUMMARY_FILE = "summary.json"  # written by a run that trained to its end (run/report.py)


def run_sweep_job(
    cfg: DictConfig, run_dir: Path, run_job: Callable[[DictConfig, Path], Any]
) -> float:
    """One job of a sweep in ``run_dir``; ``run_job`` is ``cli.run_reporting``. Returns the
    final validation loss, NaN when the job failed or stopped early."""
    from collage_train.run import branch
    from collage_train.run.directory import lock_run_dir
    from collage_train.run.validate import validate

    if cfg.train.resume:
        done = finished_summary(run_dir, cfg.train.max_steps)
        if done is not None:
            where = run_dir / SUMMARY_FILE
            print(f"job {run_dir.name} finished already ({where}): skipped", flush=True)
            return _final_loss(done)
    # the jobs of one sweep: one W&B group (branches: that of their branch point, run.branch)
    if cfg.logging.wandb.group is None and cfg.train.branch_from is None:
        with open_dict(cfg):
            cfg.logging.wandb.group = f"sweep-{run_dir.parent.name}"
    try:
        if launched_world_size() > 1:
            raise ConfigError(
                "a Hydra sweep (-m) runs its jobs one after another in one process; launch "
                "each multi-GPU job with deepspeed or torchrun on its own"
            )
        validate(cfg)
        branch.check_directory(cfg, run_dir)  # a branch never writes its parent
        lock_run_dir(run_dir)
    except CollageError as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        status, error, summary = err.exit_status, str(err), None
    else:
        outcome = run_job(cfg, run_dir)  # cli.Outcome
        status, error, summary = outcome.exit_status, outcome.error, outcome.summary
    failed = run_dir / FAILED_FILE
    if status:
        overrides = list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []
        run_dir.mkdir(parents=True, exist_ok=True)
        record = {"exit_status": status, "error": error, "overrides": overrides}
        failed.write_text(json.dumps(record, indent=2) + "\n")
        return math.nan
    failed.unlink(missing_ok=True)  # a job run again in the same directory, now finished
    return _final_loss(summary)


def _final_loss(summary: dict[str, Any] | None) -> float:
    loss = (summary or {}).get("final_val_loss")
    return math.nan if loss is None else float(loss)


def finished_summary(run_dir: Path, max_steps: int) -> dict[str, Any] | None:
    """The summary of a job that trained to ``max_steps`` in ``run_dir`` (its
    ``summary.json``, which a run writes only at its end), else None."""
    try:
        summary = json.loads((run_dir / SUMMARY_FILE).read_text())
    except (OSError, ValueError):
        return None
    steps = summary.get("steps") if isinstance(summary, dict) else None
    return summary if isinstance(steps, int) and steps >= max_steps else None


def failed_jobs(sweep_dir: Path) -> list[tuple[Path, dict[str, Any]]]:
    """The sweep's failed jobs, in job order, with their ``failed.json`` records."""
    found = []
    for path in sweep_dir.glob(f"*/{FAILED_FILE}"):
        found.append((path.parent, json.loads(path.read_text())))
    return sorted(found, key=lambda item: _job_order(item[0]))


def job_dirs(sweep_dir: Path) -> list[Path]:
    """The job directories of a sweep, in job order (each holds metrics.jsonl or failed.json)."""
    jobs = [
        path
        for path in sweep_dir.iterdir()
        if path.is_dir() and ((path / "metrics.jsonl").is_file() or (path / FAILED_FILE).is_file())
    ]
    return sorted(jobs, key=_job_order)


def _job_order(path: Path) -> tuple[int, str]:
    number = path.name.split("_")[0]
    return (int(number), path.name) if number.isdigit() else (sys.maxsize, path.name)


def report_failures(sweep_dir: Path) -> int:
    """One error line naming the sweep's failed jobs; returns the exit status they call
    for (0, and nothing printed, when none failed)."""
    failed = failed_jobs(sweep_dir) if sweep_dir.is_dir() else []
    if not failed:
        return 0
    total = len(job_dirs(sweep_dir))
    named = "; ".join(
        f"job {path.name} ({' '.join(record.get('overrides', [])) or 'no overrides'}): "
        f"{record.get('error')}"
        for path, record in failed
    )
    print(
        f"error: {len(failed)} of {total} sweep jobs failed in {sweep_dir}: {named}",
        file=sys.stderr,
        flush=True,
    )
    return max(record.get("exit_status", BAD_INPUT) for _, record in failed)


class SweepVerdict(Callback):
    """At the end of a sweep: one error line naming the failed jobs, and a non-zero exit."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        status = report_failures(Path(str(config.hydra.sweep.dir)))
        if status:
            sys.exit(status)
