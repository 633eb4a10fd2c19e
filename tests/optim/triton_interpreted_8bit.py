"""Run under ``TRITON_INTERPRET=1``: the Triton 8-bit Collage kernel against the eager step.

Called by tests/optim/test_collage_8bit_kernel.py in a subprocess (the interpreter is
chosen when Triton kernels are defined). Exits non-zero with a message on the first
mismatch. As tests/optim/triton_interpreted.py does for the Collage kernel, two passes, both
bitwise on weights, dtheta, codes and absmax (EDQ partials to summation order):

1. the kernel's interpreter branch (bf16 rounding on the bits), under the stock
   interpreter, whose fp32 -> bf16 cast truncates;
2. the branch GPUs run, under the interpreter with its cast rounding to nearest even;
   the same branch under the truncating cast must differ (else pass 2 checks nothing).
"""

from __future__ import annotations

import numpy as np
import torch
import triton.language as tl
from triton.runtime import interpreter

from collage_train.metrics.edq import partials_close
from collage_train.optim.collage.eight_bit import Collage8bitAdamW
from collage_train.optim.collage.eight_bit_triton import ROWS, triton_eight_bit_step
from collage_train.optim.collage.step_math import step_scalars

# one block; two programs with a partial last block; whole programs
SIZES = (1, 255, 256 * ROWS + 300, 256 * ROWS * 2)
STEPS = 4
_TRUNCATING_CAST = interpreter.InterpreterBuilder.cast_impl


def _nearest_even_cast(self, src, dst_type):
    """The interpreter's cast, with fp32 -> bf16 rounded to nearest even (by torch)."""
    if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
        rounded = torch.from_numpy(np.ascontiguousarray(src.data)).to(torch.bfloat16)
        bits = rounded.view(torch.int16).numpy().view(np.uint16)
        return interpreter.TensorHandle(bits, dst_type.scalar)
    return _TRUNCATING_CAST(self, src, dst_type)


def gradients(numel: int, seed: int) -> list[torch.Tensor]:
    """Magnitudes from 1e-38 to 1e1 (v below the smallest code, bf16 subnormals), zeros, a
    zero block and a block of 1e-22..1e-19 (fp32-subnormal v and absmax)."""
    gen = torch.Generator().manual_seed(seed)
    grads = []
    for _ in range(STEPS):
        exponent = torch.randint(-38, 2, (numel,), generator=gen).double()
        exponent[512:768] = torch.randint(-22, -18, exponent[512:768].shape, generator=gen)
        grad = torch.randn(numel, generator=gen, dtype=torch.float64) * 10.0**exponent
        grad[torch.rand(numel, generator=gen) < 0.05] = 0.0
        grad[256:512] = 0.0
        grads.append(grad.bfloat16())
    return grads


def check(numel: int, bit_rounding: bool, block_size: int = 256) -> None:
    gen = torch.Generator().manual_seed(numel)
    start = (torch.randn(numel, generator=gen) * 0.05).bfloat16()
    eager_param, fused_param = (torch.nn.Parameter(start.clone()) for _ in range(2))
    hyper = {"lr": 1e-3, "weight_decay": 0.1, "seed": 11, "block_size": block_size}
    eager = Collage8bitAdamW([eager_param], kernel="eager", **hyper)
    holder = Collage8bitAdamW([fused_param], kernel="eager", **hyper)  # state layout only
    state = holder._state_for(fused_param)
    for t, grad in enumerate(gradients(numel, seed=numel + 1), start=1):
        # step 2 is first refused by the step guard's mask, with NaN gradients: nothing
        # may change, then the eager step count is taken back and step 2 runs for real
        attempts = [(torch.tensor(False), grad * float("nan")), (None, grad)] if t == 2 else []
        for mask, g in attempts or [(torch.tensor(True) if t == 3 else None, grad)]:
            track = t % 2 == 0
            kept = [fused_param.detach().clone()] + [
                v.clone() for v in state.values() if torch.is_tensor(v)
            ]
            eager_param.grad = g.clone()
            eager.track_edq = track
            eager.step_mask = mask
            eager.step()
            eager.step_mask = None
            state["step"] = t
            sums = _triton_step(fused_param, state, g, t, block_size, track, mask, bit_rounding)
            where = f"{numel} elements, blocks of {block_size}, step {t}, R={bit_rounding}"
            if track:
                assert partials_close(sums, eager.last_edq[eager_param]), where
            pairs = [("theta", eager_param.detach(), fused_param.detach())]
            reference = eager.state[eager_param]
            pairs += [(k, reference[k], state[k]) for k in state if torch.is_tensor(state[k])]
            for name, a, b in pairs:
                same = torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                assert same, f"{where}: {name} differs"
            if mask is not None and not mask:
                now = [fused_param.detach()] + [v for v in state.values() if torch.is_tensor(v)]
                for a, b in zip(now, kept, strict=True):
                    assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), "refused"
                if track:
                    assert torch.equal(sums, torch.zeros_like(sums)), "refused sums"
                eager.rewind_steps(1)


def _triton_step(param, state, grad, t, block_size, track, mask, bit_rounding):
    return triton_eight_bit_step(
        param.detach(),
        state["dtheta"],
        grad,
        state["exp_avg"],
        state["exp_avg_absmax"],
        state["exp_avg_sq"],
        state["exp_avg_sq_absmax"],
        step_scalars(1e-3, 0.9, 0.999, 1e-8, 0.1, t),
        block_size=block_size,
        seed=11,
        stream=state["stream"],
        step=t,
        track=track,
        mask=mask,
        bit_rounding=bit_rounding,
    )


def main() -> None:
    for numel in SIZES:
        check(numel, bit_rounding=True)
    check(64 * ROWS + 30, bit_rounding=True, block_size=64)
    try:
        check(256 * ROWS + 300, bit_rounding=False)
    except AssertionError:
        pass  # truncating conversions: the GPU branch cannot match here
    else:
        raise AssertionError("the GPU branch matched under a truncating cast: not checked")
    interpreter.InterpreterBuilder.cast_impl = _nearest_even_cast
    for numel in SIZES:
        check(numel, bit_rounding=False)
    check(64 * ROWS + 30, bit_rounding=False, block_size=64)
    print("bitwise equal: interpreter branch, and GPU branch with round-to-nearest-even casts")


if __name__ == "__main__":
    main()
