"""Scaled attention: both attention matmuls in the Scalify matmul format, softmax unscaled.

transformers' GPT-2 and OPT attention modules call whatever function
``ALL_ATTENTION_FUNCTIONS`` holds under ``config._attn_implementation``.
``use_scaled_attention(model, fmt, rescale)`` registers ``scalify_<fmt>`` (with the
eager additive mask under the same name in the mask registry, so causal and padding
masks arrive as they do for eager attention) and points the model's config at it:
the model code is untouched. Per head, for queries Q, keys K and values V:

- scores = ``ScaledMatmul(Q, K^T)`` times the module's scaling (1/sqrt(d) for GPT-2,
  1 for OPT, whose q_proj is pre-scaled): the matmul rule, each operand cast to the
  format under its power-of-two scale (E4M3 forward, E5M2 gradients for float8);
- mask added and softmax taken in fp32: exp is not a scale-propagating op, so it runs
  unscaled, as Scalify's table prescribes (its output lies in [0, 1]);
- output = ``ScaledMatmul(P, V)``, the matmul rule again.

With ``fmt="fp32"`` this is transformers' eager attention, operation for operation.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, eager_mask

from collage_train.scalify.modules import MATMUL_FORMATS, ScaledMatmul


def implementation_name(fmt: str) -> str:
    """The ``config._attn_implementation`` value of scaled attention in format ``fmt``."""
    return f"scalify_{fmt}"


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
    rescale: bool = True,
    **_: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over (batch, heads, tokens, head_dim) tensors, in transformers' signature.

    Returns the output as (batch, tokens, heads, head_dim) and the probabilities.
    """
    if scaling is None:
        scaling = query.size(-1) ** -0.5
    scores = ScaledMatmul.apply(query, key.transpose(-2, -1), fmt, rescale) * scaling
    if attention_mask is not None:
        scores = scores + attention_mask
    probs = torch.nn.functional.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    probs = torch.nn.functional.dropout(probs, p=dropout, training=module.training)
    output = ScaledMatmul.apply(probs, value, fmt, rescale)
    return output.transpose(1, 2).contiguous(), probs


def _register(fmt: str, rescale: bool) -> str:
    name = implementation_name(fmt) + ("" if rescale else "_unscaled")

    def attention(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return scaled_attention(*args, fmt=fmt, rescale=rescale, **kwargs)

    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, eager_mask)
    return name


def use_scaled_attention(model: torch.nn.Module, fmt: str, rescale: bool = True) -> str:
    """Route ``model``'s attention through ``scaled_attention``; returns the name registered."""
    if fmt not in MATMUL_FORMATS:
        raise ValueError(f"matmul format must be one of {MATMUL_FORMATS}, got {fmt!r}")
    name = _register(fmt, rescale)
    model.config._attn_implementation = name  # GPT-2's and OPT's modules share this config
    return name
