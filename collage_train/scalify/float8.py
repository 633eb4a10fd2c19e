"""Float8 casts and scaled matmuls: E4M3 for the forward pass, E5M2 for gradients.

``to_float8`` divides by a power-of-two scale and clamps to the format's finite range
before casting, so every path sees the same operands. ``scaled_mm`` runs
``torch._scaled_mm`` on CUDA GPUs of compute capability >= 8.9 and
``scaled_mm_emulated`` elsewhere: ATen's CPU reference (``_scaled_mm_out_cpu_emulated``),
bitwise equal to ``torch._scaled_mm`` on CPU wherever that reference runs. Hopper's
float8 tensor cores accumulate with fewer bits than fp32, so the hardware path agrees
with the emulation within ``HARDWARE_ACCUMULATION_RTOL``, not bitwise.

Cast overflow, oneDNN and H100 measurements: docs/strategies.md,
'Float8 casts and scaled_mm'.
"""

from __future__ import annotations

import torch

FLOAT8_FORWARD = torch.float8_e4m3fn
FLOAT8_BACKWARD = torch.float8_e5m2
FLOAT8_DTYPES = (FLOAT8_FORWARD, FLOAT8_BACKWARD)
# How far the GPU's float8 matmul may stand from the fp32 emulation, relative to the
# result's largest magnitude: 10x what an H100 showed; a wrong layout or scale is off by O(1).
HARDWARE_ACCUMULATION_RTOL = 2.0**-9


def float8_max(dtype: torch.dtype) -> float:
    """Largest finite value of a float8 format (448 for E4M3, 57344 for E5M2)."""
    if dtype not in FLOAT8_DTYPES:
        raise ValueError(f"not a float8 format: {dtype}")
    return float(torch.finfo(dtype).max)


def to_float8(
    x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = FLOAT8_FORWARD
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(clamp(x / scale, -max, max).to(dtype), scale)``: float8 data and its fp32 scale.

    Computed in fp32; dividing by a power of two is exact, so the only rounding is
    the cast itself (nan stays nan).
    """
    limit = float8_max(dtype)
    scale = torch.as_tensor(scale, dtype=torch.float32, device=x.device)
    data = (x.to(torch.float32) / scale).clamp(-limit, limit).to(dtype)
    return data, scale


def scaled_mm_emulated(
    a8: torch.Tensor,
    b8: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """``((a8 * scale_a) @ (b8 * scale_b)).to(out_dtype)`` with fp32 operands and sums.

    Float8 products are exact in fp32; the sums round in fp32, in the order of the
    CPU fp32 matmul of contiguous operands, as ATen's reference does.
    """
    a = a8.to(torch.float32).contiguous() * scale_a.to(torch.float32)
    b = b8.to(torch.float32).contiguous() * scale_b.to(torch.float32)
    return (a @ b).to(out_dtype)


def hardware_shapes_supported(a8: torch.Tensor, b8: torch.Tensor) -> bool:
    """Whether the float8 GPU kernel takes these operands, wherever they are.

    2-D operands (batched ones, attention's, take the emulation), both dimensions of each a
    multiple of 16, and not both E5M2 (cuBLASLt has no E5M2 x E5M2 kernel).
    """
    if a8.dim() != 2 or b8.dim() != 2:
        return False
    if a8.dtype == FLOAT8_BACKWARD and b8.dtype == FLOAT8_BACKWARD:
        return False
    return all(size % 16 == 0 for size in (*a8.shape, *b8.shape))


def hardware_scaled_mm_available(a8: torch.Tensor, b8: torch.Tensor) -> bool:
    """True when ``torch._scaled_mm`` runs these operands on a float8 GPU: CUDA tensors
    on compute capability >= 8.9 (Ada, Hopper and later) and supported shapes."""
    if not (a8.is_cuda and b8.is_cuda) or not hardware_shapes_supported(a8, b8):
        return False
    return torch.cuda.get_device_capability(a8.device) >= (8, 9)


def hardware_scaled_mm(
    a8: torch.Tensor,
    b8: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """``torch._scaled_mm`` with the layouts and scales it requires: ``a8`` row-major,
    ``b8`` column-major, fp32 scales. Runs on meta tensors too, where torch checks the
    arguments as the CUDA kernel would (tests/scalify/test_scalify_float8.py)."""
    column_major_b = b8.t().contiguous().t()
    return torch._scaled_mm(
        a8.contiguous(),
        column_major_b,
        scale_a=scale_a.to(torch.float32),
        scale_b=scale_b.to(torch.float32),
        out_dtype=out_dtype,
    )


def scaled_mm(
    a8: torch.Tensor,
    b8: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """``(a8 * scale_a) @ (b8 * scale_b)`` in ``out_dtype``, on float8 hardware when present.

    ``a8`` is (M, K), ``b8`` is (K, N), or both batched (..., M, K) and (..., K, N),
    which always take the emulation. The GPU kernel wants ``b8`` column-major; it is
    made so here. Elsewhere (CPU, older GPUs, unsupported shapes or E5M2 x E5M2)
    the exact emulation runs.
    """
    if not hardware_scaled_mm_available(a8, b8):
        return scaled_mm_emulated(a8, b8, scale_a, scale_b, out_dtype)
    return hardware_scaled_mm(a8, b8, scale_a, scale_b, out_dtype)


def float8_matmul(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    dtype_a: torch.dtype = FLOAT8_FORWARD,
    dtype_b: torch.dtype = FLOAT8_FORWARD,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Cast ``a`` and ``b`` to float8 with their scales, then ``scaled_mm``."""
    a8, scale_a = to_float8(a, scale_a, dtype_a)
    b8, scale_b = to_float8(b, scale_b, dtype_b)
    return scaled_mm(a8, b8, scale_a, scale_b, out_dtype)
