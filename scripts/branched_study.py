"""Branched study: one mixed_fp32 warm-up branched into every strategy, paired by data order.

One model is warmed up in mixed_fp32 to the ``--late`` step, with checkpoints at the
``--early`` and ``--late`` steps. From each of the two, every ``--precisions`` strategy
is branched (``train.branch_from``) with ``--seeds`` data orders after the branch
(``train.branch_data_seed`` 1..N) and trained ``--branch-steps`` steps. Every run, the
warm-up included, has the same lr schedule (``train.max_steps`` = late + branch steps;
the early branches stop at early + branch steps), so a branch continues its parent's
schedule. Each branch is compared with the mixed_fp32 branch of the same point and seed:
same weights, optimizer state and batches, so the difference is the strategy's. The
table gives, per branch point and strategy, the mean ± sample sd over the seeds of the
difference of the final logged training loss and of the mean training loss over the
branch. The question Collage asks: the warm-up is branched into bf16 at the early
point and trained to the late one (a bf16 trunk), and that trunk is branched into
collage_plus and bf16 at the late point: collage_plus minus bf16, paired the same way.

Branching into another strategy needs the strategy switch on resume (issue 50); where
this checkout refuses it ("resume with the same strategy"), those rows say so and are
skipped.

    python scripts/branched_study.py --model gpt_125m --early 200 --late 1000 \\
        --branch-steps 300 --seeds 3 --json branched.json
    python scripts/branched_study.py --early 2 --late 4 --branch-steps 2 --seeds 1 \\
        --precisions mixed_fp32 bf16 --no-record --in-process   # a smoke run, a few steps

With ``--json PATH`` the finished runs are kept there, and a study started again with
the same file skips them. Runs go to ``--out`` (default: a temporary directory).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from common import STRATEGIES, append_results, parser, table
from runs import quiet_run, start_training

REFERENCE = "mixed_fp32"
NO_SWITCH = "resume with the same strategy"  # the refusal of a checkout without the switch
SWITCH_NOTE = "needs the strategy switch on resume (issue 50), not in this checkout"

# (overrides, run directory) -> None where the run finished, else its error text
Runner = Callable[[list[str], Path], str | None]


def subprocess_runner(overrides: list[str], run_dir: Path) -> str | None:
    """``python -m collage_train OVERRIDES hydra.run.dir=RUN_DIR``; its error, or None."""
    proc = start_training([*overrides, f"hydra.run.dir={run_dir}"])
    _, error = proc.communicate()
    return None if proc.returncode == 0 else error.strip()[-2000:]


def in_process_runner(overrides: list[str], run_dir: Path) -> str | None:
    """The same run in this process (``cli.run_reporting`` after the start-up checks), for
    a smoke run of a few steps without an interpreter start per run."""
    from hydra import compose, initialize_config_dir

    from collage_train import cli
    from collage_train.errors import CollageError
    from collage_train.run.validate import validate

    with initialize_config_dir(config_dir=cli.config_dir(), version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides)
    try:
        validate(cfg)
    except CollageError as err:
        return str(err)
    outcome = cli.run_reporting(cfg, run_dir)
    return None if outcome.exit_status == 0 else outcome.error or "failed"


def losses(run_dir: Path) -> list[tuple[int, float]]:
    """The (step, training loss) records of a run."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [(r["step"], r["loss"]) for r in map(json.loads, lines) if "loss" in r]


class Study:
    """The study's runs under ``root``, each run once (``rows``: the finished ones)."""

    def __init__(self, args: argparse.Namespace, root: Path, runner: Runner) -> None:
        self.args, self.root, self.runner = args, root, runner
        self.horizon = args.late + args.branch_steps
        self.rows: list[dict] = (
            json.loads(args.json.read_text()) if args.json and args.json.exists() else []
        )
        self.switch = True  # until a branch into another strategy is refused

    def common(self) -> list[str]:
        args = self.args
        return [
            f"model={args.model}",
            f"optim.lr={args.lr}",
            f"optim.min_lr={args.lr / 100}",
            *quiet_run(self.horizon, log_every=args.log_every),
            *args.overrides,
        ]

    def warm_up(self) -> Path:
        """The mixed_fp32 warm-up, stopped at the late step; returns its run directory."""
        args, run_dir = self.args, self.root / "warm-up"
        every = args.early if args.late % args.early == 0 else 1
        if not (run_dir / "checkpoints" / f"step-{args.late}").is_dir():
            error = self.runner(
                [*self.common(), f"precision={REFERENCE}", f"train.stop_at_step={args.late}",
                 f"train.checkpoint_every={every}",
                 f"train.keep_checkpoints={args.late // every + 1}"],
                run_dir,
            )  # fmt: skip
            if error is not None:
                raise RuntimeError(f"the warm-up failed: {error}")
        return run_dir

    def branch(self, name: str, parent: Path, step: int, precision: str, seed: int | None,
               stop: int) -> dict | None:  # fmt: skip
        """One branch of ``parent`` at ``step`` into ``precision`` with data-order ``seed``,
        to ``stop``: its row (None, noted, where this checkout cannot switch strategy)."""
        key = {"name": name, "step": step, "precision": precision, "seed": seed}
        done = [r for r in self.rows if all(r.get(k) == v for k, v in key.items())]
        if done:
            return done[0]
        source_precision = REFERENCE if parent.name == "warm-up" else "bf16"
        if precision != source_precision and not self.switch:
            return None
        print(f"{name}: {precision} from step {step}, seed {seed} ...", flush=True)
        run_dir = self.root / f"{name}-{step}-{precision}-{seed}"
        overrides = [
            *self.common(),
            f"precision={precision}",
            f"train.branch_from={parent / 'checkpoints' / f'step-{step}'}",
            *([f"train.branch_data_seed={seed}"] if seed is not None else []),
            *([f"train.stop_at_step={stop}"] if stop < self.horizon else []),
        ]
        error = self.runner(overrides, run_dir)
        if error is not None and NO_SWITCH in error and precision != source_precision:
            self.switch = False
            print(f"  skipped: {SWITCH_NOTE}", flush=True)
            return None
        if error is not None:
            raise RuntimeError(f"{run_dir.name} failed: {error}")
        after = [(s, loss) for s, loss in losses(run_dir) if s > step]
        row = {**key, "final_loss": after[-1][1], "mean_loss": statistics.fmean(
            loss for _, loss in after)}  # fmt: skip
        self.rows.append(row)
        if self.args.json:  # after every run: a stopped study keeps what it measured
            self.args.json.write_text(json.dumps(self.rows, indent=2) + "\n")
        return row

    def bf16_trunk(self, warm: Path) -> Path | None:
        """The warm-up branched into bf16 at the early step, trained to the late one."""
        args, run_dir = self.args, self.root / "bf16-trunk"
        if (run_dir / "checkpoints" / f"step-{args.late}").is_dir():
            return run_dir
        if not self.switch:
            return None
        print(f"bf16 trunk: from step {args.early} to {args.late} ...", flush=True)
        error = self.runner(
            [*self.common(), "precision=bf16",
             f"train.branch_from={warm / 'checkpoints' / f'step-{args.early}'}",
             f"train.stop_at_step={args.late}"],
            run_dir,
        )  # fmt: skip
        if error is not None and NO_SWITCH in error:
            self.switch = False
            return None
        if error is not None:
            raise RuntimeError(f"the bf16 trunk failed: {error}")
        return run_dir


def _mean_sd(values: list[float]) -> str:
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.fmean(values):+.4f} ± {sd:.4f}"


def paired_rows(
    rows: list[dict], name: str, step: int, precision: str, reference: str, seeds: list
) -> list[str] | None:
    """Final and mean loss of ``precision`` minus ``reference`` over ``seeds`` (mean ± sd),
    from the rows of branch set ``name`` at ``step``; None where either is missing."""
    found = {(r["precision"], r["seed"]): r for r in rows if (r["name"], r["step"]) == (name, step)}
    pairs = [(found.get((precision, s)), found.get((reference, s))) for s in seeds]
    if not pairs or any(a is None or b is None for a, b in pairs):
        return None
    final = [a["final_loss"] - b["final_loss"] for a, b in pairs]
    mean = [a["mean_loss"] - b["mean_loss"] for a, b in pairs]
    return [str(len(pairs)), _mean_sd(final), _mean_sd(mean)]


def report(study: Study, points: dict[str, int], seeds: list) -> str:
    """The markdown table of every branch against the mixed_fp32 branch, and the late
    bf16 -> collage_plus switch against staying in bf16."""
    args, rows = study.args, study.rows
    header = ["branch point", "strategy", "against", "seeds", "final loss Δ", "mean loss Δ",
              "note"]  # fmt: skip
    lines = []
    for label, step in points.items():
        for precision in args.precisions:
            cells = paired_rows(rows, "warm-up", step, precision, REFERENCE, seeds)
            note = "" if cells is not None else SWITCH_NOTE
            lines.append([f"{label} (step {step})", precision, REFERENCE,
                          *(cells or ["-", "-", "-"]), note])  # fmt: skip
    cells = paired_rows(rows, "bf16-trunk", args.late, "collage_plus", "bf16", seeds)
    lines.append([f"late (step {args.late}) of a bf16 run", "collage_plus", "bf16",
                  *(cells or ["-", "-", "-"]), "" if cells else SWITCH_NOTE])  # fmt: skip
    return table(header, lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    cli = parser(__doc__, json=False, model="gpt_tiny", overrides=True)
    cli.add_argument("--early", type=int, default=100, help="the early branch step")
    cli.add_argument("--late", type=int, default=500, help="the late branch step")
    cli.add_argument("--branch-steps", type=int, default=300, help="steps of each branch")
    cli.add_argument("--seeds", type=int, default=3, help="data orders after the branch")
    cli.add_argument("--precisions", nargs="+", default=list(STRATEGIES))
    cli.add_argument("--lr", type=float, default=1e-3, help="peak lr; it decays to lr/100")
    cli.add_argument("--log-every", type=int, default=10, help="training loss records")
    cli.add_argument("--out", type=Path, help="where the runs go (default: a temporary dir)")
    cli.add_argument(
        "--in-process", action="store_true", help="run in this process (smoke runs; tests)"
    )
    cli.add_argument("--json", type=Path, help="the finished runs; those it holds are skipped")
    args = cli.parse_args(argv)
    if not 0 < args.early < args.late or args.branch_steps < 1:
        cli.error("needs 0 < --early < --late and --branch-steps >= 1")
    if REFERENCE not in args.precisions:
        args.precisions.insert(0, REFERENCE)
    return args


def run_study(args: argparse.Namespace, root: Path, runner: Runner = subprocess_runner) -> str:
    """Every run of the study under ``root``; returns the table."""
    study = Study(args, root, runner)
    warm = study.warm_up()
    points = {"early": args.early, "late": args.late}
    seeds = list(range(1, args.seeds + 1))
    for step in points.values():
        for precision in args.precisions:
            for seed in seeds:
                study.branch("warm-up", warm, step, precision, seed, step + args.branch_steps)
    trunk = study.bf16_trunk(warm)
    if trunk is not None:
        for precision in ("bf16", "collage_plus"):
            for seed in seeds:
                study.branch("bf16-trunk", trunk, args.late, precision, seed, study.horizon)
    return report(study, points, seeds)


def main(argv: list[str] | None = None) -> str:
    args = parse_args(argv)
    runner = in_process_runner if args.in_process else subprocess_runner
    start = time.perf_counter()
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        result = run_study(args, args.out, runner)
    else:
        with tempfile.TemporaryDirectory() as root:
            result = run_study(args, Path(root), runner)
    print(result)
    if args.record:
        minutes = (time.perf_counter() - start) / 60
        append_results(
            "Branched study: strategies from one mixed_fp32 warm-up",
            f"{args.model}, warmed up in mixed_fp32, branched at steps {args.early} and "
            f"{args.late} into each strategy with data-order seeds 1..{args.seeds}, "
            f"{args.branch_steps} steps each (peak lr {args.lr}, cosine to {args.lr / 100} "
            f"at step {args.late + args.branch_steps}); differences from the mixed_fp32 "
            f"branch of the same point and seed, mean ± sample sd. Took {minutes:.0f} min.",
            result,
        )
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
