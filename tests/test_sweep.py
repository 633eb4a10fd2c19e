"""Hydra sweeps (collage_train/sweep.py): ``python -m collage_train -m ...`` runs each job in
its own directory under the sweep directory, in one W&B group; a failed job is recorded and
the rest run; ``collage_train.compare SWEEP_DIR`` compares the jobs."""

from __future__ import annotations

import json
import math

import pytest
from cli_runner import run_cli, tiny_overrides
from omegaconf import OmegaConf

from collage_train import compare
from collage_train.cli import Outcome
from collage_train.sweep import FAILED_FILE, run_sweep_job


def sweep_overrides(corpus_dir, cache_dir, tmp_path) -> list[str]:
    tiny = tiny_overrides(corpus_dir, cache_dir, tmp_path / "unused")
    short = ["train.max_steps=4", "train.eval_every=4", "train.checkpoint_every=4"]
    return [o for o in tiny if not o.startswith("hydra.run.dir=")] + short


@pytest.mark.slow
def test_a_two_job_sweep_runs_each_job_in_its_own_directory(corpus_dir, cache_dir, tmp_path):
    sweep = tmp_path / "sweep"
    overrides = sweep_overrides(corpus_dir, cache_dir, tmp_path)
    done = run_cli("-m", *overrides, "precision=mixed_fp32,bf16", f"hydra.sweep.dir={sweep}")
    assert done.returncode == 0, done.stderr[-3000:]
    jobs = sorted(path.name for path in sweep.iterdir() if path.is_dir())
    assert jobs == ["0", "1"]
    for job, precision in zip(jobs, ("mixed_fp32", "bf16"), strict=True):
        summary = json.loads((sweep / job / "summary.json").read_text())
        assert summary["precision"] == precision and summary["steps"] == 4
        config = OmegaConf.load(sweep / job / ".hydra" / "config.yaml")
        assert config.logging.wandb.group == f"sweep-{sweep.name}"  # one group for the sweep
    out = tmp_path / "comparison"
    assert compare.main([str(sweep), "--out", str(out)]) == 0
    table = (out / "summary.md").read_text().splitlines()
    assert len(table) == 4 and "mixed_fp32" in table[2] and "bf16" in table[3]


@pytest.mark.slow
def test_a_failed_job_is_recorded_and_the_others_run(corpus_dir, cache_dir, tmp_path, capsys):
    sweep = tmp_path / "sweep"
    overrides = sweep_overrides(corpus_dir, cache_dir, tmp_path)
    # a micro-batch of 3 does not divide the global batch of 8: the first job is refused
    done = run_cli("-m", *overrides, "train.micro_batch_size=3,4", f"hydra.sweep.dir={sweep}")
    assert done.returncode == 2, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: 1 of 2 sweep jobs failed in {sweep}: job 0 (")
    assert "train.micro_batch_size=3" in last
    record = json.loads((sweep / "0" / FAILED_FILE).read_text())
    assert record["exit_status"] == 2 and "micro_batch_size" in record["error"]
    assert "train.micro_batch_size=3" in record["overrides"]
    assert json.loads((sweep / "1" / "summary.json").read_text())["steps"] == 4
    assert not (sweep / "1" / FAILED_FILE).exists()
    capsys.readouterr()
    assert compare.main([str(sweep), "--out", str(tmp_path / "comparison")]) == 0
    printed = capsys.readouterr().out
    assert f"{sweep / '0'}: failed: " in printed and "| 1: " in printed


@pytest.mark.parametrize(
    ("outcome", "expected"),
    [
        (Outcome(0, summary={"final_val_loss": 3.25}), 3.25),
        (Outcome(0, summary=None), math.nan),  # stopped before max_steps
        (Outcome(3, error="the loss became nan at step 7"), math.nan),
    ],
)
def test_a_job_returns_its_final_validation_loss_for_optimising_sweepers(
    make_cfg, tmp_path, outcome, expected
):
    run_dir = tmp_path / "sweep" / "4"
    value = run_sweep_job(make_cfg(), run_dir, lambda cfg, path: outcome)
    assert value == expected or (math.isnan(value) and math.isnan(expected))
    failed = run_dir / FAILED_FILE
    assert failed.is_file() == bool(outcome.exit_status)
    if outcome.exit_status:
        assert json.loads(failed.read_text())["error"] == outcome.error
