"""Training benchmark: throughput, MFU, memory and the largest micro-batch, per strategy.

For one model preset, each precision strategy runs the real CLI in its own process
(so its peak memory is its own), side by side in one script run:

- tokens/s and MFU at the configured micro-batch;
- peak memory (CUDA: max allocated; CPU: process peak RSS) and the measured model-state
  bytes per parameter;
- the largest micro-batch that fits the memory budget, found by doubling then bisection
  (each trial a short run in its own process; on a GPU the budget is the card, and a
  trial that runs out of memory does not fit; on CPU ``--mem-budget-gb`` bounds the
  peak RSS), and tokens/s at that micro-batch;
- ratios against ``mixed_fp32`` (the paper: 15-23% less memory, up to 3.7x throughput,
  mostly from the larger micro-batch the saved memory allows).

``--compile`` adds a ``train.compile=true`` row per strategy. On CPU MFU is against the
bf16 matmul rate measured in the same run (no data-sheet peak exists for a CPU); on a
GPU against the dense bf16 peak of the card.

    python scripts/bench_train.py --model gpt_tiny --steps 20 --json train.json
    python scripts/bench_train.py --model gpt_1.3b --seq-len 2048 --micro-batch 8 --compile

The table is printed and appended to docs/results-history.md (``--no-append`` to skip).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
from runs import append_results, run_training

STRATEGIES = (
    "mixed_fp32",
    "bf16_moments",
    "bf16",
    "bf16_sr",
    "bf16_kahan",
    "adamw_8bit",
    "collage_light",
    "collage_plus",
    "collage_8bit",
    "scalify",
    "scalify_fp32_params",
)
BASELINE = "mixed_fp32"


def cpu_matmul_tflops(size: int = 1024, repeats: int = 5) -> float:
    """Achieved bf16 matmul TFLOP/s on this CPU (the MFU denominator on CPU)."""
    a = torch.randn(size, size).bfloat16()
    b = torch.randn(size, size).bfloat16()
    a @ b
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best / 1e12


class Runner:
    """Runs one short training job per call, in a fresh directory."""

    def __init__(self, args: argparse.Namespace, workdir: Path, peak_tflops: float | None):
        self.args = args
        self.workdir = workdir
        self.peak_tflops = peak_tflops
        self.count = 0

    def run(self, precision: str, micro_batch: int, steps: int, extra: list[str]) -> dict:
        self.count += 1
        overrides = [
            f"model={self.args.model}",
            f"precision={precision}",
            f"data.seq_len={self.args.seq_len}",
            f"train.micro_batch_size={micro_batch}",
            f"train.global_batch_size={micro_batch}",
            f"train.max_steps={steps}",
            f"train.eval_every={steps}",
            "train.eval_batches=1",
            "data.val_fraction=0.05",  # validation must fill one of the largest micro-batches
            f"train.checkpoint_every={steps}",
            f"train.device={self.args.device}",
            f"logging.log_every={steps}",
            "logging.console=none",
            "logging.plots=false",
            "logging.wandb.mode=disabled",
            "train.export_hf=false",
            *([f"metrics.peak_tflops={self.peak_tflops}"] if self.peak_tflops else []),
            *extra,
            *self.args.overrides,
        ]
        summary, _ = run_training(overrides, self.workdir / f"run{self.count}")
        return summary

    def fits(self, precision: str, micro_batch: int, extra: list[str]) -> tuple[bool, dict]:
        """Whether a short run at ``micro_batch`` stays inside the memory budget."""
        try:
            # as many steps as the timed runs: the host's peak RSS grows over the first steps
            summary = self.run(precision, micro_batch, self.args.steps, extra)
        except RuntimeError as error:
            if "out of memory" in str(error):
                return False, {}
            raise
        budget = self.args.mem_budget_gb * 2**30 if self.args.mem_budget_gb else None
        return budget is None or summary["peak_mem_bytes"] <= budget, summary

    def max_micro_batch(self, precision: str, extra: list[str]) -> int:
        """Largest micro-batch that fits: double until a failure, then bisect."""
        cap = self.args.max_search
        good, bad = 0, None
        candidate = 1
        while bad is None:
            if not self.fits(precision, candidate, extra)[0]:
                bad = candidate
            elif candidate >= cap:
                return candidate  # the search cap fits
            else:
                good, candidate = candidate, min(candidate * 2, cap)
        while bad - good > 1:
            middle = (good + bad) // 2
            if self.fits(precision, middle, extra)[0]:
                good = middle
            else:
                bad = middle
        return good


def bench_row(runner: Runner, precision: str, compile_model: bool) -> dict:
    args = runner.args
    extra = ["train.compile=true"] if compile_model else []
    summary = runner.run(precision, args.micro_batch, args.steps, extra)
    row = {
        "strategy": precision + (" + compile" if compile_model else ""),
        "tokens_per_s": summary["tokens_per_s"],
        "mfu": summary["mfu"],
        "peak_mem_bytes": summary["peak_mem_bytes"],
        "state_bytes_per_param": summary["state_bytes_per_param"],
        "max_micro_batch": None,
        "tokens_per_s_at_max": None,
    }
    if not args.no_search:
        best = runner.max_micro_batch(precision, extra)
        row["max_micro_batch"] = best
        if best:
            row["tokens_per_s_at_max"] = runner.run(precision, best, args.steps, extra)[
                "tokens_per_s"
            ]
    print(json.dumps(row), flush=True)
    return row


def ratio(value: float | None, base: float | None) -> str:
    return f"{value / base:.2f}" if value and base else "-"


def table(rows: list[dict]) -> str:
    base = next((r for r in rows if r["strategy"] == BASELINE), rows[0])
    lines = [
        "| strategy | tokens/s | MFU | peak mem GB | state B/param | max micro-batch | "
        "tokens/s at max | x tokens/s | x peak mem | x max micro-batch | x tokens/s at max |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "-"
        at_max = f"{r['tokens_per_s_at_max']:.0f}" if r["tokens_per_s_at_max"] else "-"
        lines.append(
            f"| {r['strategy']} | {r['tokens_per_s']:.0f} | {mfu} | "
            f"{r['peak_mem_bytes'] / 1e9:.2f} | {r['state_bytes_per_param']:.2f} | "
            f"{r['max_micro_batch'] if r['max_micro_batch'] is not None else '-'} | {at_max} | "
            f"{ratio(r['tokens_per_s'], base['tokens_per_s'])} | "
            f"{ratio(r['peak_mem_bytes'], base['peak_mem_bytes'])} | "
            f"{ratio(r['max_micro_batch'], base['max_micro_batch'])} | "
            f"{ratio(r['tokens_per_s_at_max'], base['tokens_per_s_at_max'])} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt_tiny")
    parser.add_argument("--strategies", nargs="*", default=list(STRATEGIES))
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20, help="steps of each timed run")
    parser.add_argument("--max-search", type=int, default=256, help="largest micro-batch tried")
    parser.add_argument("--mem-budget-gb", type=float, default=None, help="CPU: peak RSS cap")
    parser.add_argument("--no-search", action="store_true", help="skip the micro-batch search")
    parser.add_argument("--compile", action="store_true", help="add train.compile=true rows")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", type=Path, help="also write the rows as JSON")
    parser.add_argument("--no-append", action="store_true", help="skip docs/results-history.md")
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides for every run")
    args = parser.parse_args()
    if args.device == "cpu" and not args.no_search and args.mem_budget_gb is None:
        parser.error("on CPU the micro-batch search needs --mem-budget-gb (or --no-search)")

    peak = cpu_matmul_tflops() if args.device == "cpu" else None
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_train_") as tmp:
        runner = Runner(args, Path(tmp), peak)
        for precision in args.strategies:
            for compile_model in (False, True) if args.compile else (False,):
                rows.append(bench_row(runner, precision, compile_model))
    text = table(rows)
    print(text)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    if not args.no_append:
        budget = (
            f"peak-RSS budget {args.mem_budget_gb} GB"
            if args.mem_budget_gb
            else "budget: the device's memory"
        )
        mfu_basis = (
            f"MFU against the measured bf16 matmul rate of this CPU ({peak:.2f} TFLOP/s)"
            if peak
            else "MFU against the card's dense bf16 peak"
        )
        append_results(
            f"Training benchmark, {args.model}",
            f"Sequence {args.seq_len}, micro-batch {args.micro_batch}, {args.steps} steps per "
            f"timed run; largest micro-batch by doubling and bisection ({budget}); "
            f"{mfu_basis}; ratios against {BASELINE}.",
            text,
        )


if __name__ == "__main__":
    main()
