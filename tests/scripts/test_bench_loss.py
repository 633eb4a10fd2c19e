"""scripts/bench_loss.py: a tiny real run to JSON, and the planner's rows."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import bench_loss


@pytest.mark.slow
def test_a_tiny_real_run_holds_less_with_blocks(tmp_path, monkeypatch, capsys):
    """128 tokens at a 2048-token vocabulary in blocks of 32: the loss's peak falls by
    more than half at both precisions (12 bytes per logit of the micro-batch against 8
    per logit of a block plus the fp32 gradient accumulator)."""
    out = tmp_path / "rows.json"
    argv = [
        "bench_loss.py", "--vocab", "2048", "--seq-len", "64", "--micro-batch", "2",
        "--hidden", "32", "--layers", "1", "--chunk", "32", "--repeats", "1", "--no-plan",
        "--no-record", "--device", "cpu", "--json", str(out),
    ]  # fmt: skip
    monkeypatch.setattr(sys, "argv", argv)
    bench_loss.main()  # in this process: no start-up to pay
    printed = capsys.readouterr().out
    rows = json.loads(out.read_text())["measured"]
    assert [(r["precision"], r["chunk_tokens"]) for r in rows] == [
        ("bf16 params", None), ("bf16 params", 32), ("mixed_fp32", None), ("mixed_fp32", 32),
    ]  # fmt: skip
    for plain, chunked in zip(rows[::2], rows[1::2], strict=True):
        assert 2 * chunked["loss_peak_bytes"] < plain["loss_peak_bytes"]
        assert chunked["step_peak_bytes"] < plain["step_peak_bytes"]
    assert "| mixed_fp32 | blocks of 32 |" in printed


@pytest.mark.slow
def test_the_planner_rows_compare_the_same_settings_before_and_after():
    rows = bench_loss.planned_rows()
    assert len(rows) == len(bench_loss.PLAN_MODELS) * len(bench_loss.PLAN_SETTINGS)
    for row in rows:
        for key in ("max_micro_batch", "max_micro_batch_checkpointed"):
            before, after = row[key]
            assert after >= before, row
    llama = {(r["precision"], r["distributed"]): r for r in rows if r["model"] == "llama_8b"}
    assert llama[("collage_plus", "zero3")]["chunk_tokens"] == 512
    before, after = llama[("collage_plus", "zero3")]["max_micro_batch_checkpointed"]
    assert before < after  # the loss set llama_8b's checkpointed peak
