"""Bits per byte (collage_train.metrics.bits_per_byte): the unit, the text it counts, and
the validation records, summary and comparison table that carry it."""

from __future__ import annotations

import json
import math

import pytest
import torch

from collage_train.cli import train
from collage_train.metrics import RecordingSink
from collage_train.metrics.bits_per_byte import bits_per_byte, target_text_size
from collage_train.metrics.plots import load_run, summary_table
from collage_train.trainer import Trainer


def test_one_nat_per_token_at_one_byte_per_token_is_one_over_ln_2_bits():
    assert bits_per_byte(math.log(2), tokens=10, num_bytes=10) == pytest.approx(1.0, rel=1e-15)
    assert bits_per_byte(2.0, tokens=300, num_bytes=1200) == pytest.approx(
        2.0 * 300 / (1200 * math.log(2)), rel=1e-15
    )
    assert bits_per_byte(2.0, tokens=3, num_bytes=0) is None


def test_the_text_size_is_utf8_bytes_of_the_predicted_tokens(make_cfg, tmp_path):
    tokenizer = Trainer(make_cfg("train.max_steps=1"), tmp_path / "run").data.tokenizer
    text = "Crème brûlée costs 5 € — naïve café 🙂 prices"
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text  # the round trip this count relies on
    batch = torch.tensor([[tokenizer.eot_id, *ids], [tokenizer.eot_id, *ids]])
    tokens, num_bytes = target_text_size(tokenizer, batch)
    assert tokens == 2 * len(ids)
    assert num_bytes == 2 * len(text.encode("utf-8")) and num_bytes > 2 * len(text)


def test_validation_reports_bits_per_byte_of_the_windows(make_cfg, tmp_path):
    trainer = Trainer(make_cfg("train.max_steps=1"), tmp_path / "run")
    val = trainer.evaluate()
    tokens = num_bytes = 0  # the held-out windows' text, counted here independently
    for batch, counted in trainer.data.validation_batches(trainer.validation_plan):
        if counted:
            for row in batch[:, 1:].tolist():
                tokens += len(row)
                num_bytes += len(trainer.data.tokenizer.decode(row).encode("utf-8"))
    assert 1.5 < num_bytes / tokens < 8  # a SentencePiece vocabulary on English text
    assert val["val_bpb"] == pytest.approx(
        val["val_loss"] * tokens / (num_bytes * math.log(2)), rel=1e-12
    )
    assert trainer.evaluate() == val  # counted once, the same every time


def test_records_summary_and_comparison_carry_bits_per_byte(make_cfg, tmp_path):
    sink = RecordingSink()
    run_dir = tmp_path / "run"
    summary = train(make_cfg(), run_dir, extra_sinks=[sink])
    validations = [r for r in sink.records if "val_loss" in r]
    assert validations and all(r["val_bpb"] > 0 for r in validations)
    assert summary["final_val_bpb"] == validations[-1]["val_bpb"]
    on_disk = json.loads((run_dir / "summary.json").read_text())
    assert on_disk["final_val_bpb"] == summary["final_val_bpb"]
    logged = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["val_bpb"] for r in logged if "val_bpb" in r] == [r["val_bpb"] for r in validations]
    table = summary_table([load_run(run_dir)])
    assert "final val bits/byte" in table.splitlines()[0]
    assert f"{summary['final_val_bpb']:.4f}" in table.splitlines()[2]
