"""precision=scalify at 8 bytes per parameter: scaled fp16 parameters and gradients.

Numerics are checked against float64 references (the value of every scaled tensor, the
gradients of a float64 copy of the model, a float64 AdamW, the EDQ sums) and against the
fp32-parameter mode, whose forward pass must be the same bit for bit.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from float64_adamw import BETAS, EPS, LR, STEPS, WD, Float64AdamW, adamw_grads, adamw_params
from tiny_config import tiny_transformer
from transformers import AutoModelForCausalLM

from collage_train import export
from collage_train.checkpoint import load_checkpoint_file
from collage_train.cli import train
from collage_train.errors import ConfigError
from collage_train.metrics import memory as memory_metrics
from collage_train.metrics import model_state_bytes
from collage_train.optim import clip_grad_norm, decay_param_groups
from collage_train.optim import clipping as clipping_module
from collage_train.precision import get_strategy, strategy_for
from collage_train.precision.scalify import scalify_strategy
from collage_train.scalify.adamw import ScaledAdamW
from collage_train.scalify.params import (
    SCALE_SUFFIX,
    accumulate_grad,
    grad_value,
    scale_parameters,
    unscale_weights,
    value_of,
)
from collage_train.scalify.scale import SCALE_ATTR, is_power_of_two, rms_scale, value_rms_scale

IDS = torch.randint(0, 96, (3, 16), generator=torch.Generator().manual_seed(1))


class OptCfg:
    lr, betas, eps, weight_decay = 1e-3, (0.9, 0.95), 1e-8, 0.1


def _scaled(family: str, **options: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(the original fp32 model, a copy prepared by the 8-byte strategy)."""
    original = tiny_transformer(family)
    model = copy.deepcopy(original)
    scalify_strategy(**options).prepare_model(model)
    return original, model


def _f64_rounding(value: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The scaled-fp16 representation of ``value`` under ``scale``, in float64."""
    return (value.double() / scale.double()).to(torch.float16).double() * scale.double()


# ------------------------------------------------------------------ the layout


@pytest.mark.slow
def test_the_registry_entries_and_their_bytes(make_cfg):
    eight = strategy_for(make_cfg("precision=scalify").precision)
    twelve = strategy_for(make_cfg("precision=scalify_fp32_params").precision)
    assert (eight.name, eight.params, eight.param_dtype) == ("scalify", "fp16", torch.float16)
    assert eight.expected_state_bytes_per_param == 8 and eight.master_dtype is None
    assert (twelve.params, twelve.param_dtype) == ("fp32", torch.float32)
    assert twelve.expected_state_bytes_per_param == 12
    assert (eight.matmul, eight.master, eight.state) == (twelve.matmul, twelve.master, "fp16")
    fp32_master = strategy_for(make_cfg("precision=scalify", "precision.master=fp32").precision)
    assert fp32_master.name == "scalify" and fp32_master.master_dtype == torch.float32
    assert fp32_master.expected_state_bytes_per_param == 12  # 2 + 2 + fp32 master 4 + 2 + 2
    # the fp32-parameter layout is the one that runs under ZeRO (tests/engine/test_zero.py)
    assert twelve.not_under_zero is None and "scalify_fp32_params" in eight.not_under_zero
    with pytest.raises(ConfigError, match="precision=scalify does not run under"):
        eight.check_engine("zero1")
    twelve.check_engine("zero1")


def test_value_rms_scale_of_scaled_data_is_the_values_rms_scale():
    """What propagation reads off a scaled parameter: the RMS scale of data * scale, exactly."""
    generator = torch.Generator().manual_seed(5)
    params = [
        torch.nn.Parameter(torch.randn(64, 32, generator=generator) * magnitude)
        for magnitude in (1e-30, 1e-6, 1.0, 3e4, 0.0)
    ]
    scale_parameters(torch.nn.ParameterList(params))
    for param in params:
        expected = rms_scale(value_of(param))
        assert torch.equal(value_rms_scale(param), expected), expected
        with torch.no_grad():
            param.mul_(1.9)  # data off its stored scale's range: still the value's
        assert torch.equal(value_rms_scale(param), rms_scale(value_of(param)))


def test_the_scale_attribute_is_one_name_everywhere():
    assert clipping_module.GRAD_SCALE_ATTR == memory_metrics.SCALE_ATTR == SCALE_ATTR


@pytest.mark.parametrize("family", ["gpt", "opt", "llama"])
def test_parameters_become_fp16_data_under_power_of_two_scales(family):
    original, model = _scaled(family)
    reference = dict(original.named_parameters())
    state = model.state_dict()
    for name, param in model.named_parameters():
        scale = getattr(param, SCALE_ATTR)
        assert param.dtype == torch.float16 and is_power_of_two(scale), name
        # the value is the scaled-fp16 rounding of the fp32 initialisation, exactly
        assert torch.equal(value_of(param).double(), _f64_rounding(reference[name], scale)), name
        rms = param.detach().double().square().mean().sqrt().item()
        assert rms == 0 or 0.99 < rms < 2.01, (name, rms)  # scale = pow2_floor(RMS)
        assert torch.equal(state[name + SCALE_SUFFIX], scale), name  # checkpoints carry it
    if family != "llama":  # the tied head and embedding share one parameter and one scale
        head, table = model.lm_head, model.get_input_embeddings()
        assert head.weight is table.weight
        assert getattr(head, f"weight{SCALE_SUFFIX}") is getattr(table, f"weight{SCALE_SUFFIX}")
    # outside a forward call the modules hold the fp16 data, inside they see values
    assert model.get_input_embeddings().weight.dtype == torch.float16
    with pytest.raises(ValueError, match="already held as scaled fp16"):
        scale_parameters(model)


@pytest.mark.parametrize("family", ["gpt", "opt", "llama"])
def test_eight_byte_forward_equals_the_fp32_parameter_forward(family):
    """The same values held as scaled fp16 or in fp32 parameters: the same loss, bit for bit;
    the gradients agree to the fp16 roundings that fall differently (tied uses)."""
    _, model = _scaled(family)
    fp32_params = copy.deepcopy(tiny_transformer(family))
    scalify_strategy(params="fp32").prepare_model(fp32_params)
    with torch.no_grad():
        for (_, theirs), (_, ours) in zip(
            fp32_params.named_parameters(), model.named_parameters(), strict=True
        ):
            theirs.copy_(value_of(ours))
    ours_out = model(input_ids=IDS, labels=IDS)
    theirs_out = fp32_params(input_ids=IDS, labels=IDS)
    assert torch.equal(ours_out.logits, theirs_out.logits)
    assert ours_out.loss.item() == theirs_out.loss.item()
    ours_out.loss.backward()
    theirs_out.loss.backward()
    for (name, theirs), (_, ours) in zip(
        fp32_params.named_parameters(), model.named_parameters(), strict=True
    ):
        assert ours.grad.dtype == torch.float16 and is_power_of_two(getattr(ours.grad, SCALE_ATTR))
        # each side rounded to fp16 (11 bits) once per contribution and once for the sum
        bound = 4 * 2.0**-11 * theirs.grad.abs().max().item()
        assert (grad_value(ours) - theirs.grad).abs().max().item() <= bound, name
    # the norm clipping sees and the trainer logs is the gradient values' norm
    theirs_norm = clip_grad_norm(fp32_params.parameters(), 0.0).item()
    assert clip_grad_norm(model.parameters(), 0.0).item() == pytest.approx(theirs_norm, rel=1e-3)


@pytest.mark.parametrize("magnitude", [1.0, 1e-7])
def test_gradients_are_the_scaled_fp16_rounding_of_the_float64_gradient(magnitude):
    """fp32 matmuls (no format rounding): the only rounding left is the gradient's store.

    Two micro-batches and the tied head/embedding each add a contribution; the stored
    gradient stays within four fp16 roundings of the float64 gradient at any magnitude,
    where gradients cast to fp16 unscaled flush to zero at 1e-7.
    """
    original, model = _scaled("gpt", matmul="fp32")
    reference = original.double()
    with torch.no_grad():
        for (_, ref), (_, ours) in zip(
            reference.named_parameters(), model.named_parameters(), strict=True
        ):
            ref.copy_(value_of(ours).double())
    batches = (IDS, torch.flip(IDS, dims=[0]))
    for ids in batches:
        (model(input_ids=ids, labels=ids).loss * magnitude / 2).backward()
        (reference(input_ids=ids, labels=ids).loss * magnitude / 2).backward()
    for (name, ref), (_, ours) in zip(
        reference.named_parameters(), model.named_parameters(), strict=True
    ):
        scale = getattr(ours.grad, SCALE_ATTR)
        assert ours.grad.dtype == torch.float16 and is_power_of_two(scale), name
        error = (grad_value(ours).double() - ref.grad).abs().max().item()
        assert error <= 4 * 2.0**-11 * ref.grad.abs().max().item() + 1e-12 * magnitude, name
    unscaled = copy.deepcopy(original)
    scalify_strategy(matmul="fp32", rescale=("layernorm_grad",)).prepare_model(unscaled)
    (unscaled(input_ids=IDS, labels=IDS).loss * magnitude).backward()
    flushed = sum(int(p.grad.abs().max() == 0) for p in unscaled.parameters())
    assert (flushed > 0) == (magnitude < 1e-3)  # scale 1: a plain fp16 cast


def test_clipping_reads_and_scales_the_gradient_values():
    params = [torch.nn.Parameter(torch.randn(s)) for s in ((40, 8), (8,), (16, 16))]
    module = torch.nn.ParameterList(params)
    scale_parameters(module)
    generator = torch.Generator().manual_seed(3)
    magnitudes = (1e-6, 1, 1e3)
    grads = [
        torch.randn(p.shape, generator=generator) * m
        for p, m in zip(params, magnitudes, strict=True)
    ]
    for p, g in zip(params, grads, strict=True):
        accumulate_grad(p, g)
    stored = [grad_value(p).double() for p in params]
    norm64 = math.sqrt(sum(float(g.square().sum()) for g in stored))
    assert clip_grad_norm(module.parameters(), 0.0).item() == pytest.approx(norm64, rel=1e-6)
    assert clip_grad_norm(module.parameters(), 1.0).item() == pytest.approx(norm64, rel=1e-6)
    clipped = math.sqrt(sum(float(grad_value(p).double().square().sum()) for p in params))
    assert clipped == pytest.approx(1.0, rel=2e-3)
    for p, before in zip(params, stored, strict=True):  # every value scaled alike
        ratio = (grad_value(p).double() / before)[before.abs() > before.abs().max() / 4]
        assert ratio.sub(1.0 / norm64).abs().max().item() < 2e-3 / norm64


# ------------------------------------------------------------------ the optimizer


def _scaled_params() -> list[torch.nn.Parameter]:
    params = adamw_params()
    scale_parameters(torch.nn.ParameterList(params))
    return params


def test_scaled_adamw_on_scaled_parameters_tracks_a_float64_adamw():
    """Gradients of 1e-6, 1 and 1e4 stored as scaled fp16; the parameter is the fp16 master."""
    params = _scaled_params()
    reference = Float64AdamW([value_of(p) for p in params])
    optimizer = ScaledAdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, master="fp16")
    for step in range(STEPS):
        grads = adamw_grads(step, params)
        for p, g in zip(params, grads, strict=True):
            p.grad = None
            accumulate_grad(p, g)
        # the reference sees the gradients the optimizer sees: their scaled-fp16 rounding
        reference.step([grad_value(p).double() for p in params])
        optimizer.step()
    for p, ref in zip(params, reference.params, strict=True):
        state = optimizer.state[p]
        assert "master" not in state and "master_scale" not in state  # the parameter is it
        assert p.dtype == torch.float16 and is_power_of_two(getattr(p, SCALE_ATTR))
        bound = STEPS * 2.0**-11 * 2 * getattr(p, SCALE_ATTR).item()
        assert (value_of(p).double() - ref).abs().max().item() < bound
    assert optimizer.rescale_count > 0
    assert optimizer.scale_metrics()["scalify_rms_outside_frac"] == 0.0
    numel = sum(p.numel() for p in params)
    state_scales = sum(k.endswith("_scale") for s in optimizer.state.values() for k in s)
    scales = 2 * len(params) + state_scales  # each parameter's and each gradient's
    assert model_state_bytes(torch.nn.ParameterList(params), optimizer) == 8 * numel + 4 * scales


def test_descent_is_measured_on_the_values():
    """EDQ of one step against a float64 computation from the values before and after and
    AdamW's first update, -lr * g / (|g| + eps) - lr * wd * w."""
    params = _scaled_params()
    optimizer = ScaledAdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, master="fp16")
    for p, g in zip(params, adamw_grads(0, params), strict=True):
        accumulate_grad(p, g)
    before = [value_of(p).double() for p in params]
    grads = [grad_value(p).double() for p in params]
    optimizer.track_edq = True
    optimizer.step()
    metrics = optimizer.edq_metrics()
    dot = norm_sq = lost = moved = 0.0
    for p, w, g in zip(params, before, grads, strict=True):
        update = -LR * g / (g.abs() + EPS) - LR * WD * w
        change = value_of(p).double() - w
        dot += float((change * update).sum())
        norm_sq += float(update.square().sum())
        lost += float(((update != 0) & (change == 0)).sum())
        moved += float((update != 0).sum())
    assert metrics["edq_normalized"] == pytest.approx(dot / norm_sq, rel=1e-4)
    assert metrics["edq"] == pytest.approx(dot / math.sqrt(norm_sq), rel=1e-4)
    assert metrics["lost_update_frac"] == pytest.approx(lost / moved, abs=1e-9)


@pytest.mark.parametrize("master", ["fp16", "fp32"])
def test_full_precision_round_trip_changes_no_bit(master):
    """What replicas read and write back: the values, and load(read()) is the identity."""
    params = _scaled_params()
    optimizer = ScaledAdamW(params, lr=LR, weight_decay=WD, master=master)
    for step in range(3):
        for p, g in zip(params, adamw_grads(step, params), strict=True):
            p.grad = None
            accumulate_grad(p, g)
        optimizer.step()
    values = optimizer.full_precision_weights()
    for p, v in zip(params, values, strict=True):
        expected = optimizer.state[p]["master"] if master == "fp32" else value_of(p)
        assert v.dtype == torch.float32 and torch.equal(v, expected)
    before = [(p.detach().clone(), getattr(p, SCALE_ATTR).clone()) for p in params]
    optimizer.load_full_precision_weights(values)
    for p, (data, scale) in zip(params, before, strict=True):
        assert torch.equal(p.detach(), data) and torch.equal(getattr(p, SCALE_ATTR), scale)
    doubled = [v * 2 for v in values]
    optimizer.load_full_precision_weights(doubled)
    for p, v in zip(params, doubled, strict=True):
        if master == "fp16":
            assert torch.equal(value_of(p), v)  # doubling a scaled-fp16 value is exact


def test_step_temporaries_of_scaled_parameters_match_the_planner():
    from plan_checks import assert_step_temporaries_match_the_table

    strategy = get_strategy("scalify")
    sizes = [(512, 256), (256,), (256, 768), (768,), (768, 256)]
    params = [torch.nn.Parameter(torch.randn(s)) for s in sizes]
    module = torch.nn.ParameterList(params)
    strategy.prepare_model(module)
    optimizer = strategy.build_optimizer(decay_param_groups(module, 0.1), OptCfg)
    for p in params:
        accumulate_grad(p, torch.randn(p.shape) * 1e-3)
    assert_step_temporaries_match_the_table(strategy, params, optimizer)


# ------------------------------------------------------------------ a real run


@pytest.mark.slow
def test_an_eight_byte_run_measures_8_bytes_and_exports_ordinary_weights(make_cfg, tmp_path):
    run_dir = tmp_path / "run"
    cfg = make_cfg(
        "precision=scalify",
        "train.max_steps=4",
        "train.micro_batch_size=4",
        "train.global_batch_size=8",  # two micro-batches accumulate into scaled gradients
        "train.eval_every=4",
        "train.checkpoint_every=4",
        "logging.log_every=2",
        "train.export_hf=true",
    )
    summary = train(cfg, run_dir)
    assert summary["precision"] == "scalify"
    assert "sample" not in summary  # scaled parameters: sampled from the export instead
    assert summary["state_bytes_per_param"] == pytest.approx(8, abs=0.02)  # + 0-d scales
    assert math.isfinite(summary["final_val_loss"])
    stored = load_checkpoint_file(run_dir / "checkpoints" / "step-4", "model")
    assert any(key.endswith(SCALE_SUFFIX) for key in stored)
    assert all(t.dtype == torch.float16 for k, t in stored.items() if k + SCALE_SUFFIX in stored)
    values = unscale_weights(stored)
    exported = AutoModelForCausalLM.from_pretrained(run_dir / "hf").state_dict()
    assert not any(key.endswith(SCALE_SUFFIX) for key in exported)
    for key, tensor in exported.items():
        assert tensor.dtype == torch.float32 and torch.equal(tensor, values[key]), key
    assert export.main([str(run_dir), "--out", str(tmp_path / "from-checkpoint")]) == 0
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "from-checkpoint").state_dict()
    assert all(torch.equal(again[key], tensor) for key, tensor in exported.items())


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_activation_checkpointing_gives_the_same_scaled_gradients(family):
    """Recomputed blocks see the same values (the pre-hooks run again in backward) and
    every gradient is stored once: data and scales equal the plain run's bit for bit."""
    _, plain = _scaled(family)
    _, checkpointed = _scaled(family)
    checkpointed.gradient_checkpointing_enable(
        gradient_checkpointing_kwargs={"use_reentrant": False}
    )
    for model in (plain, checkpointed):
        model.train()
        model(input_ids=IDS, labels=IDS).loss.backward()
    for (name, ours), (_, theirs) in zip(
        checkpointed.named_parameters(), plain.named_parameters(), strict=True
    ):
        assert torch.equal(ours.grad, theirs.grad), name
        assert torch.equal(getattr(ours.grad, SCALE_ATTR), getattr(theirs.grad, SCALE_ATTR))
