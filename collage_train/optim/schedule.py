"""Learning-rate schedule: linear warm-up, then cosine decay to a floor."""

from __future__ import annotations

import math


def warmup_cosine_lr(
    step: int, *, peak_lr: float, min_lr: float, warmup_steps: int, max_steps: int
) -> float:
    """The lr of optimizer step ``step`` (0-based) in a run of ``max_steps`` steps.

    Rises linearly from peak/warmup to peak over ``warmup_steps`` steps, then follows a
    half cosine from peak to ``min_lr``, reached at the last step.
    """
    if step < warmup_steps:
        return peak_lr * (step + 1) / warmup_steps
    decay_steps = max_steps - warmup_steps
    if decay_steps <= 1:
        return peak_lr
    progress = min(1.0, (step - warmup_steps) / (decay_steps - 1))
    return min_lr + 0.5 * (peak_lr - min_lr) * (1.0 + math.cos(math.pi * progress))
