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
from collage_train.guard import REASONS, Verdict
from collage_train.metrics.edq import FIELDS, layer_group_metrics

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
    window: list[dict[str, Any]],
    *,
    all_reduce_sum: Callable[[torch.Tensor], torch.Tensor],
    device: torch.device,
    layer_groups: Sequence[str],
    with_dtheta: bool,
    since: float,
    world_size: int = 1,
) -> None:
    """Replace the device statistics of ``window`` (the steps since the last settle) by
    host numbers, in place.

    ``window`` holds one dict per step with ``loss`` (this rank's share of the mean),
    ``grad_norm`` (already global), ``edq`` (``StepOutcome.edq`` or None) and, for a step
    the step guard refused, ``applied`` False and its ``verdict`` (``guard.Verdict``, or
    None where DeepSpeed's overflow check refused it first); ``applied`` may also be the
    guard's device verdict, with the ``verdict`` beside it, and becomes a bool here (a
    refused step's EDQ then None); afterwards ``loss`` and
    ``grad_norm`` are floats, ``edq`` the EDQ metrics (``layer_group_metrics``), ``time``
    the window's wall time per step, and a refused step's ``skip`` says why
    (``guard.REASONS``) with the z-scores. A step's loss is the mean over the ranks that
    applied it (replicas judge their steps alone), or, refused on every rank, the mean
    of the refused losses. A non-finite loss of an applied step raises
    ``TrainingDiverged`` naming its step, before anything is checkpointed.
    """
    reduced = [_loss_row(stats["loss"], stats.get("applied", True)) for stats in window]
    tracked = [stats for stats in window if stats["edq"] is not None]
    reduced += [stats["edq"].flatten() for stats in tracked]
    local = [torch.as_tensor(s["grad_norm"], dtype=torch.float64).reshape(1) for s in window]
    judged = [s for s in window if s.get("verdict") is not None]
    local += [verdict_row(s["verdict"]) for s in judged]
    on_device = [s for s in window if torch.is_tensor(s.get("applied"))]
    local += [s["applied"].to(torch.float64).reshape(1) for s in on_device]
    flat = torch.cat([t.to(device, torch.float64) for t in reduced + local])
    count = sum(t.numel() for t in reduced)
    all_reduce_sum(flat[:count])
    values = flat.tolist()
    elapsed = time.perf_counter() - since
    size = len(window)
    width = len(layer_groups) * len(FIELDS)
    for index, stats in enumerate(window):
        applied_sum, refused_sum, applied_ranks = values[3 * index : 3 * index + 3]
        if applied_ranks == 0:
            stats["loss"] = refused_sum
        elif applied_ranks == world_size:
            stats["loss"] = applied_sum
        else:  # some replicas refused it: the mean over the others
            stats["loss"] = applied_sum * world_size / applied_ranks
        stats["grad_norm"] = values[count + index]
        stats["time"] = elapsed / size
    offset = 3 * size
    for stats in tracked:
        stats["edq"] = layer_group_metrics(
            values[offset : offset + width], layer_groups, with_dtheta
        )
        offset += width
    offset = count + size + 3 * len(judged)
    for stats in on_device:
        stats["applied"] = values[offset] != 0
        offset += 1
        if not stats["applied"]:
            stats["edq"] = None
    offset = count + size
    for stats in judged:
        reason, loss_z, grad_norm_z = values[offset : offset + 3]
        offset += 3
        stats.pop("verdict")
        if not stats.get("applied", True) and int(reason) != 0:  # 0: the engine refused it
            stats["skip"] = {"reason": REASONS[int(reason)], "loss_z": loss_z}
            stats["skip"]["grad_norm_z"] = grad_norm_z
    for stats in window:
        if not stats.get("applied", True):
            stats.setdefault("skip", {"reason": OVERFLOW_REASON})
            continue
        if not math.isfinite(stats["loss"]):
            raise TrainingDiverged(
                f"the loss became {stats['loss']} at step {stats['step']}; the last good "
                "checkpoint is kept. Lower optim.lr, raise optim.warmup_steps, or use "
                "precision=mixed_fp32"
            )
