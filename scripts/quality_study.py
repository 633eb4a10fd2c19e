"""Quality study: every precision strategy x beta2 on the same tiny model, same data order.

For each strategy (fp32, mixed_fp32, split_fp32, bf16, collage_light, collage_plus, scalify,
scalify_fp32_params: every configs/precision option) and each beta2 (0.95, 0.999) it trains
``--model`` (default gpt_tiny; llama_tiny for the Llama family) on the embedded corpus, with
an lr schedule that decays 100x (so that late updates fall below bf16's rounding), and
reports the final validation loss, the mean normalised EDQ and the mean lost-update
fraction over the run.
With ``--seeds N`` every cell is trained with N seeds (train.seed = 1..N: initialisation
and data order) and reported as the mean and the sample standard deviation, so that a
difference between strategies can be told from seed noise.

    python scripts/quality_study.py                 # 300 steps a run, about an hour on 2 cores
    python scripts/quality_study.py --steps 150     # a quicker look
    python scripts/quality_study.py --model llama_tiny --seeds 3

The table is printed and appended to docs/RESULTS.md (``--no-append`` to skip).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from runs import append_results, run_training

STRATEGIES = (
    "fp32",
    "mixed_fp32",
    "split_fp32",
    "bf16",
    "collage_light",
    "collage_plus",
    "scalify",
    "scalify_fp32_params",
)


def study_run(
    precision: str, beta2: float, args: argparse.Namespace, run_dir: Path, seed: int | None = None
) -> dict:
    overrides = [
        f"model={args.model}",
        f"precision={precision}",
        f"optim.betas=[0.9,{beta2}]",
        f"optim.lr={args.lr}",
        f"optim.min_lr={args.lr / 100}",
        f"train.max_steps={args.steps}",
        f"train.eval_every={args.steps}",
        f"train.eval_batches={args.eval_batches}",
        f"train.checkpoint_every={args.steps}",
        f"logging.log_every={args.edq_every}",
        "logging.console=none",
        "logging.wandb.mode=disabled",
        "train.export_hf=false",
        *([f"train.seed={seed}"] if seed is not None else []),
        *args.overrides,
    ]
    summary, records = run_training(overrides, run_dir)
    descent = [r for r in records if "edq_normalized" in r]
    late = descent[len(descent) // 2 :]
    return {
        "precision": precision,
        "beta2": beta2,
        "seed": seed,
        "final_val_loss": summary["final_val_loss"],
        "final_train_loss": summary["final_train_loss"],
        "mean_edq_normalized": statistics.fmean(r["edq_normalized"] for r in descent),
        "mean_lost_update_frac": statistics.fmean(r["lost_update_frac"] for r in descent),
        "late_lost_update_frac": statistics.fmean(r["lost_update_frac"] for r in late),
        "state_bytes_per_param": summary["state_bytes_per_param"],
    }


def table(rows: list[dict]) -> str:
    lines = [
        "| precision | beta2 | final val loss | final train loss | mean EDQ (normalised) "
        "| mean lost-update frac | lost frac, 2nd half | state B/param |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['precision']} | {r['beta2']} | {r['final_val_loss']:.4f} "
            f"| {r['final_train_loss']:.4f} | {r['mean_edq_normalized']:.3f} "
            f"| {r['mean_lost_update_frac']:.3f} | {r['late_lost_update_frac']:.3f} "
            f"| {r['state_bytes_per_param']:g} |"
        )
    return "\n".join(lines)


MEASURES = (
    "final_val_loss",
    "final_train_loss",
    "mean_edq_normalized",
    "mean_lost_update_frac",
    "late_lost_update_frac",
)


def aggregate(rows: list[dict]) -> list[dict]:
    """One row per (precision, beta2): each measure's mean and sample standard deviation."""
    cells: dict[tuple[str, float], list[dict]] = {}
    for row in rows:
        cells.setdefault((row["precision"], row["beta2"]), []).append(row)
    out = []
    for (precision, beta2), runs in cells.items():
        cell = {"precision": precision, "beta2": beta2, "seeds": len(runs)}
        for key in MEASURES:
            values = [r[key] for r in runs]
            cell[key] = statistics.fmean(values)
            cell[f"{key}_sd"] = statistics.stdev(values) if len(values) > 1 else 0.0
        cell["state_bytes_per_param"] = runs[0]["state_bytes_per_param"]
        out.append(cell)
    return out


def seeds_table(cells: list[dict]) -> str:
    """Mean +- sample standard deviation over seeds of each measure."""
    lines = [
        "| precision | beta2 | seeds | final val loss | final train loss | mean EDQ (normalised) "
        "| mean lost-update frac | lost frac, 2nd half | state B/param |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for c in cells:
        lines.append(
            f"| {c['precision']} | {c['beta2']} | {c['seeds']} "
            f"| {c['final_val_loss']:.4f} ± {c['final_val_loss_sd']:.4f} "
            f"| {c['final_train_loss']:.4f} ± {c['final_train_loss_sd']:.4f} "
            f"| {c['mean_edq_normalized']:.3f} ± {c['mean_edq_normalized_sd']:.3f} "
            f"| {c['mean_lost_update_frac']:.3f} ± {c['mean_lost_update_frac_sd']:.3f} "
            f"| {c['late_lost_update_frac']:.3f} ± {c['late_lost_update_frac_sd']:.3f} "
            f"| {c['state_bytes_per_param']:g} |"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt_tiny")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--lr", type=float, default=1e-3, help="peak lr; it decays to lr/100")
    parser.add_argument("--edq-every", type=int, default=10)
    parser.add_argument("--eval-batches", type=int, default=32)
    parser.add_argument("--beta2", type=float, nargs="+", default=[0.95, 0.999])
    parser.add_argument("--precisions", nargs="+", default=list(STRATEGIES))
    parser.add_argument(
        "--seeds", type=int, default=1, help="seeds per cell (train.seed 1..N); mean +- sd"
    )
    parser.add_argument(
        "--json", type=Path, help="also write the rows as JSON here (rewritten after every run)"
    )
    parser.add_argument("--no-append", action="store_true", help="do not touch docs/RESULTS.md")
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides for every run")
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()

    rows = []
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as root:
        for beta2 in args.beta2:
            for precision in args.precisions:
                for seed in range(1, args.seeds + 1) if args.seeds > 1 else [None]:
                    print(
                        f"{precision}, beta2 {beta2}, seed {seed}, {args.steps} steps ...",
                        flush=True,
                    )
                    run_dir = Path(root) / f"{precision}-{beta2}-{seed}"
                    rows.append(study_run(precision, beta2, args, run_dir, seed))
                    if args.json:  # after every run: a stopped study keeps what it measured
                        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    result = table(rows) if args.seeds == 1 else seeds_table(aggregate(rows))
    print(result)
    if not args.no_append:
        minutes = (time.perf_counter() - start) / 60
        append_results(
            "Quality study: precision strategies x beta2",
            f"{args.model} on the embedded corpus, {args.steps} steps, peak lr {args.lr} "
            f"decaying to {args.lr / 100} (cosine), "
            + (
                "same seed and data order for every run; "
                if args.seeds == 1
                else f"seeds 1..{args.seeds} per cell (mean ± sample sd); "
            )
            + f"EDQ every {args.edq_every} steps; validation on {args.eval_batches} held-out "
            f"batches. Took {minutes:.0f} min.",
            result,
        )


if __name__ == "__main__":
    main()
