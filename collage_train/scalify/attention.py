"""Scaled attention: both attention matmuls in the Scalify matmul format, softmax unscaled.

``use_scaled_attention(model, fmt, operand_scales)`` registers ``scalify_<fmt>`` with
transformers' attention (and mask) registries and points the model's config at it: the
model code is untouched. Per head: grouped key/value heads are repeated for the query
heads they serve; scores = ``ScaledMatmul(Q, K^T)`` times the module's scaling; mask and
softmax in fp32 (exp does not propagate a scale); output = ``ScaledMatmul(P, V)``.
Operand scales as for ``ScaledLinear`` (``"propagated"``, ``"dynamic"``, ``"unit"``;
an attention module of an unknown kind falls back to ``"dynamic"``). With
``fmt="fp32"`` this is transformers' eager attention, operation for operation.

Details: docs/strategies.md, "Scaled attention".
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.masking_utils import AttentionMaskInterface, eager_mask

from collage_train.model.hf_modeling import AttentionInterface
from collage_train.scalify.modules import MATMUL_FORMATS, OPERAND_SCALES, ScaledMatmul
from collage_train.scalify.propagation import attention_scales


def implementation_name(
    fmt: str, operand_scales: str = "dynamic", grad_rescale: bool = True
) -> str:
    """The ``config._attn_implementation`` value of scaled attention with these options."""
    name = f"scalify_{fmt}"
    if operand_scales != "dynamic":
        name += f"_{operand_scales}"
    return name if grad_rescale else name + "_unscaled_grads"


def scaled_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    *,
    fmt: str,
    operand_scales: str = "dynamic",
    grad_rescale: bool = True,
    **_: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over (batch, heads, tokens, head_dim) tensors, in transformers' signature.

    Returns the output as (batch, tokens, heads, head_dim) and the probabilities.
    """
    if scaling is None:
        scaling = query.size(-1) ** -0.5
    groups = query.size(1) // key.size(1)
    if groups > 1:  # grouped-query attention (Llama): each key/value head serves `groups`
        key = key.repeat_interleave(groups, dim=1)  # repeating keeps the scale
        value = value.repeat_interleave(groups, dim=1)
    static = attention_scales(module, key.size(-2)) if operand_scales == "propagated" else None
    rescale = operand_scales != "unit"
    qk_scales = None if static is None else (static[0], static[1])
    pv_scales = None if static is None else (static[2], static[3])
    scores = (
        ScaledMatmul.apply(query, key.transpose(-2, -1), fmt, rescale, qk_scales, grad_rescale)
        * scaling
    )
    if attention_mask is not None:
        scores = scores + attention_mask
    probs = torch.nn.functional.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    probs = torch.nn.functional.dropout(probs, p=dropout, training=module.training)
    output = ScaledMatmul.apply(probs, value, fmt, rescale, pv_scales, grad_rescale)
    return output.transpose(1, 2).contiguous(), probs


def _register(fmt: str, operand_scales: str, grad_rescale: bool) -> str:
    name = implementation_name(fmt, operand_scales, grad_rescale)

    def attention(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return scaled_attention(
            *args, fmt=fmt, operand_scales=operand_scales, grad_rescale=grad_rescale, **kwargs
        )

    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, eager_mask)
    return name


def use_scaled_attention(
    model: torch.nn.Module, fmt: str, operand_scales: str = "dynamic", grad_rescale: bool = True
) -> str:
    """Route ``model``'s attention through ``scaled_attention``; returns the name registered."""
    if fmt not in MATMUL_FORMATS:
        raise ValueError(f"matmul format must be one of {MATMUL_FORMATS}, got {fmt!r}")
    if operand_scales not in OPERAND_SCALES:
        raise ValueError(f"operand_scales must be one of {OPERAND_SCALES}, got {operand_scales!r}")
    name = _register(fmt, operand_scales, grad_rescale)
    model.config._attn_implementation = name  # GPT-2's and OPT's modules share this config
    return name
