"""CollageAdamW: AdamW whose state is all bf16, compensated with multi-component floats.

Collage (Yu et al., ICML 2024) keeps no fp32 copy of anything. Per element:

- m <- beta1 * m + (1 - beta1) * g                       (bf16)
- v <- beta2 * v + (1 - beta2) * g^2                     (bf16; an MCF (v, dv) in "plus")
- u = -lr * (m / c1) / (sqrt(v / c2) + eps) - lr * wd * theta
- "none":  theta <- fl(theta + u)                        (plain bf16, the paper's (16,16))
- "light": (theta, dtheta) <- Grow((theta, dtheta), u)   (the update's lost bits are kept)
- "plus":  light, and (v, dv) <- Mul((v, dv), (bf16(beta2), beta2 - bf16(beta2))) then
           (v, dv) <- Grow((v, dv), fl((1 - beta2) * g^2)); only v enters the sqrt.

c1 = 1 - beta1^t and c2 = 1 - beta2^t come from an integer step count, in float64 on
the host; the beta2 remainder is computed in float64 whatever the default dtype. Weight
decay is part of u, so it is compensated too. The model always computes with theta (the
bf16 parameter). A drop-in for ``torch.optim.AdamW`` on bf16 parameters::

    model = model.to(torch.bfloat16)
    optimizer = CollageAdamW(model.parameters(), lr=1e-3, weight_decay=0.1, mode="plus")
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from collage_train.optim.base import TrackingOptimizer
from collage_train.precision import mcf

MODES = ("none", "light", "plus")


class CollageAdamW(TrackingOptimizer):
    """AdamW on bf16 parameters with bf16 state; ``mode`` is "none", "light" or "plus"."""

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        mode: str = "plus",
    ) -> None:
        mode = str(mode)
        if mode not in MODES:
            raise ValueError(f"CollageAdamW mode must be one of {', '.join(MODES)}, got {mode!r}")
        super().__init__(params, lr, betas, eps, weight_decay)
        self.mode = mode
        for group in self.param_groups:
            for param in group["params"]:
                if param.dtype != torch.bfloat16:
                    raise TypeError(
                        f"CollageAdamW keeps bf16 state and needs bf16 parameters, got a "
                        f"{param.dtype} parameter of shape {tuple(param.shape)}; cast the "
                        "model with model.to(torch.bfloat16)"
                    )

    def _state_for(self, param: torch.Tensor) -> dict[str, Any]:
        state = self.state[param]
        if not state:
            state["step"] = 0
            state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            if self.mode in ("light", "plus"):
                state["dtheta"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            if self.mode == "plus":
                state["dv"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        return state

    def _step_group(self, group: dict[str, Any], params: list[torch.Tensor]) -> None:
        beta1, beta2 = group["betas"]
        states = [self._state_for(p) for p in params]
        grads = [p.grad for p in params]
        thetas = [p.detach() for p in params]
        exp_avgs = [s["exp_avg"] for s in states]
        for s in states:
            s["step"] += 1

        torch._foreach_lerp_(exp_avgs, grads, 1.0 - beta1)
        self._update_second_moment(states, grads, beta2)
        steps = [s["step"] for s in states]
        exp_avg_sqs = [s["exp_avg_sq"] for s in states]  # only the high part enters the sqrt
        updates = self._adamw_updates(group, steps, exp_avgs, exp_avg_sqs, thetas)

        before = self._snapshot(params)
        if self.mode == "none":
            torch._foreach_add_(thetas, updates)
            self._record_descent(params, before, updates)
            return
        dthetas = [s["dtheta"] for s in states]
        new_thetas, new_dthetas = mcf.grow(thetas, dthetas, updates)
        torch._foreach_copy_(thetas, new_thetas)
        torch._foreach_copy_(dthetas, new_dthetas)
        self._record_descent(params, before, updates, dthetas)

    def _update_second_moment(
        self, states: list[dict[str, Any]], grads: list[torch.Tensor], beta2: float
    ) -> None:
        exp_avg_sqs = [s["exp_avg_sq"] for s in states]
        if self.mode != "plus":
            torch._foreach_mul_(exp_avg_sqs, beta2)
            torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1.0 - beta2)
            return
        beta2_hi, beta2_lo = mcf.split_constant(beta2)
        dvs = [s["dv"] for s in states]
        v, dv = mcf.mul(exp_avg_sqs, dvs, beta2_hi, beta2_lo)
        squares = torch._foreach_mul(grads, grads)
        torch._foreach_mul_(squares, 1.0 - beta2)
        v, dv = mcf.grow(v, dv, squares)
        torch._foreach_copy_(exp_avg_sqs, v)
        torch._foreach_copy_(dvs, dv)
