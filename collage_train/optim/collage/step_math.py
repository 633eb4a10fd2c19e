"""The elementwise math of one CollageAdamW step on one tensor, every rounding explicit.

Each arithmetic step is written as fp32 arithmetic on widened bf16 values followed by
an explicit rounding to bf16 (``_fl``): exactly what a bf16 PyTorch kernel does, but
spelt out, so that TorchInductor (with ``emulate_precision_casts``) compiles it into one
fused kernel that is bitwise identical to running the same function eagerly. Eager
bf16 kernels with scalar arguments do not have this property (``lerp`` rounds its
weight to bf16 first, ``add(alpha=)`` differs), which is why the update is not written
with them.

``collage_tensor_step`` updates its state tensors in place and, when ``track`` is set,
returns the six effective-descent partial sums of ``metrics.edq.FIELDS`` (or, with
``return_update``, the intended update itself, for callers that split the sums).
"""

from __future__ import annotations

import functools
import math

import torch

from collage_train.metrics.edq import edq_partials
from collage_train.optim.base import commit_
from collage_train.optim.collage import mcf

_BF16 = torch.bfloat16


def _fl(x: torch.Tensor) -> torch.Tensor:
    return x.to(_BF16)


def collage_tensor_step(
    theta: torch.Tensor,
    dtheta: torch.Tensor | None,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    dv: torch.Tensor | None,
    grad: torch.Tensor,
    one_minus_beta1: float,
    beta2: float,
    beta2_hi: float,
    beta2_lo: float,
    inv_sqrt_bias2: float,
    eps: float,
    step_size: float,
    decay: float,
    mode: str,
    track: bool,
    return_update: bool = False,
    mask: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """One step of one tensor; ``step_size = -lr / (1 - beta1^t)``, ``decay = -lr * wd``.

    ``mask`` (``TrackingOptimizer.step_mask``), where it holds False, leaves every tensor
    as it was and makes the partial sums (or the returned update) zero.

    ``inv_sqrt_bias2`` is the fp32 reciprocal of sqrt(1 - beta2^t) (``step_scalars``):
    the bias correction of the denominator is a multiplication by it, written out so
    that every device computes the same thing (CUDA's eager division by a scalar
    multiplies by the reciprocal, the CPU's divides).
    """
    g = grad.float()
    m = _fl(exp_avg.float() + one_minus_beta1 * (g - exp_avg.float()))
    square = g * g  # exact in fp32
    if mode == "plus":
        v, dv_new = mcf.mul(exp_avg_sq, dv, beta2_hi, beta2_lo)
        v, dv_new = mcf.grow(v, dv_new, _fl(_fl(square).float() * (1.0 - beta2)))
    else:
        v = _fl(_fl(exp_avg_sq.float() * beta2).float() + (1.0 - beta2) * square)
        dv_new = None
    denom = _fl(torch.sqrt(v.float()))
    denom = _fl(_fl(denom.float() * inv_sqrt_bias2).float() + eps)
    update = _fl(_fl(m.float() / denom.float()).float() * step_size)
    update = _fl(update.float() + decay * theta.float())
    if mode == "none":
        new_theta, new_dtheta = _fl(theta.float() + update.float()), None
    else:
        new_theta, new_dtheta = mcf.grow(theta, dtheta, update)

    result = None
    if track and return_update:
        result = update
    elif track:
        result = edq_partials(theta, new_theta, update, new_dtheta)
    if result is not None and mask is not None:
        result = torch.where(mask, result, 0.0)
    commit_(exp_avg, m, mask)
    commit_(exp_avg_sq, v, mask)
    if dv_new is not None:
        commit_(dv, dv_new, mask)
    if new_dtheta is not None:
        commit_(dtheta, new_dtheta, mask)
    commit_(theta, new_theta, mask)
    return result


@functools.lru_cache(maxsize=64)
def _inv_sqrt_bias2(beta2: float, step: int) -> float:
    """fp32(1) / fp32(sqrt(1 - beta2^step)), one IEEE fp32 division (cached: every
    parameter of a step asks for the same value)."""
    sqrt_bias2 = torch.tensor(math.sqrt(1.0 - beta2**step), dtype=torch.float32)
    return float(torch.tensor(1.0, dtype=torch.float32) / sqrt_bias2)


def step_scalars(
    lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, step: int
) -> tuple[float, ...]:
    """The positional scalars of ``collage_tensor_step`` for integer step ``step``.

    The bias corrections come from the integer step in float64 (never a bf16 counter)
    and beta2's bf16 remainder from ``mcf.split_constant`` (float64); the reciprocal of
    sqrt(1 - beta2^t) is one fp32 division of fp32 values, as a CUDA kernel would do it.
    """
    beta2_hi, beta2_lo = mcf.split_constant(beta2)
    return (
        1.0 - beta1,
        beta2,
        beta2_hi,
        beta2_lo,
        _inv_sqrt_bias2(beta2, step),
        eps,
        -lr / (1.0 - beta1**step),
        -lr * weight_decay,
    )


# One entry point per mode, so that each compiles (and counts recompilations) on its
# own: within one, only ``track``/``return_update`` vary (three graphs at most).
def _none_step(
    *args: object, track: bool, return_update: bool, mask: torch.Tensor | None = None
) -> torch.Tensor | None:
    return collage_tensor_step(
        *args, mode="none", track=track, return_update=return_update, mask=mask
    )


def _light_step(
    *args: object, track: bool, return_update: bool, mask: torch.Tensor | None = None
) -> torch.Tensor | None:
    return collage_tensor_step(
        *args, mode="light", track=track, return_update=return_update, mask=mask
    )


def _plus_step(
    *args: object, track: bool, return_update: bool, mask: torch.Tensor | None = None
) -> torch.Tensor | None:
    return collage_tensor_step(
        *args, mode="plus", track=track, return_update=return_update, mask=mask
    )


_ENTRY_POINTS = {"none": _none_step, "light": _light_step, "plus": _plus_step}
_compiled: dict[str, object] = {}

# Below this many elements TorchInductor's step is not used: compiling buys nothing
# there, and sizes 0 and 1 would each cost a specialised recompilation.
MIN_COMPILED_NUMEL = 64


def compiled_tensor_step(mode: str):
    """``collage_tensor_step`` for ``mode`` compiled by TorchInductor into one fused kernel.

    Takes 1-D contiguous tensors (any length: shapes are dynamic) and the same
    positional scalars, with ``track``, ``return_update`` and ``mask`` as keywords.
    """
    if mode not in _compiled:
        _compiled[mode] = torch.compile(
            _ENTRY_POINTS[mode],
            dynamic=True,
            fullgraph=True,
            options={"emulate_precision_casts": True},
        )
    return _compiled[mode]


def fused_tensor_step(mode: str, device_type: str):
    """The one-pass step of ``mode`` for tensors on ``device_type``.

    CUDA runs the hand-written Triton kernel (``triton_kernel``), the CPU the C kernel
    (``cpu_kernel``), other devices the TorchInductor compilation of
    ``collage_tensor_step``. Same arguments as ``compiled_tensor_step``.
    """
    if device_type == "cuda":
        from collage_train.optim.collage.triton_kernel import triton_tensor_step

        return triton_tensor_step(mode)
    if device_type == "cpu":
        from collage_train.optim.collage.cpu_kernel import cpu_tensor_step

        return cpu_tensor_step(mode)
    return compiled_tensor_step(mode)


def min_fused_numel(device_type: str) -> int:
    """Tensors smaller than this are stepped eagerly (compiling for them would not pay)."""
    return 1 if device_type in ("cuda", "cpu") else MIN_COMPILED_NUMEL
