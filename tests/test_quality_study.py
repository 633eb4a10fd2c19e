"""scripts/quality_study.py's seed aggregation and table, without training runs."""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import quality_study


def _row(precision: str, beta2: float, seed: int, loss: float) -> dict:
    return {
        "precision": precision, "beta2": beta2, "seed": seed, "final_val_loss": loss,
        "final_train_loss": loss + 0.1, "mean_edq_normalized": 1.0, "mean_lost_update_frac": 0.2,
        "late_lost_update_frac": 0.3, "state_bytes_per_param": 12,
    }  # fmt: skip


def test_seeds_are_aggregated_per_cell_with_mean_and_sample_sd():
    losses = {"bf16": [5.0, 5.2, 5.4], "collage_plus": [4.9, 4.95, 5.0]}
    rows = [
        _row(precision, 0.999, seed, loss)
        for precision, values in losses.items()
        for seed, loss in enumerate(values, start=1)
    ]
    cells = quality_study.aggregate(rows)
    assert [(c["precision"], c["seeds"]) for c in cells] == [("bf16", 3), ("collage_plus", 3)]
    bf16 = cells[0]
    assert bf16["final_val_loss"] == pytest.approx(5.2)
    assert bf16["final_val_loss_sd"] == pytest.approx(statistics.stdev([5.0, 5.2, 5.4]))
    assert bf16["mean_lost_update_frac_sd"] == 0.0
    table = quality_study.seeds_table(cells).splitlines()
    assert table[0].startswith("| precision | beta2 | seeds |") and len(table) == 4
    assert "| bf16 | 0.999 | 3 | 5.2000 ± 0.2000 |" in table[2]


def test_default_grid_covers_every_precision_strategy():
    configs = Path(__file__).resolve().parent.parent / "configs" / "precision"
    strategies = {path.stem for path in configs.glob("*.yaml")}
    assert "split_fp32" in strategies
    args = quality_study.parse_args([])
    assert sorted(args.precisions) == sorted(strategies)
    assert args.beta2 == [0.95, 0.999] and args.seeds == 1 and args.model == "gpt_tiny"
