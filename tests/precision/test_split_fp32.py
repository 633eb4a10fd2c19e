"""split_fp32: an fp32 master held as the bf16 weight plus a 16-bit remainder, exactly."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from collage_train.metrics import model_state_bytes
from collage_train.optim import AdamW, SplitMasterAdamW, decay_param_groups, remainder
from collage_train.precision import get_strategy
from collage_train.trainer import Trainer

HYPER = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.1}


def fp32_from_bits(bits: list[int]) -> torch.Tensor:
    return torch.tensor(bits, dtype=torch.int64).to(torch.int32).view(torch.float32)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=2**32 - 1), min_size=1, max_size=64))
@pytest.mark.slow
def test_split_then_join_is_the_identity_on_every_finite_fp32(bits):
    master = fp32_from_bits([b - 2**32 if b >= 2**31 else b for b in bits])
    master = master[torch.isfinite(master)]
    high, low, ties = remainder.split(master)
    assert torch.equal(high.view(torch.int16), master.to(torch.bfloat16).view(torch.int16))
    assert low.dtype == torch.int16
    assert torch.equal(remainder.join(high, low, ties).view(torch.int32), master.view(torch.int32))


def test_both_kinds_of_tie_are_told_apart():
    """Low half exactly 0x8000: even high parts round down, odd ones round up."""
    highs = [0x3F80, 0x3F81, 0xBF80, 0xBF81, 0x0000, 0x7F7E]  # even, odd, negatives, zero
    bits = [((h << 16) | 0x8000) - (2**32 if h >= 0x8000 else 0) for h in highs]
    master = fp32_from_bits(bits)
    high, low, ties = remainder.split(master)
    assert ties.tolist() == [0, 2, 4, 5]  # the round-down ties (even high halves)
    assert torch.all(low == -(2**15))
    assert torch.equal(remainder.join(high, low, ties).view(torch.int32), master.view(torch.int32))
    assert math.isfinite(remainder.join(high, low, ties).sum().item())


@pytest.mark.parametrize("shapes", [[(300, 301), (7,), (0,), (1,)], [(64, 64, 3)]])
def test_trajectory_equals_fp32_master_adamw_bit_for_bit(shapes):
    gen = torch.Generator().manual_seed(1)
    init = [(torch.randn(s, generator=gen) * 0.05).bfloat16() for s in shapes]
    ref = [torch.nn.Parameter(t.clone()) for t in init]
    split = [torch.nn.Parameter(t.clone()) for t in init]
    ref_opt = AdamW([{"params": ref[:1]}, {"params": ref[1:], "weight_decay": 0.0}], **HYPER,
                    master_dtype=torch.float32)  # fmt: skip
    split_opt = SplitMasterAdamW(
        [{"params": split[:1]}, {"params": split[1:], "weight_decay": 0.0}], **HYPER
    )
    tie_counts = []
    for _ in range(60):
        for a, b in zip(ref, split, strict=True):
            grad = (torch.randn(a.shape, generator=gen) * 1e-2).bfloat16()
            a.grad, b.grad = grad.clone(), grad.clone()
        ref_opt.step()
        split_opt.step()
        tie_counts.append(sum(split_opt.state[p]["remainder_ties"].numel() for p in split))
    for a, b in zip(ref, split, strict=True):
        ref_state, split_state = ref_opt.state[a], split_opt.state[b]
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))
        master = remainder.join(b.detach(), split_state["remainder"], split_state["remainder_ties"])
        assert torch.equal(master.view(torch.int32), ref_state["master"].view(torch.int32))
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(ref_state[key], split_state[key])
    if shapes[0] == (300, 301):
        assert max(tie_counts) > 0  # the tie path was exercised


def test_state_dict_round_trip_continues_bitwise():
    gen = torch.Generator().manual_seed(2)
    grads = [(torch.randn(4096, generator=gen) * 1e-2).bfloat16() for _ in range(20)]
    a = torch.nn.Parameter((torch.randn(4096, generator=gen) * 0.05).bfloat16())
    opt_a = SplitMasterAdamW([a], **HYPER)
    for g in grads[:10]:
        a.grad = g.clone()
        opt_a.step()
    b = torch.nn.Parameter(a.detach().clone())
    opt_b = SplitMasterAdamW([b], **HYPER)
    opt_b.load_state_dict(opt_a.state_dict())
    for g in grads[10:]:
        a.grad, b.grad = g.clone(), g.clone()
        opt_a.step()
        opt_b.step()
    assert torch.equal(a, b)
    for key in ("remainder", "remainder_ties", "exp_avg", "exp_avg_sq"):
        assert torch.equal(opt_a.state[a][key], opt_b.state[b][key])


def test_needs_bf16_parameters():
    with pytest.raises(TypeError, match="bf16 parameters"):
        SplitMasterAdamW([torch.nn.Parameter(torch.ones(2))], **HYPER)


def test_measured_state_is_14_bytes_per_parameter():
    strategy = get_strategy("split_fp32")
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8)).bfloat16()
    opt = strategy.build_optimizer(decay_param_groups(model, 0.1), type("O", (), HYPER))
    model(torch.randn(4, 64, dtype=torch.bfloat16)).sum().backward()
    opt.step()
    ties = sum(s["remainder_ties"].numel() for s in opt.state.values())
    params = sum(p.numel() for p in model.parameters())
    assert (model_state_bytes(model, opt) - 8 * ties) / params == 14
    assert strategy.expected_state_bytes_per_param == 14


@pytest.mark.slow
def test_training_run_equals_mixed_fp32_bit_for_bit(make_cfg, tmp_path):
    weights, losses = {}, {}
    for name in ("mixed_fp32", "split_fp32"):
        trainer = Trainer(make_cfg(f"precision={name}"), tmp_path / name)
        trainer.fit()
        weights[name] = [p.detach().clone() for p in trainer.model.parameters()]
        losses[name] = trainer.evaluate()["val_loss"]
    assert losses["split_fp32"] == losses["mixed_fp32"]
    for a, b in zip(weights["mixed_fp32"], weights["split_fp32"], strict=True):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))
