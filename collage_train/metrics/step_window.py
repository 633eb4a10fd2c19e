"""Turning a window of steps' device statistics into host numbers, with one wait.

Each optimizer step leaves its loss, gradient norm and EDQ partial sums on the device
(this rank's share); the loop runs ahead until it needs numbers (to log, validate or
checkpoint). ``settle`` then sums every rank's shares with one all-reduce and brings
them to the host with one transfer: the only point where the host waits for the
device, so it also times the window.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from collage_train.errors import TrainingDiverged
from collage_train.metrics.edq import FIELDS, layer_group_metrics


def settle(
    window: list[dict[str, Any]],
    *,
    all_reduce_sum: Callable[[torch.Tensor], torch.Tensor],
    device: torch.device,
    layer_groups: Sequence[str],
    with_dtheta: bool,
    since: float,
) -> None:
    """Replace the device statistics of ``window`` (the steps since the last settle) by
    host numbers, in place.

    ``window`` holds one dict per step with ``loss`` (this rank's share of the mean),
    ``grad_norm`` (already global) and ``edq`` (``StepOutcome.edq`` or None);
    afterwards ``loss`` and ``grad_norm`` are floats, ``edq`` the EDQ metrics
    (``layer_group_metrics``) and ``time`` the window's wall time per step. A non-finite
    loss raises ``TrainingDiverged`` naming its step, before anything is checkpointed.
    """
    reduced = [stats["loss"].reshape(1) for stats in window]
    tracked = [stats for stats in window if stats["edq"] is not None]
    reduced += [stats["edq"].flatten() for stats in tracked]
    local = [torch.as_tensor(s["grad_norm"], dtype=torch.float64).reshape(1) for s in window]
    flat = torch.cat([t.to(device, torch.float64) for t in reduced + local])
    count = sum(t.numel() for t in reduced)
    all_reduce_sum(flat[:count])
    values = flat.tolist()
    elapsed = time.perf_counter() - since
    size = len(window)
    width = len(layer_groups) * len(FIELDS)
    for index, stats in enumerate(window):
        stats["loss"] = values[index]
        stats["grad_norm"] = values[count + index]
        stats["time"] = elapsed / size
    offset = size
    for stats in tracked:
        stats["edq"] = layer_group_metrics(
            values[offset : offset + width], layer_groups, with_dtheta
        )
        offset += width
    for stats in window:
        if not math.isfinite(stats["loss"]):
            raise TrainingDiverged(
                f"the loss became {stats['loss']} at step {stats['step']}; the last good "
                "checkpoint is kept. Lower optim.lr, raise optim.warmup_steps, or use "
                "precision=mixed_fp32"
            )
