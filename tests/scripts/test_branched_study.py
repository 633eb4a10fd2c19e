"""scripts/branched_study.py: its pairing by branch point and seed, and a smoke run of a
few steps on the tiny model (in this process): the warm-up, its branches and the table."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from suite_device import device_overrides
from tiny_config import tiny_model_and_data

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import branched_study


def test_branches_are_paired_with_the_reference_of_their_point_and_seed():
    rows = [
        {"name": "warm-up", "step": 2, "precision": p, "seed": s, "final_loss": f, "mean_loss": m}
        for p, s, f, m in [
            ("mixed_fp32", 1, 5.0, 5.5), ("mixed_fp32", 2, 4.0, 4.5),
            ("bf16", 1, 5.25, 5.5), ("bf16", 2, 4.75, 5.0),
        ]
    ]  # fmt: skip
    rows.append({**rows[2], "step": 4, "final_loss": 9.0})  # another point: not paired here
    cells = branched_study.paired_rows(rows, "warm-up", 2, "bf16", "mixed_fp32", [1, 2])
    # final: +0.25 and +0.75; mean: 0 and +0.5 (sample sd of two values: |a - b| / sqrt 2)
    assert cells == ["2", "+0.5000 ± 0.3536", "+0.2500 ± 0.3536"]
    assert branched_study.paired_rows(rows, "warm-up", 2, "bf16", "mixed_fp32", [1, 3]) is None


@pytest.mark.slow
def test_a_smoke_run_warms_up_branches_and_reports(corpus_dir, cache_dir, tmp_path, capsys):
    out, record = tmp_path / "runs", tmp_path / "rows.json"
    argv = [
        "--early", "2", "--late", "4", "--branch-steps", "2", "--seeds", "1",
        "--precisions", "mixed_fp32", "bf16", "--log-every", "1", "--no-record",
        "--in-process", "--out", str(out), "--json", str(record),
        *device_overrides(), *tiny_model_and_data(corpus_dir, cache_dir),
        "train.micro_batch_size=4", "train.global_batch_size=8", "optim.warmup_steps=1",
        "train.eval_batches=2",
    ]  # fmt: skip
    table = branched_study.main(argv).splitlines()
    assert table[0].startswith("| branch point | strategy | against | seeds | final loss Δ |")
    body = [[cell.strip() for cell in line.split("|")[1:-1]] for line in table[2:]]
    assert [row[:3] for row in body] == [
        ["early (step 2)", "mixed_fp32", "mixed_fp32"],
        ["early (step 2)", "bf16", "mixed_fp32"],
        ["late (step 4)", "mixed_fp32", "mixed_fp32"],
        ["late (step 4)", "bf16", "mixed_fp32"],
        ["late (step 4) of a bf16 run", "collage_plus", "bf16"],
    ]
    for row in (body[0], body[2]):  # the reference against itself
        assert row[3:6] == ["1", "+0.0000 ± 0.0000", "+0.0000 ± 0.0000"]
    for row in (body[1], body[3], body[4]):  # measured, or skipped with the note
        assert row[6] == branched_study.SWITCH_NOTE if row[3] == "-" else row[3] == "1"
    warm = out / "warm-up"
    assert sorted(p.name for p in (warm / "checkpoints").iterdir()) == ["step-2", "step-4"]
    for step in (2, 4):
        branch = out / f"warm-up-{step}-mixed_fp32-1"
        lineage = json.loads((branch / "branch.json").read_text())
        assert lineage["step"] == step and lineage["data_seed"] == 1
        assert [s for s, _ in branched_study.losses(branch)] == [step + 1, step + 2]
    rows = json.loads(record.read_text())
    assert {(r["step"], r["precision"]) for r in rows} >= {(2, "mixed_fp32"), (4, "mixed_fp32")}
    capsys.readouterr()
    assert branched_study.main(argv).splitlines() == table  # again: every run kept, none rerun
    assert "mixed_fp32 from step" not in capsys.readouterr().out  # refused ones are probed again
