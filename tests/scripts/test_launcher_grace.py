"""scripts/launcher_grace.py: what a launcher does to its workers after a SIGTERM."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "launcher_grace.py"


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=180
    )


def test_torchrun_forwards_sigterm_once_and_kills_after_its_shutdown_timeout():
    done = run("--launcher", "torchrun", "--shutdown-timeout", "1")
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    status, _ = result["launcher_exit"]
    assert status == 1  # torchrun re-raises the signal as its own failure
    for worker in result["workers"].values():
        ((name, at),) = worker["signals"]  # forwarded once
        assert name == "SIGTERM" and at < worker["died_after_s"]
        assert worker["died_after_s"] >= 1.0  # SIGKILL only after the timeout
    assert result["killed_afterwards"] == []


def test_workers_signalled_directly_leave_torchrun_a_clean_exit():
    done = run("--launcher", "torchrun", "--signal-workers", "--worker-exits-after", "0.2")
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["launcher_exit"][0] == 0  # what scripts/slurm_train.sbatch relies on
    for worker in result["workers"].values():
        assert [name for name, _ in worker["signals"]] == ["SIGTERM"]  # nothing forwarded


def test_a_deepspeed_only_flag_is_refused_in_one_line():
    done = run("--launcher", "deepspeed", "--shutdown-timeout", "5")
    assert done.returncode != 0
    assert done.stderr.strip().splitlines() == [
        "error: --shutdown-timeout is torchrun's; deepspeed has no such flag"
    ]
