"""The hang watchdog (collage_train/run/watchdog.py): it fires only when no step completes
for its bound outside a pause, writes every thread's stack naming the hung frame, exits
with status 3, and a 2-rank run with one rank asleep in a step ends intact and resumes."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from cli_runner import REPO, run_ranks, tiny_overrides

from collage_train import checkpoint
from collage_train.errors import HUNG, ConfigError
from collage_train.run import watchdog
from collage_train.run.watchdog import HangWatchdog


class _Exited(Exception):
    """Raised by the stand-in ``exit`` in place of ending the test process."""


def _watchdog(tmp_path: Path, timeout_s: float | None, **kwargs) -> tuple[HangWatchdog, list]:
    """A watchdog whose exit is recorded, not taken."""
    exits: list[int] = []
    return HangWatchdog(tmp_path, 0, timeout_s, exit=exits.append, **kwargs), exits


def _beat_for(dog: HangWatchdog, seconds: float, every: float) -> None:
    end = time.monotonic() + seconds
    step = dog._step
    while time.monotonic() < end:
        step += 1
        dog.beat(step)
        time.sleep(every)


def test_fires_after_the_bound_without_a_beat(tmp_path):
    dog, exits = _watchdog(tmp_path, 0.3)
    with dog.watching():
        dog.beat(1)
        dog.beat(2)
        time.sleep(1.0)
    assert exits == [HUNG]
    (written,) = tmp_path.glob("hang-rank0-*.txt")
    assert written == dog.fired_path
    assert "last completed step 2" in written.read_text()


def test_beats_keep_it_quiet_and_it_is_unarmed_before_the_second_step(tmp_path):
    dog, exits = _watchdog(tmp_path, 0.3)
    with dog.watching():
        time.sleep(0.8)  # start-up: no beat yet
        dog.beat(1)
        time.sleep(0.8)  # the first step's settling and warm-up
        _beat_for(dog, 1.2, every=0.05)
    assert exits == [] and not list(tmp_path.glob("hang-*"))


def test_a_pause_suppresses_it_and_the_bound_counts_from_its_end(tmp_path):
    dog, exits = _watchdog(tmp_path, 0.3)
    with dog.watching():
        _beat_for(dog, 0.2, every=0.05)
        with dog.paused():
            time.sleep(1.0)
        time.sleep(0.15)
        assert exits == []
        time.sleep(0.6)
    assert exits == [HUNG]


def test_off_runs_no_thread_and_a_negative_bound_is_refused(tmp_path):
    dog, exits = _watchdog(tmp_path, 0)
    with dog.watching():
        assert dog._thread is None
        dog.beat(1)
        dog.beat(2)
        time.sleep(0.3)
    assert exits == [] and not dog.armed
    with pytest.raises(ConfigError, match=r"train\.hang_timeout_s must be 0"):
        HangWatchdog(tmp_path, 0, -1)


def test_the_derived_bound_is_ten_times_the_longest_measured_step_with_a_floor(
    tmp_path, monkeypatch
):
    clock = [100.0]
    monkeypatch.setattr(watchdog.time, "monotonic", lambda: clock[0])
    intervals = [40.0, 20.0, 55.0, 30.0, 30.0, 30.0, 30.0, 30.0]
    assert len(intervals) == watchdog.MEASURED_STEPS
    dog, _ = _watchdog(tmp_path, None)
    dog.beat(1)
    clock[0] += 1000.0  # the first step's warm-up is not measured
    dog.beat(2)
    for step, seconds in enumerate(intervals, start=3):
        assert not dog.armed  # nothing fires before the bound is known
        clock[0] += seconds
        dog.beat(step)
    assert dog.armed and dog.timeout_s == watchdog.HANG_FACTOR * 55.0
    fast, _ = _watchdog(tmp_path, None)
    for step in range(1, watchdog.MEASURED_STEPS + 3):
        clock[0] += 0.5
        fast.beat(step)
    assert fast.timeout_s == watchdog.HANG_FLOOR_S


def test_collectives_get_a_shorter_timeout_while_armed_and_the_configured_one_back(
    tmp_path, monkeypatch
):
    set_to: list[float] = []
    monkeypatch.setattr(watchdog, "set_collective_timeout", lambda s: set_to.append(s) or True)
    dog, _ = _watchdog(tmp_path, 200, collective_s=1800.0)
    with dog.watching():
        dog.beat(1)
        assert set_to == []  # not armed yet: the configured timeout holds
        dog.beat(2)
        assert set_to == [watchdog.collective_timeout_s(200)] == [400.0]
        with dog.paused():
            assert set_to[-1] == 1800.0
        assert set_to[-1] == 400.0
        dog.beat(3)
    assert set_to == [400.0, 1800.0, 400.0, 1800.0]
    assert watchdog.collective_timeout_s(10) == watchdog.COLLECTIVE_FLOOR_S


_FIRES = """
import sys, time
from pathlib import Path
from collage_train.run.watchdog import HangWatchdog

def sleeping_in_a_step():
    time.sleep(60)

dog = HangWatchdog(Path(sys.argv[1]), 4, 0.5)
with dog.watching():
    dog.beat(6)
    dog.beat(7)
    sleeping_in_a_step()
print("not reached")
"""


def test_a_process_that_hangs_exits_with_its_status_and_its_stacks(tmp_path):
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_FIRES), str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == HUNG == 3, done.stderr[-2000:]
    assert "not reached" not in done.stdout
    (written,) = tmp_path.glob("hang-rank4-*.txt")
    text = written.read_text()
    assert "last completed step 7" in text
    assert "in sleeping_in_a_step" in text  # the hung frame, in faulthandler's format
    threads = re.findall(r"^(?:Current thread|Thread) 0x", text, flags=re.MULTILINE)
    assert len(threads) >= 2  # every thread: the hung main one and the watchdog's
    assert "Collectives in flight:\nno process group" in text
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    (error,) = errors
    assert error.startswith("error: [rank 4] hung: no optimizer step completed for "), error
    assert str(written) in error and "after step 7" in error and "status 3" in error
    assert "sleeping_in_a_step" in done.stderr  # the stacks are in the job's log too


@pytest.mark.slow
@pytest.mark.zero  # a 2-rank ZeRO-1 launch
def test_a_rank_asleep_in_a_step_ends_the_launch_intact_and_the_run_resumes(
    corpus_dir, cache_dir, tmp_path
):
    """Forked ranks (cli_runner.run_ranks): no launcher ends rank 0 for it when rank 1
    exits, so rank 0 must end on its own; what torchrun makes of a worker's exit status is
    tests/run/test_restart.py's subject."""
    run_dir = tmp_path / "run"
    bound = 5  # seconds; the tiny run's steps take milliseconds
    args = [
        *tiny_overrides(corpus_dir, cache_dir, run_dir),
        "distributed=zero1",
        "train.eval_every=8",
        "train.export_hf=false",
        "logging.log_every=1",
        f"train.hang_timeout_s={bound}",
    ]
    entry = str(REPO / "tests/support/hang_rank.py")
    hung = run_ranks(*args, entry=entry, timeout=300)
    assert hung.returncode != 0, hung.stderr[-3000:]
    assert hung.rank_exit_codes[1] == HUNG and hung.rank_exit_codes[0] != 0, hung.stderr[-3000:]
    (rank1,) = run_dir.glob("hang-rank1-*.txt")
    text = rank1.read_text()
    assert "in _sleep_inside_step" in text and "last completed step 5" in text, text
    line = next(line for line in hung.error_lines if line.startswith("error: [rank 1] hung"))
    waited = int(re.search(r"no optimizer step completed for (\d+) s after step 5", line)[1])
    assert bound <= waited < bound + 5, line  # within the bound (and its 0.5 s polling)
    # rank 0 waits in the step's gradient all-reduce and has ended too: its own watchdog
    # fired there (the same bound from the same step), or, when rank 1 exited a poll
    # earlier, gloo's lost connection ended its collective with an error
    rank0 = list(run_dir.glob("hang-rank0-*.txt"))
    if rank0:
        text = rank0[0].read_text()
        assert "last completed step 5" in text and "all_reduce" in text, text
    else:
        assert "Connection closed by peer" in hung.stderr, hung.stderr[-3000:]
    # the checkpoint of step 4, written in the background, is whole; nothing else is there
    assert [step for step, _ in checkpoint.list_checkpoints(run_dir)] == [4]
    assert checkpoint.damage(run_dir / "checkpoints/step-4") is None
    assert not list((run_dir / "checkpoints").glob(".*"))

    resumed = run_ranks(*args, "train.resume=true", entry=entry, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout and "at step 4" in resumed.stdout
    records = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    steps = [record["step"] for record in records if "loss" in record]  # training records
    assert steps == list(range(1, 9)), steps
    assert (run_dir / "summary.json").exists()
