"""KahanAdamW: AdamW on bf16 weights with a bf16 Kahan compensation buffer.

The numerics of torch-optimi 0.3.3's ``optimi.AdamW(..., kahan_sum=True)`` on bf16
parameters, as a ``TrackingOptimizer`` (chunked steps, EDQ, full-precision read and
write, flat partitions): the compensated-summation rival of Collage-light. Weight,
gradient, m, v and the compensation c are all bf16, 10 bytes/param. The moments are
stored bias-corrected (optimi's debiased betas, from the integer step in float64 on the
host); the update goes into c first, c is then added into the weight and keeps what the
weight could not take, so the full-precision value is ``theta + c``. Weight decay is
optimi's ``decouple_lr=False`` convention, on the bf16 weight outside the compensated
sum. Each line is the ATen kernel optimi's for-loop path calls: bitwise equal to that
path on the same device.

The step, its caveats and the comparison with Collage: docs/strategies.md,
"Kahan summation (`bf16_kahan`: `KahanAdamW`, torch-optimi's `kahan_sum=True`)".
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from collage_train.optim.base import TrackingOptimizer, commit_

__all__ = ["KahanAdamW", "debiased_beta"]


def debiased_beta(beta: float, step: int) -> float:
    """``beta * (1 - beta^(t-1)) / (1 - beta^t)`` in float64, evaluated as
    ``(beta^t - beta) / (beta^t - 1)``: the expression optimi evaluates, hence the same
    float64 value (0 at step 1, so m = g and v = g^2 after the first step)."""
    power = beta**step
    return (power - beta) / (power - 1.0)


@dataclass(frozen=True)
class KahanScalars:
    """The host-side numbers of one step (Python floats: each kernel rounds them to fp32,
    except the bf16 ``add_`` of ``eps``, which rounds it to bf16, as in optimi)."""

    lr: float
    beta1_comp: float  # 1 - b1_hat, the lerp weight
    beta2_hat: float
    beta2_comp: float  # 1 - b2_hat
    eps: float
    lr_wd: float  # lr * wd: the weight is multiplied by 1 - lr_wd (0: no weight decay)


def step_scalars(group: dict[str, Any], step: int) -> KahanScalars:
    """The scalars of integer step ``step`` (1 for the first) of a param group."""
    beta1, beta2 = group["betas"]
    lr, weight_decay = group["lr"], group["weight_decay"]
    beta1_hat, beta2_hat = debiased_beta(beta1, step), debiased_beta(beta2, step)
    return KahanScalars(
        lr, 1.0 - beta1_hat, beta2_hat, 1.0 - beta2_hat, group["eps"], lr * weight_decay
    )


def kahan_piece_step(
    weight: torch.Tensor,
    comp: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    grad: torch.Tensor,
    s: KahanScalars,
    track: bool,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """One step of (a piece of) one tensor, in place; all five tensors bf16.

    With ``track``, returns the weight before the step and the intended update in fp32
    (``(-lr * m) / d`` as ``addcdiv_`` forms it, plus ``-lr * wd * theta``), for EDQ.
    The one temporary is a bf16 tensor the size of the piece. Under a ``mask``
    (``TrackingOptimizer.step_mask``) the same kernels run on copies of the four state
    pieces, written back where it holds (a False one: nothing changes, the update is 0).
    """
    grad = grad.to(torch.bfloat16)
    before = weight.clone() if track else None
    targets = (weight, comp, exp_avg, exp_avg_sq)
    if mask is not None:
        weight, comp, exp_avg, exp_avg_sq = (t.clone() for t in targets)
    if s.lr_wd != 0:
        weight.mul_(1.0 - s.lr_wd)  # optimi's factor, also evaluated in float64
    exp_avg.lerp_(grad, s.beta1_comp)
    exp_avg_sq.mul_(s.beta2_hat).addcmul_(grad, grad, value=s.beta2_comp)
    scratch = exp_avg_sq.sqrt().add_(s.eps)  # the denominator d
    update = None
    if track:
        update = exp_avg.float().mul_(-s.lr).div_(scratch.float())
        if s.lr_wd != 0:
            update.add_(before.float(), alpha=-s.lr_wd)
    comp.addcdiv_(exp_avg, scratch, value=-s.lr)
    scratch.copy_(weight)
    weight.add_(comp)
    scratch.sub_(weight)  # theta - theta': what the weight took, negated
    comp.add_(scratch)
    if mask is not None:
        for target, new in zip(targets, (weight, comp, exp_avg, exp_avg_sq), strict=True):
            commit_(target, new, mask)
        update = torch.where(mask, update, 0.0) if track else None
    return (before, update) if track else None


class KahanAdamW(TrackingOptimizer):
    """AdamW on bf16 parameters with bf16 m, v and a bf16 Kahan compensation (10 B/param).

    A drop-in for ``torch.optim.AdamW`` on a bf16 model, stepping as
    ``optimi.AdamW(params, lr, betas, weight_decay, eps, kahan_sum=True)`` does (module
    docstring); ``step_chunk_numel`` bounds the elements a step works on at a time.
    """

    low_part = "kahan_comp"  # the full-precision value is theta + c
    masks_on_device = True  # ``step_mask``: see ``kahan_piece_step``

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
    ) -> None:
        super().__init__(params, lr, betas, eps, weight_decay)
        self._require_bf16_params("keeps a bf16 Kahan compensation beside each weight")

    def _state_for(self, param: torch.Tensor) -> dict[str, Any]:
        state = self.state[param]
        if not state:
            state["step"] = 0
            for key in ("exp_avg", "exp_avg_sq", "kahan_comp"):
                state[key] = torch.zeros_like(param, memory_format=torch.preserve_format)
        return state

    def _step_group(self, group: dict[str, Any], params: list[torch.Tensor]) -> None:
        for param in params:
            state = self._state_for(param)
            state["step"] += 1
            if param.numel() == 0:
                continue
            self._step_tensor(param, state, step_scalars(group, state["step"]))

    def _step_tensor(
        self, param: torch.Tensor, state: dict[str, Any], scalars: KahanScalars
    ) -> None:
        """One tensor's step in ``_pieces``, its EDQ partials kept when tracked: the
        realised change is that of the bf16 weight, and c is passed as the low part
        (``dtheta``), as for Collage."""
        mask = self.step_mask
        sums = self._edq_sums(param)
        tensors = [param.detach(), state["kahan_comp"], state["exp_avg"], state["exp_avg_sq"]]
        for start, piece in self._pieces([*tensors, param.grad]):
            result = kahan_piece_step(*piece, scalars, track=sums is not None, mask=mask)
            if result is None:
                continue
            before, update = (t.reshape(-1) for t in result)
            comp = piece[1].reshape(-1)
            if mask is not None:  # a refused step's partials are all zero
                comp = torch.where(mask, comp, 0.0)
            sums.add(start, before, piece[0].reshape(-1), update, comp)
        self._keep_edq(param, sums)
