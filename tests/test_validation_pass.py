"""The trainer's validation pass: the plan's windows counted, padding forwards not, and the
one line at start-up saying how the pass was fitted to the split and the ranks."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from collage_train.data.validation import plan_validation, window_batch
from collage_train.trainer import Trainer


def test_padding_forwards_are_run_but_not_counted(make_cfg, tmp_path):
    """Rank 1 of 2 on 3 one-window micro-batches evaluates window 1, then repeats window 0
    as padding: its loss is window 1's alone (the all-reduce of one process adds nothing)."""
    trainer = Trainer(make_cfg(), tmp_path / "run")
    data = trainer.data
    trainer.validation_plan = plan_validation(
        3, seq_len=data.seq_len, world_size=2, micro_batch_size=1, eval_batches=3
    )
    assert trainer.validation_plan.padding == 1

    def loss_of(window: int) -> float:
        trainer.forward_module.eval()
        with torch.no_grad(), trainer.cpu_bf16_gemm.context(compiled=False):
            return trainer.stepper.loss(
                window_batch(data.val_tokens, data.seq_len, window, 1)
            ).item()

    losses = [loss_of(window) for window in range(3)]
    assert len(set(losses)) == 3  # a counted padding forward would change the mean
    trainer.data = dataclasses.replace(data, rank=1, world_size=2)
    assert trainer.evaluate()["val_loss"] == losses[1]
    trainer.data = dataclasses.replace(data, rank=0, world_size=2)
    # float32 sums on the device: equal to the float64 mean to float32's rounding
    assert trainer.evaluate()["val_loss"] == pytest.approx((losses[0] + losses[2]) / 2, rel=1e-6)


def test_one_line_says_how_the_pass_fits_a_short_split(make_cfg, tmp_path, capsys):
    Trainer(make_cfg("train.eval_batches=100000"), tmp_path / "run")
    lines = [line for line in capsys.readouterr().out.splitlines() if "validation" in line]
    assert len(lines) == 1 and lines[0].startswith("validation: the first "), lines
    assert "asks for 800000" in lines[0]
