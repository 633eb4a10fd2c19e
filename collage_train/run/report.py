"""What a run says about itself: the line describing it at the start, a record per logged
window of steps, and ``summary.json`` (with ``plots/``) at the end.

Everything here reads two plain records and changes nothing: ``RunFacts`` (what the run
is, fixed once the trainer is built) and ``RunProgress`` (what it has done so far), both
built by the trainer (``Trainer.facts``, ``Trainer.progress``), so the report is tested
without one. The trainer hands the summary to its sinks. The summary's keys are part of
the public interface (docs/runs.md, "Outputs"): ``final_train_loss``, ``final_val_loss``,
``tokens_per_s``, ``peak_mem_bytes``, ``state_bytes_per_param``, ``wall_time_s``,
``precision``, ``model``, ``versions`` and the rest below.
"""

from __future__ import annotations

import contextlib
import platform
from collections.abc import Sequence
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from collage_train.comm.settings import comm_name, uses_replicas
from collage_train.data.progress import write_json_atomic
from collage_train.metrics import detect_peak_tflops, model_flops_utilisation
from collage_train.run import determinism
from collage_train.run.guard import describe_skip
from collage_train.run.step_window import StepRecord

# The GPU-tested stack (docker/gpu_stack.txt) names torch, transformers, deepspeed and
# triton: a GPU run's summary records each, and the CUDA version torch was built with.
_VERSIONED_PACKAGES = (
    "torch", "transformers", "deepspeed", "triton", "sentencepiece", "hydra-core", "wandb",
    "numpy",
)  # fmt: skip


@dataclass(frozen=True)
class RunFacts:
    """What a run is, fixed once the trainer is built.

    ``distributed`` is the engine's name (unsharded, zero1..3); ``comm`` the communication
    method's, with ``outer_step_every`` its outer-step period where each rank keeps a whole
    replica (DiLoCo, SparseLoCo), else None. ``cpu_bf16_gemm`` is the choice's line for the
    start-up description, ``cpu_bf16_gemm_summary`` its keys for the summary.
    ``expected_state_bytes_per_param`` and ``state_bytes_measure`` are the engine's
    (``engine.base.StateMemory``); ``corpus`` is the corpus's manifest.
    """

    model: str
    num_params: int
    precision: str
    optimizer_kernel: str
    device: str
    distributed: str
    comm: str
    outer_step_every: int | None
    world_size: int
    global_batch_sequences: int
    micro_batch_size: int
    accum_steps: int
    seq_len: int
    max_steps: int
    flops_per_token: float
    peak_tflops: float | None
    compile: bool
    activation_checkpointing: bool
    loss_chunk_tokens: int | None  # None: the full-logits loss
    async_checkpoint: bool
    cpu_bf16_gemm: str
    cpu_bf16_gemm_summary: dict[str, Any]
    expected_state_bytes_per_param: float
    state_bytes_measure: str
    corpus: dict[str, Any]
    branch: dict[str, Any] | None = None  # a branch's lineage (run.branch.Lineage.record)

    @property
    def tokens_per_step(self) -> int:
        """Tokens of one optimizer step, over every rank."""
        return self.global_batch_sequences * self.seq_len


@dataclass(frozen=True)
class RunProgress:
    """What a run has done so far, read at a settle or at the end.

    ``skipped_steps`` counts the refused steps of every rank (replicas: their sum); ``data``
    the loader's own counters (``data.mixture``: tokens per source); ``comm`` the engine's
    (``Engine.comm_metrics``); ``scale`` the optimizer's and the model's scale statistics
    (Scalify); ``memory`` the peak so far (``metrics.peak_memory``); ``state_bytes`` the
    model state measured on this rank; ``skips`` the first ``SKIPS_KEPT`` refused steps
    (step, reason, z-scores); ``rollbacks`` the guard's; ``downstream`` the last in-loop
    evaluation (None: none ran) and ``downstream_seconds`` the wall time spent in them;
    ``checkpoint_times`` the saver's (``run.checkpoint_saver``).
    """

    step: int
    epoch: int
    skipped_steps: int
    data: dict[str, Any]
    comm: dict[str, Any]
    scale: dict[str, float]
    memory: dict[str, int]
    state_bytes: int = 0
    skips: list[dict[str, Any]] = field(default_factory=list)
    rollbacks: list[dict[str, Any]] = field(default_factory=list)
    downstream: dict[str, Any] | None = None
    downstream_seconds: float = 0.0
    checkpoint_times: dict[str, Any] = field(default_factory=dict)


def run_facts(
    cfg: Any,
    strategy: Any,
    engine: Any,
    built: Any,
    corpus: dict[str, Any],
    accum_steps: int,
    *,
    num_params: int,
    flops_per_token: float,
) -> RunFacts:
    """The ``RunFacts`` of a run of ``cfg`` (the whole config) with ``strategy`` on
    ``engine``, its model ``built`` (``run.model_setup.RunModel``) on ``corpus``."""
    train, gemm = cfg.train, built.gemm
    replicas = uses_replicas(cfg.comm)
    return RunFacts(
        model=cfg.model.name,
        num_params=num_params,
        precision=strategy.name,
        optimizer_kernel=built.optimizer_kernel,
        device=str(engine.device),
        distributed=engine.name,
        comm=comm_name(cfg.comm),
        outer_step_every=int(cfg.comm.sync_every) if replicas else None,
        world_size=engine.world_size,
        global_batch_sequences=train.global_batch_size,
        micro_batch_size=train.micro_batch_size,
        accum_steps=accum_steps,
        seq_len=cfg.data.seq_len,
        max_steps=train.max_steps,
        flops_per_token=flops_per_token,
        peak_tflops=cfg.metrics.peak_tflops or detect_peak_tflops(engine.device),
        compile=train.compile,
        activation_checkpointing=train.activation_checkpointing,
        loss_chunk_tokens=built.loss_chunk_tokens,
        async_checkpoint=train.async_checkpoint,
        cpu_bf16_gemm=gemm.describe(),
        cpu_bf16_gemm_summary=gemm.summary(),
        expected_state_bytes_per_param=engine.expected_state_bytes_per_param(strategy),
        state_bytes_measure=engine.state_bytes_measure,
        corpus=corpus,
    )


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


def describe(facts: RunFacts) -> str:
    """One line stating what the run trains, where, and with which batch."""
    return (
        f"{facts.model} ({facts.num_params / 1e6:.2f}M params) | "
        f"precision={facts.precision} ({facts.optimizer_kernel} step) | "
        f"{facts.device} | global batch "
        f"{facts.global_batch_sequences} sequences x {facts.seq_len} tokens = "
        f"{facts.tokens_per_step:,} tokens (micro-batch {facts.micro_batch_size} x "
        f"{facts.accum_steps} accumulation x {facts.world_size} rank) | "
        f"distributed={facts.distributed} | {_describe_comm(facts)} | "
        f"{facts.max_steps} steps | {facts.cpu_bf16_gemm}"
    )


def _describe_comm(facts: RunFacts) -> str:
    if facts.outer_step_every is None:
        return f"comm={facts.comm}"
    return (
        f"comm={facts.comm} ({facts.world_size} replicas, outer step every "
        f"{facts.outer_step_every})"
    )


def train_record(
    facts: RunFacts, progress: RunProgress, window: Sequence[StepRecord]
) -> dict[str, Any]:
    """The logged record of ``window`` (the settled steps since the last record): losses,
    throughput, memory, the last EDQ measured in it, communication and scale counters."""
    elapsed = sum(w.time for w in window)
    tokens_per_s = facts.tokens_per_step * len(window) / elapsed
    edq = next((w.edq for w in reversed(window) if w.edq), {})
    return {
        "step": progress.step,
        "tokens": progress.step * facts.tokens_per_step,
        "epoch": progress.epoch,
        **progress.data,  # data.mixture: tokens per source
        "loss": _mean_applied_loss(window),
        "lr": window[-1].lr,
        "grad_norm": window[-1].grad_norm,
        "skipped_steps": progress.skipped_steps,  # replicas: summed over them
        "tokens_per_s": tokens_per_s,
        "tokens_per_s_per_device": tokens_per_s / facts.world_size,
        "step_time_s": elapsed / len(window),
        "data_time_frac": sum(w.data_time for w in window) / elapsed,
        "mfu": _mfu(facts, tokens_per_s),
        **progress.memory,
        **edq,
        **progress.comm,
        **progress.scale,
    }


def _mfu(facts: RunFacts, tokens_per_s: float) -> float | None:
    return model_flops_utilisation(
        tokens_per_s / facts.world_size, facts.flops_per_token, facts.peak_tflops
    )


def _mean_applied_loss(window: Sequence[StepRecord]) -> float:
    """The mean loss of the window's applied steps (a skipped step's loss may be NaN or a
    spike, and is logged in its own record); NaN when every step was skipped."""
    losses = [w.loss for w in window if w.applied]
    return sum(losses) / len(losses) if losses else float("nan")


SKIPS_KEPT = 100  # skips listed in summary.json (skipped_steps counts them all)


def skips_in(window: Sequence[StepRecord]) -> list[dict[str, Any]]:
    """The skipped steps of the settled ``window`` as the summary lists them: step, reason
    and z-scores (the trainer keeps the first ``SKIPS_KEPT``)."""
    return [{"step": s.step, **s.skip} for s in window if s.skip is not None]


def skip_records(
    facts: RunFacts, window: Sequence[StepRecord], skipped_steps: int
) -> list[dict[str, Any]]:
    """One record per skipped step of the settled ``window`` (reason and z-scores, for
    metrics.jsonl and W&B), each with the console ``line`` naming it; ``skipped_steps``
    is this rank's count so far."""
    records = []
    for stats in window:
        skip = stats.skip
        if skip is None:
            continue
        record = {
            "step": stats.step,
            "tokens": stats.step * facts.tokens_per_step,
            "skip_reason": skip["reason"],
            "skipped_loss": stats.loss,
            "skipped_grad_norm": stats.grad_norm,
            "skipped_steps": skipped_steps,
        }
        if "loss_z" in skip:
            record["loss_z"], record["grad_norm_z"] = skip["loss_z"], skip["grad_norm_z"]
        line = describe_skip(
            stats.step, skip["reason"], skip.get("loss_z"), skip.get("grad_norm_z")
        )
        record["line"] = f"{line}: loss {stats.loss:.4g}, grad norm {stats.grad_norm:.4g}"
        records.append(record)
    return records


def run_summary(
    facts: RunFacts,
    progress: RunProgress,
    last: dict[str, Any] | None,
    val: dict[str, float] | None,
    timed: Sequence[StepRecord],
    wall_time: float,
    start_step: int,
) -> dict[str, Any]:
    """The run's summary: sizes, final losses, throughput over the ``timed`` steps, memory,
    state bytes, the settings that shaped the numbers, and the package versions."""
    elapsed = sum(w.time for w in timed)
    tokens_per_s = facts.tokens_per_step * len(timed) / elapsed if elapsed else None
    downstream = progress.downstream
    return {
        "model": facts.model,
        "precision": facts.precision,
        **({"branch": facts.branch} if facts.branch else {}),
        "num_params": facts.num_params,
        "steps": progress.step,
        "steps_this_launch": progress.step - start_step,
        "tokens": progress.step * facts.tokens_per_step,
        "global_batch_sequences": facts.global_batch_sequences,
        "global_batch_tokens": facts.tokens_per_step,
        "final_train_loss": last["loss"] if last else None,
        "final_val_loss": val["val_loss"] if val else None,
        "final_val_ppl": val["val_ppl"] if val else None,
        "final_val_bpb": val["val_bpb"] if val else None,
        **({"downstream": downstream} if downstream else {}),
        **(
            {"downstream_eval_s": progress.downstream_seconds}  # in-loop evaluation's wall time
            if downstream
            else {}
        ),
        "tokens_per_s": tokens_per_s,
        "mfu": _mfu(facts, tokens_per_s) if tokens_per_s else None,
        "flops_per_token": facts.flops_per_token,
        "micro_batch_size": facts.micro_batch_size,
        "seq_len": facts.seq_len,
        "compile": facts.compile,
        "activation_checkpointing": facts.activation_checkpointing,
        "peak_mem_bytes": progress.memory["peak_mem_bytes"],
        "state_bytes_per_param": progress.state_bytes / facts.num_params,
        "expected_state_bytes_per_param": facts.expected_state_bytes_per_param,
        "state_bytes_measure": facts.state_bytes_measure,
        "distributed": facts.distributed,
        "comm": facts.comm,
        **progress.comm,
        **progress.scale,
        "world_size": facts.world_size,
        "optimizer_kernel": facts.optimizer_kernel,
        **facts.cpu_bf16_gemm_summary,
        "loss_chunk_tokens": facts.loss_chunk_tokens,  # None: the full-logits loss
        "skipped_steps": progress.skipped_steps,
        "skips": progress.skips,  # the first SKIPS_KEPT: step, reason, z-scores
        "rollbacks": progress.rollbacks,
        "async_checkpoint": facts.async_checkpoint,
        **progress.checkpoint_times,  # checkpoint_saves, seconds the loop was blocked
        **determinism.summary(),  # train.deterministic: what held while the run ran
        "wall_time_s": wall_time,
        "device": facts.device,
        "corpus": corpus_summary(facts.corpus),
        **progress.data,  # data.mixture: tokens per source
        "versions": package_versions(),
    }


def write_summary(run_dir: Path, summary: dict[str, Any]) -> None:
    """``summary.json``, atomically."""
    write_json_atomic(run_dir / "summary.json", summary)


def write_plots(run_dir: Path) -> None:
    """``plots/`` (the run's own plots and ``summary.md``) from ``metrics.jsonl``."""
    from collage_train.metrics.plots import load_run, write_report  # imports matplotlib

    write_report([load_run(run_dir)], run_dir / "plots")
