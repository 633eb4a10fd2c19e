"""Learning-rate schedule and gradient clipping."""

import itertools
import math

import pytest
import torch

from collage_train.optim import clip_grad_norm, decay_param_groups, warmup_cosine_lr


def lr(step, **kw):
    args = {"peak_lr": 1.0, "min_lr": 0.1, "warmup_steps": 10, "max_steps": 110} | kw
    return warmup_cosine_lr(step, **args)


def test_warmup_is_linear_and_reaches_peak():
    assert lr(0) == pytest.approx(0.1)
    assert lr(4) == pytest.approx(0.5)
    assert lr(9) == pytest.approx(1.0)


def test_cosine_decays_monotonically_to_min_at_last_step():
    values = [lr(s) for s in range(10, 110)]
    assert values[0] == pytest.approx(1.0)
    assert values[-1] == pytest.approx(0.1)
    assert all(a >= b for a, b in itertools.pairwise(values))
    assert lr(60) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * 50 / 99)))


def test_no_warmup_starts_at_peak():
    assert lr(0, warmup_steps=0) == pytest.approx(1.0)


def test_clip_scales_to_max_norm_and_reports_fp32_norm():
    params = [torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16)) for _ in range(2)]
    params[0].grad = torch.tensor([3.0, 0.0, 0.0], dtype=torch.bfloat16)
    params[1].grad = torch.tensor([0.0, 4.0, 0.0], dtype=torch.bfloat16)
    norm = clip_grad_norm(params, max_norm=1.0)
    assert norm.dtype == torch.float32 and norm.item() == pytest.approx(5.0)
    clipped = torch.cat([p.grad.float() for p in params]).norm().item()
    assert clipped == pytest.approx(1.0, rel=1e-2)


def test_clip_zero_only_measures():
    p = torch.nn.Parameter(torch.zeros(2))
    p.grad = torch.tensor([30.0, 40.0])
    assert clip_grad_norm([p], max_norm=0.0).item() == pytest.approx(50.0)
    assert torch.equal(p.grad, torch.tensor([30.0, 40.0]))


def test_weight_decay_only_on_matrices():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    decayed, plain = decay_param_groups(model, 0.1)
    assert decayed["weight_decay"] == 0.1 and plain["weight_decay"] == 0.0
    assert [p.ndim for p in decayed["params"]] == [2]
    assert sorted(p.ndim for p in plain["params"]) == [1, 1, 1]
