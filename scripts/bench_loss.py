"""The LM loss's memory with full logits against blocks of tokens (``collage_train.model.loss``).

Measured on this device (CPU: live-tensor peaks, ``LiveTensorBytes``; CUDA: the
allocator's peak): a Llama of a few small layers with a large vocabulary (default Llama
3's 128256 tokens at sequence 2048, one sequence) trains one forward and backward with
the plain loss (``train.loss_chunk_tokens=off``: fp32 logits of the whole micro-batch)
and with the chunked one (``auto``), for bf16 parameters (bf16, collage_*) and for
autocast over fp32 parameters (mixed_fp32). Reported per row: the loss's own peak (the
output projection and the cross-entropy, forward and backward, above their inputs: the
final hidden states and the head's weight; the weight's gradient included), the step's
forward-and-backward peak, the loss's share of it and the step's wall time (best of
``--repeats``).

Planned (``collage_train.plan``, nothing allocated): the largest micro-batch for
llama_8b (vocabulary 128256) and gpt_6.7b (GPT-2's 50257, and the default 8192) at
sequence 2048 on 8 x 80 GB, with ZeRO-2 and ZeRO-3, collage_plus and mixed_fp32, with
activation checkpointing off and on, before (``off``) and after (``auto``).

    python scripts/bench_loss.py
    python scripts/bench_loss.py --vocab 8192 --seq-len 256 --no-plan --no-record

The tables are printed and appended to docs/results-history.md (``--no-record`` to skip);
``--json PATH`` writes the rows.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F
from common import default_device, parser, publish, table

from collage_train.cpu_bf16 import choose_cpu_bf16_gemm
from collage_train.metrics.live_memory import LiveTensorBytes
from collage_train.model.build import build_model
from collage_train.model.loss import chunked_cross_entropy, install_chunked_loss
from collage_train.model.loss_settings import resolve_chunk_tokens

PRECISIONS = {  # name: (parameter dtype, autocast dtype)
    "bf16 params": (torch.bfloat16, None),
    "mixed_fp32": (torch.float32, torch.bfloat16),
}
PLAN_MODELS = (("llama_8b", 128256), ("gpt_6.7b", 50257), ("gpt_6.7b", 8192))
PLAN_SETTINGS = [(p, d) for d in ("zero2", "zero3") for p in ("collage_plus", "mixed_fp32")]
MIB = 2**20


def llama(args: argparse.Namespace) -> torch.nn.Module:
    cfg = SimpleNamespace(
        family="llama", name="bench", hidden_size=args.hidden, num_layers=args.layers,
        num_heads=args.heads, ffn_hidden_size=None, init_std=0.02, dropout=0.0,
        vocab_size=None, attn_implementation="sdpa", extra={}, num_kv_heads=None,
        tie_embeddings=False,
    )  # fmt: skip
    return build_model(cfg, vocab_size=args.vocab, seq_len=args.seq_len, eot_id=0, seed=0)


def peak_bytes(device: torch.device, run: Callable[[], Any], held: list[torch.Tensor]) -> int:
    """Peak bytes above ``held`` while ``run`` executes. On a GPU the allocator's peak
    above what is allocated now (collected first: garbage of earlier runs would count);
    on a CPU the tensors ``run`` creates, tracked, so that nothing earlier counts and no
    collection is needed (a full one takes a second in a process holding much)."""
    if device.type == "cuda":
        gc.collect()
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        run()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base
    with LiveTensorBytes() as live:
        live.track(held)
        base = live.current
        run()
    return live.peak - base


def best_seconds(device: torch.device, run: Callable[[], Any], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        run()
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best


def measure(args: argparse.Namespace, precision: str, device: torch.device) -> list[dict]:
    """Rows for the plain and the chunked loss at one precision (two copies of the model;
    their steps timed in turn, so that both see the same machine load)."""
    param_dtype, autocast_dtype = PRECISIONS[precision]
    gemm = choose_cpu_bf16_gemm("auto", device, computes_in_bf16=True)
    gen = torch.Generator().manual_seed(0)
    batch = torch.randint(0, args.vocab, (args.micro_batch, args.seq_len + 1), generator=gen)
    inputs, targets = batch[:, :-1].to(device), batch[:, 1:].to(device)
    chunk = resolve_chunk_tokens(args.chunk, vocab_size=args.vocab, chunkable=True)
    if chunk is None or chunk >= inputs.numel():
        raise SystemExit(f"one block of {chunk} tokens covers the micro-batch: nothing to compare")
    hidden = torch.randn(
        args.micro_batch, args.seq_len, args.hidden, generator=gen, dtype=param_dtype
    ).to(device)
    hidden.requires_grad_(True)

    def autocast() -> contextlib.AbstractContextManager[Any]:
        if autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device.type, dtype=autocast_dtype)

    def step_of(model: torch.nn.Module, chunked: bool) -> Callable[[], None]:
        def step() -> None:
            model.zero_grad(set_to_none=True)
            with gemm.context(compiled=False):
                with autocast():
                    if chunked:
                        loss = model(input_ids=inputs, targets=targets, use_cache=False).loss
                    else:
                        logits = model(input_ids=inputs, use_cache=False).logits
                if not chunked:
                    loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
                loss.backward()

        return step

    def loss_of(head: torch.Tensor, chunked: bool) -> Callable[[], None]:
        def loss_alone() -> None:
            head.grad = hidden.grad = None
            with gemm.context(compiled=False):
                with autocast():
                    if chunked:
                        loss = chunked_cross_entropy(hidden, head, targets, chunk)
                    else:
                        logits = F.linear(hidden, head)
                if not chunked:
                    loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
                loss.backward()

        return loss_alone

    variants = {}
    for chunked in (False, True):
        model = llama(args).to(device=device, dtype=param_dtype)
        if chunked:
            install_chunked_loss(model, chunk)
        head = model.get_output_embeddings().weight
        step = step_of(model, chunked)
        step()  # warm-up
        variants[chunked] = {
            "step": step,
            "step_peak": peak_bytes(device, step, list(model.parameters())),
            "loss_peak": peak_bytes(device, loss_of(head, chunked), [hidden, head]),
            "seconds": float("inf"),
        }
    for _ in range(args.repeats):
        for variant in variants.values():
            variant["seconds"] = min(variant["seconds"], best_seconds(device, variant["step"], 1))
    rows = []
    for chunked, variant in variants.items():
        rows.append(
            {
                "precision": precision,
                "loss": f"blocks of {chunk}" if chunked else "full logits",
                "chunk_tokens": chunk if chunked else None,
                "loss_peak_bytes": variant["loss_peak"],
                "step_peak_bytes": variant["step_peak"],
                "loss_share": variant["loss_peak"] / variant["step_peak"],
                "step_seconds": variant["seconds"],
                "bf16_gemm": gemm.mode,
            }
        )
        print(measured_table(rows[-1:]).splitlines()[-1], flush=True)
    variants.clear()
    if device.type == "cuda":
        gc.collect()  # the models' memory back to the allocator before the next precision
    return rows


def measured_table(rows: list[dict]) -> str:
    return table(
        ["precision", "loss", "loss peak MiB", "step peak MiB", "loss share", "step s"],
        (
            [r["precision"], r["loss"], f"{r['loss_peak_bytes'] / MIB:.1f}",
             f"{r['step_peak_bytes'] / MIB:.1f}", f"{r['loss_share']:.0%}",
             f"{r['step_seconds']:.2f}"]
            for r in rows
        ),
        right=(2, 3, 4, 5),
    )  # fmt: skip


def planned_rows() -> list[dict]:
    """The planner's largest micro-batches, before (off) and after (auto)."""
    from collage_train.compose import compose_job
    from collage_train.plan import make_plan

    rows = []
    for model, vocab in PLAN_MODELS:
        plans = {}
        for setting in ("off", "auto"):
            overrides = [
                f"model={model}", "data.seq_len=2048", f"data.vocab_size={vocab}",
                "train.global_batch_size=256", "train.micro_batch_size=1",
                "distributed=zero2", "plan.gpus=8", "plan.gpu_mem_gb=80",
                f"train.loss_chunk_tokens={setting}",
            ]  # fmt: skip
            rows_of = make_plan(compose_job(overrides)).rows
            plans[setting] = {(r.strategy, r.stage): r for r in rows_of}
        for precision, distributed in PLAN_SETTINGS:
            key = (precision, int(distributed[-1]))
            before, after = plans["off"][key], plans["auto"][key]
            rows.append(
                {
                    "model": model,
                    "vocab": vocab,
                    "precision": precision,
                    "distributed": distributed,
                    "chunk_tokens": after.loss_chunk_tokens,
                    "max_micro_batch": [before.max_micro_batch, after.max_micro_batch],
                    "max_micro_batch_checkpointed": [
                        before.max_micro_batch_checkpointed,
                        after.max_micro_batch_checkpointed,
                    ],
                    "peak_gib_at_1_checkpointed": [
                        before.checkpointed.peak / 2**30,
                        after.checkpointed.peak / 2**30,
                    ],
                }
            )
    return rows


def planned_table(rows: list[dict]) -> str:
    def cells(r: dict) -> list[object]:
        plain, ckpt = r["max_micro_batch"], r["max_micro_batch_checkpointed"]
        peak = r["peak_gib_at_1_checkpointed"]
        return [
            r["model"], r["vocab"], r["precision"], r["distributed"], r["chunk_tokens"],
            f"{plain[0]} -> {plain[1]}", f"{ckpt[0]} -> {ckpt[1]}",
            f"{peak[0]:.2f} -> {peak[1]:.2f}",
        ]  # fmt: skip

    return table(
        ["model", "vocabulary", "precision", "ZeRO", "block",
         "largest micro-batch, before -> after", "checkpointed",
         "peak at micro-batch 1, checkpointed, GiB"],
        map(cells, rows),
        right=(1, 4),
    )  # fmt: skip


def main() -> None:
    cli = parser(
        __doc__,
        seq_len=2048,
        repeats=(3, "timed steps; the best is kept"),
        device=default_device(),
    )
    cli.add_argument("--vocab", type=int, default=128256)
    cli.add_argument("--micro-batch", type=int, default=1)
    cli.add_argument("--hidden", type=int, default=256)
    cli.add_argument("--layers", type=int, default=2)
    cli.add_argument("--heads", type=int, default=4)
    cli.add_argument("--chunk", default="auto", help="train.loss_chunk_tokens: auto or N")
    cli.add_argument("--precisions", nargs="+", default=list(PRECISIONS), choices=PRECISIONS)
    cli.add_argument("--no-plan", action="store_true", help="skip the planner's table")
    args = cli.parse_args()
    device = torch.device(args.device)

    measured = [row for p in args.precisions for row in measure(args, p, device)]
    planned = [] if args.no_plan else planned_rows()
    shape = (
        f"Llama, {args.layers} layers, hidden {args.hidden}, vocabulary {args.vocab}, "
        f"sequence {args.seq_len}, micro-batch {args.micro_batch}, on {device}"
    )
    publish(
        args,
        measured_table(measured) + ("\n\n" + planned_table(planned) if planned else ""),
        {"measured": measured, "planned": planned},
        f"The LM loss's memory: full logits against blocks ({shape})",
        "Loss peak: the output projection and cross-entropy, forward and backward, "
        "above their inputs (weight gradient included); step peak: one forward and "
        "backward of the whole model (no optimizer step); step s: best wall time.",
    )


if __name__ == "__main__":
    main()
