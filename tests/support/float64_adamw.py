"""A float64 AdamW (decoupled weight decay) and the parameters and gradients the Scalify
optimizer tests step it on: three tensors whose gradients span 1e-6 to 1e4
(tests/scalify/test_scalify_adamw.py, tests/scalify/test_scalify_params.py)."""

from __future__ import annotations

import torch

LR, BETAS, EPS, WD = 1e-2, (0.9, 0.999), 1e-8, 0.1
STEPS = 50


GRAD_MAGNITUDES = (1e-6, 1.0, 1e4)  # one parameter each


class Float64AdamW:
    """The reference: AdamW with decoupled weight decay, all in float64."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        self.params = [p.detach().to(torch.float64).clone() for p in params]
        self.exp_avg = [torch.zeros_like(p) for p in self.params]
        self.exp_avg_sq = [torch.zeros_like(p) for p in self.params]
        self.step_count = 0

    def step(self, grads: list[torch.Tensor]) -> None:
        self.step_count += 1
        t = self.step_count
        beta1, beta2 = BETAS
        for p, m, v, g in zip(self.params, self.exp_avg, self.exp_avg_sq, grads, strict=True):
            g = g.to(torch.float64)
            m.mul_(beta1).add_(g, alpha=1 - beta1)
            v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
            denom = (v / (1 - beta2**t)).sqrt() + EPS
            p.add_(-LR * (m / (1 - beta1**t)) / denom - LR * WD * p)


def adamw_params(seed: int = 0) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    shapes = [(17, 9), (33,), (4, 4, 5)]
    return [torch.nn.Parameter(torch.randn(s, generator=generator)) for s in shapes]


def adamw_grads(step: int, params: list[torch.Tensor]) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 + step)
    return [
        (torch.randn(p.shape, generator=generator) + 0.3) * magnitude
        for p, magnitude in zip(params, GRAD_MAGNITUDES, strict=True)
    ]
