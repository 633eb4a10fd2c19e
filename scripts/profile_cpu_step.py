"""Where a CPU training step spends its time: torch profiler, op by op, beside fp32.

Builds the real trainer (default run: gpt_tiny, embedded corpus) for each precision
given, runs warm-up steps, profiles one optimizer step and prints the ops with the most
self time next to the same op's time in the fp32 run, so that an op that is slow only in
bf16 stands out. Run it under a restricted instruction set to see what an AVX2-only CPU
pays:

    ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 \\
        python scripts/profile_cpu_step.py mixed_fp32 train.cpu_bf16_gemm=fp32
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from common import parser, table
from runs import quiet_run
from torch.profiler import profile

from collage_train.compose import compose_job
from collage_train.trainer import Trainer


def op_times(precision: str, overrides: list[str], warmup: int) -> dict[str, float]:
    """Self CPU milliseconds per op over one profiled optimizer step."""
    cfg = compose_job([f"precision={precision}", *quiet_run(warmup + 1), *overrides])
    with tempfile.TemporaryDirectory() as tmp:
        trainer = Trainer(cfg, Path(tmp))
        print(trainer.describe())
        for _ in range(warmup):
            trainer.train_step()
        with profile() as prof:
            trainer.train_step()
    return {e.key: e.self_cpu_time_total / 1e3 for e in prof.key_averages()}


def main() -> None:
    cli = parser(__doc__, json=False, record=False)
    cli.add_argument("precision", help="the strategy to profile beside fp32")
    cli.add_argument("overrides", nargs="*", help="Hydra overrides for both runs")
    cli.add_argument("--top", type=int, default=15)
    cli.add_argument("--warmup", type=int, default=2)
    args = cli.parse_args()
    print(f"torch CPU capability: {torch.backends.cpu.get_cpu_capability()}")
    baseline = op_times("fp32", args.overrides, args.warmup)
    times = op_times(args.precision, args.overrides, args.warmup)
    top = sorted(times.items(), key=lambda item: -item[1])[: args.top]
    rows = [[name[:60], f"{ms:.1f}", f"{baseline.get(name, 0.0):.1f}"] for name, ms in top]
    rows.append(["total", f"{sum(times.values()):.1f}", f"{sum(baseline.values()):.1f}"])
    print("\n" + table(["op", f"{args.precision} ms", "fp32 ms"], rows))


if __name__ == "__main__":
    main()
