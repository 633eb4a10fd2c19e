"""What tracking effective descent quality costs: optimizer step time, and the step's peak
memory under ZeRO-2.

Two measurements (``--measure``, both by default), each its own table and entry:

- ``time``: ``CollageAdamW`` (modes none, light, plus) and the fp32-master ``AdamW`` on
  bf16 parameters of transformer-like shapes (``--params`` in ``--tensors`` tensors), in
  this process, each step with ``track_edq`` off and on, alternating; the median step
  time each way and the ratio. With EDQ measured every ``--log-every`` steps, the
  amortised overhead is the ratio's excess divided by that.
- ``memory``: two ranks (the real ``deepspeed`` launcher; CPU accelerator with gloo
  unless a GPU is present) build ``--model`` under ZeRO-2, and each measures the
  live-tensor peak of ``ZeroEngine.step`` (DeepSpeed's step around the project's
  optimizer, which updates one flat partition per parameter group) with tracking off and
  on, alternating, with ``collage_train.metrics.live_memory.LiveTensorBytes``. The excess
  of a tracked step is compared with the rank's model state (weights, gradients, master
  partition, optimizer state: what ``chunk_numel_for`` budgets 2% of), once as the trainer
  runs it (tracking a chunk at a time) and once tracking the whole partition at once (how
  it was done before). docs/distributed.md describes the partitions.

EDQ itself is defined in docs/strategies.md.

    python scripts/bench_edq.py --measure time --params 8e6 --steps 10
    python scripts/bench_edq.py --measure memory --model gpt_125m --seq-len 64

The tables are printed and appended to docs/results-history.md (``--no-record`` to skip).
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch
import zero_setup
from common import append_results, parser, table, write_json
from runs import launch_ranks, rank_output

from collage_train.optim import AdamW, CollageAdamW

OPTIMIZERS = ("mixed_fp32", "collage_none", "collage_light", "collage_plus")
ZERO_STRATEGIES = ("mixed_fp32", "collage_plus")
WHOLE = 1 << 62  # a chunk larger than any partition
MIB = 2**20


# --- time: the tracked step against the untracked one, in this process ---------------


def make_params(total: float, tensors: int, seed: int = 0) -> list[torch.nn.Parameter]:
    """``tensors`` square-ish bf16 matrices holding about ``total`` elements."""
    gen = torch.Generator().manual_seed(seed)
    side = int((total / tensors) ** 0.5)
    params = []
    for _ in range(tensors):
        param = torch.nn.Parameter((torch.randn(side, side, generator=gen) * 0.02).bfloat16())
        param.grad = (torch.randn(side, side, generator=gen) * 1e-3).bfloat16()
        params.append(param)
    return params


def build(name: str, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    if name == "mixed_fp32":
        return AdamW(params, lr=1e-4, weight_decay=0.1, master_dtype=torch.float32)
    return CollageAdamW(params, lr=1e-4, weight_decay=0.1, mode=name.removeprefix("collage_"))


def time_steps(optimizer: torch.optim.Optimizer, steps: int) -> dict[bool, float]:
    """Median seconds per step with tracking off and on, alternating step by step."""
    optimizer.step()  # allocate state
    times: dict[bool, list[float]] = {False: [], True: []}
    for i in range(2 * steps):
        track = i % 2 == 1
        optimizer.track_edq = track
        start = time.perf_counter()
        optimizer.step()
        times[track].append(time.perf_counter() - start)
    optimizer.track_edq = False
    return {track: statistics.median(values) for track, values in times.items()}


def measure_time(names: list[str], total: float, tensors: int, steps: int) -> list[dict]:
    rows = []
    for name in names:
        params = make_params(total, tensors)
        timings = time_steps(build(name, params), steps)
        rows.append(
            {
                "optimizer": name,
                "numel": sum(p.numel() for p in params),
                "step_s_untracked": timings[False],
                "step_s_tracked": timings[True],
                "ratio": timings[True] / timings[False],
            }
        )
        print(rows[-1], flush=True)
    return rows


def time_table(rows: list[dict], log_every: int) -> str:
    return table(
        ["optimizer", "step, EDQ off (ms)", "step, EDQ on (ms)", "on / off",
         f"amortised overhead at every {log_every} steps"],
        [
            [r["optimizer"], f"{1e3 * r['step_s_untracked']:.1f}",
             f"{1e3 * r['step_s_tracked']:.1f}", f"{r['ratio']:.2f}",
             f"{100 * (r['ratio'] - 1) / log_every:.1f}%"]
            for r in rows
        ],
    )  # fmt: skip


# --- memory: the tracked step's peak under ZeRO-2, two launched ranks ------------------


def measure_memory(
    model_name: str, seq_len: int, device: str, steps: int, overrides: list[str]
) -> list[dict]:
    """Worker: run inside each launched rank; every rank returns its rows."""
    from collage_train.metrics.live_memory import LiveTensorBytes

    rows = []
    for name in ZERO_STRATEGIES:
        for chunked in (True, False):
            run = zero_setup.build(model_name, name, 2, seq_len, device, overrides)
            engine, optimizer = run.engine, run.optimizer
            state_bytes = run.num_params * engine.peak_state_bytes_per_param(run.strategy)
            if not chunked:  # prepare sized the chunks (engine.base.declare_layout): undo
                optimizer.step_chunk_numel = WHOLE
                if hasattr(optimizer, "tracks_in_chunks"):
                    optimizer.tracks_in_chunks = False
            gen = torch.Generator().manual_seed(engine.rank)
            peaks: dict[bool, list[int]] = {False: [], True: []}
            for step in range(1 + 2 * steps):
                run.backward(gen)
                track = step % 2 == 0 and step > 0
                with LiveTensorBytes() as live:
                    start = live.current
                    engine.step(run.cfg.optim.lr, track)
                if step > 0:  # the first step creates the optimizer state
                    peaks[track].append(live.peak - start)
            extra = max(peaks[True]) - max(peaks[False])
            rows.append(
                {
                    "strategy": name,
                    "tracking": "chunked" if chunked else "whole partition",
                    "rank": engine.rank,
                    "num_params": run.num_params,
                    "chunk_numel": optimizer.step_chunk_numel if chunked else None,
                    "state_bytes": state_bytes,
                    "step_peak_untracked": max(peaks[False]),
                    "step_peak_tracked": max(peaks[True]),
                    "tracking_extra_bytes": extra,
                    "extra_over_state": extra / state_bytes,
                    "device": str(engine.device),
                }
            )
            run.close()
    return rows


def memory_table(rows: list[dict]) -> str:
    return table(
        ["strategy", "EDQ tracking", "rank", "model state MiB", "step peak MiB, untracked",
         "tracked", "tracking adds MiB", "of the state"],
        [
            [r["strategy"], r["tracking"], r["rank"], f"{r['state_bytes'] / MIB:.1f}",
             f"{r['step_peak_untracked'] / MIB:.1f}", f"{r['step_peak_tracked'] / MIB:.1f}",
             f"{r['tracking_extra_bytes'] / MIB:.2f}", f"{100 * r['extra_over_state']:.2f}%"]
            for r in rows
        ],
    )  # fmt: skip


def main() -> None:
    cli = parser(
        __doc__,
        steps=(None, "tracked (and untracked) steps: default 10 (time), 2 (memory)"),
        model=("gpt_125m", "memory: model preset (configs/model/)"),
        seq_len=64,
        device=("auto", "memory: auto, cpu or cuda"),
        overrides=True,
        worker=True,
    )
    cli.add_argument("--measure", nargs="+", choices=("time", "memory"), default=["time", "memory"])
    cli.add_argument("--params", type=float, default=8e6, help="time: parameters")
    cli.add_argument("--tensors", type=int, default=20, help="time: in this many tensors")
    cli.add_argument("--log-every", type=int, default=10, help="time: the amortised column's")
    cli.add_argument("--optimizers", nargs="+", default=list(OPTIMIZERS), choices=OPTIMIZERS)
    args = cli.parse_args()

    if args.worker_out is not None:  # inside a launched rank
        rows = measure_memory(args.model, args.seq_len, args.device, args.steps, args.overrides)
        rank_output(args.worker_out, rows)
        return

    results, entries = {}, []
    if "time" in args.measure:
        steps = args.steps or 10
        rows = measure_time(args.optimizers, args.params, args.tensors, steps)
        results["time"] = rows
        entries.append(
            (
                "Cost of effective-descent-quality tracking",
                f"{rows[0]['numel'] / 1e6:.1f}M bf16 parameters in {args.tensors} tensors, "
                f"median of {steps} steps each way, tracked and untracked steps alternating.",
                time_table(rows, args.log_every),
            )
        )
    if "memory" in args.measure:
        steps = args.steps or 2
        worker = ["--model", args.model, "--seq-len", str(args.seq_len), "--device", args.device,
                  "--steps", str(steps), *args.overrides]  # fmt: skip
        per_rank = launch_ranks(
            Path(__file__).resolve(), worker, 2, launcher="deepspeed", device=args.device,
            label="the ZeRO-2 memory measurement",
        )  # fmt: skip
        rows = [row for pair in zip(*per_rank, strict=True) for row in pair]
        results["memory"] = rows
        entries.append(
            (
                f"What EDQ tracking adds to the step's peak under ZeRO-2, {args.model}, 2 ranks",
                f"{rows[0]['num_params'] / 1e6:.1f}M parameters on {rows[0]['device']}, "
                f"sequence {args.seq_len}, micro-batch 1. Live-tensor peak of "
                "`ZeroEngine.step` (DeepSpeed's step and the project's optimizer on the flat "
                "partition) with tracking on minus off; model state = weights + gradients + "
                "master partition + optimizer state per rank (analytic, what "
                "`chunk_numel_for` budgets 2% of). 'chunked' is how the trainer runs; "
                "'whole partition' tracks the partition in one piece (as before).",
                memory_table(rows),
            )
        )
    print("\n\n".join(text for _, _, text in entries))
    write_json(args.json, results)
    if args.record:
        for title, description, text in entries:
            append_results(title, description, text)


if __name__ == "__main__":
    main()
