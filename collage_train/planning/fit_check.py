"""Start-up memory checks: refuse a run that cannot fit before anything is allocated.

All run in ``check_run_fits``, before the model's weights are drawn or read
(``collage_train.model.materialise``), and the ranks agree before any refuses
(``collage_train.engine.agreement``): a rank short of memory stops every rank at once.

- ``check_state_fits``: this rank's model state must fit the device, and the start-up's
  host transient the host, for every rank on this node; else ``OutOfMemory`` (exit 1).
- ``check_step_fits`` (CUDA runs): the planner's step peak, and the export's at the end of
  the run, must fit the least free device memory less ``plan.reserve_gb``; else
  ``StepWillNotFit`` (exit 2), whose one line says what fits.
- ``check_host_fits`` (CPU runs): every rank on this node at its run's peak
  (``planning.host_memory.run_peak``) must fit the host; else ``StepWillNotFit``.
What each check counts: docs/planner.md, "The start-up checks".
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from omegaconf import OmegaConf

from collage_train.comm.settings import uses_replicas
from collage_train.engine.agreement import agreement, gathered
from collage_train.engine.deepspeed_config import gradient_dtypes
from collage_train.engine.launch import local_world_size
from collage_train.errors import BAD_INPUT, ConfigError, OutOfMemory
from collage_train.metrics.memory import available_memory, process_memory
from collage_train.model.build import count_parameters
from collage_train.model.materialise import largest_unit_numel
from collage_train.planning.host_memory import PROCESS_HOST_BYTES, run_peak
from collage_train.planning.memory_plan import (
    GIB,
    ModelShape,
    Setting,
    checkpoint_copy_bytes,
    estimate_at,
    largest_micro_batch,
)
from collage_train.precision import get_strategy
from collage_train.precision.base import PrecisionStrategy

ZERO_GPU_COUNTS = (2, 4, 8, 16, 32, 64, 128, 256, 512)  # what "how many GPUs" tries


class StepWillNotFit(OutOfMemory):
    """The planned step peak exceeds the device's free memory: a setting must change."""

    exit_status = BAD_INPUT


def host_transient_bytes(meta: torch.nn.Module, strategy: PrecisionStrategy) -> float:
    """What building ``meta``'s weights holds on the host at once (``model.materialise``): its
    largest unit in fp32 beside the unit's copy in the storage dtype; the same where
    ``model.init_from`` reads them (the files are mapped, not copied)."""
    return largest_unit_numel(meta) * (4 + strategy.param_dtype.itemsize)


def device_free_memory(device: torch.device) -> float | None:
    """This rank's free device memory for the step check (None on a CPU run: the host is
    checked by ``check_state_fits``)."""
    if device.type != "cuda":
        return None
    return float(available_memory(device) or 0)


def check_run_fits(
    meta: torch.nn.Module,
    cfg: Any,
    strategy: PrecisionStrategy,
    engine: Any,
    device: torch.device,
    *,
    optimizer_kernel: str,
    loss_chunk_tokens: int | None,
) -> None:
    """Both checks for the model ``meta`` (on the meta device) and the run ``cfg``, every
    rank together: each rank's state check and free device memory are gathered (one
    collective), any rank's refusal raised on every rank, then the step is checked against
    the smallest free memory, alike on every rank. ``loss_chunk_tokens``: the chunked
    loss's block (None: the full-logits loss)."""
    num_params = count_parameters(meta)
    shape = ModelShape.from_model(meta, seq_len=cfg.data.seq_len)
    setting = planned_setting(cfg, strategy, engine.world_size, optimizer_kernel)
    copy = checkpoint_copy_bytes(shape, setting) if cfg.train.async_checkpoint else 0.0

    def here() -> float | None:
        if device.type == "cpu":  # first: its refusal names the settings that fit
            ranks_here = local_world_size() if engine.world_size > 1 else 1
            check_host_fits(
                shape,
                setting,
                available=host_available(ranks_here),
                ranks_here=ranks_here,
                micro_batch=cfg.train.micro_batch_size,
                global_batch=cfg.train.global_batch_size,
                checkpointing=cfg.train.activation_checkpointing,
                loss_chunk_tokens=loss_chunk_tokens,
                async_checkpoint=bool(cfg.train.async_checkpoint),
                export=bool(cfg.train.export_hf),
                model_name=cfg.model.name,
            )
        check_state_fits(
            num_params,
            strategy,
            engine,
            device,
            host_transient_bytes=host_transient_bytes(meta, strategy),
            model_name=cfg.model.name,
            distributed=engine.name,
            checkpoint_copy_bytes=copy,
        )
        return device_free_memory(device)

    free = gathered(here)
    if any(value is None for value in free):
        return
    with agreement():  # decided from the same numbers on every rank
        check_step_fits(
            shape,
            setting,
            free_bytes=min(free),
            reserve_bytes=cfg.plan.reserve_gb * GIB,
            micro_batch=cfg.train.micro_batch_size,
            global_batch=cfg.train.global_batch_size,
            checkpointing=cfg.train.activation_checkpointing,
            loss_chunk_tokens=loss_chunk_tokens,
            model_name=cfg.model.name,
        )


def host_available(ranks_here: int) -> float | None:
    """Host bytes the ``ranks_here`` ranks of this node can hold at their peak: what the
    host has available now plus what each rank already holds, up to the process bytes
    ``host_need`` counts for it (``PROCESS_HOST_BYTES``), since the ranks are running when
    they check (each rank's own share stands for every rank's: they start alike)."""
    available = available_memory(torch.device("cpu"))
    if available is None:
        return None
    held = min(process_memory() or 0, PROCESS_HOST_BYTES)
    return available + ranks_here * held


def check_state_fits(
    num_params: int,
    strategy: PrecisionStrategy,
    engine: Any,
    device: torch.device,
    *,
    host_transient_bytes: float,
    model_name: str,
    distributed: str,
    checkpoint_copy_bytes: float = 0.0,
) -> None:
    """Refuse a model whose state cannot fit, before the kernel's OOM killer would.

    Needs at least the strategy's model-state bytes (this rank's share under ZeRO) on the
    device, and on the host, for every rank on this node, the larger of
    ``host_transient_bytes`` (what building the model holds on the host at once) and
    ``checkpoint_copy_bytes`` (the host copy a background checkpoint is written from,
    allocated at the first save); on a CPU run the device is the host and holds both the
    state and the copy. Raises OutOfMemory.
    """
    ranks_here = local_world_size() if engine.world_size > 1 else 1
    device_needs = num_params * engine.peak_state_bytes_per_param(strategy)
    needs = {"host": max(host_transient_bytes, checkpoint_copy_bytes) * ranks_here}
    if device.type == "cuda":
        needs[str(device)] = device_needs
    else:
        needs["host"] = max(needs["host"], (device_needs + checkpoint_copy_bytes) * ranks_here)
    for where, needed in needs.items():
        available = available_memory(device if where != "host" else torch.device("cpu"))
        if available is not None and needed > available:
            copy = (
                " and the host copy of background checkpoints (train.async_checkpoint=false "
                "saves without it)"
                if where == "host" and checkpoint_copy_bytes
                else ""
            )
            raise OutOfMemory(
                f"out of memory: {model_name} has {num_params / 1e9:.2f}B "
                f"parameters and precision={strategy.name} with "
                f"distributed={distributed} needs at least "
                f"{needed / GIB:.1f} GiB on {where} for weights, gradients and optimizer "
                f"state{copy}, but {available / GIB:.1f} GiB is free (a smaller "
                "train.micro_batch_size cannot fix this); pick a smaller model or spread "
                "the model state over more GPUs with DeepSpeed ZeRO "
                "(distributed=zero2 or zero3)"
            )


def chosen_stage(dist_cfg: Any) -> int:
    """The ZeRO stage the ``distributed`` sub-config names: 0 for ``distributed=unsharded``."""
    if dist_cfg.name == "unsharded":
        return 0
    if dist_cfg.zero_stage not in (1, 2, 3):
        raise ConfigError(f"distributed.zero_stage must be 1, 2 or 3, got {dist_cfg.zero_stage!r}")
    return int(dist_cfg.zero_stage)


def planned_setting(
    cfg: Any, strategy: PrecisionStrategy, world_size: int, optimizer_kernel: str
) -> Setting:
    """The memory planner's ``Setting`` for the run ``cfg`` describes on ``world_size``
    ranks: its ZeRO stage (0 for one whole model per process, replicas included), offloads,
    gradient dtypes and whether the optimizer step runs fused."""
    dist = cfg.distributed
    replicas = uses_replicas(cfg.comm)
    stage = 0 if replicas else chosen_stage(dist)
    masked = bool(cfg.train.guard.enabled) and not replicas  # Trainer.verdicts_on_device
    if stage == 0:
        fused = optimizer_kernel != "eager"
        return Setting(strategy, 0, fused_optimizer=fused, masked_step=masked)
    return Setting(
        strategy,
        stage,
        gpus=world_size,
        fused_optimizer=optimizer_kernel != "eager",
        masked_step=masked,
        offload_optimizer=bool(dist.offload_optimizer),
        offload_param=bool(getattr(dist, "offload_param", False)),
        gradient_dtypes=gradient_dtypes(dist, strategy, stage),
        zero_overrides=zero_overrides(dist),
    )


def zero_overrides(dist_cfg: Any) -> dict[str, Any]:
    """The run's ``distributed.deepspeed.zero_optimization`` keys (its buckets win over the
    derived ones in the engine, so in the plan too)."""
    extra = dist_cfg.get("deepspeed") or {}
    if not isinstance(extra, dict):
        extra = OmegaConf.to_container(extra, resolve=True)
    return dict(extra.get("zero_optimization") or {})


def check_step_fits(
    shape: ModelShape,
    setting: Setting,
    *,
    free_bytes: float,
    reserve_bytes: float,
    micro_batch: int,
    global_batch: int,
    checkpointing: bool,
    model_name: str,
    loss_chunk_tokens: int | None = None,
) -> None:
    """Refuse a step whose planned peak exceeds ``free_bytes - reserve_bytes``, in one line
    saying what fits instead (``loss_chunk_tokens``: the chunked loss's block, None for the
    full-logits loss). Raises StepWillNotFit."""
    budget = free_bytes - reserve_bytes
    plan = estimate_at(
        shape,
        setting,
        micro_batch=micro_batch,
        global_batch=global_batch,
        checkpointing=checkpointing,
        loss_chunk_tokens=loss_chunk_tokens,
    )
    end = run_peak(shape, setting, plan, cpu=False)
    if plan.peak <= budget < end.run_end:
        raise StepWillNotFit(
            f"out of memory ahead: {model_name} with precision={setting.strategy.name} and "
            f"distributed=zero{setting.stage} on {setting.gpus} GPU(s) fits its step, but the "
            f"export at the end of the run gathers every weight on every GPU: about "
            f"{end.run_end / GIB:.1f} GiB per GPU, {free_bytes / GIB:.1f} GiB free less "
            f"plan.reserve_gb={reserve_bytes / GIB:g}; train.export_hf=false fits (export "
            "the checkpoint afterwards with python -m collage_train.export RUN_DIR)"
        )
    if plan.peak <= budget:
        return
    ckpt = "on" if checkpointing else "off"
    engine = "distributed=unsharded" if setting.stage == 0 else f"distributed=zero{setting.stage}"
    raise StepWillNotFit(
        f"out of memory ahead: {model_name} with precision={setting.strategy.name} and "
        f"{engine} on {setting.gpus} GPU(s) at train.micro_batch_size={micro_batch} "
        f"(activation checkpointing {ckpt}) needs about {plan.peak / GIB:.1f} GiB per GPU at "
        f"its step peak (python -m collage_train.plan shows the parts), but "
        f"{free_bytes / GIB:.1f} GiB is free less plan.reserve_gb={reserve_bytes / GIB:g}; "
        + what_fits(
            shape,
            setting,
            budget=budget,
            global_batch=global_batch,
            checkpointing=checkpointing,
            loss_chunk_tokens=loss_chunk_tokens,
        )
    )


def what_fits(
    shape: ModelShape,
    setting: Setting,
    *,
    budget: float,
    global_batch: int,
    checkpointing: bool,
    loss_chunk_tokens: int | None = None,
) -> str:
    """The nearest setting whose step fits ``budget``: a smaller micro-batch, then
    checkpointing, then a higher ZeRO stage on the same GPUs, then more GPUs with ZeRO-3."""

    def largest(candidate: Setting, ckpt: bool) -> int:
        if candidate.stage and candidate.strategy.not_under_zero:
            return 0
        return largest_micro_batch(
            shape,
            candidate,
            budget=budget,
            global_batch=global_batch,
            checkpointing=ckpt,
            loss_chunk_tokens=loss_chunk_tokens,
        )

    micro = largest(setting, checkpointing)
    if micro:
        return f"train.micro_batch_size={micro} fits (gradient accumulation keeps the batch)"
    if not checkpointing and (micro := largest(setting, True)):
        return f"train.activation_checkpointing=true with train.micro_batch_size={micro} fits"
    if setting.gpus > 1:
        for stage in range(max(setting.stage, 0) + 1, 4):
            for ckpt in dict.fromkeys((checkpointing, True)):
                zero = replace(setting, stage=stage, gradient_dtypes=None)
                if micro := largest(zero, ckpt):
                    extra = " train.activation_checkpointing=true" if ckpt else ""
                    return f"distributed=zero{stage}{extra} with micro-batch {micro} fits"
    for gpus in ZERO_GPU_COUNTS:
        if gpus <= setting.gpus or global_batch % gpus:
            continue
        zero3 = replace(setting, stage=3, gpus=gpus, gradient_dtypes=None)
        if micro := largest(zero3, True):
            return (
                f"it needs at least {gpus} such GPUs with distributed=zero3 "
                f"train.activation_checkpointing=true (micro-batch {micro})"
            )
    return "no micro-batch, checkpointing or ZeRO stage on these GPUs fits; pick a smaller model"


def host_need(
    shape: ModelShape,
    setting: Setting,
    *,
    ranks_here: int,
    micro_batch: int,
    global_batch: int,
    checkpointing: bool,
    loss_chunk_tokens: int | None,
    async_checkpoint: bool,
    export: bool,
) -> float:
    """Host bytes the ``ranks_here`` CPU ranks of this node hold at the run's peak, each
    with a background checkpoint's host copy where ``async_checkpoint``, and the export
    at the end where ``export`` (``planning.host_memory.run_peak``). Shared memory is
    counted once: a rank's resident bytes also hold its peers' DeepSpeed workspaces
    (``PEER_HOST_BYTES``), which the host holds once, in their owners."""
    plan = estimate_at(
        shape,
        setting,
        micro_batch=micro_batch,
        global_batch=global_batch,
        checkpointing=checkpointing,
        loss_chunk_tokens=loss_chunk_tokens,
    )
    # each rank's own process: the peers' shared workspaces it maps count in their owners
    peak = run_peak(shape, setting, plan, cpu=True, local_ranks=1)
    if not export:
        peak = replace(peak, run_end=0.0)
    copy = checkpoint_copy_bytes(shape, setting) if async_checkpoint else 0.0
    return ranks_here * (peak.total + copy)


def check_host_fits(
    shape: ModelShape,
    setting: Setting,
    *,
    available: float | None,
    ranks_here: int,
    model_name: str,
    **run: Any,
) -> None:
    """Refuse a CPU run whose ranks on this node would exceed the host's ``available``
    bytes at their peak (``host_need``; ``run``: its keywords but the ranks), in one line
    naming what fits: no background checkpoint, no export at the end, a shorter
    sequence, a strategy of fewer bytes per parameter, or more ZeRO-3 ranks. Raises
    StepWillNotFit."""
    if available is None:
        return
    needed = host_need(shape, setting, ranks_here=ranks_here, **run)
    if needed <= available:
        return
    engine = "distributed=unsharded" if setting.stage == 0 else f"distributed=zero{setting.stage}"
    raise StepWillNotFit(
        f"out of memory ahead: {model_name} with precision={setting.strategy.name} and "
        f"{engine} on {ranks_here} CPU rank(s) needs about {needed / GIB:.1f} GiB of host "
        f"memory at its peak (each rank's process, state, step and DeepSpeed's copies"
        f"{', the export' if run['export'] else ''}"
        f"{', the background checkpoint copy' if run['async_checkpoint'] else ''}), but "
        f"{available / GIB:.1f} GiB is available; "
        + host_what_fits(shape, setting, available=available, ranks_here=ranks_here, run=run)
    )


LEANER_STRATEGIES = ("collage_8bit", "bf16")  # fewer bytes per parameter, in this order


def host_what_fits(
    shape: ModelShape, setting: Setting, *, available: float, ranks_here: int, run: dict
) -> str:
    """The nearest settings whose ``host_need`` fits ``available`` (``check_host_fits``):
    without the background copy, then also without the export, then with that a leaner
    strategy or a shorter sequence, or the ranks spread over more hosts. On one host
    more ranks only add processes (ZeRO-3 shards the same total), so none is offered."""
    base: dict[str, Any] = {}
    said: list[str] = []

    def fits(candidate: Setting = setting, ranks: int = ranks_here, seq_len: int = 0) -> bool:
        sized = replace(shape, seq_len=seq_len or shape.seq_len)
        return host_need(sized, candidate, ranks_here=ranks, **{**run, **base}) <= available

    def answer(*more: str) -> str:
        return "it fits with " + ", ".join([*said, *more])

    for key, words in (
        ("async_checkpoint", "train.async_checkpoint=false"),
        ("export", "train.export_hf=false (export with python -m collage_train.export)"),
    ):
        if run[key]:
            base[key] = False
            said.append(words)
            if fits():
                return answer()
    for name in LEANER_STRATEGIES:
        leaner = replace(setting, strategy=get_strategy(name), gradient_dtypes=None)
        usable = not (setting.stage and leaner.strategy.not_under_zero)
        if name != setting.strategy.name and usable and fits(leaner):
            return answer(f"precision={name}")
    seq_len = shape.seq_len // 2
    while seq_len >= 16:
        if fits(seq_len=seq_len):
            return answer(f"data.seq_len={seq_len}")
        seq_len //= 2
    for hosts in (2, 4, 8):
        per_host = -(-ranks_here // hosts)
        if ranks_here > 1 and setting.stage == 3 and fits(ranks=per_host):
            return answer(f"the {ranks_here} ranks spread over {hosts} hosts ({per_host} a host)")
    return "no setting tried fits this host; pick a smaller model or more hosts"
