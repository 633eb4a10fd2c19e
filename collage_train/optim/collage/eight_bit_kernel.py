"""The fused Collage8bitAdamW step on CPU: a small C kernel, built once per machine.

``eight_bit_kernel.c`` does one pass over each block of 256 elements with the arithmetic
of ``Collage8bitAdamW``'s eager step, bitwise: dequantise both moments, update them, form
the bf16 update, grow (theta, dtheta), then quantise the block with its new absmax (m to
the nearest code, v stochastically with the bits of ``rounding_noise``). It is built and
cached like the Collage kernel (``cpu_kernel.build_library``) and loaded with ctypes.
``search_tables`` builds (and checks) the tables its nearest-code searches use. Tensors
are split over ``torch.get_num_threads()`` threads at block boundaries; each range
returns its own EDQ sums, added in range order (results do not depend on timing).

How the search works and why one comparison is enough: docs/strategies.md,
'The fused `collage_8bit` step (`optim.kernel`)'.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from collage_train.optim import rounding_noise
from collage_train.optim.blockwise8 import _midpoints, dynamic_map
from collage_train.optim.collage.cpu_kernel import _pool, build_library
from collage_train.optim.collage.step_math import StepScalars

_SOURCE = "eight_bit_kernel.c"
MAX_BLOCK = 4096  # the kernel's block-local buffers (eight_bit_kernel.c)
# The search tables: one cell per (sign, row, 7 mantissa bits), a row per exponent from
# _CELL_EXP0 to 127 and one (row 0) for every smaller magnitude (eight_bit_kernel.c).
_CELL_ROWS, _CELL_EXP0 = 25, 104
_SPLIT_MIN_NUMEL = 1 << 16  # below this, one thread (a hand-off costs tens of us)


# The ``StepScalars`` fields the 8-bit step takes, in the order of eight_bit_kernel.c's
# ``scalars_t`` and of the Triton 8-bit kernel's arguments
SCALARS = (
    "one_minus_beta1",
    "beta2",
    "one_minus_beta2",
    "inv_sqrt_bias2",
    "eps",
    "step_size",
    "decay",
)


class _Scalars(ctypes.Structure):
    _fields_ = [(name, ctypes.c_float) for name in SCALARS]


class _Maps(ctypes.Structure):
    _fields_ = [(name, ctypes.c_void_p) for name in ("m_code", "m_mid", "v_code", "cells")]


def _cell_bounds() -> tuple[torch.Tensor, torch.Tensor]:
    """The least and the greatest fp32 value of each cell, in the kernel's cell order."""
    sign = torch.arange(2).view(2, 1, 1)
    row = torch.arange(_CELL_ROWS).view(1, -1, 1)
    mantissa = torch.arange(128).view(1, 1, -1)
    exponent = torch.where(row > 0, row + _CELL_EXP0 - 1, 0)
    top = (sign << 31) | (exponent << 23) | (mantissa << 16)
    # row 0 holds every exponent below _CELL_EXP0: up to the last value below 2^-23
    span = torch.where(row > 0, 0xFFFF, ((_CELL_EXP0 - 1) << 23) | 0x7FFFFF).expand_as(top)
    ends = torch.stack([top, top | span]).reshape(2, -1).to(torch.int32)
    if (ends.view(torch.float32).abs() > 2.0).any():
        raise AssertionError("a search-table cell lies outside the scaled values' range")
    values = ends.view(torch.float32)
    return values.amin(dim=0), values.amax(dim=0)


@functools.cache
def search_tables() -> dict[str, torch.Tensor]:
    """The kernel's maps and search tables (CPU tensors, kept alive by the cache).

    ``cells`` (int32, one per cell): in bits 0-7 the least number of the signed map's
    midpoints below a value of the cell (torch.bucketize's count: ties go to the lower
    code), in bits 8-15 the least number of unsigned codes at or below it, capped at 255.
    Raises AssertionError if some cell's count varies by more than one (one comparison
    would not settle it).
    """
    least, greatest = _cell_bounds()
    least, greatest = least.clamp(-1, 1), greatest.clamp(-1, 1)  # x is clamped first
    m_mid = _midpoints(True, "cpu")
    v_code = dynamic_map(False)
    m_lo, m_hi = (torch.bucketize(x, m_mid) for x in (least, greatest))
    v_lo, v_hi = (torch.searchsorted(v_code, x, right=True) for x in (least, greatest))
    if (m_hi - m_lo > 1).any() or (v_hi - v_lo > 1).any():
        raise AssertionError("a search-table cell spans more than one map value")
    inf = torch.tensor([float("inf")])
    return {
        "m_code": dynamic_map(True).clone(),
        "m_mid": torch.cat([m_mid, inf]),
        "v_code": torch.cat([v_code, inf]),
        "cells": (m_lo | (v_lo.clamp(max=255) << 8)).to(torch.int32),
    }


@functools.cache
def load_library() -> ctypes.CDLL:
    """Build (once per machine) and load the kernel; KernelBuildError when that fails."""
    library = build_library(_SOURCE)
    library.collage8_step.restype = None
    library.collage8_step.argtypes = [
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.c_int,
        ctypes.c_int64,
        ctypes.c_uint32,
        ctypes.c_uint32,
        *[ctypes.c_void_p] * 7,
        ctypes.POINTER(_Scalars),
        ctypes.POINTER(_Maps),
        ctypes.c_int64,
        ctypes.POINTER(ctypes.c_int64),
        ctypes.POINTER(ctypes.c_double),
        ctypes.c_void_p,
    ]
    library.collage8_search.restype = None
    library.collage8_search.argtypes = [
        ctypes.c_int64,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.POINTER(_Maps),
        ctypes.c_void_p,
        ctypes.c_void_p,
    ]
    return library


@functools.cache
def _maps_and_tables() -> tuple[_Maps, dict[str, torch.Tensor]]:
    """The kernel's view of ``search_tables`` and the tensors it points into (held here, so
    that they live as long as the pointers, whatever becomes of search_tables' cache)."""
    tables = search_tables()
    return _Maps(*(tables[name].data_ptr() for name, _ in _Maps._fields_)), tables


def _maps() -> _Maps:
    return _maps_and_tables()[0]


def search(x: torch.Tensor, noise: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's code searches alone (for tests): the nearest signed code of each
    ``clamp(x, -1, 1)``, and the stochastically rounded unsigned code of each
    ``min(x, 1)`` given ``noise`` (-1 where x has its sign bit set: a scaled second moment
    never has), as int32 indices."""
    x, noise = x.float().contiguous(), noise.float().contiguous()
    m_index, v_index = (torch.empty(x.numel(), dtype=torch.int32) for _ in range(2))
    load_library().collage8_search(
        x.numel(), x.data_ptr(), noise.data_ptr(), _maps(), m_index.data_ptr(), v_index.data_ptr()
    )
    return m_index, v_index


@dataclass
class EightBitState:
    """One tensor's flat, contiguous CPU state: bf16 theta, dtheta and grad; uint8 codes and
    fp32 absmax per block of m (``exp_avg``) and v (``exp_avg_sq``)."""

    theta: torch.Tensor
    dtheta: torch.Tensor
    m_codes: torch.Tensor
    m_absmax: torch.Tensor
    v_codes: torch.Tensor
    v_absmax: torch.Tensor
    grad: torch.Tensor

    def check(self, block_size: int) -> None:
        n = self.theta.numel()
        expected = {
            "theta": (torch.bfloat16, n),
            "dtheta": (torch.bfloat16, n),
            "grad": (torch.bfloat16, n),
            "m_codes": (torch.uint8, n),
            "v_codes": (torch.uint8, n),
            "m_absmax": (torch.float32, -(-n // block_size)),
            "v_absmax": (torch.float32, -(-n // block_size)),
        }
        for name, (dtype, numel) in expected.items():
            tensor = getattr(self, name)
            if (
                tensor.dtype != dtype
                or tensor.device.type != "cpu"
                or not tensor.is_contiguous()
                or tensor.numel() != numel
            ):
                raise ValueError(
                    f"the CPU 8-bit Collage kernel takes contiguous CPU tensors: {name} must "
                    f"be {dtype} with {numel} elements"
                )


def _ranges(n: int, block_size: int, workers: int) -> list[tuple[int, int]]:
    if n < _SPLIT_MIN_NUMEL or workers == 1:
        return [(0, n)]
    blocks = -(-n // block_size)
    size = -(-blocks // workers) * block_size
    return [(start, min(n, start + size)) for start in range(0, n, size)]


def eight_bit_step(
    tensors: EightBitState,
    scalars: StepScalars,
    *,
    block_size: int,
    seed: int,
    stream: int,
    step: int,
    segments: Sequence[tuple[int, int]] | None,
    mask: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """One fused step of a whole tensor, in place; nothing is written where ``mask`` (a
    0-d bool CPU tensor: ``TrackingOptimizer.step_mask``, read by the kernel) is False.

    ``scalars``: the step's host numbers, as the eager step uses them. ``segments``: None
    (no EDQ tracking) or the ``[start, stop)`` ranges to sum EDQ partials over; returns
    their fp32 sums, one row each. Raises KernelBuildError when the kernel cannot be
    built, ValueError on tensors it cannot step.
    """
    if not 1 <= block_size <= MAX_BLOCK:
        raise ValueError(f"the CPU 8-bit Collage kernel takes blocks of 1..{MAX_BLOCK}")
    tensors.check(block_size)
    if mask is not None and (mask.dtype != torch.bool or mask.device.type != "cpu"):
        raise ValueError("the CPU 8-bit Collage kernel's mask is a bool CPU tensor")
    keep = mask.data_ptr() if mask is not None else None
    library, maps = load_library(), _maps()
    c_scalars = _Scalars(*scalars.pick(SCALARS))
    key1, key2 = rounding_noise.stream_keys(seed, stream, step)
    n = tensors.theta.numel()
    rows = list(segments) if segments is not None else []
    flat_bounds = [bound for row in rows for bound in row]

    def run(bounds: tuple[int, int]) -> list[float]:
        start, stop = bounds
        first_block = start // block_size
        local = (ctypes.c_int64 * max(1, len(flat_bounds)))(*[b - start for b in flat_bounds])
        sums = (ctypes.c_double * max(1, 6 * len(rows)))()
        library.collage8_step(
            stop - start,
            block_size,
            int(segments is not None),
            start,
            key1,
            key2,
            tensors.theta.data_ptr() + 2 * start,
            tensors.dtheta.data_ptr() + 2 * start,
            tensors.m_codes.data_ptr() + start,
            tensors.m_absmax.data_ptr() + 4 * first_block,
            tensors.v_codes.data_ptr() + start,
            tensors.v_absmax.data_ptr() + 4 * first_block,
            tensors.grad.data_ptr() + 2 * start,
            c_scalars,
            maps,
            len(rows),
            local,
            sums,
            keep,
        )
        return list(sums)

    if n == 0:
        results = []
    else:
        ranges = _ranges(n, block_size, torch.get_num_threads())
        if len(ranges) == 1:
            results = [run(ranges[0])]
        else:
            results = list(_pool(len(ranges)).map(run, ranges))
    if segments is None:
        return None
    totals = [sum(column) for column in zip(*results, strict=True)] if results else []
    sums = torch.zeros(len(rows), 6, dtype=torch.float32)
    if rows and totals:
        sums.copy_(torch.tensor(totals[: 6 * len(rows)], dtype=torch.float64).view(-1, 6))
    return sums
