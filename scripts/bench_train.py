"""Training benchmark: throughput, MFU, memory, losses and the largest micro-batch, per strategy.

For one model preset, each precision strategy runs the real CLI in its own process
(so its peak memory is its own), side by side in one script run, with the same seed and
data order:

- tokens/s and MFU at the configured micro-batch; with ``--repeats N`` every strategy
  runs N times in rotating order and tokens/s is the median over the repeats with its
  min-max range (a shared machine's speed drifts between runs), and whether the final
  loss was the same in every repeat;
- peak memory (CUDA: max allocated; CPU: process peak RSS), the measured model-state
  bytes per parameter and the final training and validation losses;
- the largest micro-batch that fits the memory budget, found by doubling then bisection
  (each trial a short run in its own process; on a GPU the budget is the card, and a
  trial that runs out of memory does not fit; on CPU ``--mem-budget-gb`` bounds the
  peak RSS), and tokens/s at that micro-batch (``--no-search`` skips it);
- ratios against ``--baseline`` (default ``mixed_fp32``; the Collage paper,
  arXiv:2405.03637: 15-23% less memory, up to 3.7x throughput, mostly from the larger
  micro-batch the saved memory allows).

``--strategies`` takes strategy names or a set: ``all`` (every strategy, the default)
or ``basic`` (fp32, mixed_fp32 and bf16). ``--compile`` adds a ``train.compile=true``
row per strategy. On CPU MFU is against the bf16 matmul rate measured in the same run
(no data-sheet peak exists for a CPU); on a GPU against the dense bf16 peak of the card.

    python scripts/bench_train.py --model gpt_tiny --steps 20 --json train.json
    python scripts/bench_train.py --strategies basic --repeats 3 --no-search
    python scripts/bench_train.py --model gpt_1.3b --seq-len 2048 --micro-batch 8 --compile

The table is printed and appended to docs/results-history.md (``--no-record`` to skip).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from common import STRATEGIES, default_device, parser, publish, ratio, table
from runs import quiet_run, run_training

SETS = {"all": STRATEGIES, "basic": ("fp32", "mixed_fp32", "bf16")}


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


def strategies(names: list[str]) -> list[str]:
    """The strategies ``names`` gives, sets (``SETS``) expanded, each once, in order."""
    out: list[str] = []
    for name in names:
        out += [s for s in SETS.get(name, (name,)) if s not in out]
    return out


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
            "train.eval_batches=1",
            "data.val_fraction=0.05",  # validation must fill one of the largest micro-batches
            f"train.device={self.args.device}",
            *quiet_run(steps),
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


def summarise(name: str, runs: list[dict]) -> dict:
    """One row from a configuration's repeated runs: the median tokens/s with its range,
    the rest from the first run."""
    first, speeds = runs[0], sorted(r["tokens_per_s"] for r in runs)
    return {
        "strategy": name,
        "tokens_per_s": statistics.median(speeds),
        "tokens_per_s_range": [speeds[0], speeds[-1]],
        "repeats": len(runs),
        "same_loss_every_repeat": len({r["final_train_loss"] for r in runs}) == 1,
        "mfu": first["mfu"],
        "peak_mem_bytes": first["peak_mem_bytes"],
        "state_bytes_per_param": first["state_bytes_per_param"],
        "final_train_loss": first["final_train_loss"],
        "final_val_loss": first["final_val_loss"],
        "max_micro_batch": None,
        "tokens_per_s_at_max": None,
    }


def measure(runner: Runner, configs: list[tuple[str, bool]]) -> list[dict]:
    """Every configuration ``--repeats`` times in rotating order, then its micro-batch
    search; one row each."""
    args = runner.args
    runs: dict[tuple[str, bool], list[dict]] = {config: [] for config in configs}
    for repeat in range(args.repeats):
        shift = repeat % len(configs)
        for precision, compiled in configs[shift:] + configs[:shift]:
            print(f"[{repeat + 1}/{args.repeats}] {precision}, compile {compiled}", flush=True)
            extra = ["train.compile=true"] if compiled else []
            runs[precision, compiled].append(
                runner.run(precision, args.micro_batch, args.steps, extra)
            )
    rows = []
    for (precision, compiled), done in runs.items():
        row = summarise(precision + (" + compile" if compiled else ""), done)
        if not args.no_search:
            extra = ["train.compile=true"] if compiled else []
            best = runner.max_micro_batch(precision, extra)
            row["max_micro_batch"] = best
            if best:
                at_max = runner.run(precision, best, args.steps, extra)
                row["tokens_per_s_at_max"] = at_max["tokens_per_s"]
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def render(rows: list[dict], baseline: str) -> str:
    """The table: the range and loss-check columns with repeats, the search's columns
    where it ran, ratios against ``baseline``'s row."""
    base = next((r for r in rows if r["strategy"] == baseline), rows[0])
    repeated = any(r["repeats"] > 1 for r in rows)
    searched = any(r["max_micro_batch"] is not None for r in rows)
    header = ["strategy", "tokens/s" + (" (median)" if repeated else "")]
    header += ["range", "same loss each repeat"] if repeated else []
    header += ["MFU", "peak mem GB", "state B/param", "final train loss", "final val loss"]
    header += ["max micro-batch", "tokens/s at max"] if searched else []
    header += [f"x {baseline} tokens/s", "x peak mem"]
    header += ["x max micro-batch", "x tokens/s at max"] if searched else []
    cells = []
    for r in rows:
        low, high = r["tokens_per_s_range"]
        line = [r["strategy"], f"{r['tokens_per_s']:,.0f}"]
        line += [
            f"{low:,.0f}-{high:,.0f}",
            "yes" if r["same_loss_every_repeat"] else "no",
        ] * repeated
        line += [
            f"{r['mfu']:.1%}" if r["mfu"] is not None else "-",
            f"{r['peak_mem_bytes'] / 1e9:.2f}",
            f"{r['state_bytes_per_param']:.2f}",
            f"{r['final_train_loss']:.4f}",
            f"{r['final_val_loss']:.4f}",
        ]
        at_max = f"{r['tokens_per_s_at_max']:,.0f}" if r["tokens_per_s_at_max"] else "-"
        best = r["max_micro_batch"]
        line += [best if best is not None else "-", at_max] * searched
        line += [
            ratio(r["tokens_per_s"], base["tokens_per_s"]),
            ratio(r["peak_mem_bytes"], base["peak_mem_bytes"]),
        ]
        line += [
            ratio(best, base["max_micro_batch"]),
            ratio(r["tokens_per_s_at_max"], base["tokens_per_s_at_max"]),
        ] * searched
        cells.append(line)
    return table(header, cells)


def main() -> None:
    cli = parser(
        __doc__,
        model="gpt_tiny",
        steps=(20, "steps of each timed run"),
        repeats=1,
        seq_len=256,
        device=default_device(),
        overrides=True,
    )
    cli.add_argument(
        "--strategies", nargs="+", default=["all"], help=f"strategies or sets: {', '.join(SETS)}"
    )
    cli.add_argument("--baseline", default="mixed_fp32", help="the ratios' denominator")
    cli.add_argument("--micro-batch", type=int, default=8)
    cli.add_argument("--max-search", type=int, default=256, help="largest micro-batch tried")
    cli.add_argument("--mem-budget-gb", type=float, default=None, help="CPU: peak RSS cap")
    cli.add_argument("--no-search", action="store_true", help="skip the micro-batch search")
    cli.add_argument("--compile", action="store_true", help="add train.compile=true rows")
    args = cli.parse_args()
    if args.device == "cpu" and not args.no_search and args.mem_budget_gb is None:
        cli.error("on CPU the micro-batch search needs --mem-budget-gb (or --no-search)")
    if args.repeats < 1:
        cli.error("--repeats must be at least 1")
    names = strategies(args.strategies)
    if args.baseline not in names:
        cli.error(f"--baseline {args.baseline} is not among --strategies")

    peak = cpu_matmul_tflops() if args.device == "cpu" else None
    configs = [(p, c) for p in names for c in ((False, True) if args.compile else (False,))]
    with tempfile.TemporaryDirectory(prefix="bench_train_") as tmp:
        rows = measure(Runner(args, Path(tmp), peak), configs)
    budget = (
        f"peak-RSS budget {args.mem_budget_gb} GB"
        if args.mem_budget_gb
        else "budget: the device's memory"
    )
    search = (
        "no micro-batch search"
        if args.no_search
        else (f"largest micro-batch by doubling and bisection ({budget})")
    )
    mfu_basis = (
        f"MFU against the measured bf16 matmul rate of this CPU ({peak:.2f} TFLOP/s)"
        if peak
        else "MFU against the card's dense bf16 peak"
    )
    publish(
        args,
        render(rows, args.baseline),
        rows,
        f"Training benchmark, {args.model}",
        f"Sequence {args.seq_len}, micro-batch {args.micro_batch}, {args.steps} steps per "
        f"timed run, {args.repeats} run(s) of each strategy in rotating order (tokens/s "
        f"the median, the first step excluded); same seed and data order; {search}; "
        f"{mfu_basis}; ratios against {args.baseline}.",
    )


if __name__ == "__main__":
    main()
