"""scripts/bench_checkpoint.py on a tiny model: both modes run, every save is timed, and
the host copy it reports is the size of the checkpoint it wrote."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from cli_runner import launch_forked
from tiny_config import tiny_model_and_data

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
sys.path.insert(0, str(SCRIPTS))
import bench_checkpoint  # noqa: E402


@pytest.mark.slow
def test_both_modes_are_timed_save_by_save(corpus_dir, cache_dir, tmp_path, monkeypatch, capsys):
    """The script's main in this process, its worker rank forked (the launcher is
    scripts/runs.py's, tested in test_scripts_common.py)."""
    data = [o for o in tiny_model_and_data(corpus_dir, cache_dir) if "seq_len" not in o]
    out = tmp_path / "rows.json"
    monkeypatch.setattr(bench_checkpoint, "launch_ranks", launch_forked)
    monkeypatch.setattr(sys, "argv", [
        "bench_checkpoint.py", "--model", "gpt_tiny", "--precision", "collage_plus",
        "--seq-len", "32", "--device", "cpu", "--saves", "2", "--no-record",
        "--json", str(out), *data,
    ])  # fmt: skip
    bench_checkpoint.main()
    [row] = json.loads(out.read_text())
    assert len(row["sync_s"]) == len(row["async_blocked_s"]) == len(row["async_written_s"]) == 2
    assert all(seconds > 0 for seconds in row["sync_s"] + row["async_written_s"])
    assert all(steps >= 0 for steps in row["steps_during_write"])
    # the copy holds what the files hold (weights, dtheta, moments, dv); the files add
    # their pickles and zip records, a few hundred bytes a tensor
    assert row["host_staging_bytes"] < row["checkpoint_bytes"] < 1.15 * row["host_staging_bytes"]
    assert "| gpt_tiny | collage_plus | unsharded | 0 of 1 |" in capsys.readouterr().out
