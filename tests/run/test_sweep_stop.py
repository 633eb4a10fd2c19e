"""collage_train/run/sweep_stop.py: SIGTERM or SIGINT in a job of a Hydra sweep ends the sweep
after that job's checkpoint, with one line naming the jobs not run and the command that
continues it; that command (train.resume=true) skips the finished jobs, resumes the
stopped one from its checkpoint and runs the rest. The sweep runs in one forked CLI
process (cli_runner.start_ranks), signalled as a scheduler or Ctrl-C signals it."""

from __future__ import annotations

import json
import os
import shlex
import signal
import time
from pathlib import Path

import pytest
from cli_runner import Result, run_ranks, start_ranks, tiny_overrides
from omegaconf import OmegaConf

from collage_train import checkpoint
from collage_train.run.sweep import FAILED_FILE
from collage_train.run.sweep_stop import BASIC_SWEEPER, SweepStop


def _sweep_args(corpus: Path, cache: Path, sweep: Path, *swept: str) -> list[str]:
    """A tiny sweep: a step logged each step, no checkpoint but the stop's and the last."""
    tiny = tiny_overrides(corpus, cache, sweep / "unused")
    return [
        "-m",
        *(o for o in tiny if not o.startswith("hydra.run.dir=")),
        "train.eval_every=1000",
        "train.checkpoint_every=1000",
        "logging.log_every=1",
        "train.export_hf=false",
        "logging.sample_tokens=0",
        *swept,
        f"hydra.sweep.dir={sweep}",
    ]


def _loss_steps(job: Path) -> list[int]:
    path = job / "metrics.jsonl"
    if not path.is_file():
        return []
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [record["step"] for record in records if "loss" in record]


def _signal_during(args: list[str], job: Path, signum: int) -> Result:
    """Run the sweep and send ``signum`` to its process once ``job`` logged two steps."""
    launch = start_ranks(*args, ranks=1)
    try:
        deadline = time.time() + 300
        while len(_loss_steps(job)) < 2:
            assert not launch.poll() and time.time() < deadline, "the sweep ended or stalled"
            time.sleep(0.02)
        (pid,) = launch.pids
        os.kill(pid, signum)
    finally:
        done = launch.wait(300)  # kills it past that
    return done


@pytest.mark.slow  # three forked CLI runs of a sweep
def test_a_signal_stops_a_sweep_after_its_job_and_the_printed_command_continues_it(
    corpus_dir, cache_dir, tmp_path
):
    """Ctrl-C in job 0: no later job starts. The printed command: job 0 resumes from its
    checkpoint and finishes, SIGTERM stops job 1. Again: job 0 is skipped, job 1 resumes,
    job 2 runs."""
    sweep = tmp_path / "sweep"
    args = _sweep_args(corpus_dir, cache_dir, sweep, "train.max_steps=12,14,2")

    done = _signal_during(args, sweep / "0", signal.SIGINT)
    # a single run stopped by a signal exits 0 (docs/preemption.md): so does the sweep
    assert done.returncode == 0, done.stderr[-3000:]
    assert not done.error_lines and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert [path.name for path in sweep.iterdir() if path.is_dir()] == ["0"]  # 1, 2 never ran
    (first_stop,) = checkpoint.list_checkpoints(sweep / "0")
    assert first_stop[0] < 12 and not (sweep / "0" / FAILED_FILE).exists()
    command = _continue_command(
        done, sweep, f"SIGINT: sweep {sweep} stopped after job 0 (checkpoint at step "
        f"{first_stop[0]}); jobs not run: 1 (train.max_steps=14), 2 (train.max_steps=2); ",
    )  # fmt: skip

    done = _signal_during(command, sweep / "1", signal.SIGTERM)  # the command, as a user runs it
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"resumed from {first_stop[1]} at step {first_stop[0]}" in done.stdout
    assert not (sweep / "2").exists()
    (second_stop,) = checkpoint.list_checkpoints(sweep / "1")
    assert second_stop[0] < 14
    assert _continue_command(
        done, sweep, f"SIGTERM: sweep {sweep} stopped after job 1 (checkpoint at step "
        f"{second_stop[0]}); jobs not run: 2 (train.max_steps=2); ",
    ) == command  # fmt: skip
    finished = {
        name: (sweep / "0" / name).read_bytes() for name in ("summary.json", "metrics.jsonl")
    }

    done = run_ranks(*command, ranks=1)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"job 0 finished already ({sweep / '0' / 'summary.json'}): skipped" in done.stdout
    assert {name: (sweep / "0" / name).read_bytes() for name in finished} == finished
    assert f"resumed from {second_stop[1]} at step {second_stop[0]}" in done.stdout
    for job, steps in (("0", 12), ("1", 14), ("2", 2)):
        assert json.loads((sweep / job / "summary.json").read_text())["steps"] == steps
        assert _loss_steps(sweep / job) == list(range(1, steps + 1))  # each step once
        assert not (sweep / job / FAILED_FILE).exists()
    assert ": sweep " not in done.stdout  # no stop


def _continue_command(done: Result, sweep: Path, head: str) -> list[str]:
    """The overrides of the command the stop line prints, checked to be the sweep's own
    with its directory and train.resume=true."""
    lines = [line for line in done.stdout.splitlines() if ": sweep " in line]
    assert len(lines) == 1, done.stdout[-3000:] + done.stderr[-3000:]
    assert lines[0].startswith(f"{head}continue it with: "), lines[0]
    command = shlex.split(lines[0].removeprefix(f"{head}continue it with: "))
    assert command[:3] == ["python", "-m", "collage_train"]
    assert command[-2:] == [f"hydra.sweep.dir={sweep}", "train.resume=true"]
    return command[3:]


def _job_config(sweep: Path, number: int, sweeper: str = BASIC_SWEEPER):
    """What Hydra hands a callback: the sweep's overrides, and the job's number and directory."""
    task = ["precision=fp32,bf16", "train.seed=1,2", "train.max_steps=4"]
    return OmegaConf.create({
        "hydra": {
            "sweeper": {"_target_": sweeper, "params": None},
            "overrides": {"task": task},
            "job": {"num": number},
            "runtime": {"output_dir": str(sweep / str(number))},
        },
        "train": {"max_steps": 4},
    })  # fmt: skip


def test_a_signal_between_jobs_stops_before_the_next_one(tmp_path, capsys, monkeypatch):
    """... naming it and the rest; a job that failed before makes the exit non-zero."""
    sweep = tmp_path / "sweep"
    (sweep / "0").mkdir(parents=True)
    failed = {"exit_status": 2, "error": "bad", "overrides": ["precision=fp32", "train.seed=1"]}
    (sweep / "0" / FAILED_FILE).write_text(json.dumps(failed))
    argv = ["collage_train", "-m", "precision=fp32,bf16", "train.seed=1,2", "train.resume=false"]
    monkeypatch.setattr("sys.argv", [*argv, "hydra.sweep.dir=elsewhere"])
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    stop = SweepStop()
    stop.on_multirun_start(_job_config(sweep, 0))
    try:
        stop.on_job_start(_job_config(sweep, 0))  # no signal yet: the job runs
        stop.on_job_end(_job_config(sweep, 0))
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.01)
        with pytest.raises(SystemExit) as ended:
            stop.on_job_start(_job_config(sweep, 1))
    finally:
        stop.on_multirun_end(_job_config(sweep, 0))
    assert ended.value.code == 2
    assert {sig: signal.getsignal(sig) for sig in before} == before
    printed = capsys.readouterr()
    command = shlex.join([
        "python", "-m", "collage_train", "-m", "precision=fp32,bf16", "train.seed=1,2",
        f"hydra.sweep.dir={sweep}", "train.resume=true",
    ])  # fmt: skip
    assert printed.out.splitlines() == [
        f"SIGTERM: sweep {sweep} stopped before job 1; jobs not run: 1 (precision=fp32 "
        "train.seed=2), 2 (precision=bf16 train.seed=1), 3 (precision=bf16 train.seed=2); "
        f"continue it with: {command}"
    ]
    assert printed.err.startswith(f"error: 1 of 1 sweep jobs failed in {sweep}: job 0 (")


def test_an_optimising_sweepers_jobs_are_named_from_the_stopped_one_on(tmp_path, capsys):
    sweep = tmp_path / "sweep"
    stop = SweepStop()
    stop.on_multirun_start(_job_config(sweep, 0, sweeper="hydra_plugins.optuna.OptunaSweeper"))
    try:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.01)
        with pytest.raises(SystemExit) as ended:
            stop.on_job_end(_job_config(sweep, 3))
    finally:
        stop.on_multirun_end(_job_config(sweep, 0))
    assert ended.value.code == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith(
        f"SIGINT: sweep {sweep} stopped after job 3 (no checkpoint); jobs from 4 on not run; "
    ), line
