"""The step guard: skip an optimizer step whose loss or gradient norm is non-finite or an
outlier, so that one bad batch neither kills a run nor leaves a spike in its weights.

Invariant: the window changes only through ``accept`` or ``admit`` of a verdict that
``judge`` returned, so two runs that judge the same values decide the same.

A step's loss (the mean over the ranks that step in lockstep) and global gradient norm are
judged against a window of the last ``guard.window`` applied steps, held on the device:
refused when non-finite or, once the window holds ``guard.min_history`` steps, more than
``guard.z_threshold`` standard deviations above its mean (OLMo-core's test). The verdict
is a device tensor that masks the optimizer's update (``admit``;
``optim.base.TrackingOptimizer.step_mask``) until the host reads it at the next settle; a
DiLoCo/SparseLoCo replica, or an optimizer that cannot mask its step, has the engine
read it before the step. What it costs and guarantees: docs/runs.md, "The step guard".
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

# Why a step was refused, by the code ``Verdict.reason`` holds (0: applied).
REASONS = ("applied", "non-finite loss", "non-finite grad norm", "loss spike", "grad-norm spike")


@dataclass(frozen=True)
class GuardSettings:
    """``train.guard`` as the guard reads it (``config.schema.GuardConfig`` documents each)."""

    enabled: bool = True
    window: int = 128
    z_threshold: float = 6.0
    min_history: int = 8
    max_consecutive_skips: int = 5
    max_rollbacks: int = 2

    @classmethod
    def from_config(cls, cfg: Any) -> GuardSettings:
        return cls(**{name: cfg[name] for name in cls.__dataclass_fields__})


@dataclass(frozen=True)
class Verdict:
    """One step's judgement, as 0-d device tensors (read on the host only when needed)."""

    ok: torch.Tensor  # bool: apply the step
    reason: torch.Tensor  # int64 index into REASONS
    loss_z: torch.Tensor  # float64 z-scores against the window (0 before min_history)
    grad_norm_z: torch.Tensor
    values: torch.Tensor  # float64 (loss, grad_norm) as judged: what ``accept`` records


class StepGuard:
    """A rolling window of applied steps' (loss, gradient norm) on ``device``, and the test
    of each new step against it."""

    def __init__(self, settings: GuardSettings, device: torch.device) -> None:
        if settings.window < 2:
            raise ValueError(f"train.guard.window must be at least 2, got {settings.window}")
        self.settings = settings
        self.values = torch.zeros(2, settings.window, dtype=torch.float64, device=device)
        self.count = torch.zeros((), dtype=torch.int64, device=device)  # applied steps seen
        # A step judged since the last ``release`` was refused: ``admit`` holds back the rest.
        self.holding = torch.zeros((), dtype=torch.bool, device=device)

    def judge(self, loss: torch.Tensor, grad_norm: torch.Tensor | float) -> Verdict:
        """The verdict on a step with this ``loss`` and ``grad_norm``, without a host read."""
        device = self.values.device
        new = torch.stack(
            [
                torch.as_tensor(v, dtype=torch.float64, device=device).reshape(())
                for v in (loss, grad_norm)
            ]
        )
        finite = torch.isfinite(new)
        filled = torch.clamp(self.count, max=self.settings.window)
        slots = torch.arange(self.settings.window, device=device) < filled
        n = filled.clamp(min=1).to(torch.float64)
        mean = torch.where(slots, self.values, 0.0).sum(dim=1) / n
        spread = torch.where(slots, self.values - mean[:, None], 0.0)
        sd = (spread.square().sum(dim=1) / (n - 1).clamp(min=1)).sqrt()
        # A window of equal values has sd 0: a relative floor keeps its z-scores finite.
        floor = mean.abs() * 1e-6 + torch.finfo(torch.float64).tiny
        z = (new - mean) / torch.maximum(sd, floor)
        warm = filled >= self.settings.min_history
        z = torch.where(warm & finite, z, torch.zeros_like(z))
        spike = z > self.settings.z_threshold
        # the first reason that holds, in REASONS order
        reasons = torch.stack([~finite[0], ~finite[1], spike[0], spike[1]])
        codes = torch.arange(1, len(REASONS), device=device)
        reason = torch.where(reasons, codes, len(REASONS)).min()
        reason = torch.where(reason == len(REASONS), 0, reason)
        return Verdict(ok=reason == 0, reason=reason, loss_z=z[0], grad_norm_z=z[1], values=new)

    def accept(self, verdict: Verdict) -> None:
        """Add the judged step to the window if ``verdict`` applied it (no host read)."""
        self._record(verdict.ok, verdict.values)

    def admit(self, verdict: Verdict) -> torch.Tensor:
        """Whether the judged step is applied, decided on the device for a host that reads it
        only at its next settle: as ``verdict`` says, unless a step judged since the last
        ``release`` was refused. Such a later step is held back (the host, learning of the
        refusal at the settle, takes it again with the counters the refusal leaves), so every
        step runs with the lr and bias corrections of the applied steps before it. Records
        an applied step in the window, as ``accept`` does; no host read."""
        ok = verdict.ok & ~self.holding
        self.holding |= ~verdict.ok
        self._record(ok, verdict.values)
        return ok

    def release(self) -> None:
        """The host has settled every step judged so far: ``admit`` holds nothing back."""
        self.holding.zero_()

    def _record(self, applied: torch.Tensor, values: torch.Tensor) -> None:
        slot = torch.remainder(self.count, self.settings.window)
        column = self.values.index_select(1, slot.reshape(1)).squeeze(1)
        self.values.index_copy_(
            1, slot.reshape(1), torch.where(applied, values, column).unsqueeze(1)
        )
        self.count += applied.to(torch.int64)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"values": self.values.cpu().clone(), "count": self.count.cpu().clone()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        values = state["values"]
        if values.shape != self.values.shape:  # another train.guard.window: start afresh
            self.values.zero_()
            self.count.zero_()
            return
        self.values.copy_(values)
        self.count.copy_(state["count"])


def describe_skip(
    step: int, reason: str, loss_z: float | None = None, grad_norm_z: float | None = None
) -> str:
    """One line naming a refused step and why (a spike with its z-score)."""
    z = {"loss spike": loss_z, "grad-norm spike": grad_norm_z}.get(reason)
    why = f"{reason}, z = {z:.1f}" if z is not None and math.isfinite(z) else reason
    return f"step {step} skipped ({why})"
