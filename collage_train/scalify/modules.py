"""A scaled drop-in for ``nn.Linear`` and transformers' ``Conv1D``.

``ScaledLinear`` keeps the original module's ``weight`` and ``bias`` Parameters (same
objects, same names, so optimizers, tied embeddings and state dicts are unaffected)
and runs its matmul through ``ScaledMatmul``, a custom autograd Function:

- ``"fp32"``: plain fp32 matmuls, no quantization (checks the plumbing);
- ``"bf16"`` / ``"fp16"``: each operand divided by its power-of-two RMS scale and
  cast, the product multiplied back by ``s_a * s_b`` (exact);
- ``"float8"``: E4M3 activations and weights forward, E5M2 gradients backward,
  through ``scaled_mm`` (hardware float8 where present, exact emulation elsewhere).

Scales are taken from each operand's RMS at the module boundary, and the output is
handed back unscaled, so model code needs no change: ``scalify_linears(model, fmt)``
swaps the modules in place.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.pytorch_utils import Conv1D

from collage_train.scalify.float8 import FLOAT8_BACKWARD, FLOAT8_FORWARD, scaled_mm, to_float8
from collage_train.scalify.scale import rms_scale

MATMUL_FORMATS = ("fp32", "bf16", "fp16", "float8")
_CAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def quantize(
    t: torch.Tensor, fmt: str, backward: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(data, scale)`` of ``t`` in matmul format ``fmt`` (E5M2 for gradients in float8)."""
    if fmt == "fp32":
        return t.to(torch.float32), torch.ones((), device=t.device)
    scale = rms_scale(t)
    if fmt == "float8":
        return to_float8(t, scale, FLOAT8_BACKWARD if backward else FLOAT8_FORWARD)
    return (t.to(torch.float32) / scale).to(_CAST_DTYPES[fmt]), scale


def matmul(
    a: torch.Tensor, scale_a: torch.Tensor, b: torch.Tensor, scale_b: torch.Tensor, fmt: str
) -> torch.Tensor:
    """The fp32 value of ``(a * scale_a) @ (b * scale_b)`` for data in format ``fmt``."""
    if fmt == "fp32":
        return a @ b
    if fmt == "float8":
        return scaled_mm(a, b, scale_a, scale_b, torch.float32)
    return (a @ b).to(torch.float32) * (scale_a * scale_b)


class ScaledMatmul(torch.autograd.Function):
    """``x @ w`` for 2-D ``x`` (M, K) and ``w`` (K, N), quantized as ``fmt`` says."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, fmt: str) -> torch.Tensor:
        x_data, x_scale = quantize(x, fmt)
        w_data, w_scale = quantize(w, fmt)
        ctx.save_for_backward(x_data, x_scale, w_data, w_scale)
        ctx.fmt = fmt
        ctx.dtypes = (x.dtype, w.dtype)
        return matmul(x_data, x_scale, w_data, w_scale, fmt).to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        x_data, x_scale, w_data, w_scale = ctx.saved_tensors
        fmt = ctx.fmt
        g_data, g_scale = quantize(grad_out, fmt, backward=True)
        grad_x = matmul(g_data, g_scale, w_data.t(), w_scale, fmt)
        grad_w = matmul(x_data.t(), x_scale, g_data, g_scale, fmt)
        return grad_x.to(ctx.dtypes[0]), grad_w.to(ctx.dtypes[1]), None


class ScaledLinear(torch.nn.Module):
    """``y = x @ W (+ b)`` with a scaled matmul, holding the replaced module's Parameters.

    ``weight_is_in_out`` says the weight is stored (in, out) as in ``Conv1D``; else it
    is (out, in) as in ``nn.Linear``.
    """

    def __init__(
        self,
        weight: torch.nn.Parameter,
        bias: torch.nn.Parameter | None,
        weight_is_in_out: bool,
        fmt: str = "float8",
    ) -> None:
        super().__init__()
        if fmt not in MATMUL_FORMATS:
            raise ValueError(f"matmul format must be one of {MATMUL_FORMATS}, got {fmt!r}")
        self.weight = weight
        self.bias = bias
        self.weight_is_in_out = weight_is_in_out
        self.fmt = fmt

    @classmethod
    def replacing(cls, module: torch.nn.Module, fmt: str) -> ScaledLinear:
        """A ScaledLinear sharing ``module``'s weight and bias (nn.Linear or Conv1D)."""
        if isinstance(module, Conv1D):
            return cls(module.weight, module.bias, weight_is_in_out=True, fmt=fmt)
        if isinstance(module, torch.nn.Linear):
            return cls(module.weight, module.bias, weight_is_in_out=False, fmt=fmt)
        raise TypeError(f"cannot replace a {type(module).__name__} with a ScaledLinear")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight if self.weight_is_in_out else self.weight.t()
        out = ScaledMatmul.apply(x.reshape(-1, x.shape[-1]), w, self.fmt)
        out = out.reshape(*x.shape[:-1], w.shape[1])
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        k, n = self.weight.shape if self.weight_is_in_out else self.weight.shape[::-1]
        return f"in_features={k}, out_features={n}, bias={self.bias is not None}, fmt={self.fmt}"


def scalify_linears(
    model: torch.nn.Module, fmt: str = "float8", skip: tuple[str, ...] = ()
) -> list[str]:
    """Replace every ``nn.Linear`` and ``Conv1D`` in ``model`` by a ScaledLinear, in place.

    Modules whose qualified name is in ``skip`` (e.g. ``"lm_head"``) stay as they are.
    Returns the names replaced.
    """
    targets = [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear | Conv1D) and name not in skip
    ]
    for name, module in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, ScaledLinear.replacing(module, fmt))
    return [name for name, _ in targets]
