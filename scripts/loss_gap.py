"""Step-by-step training-loss gap between runs and a reference run.

Reads the training records (those with ``loss``) of each run directory's
``metrics.jsonl`` and compares them with the reference run's at the same steps: the
largest absolute and relative difference, where it happens, and whether it lies within
``--rtol``. ``scripts/gpu_check.sh`` uses it for ZeRO-1/2/3 on all GPUs against one GPU
and for an elastic resume against the run that never stopped.

    python scripts/loss_gap.py REFERENCE_RUN RUN [RUN ...] [--rtol 0.01] \\
        [--from-step S] [--json FILE]

Exit status 0 when every run is within the tolerance, 1 when one is not, 2 on bad input
(one ``error:`` line: a missing run, or runs that did not log the same steps).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from common import parser, write_json


class GapError(ValueError):
    """Runs that cannot be compared."""


def losses(run_dir: Path) -> dict[int, float]:
    """Step -> training loss, from ``run_dir/metrics.jsonl``."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise GapError(f"{run_dir} has no metrics.jsonl: not a finished run directory")
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    found = {int(r["step"]): float(r["loss"]) for r in records if "loss" in r}
    if not found:
        raise GapError(f"{path} holds no training loss")
    return found


def gap(reference: dict[int, float], run: dict[int, float], from_step: int) -> dict:
    """The largest absolute and relative loss difference over the steps from ``from_step``."""
    steps = sorted(s for s in reference if s >= from_step)
    theirs = sorted(s for s in run if s >= from_step)
    if steps != theirs:
        raise GapError(
            f"the runs logged different steps from step {from_step}: reference "
            f"{steps[:3]}...{steps[-3:]} ({len(steps)}), run {theirs[:3]}...{theirs[-3:]} "
            f"({len(theirs)}); log the same steps (logging.log_every)"
        )
    if not steps:
        raise GapError(f"no logged step at or after step {from_step}")
    rows = [(s, abs(run[s] - reference[s]), abs(run[s] - reference[s]) / abs(reference[s]))
            for s in steps]  # fmt: skip
    at_abs = max(rows, key=lambda row: row[1])
    at_rel = max(rows, key=lambda row: row[2])
    return {
        "steps": len(steps),
        "first_step": steps[0],
        "last_step": steps[-1],
        "max_abs_diff": at_abs[1],
        "max_abs_diff_step": at_abs[0],
        "max_rel_diff": at_rel[2],
        "max_rel_diff_step": at_rel[0],
    }


def main(argv: list[str] | None = None) -> int:
    cli = parser(__doc__, record=False)
    cli.add_argument("reference", type=Path, help="the reference run directory")
    cli.add_argument("runs", nargs="+", type=Path, help="run directories to compare")
    cli.add_argument("--rtol", type=float, default=0.01, help="largest relative gap allowed")
    cli.add_argument("--from-step", type=int, default=1, help="compare from this step on")
    args = cli.parse_args(argv)
    try:
        reference = losses(args.reference)
        rows = []
        for run in args.runs:
            row = {"run": str(run), "reference": str(args.reference), "rtol": args.rtol}
            row.update(gap(reference, losses(run), args.from_step))
            row["within_tolerance"] = row["max_rel_diff"] <= args.rtol
            rows.append(row)
    except GapError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    for row in rows:
        print(
            f"{row['run']}: {row['steps']} steps ({row['first_step']}-{row['last_step']}), "
            f"max |loss gap| {row['max_abs_diff']:.3g} at step {row['max_abs_diff_step']}, "
            f"max relative {row['max_rel_diff']:.3g} at step {row['max_rel_diff_step']} "
            f"({'within' if row['within_tolerance'] else 'beyond'} rtol {row['rtol']:g})"
        )
    write_json(args.json, {"rows": rows})
    return 0 if all(row["within_tolerance"] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
