"""Run under ``TRITON_INTERPRET=1``: the Triton Collage kernel against the eager step.

Called by tests/optim/test_fused_optimizer.py in a subprocess (the interpreter is chosen when
Triton kernels are defined, so it needs a fresh interpreter). Exits non-zero with a
message on the first mismatch. Step 2 runs under a False ``mask`` with a NaN in its
gradient (the step guard refusing it: nothing may change), step 4 under a True one.
Two passes, both bitwise:

1. the kernel's interpreter branch (``bit_rounding``: bf16 rounding done on the bits),
   under the stock interpreter, whose fp32 -> bf16 cast truncates;
2. the branch GPUs run (the conversion instruction rounds), under the interpreter with
   its cast patched to round to nearest even as GPUs do; and, to show that pass 2
   depends on that rounding, the same branch under the truncating cast must differ.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
import triton.language as tl
from triton.runtime import interpreter

from collage_train.metrics.edq import partials_close
from collage_train.optim.collage.step_math import collage_tensor_step, step_scalars
from collage_train.optim.collage.triton_kernel import BLOCK, triton_tensor_step

SIZES = (1, BLOCK - 1, BLOCK + 1, 2 * BLOCK + 3)
STEPS = 5


_TRUNCATING_CAST = interpreter.InterpreterBuilder.cast_impl


def _nearest_even_cast(self, src, dst_type):
    """The interpreter's cast, with fp32 -> bf16 rounded to nearest even (by torch)."""
    if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
        rounded = torch.from_numpy(np.ascontiguousarray(src.data)).to(torch.bfloat16)
        bits = rounded.view(torch.int16).numpy().view(np.uint16)
        return interpreter.TensorHandle(bits, dst_type.scalar)
    return _TRUNCATING_CAST(self, src, dst_type)


def check(mode: str, numel: int, bit_rounding: bool = True) -> None:
    gen = torch.Generator().manual_seed(numel)
    theta = (torch.randn(numel, generator=gen) * 0.05).bfloat16()
    # theta, dtheta, exp_avg, exp_avg_sq, dv for the eager and the Triton step
    runs = [[theta.clone()] + [torch.zeros_like(theta) for _ in range(4)] for _ in range(2)]
    steps = (
        functools.partial(collage_tensor_step, mode=mode),
        triton_tensor_step(mode, bit_rounding=bit_rounding),
    )
    for t in range(1, STEPS + 1):
        grad = (torch.randn(numel, generator=gen) * 1e-2).bfloat16()
        scalars = step_scalars(3e-3 * 0.97**t, 0.9, 0.999, 1e-8, 0.1, t)
        track, return_update = t % 2 == 0, t == 3
        track = track or return_update
        # the step guard's mask: step 2 refused (with a NaN gradient), step 4 applied
        mask = {2: torch.tensor(False), 4: torch.tensor(True)}.get(t)
        if t == 2:
            grad[numel // 2] = float("nan")
        before = [[x.clone() for x in run] for run in runs]
        results = []
        for (p, dtheta, m, v, dv), step in zip(runs, steps, strict=True):
            dtheta = dtheta if mode != "none" else None
            dv = dv if mode == "plus" else None
            results.append(
                step(
                    p, dtheta, m, v, dv, grad, scalars,
                    track=track, return_update=return_update, mask=mask,
                )
            )  # fmt: skip
        if t == 2:
            for run, kept in zip(runs, before, strict=True):
                pairs = zip(run, kept, strict=True)
                same = all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in pairs)
                assert same, "a refused step wrote"
            assert all(torch.equal(r, torch.zeros_like(r)) for r in results), "refused sums"
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
            check(mode, numel, bit_rounding=True)
    try:
        check("plus", BLOCK + 1, bit_rounding=False)
    except AssertionError:
        pass  # truncating conversions: the GPU branch cannot match here
    else:
        raise AssertionError("the GPU branch matched under a truncating cast: not checked")
    interpreter.InterpreterBuilder.cast_impl = _nearest_even_cast
    for mode in ("none", "light", "plus"):
        for numel in SIZES:
            check(mode, numel, bit_rounding=False)
    print("bitwise equal: interpreter branch, and GPU branch with round-to-nearest-even casts")


if __name__ == "__main__":
    main()
