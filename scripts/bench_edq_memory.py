"""What tracking EDQ adds to the optimizer step's peak under ZeRO, counted tensor by tensor.

Two ranks (the real ``deepspeed`` launcher; CPU accelerator with gloo unless a GPU is
present) build the model under ZeRO-2, and each measures the live-tensor peak of
``ZeroEngine.step`` (DeepSpeed's step around the project's optimizer, which updates one
flat partition per parameter group) with EDQ tracking off and on, alternating, with
``collage_train.metrics.live_memory.LiveTensorBytes``. The excess of a tracked step is
compared with the rank's model state (weights, gradients, master partition, optimizer
state: what ``chunk_numel_for`` budgets 2% of), once as the trainer runs it (tracking a
chunk at a time) and once tracking the whole partition at once (how it was done before).

    python scripts/bench_edq_memory.py --model gpt_125m --seq-len 64

The table is printed and appended to docs/results-history.md (``--no-append`` to skip).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from runs import REPO, append_results

STRATEGIES = ("mixed_fp32", "collage_plus")
WHOLE = 1 << 62  # a chunk larger than any partition


def measure(model_name: str, seq_len: int, device: str, steps: int) -> list[dict]:
    """Worker: run inside each launched rank; every rank returns its rows."""
    import torch
    import torch.nn.functional as F
    from hydra import compose, initialize_config_dir

    from collage_train.cli import config_dir
    from collage_train.config import register_schemas
    from collage_train.engine import build_engine
    from collage_train.metrics.live_memory import LiveTensorBytes
    from collage_train.models import build_model, count_parameters
    from collage_train.optim import decay_param_groups
    from collage_train.precision import get_strategy

    register_schemas()
    rows = []
    for name in STRATEGIES:
        for chunked in (True, False):
            with initialize_config_dir(config_dir(), version_base="1.3"):
                cfg = compose(
                    "config", [f"model={model_name}", f"precision={name}", "distributed=zero2"]
                )
            strategy = get_strategy(name)
            engine = build_engine(cfg.distributed, device=device)
            model = build_model(cfg.model, vocab_size=8192, seq_len=seq_len, eot_id=2, seed=0)
            model = model.to(device=engine.device, dtype=strategy.param_dtype)
            num_params = count_parameters(model)
            optimizer = strategy.build_optimizer(decay_param_groups(model, 0.1), cfg.optim)
            forward = engine.prepare(
                model,
                optimizer,
                strategy=strategy,
                micro_batch_size=1,
                accum_steps=1,
                grad_clip=1.0,
            )
            state_bytes = num_params * engine.peak_state_bytes_per_param(strategy)
            if not chunked:  # prepare sized the chunks (engine.base.declare_layout): undo
                optimizer.step_chunk_numel = WHOLE
                if hasattr(optimizer, "tracks_in_chunks"):
                    optimizer.tracks_in_chunks = False
            gen = torch.Generator().manual_seed(engine.rank)
            peaks: dict[bool, list[int]] = {False: [], True: []}
            for step in range(1 + 2 * steps):
                tokens = torch.randint(0, 8192, (1, seq_len + 1), generator=gen)
                tokens = tokens.to(engine.device)
                logits = forward(input_ids=tokens[:, :-1], use_cache=False).logits
                engine.backward(F.cross_entropy(logits.float().flatten(0, 1), tokens[0, 1:]))
                track = step % 2 == 0 and step > 0
                with LiveTensorBytes() as live:
                    start = live.current
                    engine.step(cfg.optim.lr, track)
                if step > 0:  # the first step creates the optimizer state
                    peaks[track].append(live.peak - start)
            extra = max(peaks[True]) - max(peaks[False])
            rows.append(
                {
                    "strategy": name,
                    "tracking": "chunked" if chunked else "whole partition",
                    "rank": engine.rank,
                    "num_params": num_params,
                    "chunk_numel": optimizer.step_chunk_numel if chunked else None,
                    "state_bytes": state_bytes,
                    "step_peak_untracked": max(peaks[False]),
                    "step_peak_tracked": max(peaks[True]),
                    "tracking_extra_bytes": extra,
                    "extra_over_state": extra / state_bytes,
                    "device": str(engine.device),
                }
            )
            del forward, optimizer, model
            engine.ds.destroy()
    return rows


def table(rows: list[dict]) -> str:
    lines = [
        "| strategy | EDQ tracking | rank | model state MiB | step peak MiB, untracked | "
        "tracked | tracking adds MiB | of the state |",
        "|---|---|---|---|---|---|---|---|",
    ]
    mib = 2**20
    for row in rows:
        lines.append(
            f"| {row['strategy']} | {row['tracking']} | {row['rank']} | "
            f"{row['state_bytes'] / mib:.1f} | {row['step_peak_untracked'] / mib:.1f} | "
            f"{row['step_peak_tracked'] / mib:.1f} | {row['tracking_extra_bytes'] / mib:.2f} | "
            f"{100 * row['extra_over_state']:.2f}% |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt_125m", help="model preset (configs/model/)")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--steps", type=int, default=2, help="tracked (and untracked) steps")
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda")
    parser.add_argument("--json", type=Path, help="also write the rows as JSON")
    parser.add_argument("--no-append", action="store_true", help="skip docs/results-history.md")
    parser.add_argument("--worker-out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.worker_out is not None:  # inside a launched rank
        rows = measure(args.model, args.seq_len, args.device, args.steps)
        rank = int(os.environ.get("RANK", "0"))
        (args.worker_out.parent / f"rank{rank}.json").write_text(json.dumps(rows))
        return

    scratch = Path(tempfile.mkdtemp(prefix="bench_edq_memory_"))
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    if args.device == "cpu" or not _has_gpu():
        env["DS_ACCELERATOR"] = "cpu"
    command = [
        shutil.which("deepspeed") or str(Path(sys.executable).parent / "deepspeed"),
        "--num_gpus", "2", "--no_local_rank", str(Path(__file__).resolve()),
        "--model", args.model, "--seq-len", str(args.seq_len), "--device", args.device,
        "--steps", str(args.steps), "--worker-out", str(scratch / "rows.json"),
    ]  # fmt: skip
    proc = subprocess.run(command, cwd=scratch, env=env, capture_output=True, text=True)
    outputs = sorted(scratch.glob("rank*.json"))
    if proc.returncode != 0 or len(outputs) != 2:
        sys.exit(f"the 2-rank measurement failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    per_rank = [json.loads(path.read_text()) for path in outputs]
    rows = [row for pair in zip(*per_rank, strict=True) for row in pair]
    shutil.rmtree(scratch, ignore_errors=True)
    text = table(rows)
    print(text)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    if not args.no_append:
        append_results(
            f"What EDQ tracking adds to the step's peak under ZeRO-2, {args.model}, 2 ranks",
            f"{rows[0]['num_params'] / 1e6:.1f}M parameters on {rows[0]['device']}, sequence "
            f"{args.seq_len}, micro-batch 1. Live-tensor peak of `ZeroEngine.step` (DeepSpeed's "
            "step and the project's optimizer on the flat partition) with tracking on minus "
            "off; model state = weights + gradients + master partition + optimizer state per "
            "rank (analytic, what `chunk_numel_for` budgets 2% of). 'chunked' is how the "
            "trainer runs; 'whole partition' tracks the partition in one piece (as before).",
            text,
        )


def _has_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


if __name__ == "__main__":
    main()
