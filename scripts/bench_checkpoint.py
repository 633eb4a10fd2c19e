"""How long a checkpoint save blocks the training loop: synchronous against background.

Each rank (one process, or the ranks of a ``torchrun`` launch) builds the real
``Trainer`` from the composed configuration, takes one step, then saves ``--saves``
times in each mode, one training step before each save:

- sync (``train.async_checkpoint=false``): the loop waits until the files are written,
  fsynced, checksummed and committed;
- async (the default): the loop waits for the weights check and the copy of the state
  into host buffers; training steps run while the files are written (counted), then the
  save is waited for. The host buffers are allocated in the background after the first
  step, as ``Trainer.fit`` does, before the timed saves; the ratio is taken over the saves
  after the first ("steady"), the first shown beside it.

    python scripts/bench_checkpoint.py --model gpt_125m --precision collage_plus
    python scripts/bench_checkpoint.py --model gpt_1.3b --precision bf16 --seq-len 128
    python scripts/bench_checkpoint.py --distributed zero2 --nproc 2 --device cuda

The table is printed and appended to docs/results-history.md (``--no-record`` to skip).
"""

from __future__ import annotations

import time
from pathlib import Path

from common import parser, publish, table
from runs import launch_ranks, rank_output

GIB = 2**30


def directory_bytes(path: Path, rank: int | None) -> int:
    """Bytes of a checkpoint's files; of one rank's optimizer shards when ``rank`` is set
    (DeepSpeed's ``*_rank_R_*`` files, plus the model states rank 0 writes)."""
    files = [file for file in path.rglob("*.pt") if file.is_file()]
    if rank is not None:
        files = [
            f
            for f in files
            if f"_rank_{rank}_" in f.name or (rank == 0 and "model_states" in f.name)
        ]
    return sum(file.stat().st_size for file in files)


def worker(out: Path, overrides: list[str], saves: int) -> None:
    """Inside each rank: build the trainer, step, save in both modes, report."""
    import torch

    from collage_train import checkpoint
    from collage_train.compose import compose_job
    from collage_train.trainer import Trainer

    cfg = compose_job(overrides)
    trainer = Trainer(cfg, out.parent / "run")
    trainer.train_step()  # warm-up: allocations, the optimizer state
    # as Trainer.fit does after its first step
    trainer.checkpointer.saver.prepare(trainer.state_dict())
    trainer.checkpointer.saver.wait()  # the host buffers are allocated before the timed saves
    sync_s, blocked_s, written_s, steps_during = [], [], [], []
    for _ in range(saves):
        trainer.train_step()
        start = time.perf_counter()
        trainer.save_checkpoint(background=False)
        sync_s.append(time.perf_counter() - start)
    for _ in range(saves):
        trainer.train_step()
        start = time.perf_counter()
        trainer.save_checkpoint(background=True)
        blocked_s.append(time.perf_counter() - start)
        overlapped = 0
        while trainer.checkpointer.saver.in_flight:
            trainer.train_step()
            overlapped += 1
        trainer.checkpointer.saver.wait()
        trainer.checkpointer.saver.raise_failure()
        written_s.append(trainer.checkpointer.saver.times.written[-1])
        steps_during.append(overlapped)
    rank = trainer.engine.rank
    newest = checkpoint.latest_checkpoint(trainer.run_dir)
    row = {
        "rank": rank,
        "world_size": trainer.engine.world_size,
        "device": str(trainer.device),
        "num_params": trainer.num_params,
        "checkpoint_bytes": directory_bytes(
            newest, rank if trainer.engine.world_size > 1 else None
        ),
        "host_staging_bytes": trainer.checkpointer.saver.host_staging_bytes,
        "sync_s": sync_s,
        "async_blocked_s": blocked_s,
        "async_written_s": written_s,
        "steps_during_write": steps_during,
        "torch": torch.__version__,
    }
    rank_output(out, row)
    trainer.engine.close()


def launch(distributed: str, ranks: int, overrides: list[str], saves: int) -> list[dict]:
    args = ["--saves", str(saves), "--", *overrides, f"distributed={distributed}"]
    rows = launch_ranks(Path(__file__).resolve(), args, ranks, label=distributed)
    for row in rows:
        row["distributed"] = distributed
        steady = row["async_blocked_s"][1:] or row["async_blocked_s"]
        row["blocked_ratio"] = mean(steady) / mean(row["sync_s"])
    return rows


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


def render(rows: list[dict], model: str, precision: str) -> str:
    def cells(row: dict) -> list[object]:
        blocked = row["async_blocked_s"]
        steady = blocked[1:] or blocked
        return [
            model, precision, row["distributed"], f"{row['rank']} of {row['world_size']}",
            f"{row['checkpoint_bytes'] / GIB:.2f}", f"{mean(row['sync_s']):.2f}",
            f"{blocked[0]:.2f} / {mean(steady):.2f}", f"{mean(row['async_written_s']):.2f}",
            ", ".join(map(str, row["steps_during_write"])), f"{row['blocked_ratio']:.1%}",
        ]  # fmt: skip

    return table(
        ["model", "precision", "engine", "rank", "checkpoint (GiB, this rank's files)",
         "sync save (s)", "async: loop blocked (s), first / steady",
         "async: written in background (s)", "steps run during the write",
         "blocked / sync (steady)"],
        map(cells, rows),
    )  # fmt: skip


def main() -> None:
    cli = parser(
        __doc__,
        model="gpt_125m",
        seq_len=256,
        device=("auto", "train.device: auto, cpu or cuda"),
        overrides=True,
        worker=True,
    )
    cli.add_argument("--precision", default="collage_plus")
    cli.add_argument("--distributed", default="unsharded", help="unsharded, zero1/2/3")
    cli.add_argument("--nproc", type=int, default=1, help="ranks (torchrun) for ZeRO")
    cli.add_argument("--saves", type=int, default=3, help="saves in each mode")
    args = cli.parse_args()
    if args.worker_out is not None:
        worker(args.worker_out, args.overrides, args.saves)
        return
    batch = max(1, args.nproc)
    overrides = [
        f"model={args.model}", f"precision={args.precision}", f"train.device={args.device}",
        f"data.seq_len={args.seq_len}", "train.micro_batch_size=1",
        f"train.global_batch_size={batch}", "train.max_steps=1000",
        "train.keep_checkpoints=1", "logging.wandb.mode=disabled", "logging.console=none",
        *args.overrides,
    ]  # fmt: skip
    rows = launch(args.distributed, args.nproc, overrides, args.saves)
    publish(
        args,
        render(rows, args.model, args.precision),
        rows,
        f"Checkpoint save: loop blocked, sync against async ({args.model}, "
        f"{args.precision}, {args.distributed} x {args.nproc})",
        f"One training step before each save, {args.saves} saves per mode, sequence "
        f"{args.seq_len}, micro-batch 1, the embedded default corpus; the run directory "
        "on the machine's local disk. Async: steps keep running while the files are "
        "written; the host buffers were allocated in the background after the first step (as "
        "in training), before the timed saves.",
    )


if __name__ == "__main__":
    main()
