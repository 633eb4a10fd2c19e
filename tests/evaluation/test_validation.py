"""The validator on its own: when it is due, and its mean over counted windows only."""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch

from collage_train.evaluation.validation import Validator


class Letters:
    """A tokenizer whose every token is one byte of text."""

    def decode(self, ids: list[int]) -> str:
        return "x" * len(ids)


def validator(windows, every: int = 4, max_steps: int = 10) -> Validator:
    engine = SimpleNamespace(device=torch.device("cpu"), all_reduce_sum=lambda t: t)
    losses = {id(batch): loss for batch, loss, _ in windows}

    def evaluated(batches):
        for batch, counted in batches:
            yield batch, torch.tensor(losses[id(batch)]), counted

    return Validator(
        engine,
        lambda: iter([(batch, counted) for batch, _, counted in windows]),
        evaluated,
        Letters(),
        SimpleNamespace(eval_every=every, max_steps=max_steps),
    )


def test_due_every_eval_every_steps_and_at_the_last():
    run = validator([])
    assert [step for step in range(1, 11) if run.due(step)] == [4, 8, 10]


def test_the_mean_leaves_out_padding_forwards_and_counts_bytes_once():
    batch = torch.zeros(2, 5, dtype=torch.long)  # 2 rows of 4 predicted tokens
    windows = [(batch, 2.0, True), (batch.clone(), 4.0, True), (batch.clone(), 50.0, False)]
    run = validator(windows)
    results = run.run()
    assert results["val_loss"] == 3.0
    assert results["val_ppl"] == math.exp(3.0)
    assert results["val_bpb"] == 3.0 / math.log(2)  # one byte per token
    assert run.run() == results  # the text's size is kept from the first pass
