"""Global gradient-norm computation and clipping with fp32 accumulation.

A gradient may be scaled data: a tensor carrying a 0-d power-of-two scale as its attribute
``scalify_scale`` stands for ``grad * scale`` (Scalify's scaled fp16 gradients,
``collage_train.scalify.params``). Its norm is the data's norm times the scale, exactly,
so the norm returned is always that of the gradient values; clipping puts the power-of-two
part of its factor into the scale and the rest into the data.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

GRAD_SCALE_ATTR = "scalify_scale"  # = collage_train.scalify.scale.SCALE_ATTR (tested)


@torch.no_grad()
def clip_grad_norm(params: Iterable[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Return the global L2 norm of the gradients (fp32) and scale them to ``max_norm``.

    Norms are accumulated in fp32 even for bf16 gradients; ``max_norm <= 0`` only
    measures. A non-finite norm leaves the gradients untouched.
    """
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    norms = torch._foreach_norm(grads, 2.0, dtype=torch.float32)
    scales = [getattr(g, GRAD_SCALE_ATTR, None) for g in grads]
    if any(scale is not None for scale in scales):  # the values' norms: data norm x scale
        norms = [n if s is None else n * s.to(n.device) for n, s in zip(norms, scales, strict=True)]
    total = torch.linalg.vector_norm(torch.stack(norms), 2.0)
    if max_norm > 0:
        scale = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        scale = torch.where(torch.isfinite(scale), scale, torch.ones_like(scale))
        plain = [g for g, s in zip(grads, scales, strict=True) if s is None]
        if plain:
            torch._foreach_mul_(plain, scale.to(plain[0].device))
        if len(plain) < len(grads):
            _clip_scaled(grads, scales, scale)
    return total


def _clip_scaled(grads: list[torch.Tensor], scales: list, factor: torch.Tensor) -> None:
    """Multiply scaled gradients by ``factor`` in (0, 1]: its power-of-two part goes into
    each scale (exact), the rest, in (1/2, 1], into the data, which so stays within a
    factor of two of where it was instead of sinking towards fp16's subnormals."""
    mantissa, exponent = torch.frexp(factor)  # factor = mantissa * 2**exponent, [1/2, 1)
    half = mantissa == 0.5
    mantissa = torch.where(half, torch.ones_like(mantissa), mantissa)  # 1 stays 1 * 2**0
    power = torch.ldexp(torch.ones_like(factor), torch.where(half, exponent - 1, exponent))
    scaled = [g for g, s in zip(grads, scales, strict=True) if s is not None]
    torch._foreach_mul_(scaled, mantissa.to(scaled[0].device))
    for s in scales:
        if s is not None:
            s.mul_(power.to(s.device))
