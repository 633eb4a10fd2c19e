"""scripts/quality_study.py's seed aggregation and table, without training runs."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
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
    assert cells[0]["val_diff"] is None  # no fp32 runs to pair with
    bf16 = cells[0]
    assert bf16["final_val_loss"] == pytest.approx(5.2)
    assert bf16["final_val_loss_sd"] == pytest.approx(statistics.stdev([5.0, 5.2, 5.4]))
    assert bf16["mean_lost_update_frac_sd"] == 0.0
    table = quality_study.seeds_table(cells).splitlines()
    assert table[0].startswith("| model | precision | beta2 | seeds |") and len(table) == 4
    assert "| gpt_tiny | bf16 | 0.999 | 3 | 5.2000 ± 0.2000 | n/a |" in table[2]


def test_difference_from_fp32_is_paired_seed_by_seed_per_model():
    losses = {"fp32": [5.0, 5.5, 6.0], "bf16": [5.1, 5.7, 6.3]}
    rows = [
        {**_row(precision, 0.999, seed, loss), "model": model}
        for model in ("gpt_tiny", "llama_tiny")
        for precision, values in losses.items()
        for seed, loss in enumerate(values, start=1)
    ]
    rows[-1]["final_val_loss"] += 1.0  # llama_tiny bf16 seed 3 only
    cells = {(c["model"], c["precision"]): c for c in quality_study.aggregate(rows)}
    gpt = cells[("gpt_tiny", "bf16")]
    assert gpt["val_diff"] == pytest.approx(0.2)  # differences 0.1, 0.2, 0.3
    assert gpt["val_diff_sd"] == pytest.approx(0.1)
    assert gpt["final_val_loss_sd"] == pytest.approx(0.6)  # unpaired: seed noise dominates
    assert cells[("llama_tiny", "bf16")]["val_diff"] == pytest.approx(0.2 + 1.0 / 3)
    assert cells[("gpt_tiny", "fp32")]["val_diff"] == 0.0


def test_a_study_restarted_with_its_json_skips_the_runs_it_holds(tmp_path, monkeypatch):
    done = {**_row("fp32", 0.999, None, 5.0), "model": "gpt_tiny", "steps": 7}
    path = tmp_path / "rows.json"
    path.write_text(json.dumps([done]))
    ran = []

    def fake_run(precision, beta2, args, run_dir, seed, model):
        ran.append((model, precision))
        return {**_row(precision, beta2, seed, 5.5), "model": model, "steps": args.steps}

    monkeypatch.setattr(quality_study, "study_run", fake_run)
    monkeypatch.setattr(
        sys, "argv",
        ["quality_study.py", "--steps", "7", "--beta2", "0.999", "--precisions", "fp32", "bf16",
         "--json", str(path), "--no-record"],
    )  # fmt: skip
    quality_study.main()
    assert ran == [("gpt_tiny", "bf16")]
    assert [r["precision"] for r in json.loads(path.read_text())] == ["fp32", "bf16"]


def test_default_grid_covers_every_precision_strategy():
    configs = Path(__file__).resolve().parents[2] / "configs" / "precision"
    strategies = {path.stem for path in configs.glob("*.yaml")}
    assert "split_fp32" in strategies
    args = quality_study.parse_args([])
    assert sorted(args.precisions) == sorted(strategies)
    assert args.beta2 == [0.95, 0.999] and args.seeds == 1 and args.models == ["gpt_tiny"]
