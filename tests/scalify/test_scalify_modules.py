"""ScaledLinear swapped into tiny GPT-2 / OPT models: exact in fp32, close in bf16/float8."""

from __future__ import annotations

import copy

import pytest
import torch
from tiny_config import tiny_transformer
from transformers.pytorch_utils import Conv1D

from collage_train.scalify.float8 import (
    FLOAT8_BACKWARD,
    FLOAT8_FORWARD,
    HARDWARE_ACCUMULATION_RTOL,
    scaled_mm,
    to_float8,
)
from collage_train.scalify.modules import (
    ScaledLinear,
    ScaledMatmul,
    scalify_linears,
)
from collage_train.scalify.scale import rms_scale


def _model(family: str = "gpt") -> torch.nn.Module:
    return tiny_transformer(family)


def _loss_and_grads(model: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor, dict]:
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 96, (3, 16), generator=generator)
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    return out.loss.detach(), out.logits.detach(), grads


@pytest.mark.parametrize("family", ["gpt", "opt"])
def test_fp32_format_equals_the_original_model(family):
    original = _model(family)
    scaled = copy.deepcopy(original)
    replaced = scalify_linears(scaled, "fp32")
    kinds = {type(m) for m in original.modules()}
    assert replaced and (Conv1D in kinds) == (family == "gpt")
    assert not any(isinstance(m, torch.nn.Linear | Conv1D) for m in scaled.modules())
    assert list(scaled.state_dict()) == list(original.state_dict())

    loss, logits, grads = _loss_and_grads(original)
    scaled_loss, scaled_logits, scaled_grads = _loss_and_grads(scaled)
    assert torch.allclose(scaled_logits, logits, rtol=1e-6, atol=1e-6)
    assert abs(scaled_loss.item() - loss.item()) < 1e-6
    assert scaled_grads.keys() == grads.keys()
    for name, grad in grads.items():
        assert torch.allclose(scaled_grads[name], grad, rtol=1e-5, atol=1e-6), name


def test_replacement_shares_parameters_and_keeps_the_tied_head():
    model = _model("gpt")
    before = [id(p) for p in model.parameters()]
    names = scalify_linears(model, "float8", skip=("lm_head",))
    assert "lm_head" not in names and "transformer.h.0.attn.c_attn" in names
    assert [id(p) for p in model.parameters()] == before
    assert isinstance(model.lm_head, torch.nn.Linear)
    assert model.lm_head.weight is model.transformer.wte.weight
    assert "fmt=float8" in repr(model.transformer.h[0].mlp.c_fc)
    with pytest.raises(ValueError, match="format"):
        ScaledLinear(model.lm_head.weight, None, weight_is_in_out=False, fmt="int4")


@pytest.mark.parametrize(("fmt", "tolerance"), [("bf16", 0.02), ("fp16", 0.005), ("float8", 0.1)])
def test_low_precision_formats_stay_close_to_fp32(fmt, tolerance):
    original = _model("gpt")
    scaled = copy.deepcopy(original)
    scalify_linears(scaled, fmt)
    loss, logits, grads = _loss_and_grads(original)
    scaled_loss, scaled_logits, scaled_grads = _loss_and_grads(scaled)
    assert abs(scaled_loss.item() - loss.item()) < tolerance * loss.item()
    assert ((scaled_logits - logits).norm() / logits.norm()).item() < tolerance
    flat = torch.cat([g.flatten() for g in grads.values()])
    scaled_flat = torch.cat([scaled_grads[n].flatten() for n in grads])
    assert ((scaled_flat - flat).norm() / flat.norm()).item() < 3 * tolerance
    assert not torch.equal(scaled_flat, flat)


def test_float8_forward_is_e4m3_and_backward_is_e5m2():
    torch.manual_seed(3)
    x = (torch.randn(32, 48) * 1e-3).requires_grad_()
    w = (torch.randn(48, 16) * 40.0).requires_grad_()
    out = ScaledMatmul.apply(x, w, "float8")
    grad_out = torch.randn(32, 16) * 1e5
    out.backward(grad_out)

    x8, sx = to_float8(x.detach(), rms_scale(x), FLOAT8_FORWARD)
    w8, sw = to_float8(w.detach(), rms_scale(w), FLOAT8_FORWARD)
    g8, sg = to_float8(grad_out, rms_scale(grad_out), FLOAT8_BACKWARD)
    assert torch.equal(out, scaled_mm(x8, w8, sx, sw, torch.float32))
    assert torch.equal(x.grad, scaled_mm(g8, w8.t(), sg, sw, torch.float32))
    assert torch.equal(w.grad, scaled_mm(x8.t(), g8, sx, sg, torch.float32))
    exact = grad_out @ w.detach().t()
    assert ((x.grad - exact).norm() / exact.norm()).item() < 0.15


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_float8_matmul_on_gpu_matches_the_cpu_emulation():
    torch.manual_seed(4)
    x, w, grad_out = torch.randn(64, 96), torch.randn(96, 32) * 0.02, torch.randn(64, 32)
    results = []
    for device in ("cpu", "cuda"):
        # fresh leaves on each device (x.to("cpu") would be x itself, left requiring grad)
        xd = x.detach().clone().to(device).requires_grad_()
        wd = w.detach().clone().to(device).requires_grad_()
        out = ScaledMatmul.apply(xd, wd, "float8")
        out.backward(grad_out.to(device))
        results.append([t.detach().cpu() for t in (out, xd.grad, wd.grad)])
    for cpu, gpu in zip(*results, strict=True):
        # Hopper's float8 tensor cores accumulate with fewer bits than fp32
        # (docs/results-history.md, "GPU check on one H100, partial", 2026-11-26: 2e-4
        # relative); a wrong layout or scale is off by O(1)
        bound = HARDWARE_ACCUMULATION_RTOL
        assert torch.allclose(gpu, cpu, rtol=bound, atol=bound * cpu.abs().max().item())


def test_float8_model_with_scaled_fp16_optimizer_trains_like_fp32():
    """Tiny GPT-2, one batch, 12 steps: float8 matmuls + ScaledAdamW (fp16 master)."""
    from collage_train.optim import AdamW
    from collage_train.scalify.adamw import ScaledAdamW

    ids = torch.randint(0, 96, (4, 16), generator=torch.Generator().manual_seed(1))

    def losses(model, optimizer) -> list[float]:
        values = []
        for _ in range(12):
            optimizer.zero_grad()
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            values.append(loss.item())
        return values

    reference = _model("gpt")
    fp32 = losses(reference, AdamW(reference.parameters(), lr=3e-3, weight_decay=0.1))
    model = _model("gpt")
    scalify_linears(model, "float8")
    optimizer = ScaledAdamW(model.parameters(), lr=3e-3, weight_decay=0.1, master="fp16")
    scalified = losses(model, optimizer)
    assert scalified[-1] < 0.8 * scalified[0]
    assert abs(scalified[-1] - fp32[-1]) < 0.02 * fp32[-1]
    assert optimizer.rescale_count > 0
