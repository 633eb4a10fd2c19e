"""Quality study (the arena): every precision strategy x beta2 x model, same data order.

For each strategy (every configs/precision option: fp32, mixed_fp32, split_fp32,
bf16_moments, bf16, bf16_sr, bf16_kahan, adamw_8bit, collage_light, collage_plus,
collage_8bit, scalify, scalify_fp32_params), each beta2 (0.95, 0.999) and each
``--models`` entry (default gpt_tiny; llama_tiny for the Llama family) it trains on the
embedded corpus with an lr schedule that decays 100x (so that late updates fall below
bf16's rounding), and reports the final validation loss, the mean normalised EDQ, the
mean lost-update fraction, the measured state bytes per parameter and the median step
time. With ``--seeds N`` every cell is trained with N seeds (train.seed = 1..N:
initialisation and data order) and reported as the mean and the sample standard
deviation, and, where fp32 is in the grid, as the mean and sd of the seed-by-seed
difference from fp32's validation loss (the same seed is the same data order and
initialisation, so the pairing removes most of the seed noise).

    python scripts/quality_study.py                 # 300 steps a run, hours on 2 cores
    python scripts/quality_study.py --steps 100 --models gpt_tiny llama_tiny --seeds 3
    python scripts/quality_study.py --steps 1000 --beta2 0.999 \
        --precisions fp32 bf16 bf16_sr collage_8bit bf16_kahan adamw_8bit collage_light

With ``--json PATH`` every finished run is written there at once and a study started
again with the same file skips the runs it already holds, so a stopped study resumes.
The table is printed and appended to docs/results-history.md (``--no-record`` to skip).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from common import STRATEGIES, append_results, parser, table
from runs import quiet_run, run_training


def study_run(
    precision: str,
    beta2: float,
    args: argparse.Namespace,
    run_dir: Path,
    seed: int | None = None,
    model: str = "gpt_tiny",
) -> dict:
    overrides = [
        f"model={model}",
        f"precision={precision}",
        f"optim.betas=[0.9,{beta2}]",
        f"optim.lr={args.lr}",
        f"optim.min_lr={args.lr / 100}",
        f"train.eval_batches={args.eval_batches}",
        *quiet_run(args.steps, log_every=args.edq_every),
        *([f"train.seed={seed}"] if seed is not None else []),
        *args.overrides,
    ]
    summary, records = run_training(overrides, run_dir)
    descent = [r for r in records if "edq_normalized" in r]
    late = descent[len(descent) // 2 :]
    step_times = sorted(r["step_time_s"] for r in records if "step_time_s" in r)
    return {
        "model": model,
        "steps": args.steps,
        "precision": precision,
        "beta2": beta2,
        "seed": seed,
        "step_time_s": step_times[len(step_times) // 2] if step_times else None,
        "final_val_loss": summary["final_val_loss"],
        "final_train_loss": summary["final_train_loss"],
        "mean_edq_normalized": statistics.fmean(r["edq_normalized"] for r in descent),
        "mean_lost_update_frac": statistics.fmean(r["lost_update_frac"] for r in descent),
        "late_lost_update_frac": statistics.fmean(r["lost_update_frac"] for r in late),
        "state_bytes_per_param": summary["state_bytes_per_param"],
    }


MEASURES = (
    "final_val_loss",
    "final_train_loss",
    "mean_edq_normalized",
    "mean_lost_update_frac",
    "late_lost_update_frac",
)


def _mean_sd(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def aggregate(rows: list[dict], reference: str = "fp32") -> list[dict]:
    """One row per (model, precision, beta2): each measure's mean and sample standard
    deviation, and the mean and sd of the seed-by-seed difference of the final validation
    loss from ``reference``'s run with the same model, beta2 and seed (``val_diff``;
    None where the reference did not run)."""
    cells: dict[tuple[str, str, float], list[dict]] = {}
    for row in rows:
        key = (row.get("model", "gpt_tiny"), row["precision"], row["beta2"])
        cells.setdefault(key, []).append(row)
    out = []
    for (model, precision, beta2), runs in cells.items():
        cell = {"model": model, "precision": precision, "beta2": beta2, "seeds": len(runs)}
        for key in MEASURES:
            cell[key], cell[f"{key}_sd"] = _mean_sd([r[key] for r in runs])
        cell["state_bytes_per_param"] = runs[0]["state_bytes_per_param"]
        times = [r["step_time_s"] for r in runs if r.get("step_time_s") is not None]
        cell["step_time_s"] = statistics.median(times) if times else None
        base = {r["seed"]: r["final_val_loss"] for r in cells.get((model, reference, beta2), [])}
        diffs = [r["final_val_loss"] - base[r["seed"]] for r in runs if r["seed"] in base]
        cell["val_diff"], cell["val_diff_sd"] = _mean_sd(diffs) if diffs else (None, None)
        out.append(cell)
    return out


def seeds_table(cells: list[dict]) -> str:
    """Mean +- sample standard deviation over seeds of each measure, the paired difference
    from fp32 and the median step time."""

    def line(c: dict) -> list[object]:
        diff = (
            f"{c['val_diff']:+.4f} ± {c['val_diff_sd']:.4f}"
            if c.get("val_diff") is not None
            else "n/a"
        )
        step_time = f"{c['step_time_s']:.3f}" if c.get("step_time_s") is not None else "n/a"
        spread = [
            f"{c[key]:{form}} ± {c[f'{key}_sd']:{form}}"
            for key, form in (
                ("final_val_loss", ".4f"),
                ("final_train_loss", ".4f"),
                ("mean_edq_normalized", ".3f"),
                ("mean_lost_update_frac", ".3f"),
                ("late_lost_update_frac", ".3f"),
            )
        ]
        return [
            c["model"], c["precision"], c["beta2"], c["seeds"], spread[0], diff, *spread[1:],
            f"{c['state_bytes_per_param']:g}", step_time,
        ]  # fmt: skip

    return table(
        ["model", "precision", "beta2", "seeds", "final val loss", "val loss - fp32 (paired)",
         "final train loss", "mean EDQ (normalised)", "mean lost-update frac",
         "lost frac, 2nd half", "state B/param", "step time (s)"],
        map(line, cells),
    )  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    cli = parser(
        __doc__,
        json=False,
        steps=300,
        overrides=True,
    )
    cli.add_argument("--models", nargs="+", default=["gpt_tiny"])
    cli.add_argument("--lr", type=float, default=1e-3, help="peak lr; it decays to lr/100")
    cli.add_argument("--edq-every", type=int, default=10)
    cli.add_argument("--eval-batches", type=int, default=32)
    cli.add_argument("--beta2", type=float, nargs="+", default=[0.95, 0.999])
    cli.add_argument("--precisions", nargs="+", default=list(STRATEGIES))
    cli.add_argument(
        "--seeds", type=int, default=1, help="seeds per cell (train.seed 1..N); mean +- sd"
    )
    cli.add_argument(
        "--json",
        type=Path,
        help="also write the rows as JSON here (rewritten after every run); the runs it "
        "already holds are not run again",
    )
    return cli.parse_args(argv)


def main() -> None:
    args = parse_args()

    rows = json.loads(args.json.read_text()) if args.json and args.json.exists() else []
    done = {_run_key(r) for r in rows}
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as root:
        for model in args.models:
            for beta2 in args.beta2:
                for precision in args.precisions:
                    for seed in range(1, args.seeds + 1) if args.seeds > 1 else [None]:
                        key = (model, args.steps, precision, beta2, seed)
                        if key in done:
                            continue
                        print(f"{model}, {precision}, beta2 {beta2}, seed {seed}, "
                              f"{args.steps} steps ...", flush=True)  # fmt: skip
                        run_dir = Path(root) / f"{model}-{precision}-{beta2}-{seed}"
                        rows.append(study_run(precision, beta2, args, run_dir, seed, model))
                        if args.json:  # after every run: a stopped study keeps what it measured
                            args.json.write_text(json.dumps(rows, indent=2) + "\n")
    wanted = [r for r in rows if r.get("steps", args.steps) == args.steps]
    result = seeds_table(aggregate(wanted))
    print(result)
    if args.record:
        minutes = (time.perf_counter() - start) / 60
        append_results(
            "Quality study: precision strategies x beta2",
            f"{', '.join(args.models)} on the embedded corpus, {args.steps} steps, peak lr "
            f"{args.lr} decaying to {args.lr / 100} (cosine), "
            + (
                "same seed and data order for every run; "
                if args.seeds == 1
                else f"seeds 1..{args.seeds} per cell (mean ± sample sd); "
            )
            + f"EDQ every {args.edq_every} steps; validation on {args.eval_batches} held-out "
            f"batches. Took {minutes:.0f} min.",
            result,
        )


def _run_key(row: dict) -> tuple:
    """What identifies one run of the grid (rows of older studies lack model and steps)."""
    return (row.get("model"), row.get("steps"), row["precision"], row["beta2"], row["seed"])


if __name__ == "__main__":
    main()
