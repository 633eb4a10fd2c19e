"""Scalify's attention-score and residual-add rules on tiny GPT-2 / OPT models.

The whole scaled model (linears, LayerNorms, attention, residual stream) with fp32
data equals the original; float8 attention multiplies E4M3 operands; the residual
stream's scales follow the add rule and its stored data is exactly fp16 under them.
"""

from __future__ import annotations

import copy

import pytest
import torch
from compile_backends import fresh_dynamo, stop_inductor_before_code_generation
from tiny_config import assert_same_logits_and_grads, logits_and_grads, tiny_transformer

from collage_train.scalify import is_power_of_two
from collage_train.scalify.attention import implementation_name, scaled_attention
from collage_train.scalify.float8 import FLOAT8_FORWARD, to_float8
from collage_train.scalify.modules import scalify_layer_norms, scalify_linears
from collage_train.scalify.residual import ScaledResidualStream, StoreScaled
from collage_train.scalify.scale import add_scale, rms_scale


def _model(family: str, layers: int = 3) -> torch.nn.Module:
    return tiny_transformer(family, layers)


def _scalified(model: torch.nn.Module, fmt: str) -> tuple[torch.nn.Module, ScaledResidualStream]:
    """What precision=scalify's prepare_model installs, on a copy."""
    from collage_train.scalify.attention import use_scaled_attention

    scaled = copy.deepcopy(model)
    scalify_linears(scaled, fmt)
    scalify_layer_norms(scaled, fmt)
    assert use_scaled_attention(scaled, fmt) == implementation_name(fmt)
    return scaled, ScaledResidualStream(scaled, fmt)


@pytest.mark.parametrize("family", ["gpt", "opt"])
def test_scaled_model_with_fp32_data_equals_the_original(family):
    original = _model(family)
    scaled, stream = _scalified(original, "fp32")
    assert scaled.config._attn_implementation == "scalify_fp32"
    assert_same_logits_and_grads(original, scaled)
    assert len(stream.scales) == 1 + 3  # entering the first block, leaving each block
    assert is_power_of_two(torch.tensor(stream.scales))


@pytest.mark.parametrize("family", ["gpt", "opt"])
def test_residual_scales_follow_the_add_rule(family):
    scaled, stream = _scalified(_model(family), "fp16")
    logits_and_grads(scaled)
    embeddings = [m for m in scaled.modules() if isinstance(m, torch.nn.Embedding)]
    expected = rms_scale(embeddings[0].weight)
    for table in embeddings[1:]:
        expected = add_scale(expected, rms_scale(table.weight))
    assert stream.scales[0] == float(expected)
    for index, (_, branches) in enumerate(stream.blocks):
        for branch in branches:
            output_scale = branch.last_output_scale
            assert is_power_of_two(output_scale)
            expected = add_scale(expected, output_scale)
        assert stream.scales[index + 1] == float(expected)
    assert all(1 / 16 <= rms <= 16 for rms in stream.data_rms)
    assert stream.rms_outside_frac() == 0.0


def test_residual_stream_is_stored_as_fp16_data_under_its_scale():
    scaled, stream = _scalified(_model("gpt"), "float8")
    outputs = []
    for block, _ in stream.blocks:  # registered after the stream's hook: sees the store
        block.register_forward_hook(lambda m, a, out: outputs.append(out.detach()))
    logits_and_grads(scaled)
    for output, scale in zip(outputs, stream.scales[1:], strict=True):
        data = output / scale
        assert torch.equal(data.half().float(), data)  # exactly fp16 data
    assert len(outputs) == 3


def test_store_saturates_and_passes_gradients_through():
    value = torch.tensor([1.0, -3.0e5, 1e-9, 7.0], requires_grad=True)
    stored = StoreScaled.apply(value, torch.tensor(2.0), torch.float16)
    assert stored[1].item() == -65504.0 * 2  # clamped to fp16's range, not -inf
    assert stored[2].item() == 0.0  # below fp16's smallest subnormal under scale 2
    stored.backward(torch.arange(4.0))
    assert torch.equal(value.grad, torch.arange(4.0))


def test_float8_attention_multiplies_e4m3_operands():
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, 3, 8, 16, generator=gen) * s for s in (3.0, 0.5, 20.0))
    module = torch.nn.Module()  # stands in for the attention module (only .training is read)
    mask = torch.triu(torch.full((8, 8), float("-inf")), diagonal=1)
    out, probs = scaled_attention(module, q, k, v, mask, scaling=0.25, fmt="float8")

    def e4m3(t: torch.Tensor) -> torch.Tensor:
        data, scale = to_float8(t, rms_scale(t), FLOAT8_FORWARD)
        return data.float() * scale

    scores = e4m3(q) @ e4m3(k.transpose(-2, -1)) * 0.25 + mask
    expected_probs = torch.softmax(scores, dim=-1)
    assert torch.equal(probs, expected_probs)
    assert torch.equal(out, (e4m3(expected_probs) @ e4m3(v)).transpose(1, 2))
    exact = (torch.softmax(q @ k.transpose(-2, -1) * 0.25 + mask, dim=-1) @ v).transpose(1, 2)
    assert not torch.equal(out, exact)
    assert ((out - exact).norm() / exact.norm()).item() < 0.1


@pytest.mark.parametrize("family", ["gpt", "opt"])
def test_float8_model_stays_close_and_trains_through_attention(family):
    original = _model(family)
    scaled, _ = _scalified(original, "float8")
    logits, grads = logits_and_grads(original)
    scaled_logits, scaled_grads = logits_and_grads(scaled)
    assert ((scaled_logits - logits).norm() / logits.norm()).item() < 0.1
    name = next(n for n in grads if "q_proj.weight" in n or "c_attn.weight" in n)
    relative = (scaled_grads[name] - grads[name]).norm() / grads[name].norm()
    assert 0 < relative.item() < 0.3  # quantized, yet the query/key gradient survives


@pytest.mark.parametrize("family", ["gpt", "opt"])
def test_activation_checkpointing_recomputes_the_same_stores(family):
    """Blocks re-run in backward (in reverse order) must store under the forward's scales."""
    plain, plain_stream = _scalified(_model(family), "float8")
    checkpointed, stream = _scalified(_model(family), "float8")
    checkpointed.gradient_checkpointing_enable(
        gradient_checkpointing_kwargs={"use_reentrant": False}
    )
    checkpointed.train()
    plain.train()
    logits, grads = logits_and_grads(plain)
    ckpt_logits, ckpt_grads = logits_and_grads(checkpointed)
    assert torch.equal(ckpt_logits, logits)
    for name, grad in grads.items():
        assert torch.equal(ckpt_grads[name], grad), name
    assert stream.scales == plain_stream.scales and stream.data_rms == plain_stream.data_rms


@pytest.mark.slow
@pytest.mark.parametrize(
    ("matmul", "rescale"),
    [("fp32", ("matmul", "layernorm_grad", "grads")), ("fp8", ("layernorm_grad", "grads"))],
    ids=["fp32-dynamic", "fp8-propagated"],
)
def test_scaled_model_runs_under_torch_compile(monkeypatch, matmul, rescale):
    """train.compile=true with precision=scalify: hooks, attention, autograd Functions and
    the propagated scale sources trace.

    With fp32 data the compiled model equals the eager one to fp32 reordering; with
    float8 such reorderings flip some roundings, so it is only close. On CPU the graphs
    stop after Dynamo and AOTAutograd (support/compile_backends.py: Inductor's C++ for
    them is some 45 s of builds from a cold cache, for a path GPU users take through
    Triton); with ``--device cuda`` Inductor compiles them whole.
    """
    from collage_train.precision.scalify import scalify_strategy

    stop_inductor_before_code_generation(monkeypatch)
    strategy = scalify_strategy(matmul=matmul, rescale=rescale)
    eager = strategy.prepare_model(_model("gpt", layers=1))
    compiled = strategy.prepare_model(_model("gpt", layers=1))  # same seed, same weights
    logits, grads = logits_and_grads(eager)
    counters = fresh_dynamo()
    compiled_logits, compiled_grads = logits_and_grads(torch.compile(compiled))
    assert counters["stats"]["unique_graphs"] >= 1  # Dynamo compiled the model
    if matmul == "fp32":
        assert torch.allclose(compiled_logits, logits, rtol=1e-5, atol=1e-5)
    relative = (compiled_logits - logits).norm() / logits.norm()
    assert relative.item() < 0.05
    for name, grad in grads.items():
        other = compiled_grads.get(name, compiled_grads.get(f"_orig_mod.{name}"))
        assert other is not None and bool(torch.isfinite(other).all()), name
        assert ((other - grad).norm() / grad.norm()).item() < (1e-4 if matmul == "fp32" else 0.2)
    stream, eager_stream = compiled.scalify_residual_stream, eager.scalify_residual_stream
    assert stream.scales == eager_stream.scales
    for name in ("transformer.h.0.attn.c_proj", "lm_head"):
        ours, theirs = compiled.get_submodule(name), eager.get_submodule(name)
        assert torch.equal(ours.last_output_scale, theirs.last_output_scale), name
