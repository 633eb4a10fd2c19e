"""AdamW with decoupled weight decay, integer step counts and optional master weights.

Serves the fp32, mixed_fp32 and bf16_moments strategies: ``master_dtype=None`` updates
the parameters themselves, with moments in their dtype; ``master_dtype=torch.float32``
on bf16 parameters keeps an fp32 master and fp32 moments and rounds the result into the
parameter; ``moment_dtype=torch.bfloat16`` stores the moments in bf16, rounded to
nearest after an update computed from their fp32 values. Bias corrections come from an
integer step count, in float64 on the host; elementwise work is multi-tensor
``torch._foreach_*`` kernels in ``adamw_moments_`` and ``adamw_updates`` (parts of which
``BlockwiseAdamW`` shares). The all-bf16 strategies use ``CollageAdamW``.

Details: docs/strategies.md, "AdamW: master weights and moment dtypes".
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from collage_train.optim.base import (
    TrackingOptimizer,
    bias_corrections,
    commit_,
    flat_view,
    write_back,
)


class AdamW(TrackingOptimizer):
    """AdamW (Loshchilov & Hutter) whose state may be held in a wider dtype than the params.

    A tracked step (EDQ) applies its updates ``step_chunk_numel`` elements at a time
    (``_apply_tracked``), so that tracking costs one chunk of copies, not a whole tensor.
    """

    tracks_in_chunks = True  # False: a subclass whose masters are not plain tensors
    # True: ``_masters`` rebuilds the masters for each step, ``_store_masters`` keeps them
    masters_rebuilt = False
    masks_on_device = True  # a masked step (``step_mask``) runs as ``_step_in_chunks``

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        master_dtype: torch.dtype | None = None,
        moment_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(params, lr, betas, eps, weight_decay)
        self.master_dtype = master_dtype
        self.moment_dtype = moment_dtype

    def _keeps_master(self, param: torch.Tensor) -> bool:
        return self.master_dtype is not None and param.dtype != self.master_dtype

    def _state_for(self, param: torch.Tensor) -> dict[str, Any]:
        state = self.state[param]
        if not state:
            target = param.detach()
            if self._keeps_master(param):
                target = target.to(self.master_dtype, copy=True)
                state["master"] = target
            state["step"] = 0
            moments = {"dtype": self.moment_dtype or target.dtype}
            state["exp_avg"] = torch.zeros_like(target, **moments)
            state["exp_avg_sq"] = torch.zeros_like(target, **moments)
        return state

    def _full_precision(self, param: torch.Tensor) -> torch.Tensor:
        """The fp32 master when one is kept (before the first step: the weight itself)."""
        master = self.state[param].get("master")
        if master is None:
            return super()._full_precision(param)
        return master.to(torch.float32, copy=True)

    def _load_full_precision(self, param: torch.Tensor, value: torch.Tensor) -> None:
        """master = value, weight = its rounding (the master is created if not yet there)."""
        if self._keeps_master(param):
            self._state_for(param)["master"].copy_(value)
        param.detach().copy_(value)

    def _masters(self, params: list[torch.Tensor], states: list[dict[str, Any]]) -> list:
        """The tensors the update is applied to: fp32 masters, or the parameters."""
        return [s.get("master", p) for s, p in zip(states, params, strict=True)]

    def _store_masters(
        self, params: list[torch.Tensor], states: list[dict[str, Any]], masters: list
    ) -> None:
        """Round updated masters into the (bf16) parameters the model computes with."""
        kept = [(p, m) for p, s, m in zip(params, states, masters, strict=True) if "master" in s]
        if kept:
            torch._foreach_copy_([p for p, _ in kept], [m for _, m in kept])

    def _step_group(self, group: dict[str, Any], params: list[torch.Tensor]) -> None:
        states = [self._state_for(p) for p in params]
        targets = self._masters(params, states)
        for s in states:
            s["step"] += 1
        if self.moment_dtype is not None or self.step_mask is not None:
            self._step_in_chunks(group, params, states, targets)
            if self.masters_rebuilt:
                self._store_masters(params, states, targets)
            return
        grads = [p.grad.to(t.dtype) for p, t in zip(params, targets, strict=True)]
        exp_avgs = [s["exp_avg"] for s in states]
        exp_avg_sqs = [s["exp_avg_sq"] for s in states]

        adamw_moments_(exp_avgs, exp_avg_sqs, grads, group["betas"])
        steps = [s["step"] for s in states]
        updates = adamw_updates(group, steps, exp_avgs, exp_avg_sqs, targets)

        if self.track_edq and self.tracks_in_chunks:
            self._apply_tracked(params, targets, updates)
            return
        before = self._snapshot(params)
        torch._foreach_add_(targets, updates)
        self._store_masters(params, states, targets)
        self._record_edq(params, before, updates)

    def _step_in_chunks(
        self,
        group: dict[str, Any],
        params: list[torch.Tensor],
        states: list[dict[str, Any]],
        targets: list[torch.Tensor],
    ) -> None:
        """The AdamW step of ``_step_group`` one tensor and ``step_chunk_numel`` elements at
        a time, with moments stored in ``moment_dtype`` and computed in the target's dtype.

        The same functions (``adamw_moments_``, ``adamw_updates``) as the whole-list path,
        on one-chunk lists, so the same ``torch._foreach_*`` kernels: fused ops (lerp,
        addcmul, add with alpha, division by a scalar) round alike only within one kernel
        family (on CUDA the plain and the foreach kernels differ), so with moments in the
        target's own dtype the two paths give the same bits on every device (tested). The
        fp32 copies of the moments and the update exist for one chunk at a time. A step
        under a ``step_mask`` runs here too: each chunk's new values are written where it
        holds.
        """
        mask = self.step_mask
        for param, state, target in zip(params, states, targets, strict=True):
            pending: list[tuple[torch.Tensor, torch.Tensor]] = []  # non-contiguous tensors
            grad = param.grad.reshape(-1)
            m_low, v_low, flat_weight = (
                flat_view(x, pending)
                for x in (state["exp_avg"], state["exp_avg_sq"], param.detach())
            )
            same = target.data_ptr() == param.data_ptr()
            flat_target = flat_weight if same else flat_view(target.detach(), pending)
            sums = self._edq_sums(param)
            for start, stop in self._chunks(target.numel()):
                g = [grad[start:stop].to(target.dtype)]
                m = [m_low[start:stop].to(target.dtype, copy=True)]
                v = [v_low[start:stop].to(target.dtype, copy=True)]
                adamw_moments_(m, v, g, group["betas"])
                commit_(m_low[start:stop], m[0], mask)
                commit_(v_low[start:stop], v[0], mask)
                theta = [flat_target[start:stop]]
                update = adamw_updates(group, [state["step"]], m, v, theta)[0]
                del g, m, v  # freed before the apply's temporaries
                self._apply_chunk(flat_weight, flat_target, update, start, sums, mask)
            write_back(pending)
            self._keep_edq(param, sums)


def adamw_moments_(
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    grads: list[torch.Tensor],
    betas: tuple[float, float],
) -> None:
    """m <- lerp(m, g, 1 - beta1), then ``second_moments_``, in place."""
    torch._foreach_lerp_(exp_avgs, grads, 1.0 - betas[0])
    second_moments_(exp_avg_sqs, grads, betas[1])


def adamw_updates(
    group: dict[str, Any],
    steps: list[int],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    thetas: list[torch.Tensor],
) -> list[torch.Tensor]:
    """u = -lr * m_hat / (sqrt(v_hat) + eps) - lr * wd * theta, in the moments' dtype.

    The bias corrections come from the integer step counts, in float64 on the host.
    """
    beta1, beta2 = group["betas"]
    lr, weight_decay = group["lr"], group["weight_decay"]
    corrections = [bias_corrections(beta1, beta2, t) for t in steps]
    denoms = adamw_denominators(exp_avg_sqs, [c[1] for c in corrections], group["eps"])
    updates = adamw_directions(exp_avgs, denoms, [-lr / c[0] for c in corrections])
    if weight_decay != 0.0:
        torch._foreach_add_(updates, thetas, alpha=-lr * weight_decay)
    return updates


def second_moments_(
    exp_avg_sqs: list[torch.Tensor], grads: list[torch.Tensor], beta2: float
) -> None:
    """v <- beta2 * v + (1 - beta2) * g^2, in place: ``_foreach_mul_``, ``_foreach_addcmul_``."""
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1.0 - beta2)


def adamw_denominators(
    exp_avg_sqs: list[torch.Tensor], sqrt_bias2: list[float], eps: float
) -> list[torch.Tensor]:
    """sqrt(v) / sqrt(1 - beta2^t) + eps, one new tensor each (``sqrt_bias2``: one a tensor)."""
    denoms = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_div_(denoms, sqrt_bias2)
    torch._foreach_add_(denoms, eps)
    return list(denoms)


def adamw_directions(
    exp_avgs: list[torch.Tensor], denoms: list[torch.Tensor], step_sizes: list[float]
) -> list[torch.Tensor]:
    """m / denom * step_size, one new tensor each (``step_size = -lr / (1 - beta1^t)``)."""
    directions = torch._foreach_div(exp_avgs, denoms)
    torch._foreach_mul_(directions, step_sizes)
    return list(directions)
