"""Automatic restart (docs/preemption.md, "Automatic restart"): a 2-rank ZeRO-2 torchrun
job launched with ``--max-restarts 1`` and ``train.resume=true`` loses one rank to a
SIGKILL mid-run; torchrun restarts both ranks, they continue from the newest checkpoint,
and the job ends with the same final weights and optimizer state, bit for bit, as a run
never interrupted, with every step in ``metrics.jsonl`` once."""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

import pytest
from cli_runner import remove_shm_buffers, run_ranks, start_torchrun, tiny_overrides
from launched_runs import assert_same_checkpoint_tensors, rank_pids

STEPS = 12
KILL_AFTER = 6  # steps logged before one rank is killed


def _rank_of(pid: int) -> int:
    """The ``RANK`` torchrun gave a worker process."""
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    (rank,) = [entry[5:] for entry in environ if entry.startswith(b"RANK=")]
    return int(rank)


def _steps_logged(metrics: Path) -> list[int]:
    return [
        json.loads(line)["step"] for line in metrics.read_text().splitlines() if '"loss"' in line
    ]


pytestmark = [pytest.mark.slow, pytest.mark.zero]  # a 2-rank ZeRO-2 launch


def test_a_killed_rank_is_restarted_by_torchrun_and_the_job_ends_as_if_never_killed(
    corpus_dir, cache_dir, tmp_path
):
    def overrides(run_dir: Path) -> list[str]:
        return [
            *tiny_overrides(corpus_dir, cache_dir, run_dir),
            "distributed=zero2",
            "precision=collage_plus",
            f"train.max_steps={STEPS}",
            "train.checkpoint_every=4",
            f"train.eval_every={STEPS}",
            "logging.log_every=1",
            "train.export_hf=false",
        ]

    reference = run_ranks(*overrides(tmp_path / "reference"))
    assert reference.returncode == 0, reference.stderr[-3000:]

    run_dir = tmp_path / "restarted"
    # the same command line for the first launch and every restart: resume if there is a
    # checkpoint, else start from step 0
    proc, port = start_torchrun(
        *overrides(run_dir),
        "train.resume=true",
        options=("--max-restarts", "1"),
        rendezvous="c10d",
    )
    try:
        metrics = run_dir / "metrics.jsonl"
        deadline = time.time() + 300
        while not (metrics.exists() and len(_steps_logged(metrics)) >= KILL_AFTER):
            assert proc.poll() is None and time.time() < deadline, proc.communicate()
            time.sleep(0.05)
        ranks = {_rank_of(pid): pid for pid in rank_pids(proc.pid)}
        assert sorted(ranks) == [0, 1]
        os.kill(ranks[1], signal.SIGKILL)  # a fault: no handler, no checkpoint
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:  # a hung job: its ranks first, or they outlive it
            for pid in rank_pids(proc.pid):
                os.kill(pid, signal.SIGKILL)
            proc.kill()
        remove_shm_buffers(port)
    assert proc.returncode == 0, stderr[-3000:]
    assert f"no checkpoint in {run_dir} yet: starting from step 0" in stdout
    resumed = re.findall(r"resumed from \S+/step-(\d+) at step (\d+)", stdout)
    # one restart, from a checkpoint written before the kill (step 4, or 8 if it came late)
    assert len(resumed) == 1 and resumed[0][0] == resumed[0][1], stdout[-3000:]
    assert int(resumed[0][0]) in (4, 8)

    final = f"checkpoints/step-{STEPS}"
    assert_same_checkpoint_tensors(run_dir / final, tmp_path / "reference" / final)
    # the records the killed attempt wrote past the checkpoint were dropped on resume
    assert _steps_logged(metrics) == list(range(1, STEPS + 1))
    assert _steps_logged(metrics) == _steps_logged(tmp_path / "reference" / "metrics.jsonl")
