"""Variants of the Triton Collage kernel on a GPU: bitwise parity and time against the floor.

For each block size, warp count and rounding method (conversion instruction or bit
arithmetic), checks the kernel against the eager step (bitwise, several steps) and
times one step of a large tensor, with and without EDQ sums, against a copy's
read + write bandwidth measured in the same run (22 bytes/param for collage_plus).

    python scripts/tune_collage_triton.py --numel 65e6 --json tune.json
"""

from __future__ import annotations

import functools
import itertools
import statistics
import time

import torch
from common import parser, write_json

from collage_train.metrics.edq import partials_close
from collage_train.optim.collage.step_math import collage_tensor_step, step_scalars
from collage_train.optim.collage.triton_kernel import triton_tensor_step

FLOOR_BYTES = {"none": 14, "light": 18, "plus": 22}
# Without a GPU (dry runs under TRITON_INTERPRET=1) the script runs on the CPU.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def state(numel: int, seed: int) -> list[torch.Tensor]:
    """theta, dtheta, exp_avg, exp_avg_sq, dv and grad as training has them: zero state.

    Timed steps then run from the state the warm-up steps leave (finite values; random
    optimizer state would hold negative or NaN entries that change the kernel's speed).
    """
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    theta = (torch.randn(numel, generator=gen, device=DEVICE) * 0.05).bfloat16()
    grad = (torch.randn(numel, generator=gen, device=DEVICE) * 1e-2).bfloat16()
    return [theta] + [torch.zeros_like(theta) for _ in range(4)] + [grad]


def args_for(tensors: list[torch.Tensor], mode: str) -> list[torch.Tensor | None]:
    theta, dtheta, m, v, dv, g = tensors
    return [theta, dtheta if mode != "none" else None, m, v, dv if mode == "plus" else None, g]


def bitwise_equal(step, mode: str, numel: int) -> bool:
    eager_state, fused_state = state(numel, 1), state(numel, 1)
    eager = functools.partial(collage_tensor_step, mode=mode)
    for t in range(1, 5):
        scalars = step_scalars(1e-3, 0.9, 0.999, 1e-8, 0.1, t)
        flags = {"track": t % 2 == 0, "return_update": False}
        a = eager(*args_for(eager_state, mode), scalars, **flags)
        b = step(*args_for(fused_state, mode), scalars, **flags)
        if flags["track"] and not partials_close(a, b):
            return False
    return all(
        torch.equal(x.view(torch.int16), y.view(torch.int16))
        for x, y in zip(eager_state, fused_state, strict=True)
    )


def median_ms(fn, repeats: int = 25) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        if DEVICE == "cuda":
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            began = time.perf_counter()
            fn()
            times.append((time.perf_counter() - began) * 1e3)
    return statistics.median(times)


def copy_bandwidth(numel: int) -> float:
    """Read + write bytes per second of an fp32 copy of ``numel`` elements."""
    src = torch.randn(numel, device=DEVICE)
    dst = torch.empty_like(src)
    return 2 * numel * 4 / (median_ms(lambda: dst.copy_(src)) / 1e3)


def main() -> None:
    cli = parser(__doc__, record=False)
    cli.add_argument("--numel", type=float, default=65e6)
    cli.add_argument("--modes", nargs="*", default=["plus"])
    args = cli.parse_args()
    numel = int(args.numel)
    bandwidth = copy_bandwidth(numel * 4)
    tensors = state(numel, 0)
    scalars = step_scalars(1e-3, 0.9, 0.999, 1e-8, 0.1, 10)
    rows = []
    for mode, block, warps, bits in itertools.product(
        args.modes, (1024, 2048, 4096), (4, 8), (False, True)
    ):
        step = triton_tensor_step(mode, block=block, num_warps=warps, bit_rounding=bits)
        floor_ms = FLOOR_BYTES[mode] * numel / bandwidth * 1e3
        row = {"mode": mode, "block": block, "num_warps": warps, "bit_rounding": bits}
        row["bitwise"] = bitwise_equal(step, mode, min(numel, 1 << 20))
        for track in (False, True):
            ms = median_ms(
                functools.partial(
                    step, *args_for(tensors, mode), scalars, track=track, return_update=False
                )
            )
            row["edq_ms" if track else "ms"] = ms
            row["edq_floor_ratio" if track else "floor_ratio"] = ms / floor_ms
        rows.append(row)
        print(
            f"{mode} block {block} warps {warps} bits {bits}: bitwise {row['bitwise']} "
            f"{row['ms']:.2f} ms ({row['floor_ratio']:.2f}x), EDQ {row['edq_ms']:.2f} ms "
            f"({row['edq_floor_ratio']:.2f}x)",
            flush=True,
        )
    print(f"copy bandwidth {bandwidth / 1e9:.0f} GB/s; {numel / 1e6:.0f}M elements")
    write_json(args.json, rows)


if __name__ == "__main__":
    main()
