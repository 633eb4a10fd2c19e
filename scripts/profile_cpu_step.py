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

import argparse
import tempfile
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from torch.profiler import profile

from collage_train.cli import config_dir
from collage_train.config import register_schemas
from collage_train.trainer import Trainer


def op_times(precision: str, overrides: list[str], warmup: int) -> dict[str, float]:
    """Self CPU milliseconds per op over one profiled optimizer step."""
    quiet = ["logging.console=none", "logging.wandb.mode=disabled", "train.export_hf=false"]
    with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
        cfg = compose("config", overrides=[f"precision={precision}", *quiet, *overrides])
    with tempfile.TemporaryDirectory() as tmp:
        trainer = Trainer(cfg, Path(tmp))
        print(trainer.describe())
        for _ in range(warmup):
            trainer.train_step()
        with profile() as prof:
            trainer.train_step()
    return {e.key: e.self_cpu_time_total / 1e3 for e in prof.key_averages()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("precision", help="the strategy to profile beside fp32")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for both runs")
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    register_schemas()
    print(f"torch CPU capability: {torch.backends.cpu.get_cpu_capability()}")
    baseline = op_times("fp32", args.overrides, args.warmup)
    times = op_times(args.precision, args.overrides, args.warmup)
    print(f"\n| op | {args.precision} ms | fp32 ms |\n|---|---|---|")
    for name, ms in sorted(times.items(), key=lambda item: -item[1])[: args.top]:
        print(f"| {name[:60]} | {ms:.1f} | {baseline.get(name, 0.0):.1f} |")
    print(f"| total | {sum(times.values()):.1f} | {sum(baseline.values()):.1f} |")


if __name__ == "__main__":
    main()
