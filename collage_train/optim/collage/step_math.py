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
``return_update``, the intended update itself, for callers that split the sums). Its
host numbers are one ``StepScalars``, which the C and Triton kernels (and the 8-bit
step's) take as they are.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch

from collage_train.metrics.edq import edq_partials
from collage_train.optim.base import bias_corrections, commit_
from collage_train.optim.collage import mcf

_BF16 = torch.bfloat16


def _fl(x: torch.Tensor) -> torch.Tensor:
    return x.to(_BF16)


@dataclasses.dataclass(frozen=True)
class StepScalars:
    """The host numbers of one Collage step of one tensor, Python floats (float64) that
    each backend rounds to fp32 where it uses them: the eager ``collage_tensor_step``,
    the C kernels' ``scalars_t`` and the Triton kernels' arguments (same names)."""

    one_minus_beta1: float
    beta2: float
    beta2_hi: float  # bf16(beta2)
    beta2_lo: float  # bf16(beta2 - beta2_hi), the remainder taken in float64
    one_minus_beta2: float  # in float64
    inv_sqrt_bias2: float  # fp32(1) / fp32(sqrt(1 - beta2^t))
    eps: float
    step_size: float  # -lr / (1 - beta1^t)
    decay: float  # -lr * wd

    @classmethod
    def of(cls, group: dict[str, Any], step: int) -> StepScalars:
        """The scalars of integer step ``step`` of a param group (lr, betas, eps, wd)."""
        beta1, beta2 = group["betas"]
        return step_scalars(group["lr"], beta1, beta2, group["eps"], group["weight_decay"], step)

    def pick(self, names: tuple[str, ...]) -> tuple[float, ...]:
        """The values of ``names``, in that order (a C struct's fields, say)."""
        return tuple(getattr(self, name) for name in names)


@functools.lru_cache(maxsize=64)
def _fp32_reciprocal(value: float) -> float:
    """fp32(1) / fp32(value), one IEEE fp32 division (cached: every parameter of a step
    asks for the same value)."""
    return float(torch.tensor(1.0, dtype=torch.float32) / torch.tensor(value, dtype=torch.float32))


def step_scalars(
    lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, step: int
) -> StepScalars:
    """The ``StepScalars`` of integer step ``step``.

    The bias corrections come from the integer step in float64 (never a bf16 counter)
    and beta2's bf16 remainder from ``mcf.split_constant`` (float64); the reciprocal of
    sqrt(1 - beta2^t) is one fp32 division of fp32 values, as a CUDA kernel would do it.
    """
    beta2_hi, beta2_lo = mcf.split_constant(beta2)
    bias1, sqrt_bias2 = bias_corrections(beta1, beta2, step)
    return StepScalars(
        one_minus_beta1=1.0 - beta1,
        beta2=beta2,
        beta2_hi=beta2_hi,
        beta2_lo=beta2_lo,
        one_minus_beta2=1.0 - beta2,
        inv_sqrt_bias2=_fp32_reciprocal(sqrt_bias2),
        eps=eps,
        step_size=-lr / bias1,
        decay=-lr * weight_decay,
    )


def collage_tensor_step(
    theta: torch.Tensor,
    dtheta: torch.Tensor | None,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    dv: torch.Tensor | None,
    grad: torch.Tensor,
    s: StepScalars,
    mode: str,
    track: bool,
    return_update: bool = False,
    mask: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """One step of one tensor with the host numbers ``s``.

    ``mask`` (``TrackingOptimizer.step_mask``), where it holds False, leaves every tensor
    as it was and makes the partial sums (or the returned update) zero.

    The bias correction of the denominator is a multiplication by ``s.inv_sqrt_bias2``,
    the fp32 reciprocal of sqrt(1 - beta2^t), written out so that every device computes
    the same thing (CUDA's eager division by a scalar multiplies by the reciprocal, the
    CPU's divides).
    """
    g = grad.float()
    m = _fl(exp_avg.float() + s.one_minus_beta1 * (g - exp_avg.float()))
    square = g * g  # exact in fp32
    if mode == "plus":
        v, dv_new = mcf.mul(exp_avg_sq, dv, s.beta2_hi, s.beta2_lo)
        v, dv_new = mcf.grow(v, dv_new, _fl(_fl(square).float() * s.one_minus_beta2))
    else:
        v = _fl(_fl(exp_avg_sq.float() * s.beta2).float() + s.one_minus_beta2 * square)
        dv_new = None
    denom = _fl(torch.sqrt(v.float()))
    denom = _fl(_fl(denom.float() * s.inv_sqrt_bias2).float() + s.eps)
    update = _fl(_fl(m.float() / denom.float()).float() * s.step_size)
    update = _fl(update.float() + s.decay * theta.float())
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

    Takes 1-D contiguous tensors (any length: shapes are dynamic) and the
    ``StepScalars``, with ``track``, ``return_update`` and ``mask`` as keywords.
    """
    if mode not in _compiled:
        _compiled[mode] = torch.compile(
            _ENTRY_POINTS[mode],
            dynamic=True,
            fullgraph=True,
            options={"emulate_precision_casts": True},
        )
    return _compiled[mode]
