"""Power-of-two scales and the Scalify propagation rules.

A scaled tensor is ``data * scale`` with ``scale`` an exact power of two, rounded down,
so multiplying or dividing by it is exact (barring overflow or underflow). Scales are
0-d float32 tensors (the form ``torch._scaled_mm`` takes); the rules (matmul, add, mul,
sum, rotary embedding) compute in float64 and round the result down to a power of two,
so every scale they return is exact. A stored scaled tensor is ``(data, scale)`` with
fp16 ``data`` (``store_scaled``, read back exactly by ``load_scaled``); a parameter held
that way (``collage_train.scalify.params``) carries its scale as ``scalify_scale``, and
``value_rms_scale`` gives the RMS scale of the value such a tensor stands for, and
``ExactFp16Scales`` the scales under which fp16 data holds a tensor exactly.

The rules: docs/strategies.md, "Scales and the propagation rules".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

STORAGE_DTYPE = torch.float16
FP16_MAX = _FP16_MAX = float(torch.finfo(STORAGE_DTYPE).max)
SCALE_ATTR = "scalify_scale"  # a scaled parameter's power-of-two scale (0-d fp32)


def pow2_floor(x: torch.Tensor) -> torch.Tensor:
    """The largest power of two ``<= |x|``, elementwise, in ``x``'s dtype.

    Exact: built from ``torch.frexp`` (``|x| = m * 2**e`` with ``m`` in ``[0.5, 1)``,
    so the answer is ``2**(e - 1)``), subnormal inputs included. Special values:
    ``0 -> 0``, ``+-inf -> inf``, ``nan -> nan``; callers that need a usable scale
    (``rms_scale``) decide what to do with those.
    """
    magnitude = x.abs()
    _, exponent = torch.frexp(magnitude)
    result = torch.ldexp(torch.ones_like(magnitude), exponent - 1)
    special = (magnitude == 0) | ~torch.isfinite(magnitude)
    return torch.where(special, magnitude, result)


def is_power_of_two(x: torch.Tensor) -> bool:
    """True when every element is a positive, finite, exact power of two."""
    mantissa, _ = torch.frexp(x)
    return bool(((mantissa == 0.5) & torch.isfinite(x)).all())


def _as_scale(value: torch.Tensor) -> torch.Tensor:
    """A float64 result rounded down to a power of two, as a float32 scale."""
    return pow2_floor(value.to(torch.float64)).to(torch.float32)


def rms_scale(t: torch.Tensor) -> torch.Tensor:
    """``pow2_floor`` of the root mean square of ``t``, a 0-d float32 scale.

    The RMS is computed in float64 (no overflow of the squares, no rounding up to
    the next power of two before the floor). A tensor with RMS 0 (all zeros, or
    empty) gets scale 1, so its data stays zero under a finite scale; a tensor
    holding inf or nan gets a non-finite scale, so the fault stays visible.
    """
    if t.numel() == 0:
        return torch.ones((), dtype=torch.float32, device=t.device)
    rms = t.detach().to(torch.float64).square().mean().sqrt()
    scale = _as_scale(rms)
    return torch.where(rms == 0, torch.ones_like(scale), scale)


def value_rms_scale(t: torch.Tensor) -> torch.Tensor:
    """``rms_scale`` of the value ``t`` stands for: for a scaled parameter (fp16 data with a
    ``scalify_scale`` attribute) its data's RMS scale times that scale, which equals the
    RMS scale of ``data * scale`` exactly (scaling by a power of two commutes with every
    rounding of the float64 RMS); for any other tensor ``rms_scale(t)``."""
    scale = getattr(t, SCALE_ATTR, None)
    if scale is None:
        return rms_scale(t)
    if t.numel() == 0:
        return torch.ones((), dtype=torch.float32, device=t.device)
    rms = t.detach().to(torch.float64).square().mean().sqrt()
    value = _as_scale(rms * scale.to(device=t.device, dtype=torch.float64))
    # all-zero data stands for zero, whose scale is 1 whatever the stored scale
    return torch.where(rms == 0, torch.ones_like(value), value)


def load_scaled(data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The fp32 value ``data * scale`` of a scaled tensor (exact: ``scale`` is a power of two)."""
    return data.to(torch.float32) * scale


def store_scaled(
    value: torch.Tensor, scaled: bool = True, dtype: torch.dtype = STORAGE_DTYPE
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(data, scale)`` for an fp32 value: scale = ``rms_scale(value)`` (1 if not scaled).

    fp16 data is clamped to the fp16 range, so a value more than ~2**15 times its RMS
    saturates instead of becoming inf. ``dtype=torch.float32`` stores the value as is.
    """
    if dtype == torch.float32:
        return value.clone(), torch.ones((), device=value.device)
    scale = rms_scale(value) if scaled else torch.ones((), device=value.device)
    data = (value / scale).clamp(-_FP16_MAX, _FP16_MAX).to(dtype)
    return data, scale


def rms_scales_from_sums(squares: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """``rms_scale`` of tensors known by their float64 sums of squares and element counts
    (a tensor summed chunk by chunk, or piece by piece over ranks); zero or empty: 1."""
    rms = (squares / counts.clamp(min=1)).sqrt()
    scales = _as_scale(rms)
    return torch.where(rms == 0, torch.ones_like(scales), scales)


def per_element(scale: torch.Tensor, lengths: torch.Tensor | None) -> torch.Tensor:
    """A scale to multiply data by: a 0-d ``scale`` as is, one per segment of ``lengths``
    elements (a ZeRO partition's pieces, ``scalify.pieces``) repeated over its elements."""
    if lengths is None or scale.dim() == 0:
        return scale
    return torch.repeat_interleave(scale, lengths.to(scale.device), output_size=int(lengths.sum()))


def _pow2_floor_sqrt(n: int) -> float:
    """``pow2_floor(sqrt(n))`` for a positive integer, exactly: ``2**floor(log2(n) / 2)``."""
    if n < 1:
        raise ValueError(f"a dimension size must be >= 1, got {n}")
    return float(2 ** ((n.bit_length() - 1) // 2))


def sum_scale(scale: torch.Tensor, n: int) -> torch.Tensor:
    """Scale of a sum over ``n`` elements: ``scale * pow2_floor(sqrt(n))``."""
    return _as_scale(scale.to(torch.float64) * _pow2_floor_sqrt(n))


def matmul_scale(scale_a: torch.Tensor, scale_b: torch.Tensor, k: int) -> torch.Tensor:
    """Scale of ``a @ b`` over inner dimension ``k``: ``s_a * s_b * pow2_floor(sqrt(k))``."""
    return _as_scale(scale_a.to(torch.float64) * scale_b.to(torch.float64) * _pow2_floor_sqrt(k))


def add_scale(scale_a: torch.Tensor, scale_b: torch.Tensor) -> torch.Tensor:
    """Scale of ``a + b``: ``pow2_floor(sqrt(s_a**2 + s_b**2))``."""
    a, b = scale_a.to(torch.float64), scale_b.to(torch.float64)
    return _as_scale((a.square() + b.square()).sqrt())


def mul_scale(scale_a: torch.Tensor, scale_b: torch.Tensor) -> torch.Tensor:
    """Scale of the elementwise product ``a * b``: ``s_a * s_b``."""
    return _as_scale(scale_a.to(torch.float64) * scale_b.to(torch.float64))


def rotary_scale(scale: torch.Tensor) -> torch.Tensor:
    """Scale of a rotary embedding ``x * cos + rotate_half(x) * sin`` of ``x`` at ``scale``.

    The cos and sin tables lie in [-1, 1] and have unit scale; ``rotate_half`` permutes
    and negates (keeps the scale). The mul rule then the add rule: ``pow2_floor(sqrt(2) s)``,
    which for a power-of-two ``s`` is ``s`` itself.
    """
    one = torch.ones((), dtype=scale.dtype, device=scale.device)
    return add_scale(mul_scale(scale, one), mul_scale(scale, one))


@dataclass
class ExactFp16Scales:
    """The power-of-two scales ``2**k`` under which every element seen so far, divided by
    the scale, is an fp16 value (``store_scaled`` holds it exactly): ``low <= k <= high``,
    none when ``low > high``. Fed a tensor at a time (``add``), so one pass over a whole
    tensor answers for any scale chosen after it (``holds``).

    An element ``m * 2**e`` (``m`` odd) divided by ``2**k`` is an fp16 value exactly when
    ``m`` has at most 11 bits, ``e - k >= -24`` (fp16's smallest step) and its leading bit
    is at most ``2**15`` (fp16's largest finite value, 65504, has 11 ones below it)."""

    low: float = -torch.inf
    high: float = torch.inf

    def add(self, values: torch.Tensor) -> None:
        if self.low > self.high:  # none already: no later element can widen it
            return
        values = values.double().flatten()
        values = values[values != 0]  # zero is exact under any scale
        if values.numel() == 0:
            return
        if not bool(torch.isfinite(values).all()):
            self.low, self.high = 1.0, 0.0
            return
        mantissa, exponent = torch.frexp(values)  # |value| = mantissa * 2**exponent
        significand = (mantissa.abs() * 2.0**53).to(torch.int64)  # 53 bits, the top one set
        trailing = torch.frexp((significand & -significand).double())[1] - 1  # zero bits
        if bool((trailing < 42).any()):  # more than 11 significant bits: no scale holds it
            self.low, self.high = 1.0, 0.0
            return
        self.low = max(self.low, float((exponent - 16).max()))  # leading bit <= 2**15
        self.high = min(self.high, float((exponent + trailing - 29).min()))  # lowest >= 2**-24

    def holds(self, scale: torch.Tensor) -> bool:
        """Whether every element seen divided by ``scale`` is fp16; never for a scale that
        is not a power of two (0 or inf past fp32's range)."""
        if not is_power_of_two(scale):
            return False
        k = int(torch.frexp(scale.double())[1]) - 1
        return self.low <= k <= self.high
