"""Validation during training: the mean loss and bits per byte on held-out windows.

``Validator`` knows when it is due (every ``train.eval_every`` steps and at the last) and
evaluates the windows of the run's validation plan (``collage_train.data.validation``): the
same windows whatever the world size, every rank running the same number of forwards.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import torch

from collage_train.engine.base import Engine
from collage_train.metrics.bits_per_byte import bits_per_byte, target_text_size


class Validator:
    """The run's validation (``train``: the ``train`` config): due when, and its results."""

    def __init__(
        self,
        engine: Engine,
        batches: Callable[[], Iterator[tuple[torch.Tensor, bool]]],
        losses: Callable[
            [Iterator[tuple[torch.Tensor, bool]]], Iterator[tuple[torch.Tensor, torch.Tensor, bool]]
        ],
        tokenizer: Any,
        train: Any,
    ) -> None:
        self._engine = engine
        self._batches = batches
        self._losses = losses
        self._tokenizer = tokenizer
        self._every, self._max_steps = train.eval_every, train.max_steps
        self._text_size: tuple[int, int] | None = None  # tokens, bytes: the first pass's

    def due(self, step: int) -> bool:
        return step % self._every == 0 or step == self._max_steps

    def run(self) -> dict[str, float]:
        """``val_loss``, ``val_ppl`` and ``val_bpb`` (``metrics.bits_per_byte``) over the
        held-out windows; a padding forward (a rank whose turn found no micro-batch left)
        is not counted."""
        device = self._engine.device
        totals = torch.zeros(2, device=device)  # loss sum, batch count
        text_size = [0, 0] if self._text_size is None else None  # tokens, bytes
        for batch, loss, counted in self._losses(self._batches()):
            if counted:
                totals[0] += loss
                totals[1] += 1
                if text_size is not None:  # the first pass: the windows' text, on the host
                    tokens, num_bytes = target_text_size(self._tokenizer, batch)
                    text_size[0] += tokens
                    text_size[1] += num_bytes
        loss_sum, batches = self._engine.all_reduce_sum(totals).tolist()
        if text_size is not None:  # once per run: the same windows every time
            sizes = torch.tensor(text_size, dtype=torch.float64, device=device)
            tokens, num_bytes = self._engine.all_reduce_sum(sizes).tolist()
            self._text_size = (int(tokens), int(num_bytes))
        val_loss = loss_sum / batches
        return {
            "val_loss": val_loss,
            "val_ppl": math.exp(min(val_loss, 50.0)),
            "val_bpb": bits_per_byte(val_loss, *self._text_size),
        }
