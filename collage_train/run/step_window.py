"""A step's statistics (``StepRecord``), and turning a window of them into host numbers
with one wait.

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
from dataclasses import dataclass
from typing import Any

import torch

from collage_train.errors import TrainingDiverged
from collage_train.metrics.edq import FIELDS, layer_group_metrics
from collage_train.run.guard import REASONS, Verdict


@dataclass
class StepRecord:
    """One optimizer step's statistics: device tensors (this rank's share) until
    ``settle`` turns them into host numbers.

    ``applied`` is False for a step refused at once (the guard's verdict read before the
    update, or DeepSpeed's overflow check), the guard's device verdict for a step whose
    update it masked, True otherwise; ``verdict`` is the guard's judgement of a step it
    refused or may have refused. ``settle`` fills ``time`` (the window's wall seconds per
    step) and, for a refused step, ``skip`` (reason and z-scores); ``edq`` becomes the EDQ
    metrics (``metrics.edq.layer_group_metrics``), None for a refused step.
    """

    step: int
    loss: torch.Tensor | float
    lr: float
    grad_norm: torch.Tensor | float
    data_time: float = 0.0
    edq: torch.Tensor | dict[str, float] | None = None
    applied: bool | torch.Tensor = True
    verdict: Verdict | None = None
    time: float = 0.0
    skip: dict[str, Any] | None = None


# A step that DeepSpeed's own overflow check refused before the guard was asked.
OVERFLOW_REASON = "non-finite grad norm (DeepSpeed's overflow check)"


def verdict_row(verdict: Verdict) -> torch.Tensor:
    """The verdict's reason code and z-scores as one float64 row, still on the device."""
    parts = (verdict.reason, verdict.loss_z, verdict.grad_norm_z)
    return torch.stack([part.to(torch.float64) for part in parts])


def _loss_row(share: torch.Tensor, applied: bool | torch.Tensor) -> torch.Tensor:
    """A step's loss share as (applied share, refused share, applied ranks): summed over
    ranks, the parts of a step that some ranks refused stay apart. ``applied`` may be the
    step guard's device verdict (then nothing is read here)."""
    share = share.reshape(1).to(torch.float64)
    zero = torch.zeros_like(share)
    if torch.is_tensor(applied):
        ok = applied.reshape(1)
        applied_share, refused_share = torch.where(ok, share, zero), torch.where(ok, zero, share)
        return torch.cat([applied_share, refused_share, ok.to(share.dtype)])
    return torch.cat([share, zero, zero + 1] if applied else [zero, share, zero])


def settle(
    window: Sequence[StepRecord],
    *,
    all_reduce_sum: Callable[[torch.Tensor], torch.Tensor],
    device: torch.device,
    layer_groups: Sequence[str],
    with_dtheta: bool,
    since: float,
    world_size: int = 1,
) -> None:
    """Replace the device statistics of ``window`` (the steps since the last settle) by
    host numbers, in place (``StepRecord`` says what each field becomes).

    A step's loss is the mean over the ranks that applied it (replicas judge their steps
    alone), or, refused on every rank, the mean of the refused losses. A non-finite loss
    of an applied step raises ``TrainingDiverged`` naming its step, before anything is
    checkpointed.
    """
    reduced = [_loss_row(record.loss, record.applied) for record in window]
    tracked = [record for record in window if record.edq is not None]
    reduced += [record.edq.flatten() for record in tracked]
    local = [torch.as_tensor(r.grad_norm, dtype=torch.float64).reshape(1) for r in window]
    judged = [r for r in window if r.verdict is not None]
    local += [verdict_row(r.verdict) for r in judged]
    on_device = [r for r in window if torch.is_tensor(r.applied)]
    local += [r.applied.to(torch.float64).reshape(1) for r in on_device]
    flat = torch.cat([t.to(device, torch.float64) for t in reduced + local])
    count = sum(t.numel() for t in reduced)
    all_reduce_sum(flat[:count])
    values = flat.tolist()
    elapsed = time.perf_counter() - since
    size = len(window)
    width = len(layer_groups) * len(FIELDS)
    for index, record in enumerate(window):
        applied_sum, refused_sum, applied_ranks = values[3 * index : 3 * index + 3]
        if applied_ranks == 0:
            record.loss = refused_sum
        elif applied_ranks == world_size:
            record.loss = applied_sum
        else:  # some replicas refused it: the mean over the others
            record.loss = applied_sum * world_size / applied_ranks
        record.grad_norm = values[count + index]
        record.time = elapsed / size
    offset = 3 * size
    for record in tracked:
        record.edq = layer_group_metrics(values[offset : offset + width], layer_groups, with_dtheta)
        offset += width
    offset = count + size + 3 * len(judged)
    for record in on_device:
        record.applied = values[offset] != 0
        offset += 1
        if not record.applied:
            record.edq = None
    offset = count + size
    for record in judged:
        reason, loss_z, grad_norm_z = values[offset : offset + 3]
        offset += 3
        record.verdict = None
        if not record.applied and int(reason) != 0:  # 0: the engine refused it
            record.skip = {"reason": REASONS[int(reason)], "loss_z": loss_z}
            record.skip["grad_norm_z"] = grad_norm_z
    for record in window:
        if not record.applied:
            if record.skip is None:
                record.skip = {"reason": OVERFLOW_REASON}
            continue
        if not math.isfinite(record.loss):
            raise TrainingDiverged(
                f"the loss became {record.loss} at step {record.step}; the last good "
                "checkpoint is kept. Lower optim.lr, raise optim.warmup_steps, or use "
                "precision=mixed_fp32"
            )
