"""scripts/bench_checkpoint.py on a tiny model: both modes run, every save is timed, and
the host copy it reports is the size of the checkpoint it wrote."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from tiny_config import tiny_model_and_data

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


@pytest.mark.slow
def test_both_modes_are_timed_save_by_save(corpus_dir, cache_dir, tmp_path):
    data = [o for o in tiny_model_and_data(corpus_dir, cache_dir) if "seq_len" not in o]
    out = tmp_path / "rows.json"
    command = [
        sys.executable, str(SCRIPTS / "bench_checkpoint.py"), "--model", "gpt_tiny",
        "--precision", "collage_plus", "--seq-len", "32", "--device", "cpu", "--saves", "2",
        "--no-record", "--json", str(out), *data,
    ]  # fmt: skip
    proc = subprocess.run(command, cwd=SCRIPTS, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    [row] = json.loads(out.read_text())
    assert len(row["sync_s"]) == len(row["async_blocked_s"]) == len(row["async_written_s"]) == 2
    assert all(seconds > 0 for seconds in row["sync_s"] + row["async_written_s"])
    assert all(steps >= 0 for steps in row["steps_during_write"])
    # the copy holds what the files hold (weights, dtheta, moments, dv); the files add
    # their pickles and zip records, a few hundred bytes a tensor
    assert row["host_staging_bytes"] < row["checkpoint_bytes"] < 1.15 * row["host_staging_bytes"]
    assert "| gpt_tiny | collage_plus | unsharded | 0 of 1 |" in proc.stdout
