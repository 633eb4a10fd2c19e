"""A 2-rank ZeRO-2 run preempted with SIGTERM at a random step: it stops within two
optimizer steps with a checkpoint (the background one, flushed before exit), says how
long the stop took, and resumes to the same weights and optimizer state, bit for bit, as
a run never interrupted (docs/preemption.md). The preempted run starts without
hydra.run.dir: both ranks write into rank 0's timestamped directory. Its ranks are forked
(cli_runner.start_ranks) and signalled as Slurm signals them; how torchrun passes a
SIGTERM on to its workers is tests/scripts/test_launcher_grace.py's subject."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import time
from pathlib import Path

import pytest
from cli_runner import run_ranks, start_ranks, tiny_overrides
from launched_runs import assert_same_checkpoint_tensors

from collage_train import checkpoint

STEPS = 12


pytestmark = [pytest.mark.slow, pytest.mark.zero]  # a 2-rank ZeRO-2 launch


def test_sigterm_at_a_random_step_stops_within_two_steps_and_resumes_bitwise(
    corpus_dir, cache_dir, tmp_path
):
    def overrides(run_dir: Path | None) -> list[str]:
        placed = tiny_overrides(corpus_dir, cache_dir, run_dir or tmp_path / "unused")
        return [
            *(arg for arg in placed if run_dir or not arg.startswith("hydra.run.dir=")),
            "distributed=zero2",
            "precision=collage_plus",
            f"train.max_steps={STEPS}",
            f"train.checkpoint_every={STEPS}",
            f"train.eval_every={STEPS}",
            "logging.log_every=1",
            "train.export_hf=false",
        ]

    reference = run_ranks(*overrides(tmp_path / "reference"))
    assert reference.returncode == 0, reference.stderr[-3000:]

    launched_in = tmp_path / "launch"
    launched_in.mkdir()
    at_step = random.randint(2, 7)  # steps logged before the signal is sent
    launch = start_ranks(*overrides(None), cwd=launched_in)

    def logged() -> int:
        found = list(launched_in.glob("outputs/*/*/metrics.jsonl"))
        return found[0].read_text().count('"loss"') if found else 0

    try:
        deadline = time.time() + 300
        while logged() < at_step:
            assert not launch.poll() and time.time() < deadline, "the run ended or stalled"
            time.sleep(0.05)
        assert len(launch.pids) == 2
        for pid in launch.pids:  # what Slurm's --signal and scripts/slurm_train.sbatch do
            os.kill(pid, signal.SIGTERM)
    finally:
        done = launch.wait(300)  # kills the ranks past it
    assert done.returncode == 0, done.stderr[-3000:]
    stdout = done.stdout
    notice = re.search(
        r"SIGTERM received during step (\d+): checkpoint saved at step (\d+), ([\d.]+) s after "
        r"the signal",
        stdout,
    )
    assert notice, stdout[-2000:]
    # both ranks in rank 0's directory: one directory, its record, both ranks' shards
    (run_dir,) = launched_in.glob("outputs/*/*")
    assert (run_dir / ".hydra" / "config.yaml").is_file()
    landed, saved = int(notice.group(1)), int(notice.group(2))
    # landed after the steps seen; stopped after at most the next one
    assert at_step < landed and saved - landed <= 1, (at_step, landed, saved)
    assert [step for step, _ in checkpoint.list_checkpoints(run_dir)] == [saved]
    shards = run_dir / "checkpoints" / f"step-{saved}"
    assert {rank for rank in (0, 1) if list(shards.glob(f"*zero_pp_rank_{rank}_*"))} == {0, 1}

    resumed = run_ranks(*overrides(run_dir), "train.resume=true")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    final = f"checkpoints/step-{STEPS}"
    assert_same_checkpoint_tensors(run_dir / final, tmp_path / "reference" / final)
    assert json.loads((run_dir / "summary.json").read_text())["world_size"] == 2
