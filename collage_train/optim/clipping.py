"""Global gradient-norm computation and clipping with fp32 accumulation."""

from __future__ import annotations

from collections.abc import Iterable

import torch


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
    total = torch.linalg.vector_norm(torch.stack(norms), 2.0)
    if max_norm > 0:
        scale = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        scale = torch.where(torch.isfinite(scale), scale, torch.ones_like(scale))
        torch._foreach_mul_(grads, scale.to(grads[0].device))
    return total
