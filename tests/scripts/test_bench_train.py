"""scripts/bench_train.py's micro-batch search and ratio table, without training runs."""

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


def test_table_reports_ratios_against_mixed_fp32():
    def row(name, tokens, mem, best):
        return {
            "strategy": name,
            "tokens_per_s": tokens,
            "mfu": None,
            "peak_mem_bytes": mem,
            "state_bytes_per_param": 12.0,
            "max_micro_batch": best,
            "tokens_per_s_at_max": tokens * 2,
        }

    text = bench_train.table(
        [row("collage_plus", 150.0, 8e9, 24), row("mixed_fp32", 100.0, 1e10, 16)]
    )
    plus = next(line for line in text.splitlines() if line.startswith("| collage_plus"))
    assert plus.endswith("| 1.50 | 0.80 | 1.50 | 1.50 |")
