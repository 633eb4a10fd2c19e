"""The Collage8bitAdamW step as one Triton kernel, with the arithmetic of the C kernel.

One program takes ``ROWS`` whole blocks of ``QBLOCK`` elements (the quantisation blocks,
256 by default: a power of two, as ``tl.arange`` needs), reads every input once, runs
``eight_bit_kernel.c``'s arithmetic (``Collage8bitAdamW``'s eager step) and writes the
new state once; with EDQ tracked it stores its six partial sums. The bitwise contract is
the C kernel's and the Collage Triton kernel's (``triton_kernel``): separate IEEE fp32
operations, ``div_rn`` and ``sqrt_rn``, bf16 roundings to nearest even (on the bits
under Triton's CPU interpreter, whose casts truncate: ``R``), the same search tables
(``eight_bit_kernel.search_tables``) and the same 32-bit hash. Checked against the eager
step in the interpreter (tests/optim/triton_interpreted_8bit.py); not yet run on a GPU.

Details: docs/strategies.md, "The fused `collage_8bit` step (`optim.kernel`)".
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from collage_train.optim import rounding_noise
from collage_train.optim.collage.eight_bit_kernel import SCALARS, search_tables
from collage_train.optim.collage.step_math import StepScalars
from collage_train.optim.collage.triton_kernel import _grow, _rn

ROWS = 8  # quantisation blocks per program
NUM_WARPS = 8
_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"
_TINY = 1e-38  # blockwise8._scaled's clamp (an fp32 subnormal)


@triton.jit
def _mix32(x):
    """lowbias32 on int64 values in [0, 2^32), masked back to 32 bits after each product
    (rounding_noise._mix32_tensor's arithmetic)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


@triton.jit
def _cell(x):
    """The search-table cell of x (eight_bit_kernel.c's cell_of)."""
    u = x.to(tl.int32, bitcast=True)
    row = tl.minimum(tl.maximum(((u >> 23) & 0xFF) - 103, 0), 24)
    return (((u >> 31) & 1) * 25 + row) * 128 + ((u >> 16) & 0x7F)


@triton.jit
def _eight_bit_kernel(
    theta_ptr,
    dtheta_ptr,
    g_ptr,
    mq_ptr,
    m_absmax_ptr,
    vq_ptr,
    v_absmax_ptr,
    m_mid_ptr,
    m_code_ptr,
    v_code_ptr,
    cells_ptr,
    partials_ptr,
    keep_ptr,
    n,
    key1,
    key2,
    one_minus_beta1,
    beta2,
    one_minus_beta2,
    inv_sqrt_bias2,
    eps,
    step_size,
    decay,
    tiny,
    QBLOCK: tl.constexpr,
    ROWS: tl.constexpr,
    TRACK: tl.constexpr,
    GATED: tl.constexpr,
    R: tl.constexpr,
):
    pid = tl.program_id(0)
    blocks = pid.to(tl.int64) * ROWS + tl.arange(0, ROWS)
    offsets = blocks[:, None] * QBLOCK + tl.arange(0, QBLOCK)[None, :]
    mask = offsets < n
    block_mask = blocks * QBLOCK < n
    if GATED:  # a False *keep_ptr (the step guard's verdict): read all, write nothing
        keep = tl.zeros([ROWS], tl.int32) + tl.load(keep_ptr).to(tl.int32)
        block_written = block_mask & (keep != 0)
        written = mask & block_written[:, None]
    else:
        block_written, written = block_mask, mask
    g = tl.load(g_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    m_codes = tl.load(mq_ptr + offsets, mask=mask, other=0).to(tl.int32)
    v_codes = tl.load(vq_ptr + offsets, mask=mask, other=0).to(tl.int32)
    m_scale = tl.load(m_absmax_ptr + blocks, mask=block_mask, other=0.0)
    v_scale = tl.load(v_absmax_ptr + blocks, mask=block_mask, other=0.0)
    m = tl.load(m_code_ptr + m_codes) * m_scale[:, None]
    v = tl.load(v_code_ptr + v_codes) * v_scale[:, None]
    m = m + one_minus_beta1 * (g - m)
    v = v * beta2 + one_minus_beta2 * (g * g)
    denom = tl.sqrt_rn(v) * inv_sqrt_bias2 + eps
    theta = tl.load(theta_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    dtheta = tl.load(dtheta_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    update = _rn(tl.div_rn(m, denom) * step_size + decay * theta, R)
    new_theta, new_dtheta = _grow(theta, dtheta, update, R)
    tl.store(theta_ptr + offsets, new_theta.to(tl.bfloat16), mask=written)
    tl.store(dtheta_ptr + offsets, new_dtheta.to(tl.bfloat16), mask=written)

    # blockwise8._scaled: a whole block scales by the reciprocal of max(absmax, tiny) and
    # keeps its absmax; a shorter (last) block divides by max(absmax, tiny) and keeps that
    whole = tl.sum(mask.to(tl.int32), axis=1) == QBLOCK
    m_max = tl.max(tl.where(mask, tl.abs(m), 0.0), axis=1)
    v_max = tl.max(tl.where(mask, tl.abs(v), 0.0), axis=1)
    m_div, v_div = tl.maximum(m_max, tiny), tl.maximum(v_max, tiny)
    tl.store(m_absmax_ptr + blocks, tl.where(whole, m_max, m_div), mask=block_written)
    tl.store(v_absmax_ptr + blocks, tl.where(whole, v_max, v_div), mask=block_written)
    one = tl.full([ROWS], 1.0, tl.float32)
    m_rcp, v_rcp = tl.div_rn(one, m_div), tl.div_rn(one, v_div)
    xm = tl.where(whole[:, None], m * m_rcp[:, None], tl.div_rn(m, m_div[:, None]))
    xm = tl.minimum(tl.maximum(xm, -1.0), 1.0)
    xv = tl.where(whole[:, None], v * v_rcp[:, None], tl.div_rn(v, v_div[:, None]))
    xv = tl.minimum(xv, 1.0)  # v >= +0

    # m: the nearest code (ties to the lower); cells hold the least count per bf16 interval
    k = tl.load(cells_ptr + _cell(xm)) & 0xFF
    k += (tl.load(m_mid_ptr + k) < xm).to(tl.int32)
    tl.store(mq_ptr + offsets, k.to(tl.uint8), mask=written)
    # v: between codes c_k <= x <= c_k+1, up with probability (x - c_k) / (c_k+1 - c_k)
    k = (tl.load(cells_ptr + _cell(xv)) >> 8) & 0xFF
    k += (tl.load(v_code_ptr + k) <= xv).to(tl.int32)
    below = tl.minimum(tl.maximum(k - 1, 0), 254)
    low, high = tl.load(v_code_ptr + below), tl.load(v_code_ptr + below + 1)
    index = offsets & 0xFFFFFFFF  # the element's index modulo 2^32
    bits = _mix32(_mix32(index ^ key1.to(tl.int64)) ^ key2.to(tl.int64))
    noise = (bits >> 8).to(tl.float32) * 5.9604644775390625e-08  # 2^-24
    index = below + (noise < tl.div_rn(xv - low, high - low)).to(tl.int32)
    index = tl.where((index == 0) & (xv > 0.0), 1, index)  # a positive v is never 0
    tl.store(vq_ptr + offsets, index.to(tl.uint8), mask=written)

    if TRACK:  # this program's partial sums, in the order of metrics.edq.FIELDS
        update = tl.where(written, update, 0.0)
        realised = tl.where(written, new_theta - theta, 0.0)
        low_part = tl.where(written, new_dtheta, 0.0)
        moved = update != 0.0
        row = partials_ptr + pid * 6
        tl.store(row, tl.sum(tl.sum(realised * update, axis=1), axis=0))
        tl.store(row + 1, tl.sum(tl.sum(update * update, axis=1), axis=0))
        tl.store(row + 2, tl.sum(tl.sum(moved.to(tl.float32), axis=1), axis=0))
        both = (moved & (realised == 0.0)).to(tl.float32)
        tl.store(row + 3, tl.sum(tl.sum(both, axis=1), axis=0))
        tl.store(row + 4, tl.sum(tl.sum(low_part * low_part, axis=1), axis=0))
        tl.store(row + 5, tl.sum(tl.sum(low_part * update, axis=1), axis=0))


def _device_tables(device: torch.device) -> dict[str, torch.Tensor]:
    return {name: t.to(device) for name, t in search_tables().items()}


def triton_eight_bit_step(
    theta: torch.Tensor,
    dtheta: torch.Tensor,
    grad: torch.Tensor,
    m_codes: torch.Tensor,
    m_absmax: torch.Tensor,
    v_codes: torch.Tensor,
    v_absmax: torch.Tensor,
    scalars: StepScalars,
    *,
    block_size: int,
    seed: int,
    stream: int,
    step: int,
    track: bool,
    mask: torch.Tensor | None = None,
    bit_rounding: bool = _INTERPRETED,
) -> torch.Tensor | None:
    """One fused step of a whole flat tensor, in place (contiguous tensors on one device).

    ``scalars`` as ``eight_bit_kernel.eight_bit_step``'s; ``block_size`` a power of two.
    Returns the six EDQ partial sums (fp32) when ``track``, else None. ``mask``: the 0-d
    bool ``TrackingOptimizer.step_mask``, read by the kernel (False: nothing written).
    """
    if block_size & (block_size - 1):
        raise ValueError(f"the Triton 8-bit kernel takes power-of-two blocks, not {block_size}")
    n = theta.numel()
    programs = max(1, triton.cdiv(n, ROWS * block_size))
    tables = _device_tables(theta.device)
    key1, key2 = rounding_noise.stream_keys(seed, stream, step)
    partials = torch.zeros((programs, 6), dtype=torch.float32, device=theta.device)
    if n:
        _eight_bit_kernel[(programs,)](
            theta,
            dtheta,
            grad,
            m_codes,
            m_absmax,
            v_codes,
            v_absmax,
            tables["m_mid"],
            tables["m_code"],
            tables["v_code"],
            tables["cells"],
            partials,
            mask if mask is not None else partials,
            n,
            key1,
            key2,
            *scalars.pick(SCALARS),
            _TINY,
            QBLOCK=block_size,
            ROWS=ROWS,
            TRACK=track,
            GATED=mask is not None,
            R=bit_rounding,
            num_warps=NUM_WARPS,
            enable_fp_fusion=False,
        )
    return partials.sum(dim=0) if track else None
