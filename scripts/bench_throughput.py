"""Throughput where users feel it: one model on one GPU, each strategy at an equal
micro-batch and at the largest micro-batch the planner lets it run, compile off and on.

For each precision strategy (default ``mixed_fp32``, ``bf16``, ``collage_plus``) and each
``train.compile`` setting, two rows, all with activation checkpointing:

- ``equal``: the same micro-batch for every strategy (``--micro-batch``, default 8, the
  gpt_1.3b recipe's);
- ``largest``: the strategy's largest micro-batch from the planner
  (``planning.memory_plan.largest_micro_batch`` with one micro-batch per step, as these runs
  take, for the device's memory less ``--reserve-gb``, the planner's ``plan.reserve_gb``).
  What the paper's throughput gain comes from: less state, more sequences per step.

Each row is one short run of the real CLI in its own process (``runs.run_training``):
tokens/s and MFU from the run's summary, over the steps after the first (which pays for
compilation): enough for ``--timed-tokens``, at least ``--min-timed-steps``; the
measured peak (``torch.cuda.max_memory_allocated``; on CPU the process's peak RSS, not
comparable with the plan) and the planner's predicted peak for the same setting
(``planning.memory_plan.estimate``, with the optimizer kernel the run used), with their ratio.
Each run's directory (it ends with a checkpoint) is deleted once read. Rows go to
``--json`` as each finishes, so a run cut short keeps what it measured; a run that fails
(e.g. out of memory) is a row with its error line. ``--deterministic both`` runs each
row with and without ``train.deterministic`` and gives the deterministic row's tokens/s
over the other's: what the setting costs (docs/reproducibility.md).

    python scripts/bench_throughput.py --json throughput.json          # gpt_1.3b, seq 2048, GPU
    python scripts/bench_throughput.py --compile on --roles largest     # a part of it
    python scripts/bench_throughput.py --strategies collage_plus --compile off --roles equal \\
        --deterministic both                                            # the setting's cost
    python scripts/bench_throughput.py --dry-run --gpu-mem-gb 80        # the planned rows only
    python scripts/bench_throughput.py --model gpt_tiny --seq-len 64 --device cpu \\
        --gpu-mem-gb 0.01 --strategies bf16 --compile off --timed-tokens 1 --no-record

The table is printed and appended to docs/results-history.md (``--no-record`` to skip).
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from common import default_device, machine, parser, publish, ratio, table, write_json
from runs import quiet_run, run_training

from collage_train.compose import compose_job
from collage_train.planning.memory_plan import (
    GIB,
    ModelShape,
    Setting,
    estimate,
    largest_micro_batch,
)
from collage_train.precision import get_strategy

STRATEGIES = ("mixed_fp32", "bf16", "collage_plus")
BASELINE = "mixed_fp32"
COMPILE_MODES = {"off": (False,), "on": (True,), "both": (False, True)}
DETERMINISTIC_MODES = COMPILE_MODES  # train.deterministic: off | on | both
ROLES = ("equal", "largest")


def model_shape(args: argparse.Namespace) -> ModelShape:
    """The shape of the model the runs build (the same overrides, on the meta device)."""
    cfg = compose_job([f"model={args.model}", f"data.seq_len={args.seq_len}", *args.overrides])
    vocab = cfg.model.vocab_size or cfg.data.vocab_size
    return ModelShape.from_config(cfg.model, vocab_size=vocab, seq_len=args.seq_len)


def predicted_peak(shape: ModelShape, strategy: str, micro_batch: int, fused: bool) -> float:
    """The planner's step peak for one micro-batch per step, with checkpointing."""
    setting = Setting(get_strategy(strategy), 0, fused_optimizer=fused)
    plan = estimate(shape, setting, micro_batch=micro_batch, accum_steps=1, checkpointing=True)
    return plan.peak


def largest_fitting(shape: ModelShape, strategy: str, budget: float, cap: int) -> int:
    """The largest micro-batch up to ``cap`` that the planner fits in ``budget`` bytes as
    a whole step (``largest_micro_batch`` with the global batch equal to it), for the
    eager optimizer step the planner assumes where the fused kernel may fall back."""
    setting = Setting(get_strategy(strategy), 0, fused_optimizer=False)
    best = 0
    for micro in range(1, cap + 1):
        fits = largest_micro_batch(
            shape, setting, budget=budget, global_batch=micro, checkpointing=True
        )
        if fits == micro:
            best = micro
    return best


def plan_rows(args: argparse.Namespace, shape: ModelShape, budget: float) -> list[dict]:
    """Every row to run: strategy, compile setting, role, micro-batch and
    ``train.deterministic``."""
    rows = []
    for compile_model in COMPILE_MODES[args.compile]:
        for strategy in args.strategies:
            largest = largest_fitting(shape, strategy, budget, args.max_micro_batch)
            for role, micro in (("equal", args.micro_batch), ("largest", largest)):
                if role not in args.roles:
                    continue
                for deterministic in DETERMINISTIC_MODES[args.deterministic]:
                    row = {"strategy": strategy, "compile": compile_model, "role": role}
                    row["deterministic"] = deterministic
                    row["micro_batch"] = micro
                    row["planned_largest"] = largest
                    if micro < 1 or micro > largest:
                        row["error"] = f"the planner fits at most micro-batch {largest}"
                    rows.append(row)
    return rows


def run_row(
    args: argparse.Namespace, row: dict, workdir: Path, peak_tflops: float | None
) -> dict[str, Any]:
    """One training run for ``row``; its summary's numbers, or its error line."""
    steps = 1 + timed_steps(args, row["micro_batch"])
    overrides = [
        f"model={args.model}",
        f"precision={row['strategy']}",
        f"data.seq_len={args.seq_len}",
        f"train.micro_batch_size={row['micro_batch']}",
        f"train.global_batch_size={row['micro_batch']}",
        "train.eval_batches=1",
        # validation must fill one of the largest micro-batches: 15% of the stdlib corpus
        # (3.7M tokens) is 270 sequences of 2048, above the 256 the search stops at
        "data.val_fraction=0.15",
        "train.keep_checkpoints=1",
        "train.activation_checkpointing=true",
        f"train.compile={str(row['compile']).lower()}",
        f"train.deterministic={str(row['deterministic']).lower()}",
        f"train.device={args.device}",
        *quiet_run(steps),
        *([f"metrics.peak_tflops={peak_tflops}"] if peak_tflops else []),
        *args.overrides,
    ]
    run_dir = workdir / "run"
    start = time.perf_counter()
    try:
        summary, _ = run_training(overrides, run_dir)
    except RuntimeError as error:
        lines = [line for line in str(error).splitlines() if line.strip()]
        return {"error": lines[-1] if lines else "failed", "run_seconds": _since(start)}
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)  # a checkpoint of the whole state
    return {
        "tokens_per_s": summary["tokens_per_s"],
        "mfu": summary["mfu"],
        "peak_mem_bytes": summary["peak_mem_bytes"],
        "optimizer_kernel": summary["optimizer_kernel"],
        "run_seconds": _since(start),
    }


def timed_steps(args: argparse.Namespace, micro_batch: int) -> int:
    """Steps after the first: ``--timed-tokens`` tokens, at least ``--min-timed-steps``."""
    tokens = micro_batch * args.seq_len
    return max(args.min_timed_steps, -(-args.timed_tokens // tokens))


def _since(start: float) -> float:
    return round(time.perf_counter() - start, 1)


def measure(args: argparse.Namespace, shape: ModelShape, rows: list[dict], write) -> None:
    """Run each planned row (one run per distinct setting), filling in its numbers."""
    peak = _cpu_peak_tflops() if args.device == "cpu" else None
    done: dict[tuple, dict] = {}
    with tempfile.TemporaryDirectory(prefix="bench_throughput_") as tmp:
        for row in rows:
            if "error" in row:
                write(rows)
                continue
            key = (row["strategy"], row["compile"], row["micro_batch"], row["deterministic"])
            if key not in done:
                done[key] = run_row(args, row, Path(tmp), peak)
            row.update(done[key])
            if "peak_mem_bytes" in row:
                fused = row["optimizer_kernel"] == "compiled"
                planned = predicted_peak(shape, row["strategy"], row["micro_batch"], fused)
                row["predicted_peak_bytes"] = planned
                row["predicted_over_measured"] = planned / row["peak_mem_bytes"]
            print(json.dumps(row), flush=True)
            write(rows)


def _cpu_peak_tflops() -> float:
    from bench_train import cpu_matmul_tflops  # the MFU denominator on CPU

    return cpu_matmul_tflops()


def _gib(value: float | None) -> str:
    return f"{value / GIB:.2f}" if value else "-"


def render(rows: list[dict]) -> str:
    """Markdown rows; tokens/s also against mixed_fp32 at the equal micro-batch (same
    compile and deterministic settings) and, where both were run, the deterministic row's
    against the same row without it (what ``train.deterministic`` costs)."""
    base = {
        (row["compile"], row["deterministic"]): row.get("tokens_per_s")
        for row in rows
        if row["strategy"] == BASELINE and row["role"] == "equal"
    }
    plain = {
        (row["strategy"], row["compile"], row["role"]): row.get("tokens_per_s")
        for row in rows
        if not row["deterministic"]
    }
    costed = any(row["deterministic"] for row in rows)
    header = ["strategy", "compile", "micro-batch", "tokens/s", "x mixed_fp32 (equal)", "MFU",
              "peak GiB", "planned GiB", "planned / measured"]  # fmt: skip
    header += ["x deterministic off"] if costed else []
    lines = []
    for row in rows:
        deterministic = ", deterministic" if row["deterministic"] else ""
        name = f"{row['strategy']} ({row['role']}{deterministic})"
        compiled = "on" if row["compile"] else "off"
        if row.get("tokens_per_s") is None:
            planned = _gib(row.get("predicted_peak_bytes"))
            cells = [name, compiled, row["micro_batch"], "-", "-", "-", "-", planned, "-"]
            cells += ["-"] if costed else []
            lines.append(cells + ([row["error"]] if row.get("error") else []))
            continue
        tokens, mfu = row["tokens_per_s"], row.get("mfu")
        baseline = base.get((row["compile"], row["deterministic"]))
        cells = [
            name, compiled, row["micro_batch"], f"{tokens:,.0f}", ratio(tokens, baseline),
            f"{mfu:.1%}" if mfu is not None else "-", _gib(row["peak_mem_bytes"]),
            _gib(row["predicted_peak_bytes"]), f"{row['predicted_over_measured']:.2f}",
        ]  # fmt: skip
        if costed:
            off = plain.get((row["strategy"], row["compile"], row["role"]))
            cells.append(ratio(tokens, off) if row["deterministic"] else "-")
        lines.append(cells)
    return table(header, lines)


def device_budget(args: argparse.Namespace) -> float:
    """Bytes the planner may fill: the device's memory (or ``--gpu-mem-gb``) less the
    reserve."""
    if args.gpu_mem_gb is not None:
        total = args.gpu_mem_gb * GIB
    elif args.device == "cuda":
        total = torch.cuda.get_device_properties(0).total_memory
    else:
        raise SystemExit(
            "error: on CPU give --gpu-mem-gb, the memory the planner picks micro-batches for"
        )
    return total - args.reserve_gb * GIB


def main() -> None:
    cli = parser(__doc__, model="gpt_1.3b", seq_len=2048, device=default_device(), overrides=True)
    cli.add_argument("--strategies", nargs="*", default=list(STRATEGIES))
    cli.add_argument("--micro-batch", type=int, default=8, help="the equal micro-batch")
    cli.add_argument("--max-micro-batch", type=int, default=256, help="planner search cap")
    cli.add_argument("--compile", choices=sorted(COMPILE_MODES), default="both")
    cli.add_argument("--roles", nargs="*", choices=ROLES, default=list(ROLES))
    cli.add_argument(
        "--deterministic",
        choices=sorted(DETERMINISTIC_MODES),
        default="off",
        help="train.deterministic for every row; both: each row with and without it",
    )
    cli.add_argument("--timed-tokens", type=int, default=2**18, help="per run, after step 1")
    cli.add_argument("--min-timed-steps", type=int, default=3)
    cli.add_argument("--gpu-mem-gb", type=float, default=None, help="default: the device's")
    cli.add_argument("--reserve-gb", type=float, default=2.0, help="as plan.reserve_gb")
    cli.add_argument("--dry-run", action="store_true", help="plan the rows, run nothing")
    args = cli.parse_args()
    if args.min_timed_steps < 1:
        cli.error("--min-timed-steps must be at least 1")

    budget = device_budget(args)
    shape = model_shape(args)
    rows = plan_rows(args, shape, budget)
    header = {
        "model": args.model,
        "seq_len": args.seq_len,
        "num_params": shape.num_params,
        "budget_bytes": budget,
        "timed_tokens": args.timed_tokens,
        "min_timed_steps": args.min_timed_steps,
        "machine": machine() if not args.dry_run else None,
        "dry_run": args.dry_run,
    }

    def write(current: list[dict]) -> None:  # as the rows come: a run cut short keeps them
        write_json(args.json, {**header, "rows": current})

    if args.dry_run:
        for row in rows:
            if "error" not in row:
                row["predicted_peak_bytes"] = predicted_peak(
                    shape, row["strategy"], row["micro_batch"], fused=False
                )
        write(rows)
        print(render(rows))
        return
    measure(args, shape, rows, write)
    publish(
        args,
        render(rows),
        {**header, "rows": rows},
        f"Throughput benchmark, {args.model} at sequence {args.seq_len}",
        f"One process, activation checkpointing; micro-batch {args.micro_batch} for "
        f"every strategy and each strategy's largest from the planner for "
        f"{budget / GIB:.1f} GiB; timed over at least {args.timed_tokens} tokens and "
        f"{args.min_timed_steps} steps after the first; "
        "planned: memory_plan's step peak for the same setting.",
    )


if __name__ == "__main__":
    main()
