"""A scaled drop-in for ``nn.Linear`` and transformers' ``Conv1D``.

``ScaledLinear`` keeps the original module's ``weight`` and ``bias`` Parameters (same
objects, same names, so optimizers, tied embeddings and state dicts are unaffected)
and runs its matmul through ``ScaledMatmul``, a custom autograd Function that casts both
operands to the format (``"fp32"``, ``"bf16"``, ``"fp16"`` or ``"float8"``: E4M3
forward, E5M2 backward) under power-of-two scales and multiplies the product back
exactly. ``operand_scales`` says where the scales come from: ``"dynamic"`` (each
operand's RMS), ``"propagated"`` (Scalify's static rule, ``input_scale_source``) or
``"unit"``. The output is an fp32 value, so model code needs no change:
``scalify_linears(model, fmt)`` swaps the modules in place.

Details: docs/strategies.md, "Scaled matmuls: ScaledLinear".
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from transformers.pytorch_utils import Conv1D

from collage_train.model.shapes import full_shape
from collage_train.scalify.float8 import FLOAT8_BACKWARD, FLOAT8_FORWARD, scaled_mm, to_float8
from collage_train.scalify.scale import matmul_scale, rms_scale, value_rms_scale

MATMUL_FORMATS = ("fp32", "bf16", "fp16", "float8")
OPERAND_SCALES = ("dynamic", "propagated", "unit")
_CAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def operand_scale(t: torch.Tensor, rescale: bool = True) -> torch.Tensor:
    """The power-of-two scale ``t`` is cast under: its RMS scale, or 1 without ``rescale``."""
    return rms_scale(t) if rescale else torch.ones((), device=t.device)


def quantize(
    t: torch.Tensor,
    fmt: str,
    backward: bool = False,
    rescale: bool = True,
    scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(data, scale)`` of ``t`` in matmul format ``fmt`` (E5M2 for gradients in float8).

    ``rescale=False`` casts under scale 1 (what an unscaled low-precision cast does);
    a given ``scale`` (``operand_scale``, computed by the caller) is used as is.
    """
    if scale is None:
        scale = operand_scale(t, rescale)
    if fmt == "fp32":  # scaled, not rounded: dividing by a power of two is exact
        return t.to(torch.float32) / scale, scale
    if fmt == "float8":
        return to_float8(t, scale, FLOAT8_BACKWARD if backward else FLOAT8_FORWARD)
    return (t.to(torch.float32) / scale).to(_CAST_DTYPES[fmt]), scale


def matmul(
    a: torch.Tensor, scale_a: torch.Tensor, b: torch.Tensor, scale_b: torch.Tensor, fmt: str
) -> torch.Tensor:
    """The fp32 value of ``(a * scale_a) @ (b * scale_b)`` for data in format ``fmt``."""
    if fmt == "float8":
        return scaled_mm(a, b, scale_a, scale_b, torch.float32)
    return (a @ b).to(torch.float32) * (scale_a * scale_b)


class ScaledMatmul(torch.autograd.Function):
    """``x @ w`` for ``x`` (..., M, K) and ``w`` (..., K, N), quantized as ``fmt`` says.

    2-D for the linear layers; batched (equal leading dimensions) for attention.
    """

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        w: torch.Tensor,
        fmt: str,
        rescale: bool = True,
        scales: tuple[torch.Tensor, torch.Tensor] | None = None,
        grad_rescale: bool | None = None,
    ) -> torch.Tensor:
        """``scales`` fixes the operands' scales (else their RMS, or 1 without ``rescale``);
        ``grad_rescale`` (default: ``rescale``) gives the incoming gradient its RMS scale."""
        x_scale, w_scale = scales if scales is not None else (None, None)
        x_data, x_scale = quantize(x, fmt, rescale=rescale, scale=x_scale)
        w_data, w_scale = quantize(w, fmt, rescale=rescale, scale=w_scale)
        ctx.save_for_backward(x_data, x_scale, w_data, w_scale)
        ctx.fmt = fmt
        ctx.rescale = rescale if grad_rescale is None else grad_rescale
        ctx.dtypes = (x.dtype, w.dtype)
        return matmul(x_data, x_scale, w_data, w_scale, fmt).to(x.dtype)

    @staticmethod
    def backward(
        ctx: Any, grad_out: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, None, None, None, None]:
        x_data, x_scale, w_data, w_scale = ctx.saved_tensors
        fmt = ctx.fmt
        g_data, g_scale = quantize(grad_out, fmt, backward=True, rescale=ctx.rescale)
        grad_x = matmul(g_data, g_scale, w_data.transpose(-2, -1), w_scale, fmt)
        grad_w = matmul(x_data.transpose(-2, -1), x_scale, g_data, g_scale, fmt)
        return grad_x.to(ctx.dtypes[0]), grad_w.to(ctx.dtypes[1]), None, None, None, None


class ScaledLinear(torch.nn.Module):
    """``y = x @ W (+ b)`` with a scaled matmul, holding the replaced module's Parameters.

    ``weight_is_in_out`` says the weight is stored (in, out) as in ``Conv1D``; else it
    is (out, in) as in ``nn.Linear``. ``operand_scales`` is one of OPERAND_SCALES;
    ``grad_rescale`` gives the gradient arriving in backward a fresh RMS scale.
    """

    def __init__(
        self,
        weight: torch.nn.Parameter,
        bias: torch.nn.Parameter | None,
        weight_is_in_out: bool,
        fmt: str = "float8",
        operand_scales: str = "dynamic",
        grad_rescale: bool = True,
    ) -> None:
        super().__init__()
        if fmt not in MATMUL_FORMATS:
            raise ValueError(f"matmul format must be one of {MATMUL_FORMATS}, got {fmt!r}")
        if operand_scales not in OPERAND_SCALES:
            raise ValueError(
                f"operand_scales must be one of {OPERAND_SCALES}, got {operand_scales!r}"
            )
        self.weight = weight
        self.bias = bias
        self.weight_is_in_out = weight_is_in_out
        self.fmt = fmt
        self.operand_scales = operand_scales
        self.grad_rescale = grad_rescale
        # With "propagated": returns the input's scale (a 0-d tensor), set by
        # collage_train.scalify.propagation; None means the input is unscaled.
        self.input_scale_source: Callable[[], torch.Tensor] | None = None
        # The matmul rule's scale of the last output (s_x * s_w * pow2(sqrt(K))): the
        # scale this layer hands to a residual add (collage_train.scalify.residual) and
        # to the layers that consume its output (propagation).
        self.last_output_scale = torch.ones(())
        # RMS of the last input's data (value / its scale): how far the scale drifted.
        self.last_input_data_rms = torch.ones(())

    @classmethod
    def replacing(cls, module: torch.nn.Module, fmt: str, **options: Any) -> ScaledLinear:
        """A ScaledLinear sharing ``module``'s weight and bias (nn.Linear or Conv1D)."""
        if isinstance(module, Conv1D):
            return cls(module.weight, module.bias, True, fmt=fmt, **options)
        if isinstance(module, torch.nn.Linear):
            return cls(module.weight, module.bias, False, fmt=fmt, **options)
        raise TypeError(f"cannot replace a {type(module).__name__} with a ScaledLinear")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight if self.weight_is_in_out else self.weight.t()
        x2 = x.reshape(-1, x.shape[-1])
        scales = self._operand_scales(x2, w)
        self.last_output_scale = matmul_scale(*scales, x2.shape[-1]).detach()
        self.last_input_data_rms = (x2.detach().float().square().mean().sqrt() / scales[0]).detach()
        out = ScaledMatmul.apply(x2, w, self.fmt, True, scales, self.grad_rescale)
        out = out.reshape(*x.shape[:-1], w.shape[1])
        return out if self.bias is None else out + self.bias

    def _operand_scales(
        self, x: torch.Tensor, w: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # The weight's scale, read off the parameter (scaled fp16 data or fp32 alike).
        weight_scale = value_rms_scale(self._parameters["weight"]).to(x.device)
        if self.operand_scales == "dynamic":
            return rms_scale(x), weight_scale
        one = torch.ones((), device=x.device)
        if self.operand_scales == "unit":
            return one, one
        source = self.input_scale_source
        x_scale = one if source is None else source().to(x.device)
        return x_scale, weight_scale

    def extra_repr(self) -> str:
        shape = full_shape(self.weight)  # whole, also while ZeRO-3 holds a partition of it
        k, n = shape if self.weight_is_in_out else shape[::-1]
        return f"in_features={k}, out_features={n}, bias={self.bias is not None}, fmt={self.fmt}"


def scalify_linears(
    model: torch.nn.Module, fmt: str = "float8", skip: tuple[str, ...] = (), **options: Any
) -> list[str]:
    """Replace every ``nn.Linear`` and ``Conv1D`` in ``model`` by a ScaledLinear, in place.

    Modules whose qualified name is in ``skip`` (e.g. ``"lm_head"``) stay as they are.
    ``options`` go to ScaledLinear (``operand_scales``, ``grad_rescale``). Returns the
    names replaced.
    """
    targets = [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear | Conv1D) and name not in skip
    ]
    for name, module in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, ScaledLinear.replacing(module, fmt, **options))
    return [name for name, _ in targets]


def requantize(t: torch.Tensor, fmt: str, backward: bool, rescale: bool) -> torch.Tensor:
    """``t`` rounded to format ``fmt`` (under a fresh RMS scale if ``rescale``), in its dtype."""
    if fmt == "fp32":
        return t
    data, scale = quantize(t, fmt, backward=backward, rescale=rescale)
    return (data.to(torch.float32) * scale).to(t.dtype)


class GradientRescale(torch.autograd.Function):
    """Identity forward; backward rounds the incoming gradient to ``fmt``'s gradient format.

    With ``rescale`` the gradient is divided by a fresh power-of-two RMS scale first (a
    Scalify dynamic-rescale point); without, it is cast as is, under- or overflowing.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, fmt: str, rescale: bool) -> torch.Tensor:
        ctx.fmt, ctx.rescale = fmt, rescale
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return requantize(grad, ctx.fmt, backward=True, rescale=ctx.rescale), None, None


class ScaledLayerNorm(torch.nn.Module):
    """A LayerNorm whose backward is a dynamic-rescale point, holding the original Parameters.

    Forward is the original ``F.layer_norm``: the normalised value has unit scale, so the
    output's scale is the mul rule's, the gain's power-of-two RMS (``output_scale``).
    Backward: the gradient LayerNorm hands back to the residual stream is stored in the
    gradient format (E5M2 for float8, else fp16 / bf16) under a fresh power-of-two RMS
    scale (Scalify's LayerNorm-backward rescale; scale 1 with ``rescale=False``).
    """

    def __init__(self, norm: torch.nn.LayerNorm, fmt: str, rescale: bool = True) -> None:
        super().__init__()
        if fmt not in MATMUL_FORMATS:
            raise ValueError(f"matmul format must be one of {MATMUL_FORMATS}, got {fmt!r}")
        self.weight, self.bias = norm.weight, norm.bias
        self.normalized_shape = norm.normalized_shape
        self.eps = norm.eps
        self.fmt, self.rescale = fmt, rescale

    def output_scale(self) -> torch.Tensor:
        """The propagated scale of the output: unit-scale normalised value times the gain."""
        return layer_norm_output_scale(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = GradientRescale.apply(x, self.fmt, self.rescale)
        return torch.nn.functional.layer_norm(
            x, self.normalized_shape, self.weight, self.bias, self.eps
        )

    def extra_repr(self) -> str:
        return f"{tuple(self.normalized_shape)}, eps={self.eps}, fmt={self.fmt}"


class ScaledRMSNorm(torch.nn.Module):
    """An RMSNorm (Llama's) whose backward is a dynamic-rescale point, holding the original gain.

    Forward is transformers' ``LlamaRMSNorm`` operation for operation: the input up-cast to
    fp32, divided by its root mean square (the reciprocal RMS is a reduction over the
    hidden units and runs unscaled in fp32, as LayerNorm's statistics do), cast back and
    multiplied by the gain. The normalised value has unit scale by construction, so the
    output's scale is the mul rule's: the gain's power-of-two RMS (``output_scale``), as
    for ``ScaledLayerNorm``. Backward rescales the gradient handed to the residual stream
    exactly as ``ScaledLayerNorm`` does (Scalify's normalisation-backward rescale).
    """

    def __init__(self, norm: torch.nn.Module, fmt: str, rescale: bool = True) -> None:
        super().__init__()
        if fmt not in MATMUL_FORMATS:
            raise ValueError(f"matmul format must be one of {MATMUL_FORMATS}, got {fmt!r}")
        self.weight = norm.weight
        self.eps = float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)))
        self.fmt, self.rescale = fmt, rescale

    def output_scale(self) -> torch.Tensor:
        """The propagated scale of the output: unit-scale normalised value times the gain."""
        return layer_norm_output_scale(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = GradientRescale.apply(x, self.fmt, self.rescale)
        dtype = x.dtype
        wide = x.to(torch.float32)
        wide = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * wide.to(dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}, fmt={self.fmt}"


def is_rms_norm(module: torch.nn.Module) -> bool:
    """Whether ``module`` is an RMSNorm with a gain (transformers' ``*RMSNorm`` or torch's)."""
    named = type(module).__name__.endswith("RMSNorm") and hasattr(module, "variance_epsilon")
    builtin = isinstance(module, torch.nn.RMSNorm) and module.weight is not None
    return (named or builtin) and isinstance(getattr(module, "weight", None), torch.nn.Parameter)


def layer_norm_output_scale(norm: torch.nn.Module) -> torch.Tensor:
    """Scale of a LayerNorm's output by the mul rule: its gain's power-of-two RMS (1 without)."""
    weight = getattr(norm, "weight", None)
    return torch.ones(()) if weight is None else value_rms_scale(weight)


def scalify_layer_norms(model: torch.nn.Module, fmt: str, rescale: bool = True) -> list[str]:
    """Replace every ``nn.LayerNorm`` by a ScaledLayerNorm and every RMSNorm (``is_rms_norm``)
    by a ScaledRMSNorm in ``model``, in place. Returns the names replaced."""
    targets = [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.LayerNorm) or is_rms_norm(module)
    ]
    for name, module in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        scaled_class = ScaledLayerNorm if isinstance(module, torch.nn.LayerNorm) else ScaledRMSNorm
        setattr(parent, child, scaled_class(module, fmt, rescale))
    return [name for name, _ in targets]


GRADIENT_STORAGE = {"fp32": "fp32", "bf16": "bf16", "fp16": "fp16", "float8": "fp16"}


def rescale_parameter_gradients(
    model: torch.nn.Module, fmt: str, rescale: bool = True
) -> list[torch.utils.hooks.RemovableHandle]:
    """Round each parameter's gradient to its storage format as backward produces it.

    The storage format is ``GRADIENT_STORAGE[fmt]``: scaled fp16 for float8 and fp16
    matmuls, bf16 for bf16 (weight gradients in float8 E5M2 would lose too much for the
    optimizer). With ``rescale`` each gradient gets a fresh power-of-two RMS scale (the
    Scalify gradient rescale point); without, it is cast as is and small gradients
    flush to zero. Hooks run per backward pass, so accumulated micro-batches each round.
    """
    storage = GRADIENT_STORAGE[fmt]
    if storage == "fp32":
        return []
    seen: set[int] = set()
    handles = []
    for param in model.parameters():
        if id(param) in seen or not param.requires_grad:
            continue
        seen.add(id(param))
        handles.append(
            param.register_hook(
                lambda g, storage=storage: requantize(g, storage, backward=False, rescale=rescale)
            )
        )
    return handles
