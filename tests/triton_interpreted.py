"""Run under ``TRITON_INTERPRET=1``: the Triton Collage kernel against the eager step.

Called by tests/test_fused_optimizer.py in a subprocess (the interpreter is chosen when
Triton kernels are defined, so it needs a fresh interpreter). Exits non-zero with a
message on the first mismatch.
"""

from __future__ import annotations

import functools

import torch

from collage_train.metrics.descent import partials_close
from collage_train.optim.collage_math import collage_tensor_step, step_scalars
from collage_train.optim.collage_triton import BLOCK, triton_tensor_step

SIZES = (1, BLOCK - 1, BLOCK + 1, 2 * BLOCK + 3)
STEPS = 5


def check(mode: str, numel: int) -> None:
    gen = torch.Generator().manual_seed(numel)
    theta = (torch.randn(numel, generator=gen) * 0.05).bfloat16()
    # theta, dtheta, exp_avg, exp_avg_sq, dv for the eager and the Triton step
    runs = [[theta.clone()] + [torch.zeros_like(theta) for _ in range(4)] for _ in range(2)]
    steps = (functools.partial(collage_tensor_step, mode=mode), triton_tensor_step(mode))
    for t in range(1, STEPS + 1):
        grad = (torch.randn(numel, generator=gen) * 1e-2).bfloat16()
        scalars = step_scalars(3e-3 * 0.97**t, 0.9, 0.999, 1e-8, 0.1, t)
        track, return_update = t % 2 == 0, t == 3
        track = track or return_update
        results = []
        for (p, dtheta, m, v, dv), step in zip(runs, steps, strict=True):
            dtheta = dtheta if mode != "none" else None
            dv = dv if mode == "plus" else None
            results.append(
                step(p, dtheta, m, v, dv, grad, *scalars, track=track, return_update=return_update)
            )
        if return_update:
            assert torch.equal(results[0].view(torch.int16), results[1].view(torch.int16))
        elif track:
            assert partials_close(results[1], results[0]), (results[0], results[1])
        for name, a, b in zip(("theta", "dtheta", "m", "v", "dv"), *runs, strict=True):
            same = torch.equal(a.view(torch.int16), b.view(torch.int16))
            assert same, f"mode {mode}, {numel} elements, step {t}: {name} differs"


def main() -> None:
    for mode in ("none", "light", "plus"):
        for numel in SIZES:
            check(mode, numel)
    print("bitwise equal")


if __name__ == "__main__":
    main()
