"""scripts/bench_train.py's strategy sets, micro-batch search, repeats and ratio table, without
training runs."""

from __future__ import annotations

import sys
from argparse import Namespace
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import bench_train


@pytest.mark.parametrize("limit", [1, 2, 3, 7, 8, 13, 64, 100])
def test_search_finds_the_largest_micro_batch_that_fits(limit, monkeypatch):
    runner = bench_train.Runner(Namespace(max_search=100), Path("."), None)
    tried = []

    def fits(precision, micro_batch, extra):
        tried.append(micro_batch)
        return micro_batch <= limit, {}

    monkeypatch.setattr(runner, "fits", fits)
    assert runner.max_micro_batch("bf16", []) == limit
    assert len(tried) <= 2 * limit.bit_length() + 2  # doubling, then bisection


def test_nothing_fits_gives_zero(monkeypatch):
    runner = bench_train.Runner(Namespace(max_search=100), Path("."), None)
    monkeypatch.setattr(runner, "fits", lambda *args: (False, {}))
    assert runner.max_micro_batch("bf16", []) == 0


def _row(name, tokens, mem, best, repeats=1, speeds=None):
    speeds = speeds or [tokens, tokens]
    return {
        "strategy": name,
        "tokens_per_s": tokens,
        "tokens_per_s_range": speeds,
        "repeats": repeats,
        "same_loss_every_repeat": True,
        "mfu": None,
        "peak_mem_bytes": mem,
        "state_bytes_per_param": 12.0,
        "final_train_loss": 5.0,
        "final_val_loss": 5.5,
        "max_micro_batch": best,
        "tokens_per_s_at_max": tokens * 2 if best else None,
    }


def test_table_reports_ratios_against_the_baseline():
    text = bench_train.render(
        [_row("collage_plus", 150.0, 8e9, 24), _row("mixed_fp32", 100.0, 1e10, 16)],
        "mixed_fp32",
    )
    plus = next(line for line in text.splitlines() if line.startswith("| collage_plus"))
    assert plus.endswith("| 1.50 | 0.80 | 1.50 | 1.50 |")
    assert "| 5.0000 | 5.5000 | 24 | 300 |" in plus  # losses, then the search's columns
    assert "range" not in text  # one run each: no repeat columns


def test_repeats_give_the_median_with_its_range_and_no_search_drops_its_columns():
    runs = [
        {"tokens_per_s": t, "final_train_loss": 5.0, "mfu": 0.1, "peak_mem_bytes": 1e9,
         "state_bytes_per_param": 8.0, "final_val_loss": 5.5}
        for t in (90.0, 120.0, 100.0)
    ]  # fmt: skip
    row = bench_train.summarise("bf16", runs)
    assert row["tokens_per_s"] == 100.0 and row["tokens_per_s_range"] == [90.0, 120.0]
    assert row["repeats"] == 3 and row["same_loss_every_repeat"]
    runs[1] = {**runs[1], "final_train_loss": 5.1}
    assert not bench_train.summarise("bf16", runs)["same_loss_every_repeat"]
    text = bench_train.render([row, {**row, "strategy": "fp32", "tokens_per_s": 50.0}], "fp32")
    header, _, line, _ = text.splitlines()
    assert "tokens/s (median) | range | same loss each repeat" in header
    assert "max micro-batch" not in header  # --no-search
    assert line.startswith("| bf16 | 100 | 90-120 | yes | 10.0% |")
    assert line.endswith("| 2.00 | 1.00 |")


def test_sets_expand_to_strategies_each_once_in_order():
    assert bench_train.strategies(["basic"]) == ["fp32", "mixed_fp32", "bf16"]
    assert bench_train.strategies(["bf16", "basic", "collage_plus"]) == [
        "bf16", "fp32", "mixed_fp32", "collage_plus"
    ]  # fmt: skip
    configs = Path(__file__).resolve().parents[2] / "configs" / "precision"
    assert sorted(bench_train.strategies(["all"])) == sorted(p.stem for p in configs.glob("*.yaml"))


def test_repeats_run_in_rotating_order_and_the_search_runs_once(monkeypatch):
    args = Namespace(repeats=3, micro_batch=8, steps=2, no_search=False, max_search=4)
    runner = bench_train.Runner(args, Path("."), None)
    calls = []

    def run(precision, micro_batch, steps, extra):
        calls.append((precision, micro_batch))
        return {
            "tokens_per_s": 1.0,
            "final_train_loss": 1.0,
            "mfu": None,
            "peak_mem_bytes": 1,
            "state_bytes_per_param": 2.0,
            "final_val_loss": 1.0,
        }

    monkeypatch.setattr(runner, "run", run)
    monkeypatch.setattr(runner, "fits", lambda precision, micro, extra: (micro <= 2, {}))
    rows = bench_train.measure(runner, [("a", False), ("b", False)])
    assert calls == [("a", 8), ("b", 8), ("b", 8), ("a", 8), ("a", 8), ("b", 8), ("a", 2),
                     ("b", 2)]  # fmt: skip
    assert [(r["strategy"], r["repeats"], r["max_micro_batch"]) for r in rows] == [
        ("a", 3, 2), ("b", 3, 2)
    ]  # fmt: skip


def test_a_baseline_outside_the_strategies_is_one_error_line(monkeypatch, capsys):
    argv = ["bench_train.py", "--strategies", "bf16", "--no-search", "--no-record"]
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit) as stop:
        bench_train.main()
    assert stop.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.endswith("error: --baseline mixed_fp32 is not among --strategies")
