"""scripts/bench_guard.py at a tiny size: it times the guard alone and whole runs with the
guard on and off, and reports both as fractions of the step."""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import pytest
from cli_runner import run_training_forked
from tiny_config import tiny_model_and_data

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import bench_guard

pytestmark = pytest.mark.slow


def test_the_guard_benchmark_reports_its_cost_as_a_fraction_of_the_step(
    tmp_path, corpus_dir, cache_dir, monkeypatch, capsys
):
    """The script in this process, its runs forked (``run_training_forked``)."""
    out = tmp_path / "guard.json"
    data = [o for o in tiny_model_and_data(corpus_dir, cache_dir) if "seq_len" not in o]
    argv = [
        "bench_guard.py", "--model", "gpt_tiny", "--seq-len", "32", "--micro-batch", "2",
        "--steps", "3", "--repeats", "1", "--calls", "50", "--no-record", "--json", str(out),
        *data,
    ]  # fmt: skip
    monkeypatch.setattr(sys, "argv", argv)
    monkeypatch.setattr(bench_guard, "run_training", run_training_forked)
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    bench_guard.main()
    assert not list(scratch.glob("bench_guard_*"))  # its runs' directories removed
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())
    assert [(r["guard"], r["skipped_steps"]) for r in result["runs"]] == [(True, 0), (False, 0)]
    assert 0 < result["guard_alone_s"] < result["step_s_guard_off"]
    assert 0 < result["guard_alone_read_s"] < result["step_s_guard_off"]
    assert result["guard_alone_frac"] == pytest.approx(
        result["guard_alone_s"] / result["step_s_guard_off"]
    )
    on, off = result["step_s_guard_on"], result["step_s_guard_off"]
    assert result["whole_step_ratio_on_off"] == pytest.approx(on / off)
    assert "| guard alone / step |" in printed
