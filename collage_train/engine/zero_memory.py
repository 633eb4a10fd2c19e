"""Analytic model-state bytes per parameter per rank under DeepSpeed ZeRO.

What one rank of N holds, per parameter, for a precision strategy (DeepSpeed 0.19.8):
the weights whole at stages 1-2 and 1/N at stage 3; the gradients at the step whole at
stage 1 and 1/N at stages 2-3, in ``distributed.grad_accum_dtype`` (the weights' dtype
when it is not given); the optimizer state 1/N; a master partition 1/N only where the
master dtype differs from the weights' (mixed_fp32) or with offload: elsewhere
``engine.zero.share_weight_partitions`` has the optimizer step the weight partition
itself, and the master costs nothing beyond the weights. ``persistent`` (weights +
master + optimizer state) is what survives between steps and what
``ZeroEngine.state_bytes`` measures; gradients live only during a step. Measured by
scripts/bench_zero_memory.py.
The table, and DeepSpeed's behaviour behind the master's row: docs/distributed.md,
"Choosing a ZeRO stage".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from collage_train.precision.base import PrecisionStrategy


@dataclass(frozen=True)
class ZeroStateBytes:
    """Bytes per parameter held by one rank, by component."""

    weights: float
    gradients: float
    master: float
    optimizer: float

    @property
    def persistent(self) -> float:
        return self.weights + self.master + self.optimizer

    @property
    def total(self) -> float:
        return self.persistent + self.gradients


def optimizer_state_bytes(strategy: PrecisionStrategy) -> float:
    """Bytes per parameter of the optimizer's own state (moments, dtheta, dv)."""
    return float(sum(nbytes for _, nbytes in strategy.optimizer_state))


def zero_state_bytes(
    strategy: PrecisionStrategy,
    stage: int,
    world_size: int,
    grad_accum_dtype: torch.dtype | None = None,
    *,
    offload: bool = False,
) -> ZeroStateBytes:
    """Analytic bytes per parameter on one of ``world_size`` ranks at ZeRO ``stage``.

    ``offload``: optimizer or parameter offload is on, so a master partition in the
    weights' dtype is a copy of its own (it is the weight partition otherwise).
    """
    param = strategy.param_dtype.itemsize
    grad = (grad_accum_dtype or strategy.param_dtype).itemsize
    master_dtype = strategy.master_dtype or strategy.param_dtype
    is_weights = master_dtype == strategy.param_dtype and not offload
    return ZeroStateBytes(
        weights=param if stage < 3 else param / world_size,
        gradients=grad if stage == 1 else grad / world_size,
        master=0.0 if is_weights else master_dtype.itemsize / world_size,
        optimizer=optimizer_state_bytes(strategy) / world_size,
    )
