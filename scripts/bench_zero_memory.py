"""Model-state bytes per parameter per rank under DeepSpeed ZeRO, measured against analytic.

For every precision strategy and ZeRO stage, two ranks (the real ``deepspeed`` launcher,
CPU accelerator with gloo unless a GPU is present) build the model, take one optimizer
step through ``ZeroEngine`` and measure what each rank holds between steps: weights,
master partition and optimizer state (gradients are freed after every step and are
listed analytically), and whether the master partition is the weight partition itself
(``ZeroEngine.shares_weight_partitions``) or a copy of its own. The analytic values are
``collage_train.engine.zero_memory``.

    python scripts/bench_zero_memory.py --model gpt_125m --json zero_memory.json

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

STRATEGIES = ("mixed_fp32", "bf16", "collage_light", "collage_plus", "scalify_fp32_params")
STAGES = (1, 2, 3)


def measure(model_name: str, seq_len: int, device: str, strategies: list[str]) -> list[dict]:
    """Worker: run inside each launched rank; rank 0 returns the rows."""
    import torch
    import torch.nn.functional as F
    from hydra import compose, initialize_config_dir

    from collage_train.cli import config_dir
    from collage_train.config import register_schemas
    from collage_train.engine import build_engine
    from collage_train.engine.zero_memory import zero_state_bytes
    from collage_train.models import build_model, count_parameters
    from collage_train.optim import decay_param_groups
    from collage_train.precision import get_strategy

    register_schemas()
    rows = []
    for stage in STAGES:
        for name in strategies:
            with initialize_config_dir(config_dir(), version_base="1.3"):
                cfg = compose(
                    "config",
                    [f"model={model_name}", f"precision={name}", f"distributed=zero{stage}"],
                )
            strategy = get_strategy(name)
            engine = build_engine(cfg.distributed, device=device)
            model = build_model(cfg.model, vocab_size=8192, seq_len=seq_len, eot_id=2, seed=0)
            model = model.to(device=engine.device, dtype=strategy.param_dtype)
            model = strategy.prepare_model(model)  # e.g. Scalify's module swap
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
            tokens = torch.randint(0, 8192, (1, seq_len + 1), device=engine.device)
            logits = forward(input_ids=tokens[:, :-1], use_cache=False).logits
            engine.backward(F.cross_entropy(logits.float().flatten(0, 1), tokens[0, 1:]))
            engine.step(cfg.optim.lr, track_edq=False)
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
            expected = zero_state_bytes(strategy, stage, engine.world_size)
            rows.append(
                {
                    "strategy": name,
                    "zero_stage": stage,
                    "world_size": engine.world_size,
                    "num_params": num_params,
                    "measured_bytes_per_param": [g.item() / num_params for g in gathered],
                    "expected_bytes_per_param": expected.persistent,
                    "expected_gradient_bytes_per_param": expected.gradients,
                    "state_dtypes": dtypes,
                    "master_is_weights": engine.shares_weight_partitions,
                    "device": str(engine.device),
                }
            )
            del forward, optimizer, model
            engine.ds.destroy()
    return rows


def table(rows: list[dict]) -> str:
    lines = [
        "| strategy | ZeRO stage | measured B/param, rank 0 / rank 1 | analytic | ratio | "
        "gradients (analytic) | master partition | master + optimizer dtypes |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        measured = row["measured_bytes_per_param"]
        lines.append(
            f"| {row['strategy']} | {row['zero_stage']} | "
            f"{' / '.join(f'{m:.2f}' for m in measured)} | "
            f"{row['expected_bytes_per_param']:.2f} | "
            f"{max(measured) / row['expected_bytes_per_param']:.3f} | "
            f"{row['expected_gradient_bytes_per_param']:.2f} | "
            f"{'the weights' if row.get('master_is_weights') else 'own copy'} | "
            f"{', '.join(row['state_dtypes'])} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt_125m", help="model preset (configs/model/)")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument(
        "--strategies", nargs="+", default=list(STRATEGIES), help="precision strategies"
    )
    parser.add_argument("--json", type=Path, help="also write the rows as JSON")
    parser.add_argument("--no-append", action="store_true", help="skip docs/results-history.md")
    parser.add_argument("--worker-out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.worker_out is not None:  # inside a launched rank
        rows = measure(args.model, args.seq_len, args.device, args.strategies)
        if int(os.environ.get("RANK", "0")) == 0:
            args.worker_out.write_text(json.dumps(rows))
        return

    scratch = Path(tempfile.mkdtemp(prefix="bench_zero_"))
    out = scratch / "rows.json"
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    if args.device == "cpu" or not _has_gpu():
        env["DS_ACCELERATOR"] = "cpu"
    command = [
        shutil.which("deepspeed") or str(Path(sys.executable).parent / "deepspeed"),
        "--num_gpus", str(args.ranks), "--no_local_rank", str(Path(__file__).resolve()),
        "--model", args.model, "--seq-len", str(args.seq_len), "--device", args.device,
        "--worker-out", str(out), "--strategies", *args.strategies,
    ]  # fmt: skip
    proc = subprocess.run(command, cwd=scratch, env=env, capture_output=True, text=True)
    if proc.returncode != 0 or not out.is_file():
        sys.exit(f"the {args.ranks}-rank measurement failed:\n{proc.stdout[-3000:]}")
    rows = json.loads(out.read_text())
    shutil.rmtree(scratch, ignore_errors=True)
    text = table(rows)
    print(text)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    if not args.no_append:
        append_results(
            f"Model-state bytes per parameter under ZeRO, {args.model}, {args.ranks} ranks",
            f"{rows[0]['num_params'] / 1e6:.1f}M parameters on {rows[0]['device']}; per rank "
            "after one step: weights + master partition + optimizer state (gradients are freed "
            "between steps, listed analytically).",
            text,
        )


def _has_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


if __name__ == "__main__":
    main()
