"""Propagated (static) operand scales: each matmul input at the scale the table derives."""

from __future__ import annotations

import copy

import pytest
import torch
from tiny_config import assert_same_logits_and_grads, logits_and_grads, tiny_transformer

from collage_train.precision.scalify import scalify_strategy
from collage_train.scalify import is_power_of_two
from collage_train.scalify import modules as scalify_modules
from collage_train.scalify import propagation as scalify_propagation
from collage_train.scalify.modules import ScaledLayerNorm, ScaledLinear, scalify_linears
from collage_train.scalify.propagation import attention_scales, propagate_scales
from collage_train.scalify.scale import (
    add_scale,
    matmul_scale,
    pow2_floor,
    sum_scale,
    value_rms_scale,
)

SEQ = 16


# OPT as opt_350m is shaped: LayerNorm after each residual add, narrower embeddings
# projected in and out, no final LayerNorm.
POST_LN_OPT = {"do_layer_norm_before": False, "word_embed_proj_dim": 16}


def _prepared(family: str, matmul: str = "fp8", layers: int = 2, **extra) -> torch.nn.Module:
    """A tiny model as precision=scalify (default options but ``matmul``) prepares it."""
    model = tiny_transformer(family, layers, **extra)
    return scalify_strategy(matmul=matmul).prepare_model(model)


def _input_scale(model: torch.nn.Module, name: str) -> torch.Tensor:
    source = model.get_submodule(name).input_scale_source
    assert source is not None, f"{name} has no propagated input scale"
    return source()


def _norm_scale(model: torch.nn.Module, name: str) -> torch.Tensor:
    norm = model.get_submodule(name)
    assert isinstance(norm, ScaledLayerNorm)
    return value_rms_scale(norm.weight)


def _linear_scale(model: torch.nn.Module, name: str) -> torch.Tensor:
    return model.get_submodule(name).last_output_scale


def test_gpt2_inputs_take_their_producers_scales():
    model = _prepared("gpt")
    for _ in range(2):  # scales change with the weights; check after an update too
        logits_and_grads(model)
        with torch.no_grad():
            for param in model.parameters():
                param.mul_(1.7)
    logits_and_grads(model)
    for block in ("transformer.h.0", "transformer.h.1"):
        expected = {
            "attn.c_attn": _norm_scale(model, f"{block}.ln_1"),
            "attn.c_proj": _linear_scale(model, f"{block}.attn.c_attn"),  # P V
            "mlp.c_fc": _norm_scale(model, f"{block}.ln_2"),
            "mlp.c_proj": _linear_scale(model, f"{block}.mlp.c_fc"),  # GELU keeps it
        }
        for name, scale in expected.items():
            got = _input_scale(model, f"{block}.{name}")
            assert torch.equal(got, scale), name
            assert is_power_of_two(got)
    assert torch.equal(_input_scale(model, "lm_head"), _norm_scale(model, "transformer.ln_f"))
    # the matmul rule on the propagated input scale and the weight's own scale
    c_fc = model.get_submodule("transformer.h.0.mlp.c_fc")
    assert torch.equal(
        c_fc.last_output_scale,
        matmul_scale(
            _input_scale(model, "transformer.h.0.mlp.c_fc"), value_rms_scale(c_fc.weight), 32
        ),
    )


def test_opt_inputs_take_their_producers_scales():
    model = _prepared("opt")
    logits_and_grads(model)
    for block in ("model.decoder.layers.0", "model.decoder.layers.1"):
        norm = _norm_scale(model, f"{block}.self_attn_layer_norm")
        expected = {
            "self_attn.q_proj": norm,
            "self_attn.k_proj": norm,
            "self_attn.v_proj": norm,
            "self_attn.out_proj": _linear_scale(model, f"{block}.self_attn.v_proj"),
            "fc1": _norm_scale(model, f"{block}.final_layer_norm"),
            "fc2": _linear_scale(model, f"{block}.fc1"),  # ReLU keeps it
        }
        for name, scale in expected.items():
            assert torch.equal(_input_scale(model, f"{block}.{name}"), scale), name
    final = _norm_scale(model, "model.decoder.final_layer_norm")
    assert torch.equal(_input_scale(model, "lm_head"), final)


def test_post_layernorm_opt_inputs_take_their_producers_scales():
    model = _prepared("opt", **POST_LN_OPT)
    strategy = scalify_strategy()
    logits_and_grads(model)
    layers = [f"model.decoder.layers.{i}" for i in range(2)]
    tokens = model.get_input_embeddings().weight
    positions = model.get_submodule("model.decoder.embed_positions").weight
    project_in = _linear_scale(model, "model.decoder.project_in")
    assert torch.equal(_input_scale(model, "model.decoder.project_in"), value_rms_scale(tokens))
    block_input = add_scale(project_in, value_rms_scale(positions))  # entering the first layer
    for block in layers:
        expected = {
            "self_attn.q_proj": block_input,
            "self_attn.k_proj": block_input,
            "self_attn.v_proj": block_input,
            "self_attn.out_proj": _linear_scale(model, f"{block}.self_attn.v_proj"),
            "fc1": _norm_scale(model, f"{block}.self_attn_layer_norm"),  # LN after the add
            "fc2": _linear_scale(model, f"{block}.fc1"),
        }
        for name, scale in expected.items():
            assert torch.equal(_input_scale(model, f"{block}.{name}"), scale), name
        block_input = _norm_scale(model, f"{block}.final_layer_norm")  # the block's output
    assert torch.equal(_input_scale(model, "model.decoder.project_out"), block_input)
    head_input = _linear_scale(model, "model.decoder.project_out")
    assert torch.equal(_input_scale(model, "lm_head"), head_input)
    # the residual stream leaves each post-LN layer at its closing LayerNorm's scale
    stream = model.scalify_residual_stream
    entry = add_scale(project_in, value_rms_scale(positions))
    expected_stream = [entry] + [_norm_scale(model, f"{b}.final_layer_norm") for b in layers]
    assert stream.scales == [float(s) for s in expected_stream]
    metrics = strategy.model_metrics(model)
    assert metrics["scalify_operand_rms_outside_frac"] == 0.0
    assert metrics["scalify_residual_rms_outside_frac"] == 0.0


@pytest.mark.parametrize(
    ("family", "extra"),
    [("gpt", {}), ("opt", {}), ("opt", POST_LN_OPT)],
    ids=["gpt", "opt", "opt-post-ln"],
)
def test_forward_operand_scales_never_measure_an_activation(family, extra, monkeypatch):
    """Only parameters (weights, LayerNorm gains, embedding tables) get an RMS scale."""
    model = _prepared(family, **extra)
    params = {id(p) for p in model.parameters()}
    measured = []

    def recording(original):
        def record(t: torch.Tensor) -> torch.Tensor:
            measured.append(id(t) in params or (t._base is not None and id(t._base) in params))
            return original(t)

        return record

    monkeypatch.setattr(scalify_modules, "rms_scale", recording(scalify_modules.rms_scale))
    for module in (scalify_modules, scalify_propagation):
        monkeypatch.setattr(module, "value_rms_scale", recording(module.value_rms_scale))
    ids = torch.randint(0, 96, (2, SEQ))
    with torch.no_grad():
        model(input_ids=ids)
    assert measured and all(measured)


@pytest.mark.parametrize("family", ["gpt", "opt"])
def test_attention_scales_follow_the_table(family):
    model = _prepared(family)
    logits_and_grads(model)
    attention = next(m for m in model.modules() if type(m).__name__.endswith("Attention"))
    q, k, probs, v = attention_scales(attention, SEQ)
    assert torch.equal(probs, 1.0 / sum_scale(torch.ones(()), SEQ))  # 1/4 for 16 keys
    assert float(probs) == 0.25
    if family == "gpt":
        qkv = attention.c_attn.last_output_scale
        assert torch.equal(q, qkv) and torch.equal(k, qkv) and torch.equal(v, qkv)
    else:  # OPT multiplies the query by 1/sqrt(head_dim) before attention
        scaling = pow2_floor(torch.tensor(attention.scaling))
        assert torch.equal(q, attention.q_proj.last_output_scale * scaling)
        assert torch.equal(k, attention.k_proj.last_output_scale)
        assert torch.equal(v, attention.v_proj.last_output_scale)
    # P V's scale by the matmul rule is the value's: what out_proj / c_proj reads
    for keys in (1, 7, 16, 1000):
        p_scale = 1.0 / sum_scale(torch.ones(()), keys)
        assert torch.equal(matmul_scale(p_scale, v, keys), v)


@pytest.mark.parametrize(
    ("family", "extra"),
    [("gpt", {}), ("opt", {}), ("opt", POST_LN_OPT)],
    ids=["gpt", "opt", "opt-post-ln"],
)
def test_propagated_model_with_fp32_data_equals_the_original(family, extra):
    original = tiny_transformer(family, 2, **extra)
    strategy = scalify_strategy(matmul="fp32", params="fp32")  # fp32 data throughout
    scaled = strategy.prepare_model(copy.deepcopy(original))
    assert scaled.config._attn_implementation == "scalify_fp32_propagated"
    assert_same_logits_and_grads(original, scaled)


def test_float8_with_propagated_scales_stays_close_to_fp32():
    original = tiny_transformer("gpt", 2)
    reference, _ = logits_and_grads(original)
    logits, _ = logits_and_grads(_prepared("gpt"))
    error = (logits - reference).norm() / reference.norm()
    assert error < 0.1, float(error)


def test_unknown_modules_stay_unscaled_on_input():
    """A bare stack has no table entry: input scale 1, the weight at its own scale."""
    stack = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    scalify_linears(stack, "fp32", operand_scales="propagated")
    assert propagate_scales(stack) == []
    x = torch.randn(5, 8) * 100
    stack(x)
    first = stack[0]
    assert isinstance(first, ScaledLinear) and first.input_scale_source is None
    assert torch.equal(
        first.last_output_scale, matmul_scale(torch.ones(()), value_rms_scale(first.weight), 8)
    )


def test_an_activation_without_a_rule_leaves_its_output_unscaled():
    """tanh is no gate times its input: the table has no rule, the next input has scale 1."""
    model = _prepared("gpt", activation_function="tanh")
    logits_and_grads(model)
    c_proj = model.get_submodule("transformer.h.0.mlp.c_proj")
    assert c_proj.input_scale_source is None
    expected = matmul_scale(torch.ones(()), value_rms_scale(c_proj.weight), 4 * 32)
    assert torch.equal(c_proj.last_output_scale, expected)
    gelu = _prepared("gpt").get_submodule("transformer.h.0.mlp.c_proj")
    assert gelu.input_scale_source is not None
