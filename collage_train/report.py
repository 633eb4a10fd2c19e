"""What a run says about itself: the line describing it at the start, a record per logged
window of steps, and ``summary.json`` (with ``plots/``) at the end.

Everything here reads a built ``Trainer`` and changes nothing; the trainer calls it and
hands the summary to its sinks. The summary's keys are part of the public interface
(docs/runs.md, "Outputs"): ``final_train_loss``, ``final_val_loss``, ``tokens_per_s``,
``peak_mem_bytes``, ``state_bytes_per_param``, ``wall_time_s``, ``precision``, ``model``,
``versions`` and the rest below.
"""

from __future__ import annotations

import contextlib
import platform
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from collage_train import determinism
from collage_train.comm.settings import comm_name, uses_replicas
from collage_train.data.progress import write_json_atomic
from collage_train.guard import describe_skip
from collage_train.metrics import model_flops_utilisation, peak_memory

# The GPU-tested stack (docker/gpu_stack.txt) names torch, transformers, deepspeed and
# triton: a GPU run's summary records each, and the CUDA version torch was built with.
_VERSIONED_PACKAGES = (
    "torch", "transformers", "deepspeed", "triton", "sentencepiece", "hydra-core", "wandb",
    "numpy",
)  # fmt: skip


def package_versions() -> dict[str, str]:
    """Versions of Python, CUDA (a CUDA build of torch only) and the packages a run's
    numbers depend on."""
    versions = {"python": platform.python_version()}
    if torch.version.cuda:
        versions["cuda"] = torch.version.cuda
    for name in ("collage_train", *_VERSIONED_PACKAGES):
        with contextlib.suppress(metadata.PackageNotFoundError):
            versions[name] = metadata.version(name)
    return versions


def corpus_summary(meta: dict[str, Any]) -> dict[str, Any]:
    """The corpus facts worth keeping with a run's results (source, sizes, Python version)."""
    keys = ("vocab_size", "num_documents", "train_tokens", "val_tokens", "cache_dir")
    return {**meta.get("source", {}), **{key: meta[key] for key in keys if key in meta}}


def describe(trainer: Any) -> str:
    """One line stating what ``trainer`` trains, where, and with which batch."""
    cfg, train = trainer.cfg, trainer.cfg.train
    return (
        f"{cfg.model.name} ({trainer.num_params / 1e6:.2f}M params) | "
        f"precision={trainer.strategy.name} ({trainer.optimizer_kernel} step) | "
        f"{trainer.device} | global batch "
        f"{train.global_batch_size} sequences x {cfg.data.seq_len} tokens = "
        f"{trainer.tokens_per_step:,} tokens (micro-batch {train.micro_batch_size} x "
        f"{trainer.accum_steps} accumulation x {trainer.engine.world_size} rank) | "
        f"distributed={cfg.distributed.name} | {_describe_comm(trainer)} | "
        f"{train.max_steps} steps | {trainer.cpu_bf16_gemm.describe()}"
    )


def _describe_comm(trainer: Any) -> str:
    comm = trainer.cfg.comm
    if not uses_replicas(comm):
        return f"comm={comm_name(comm)}"
    replicas = trainer.engine.world_size
    return f"comm={comm.name} ({replicas} replicas, outer step every {comm.sync_every})"


def train_record(trainer: Any, window: list[dict[str, Any]]) -> dict[str, Any]:
    """The logged record of ``window`` (the settled steps since the last record): losses,
    throughput, memory, the last EDQ measured in it, communication and scale counters."""
    elapsed = sum(w["time"] for w in window)
    tokens_per_s = trainer.tokens_per_step * len(window) / elapsed
    world_size = trainer.engine.world_size
    edq = next((w["edq"] for w in reversed(window) if w["edq"]), {})
    loader = trainer.data.train_loader
    return {
        "step": trainer.step,
        "tokens": trainer.step * trainer.tokens_per_step,
        "epoch": loader.epoch,
        **loader.metrics(),  # data.mixture: tokens per source
        "loss": _mean_applied_loss(window),
        "lr": window[-1]["lr"],
        "grad_norm": window[-1]["grad_norm"],
        "skipped_steps": trainer.skipped_steps_all_ranks,  # replicas: summed over them
        "tokens_per_s": tokens_per_s,
        "tokens_per_s_per_device": tokens_per_s / world_size,
        "step_time_s": elapsed / len(window),
        "data_time_frac": sum(w["data_time"] for w in window) / elapsed,
        "mfu": model_flops_utilisation(
            tokens_per_s / world_size, trainer.flops_per_token, trainer.peak_tflops
        ),
        **peak_memory(trainer.device),
        **edq,
        **trainer.engine.comm_metrics(),
        **scale_metrics(trainer),
    }


def _mean_applied_loss(window: list[dict[str, Any]]) -> float:
    """The mean loss of the window's applied steps (a skipped step's loss may be NaN or a
    spike, and is logged in its own record); NaN when every step was skipped."""
    losses = [w["loss"] for w in window if w.get("applied", True)]
    return sum(losses) / len(losses) if losses else float("nan")


SKIPS_KEPT = 100  # skips listed in summary.json (skipped_steps counts them all)


def skip_records(trainer: Any, window: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One record per skipped step of the settled ``window`` (reason and z-scores, for
    metrics.jsonl and W&B), each with the console ``line`` naming it; also listed in
    ``trainer.skips`` for the summary."""
    records = []
    for stats in window:
        skip = stats.get("skip")
        if skip is None:
            continue
        entry = {"step": stats["step"], **skip}
        if len(trainer.skips) < SKIPS_KEPT:
            trainer.skips.append(entry)
        record = {
            "step": stats["step"],
            "tokens": stats["step"] * trainer.tokens_per_step,
            "skip_reason": skip["reason"],
            "skipped_loss": stats["loss"],
            "skipped_grad_norm": stats["grad_norm"],
            "skipped_steps": trainer.skipped_steps,
        }
        if "loss_z" in skip:
            record["loss_z"], record["grad_norm_z"] = skip["loss_z"], skip["grad_norm_z"]
        line = describe_skip(
            stats["step"], skip["reason"], skip.get("loss_z"), skip.get("grad_norm_z")
        )
        record["line"] = f"{line}: loss {stats['loss']:.4g}, grad norm {stats['grad_norm']:.4g}"
        records.append(record)
    return records


def scale_metrics(trainer: Any) -> dict[str, float]:
    """Scale statistics of the optimizer's state and of the model (Scalify); none else."""
    return {**trainer.optimizer.scale_metrics(), **trainer.strategy.model_metrics(trainer.model)}


def run_summary(
    trainer: Any,
    last: dict[str, Any] | None,
    val: dict[str, float] | None,
    timed: list[dict[str, float]],
    wall_time: float,
    start_step: int,
) -> dict[str, Any]:
    """The run's summary: sizes, final losses, throughput over the ``timed`` steps, memory,
    state bytes, the settings that shaped the numbers, and the package versions."""
    cfg, train, engine = trainer.cfg, trainer.cfg.train, trainer.engine
    elapsed = sum(w["time"] for w in timed)
    tokens_per_s = trainer.tokens_per_step * len(timed) / elapsed if elapsed else None
    mfu = (
        model_flops_utilisation(
            tokens_per_s / engine.world_size, trainer.flops_per_token, trainer.peak_tflops
        )
        if tokens_per_s
        else None
    )
    return {
        "model": cfg.model.name,
        "precision": trainer.strategy.name,
        "num_params": trainer.num_params,
        "steps": trainer.step,
        "steps_this_launch": trainer.step - start_step,
        "tokens": trainer.step * trainer.tokens_per_step,
        "global_batch_sequences": train.global_batch_size,
        "global_batch_tokens": trainer.tokens_per_step,
        "final_train_loss": last["loss"] if last else None,
        "final_val_loss": val["val_loss"] if val else None,
        "final_val_ppl": val["val_ppl"] if val else None,
        "final_val_bpb": val["val_bpb"] if val else None,
        **({"downstream": trainer.last_downstream} if trainer.last_downstream else {}),
        **(
            {"downstream_eval_s": trainer.downstream_seconds}  # in-loop evaluation's wall time
            if trainer.last_downstream
            else {}
        ),
        "tokens_per_s": tokens_per_s,
        "mfu": mfu,
        "flops_per_token": trainer.flops_per_token,
        "micro_batch_size": train.micro_batch_size,
        "seq_len": cfg.data.seq_len,
        "compile": train.compile,
        "activation_checkpointing": train.activation_checkpointing,
        "peak_mem_bytes": peak_memory(trainer.device)["peak_mem_bytes"],
        "state_bytes_per_param": engine.state_bytes() / trainer.num_params,
        "expected_state_bytes_per_param": engine.expected_state_bytes_per_param(trainer.strategy),
        "state_bytes_measure": engine.state_bytes_measure,
        "distributed": cfg.distributed.name,
        "comm": comm_name(cfg.comm),
        **engine.comm_metrics(),
        **scale_metrics(trainer),
        "world_size": engine.world_size,
        "optimizer_kernel": trainer.optimizer_kernel,
        **trainer.cpu_bf16_gemm.summary(),
        "loss_chunk_tokens": trainer.loss_chunk_tokens,  # None: the full-logits loss
        "skipped_steps": trainer.skipped_steps_all_ranks,
        "skips": trainer.skips,  # the first SKIPS_KEPT: step, reason, z-scores
        "rollbacks": trainer.rollbacks,
        "async_checkpoint": train.async_checkpoint,
        **trainer.saver.times.summary(),  # checkpoint_saves, seconds the loop was blocked
        **determinism.summary(),  # train.deterministic: what held while the run ran
        "wall_time_s": wall_time,
        "device": str(trainer.device),
        "corpus": corpus_summary(trainer.data.meta),
        **trainer.data.train_loader.metrics(),  # data.mixture: tokens per source
        "versions": package_versions(),
    }


def write_summary(run_dir: Path, summary: dict[str, Any], *, plots: bool) -> None:
    """``summary.json``, atomically, and ``plots/`` from ``metrics.jsonl`` when asked."""
    write_json_atomic(run_dir / "summary.json", summary)
    if plots and (run_dir / "metrics.jsonl").is_file():
        from collage_train.metrics.plots import load_run, write_report  # imports matplotlib

        write_report([load_run(run_dir)], run_dir / "plots")
