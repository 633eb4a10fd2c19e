"""AdamW with decoupled weight decay, integer step counts and optional master weights.

One implementation serves the fp32, mixed_fp32 and plain-bf16 strategies:

- ``master_dtype=None``: the update is applied to the parameters themselves and the
  moments have the parameters' dtype (fp32 AdamW for fp32 params, the paper's
  (16,16) baseline for bf16 params).
- ``master_dtype=torch.float32`` on bf16 parameters: the optimizer keeps an fp32
  master copy and fp32 moments, applies the update there and rounds the result into
  the bf16 parameter (the usual mixed-precision baseline).

Bias corrections come from an integer step count and are computed on the host in
float64; all elementwise work uses multi-tensor ``torch._foreach_*`` kernels.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch


class AdamW(torch.optim.Optimizer):
    """AdamW (Loshchilov & Hutter) whose state may be held in a wider dtype than the params."""

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        master_dtype: torch.dtype | None = None,
    ) -> None:
        if lr < 0 or eps < 0 or weight_decay < 0:
            raise ValueError(
                f"invalid AdamW hyper-parameters: lr={lr}, eps={eps}, wd={weight_decay}"
            )
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"AdamW betas must lie in [0, 1), got {betas}")
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay}
        super().__init__(params, defaults)
        self.master_dtype = master_dtype

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
            state["exp_avg"] = torch.zeros_like(target, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(target, memory_format=torch.preserve_format)
        return state

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            self._step_group(group)
        return loss

    def _step_group(self, group: dict[str, Any]) -> None:
        params = [p for p in group["params"] if p.grad is not None]
        if not params:
            return
        beta1, beta2 = group["betas"]
        lr, eps, weight_decay = group["lr"], group["eps"], group["weight_decay"]
        states = [self._state_for(p) for p in params]
        targets = [s.get("master", p) for s, p in zip(states, params, strict=True)]
        grads = [p.grad.to(t.dtype) for p, t in zip(params, targets, strict=True)]
        exp_avgs = [s["exp_avg"] for s in states]
        exp_avg_sqs = [s["exp_avg_sq"] for s in states]
        for s in states:
            s["step"] += 1

        if weight_decay != 0.0:
            torch._foreach_mul_(targets, 1.0 - lr * weight_decay)
        torch._foreach_lerp_(exp_avgs, grads, 1.0 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1.0 - beta2)

        # Bias corrections in float64 on the host, from the integer step count.
        steps = [s["step"] for s in states]
        sqrt_bias2 = [math.sqrt(1.0 - beta2**t) for t in steps]
        step_sizes = [-lr / (1.0 - beta1**t) for t in steps]
        denom = torch._foreach_sqrt(exp_avg_sqs)
        torch._foreach_div_(denom, sqrt_bias2)
        torch._foreach_add_(denom, eps)
        torch._foreach_addcdiv_(targets, exp_avgs, denom, step_sizes)

        masters = [(p, s["master"]) for p, s in zip(params, states, strict=True) if "master" in s]
        if masters:
            torch._foreach_copy_([p for p, _ in masters], [m for _, m in masters])

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore state without torch's cast of every state tensor to the param dtype.

        The base class would round fp32 masters and moments to bf16; here each
        tensor keeps the dtype it was saved with and only moves to the param's device.
        """
        saved_state = state_dict["state"]
        super().load_state_dict({**state_dict, "state": {}})
        params = [p for group in self.param_groups for p in group["params"]]
        for index, saved in saved_state.items():
            param = params[int(index)]
            restored = {}
            for key, value in saved.items():
                if torch.is_tensor(value):
                    if key != "step" and value.shape != param.shape:
                        raise ValueError(
                            f"optimizer state {key!r} has shape {tuple(value.shape)} but its "
                            f"parameter has shape {tuple(param.shape)}"
                        )
                    value = value.to(param.device, copy=True)
                restored[key] = value
            self.state[param] = restored
