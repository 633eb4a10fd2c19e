"""Communication benchmark: DDP vs DiLoCo vs SparseLoCo at equal tokens.

Each method trains the same model on the embedded corpus with the same global batch,
the same number of inner steps (so the same tokens) and the same seed, through the
real CLI:

- ``ddp``: by default ``distributed=zero1`` on ``--replicas`` processes under
  ``torchrun``: the same process and thread layout as the replica rows (one thread
  per process), with a real gradient reduction every step, and the loss of
  data-parallel training (the mean gradient of the global batch; test_zero.py checks
  it against one process). ``--ddp-engine single`` runs one process on the whole
  global batch instead (same loss, no per-step communication in its wall time).
  DeepSpeed does not count its bytes, so the row states what DDP sends: every step
  each replica contributes its whole gradient (the strategy's parameter dtype: 2 bytes
  per parameter for bf16 weights) to an all-reduce.
- ``diloco`` (outer SGD lr 0.7, Nesterov momentum 0.9), ``diloco_avg`` (outer lr 1, no
  momentum: plain averaging) and ``sparseloco``: ``--replicas`` processes under
  ``torchrun`` (gloo on CPU), each on its shard of the global batch, merging every
  ``--sync-every`` steps;
  bytes are measured by the replica engine (payloads, checksums, the trainer's scalar
  reductions).

Columns: final validation loss; bytes sent per replica over the run and per inner step;
how many times fewer than DDP; training wall time (rank 0's ``fit``, start-up excluded)
and, for replicas, the time spent in collectives. On one machine the "link" is
loopback, so communication time mostly measures waiting for the slower replica; the
bytes are what a slow link would have to carry.

    python scripts/bench_sparseloco.py --json sparseloco.json
    python scripts/bench_sparseloco.py --steps 600 --sync-every 15 --seq-len 128

The table is printed and appended to docs/results-history.md (``--no-record`` to skip).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from common import parser, publish, table
from runs import quiet_run, run_training

# Row name -> comm overrides; diloco_avg is DiLoCo with outer lr 1 and no momentum: plain
# averaging of the replicas every H steps, which shows what the outer momentum adds.
METHODS = {
    "ddp": [],
    "diloco": ["comm=diloco"],
    "diloco_avg": [
        "comm=diloco",
        "comm.outer_lr=1.0",
        "comm.outer_momentum=0",
        "comm.nesterov=false",
    ],
    "sparseloco": ["comm=sparseloco"],
}


def run_replicas(overrides: list[str], run_dir: Path, replicas: int) -> tuple[dict, list[dict]]:
    """The CLI on ``replicas`` ranks under ``torchrun``, one thread each."""
    return run_training(overrides, run_dir, env={"OMP_NUM_THREADS": "1"}, ranks=replicas)


def common_overrides(args: argparse.Namespace) -> list[str]:
    return [
        f"model={args.model}",
        f"precision={args.precision}",
        f"data.seq_len={args.seq_len}",
        f"train.micro_batch_size={args.global_batch // args.replicas}",
        f"train.global_batch_size={args.global_batch}",
        f"train.eval_batches={args.eval_batches}",
        f"optim.lr={args.lr}",
        f"optim.warmup_steps={args.warmup}",
        "train.device=cpu",
        *quiet_run(args.steps, log_every=args.sync_every),
        *args.overrides,
    ]


def bench_row(args: argparse.Namespace, method: str, workdir: Path) -> dict:
    overrides = common_overrides(args)
    run_dir = workdir / method
    if method == "ddp":
        if args.ddp_engine == "unsharded":
            summary, _ = run_training(overrides, run_dir)
        else:
            overrides.append(f"distributed={args.ddp_engine}")
            summary, _ = run_replicas(overrides, run_dir, args.replicas)
        grad_bytes = 4 if args.precision == "fp32" else 2
        per_step = summary["num_params"] * grad_bytes
        bytes_total, comm_time = per_step * args.steps, None
    else:
        overrides += [*METHODS[method], f"comm.sync_every={args.sync_every}"]
        summary, _ = run_replicas(overrides, run_dir, args.replicas)
        bytes_total, comm_time = summary["comm_bytes_total"], summary["comm_time_s"]
    row = {
        "method": method,
        "engine": args.ddp_engine if method == "ddp" else "replicas",
        "replicas": 1 if method == "ddp" and args.ddp_engine == "unsharded" else args.replicas,
        "sync_every": 1 if method == "ddp" else args.sync_every,
        "tokens": summary["tokens"],
        "final_val_loss": summary["final_val_loss"],
        "final_train_loss": summary["final_train_loss"],
        "bytes_per_replica": bytes_total,
        "bytes_per_step": bytes_total / args.steps,
        "payload_bytes_per_outer_step": summary.get("comm_bytes_per_outer_step"),
        "compression_ratio": summary.get("comm_compression_ratio"),
        "wall_time_s": summary["wall_time_s"],
        "comm_time_s": comm_time,
        "num_params": summary["num_params"],
    }
    print(json.dumps(row), flush=True)
    return row


def render(rows: list[dict]) -> str:
    ddp = next((r for r in rows if r["method"] == "ddp"), None)

    def cells(r: dict) -> list[object]:
        fewer = f"{ddp['bytes_per_replica'] / r['bytes_per_replica']:.0f}" if ddp else "-"
        ratio = f"1/{r['compression_ratio']:.0f}" if r["compression_ratio"] else "-"
        comm = f"{r['comm_time_s']:.2f}" if r["comm_time_s"] is not None else "-"
        name = f"ddp ({r['engine']})" if r["method"] == "ddp" else r["method"]
        return [
            name, r["replicas"], r["sync_every"], f"{r['tokens']:,}",
            f"{r['final_val_loss']:.4f}", f"{r['bytes_per_replica'] / 1e6:.2f} MB",
            f"{r['bytes_per_step'] / 1e3:.1f} kB", fewer, ratio, f"{r['wall_time_s']:.1f}", comm,
        ]  # fmt: skip

    return table(
        ["method", "processes", "H", "tokens", "final val loss", "bytes/replica (run)",
         "bytes/replica/step", "x fewer than DDP", "payload vs fp32", "wall s", "comm s"],
        map(cells, rows),
    )  # fmt: skip


def main() -> None:
    cli = parser(
        __doc__,
        model="gpt_tiny",
        steps=(240, "inner steps (a multiple of H)"),
        seq_len=64,
        overrides=True,
    )
    cli.add_argument("--methods", nargs="*", default=list(METHODS), choices=METHODS)
    cli.add_argument("--precision", default="mixed_fp32")
    cli.add_argument("--replicas", type=int, default=2)
    cli.add_argument("--ddp-engine", default="zero1", choices=("zero1", "unsharded"))
    cli.add_argument("--sync-every", type=int, default=8, help="H, inner steps per sync")
    cli.add_argument("--global-batch", type=int, default=16, help="sequences per step")
    cli.add_argument("--lr", type=float, default=3e-3, help="inner AdamW peak lr")
    cli.add_argument("--warmup", type=int, default=15)
    cli.add_argument("--eval-batches", type=int, default=16)
    args = cli.parse_args()
    if args.steps % args.sync_every:
        cli.error(f"--steps {args.steps} must be a multiple of --sync-every {args.sync_every}")
    if args.global_batch % args.replicas:
        cli.error("--global-batch must split evenly over --replicas")

    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_sparseloco_") as tmp:
        for method in args.methods:
            rows.append(bench_row(args, method, Path(tmp)))
    publish(
        args,
        render(rows),
        rows,
        f"SparseLoCo communication benchmark, {args.model}",
        f"{args.precision}, sequence {args.seq_len}, global batch {args.global_batch}, "
        f"{args.steps} inner steps, {args.replicas} CPU replicas under torchrun (gloo), "
        f"H = {args.sync_every}; ddp is distributed={args.ddp_engine} on the same global "
        "batch, its bytes the gradient all-reduce message per replica per step. Bytes are "
        "per replica; wall time is training only (start-up excluded).",
    )


if __name__ == "__main__":
    main()
