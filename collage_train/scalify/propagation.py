"""Static operand scales: Scalify's propagation table wired between the model's modules.

In Scalify a tensor's scale is not measured but derived: each op's output scale follows
from its inputs' by a fixed rule (``collage_train.scalify.scale``), and only a few
points rescale dynamically. Between the modules of a transformers model the tensors are
plain, so ``propagate_scales`` gives every matmul input, as a
``ScaledLinear.input_scale_source``, the scale the table assigns to the op that produced
it (a norm, attention, a gating activation, SwiGLU, rotary embeddings, the embeddings);
``attention_scales`` does the same for the attention matmuls and ``stream_entry_scale``
for the residual stream's entry. Blocks of an unknown kind keep ``input_scale_source``
unset: their inputs are unscaled, the table's fallback.

The rule for each producer: docs/strategies.md, "The propagation table".
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from collage_train.scalify.modules import ScaledLayerNorm, ScaledLinear, ScaledRMSNorm
from collage_train.scalify.scale import (
    add_scale,
    mul_scale,
    rotary_scale,
    sum_scale,
    value_rms_scale,
)

ScaledNorm = ScaledLayerNorm | ScaledRMSNorm
# A producer in a table: a module name, None (the input is unscaled) or a callable of
# the block giving the scale (a rule over several producers, e.g. SwiGLU's product).
Producer = str | Callable[[torch.nn.Module], Callable[[], torch.Tensor]] | None

# Per block class: consumer linear -> the module whose output it reads (a ScaledLayerNorm
# or a ScaledLinear), or None for an input the table leaves unscaled.
_GPT2_BLOCK: dict[str, str | None] = {
    "attn.c_attn": "ln_1",
    "attn.c_proj": "attn.c_attn",  # P V: the value projection's scale
    "mlp.c_fc": "ln_2",
}
_OPT_LAYER: dict[str, str | None] = {  # LayerNorm before attention and MLP (most OPTs)
    "self_attn.q_proj": "self_attn_layer_norm",
    "self_attn.k_proj": "self_attn_layer_norm",
    "self_attn.v_proj": "self_attn_layer_norm",
    "self_attn.out_proj": "self_attn.v_proj",
    "fc1": "final_layer_norm",
}
_OPT_POST_LN_LAYER: dict[str, str | None] = {  # LayerNorm after each add (opt_350m)
    "self_attn.out_proj": "self_attn.v_proj",
    "fc1": "self_attn_layer_norm",
}
_OPT_POST_LN_INPUTS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
_LLAMA_LAYER: dict[str, Producer] = {  # RMSNorm before attention and the SwiGLU MLP
    "self_attn.q_proj": "input_layernorm",
    "self_attn.k_proj": "input_layernorm",
    "self_attn.v_proj": "input_layernorm",
    "self_attn.o_proj": "self_attn.v_proj",  # P V: the value projection's scale
    "mlp.gate_proj": "post_attention_layernorm",
    "mlp.up_proj": "post_attention_layernorm",
}
# Activations of the form x * gate(x), gate in [0, 1]: they keep their input's scale.
GATING_ACTIVATIONS = frozenset(
    {
        "ReLU",
        "GELU",
        "GELUActivation",
        "NewGELUActivation",
        "FastGELUActivation",
        "GELUTanh",
        "PytorchGELUTanh",
        "QuickGELUActivation",
        "SiLU",
        "SiLUActivation",
    }
)
# The final LayerNorm, wherever the model keeps it (the LM head, or OPT's project_out,
# reads it).
_FINAL_NORMS = ("transformer.ln_f", "model.decoder.final_layer_norm", "model.norm")

# Attention module class -> (query, key, value) producing linears, whether the query
# was multiplied by the module's ``scaling`` before attention (OPT does that), and whether
# the queries and keys were rotated (Llama's rotary embedding).
ATTENTION_INPUTS = {
    "GPT2Attention": (("c_attn", "c_attn", "c_attn"), False, False),
    "OPTAttention": (("q_proj", "k_proj", "v_proj"), True, False),
    "LlamaAttention": (("q_proj", "k_proj", "v_proj"), False, True),
}


def _output_scale_of(module: torch.nn.Module) -> Callable[[], torch.Tensor]:
    if isinstance(module, ScaledNorm):
        return module.output_scale
    if isinstance(module, ScaledLinear):
        return lambda: module.last_output_scale
    raise TypeError(f"no propagated scale for a {type(module).__name__}")


def _after(activation: object, producer: str) -> str | None:
    """The producer whose scale an activation's output keeps, or None (unscaled)."""
    return producer if type(activation).__name__ in GATING_ACTIVATIONS else None


def _swiglu_product(block: torch.nn.Module) -> Callable[[], torch.Tensor] | None:
    """Scale of Llama's ``act(gate_proj(x)) * up_proj(x)``: the gating rule keeps the gate
    projection's scale through SiLU, the mul rule multiplies it by the up projection's.
    None (unscaled) when the activation is not a gating one or the projections are plain."""
    mlp = block.mlp
    gate, up = mlp.gate_proj, mlp.up_proj
    if _after(mlp.act_fn, "gate_proj") is None or not isinstance(gate, ScaledLinear):
        return None
    if not isinstance(up, ScaledLinear):
        return None
    return lambda: mul_scale(
        gate.last_output_scale, up.last_output_scale.to(gate.last_output_scale.device)
    )


def _wire(block: torch.nn.Module, table: dict[str, Producer]) -> list[str]:
    wired = []
    for consumer_name, producer in table.items():
        consumer = block.get_submodule(consumer_name)
        if not isinstance(consumer, ScaledLinear):
            continue
        # None: the input is unscaled (ScaledLinear then casts it under scale 1)
        if producer is None:
            consumer.input_scale_source = None
        elif callable(producer):
            consumer.input_scale_source = producer(block)
        else:
            consumer.input_scale_source = _output_scale_of(block.get_submodule(producer))
        wired.append(consumer_name)
    return wired


def propagate_scales(model: torch.nn.Module) -> list[str]:
    """Give each ScaledLinear of ``model`` the propagated scale of its input.

    Run after the linears and LayerNorms are scaled. Returns the qualified names of the
    linears wired (the others stay unscaled on input).
    """
    wired: list[str] = []
    block_input: Callable[[], torch.Tensor] = lambda: stream_entry_scale(model)  # noqa: E731
    for name, block in model.named_modules():
        kind = type(block).__name__
        prefix = f"{name}." if name else ""
        if kind == "GPT2Block":
            table = {**_GPT2_BLOCK, "mlp.c_proj": _after(block.mlp.act, "mlp.c_fc")}
            wired += [prefix + n for n in _wire(block, table)]
        elif kind == "LlamaDecoderLayer":
            table = {**_LLAMA_LAYER, "mlp.down_proj": _swiglu_product}
            wired += [prefix + n for n in _wire(block, table)]
        elif kind == "OPTDecoderLayer" and block.do_layer_norm_before:
            table = {**_OPT_LAYER, "fc2": _after(block.activation_fn, "fc1")}
            wired += [prefix + n for n in _wire(block, table)]
        elif kind == "OPTDecoderLayer":
            table = {**_OPT_POST_LN_LAYER, "fc2": _after(block.activation_fn, "fc1")}
            wired += [prefix + n for n in _wire(block, table)]
            for projection in _OPT_POST_LN_INPUTS:
                block.get_submodule(projection).input_scale_source = block_input
                wired.append(prefix + projection)
            block_input = _output_scale_of(block.final_layer_norm)  # the next layer's input
    decoder = _opt_decoder(model)
    project_in = getattr(decoder, "project_in", None)
    if isinstance(project_in, ScaledLinear):  # reads the token embedding lookup
        tokens = model.get_input_embeddings()
        project_in.input_scale_source = lambda: value_rms_scale(tokens.weight)
        wired.append("model.decoder.project_in")
    head_input: Callable[[], torch.Tensor] | None = None
    norm = _final_norm(model)
    if norm is not None:
        head_input = norm.output_scale
    project_out = getattr(decoder, "project_out", None)
    if isinstance(project_out, ScaledLinear):
        # its input: the final LayerNorm, or (post-LN) the last layer's closing one
        project_out.input_scale_source = head_input or block_input
        wired.append("model.decoder.project_out")
        head_input = _output_scale_of(project_out)
    head = getattr(model, "lm_head", None)
    if isinstance(head, ScaledLinear) and head_input is not None:
        head.input_scale_source = head_input
        wired.append("lm_head")
    return wired


def stream_entry_scale(model: torch.nn.Module) -> torch.Tensor:
    """The scale of the residual stream entering the first block.

    The add rule over the token embeddings (the table's scale, or the output scale of
    OPT's ``project_in`` when the embeddings are narrower) and every other embedding
    table (positions).
    """
    tokens = model.get_input_embeddings()
    project_in = getattr(_opt_decoder(model), "project_in", None)
    if isinstance(project_in, ScaledLinear):
        scale = project_in.last_output_scale
    else:
        scale = value_rms_scale(tokens.weight)
    for table in model.modules():
        if isinstance(table, torch.nn.Embedding) and table is not tokens:
            scale = add_scale(scale, value_rms_scale(table.weight).to(scale.device))
    return scale


def _opt_decoder(model: torch.nn.Module) -> torch.nn.Module | None:
    return getattr(getattr(model, "model", None), "decoder", None)


def _final_norm(model: torch.nn.Module) -> ScaledNorm | None:
    """The model's final norm (GPT-2's ln_f, OPT's decoder LayerNorm, Llama's RMSNorm), if any."""
    for name in _FINAL_NORMS:
        try:
            norm = model.get_submodule(name)
        except AttributeError:  # absent, or None (OPT without a final LayerNorm)
            continue
        if isinstance(norm, ScaledNorm):
            return norm
    return None


def attention_scales(
    module: torch.nn.Module, keys: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """Propagated scales of (query, key, softmax output, value) for ``module``'s attention.

    None for an attention module of an unknown kind. The softmax output over ``keys``
    keys has scale ``1 / pow2_floor(sqrt(keys))`` (module docstring); rotated queries and
    keys keep their projections' scales (``rotary_scale``).
    """
    entry = ATTENTION_INPUTS.get(type(module).__name__)
    if entry is None:
        return None
    (q_name, k_name, v_name), query_prescaled, rotated = entry
    q, k, v = (module.get_submodule(n) for n in (q_name, k_name, v_name))
    if not all(isinstance(m, ScaledLinear) for m in (q, k, v)):
        return None
    device = q.last_output_scale.device
    q_scale = q.last_output_scale
    if query_prescaled:  # query = q_proj(x) * scaling: the mul rule with a constant
        mantissa_exponent = math.frexp(float(module.scaling))[1]  # exact, on the host
        q_scale = q_scale * math.ldexp(1.0, mantissa_exponent - 1)
    device = q.last_output_scale.device
    k_scale = k.last_output_scale.to(device)
    if rotated:
        q_scale, k_scale = rotary_scale(q_scale), rotary_scale(k_scale)
    probs_scale = 1.0 / sum_scale(torch.ones((), device=device), keys)
    return q_scale, k_scale, probs_scale, v.last_output_scale.to(device)
