"""Scalify on Llama: RMSNorm, the SwiGLU product and rotary embeddings get scale rules."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from tiny_config import assert_same_logits_and_grads, logits_and_grads
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

from collage_train.model.build import build_model
from collage_train.precision.scalify import scalify_strategy
from collage_train.scalify import is_power_of_two
from collage_train.scalify import propagation as scalify_propagation
from collage_train.scalify.modules import ScaledLinear, ScaledRMSNorm
from collage_train.scalify.propagation import attention_scales
from collage_train.scalify.scale import (
    mul_scale,
    pow2_floor,
    rms_scale,
    rotary_scale,
    value_rms_scale,
)

SEQ = 16


def tiny_llama(layers: int = 2) -> torch.nn.Module:
    """32 wide, 4 query heads sharing 2 key/value heads, SwiGLU 88 wide (vocabulary 96)."""
    cfg = SimpleNamespace(
        family="llama", name="t", hidden_size=32, num_layers=layers, num_heads=4,
        num_kv_heads=2, ffn_hidden_size=88, init_std=0.02, dropout=0.0, vocab_size=None,
        attn_implementation="eager", rope_theta=500000.0, rms_norm_eps=1e-5,
        tie_embeddings=False, extra={},
    )  # fmt: skip
    return build_model(cfg, vocab_size=96, seq_len=SEQ, eot_id=2, seed=0)


def test_fp32_scalified_llama_equals_the_original():
    """RMSNorm, GQA attention, rotary and SwiGLU through the scaled modules, no rounding."""
    original = tiny_llama()
    strategy = scalify_strategy(matmul="fp32", params="fp32")  # fp32 data throughout
    scaled = strategy.prepare_model(copy.deepcopy(original))
    kinds = {type(m).__name__ for m in scaled.modules()}
    assert "LlamaRMSNorm" not in kinds and "Linear" not in kinds
    assert {"ScaledRMSNorm", "ScaledLinear"} <= kinds
    assert_same_logits_and_grads(original, scaled)


def test_llama_inputs_take_their_producers_scales():
    model = scalify_strategy().prepare_model(tiny_llama())
    logits_and_grads(model)

    def source(name: str) -> torch.Tensor:
        scale = model.get_submodule(name).input_scale_source
        assert scale is not None, f"{name} has no propagated input scale"
        return scale()

    def gain(name: str) -> torch.Tensor:
        norm = model.get_submodule(name)
        assert isinstance(norm, ScaledRMSNorm)
        return value_rms_scale(norm.weight)

    def output(name: str) -> torch.Tensor:
        return model.get_submodule(name).last_output_scale

    for block in ("model.layers.0", "model.layers.1"):
        expected = {
            "self_attn.q_proj": gain(f"{block}.input_layernorm"),
            "self_attn.k_proj": gain(f"{block}.input_layernorm"),
            "self_attn.v_proj": gain(f"{block}.input_layernorm"),
            "self_attn.o_proj": output(f"{block}.self_attn.v_proj"),  # P V
            "mlp.gate_proj": gain(f"{block}.post_attention_layernorm"),
            "mlp.up_proj": gain(f"{block}.post_attention_layernorm"),
            # SiLU keeps the gate's scale, the product multiplies the scales
            "mlp.down_proj": mul_scale(
                output(f"{block}.mlp.gate_proj"), output(f"{block}.mlp.up_proj")
            ),
        }
        for name, scale in expected.items():
            got = source(f"{block}.{name}")
            assert torch.equal(got, scale) and is_power_of_two(got), name
    assert torch.equal(source("lm_head"), gain("model.norm"))
    stream = model.scalify_residual_stream  # the add rule at every Llama block boundary
    assert len(stream.scales) == 3 and is_power_of_two(torch.tensor(stream.scales))


def test_rotary_rule_keeps_the_scale_and_is_applied(monkeypatch):
    """Rotation preserves the RMS, so the rule's scale (cos, sin unit; mul, add) is the
    projection's; attention takes the rotated queries and keys at that scale."""
    for exponent in (-9, 0, 5):
        scale = torch.tensor(2.0**exponent)
        assert torch.equal(rotary_scale(scale), scale)
    q, k = torch.randn(2, 4, SEQ, 8) * 3.0, torch.randn(2, 2, SEQ, 8) * 0.01
    angles = torch.randn(2, SEQ, 4)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    rotated_q, rotated_k = apply_rotary_pos_emb(q, k, cos, sin)
    for before, after in ((q, rotated_q), (k, rotated_k)):
        rms = before.square().mean().sqrt()
        assert torch.allclose(after.square().mean().sqrt(), rms, rtol=1e-5)
        assert torch.equal(rotary_scale(pow2_floor(rms)), rms_scale(before))

    calls = []
    original = scalify_propagation.rotary_scale
    monkeypatch.setattr(
        scalify_propagation, "rotary_scale", lambda s: calls.append(1) or original(s)
    )
    model = scalify_strategy().prepare_model(tiny_llama())
    logits_and_grads(model)
    assert len(calls) == 2 * 2  # queries and keys of both layers
    attention = model.get_submodule("model.layers.0.self_attn")
    q_scale, k_scale, _, v_scale = attention_scales(attention, SEQ)
    assert torch.equal(q_scale, attention.q_proj.last_output_scale)
    assert torch.equal(k_scale, attention.k_proj.last_output_scale)
    assert torch.equal(v_scale, attention.v_proj.last_output_scale)


def test_rmsnorm_backward_rescale_keeps_small_gradients():
    """E5M2 gradients of size 1e-6 flush to zero unscaled; the rescale point keeps them."""
    torch.manual_seed(0)
    norm = LlamaRMSNorm(64, eps=1e-5)
    with torch.no_grad():
        norm.weight.mul_(torch.rand(64) + 0.5)
    x, grad_out = torch.randn(8, 64), torch.randn(8, 64) * 1e-6
    results = {}
    for rescale in (True, False):
        xr = x.clone().requires_grad_()
        out = ScaledRMSNorm(norm, "float8", rescale=rescale)(xr)
        out.backward(grad_out)
        results[rescale] = xr.grad
    xe = x.clone().requires_grad_()
    expected = norm(xe)
    expected.backward(grad_out)
    assert torch.equal(out, expected)  # forward is transformers' operation for operation
    assert (results[True] - xe.grad).norm() / xe.grad.norm() < 0.15
    assert results[False].abs().max() == 0


@pytest.mark.slow
def test_scalify_llama_run_trains_with_unit_data(make_cfg, tmp_path):
    """fp8 matmuls, fp16 master and state on llama_tiny: the loss falls, the residual stream
    and every matmul operand (the SwiGLU product included) keep data near unit RMS."""
    from collage_train.trainer import Trainer

    cfg = make_cfg(
        "model=llama_tiny", "model.num_heads=4", "model.num_kv_heads=2",
        "model.ffn_hidden_size=88", "precision=scalify", "optim.lr=3e-3",
        "optim.warmup_steps=0", "train.global_batch_size=8",
    )  # fmt: skip
    trainer = Trainer(cfg, tmp_path / "run")
    assert any(isinstance(m, ScaledRMSNorm) for m in trainer.model.modules())
    assert trainer.model.config._attn_implementation == "scalify_float8_propagated"
    down = trainer.model.get_submodule("model.layers.0.mlp.down_proj")
    assert isinstance(down, ScaledLinear) and down.input_scale_source is not None
    losses = [trainer.train_step().loss for _ in range(4)]
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0] - 0.05, losses
    metrics = trainer.strategy.model_metrics(trainer.model)
    assert metrics["scalify_residual_rms_outside_frac"] == 0.0
    assert metrics["scalify_operand_rms_outside_frac"] == 0.0
