"""Launch-to-first-step time and peak host memory of building a run, per rank.

Each rank (one process, or the ranks of a ``torchrun`` launch) composes the real
configuration and builds the real ``Trainer``: data, the model in its storage dtype,
the optimizer and the engine (DeepSpeed's ``initialize`` under ZeRO), everything that
happens before the first step. It reports the seconds since its process started and its
peak resident set size (``VmHWM``) twice: once the model is built
(``run.model_setup.build_run_model`` returned) and before the first step; then it
exits without training. On a CPU the
device is the host, so the second also holds what the engine allocates for training
(DeepSpeed ZeRO-3's flat weight and gradient partitions).

    python scripts/bench_startup.py --model gpt_1.3b --precision collage_plus \\
        --setting unsharded:1 zero3:2 --json startup.json

The table is printed and appended to docs/results-history.md (``--no-record`` to skip). Run it
from another checkout (``--repo``) to measure that code with the same script.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from common import REPO, parser, publish, table
from runs import launch_ranks, rank_output

GIB = 2**30


def process_age_s() -> float:
    """Seconds since this process started (Linux: /proc/self/stat and /proc/stat)."""
    ticks = os.sysconf("SC_CLK_TCK")
    fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    started_after_boot = int(fields[19]) / ticks  # field 22 of stat(5), after "pid (comm)"
    boot = next(
        int(line.split()[1])
        for line in Path("/proc/stat").read_text().splitlines()
        if line.startswith("btime")
    )
    return time.time() - (boot + started_after_boot)


def peak_rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def worker(out: Path, overrides: list[str]) -> None:
    """Inside each rank: build the trainer, report, exit."""
    import torch

    from collage_train import trainer as trainer_module
    from collage_train.compose import compose_job
    from collage_train.trainer import Trainer

    cfg = compose_job(overrides)
    built: dict[str, float] = {}
    # the model alone, before the engine wraps it (a checkout from before the trainer's
    # components, --repo, builds it in Trainer._build_model)
    owner, name = (
        (Trainer, "_build_model")
        if hasattr(Trainer, "_build_model")
        else (trainer_module, "build_run_model")
    )
    build = getattr(owner, name)

    def timed_build(*args: Any) -> Any:
        model = build(*args)
        built.update(model_s=process_age_s(), model_peak_rss_bytes=peak_rss_bytes())
        return model

    setattr(owner, name, timed_build)
    trainer = Trainer(cfg, out.parent / "run")
    row = {
        **built,
        "rank": trainer.engine.rank,
        "world_size": trainer.engine.world_size,
        "startup_s": process_age_s(),
        "peak_rss_bytes": peak_rss_bytes(),
        "num_params": trainer.num_params,
        "param_bytes": trainer.strategy.param_dtype.itemsize,
        "torch": torch.__version__,
    }
    rank_output(out, row)
    trainer.engine.close()


def launch(repo: Path, distributed: str, ranks: int, overrides: list[str]) -> list[dict]:
    args = ["--", *overrides, f"distributed={distributed}"]
    rows = launch_ranks(Path(__file__).resolve(), args, ranks, repo=repo, label=distributed)
    for row in rows:
        row["distributed"] = distributed
    return rows


def render(rows: list[dict], label: str) -> str:
    def cells(row: dict) -> list[object]:
        shard = row["world_size"] if row["distributed"] == "zero3" else 1
        weights = row["num_params"] * row["param_bytes"] / shard
        return [
            label, row["distributed"], f"{row['world_size']} (rank {row['rank']})",
            f"{row['model_s']:.1f}", f"{row['model_peak_rss_bytes'] / GIB:.2f}",
            f"{row['startup_s']:.1f}", f"{row['peak_rss_bytes'] / GIB:.2f}",
            f"{weights / GIB:.2f}", f"{(row['model_peak_rss_bytes'] - weights) / GIB:.2f}",
        ]  # fmt: skip

    return table(
        ["code", "engine", "ranks", "model built (s)", "peak RSS, model built (GiB)",
         "launch to first step (s)", "peak RSS, first step (GiB)", "weights per rank (GiB)",
         "model-built RSS - weights (GiB)"],
        map(cells, rows),
    )  # fmt: skip


def main() -> None:
    cli = parser(__doc__, model="gpt_1.3b", seq_len=2048, overrides=True, worker=True)
    cli.add_argument("--precision", default="collage_plus")
    cli.add_argument(
        "--setting", nargs="+", default=["unsharded:1", "zero3:2"], help="ENGINE:RANKS ..."
    )
    cli.add_argument("--repo", type=Path, default=REPO, help="the checkout to measure")
    cli.add_argument("--label", default="this checkout", help="the code's name in the table")
    args = cli.parse_args()
    overrides = args.overrides

    if args.worker_out is not None:  # inside a launched rank
        worker(args.worker_out, overrides)
        return

    base = [
        f"model={args.model}", f"precision={args.precision}", f"data.seq_len={args.seq_len}",
        "train.micro_batch_size=1", "logging.wandb.mode=disabled", *overrides,
    ]  # fmt: skip
    rows = []
    for setting in args.setting:
        distributed, ranks = setting.split(":")
        rows += launch(
            args.repo.resolve(),
            distributed,
            int(ranks),
            [*base, f"train.global_batch_size={int(ranks) * 2}"],
        )
    publish(
        args,
        render(rows, args.label),
        rows,
        f"Start-up: launch to first step and peak host RSS, {args.model} {args.precision}",
        f"Sequence {args.seq_len}; each rank builds the real Trainer (data, model, "
        "optimizer, engine) and stops before the first step.",
    )


if __name__ == "__main__":
    main()
