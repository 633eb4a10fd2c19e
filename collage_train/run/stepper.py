"""One optimizer step's forward and backward, without waiting for the device.

``Stepper`` runs a step's micro-batches through the model (the plain loss or the chunked
one, ``collage_train.model.loss``) and hands their gradients to the engine; it gives the step's
learning rate (from the applied steps: a skipped step does not move the schedule) and
whether the step tracks EDQ. The loss and every statistic stay device tensors until the
window settles them (``run.guarded_window``).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F

from collage_train.data.transfer import to_device
from collage_train.engine.base import Engine, StepOutcome
from collage_train.metrics.edq import FIELDS as EDQ_FIELDS
from collage_train.optim import warmup_cosine_lr
from collage_train.run.model_setup import RunModel


class Stepper:
    """The forward and backward passes of a run's steps and validation batches, for the
    model ``built`` (its GEMMs, its loss head); ``optim`` and ``train`` are those configs."""

    def __init__(
        self,
        engine: Engine,
        forward_module: torch.nn.Module,
        built: RunModel,
        *,
        autocast_dtype: torch.dtype | None,
        optim: Any,
        train: Any,
        accum_steps: int,
        edq_every: int,
        layer_group_count: int,
    ) -> None:
        self._engine = engine
        self._module = forward_module
        self._device = engine.device
        self._autocast_dtype = autocast_dtype
        self._gemm, self._loss_chunk_tokens = built.gemm, built.loss_chunk_tokens
        self._compiled, self._max_steps = train.compile, train.max_steps
        self.accum_steps = accum_steps
        self._optim = optim
        self._edq_every = edq_every
        self._layer_group_count = layer_group_count

    def loss(self, batch: torch.Tensor) -> torch.Tensor:
        """The mean next-token loss of a device batch (its last token is only a target)."""
        inputs, targets = batch[:, :-1], batch[:, 1:]
        autocast = (
            torch.autocast(self._device.type, dtype=self._autocast_dtype)
            if self._autocast_dtype is not None
            else contextlib.nullcontext()
        )
        with autocast:
            if self._loss_chunk_tokens is not None:  # never the whole micro-batch's logits
                return self._module(
                    input_ids=inputs,
                    targets=targets,
                    grad_scale=1 / self.accum_steps,  # what the engines' backward hands it
                    use_cache=False,
                ).loss
            logits = self._module(input_ids=inputs, use_cache=False).logits
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())

    def forward_backward(
        self, next_batch: Callable[[], torch.Tensor]
    ) -> tuple[torch.Tensor, float]:
        """Gradients of ``accum_steps`` micro-batches drawn from ``next_batch`` (host
        batches); returns this rank's share of the step's mean loss (a device tensor) and
        the seconds spent fetching data."""
        data_time = 0.0
        loss_sum = torch.zeros((), device=self._device)
        for _ in range(self.accum_steps):
            fetch_start = time.perf_counter()
            batch = to_device(next_batch(), self._device)
            data_time += time.perf_counter() - fetch_start
            with self._gemm.context(compiled=self._compiled):
                loss = self.loss(batch)
                self._engine.backward(loss)
            loss_sum += loss.detach()
        loss_sum /= self.accum_steps * self._engine.world_size  # summed over ranks: the mean
        return loss_sum, data_time

    def lr(self, applied_steps: int) -> float:
        """The learning rate after ``applied_steps`` applied steps."""
        optim = self._optim
        return warmup_cosine_lr(
            applied_steps,
            peak_lr=optim.lr,
            min_lr=optim.min_lr,
            warmup_steps=optim.warmup_steps,
            max_steps=self._max_steps,
        )

    def tracks_edq(self, step: int) -> bool:
        """Whether step number ``step`` (1-based) measures EDQ (``metrics.edq_every``)."""
        return self._edq_every > 0 and step % self._edq_every == 0

    def edq_rows(self, outcome: StepOutcome, tracked: bool) -> torch.Tensor | None:
        """The step's EDQ partial sums to settle. A replica that skipped a tracked step adds
        nothing to its sums but adds its rows: every replica's settle reduces tensors of
        the same size."""
        if outcome.edq is None and tracked and self._engine.independent_replicas:
            return torch.zeros(self._layer_group_count, len(EDQ_FIELDS), device=self._device)
        return outcome.edq

    @torch.no_grad()
    def eval_losses(
        self, batches: Iterator[tuple[torch.Tensor, bool]]
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor, bool]]:
        """For each (host batch, counted) pair: the host batch, its loss in eval mode (no
        gradient) and ``counted``; the model goes back to training mode afterwards."""
        self._module.eval()
        try:
            for batch, counted in batches:
                with self._gemm.context(compiled=self._compiled):
                    loss = self.loss(to_device(batch, self._device))
                yield batch, loss, counted
        finally:
            self._module.train()
