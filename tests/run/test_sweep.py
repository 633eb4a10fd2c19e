"""Hydra sweeps (collage_train/run/sweep.py): ``python -m collage_train -m ...`` runs each job in
its own directory under the sweep directory, in one W&B group; a failed job is recorded and
the rest run; ``collage_train.compare SWEEP_DIR`` compares the jobs."""

from __future__ import annotations

import json
import math

import pytest
from cli_runner import run_ranks, tiny_overrides
from omegaconf import OmegaConf

from collage_train import compare
from collage_train.cli import Outcome
from collage_train.run.sweep import FAILED_FILE, run_sweep_job


@pytest.fixture(scope="module")
def sweep(corpus_dir, cache_dir, tmp_path_factory):
    """One four-job sweep that both tests read (one forked CLI process): micro-batch 4, then
    3, which does not divide the global batch of 8, each with precision mixed_fp32 and
    bf16 (jobs 0 and 1 run, 2 and 3 are refused). Returns the sweep directory and
    the CLI's result."""
    tmp_path = tmp_path_factory.mktemp("sweep")
    tiny = tiny_overrides(corpus_dir, cache_dir, tmp_path / "unused")
    short = ["train.max_steps=4", "train.eval_every=4", "train.checkpoint_every=4"]
    overrides = [o for o in tiny if not o.startswith("hydra.run.dir=")] + short
    sweep = tmp_path / "sweep"
    done = run_ranks(
        "-m", *overrides, "precision=mixed_fp32,bf16", "train.micro_batch_size=4,3",
        f"hydra.sweep.dir={sweep}", ranks=1,
    )  # fmt: skip
    return sweep, done


@pytest.mark.slow
def test_a_sweep_runs_each_job_in_its_own_directory(sweep, tmp_path, capsys):
    sweep, _ = sweep
    jobs = sorted(path.name for path in sweep.iterdir() if path.is_dir())
    assert jobs == ["0", "1", "2", "3"]
    for job, precision in (("0", "mixed_fp32"), ("1", "bf16")):
        summary = json.loads((sweep / job / "summary.json").read_text())
        assert summary["precision"] == precision and summary["steps"] == 4
        config = OmegaConf.load(sweep / job / ".hydra" / "config.yaml")
        assert config.logging.wandb.group == f"sweep-{sweep.name}"  # one group for the sweep
    out = tmp_path / "comparison"
    capsys.readouterr()
    assert compare.main([str(sweep), "--out", str(out)]) == 0
    table = (out / "summary.md").read_text().splitlines()
    assert len(table) == 4 and "mixed_fp32" in table[2] and "bf16" in table[3]
    printed = capsys.readouterr().out
    assert f"{sweep / '2'}: failed: " in printed and "| 1: " in printed


@pytest.mark.slow
def test_a_failed_job_is_recorded_and_the_others_run(sweep):
    sweep, done = sweep
    assert done.returncode == 2, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: 2 of 4 sweep jobs failed in {sweep}: job 2 (")
    assert "train.micro_batch_size=3" in last
    for job in ("2", "3"):
        record = json.loads((sweep / job / FAILED_FILE).read_text())
        assert record["exit_status"] == 2 and "micro_batch_size" in record["error"]
        assert "train.micro_batch_size=3" in record["overrides"]
    for job in ("0", "1"):
        assert json.loads((sweep / job / "summary.json").read_text())["steps"] == 4
        assert not (sweep / job / FAILED_FILE).exists()


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


def test_a_resumed_sweep_skips_a_job_that_trained_to_its_end(make_cfg, tmp_path, capsys):
    """A finished job is one whose summary.json says it trained to train.max_steps."""
    run_dir = tmp_path / "sweep" / "0"
    run_dir.mkdir(parents=True)
    (run_dir / "summary.json").write_text(json.dumps({"steps": 4, "final_val_loss": 2.5}))
    ran = []

    def run_job(cfg, path):
        ran.append(cfg.train.max_steps)
        return Outcome(0, summary={"steps": cfg.train.max_steps, "final_val_loss": 2.0})

    resume = "train.resume=true"
    assert run_sweep_job(make_cfg(resume, "train.max_steps=4"), run_dir, run_job) == 2.5
    skipped = f"job 0 finished already ({run_dir / 'summary.json'}): skipped"
    assert skipped in capsys.readouterr().out
    assert ran == []
    # without train.resume, or with more steps to train, the job runs
    assert run_sweep_job(make_cfg("train.max_steps=4"), run_dir, run_job) == 2.0
    assert run_sweep_job(make_cfg(resume, "train.max_steps=8"), run_dir, run_job) == 2.0
    assert ran == [4, 8]
