"""Model-state bytes per parameter per rank under DeepSpeed ZeRO, measured against analytic.

For every precision strategy and ZeRO stage, two ranks (the real ``deepspeed`` launcher,
CPU accelerator with gloo unless a GPU is present) build the model, take one optimizer
step through ``ZeroEngine`` and measure what each rank holds between steps: weights,
master partition and optimizer state (gradients are freed after every step and are
listed analytically), and whether the master partition is the weight partition itself
(``ZeroEngine.shares_weight_partitions``) or a copy of its own. The analytic values are
``collage_train.engine.zero_memory``.

    python scripts/bench_zero_memory.py --model gpt_125m --json zero_memory.json

The table is printed and appended to docs/results-history.md (``--no-record`` to skip).
docs/distributed.md gives the rules these bytes follow.
"""

from __future__ import annotations

from pathlib import Path

import zero_setup
from common import parser, publish, table
from runs import launch_ranks, rank_output

STRATEGIES = ("mixed_fp32", "bf16", "collage_light", "collage_plus", "scalify_fp32_params")
STAGES = (1, 2, 3)


def measure(model_name: str, seq_len: int, device: str, strategies: list[str]) -> list[dict]:
    """Worker: run inside each launched rank; every rank returns the same rows."""
    import torch

    from collage_train.engine.zero_memory import zero_state_bytes

    rows = []
    for stage in STAGES:
        for name in strategies:
            run = zero_setup.build(model_name, name, stage, seq_len, device, [])
            engine, optimizer = run.engine, run.optimizer
            run.backward()
            engine.step(run.cfg.optim.lr, track_edq=False)
            per_rank = torch.tensor([engine.state_bytes()], dtype=torch.float64)
            gathered = [torch.zeros_like(per_rank) for _ in range(engine.world_size)]
            torch.distributed.all_gather(gathered, per_rank)
            dtypes = sorted(
                {
                    str(value.dtype).removeprefix("torch.")
                    for state in optimizer.state.values()
                    for value in state.values()
                    if torch.is_tensor(value) and value.dim() > 0
                }
                | {str(t.dtype).removeprefix("torch.") for t in engine.master_partitions()}
            )
            expected = zero_state_bytes(run.strategy, stage, engine.world_size)
            rows.append(
                {
                    "strategy": name,
                    "zero_stage": stage,
                    "world_size": engine.world_size,
                    "num_params": run.num_params,
                    "measured_bytes_per_param": [g.item() / run.num_params for g in gathered],
                    "expected_bytes_per_param": expected.persistent,
                    "expected_gradient_bytes_per_param": expected.gradients,
                    "state_dtypes": dtypes,
                    "master_is_weights": engine.shares_weight_partitions,
                    "device": str(engine.device),
                }
            )
            run.close()
    return rows


def render(rows: list[dict]) -> str:
    return table(
        ["strategy", "ZeRO stage", "measured B/param, rank 0 / rank 1", "analytic", "ratio",
         "gradients (analytic)", "master partition", "master + optimizer dtypes"],
        [
            [r["strategy"], r["zero_stage"],
             " / ".join(f"{m:.2f}" for m in r["measured_bytes_per_param"]),
             f"{r['expected_bytes_per_param']:.2f}",
             f"{max(r['measured_bytes_per_param']) / r['expected_bytes_per_param']:.3f}",
             f"{r['expected_gradient_bytes_per_param']:.2f}",
             "the weights" if r.get("master_is_weights") else "own copy",
             ", ".join(r["state_dtypes"])]
            for r in rows
        ],
    )  # fmt: skip


def main() -> None:
    cli = parser(__doc__, model="gpt_125m", seq_len=128, device=("auto", "auto, cpu or cuda"),
                 worker=True)  # fmt: skip
    cli.add_argument("--ranks", type=int, default=2)
    cli.add_argument(
        "--strategies", nargs="+", default=list(STRATEGIES), help="precision strategies"
    )
    args = cli.parse_args()

    if args.worker_out is not None:  # inside a launched rank
        rank_output(
            args.worker_out, measure(args.model, args.seq_len, args.device, args.strategies)
        )
        return

    worker = ["--model", args.model, "--seq-len", str(args.seq_len), "--device", args.device,
              "--strategies", *args.strategies]  # fmt: skip
    rows = launch_ranks(
        Path(__file__).resolve(), worker, args.ranks, launcher="deepspeed", device=args.device,
        label="the ZeRO memory measurement",
    )[0]  # fmt: skip
    publish(
        args,
        render(rows),
        rows,
        f"Model-state bytes per parameter under ZeRO, {args.model}, {args.ranks} ranks",
        f"{rows[0]['num_params'] / 1e6:.1f}M parameters on {rows[0]['device']}; per rank "
        "after one step: weights + master partition + optimizer state (gradients are freed "
        "between steps, listed analytically).",
    )


if __name__ == "__main__":
    main()
