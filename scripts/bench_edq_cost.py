"""Cost of measuring effective descent quality: optimizer step time with tracking on and off.

Times ``CollageAdamW`` (modes none, light, plus) and the fp32-master ``AdamW`` on bf16
parameters of transformer-like shapes, each step with ``track_edq`` off and on, in
alternating order; reports the median step time and the ratio. With EDQ measured every
``log_every`` steps, the amortised overhead is the ratio's excess divided by that.

    python scripts/bench_edq_cost.py --params 8e6 --steps 10

The table is printed and appended to docs/results-history.md (``--no-append`` to skip).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from runs import append_results

from collage_train.optim import AdamW, CollageAdamW


def make_params(total: float, tensors: int, seed: int = 0) -> list[torch.nn.Parameter]:
    """``tensors`` square-ish bf16 matrices holding about ``total`` elements."""
    gen = torch.Generator().manual_seed(seed)
    side = int((total / tensors) ** 0.5)
    params = []
    for _ in range(tensors):
        param = torch.nn.Parameter((torch.randn(side, side, generator=gen) * 0.02).bfloat16())
        param.grad = (torch.randn(side, side, generator=gen) * 1e-3).bfloat16()
        params.append(param)
    return params


def build(name: str, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    if name == "mixed_fp32":
        return AdamW(params, lr=1e-4, weight_decay=0.1, master_dtype=torch.float32)
    return CollageAdamW(params, lr=1e-4, weight_decay=0.1, mode=name.removeprefix("collage_"))


def time_steps(optimizer: torch.optim.Optimizer, steps: int) -> dict[bool, float]:
    """Median seconds per step with tracking off and on, alternating step by step."""
    optimizer.step()  # allocate state
    times: dict[bool, list[float]] = {False: [], True: []}
    for i in range(2 * steps):
        track = i % 2 == 1
        optimizer.track_edq = track
        start = time.perf_counter()
        optimizer.step()
        times[track].append(time.perf_counter() - start)
    optimizer.track_edq = False
    return {track: statistics.median(values) for track, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, default=8e6)
    parser.add_argument("--tensors", type=int, default=20)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--log-every", type=int, default=10, help="for the amortised column")
    parser.add_argument(
        "--optimizers",
        nargs="+",
        default=["mixed_fp32", "collage_none", "collage_light", "collage_plus"],
    )
    parser.add_argument("--no-append", action="store_true", help="skip docs/results-history.md")
    args = parser.parse_args()

    lines = [
        "| optimizer | step, EDQ off (ms) | step, EDQ on (ms) | on / off "
        f"| amortised overhead at every {args.log_every} steps |",
        "|---|---|---|---|---|",
    ]
    numel = 0
    for name in args.optimizers:
        params = make_params(args.params, args.tensors)
        numel = sum(p.numel() for p in params)
        timings = time_steps(build(name, params), args.steps)
        ratio = timings[True] / timings[False]
        lines.append(
            f"| {name} | {1e3 * timings[False]:.1f} | {1e3 * timings[True]:.1f} | {ratio:.2f} "
            f"| {100 * (ratio - 1) / args.log_every:.1f}% |"
        )
        print(lines[-1], flush=True)
    result = "\n".join(lines)
    print(result)
    if not args.no_append:
        append_results(
            "Cost of effective-descent-quality tracking",
            f"{numel / 1e6:.1f}M bf16 parameters in {args.tensors} tensors, median of "
            f"{args.steps} steps each way, tracked and untracked steps alternating.",
            result,
        )


if __name__ == "__main__":
    main()
