"""Optimizer step time against the memory-bandwidth floor, strategy by strategy.

An optimizer step is pure memory traffic: its floor is the bytes it must read and write
per parameter (its state layout, docs/strategies.md) over the bandwidth of a large
copy, measured in the same run. For a parameter set of transformer-like matrices, each
row reports the best and the median step time, the effective bandwidth (floor bytes /
best time) and the ratio to the floor,
side by side with torch.optim.AdamW (fp32 parameters and states; foreach on CPU, fused
on GPU) and, when installed, peers a user would pick instead (optimi's Kahan-summation
AdamW, torchao's bf16 AdamW with stochastic rounding; ``pip install -e .[bench]``).

On a shared or throttled host, noise only ever adds time, and it comes in waves that
slow copies and steps alike. Two ratios are reported: best against best (the fastest
step against the fastest copy of the whole run, which can only raise a ratio), and
paired (the median over steps of each step against a copy timed just before it, so a
slow period slows both sides). The EDQ overhead is the median over adjacent pairs of
one tracked and one untracked step on the same optimizer, each after a copy, in
alternating order.

    python scripts/bench_optimizer.py --params 33.6e6 --json optimizer.json

The table is printed and appended to docs/results-history.md (``--no-record`` to skip).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
from common import default_device, parser, publish, table

from collage_train.optim import AdamW, CollageAdamW, SplitMasterAdamW

# Bytes read + written per parameter by one fused pass (gradient read included).
FLOOR_BYTES = {
    "torch_adamw_fp32": 28,  # p, g, m, v fp32 read; p, m, v written
    "mixed_fp32": 28,  # master, m, v fp32 + bf16 g read; master, m, v fp32 + bf16 p written
    "split_fp32": 26,  # p, remainder, g (2 each) + m, v (4 each) read; all but g written
    "bf16": 14,
    "collage_light": 18,
    "collage_plus": 22,
    "optimi_kahan": 18,  # p, g, m, v, compensation bf16 read; all but g written
    "torchao_bf16_sr": 14,
}


def make_params(total: float, tensors: int, dtype: torch.dtype, device: str) -> list:
    side = int((total / tensors) ** 0.5)
    gen = torch.Generator().manual_seed(0)
    params = []
    for _ in range(tensors):
        param = torch.nn.Parameter(
            (torch.randn(side, side, generator=gen) * 0.02).to(device, dtype)
        )
        param.grad = (torch.randn(side, side, generator=gen) * 1e-3).to(device, dtype)
        params.append(param)
    return params


class Copier:
    """A large fp32 copy: the bandwidth probe the floor is measured with."""

    def __init__(self, numel: int, device: str) -> None:
        self.src = torch.randn(numel, device=device)
        self.dst = torch.empty_like(self.src)
        self.device = device
        self.bytes = 2 * self.src.numel() * self.src.element_size()  # read + write

    def seconds(self) -> float:
        sync(self.device)
        start = time.perf_counter()
        self.dst.copy_(self.src)
        sync(self.device)
        return time.perf_counter() - start

    def bandwidth(self, repeats: int = 5) -> float:
        """Bytes per second of the fastest of ``repeats`` copies."""
        return self.bytes / min(self.seconds() for _ in range(repeats))


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def candidates(device: str) -> dict[str, tuple[torch.dtype, Callable]]:
    """name -> (parameter dtype, optimizer factory)."""
    hyper = {"lr": 1e-4, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.1}
    fused_torch = {"fused": True} if device == "cuda" else {"foreach": True}
    rows: dict[str, tuple[torch.dtype, Callable]] = {
        "torch_adamw_fp32": (torch.float32, lambda p: torch.optim.AdamW(p, **hyper, **fused_torch)),
        "mixed_fp32": (torch.bfloat16, lambda p: AdamW(p, master_dtype=torch.float32, **hyper)),
        "split_fp32": (torch.bfloat16, lambda p: SplitMasterAdamW(p, **hyper)),
    }
    for mode, name in (("none", "bf16"), ("light", "collage_light"), ("plus", "collage_plus")):
        for kernel in ("eager", "compiled"):
            rows[f"{name} ({kernel})"] = (
                torch.bfloat16,
                lambda p, mode=mode, kernel=kernel: CollageAdamW(
                    p, mode=mode, kernel=kernel, **hyper
                ),
            )
    # What a drop-in user gets: CollageAdamW(params, lr=...) (mode plus, kernel auto).
    rows["collage_plus (default)"] = (torch.bfloat16, lambda p: CollageAdamW(p, **hyper))
    try:
        import optimi

        rows["optimi_kahan"] = (
            torch.bfloat16,
            lambda p: optimi.AdamW(p, kahan_sum=True, decouple_lr=False, **hyper),
        )
    except ImportError:
        print("optimi is not installed: its row is skipped (pip install torch-optimi)")
    try:
        from torchao.optim import _AdamW

        rows["torchao_bf16_sr"] = (
            torch.bfloat16,
            lambda p: _AdamW(p, bf16_stochastic_round=True, **hyper),
        )
    except ImportError:
        print("torchao is not installed: its row is skipped (pip install torchao)")
    return rows


def time_steps(
    optimizer: torch.optim.Optimizer, steps: int, copier: Copier, track: bool
) -> tuple[list[float], list[float], list[float]]:
    """Seconds of each step after two warm-up steps (state allocation, compilation).

    Returns (timed steps, untracked partner steps, the copy timed just before each timed
    step). Every step follows a copy. With ``track`` the steps come in pairs, one with
    EDQ tracking and one without, on the same optimizer and tensors, so that tracked
    step i and untracked step i are neighbours in time (a paired comparison, not two
    runs minutes apart on a noisy host); the order within a pair alternates, so that
    neither side is always the one that follows the copy's cache flush or a drift in
    the host's speed. Without ``track`` the second list is empty.
    """
    for _ in range(2):
        optimizer.step()
    times: dict[bool, list[float]] = {True: [], False: []}
    copies = []
    for index in range(2 * steps if track else steps):
        pair, second = divmod(index, 2)
        tracked = track and (second == pair % 2)  # T U, U T, T U, ...
        if track:
            optimizer.track_edq = tracked
        copy = copier.seconds()
        if tracked or not track:
            copies.append(copy)
        sync(copier.device)
        start = time.perf_counter()
        optimizer.step()
        sync(copier.device)
        times[tracked].append(time.perf_counter() - start)
    if track:
        return times[True], times[False], copies
    return times[False], [], copies


def row(
    name: str,
    numel: int,
    times: list[float],
    partners: list[float],
    copies: list[float],
    copy_bytes: int,
    bandwidth: float,
) -> dict[str, float | str]:
    """One table row: the best step against the floor at ``bandwidth`` (the run's best
    copy), and each step against the floor its preceding copy (of ``copy_bytes``) gives."""
    floor_bytes = FLOOR_BYTES[name.split(" ")[0]]
    floor_seconds = floor_bytes * numel / bandwidth
    best, median = min(times), statistics.median(times)
    paired = [
        t / (floor_bytes * numel * c / copy_bytes) for t, c in zip(times, copies, strict=True)
    ]
    result: dict[str, float | str] = {
        "name": name,
        "ms_per_step": best * 1e3,
        "ms_per_step_median": median * 1e3,
        "gb_per_s": floor_bytes * numel / best / 1e9,
        "floor_ratio": best / floor_seconds,
        "floor_ratio_paired": statistics.median(paired),
        "floor_bytes_per_param": floor_bytes,
        "floor_ms": floor_seconds * 1e3,
    }
    if partners:
        pairs = [a / b for a, b in zip(times, partners, strict=True)]
        result["edq_overhead"] = statistics.median(pairs) - 1.0
        result["edq_overhead_best"] = best / min(partners) - 1.0
    return result


def main() -> None:
    cli = parser(__doc__, steps=(20, "timed steps per row"), device=default_device())
    cli.add_argument("--params", type=float, default=None, help="default 33.6e6 CPU, 1.3e9 GPU")
    cli.add_argument("--tensors", type=int, default=20)
    cli.add_argument("--only", nargs="*", help="row names to run (default: all)")
    args = cli.parse_args()
    total = args.params or (1.3e9 if args.device == "cuda" else 33.6e6)

    copier = Copier(int(total), args.device)
    bandwidth = copier.bandwidth()
    measured = []
    specs = candidates(args.device)
    plans = [(name, spec, False) for name, spec in specs.items()]
    edq_row = ("collage_plus (compiled, EDQ every step)", specs["collage_plus (compiled)"], True)
    plans.append(edq_row)
    plans = [p for p in plans if not args.only or p[0] in args.only]
    for name, (dtype, factory), track in plans:
        params = make_params(total, args.tensors, dtype, args.device)
        numel = sum(p.numel() for p in params)
        optimizer = factory(params)
        bandwidth = max(bandwidth, copier.bandwidth())
        times, partners, copies = time_steps(optimizer, args.steps, copier, track)
        bandwidth = max(bandwidth, copier.bytes / min(copies))
        measured.append((name, numel, times, partners, copies))
        print(f"{name}: best {min(times) * 1e3:.1f} ms", flush=True)
        del optimizer, params
    rows = [row(*entry, copier.bytes, bandwidth) for entry in measured]

    text = table(
        ["optimizer", "bytes/param (floor)", "best ms/step", "median ms/step", "floor ms",
         "effective GB/s", "x floor (best)", "x floor (paired)"],
        (
            [r["name"], r["floor_bytes_per_param"], f"{r['ms_per_step']:.1f}",
             f"{r['ms_per_step_median']:.1f}", f"{r['floor_ms']:.1f}", f"{r['gb_per_s']:.1f}",
             f"{r['floor_ratio']:.2f}", f"{r['floor_ratio_paired']:.2f}"]
            for r in rows
        ),
    )  # fmt: skip
    text += "".join(
        f"\n\nEDQ on every step: {r['edq_overhead']:+.1%} against the same optimizer's "
        f"untracked steps (median of {args.steps} adjacent pairs; best against best: "
        f"{r['edq_overhead_best']:+.1%})."
        for r in rows
        if "edq_overhead" in r
    )
    publish(
        args,
        text,
        rows,
        "Optimizer step against the memory-bandwidth floor",
        f"{total / 1e6:.1f}M parameters in {args.tensors} tensors on {args.device}; copy "
        f"bandwidth (read + write) {bandwidth / 1e9:.1f} GB/s, the best copy of the run "
        f"(one copy timed before every step); {args.steps} timed steps per row; paired: "
        "median over steps of step time / the floor at the preceding copy's bandwidth.",
    )


if __name__ == "__main__":
    main()
