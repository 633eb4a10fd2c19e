"""Two small parameters of a precision strategy with its own optimizer, stepped on random
gradients (tests/precision/test_full_precision.py, tests/comm/test_outer_step.py)."""

from __future__ import annotations

import torch

from collage_train.precision import get_strategy


class _Hyper:
    lr = 1e-2
    betas = (0.9, 0.95)
    eps = 1e-8
    weight_decay = 0.1


def build(name: str, seed: int = 0) -> tuple[list[torch.nn.Parameter], torch.optim.Optimizer]:
    """Two parameters of the strategy's dtype and its optimizer (two param groups)."""
    strategy = get_strategy(name)
    gen = torch.Generator().manual_seed(seed)
    params = [
        torch.nn.Parameter((0.02 * torch.randn(64, 48, generator=gen)).to(strategy.param_dtype)),
        torch.nn.Parameter(torch.randn(48, generator=gen).to(strategy.param_dtype)),
    ]
    groups = [{"params": [params[0]]}, {"params": [params[1]], "weight_decay": 0.0}]
    return params, strategy.build_optimizer(groups, _Hyper())


def take_steps(params, optimizer, steps: int = 5, seed: int = 1) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for param in params:
            param.grad = torch.randn(param.shape, generator=gen).to(param.dtype)
        optimizer.step()
