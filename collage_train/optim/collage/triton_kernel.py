"""The Collage step as one hand-written Triton kernel for CUDA tensors.

One program reads a block of each input once (theta, dtheta, m, v, dv, g: bf16), runs
``step_math.collage_tensor_step``'s arithmetic with every bf16 rounding written out,
writes the new state once, and, when EDQ is tracked, stores the block's six partial
sums (``metrics.edq.FIELDS``) beside it; a deterministic sum over the blocks finishes
them. Bitwise parity with the eager CUDA reference: separate IEEE fp32 operations
(``enable_fp_fusion=False``), correctly rounded ``div_rn``/``sqrt_rn``, and bf16
conversions to nearest even (on the bits under ``TRITON_INTERPRET=1``, whose casts
truncate), checked on CPU by tests/optim/triton_interpreted.py and
tests/optim/test_triton_ptx.py, on a GPU by tests/optim/test_fused_optimizer.py.

Why these choices: docs/strategies.md, "The fused Collage step: CPU and Triton kernels".
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from collage_train.optim.collage.step_math import StepScalars

_MODES = {"none": 0, "light": 1, "plus": 2}
BLOCK = 2048
NUM_WARPS = 8
# Triton's CPU interpreter (tests without a GPU) needs the bitwise rounding of ``_rn``.
_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _rn(x, BIT_RNE: tl.constexpr):
    """Round an fp32 value to bf16 (nearest even) and widen it back.

    On a GPU the conversion instruction rounds to nearest even. Triton's CPU
    interpreter truncates, so there (``BIT_RNE``) the rounding is done on the bits:
    add 0x7FFF plus the lowest kept bit, clear the low 16 bits (exact for finite values).
    """
    if BIT_RNE:
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & -65536
        return bits.to(tl.float32, bitcast=True)
    return x.to(tl.bfloat16).to(tl.float32)


@triton.jit
def _two_sum(a, b, R: tl.constexpr):
    s = _rn(a + b, R)
    a_approx = _rn(s - b, R)
    b_approx = _rn(s - a_approx, R)
    return s, _rn(_rn(a - a_approx, R) + _rn(b - b_approx, R), R)


@triton.jit
def _fast_two_sum(a, b, R: tl.constexpr):
    s = _rn(a + b, R)
    return s, _rn(b - _rn(s - a, R), R)


@triton.jit
def _grow(x, dx, a, R: tl.constexpr):
    s, e = _two_sum(x, a, R)
    return _fast_two_sum(s, _rn(dx + e, R), R)


@triton.jit
def _collage_step_kernel(
    theta_ptr,
    dtheta_ptr,
    m_ptr,
    v_ptr,
    dv_ptr,
    g_ptr,
    update_ptr,
    partials_ptr,
    keep_ptr,
    n,
    one_minus_beta1,
    beta2,
    beta2_hi,
    beta2_lo,
    one_minus_beta2,
    inv_sqrt_bias2,
    eps,
    step_size,
    decay,
    MODE: tl.constexpr,
    TRACK: tl.constexpr,
    WRITE_UPDATE: tl.constexpr,
    GATED: tl.constexpr,
    BLOCK: tl.constexpr,
    R: tl.constexpr,
):
    pid = tl.program_id(0)
    offsets = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    if GATED:  # a False *keep_ptr (the step guard's verdict): read all, write nothing
        keep = tl.zeros([BLOCK], tl.int32) + tl.load(keep_ptr).to(tl.int32)  # a block of it
        written = mask & (keep != 0)
    else:
        written = mask
    theta = tl.load(theta_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    m = tl.load(m_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + offsets, mask=mask, other=0.0).to(tl.float32)

    m = _rn(m + one_minus_beta1 * (g - m), R)
    square = g * g
    if MODE == 2:  # (v, dv) <- Mul((v, dv), (beta2_hi, beta2_lo)), then Grow
        dv = tl.load(dv_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        exact = v * beta2_hi
        p = _rn(exact, R)
        e = _rn(exact - p, R)
        d = _rn(_rn(_rn(dv * beta2_hi, R) + _rn(v * beta2_lo, R), R) + e, R)
        v, dv = _fast_two_sum(p, d, R)
        v, dv = _grow(v, dv, _rn(_rn(square, R) * one_minus_beta2, R), R)
        tl.store(dv_ptr + offsets, dv.to(tl.bfloat16), mask=written)
    else:
        v = _rn(_rn(v * beta2, R) + one_minus_beta2 * square, R)
    denom = _rn(tl.sqrt_rn(v), R)
    denom = _rn(_rn(denom * inv_sqrt_bias2, R) + eps, R)
    update = _rn(_rn(tl.div_rn(m, denom), R) * step_size, R)
    update = _rn(update + decay * theta, R)
    if MODE == 0:
        new_theta = _rn(theta + update, R)
    else:
        dtheta = tl.load(dtheta_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        new_theta, dtheta = _grow(theta, dtheta, update, R)
        tl.store(dtheta_ptr + offsets, dtheta.to(tl.bfloat16), mask=written)
    tl.store(m_ptr + offsets, m.to(tl.bfloat16), mask=written)
    tl.store(v_ptr + offsets, v.to(tl.bfloat16), mask=written)
    tl.store(theta_ptr + offsets, new_theta.to(tl.bfloat16), mask=written)
    if WRITE_UPDATE:  # zero where a False keep leaves everything as it was
        tl.store(update_ptr + offsets, tl.where(written, update, 0.0).to(tl.bfloat16), mask=mask)
    if TRACK:  # this block's partial sums, in the order of metrics.edq.FIELDS
        update = tl.where(written, update, 0.0)
        realised = tl.where(written, new_theta - theta, 0.0)
        moved = update != 0.0
        row = partials_ptr + pid * 6
        tl.store(row, tl.sum(realised * update, axis=0))
        tl.store(row + 1, tl.sum(update * update, axis=0))
        tl.store(row + 2, tl.sum(moved.to(tl.float32), axis=0))
        tl.store(row + 3, tl.sum((moved & (realised == 0.0)).to(tl.float32), axis=0))
        if MODE == 0:
            tl.store(row + 4, 0.0)
            tl.store(row + 5, 0.0)
        else:
            low = tl.where(written, dtheta, 0.0)
            tl.store(row + 4, tl.sum(low * low, axis=0))
            tl.store(row + 5, tl.sum(low * update, axis=0))


def triton_tensor_step(
    mode: str, block: int = BLOCK, num_warps: int = NUM_WARPS, bit_rounding: bool = _INTERPRETED
) -> Callable[..., torch.Tensor | None]:
    """A drop-in for ``step_math.compiled_tensor_step(mode)`` on contiguous CUDA tensors.

    Same positional tensors and ``StepScalars``, ``track``/``return_update``/``mask`` as keywords
    (``mask``: the 0-d bool ``TrackingOptimizer.step_mask``, read by the kernel); returns
    the six EDQ partial sums (fp32, on the device) or the intended update. ``block``,
    ``num_warps`` and ``bit_rounding`` (round on the bits instead of the conversion
    instruction) exist for scripts/tune_collage_triton.py; all variants are bitwise equal.
    """
    mode_id = _MODES[mode]

    def step(
        theta: torch.Tensor,
        dtheta: torch.Tensor | None,
        exp_avg: torch.Tensor,
        exp_avg_sq: torch.Tensor,
        dv: torch.Tensor | None,
        grad: torch.Tensor,
        scalars: StepScalars,
        *,
        track: bool,
        return_update: bool,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        n = theta.numel()
        blocks = triton.cdiv(n, block)
        write_update = track and return_update
        update = torch.empty_like(theta) if write_update else theta
        partials = torch.empty(
            (blocks if track and not return_update else 1, 6),
            dtype=torch.float32,
            device=theta.device,
        )
        _collage_step_kernel[(blocks,)](
            theta,
            dtheta if dtheta is not None else theta,
            exp_avg,
            exp_avg_sq,
            dv if dv is not None else theta,
            grad,
            update,
            partials,
            mask if mask is not None else partials,
            n,
            **vars(scalars),  # the kernel's scalar arguments, by name
            MODE=mode_id,
            TRACK=track and not return_update,
            WRITE_UPDATE=write_update,
            GATED=mask is not None,
            BLOCK=block,
            R=bit_rounding,
            num_warps=num_warps,
            enable_fp_fusion=False,
        )
        if write_update:
            return update
        return partials.sum(dim=0) if track else None

    return step
