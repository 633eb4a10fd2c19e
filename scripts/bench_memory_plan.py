"""How close is the memory planner? Planned against measured step peaks, per strategy.

For one model preset, each precision strategy (with and without activation
checkpointing) trains two steps in this process; the second step's peak is measured
and set beside ``collage_train.planning.memory_plan``'s prediction for the same setting:

- on a GPU: ``torch.cuda.max_memory_allocated`` over the step (everything allocated,
  the optimizer's fused kernel as the trainer chooses it);
- on CPU: the live-tensor peak (``LiveTensorBytes``) with the eager optimizer step,
  since a dispatch mode cannot see inside compiled kernels.

    python scripts/bench_memory_plan.py --model gpt_125m --seq-len 256 --micro-batch 4
    python scripts/bench_memory_plan.py --model gpt_1.3b --seq-len 2048 --micro-batch 4

The table is printed and appended to docs/results-history.md (``--no-record`` to skip);
``--json PATH`` writes the rows.
"""

from __future__ import annotations

import argparse
import gc
import tempfile
from pathlib import Path

import torch
from common import STRATEGIES, parser, publish, table
from hydra import compose, initialize_config_dir
from runs import quiet_run

from collage_train.cli import config_dir
from collage_train.config.schema import register_schemas
from collage_train.metrics.live_memory import LiveTensorBytes
from collage_train.planning.batch import accumulation_steps
from collage_train.planning.memory_plan import ModelShape, Setting, estimate
from collage_train.precision import get_strategy
from collage_train.trainer import Trainer

# Every strategy but fp32 (no bf16 state to plan) and Scalify's (run them by name).
DEFAULT_STRATEGIES = [s for s in STRATEGIES if s != "fp32" and not s.startswith("scalify")]


def compose_run(args: argparse.Namespace, precision: str, checkpointing: bool) -> object:
    overrides = [
        f"model={args.model}",
        f"precision={precision}",
        f"data.seq_len={args.seq_len}",
        f"train.micro_batch_size={args.micro_batch}",
        f"train.global_batch_size={args.global_batch or args.micro_batch}",
        f"train.activation_checkpointing={str(checkpointing).lower()}",
        *quiet_run(2),
        *args.overrides,
    ]
    if not torch.cuda.is_available():
        overrides.append("optim.kernel=eager")
    with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
        return compose(config_name="config", overrides=overrides)


def measured_peak(trainer: Trainer) -> int:
    """Peak bytes of the second step (the first creates the optimizer state)."""
    trainer.train_step()
    if trainer.device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        trainer.train_step()
        return torch.cuda.max_memory_allocated()
    with LiveTensorBytes() as live:
        live.track_training_state(trainer.model.parameters(), trainer.optimizer)
        trainer.train_step()
    return live.peak


def bench_row(args: argparse.Namespace, precision: str, checkpointing: bool) -> dict:
    cfg = compose_run(args, precision, checkpointing)
    with tempfile.TemporaryDirectory() as run_dir:
        trainer = Trainer(cfg, Path(run_dir))
        measured = measured_peak(trainer)
        shape = ModelShape.from_config(
            cfg.model, vocab_size=trainer.data.tokenizer.vocab_size, seq_len=cfg.data.seq_len
        )
        setting = Setting(
            get_strategy(precision),
            0,
            fused_optimizer=trainer.optimizer_kernel != "eager",
            masked_step=trainer.window.verdicts_on_device,
        )
        train = cfg.train
        planned = estimate(
            shape,
            setting,
            micro_batch=train.micro_batch_size,
            accum_steps=accumulation_steps(train.global_batch_size, train.micro_batch_size, 1),
            checkpointing=checkpointing,
            fp32_gemms=trainer.cpu_bf16_gemm.emulates,
            loss_chunk_tokens=trainer.loss_chunk_tokens,
        )
        kernel = trainer.optimizer_kernel
        del trainer
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return {
        "strategy": precision,
        "activation_checkpointing": checkpointing,
        "optimizer_kernel": kernel,
        "planned_bytes": planned.peak,
        "measured_bytes": measured,
        "ratio": planned.peak / measured,
    }


def render(rows: list[dict]) -> str:
    return table(
        ["strategy", "checkpointing", "optimizer step", "planned MiB", "measured MiB",
         "planned / measured"],
        (
            [r["strategy"], "on" if r["activation_checkpointing"] else "off",
             r["optimizer_kernel"], f"{r['planned_bytes'] / 2**20:.1f}",
             f"{r['measured_bytes'] / 2**20:.1f}", f"{r['ratio']:.3f}"]
            for r in rows
        ),
        right=(3, 4, 5),
    )  # fmt: skip


def main() -> None:
    cli = parser(__doc__, model="gpt_125m", seq_len=256, overrides=True)
    cli.add_argument("--micro-batch", type=int, default=4)
    cli.add_argument("--global-batch", type=int, default=None, help="default: one micro-batch")
    cli.add_argument("--strategies", nargs="+", default=DEFAULT_STRATEGIES)
    # the spelling of the commands in docs/results-history.md before the positional overrides
    cli.add_argument("--override", nargs="*", default=[], help=argparse.SUPPRESS)
    args = cli.parse_args()
    args.overrides += args.override
    register_schemas()

    rows = []
    for precision in args.strategies:
        for checkpointing in (False, True):
            rows.append(bench_row(args, precision, checkpointing))
            print(render(rows[-1:]).splitlines()[-1], flush=True)
    worst = max(abs(r["ratio"] - 1) for r in rows)
    publish(
        args,
        render(rows),
        rows,
        f"Memory planner against measured step peaks, {args.model}",
        f"Sequence {args.seq_len}, micro-batch {args.micro_batch}; second training step; "
        f"largest deviation {worst:.1%}.",
    )


if __name__ == "__main__":
    main()
