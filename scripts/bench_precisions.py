"""Train the same model with each precision strategy, side by side, and compare.

Each strategy runs the real CLI in its own process (so peak memory is its own) with
the same seed, data order and steps; the table reports throughput, measured model-state
bytes per parameter, peak memory and losses, with ratios against a baseline strategy.
Runs are repeated in rotating order and throughput is the median over repeats (with
its min-max range), because a shared 2-core machine's speed drifts between runs.

    python scripts/bench_precisions.py --steps 20 --repeats 3
    python scripts/bench_precisions.py --model gpt_125m --steps 100 --json out.json

The table is printed and appended to docs/results-history.md (``--no-append`` to skip).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from runs import append_results, run_training


def run_strategy(precision: str, args: argparse.Namespace, run_dir: Path) -> dict:
    overrides = [
        f"model={args.model}",
        f"precision={precision}",
        f"train.max_steps={args.steps}",
        f"train.eval_every={args.steps}",
        f"train.checkpoint_every={args.steps}",
        f"logging.log_every={args.steps}",
        "logging.console=none",
        "logging.wandb.mode=disabled",
        "train.export_hf=false",
        *args.overrides,
    ]
    summary, _ = run_training(overrides, run_dir)
    return summary


def summarise(runs: list[dict]) -> dict:
    """One row per strategy: median throughput over repeats, the rest from the first run."""
    speeds = sorted(r["tokens_per_s"] for r in runs)
    return {
        **runs[0],
        "tokens_per_s": statistics.median(speeds),
        "tokens_per_s_range": [speeds[0], speeds[-1]],
        "repeats": len(runs),
        "deterministic_loss": len({r["final_train_loss"] for r in runs}) == 1,
    }


def table(rows: list[dict], baseline: str) -> str:
    base = next(r for r in rows if r["precision"] == baseline)
    lines = [
        f"| precision | tokens/s (median) | range | x {baseline} | state B/param | peak mem GB "
        f"| x {baseline} | final train loss | final val loss |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        low, high = r["tokens_per_s_range"]
        lines.append(
            f"| {r['precision']} | {r['tokens_per_s']:,.0f} | {low:,.0f}-{high:,.0f} "
            f"| {r['tokens_per_s'] / base['tokens_per_s']:.2f} "
            f"| {r['state_bytes_per_param']:g} | {r['peak_mem_bytes'] / 2**30:.2f} "
            f"| {r['peak_mem_bytes'] / base['peak_mem_bytes']:.2f} "
            f"| {r['final_train_loss']:.4f} | {r['final_val_loss']:.4f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt_tiny")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--precisions", nargs="+", default=["fp32", "mixed_fp32", "bf16"])
    parser.add_argument("--baseline", default="mixed_fp32")
    parser.add_argument("--json", type=Path, help="also write the rows as JSON here")
    parser.add_argument("--no-append", action="store_true", help="skip docs/results-history.md")
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides for every run")
    args = parser.parse_args()
    if args.baseline not in args.precisions:
        parser.error(f"--baseline {args.baseline} is not among --precisions")

    runs: dict[str, list[dict]] = {p: [] for p in args.precisions}
    with tempfile.TemporaryDirectory() as root:
        for repeat in range(args.repeats):
            shift = repeat % len(args.precisions)
            for precision in args.precisions[shift:] + args.precisions[:shift]:
                print(
                    f"[{repeat + 1}/{args.repeats}] {args.model} with {precision}, "
                    f"{args.steps} steps ...",
                    flush=True,
                )
                run_dir = Path(root) / f"{precision}-{repeat}"
                runs[precision].append(run_strategy(precision, args, run_dir))
    rows = [summarise(runs[p]) for p in args.precisions]
    result = table(rows, args.baseline)
    print(result)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    if not args.no_append:
        append_results(
            "Precision strategies side by side",
            f"{args.model}, {args.steps} steps, same seed and data order; each run in its own "
            f"process, {args.repeats} repeats in rotating order; throughput excludes the first "
            "step and is the median over repeats.",
            result,
        )


if __name__ == "__main__":
    main()
