"""``python -m collage_train.plan [overrides]``: will a run fit, and at what micro-batch?

Takes the same overrides as training, e.g.

    python -m collage_train.plan +experiment=gpt_6.7b precision=collage_plus \\
        distributed=zero2 plan.gpus=8 plan.gpu_mem_gb=80

and prints, per GPU, the bytes of weights, gradients, master weights, each optimizer
state component, DeepSpeed buffers and activations at the configured micro-batch and
sequence length (with and without activation checkpointing), the step's peak, the
largest micro-batch that fits and whether the run fits at all: first for the chosen
precision strategy and ZeRO stage, then for every strategy and stage side by side.
Nothing is built or allocated; the estimates come from ``collage_train.planning.memory_plan``.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from collage_train.comm.settings import uses_replicas
from collage_train.engine.deepspeed_config import GradientDtypes, gradient_dtypes
from collage_train.errors import CollageError, ConfigError
from collage_train.model.loss_settings import resolve_chunk_tokens
from collage_train.planning.fit_check import chosen_stage, zero_overrides
from collage_train.planning.host_memory import run_end_bytes, run_peak
from collage_train.planning.memory_plan import (
    GIB,
    MemoryEstimate,
    ModelShape,
    Setting,
    checkpoint_copy_bytes,
    estimate_at,
    largest_micro_batch,
)
from collage_train.precision import available, get_strategy, strategy_for
from collage_train.run.vocabulary import check_vocabulary, tokenizer_ids


@dataclass
class PlanRow:
    """One strategy at one ZeRO stage: estimates without and with checkpointing."""

    strategy: str
    stage: int
    plain: MemoryEstimate
    checkpointed: MemoryEstimate
    max_micro_batch: int
    max_micro_batch_checkpointed: int
    fits: bool  # at the configured micro-batch and checkpointing setting
    chosen: bool
    loss_chunk_tokens: int | None = None  # the chunked loss's block; None: full logits
    checkpoint_copy: float = 0.0  # host bytes per rank of a background checkpoint's copy
    run_end: float = 0.0  # per GPU while the run exports hf/ (planning.host_memory)
    cpu_rank: float = 0.0  # host bytes of one CPU rank at the run's peak

    @property
    def fits_at_all(self) -> bool:
        return max(self.max_micro_batch, self.max_micro_batch_checkpointed) > 0

    def as_dict(self) -> dict[str, Any]:
        return {
            "strategy": self.strategy,
            "stage": self.stage,
            "weights": self.plain.weights,
            "gradients": self.plain.gradients,
            "master": self.plain.master,
            "optimizer": dict(self.plain.optimizer),
            "buffers": self.plain.buffers,
            "activations": self.plain.activations,
            "activations_checkpointed": self.checkpointed.activations,
            "peak": self.plain.peak,
            "peak_checkpointed": self.checkpointed.peak,
            "max_micro_batch": self.max_micro_batch,
            "max_micro_batch_checkpointed": self.max_micro_batch_checkpointed,
            "fits": self.fits,
            "fits_at_all": self.fits_at_all,
            "loss_chunk_tokens": self.loss_chunk_tokens,
            "host_checkpoint_copy": self.checkpoint_copy,
        }


@dataclass
class Plan:
    """The planned run: model shape, budget and every row."""

    model_name: str
    shape: ModelShape
    gpus: int
    budget: float
    gpu_mem_gb: float
    reserve_gb: float
    micro_batch: int
    global_batch: int
    checkpointing: bool
    fused_optimizer: bool
    rows: list[PlanRow]
    async_checkpoint: bool = True

    @property
    def chosen(self) -> PlanRow:
        return next(row for row in self.rows if row.chosen)


def make_plan(cfg: Any) -> Plan:
    """Every strategy and stage for the run ``cfg`` describes, on ``cfg.plan``'s cluster."""
    plan_cfg, train = cfg.plan, cfg.train
    if plan_cfg.gpus < 1:
        raise ConfigError(f"plan.gpus must be at least 1, got {plan_cfg.gpus}")
    budget = (plan_cfg.gpu_mem_gb - plan_cfg.reserve_gb) * GIB
    if budget <= 0:
        raise ConfigError(
            f"plan.gpu_mem_gb={plan_cfg.gpu_mem_gb} leaves nothing after "
            f"plan.reserve_gb={plan_cfg.reserve_gb}"
        )
    if train.micro_batch_size < 1 or train.global_batch_size < 1:
        raise ConfigError("train.micro_batch_size and train.global_batch_size must be positive")
    stage = chosen_stage(cfg.distributed)
    if stage == 0 and plan_cfg.gpus > 1:
        raise ConfigError(
            f"distributed=unsharded runs on one GPU but plan.gpus={plan_cfg.gpus}; "
            "choose distributed=zero1, zero2 or zero3 (or plan.gpus=1)"
        )
    configured = strategy_for(cfg.precision)  # the chosen strategy with its options
    configured.check_engine(_stage_name(stage))
    chosen = configured.name
    check_vocabulary(cfg)  # the run's own start-up refusal, before planning its embedding
    # the tokenizer's ids (data.tokenizer's own size, not data.vocab_size), which
    # model.vocab_size may pad; model.init_from: the directory's embedding
    vocab = 1 if cfg.model.init_from else tokenizer_ids(cfg)[0]
    shape = ModelShape.from_config(cfg.model, vocab_size=vocab, seq_len=cfg.data.seq_len)
    # optim.kernel=auto may fall back to the eager step at its start-up probe (a kernel
    # that fails to build or to match): plan for the eager step's chunk, so a fallback
    # still fits; only compiled is certain to run fused.
    fused = cfg.optim.kernel == "compiled"
    # the step guard masks the optimizer's update (not a replica's: Trainer.verdicts_on_device)
    masked = bool(cfg.train.guard.enabled) and not uses_replicas(cfg.comm)
    stages = ([0] if plan_cfg.gpus == 1 else []) + [1, 2, 3]
    rows = []
    for name in available():
        strategy = configured if name == chosen else get_strategy(name)
        for row_stage in stages:
            if row_stage and strategy.not_under_zero:
                continue  # refused by the trainer: no row
            is_chosen = name == chosen and row_stage == stage
            setting = Setting(
                strategy,
                row_stage,
                gpus=plan_cfg.gpus,
                fused_optimizer=fused,
                masked_step=masked,
                offload_optimizer=is_chosen
                and bool(getattr(cfg.distributed, "offload_optimizer", False)),
                offload_param=is_chosen and bool(getattr(cfg.distributed, "offload_param", False)),
                gradient_dtypes=_gradient_dtypes(cfg.distributed, strategy, row_stage, is_chosen),
                zero_overrides=zero_overrides(cfg.distributed) if is_chosen else {},
            )
            chunk = _loss_chunk(train, strategy, shape.vocab, is_chosen)
            rows.append(
                _row(setting, shape, train, budget=budget, chosen=is_chosen, name=name, chunk=chunk)
            )
    return Plan(
        model_name=cfg.model.name,
        shape=shape,
        gpus=plan_cfg.gpus,
        budget=budget,
        gpu_mem_gb=plan_cfg.gpu_mem_gb,
        reserve_gb=plan_cfg.reserve_gb,
        micro_batch=train.micro_batch_size,
        global_batch=train.global_batch_size,
        checkpointing=bool(train.activation_checkpointing),
        fused_optimizer=fused,
        rows=rows,
        async_checkpoint=bool(train.async_checkpoint),
    )


def _gradient_dtypes(
    dist_cfg: Any, strategy: Any, stage: int, chosen: bool
) -> GradientDtypes | None:
    """The configured gradient dtypes at ZeRO ``stage``; where another row's strategy or
    stage cannot take them, that row's ``auto`` (only the chosen row must accept them)."""
    if stage == 0:
        return None
    try:
        return gradient_dtypes(dist_cfg, strategy, stage)
    except ConfigError:
        if chosen:
            raise
        auto = {"reduce_dtype": "auto", "grad_accum_dtype": "auto"}
        return gradient_dtypes(SimpleNamespace(**auto), strategy, stage)


def _loss_chunk(train: Any, strategy: Any, vocab: int, chosen: bool) -> int | None:
    """The chunked loss's block for ``strategy`` (``train.loss_chunk_tokens`` resolved as
    the trainer resolves it); where another row's strategy refuses a set block (Scalify),
    its plain loss: only the chosen row must accept the setting."""
    try:
        return resolve_chunk_tokens(
            train.loss_chunk_tokens, vocab_size=vocab, chunkable=strategy.chunked_loss
        )
    except ConfigError:
        if chosen:
            raise
        return None


def _row(
    setting: Setting,
    shape: ModelShape,
    train: Any,
    *,
    budget: float,
    chosen: bool,
    name: str,
    chunk: int | None,
) -> PlanRow:
    micro, global_batch = train.micro_batch_size, train.global_batch_size
    plain, checkpointed = (
        estimate_at(
            shape,
            setting,
            micro_batch=micro,
            global_batch=global_batch,
            checkpointing=ckpt,
            loss_chunk_tokens=chunk,
        )
        for ckpt in (False, True)
    )
    largest = (
        largest_micro_batch(
            shape,
            setting,
            budget=budget,
            global_batch=global_batch,
            checkpointing=ckpt,
            loss_chunk_tokens=chunk,
        )
        for ckpt in (False, True)
    )
    configured = checkpointed if train.activation_checkpointing else plain
    run_end = run_end_bytes(shape, setting, configured) if train.export_hf else 0.0
    cpu = run_peak(shape, setting, configured, cpu=True)
    cpu_end = cpu.run_end if train.export_hf else 0.0
    return PlanRow(
        strategy=name,
        stage=setting.stage,
        plain=plain,
        checkpointed=checkpointed,
        max_micro_batch=next(largest),
        max_micro_batch_checkpointed=next(largest),
        fits=max(configured.peak, run_end) <= budget,
        chosen=chosen,
        loss_chunk_tokens=chunk,
        checkpoint_copy=checkpoint_copy_bytes(shape, setting),
        run_end=run_end,
        cpu_rank=cpu.process + max(cpu.step, cpu_end),
    )


def _gib(nbytes: float) -> str:
    return f"{nbytes / GIB:.2f}"


def _describe_loss(chunk: int | None, shape: ModelShape) -> str:
    if chunk is None:
        return "full logits (train.loss_chunk_tokens)"
    if chunk >= shape.seq_len:
        covered = f"; full logits up to {chunk // shape.seq_len} sequences a micro-batch"
    else:
        covered = ""
    return f"blocks of {chunk} tokens (train.loss_chunk_tokens{covered})"


def _describe_checkpoint_copy(nbytes: float, asynchronous: bool) -> str:
    if not asynchronous:
        return "no checkpoint copy (train.async_checkpoint=false: saves block the step)"
    return (
        f"{_gib(nbytes)} GiB for the background checkpoint's copy of the state "
        "(pinned; train.async_checkpoint=false: none)"
    )


def _describe_run_end(nbytes: float) -> str:
    if not nbytes:
        return "no export (train.export_hf=false)"
    return f"{_gib(nbytes)} (the state, and under ZeRO-3 every weight gathered on every GPU)"


def _stage_name(stage: int) -> str:
    return "unsharded" if stage == 0 else f"zero{stage}"


def render(plan: Plan) -> str:
    """The chosen setting in detail, then every strategy and stage as a table (GiB per GPU)."""
    shape, row = plan.shape, plan.chosen
    ckpt_word = "on" if plan.checkpointing else "off"
    lines = [
        f"{plan.model_name}: {shape.num_params / 1e9:.2f}B parameters "
        f"({shape.layers} layers, hidden {shape.hidden}, vocabulary {shape.vocab}), "
        f"sequence {shape.seq_len}, micro-batch {plan.micro_batch}, "
        f"global batch {plan.global_batch}, activation checkpointing {ckpt_word}",
        f"{plan.gpus} GPU(s) x {plan.gpu_mem_gb:g} GiB, {plan.reserve_gb:g} GiB reserved: "
        f"{_gib(plan.budget)} GiB usable per GPU; optimizer step "
        f"{'fused' if plan.fused_optimizer else 'eager (what optim.kernel=auto may fall back to)'}",
        "",
        f"{row.strategy} with {_stage_name(row.stage)}, GiB per GPU:",
    ]
    optimizer = ", ".join(f"{k} {_gib(v)}" for k, v in row.plain.optimizer.items())
    detail = [
        ("weights", _gib(row.plain.weights)),
        ("gradients", _gib(row.plain.gradients)),
        ("master weights", _gib(row.plain.master)),
        ("optimizer state", f"{_gib(sum(row.plain.optimizer.values()))} ({optimizer})"),
        ("DeepSpeed buffers", _gib(row.plain.buffers)),
        (
            "activations",
            f"{_gib(row.plain.activations)} (checkpointed: {_gib(row.checkpointed.activations)})",
        ),
        ("step peak", f"{_gib(row.plain.peak)} (checkpointed: {_gib(row.checkpointed.peak)})"),
        (
            "largest micro-batch",
            f"{row.max_micro_batch} (checkpointed: {row.max_micro_batch_checkpointed})",
        ),
        (f"fits at micro-batch {plan.micro_batch}", "yes" if row.fits else "no"),
        ("loss", _describe_loss(row.loss_chunk_tokens, shape)),
        ("end of run (export)", _describe_run_end(row.run_end)),
        ("host, per rank", _describe_checkpoint_copy(row.checkpoint_copy, plan.async_checkpoint)),
        (
            "on a CPU rank",
            f"{_gib(row.cpu_rank)} GiB of host at the run's peak (the process, the step with "
            "DeepSpeed's CPU copies, the export)",
        ),
    ]
    lines += [f"  {key:<26}{value}" for key, value in detail]
    if not row.fits_at_all:
        lines.append("  does not fit at micro-batch 1 even with checkpointing")
    header = (
        "strategy", "stage", "weights", "grads", "master", "optim", "buffers",
        "act", "act ckpt", "peak", "peak ckpt", "max mb", "max mb ckpt", "fits",
    )  # fmt: skip
    table = [header]
    for r in plan.rows:
        table.append(
            (
                r.strategy + (" *" if r.chosen else ""),
                _stage_name(r.stage),
                _gib(r.plain.weights),
                _gib(r.plain.gradients),
                _gib(r.plain.master),
                _gib(sum(r.plain.optimizer.values())),
                _gib(r.plain.buffers),
                _gib(r.plain.activations),
                _gib(r.checkpointed.activations),
                _gib(r.plain.peak),
                _gib(r.checkpointed.peak),
                str(r.max_micro_batch),
                str(r.max_micro_batch_checkpointed),
                "yes" if r.fits else ("ckpt/smaller mb" if r.fits_at_all else "no"),
            )
        )
    widths = [max(len(cells[i]) for cells in table) for i in range(len(header))]
    lines += ["", f"Every strategy and stage (GiB per GPU at micro-batch {plan.micro_batch}; "]
    lines[-1] += "* = chosen; fits: at the configured micro-batch and checkpointing):"
    for cells in table:
        lines.append(
            "  ".join(
                c.ljust(w) if i < 2 else c.rjust(w)
                for i, (c, w) in enumerate(zip(cells, widths, strict=True))
            )
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Compose the config from ``argv`` overrides, plan, print; 0, or 2 on bad input."""
    from collage_train.compose import compose_job

    overrides = list(sys.argv[1:] if argv is None else argv)
    if any(arg in ("-h", "--help") for arg in overrides):
        print(__doc__)
        return 0
    try:
        print(render(make_plan(compose_job(overrides))))
    except CollageError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
