"""A run's peak beyond its step: what a CPU rank's process holds, DeepSpeed's own CPU
copies at the step, and the end of a run (the export's gathered weights).

``memory_plan.estimate`` plans one step's tensors. On CPU ranks the host also holds each
rank's interpreter and libraries (``PROCESS_HOST_BYTES``) and, under ZeRO, the flat
copies DeepSpeed makes at its step and keeps (``ZERO3_CPU_STEP_BYTES``,
``ZERO12_CPU_STEP_BYTES``). At the end of a
run the export to ``hf/`` (``export.export_from_engine``) gathers every ZeRO-3 weight on
every rank at once (``run_end_bytes``). Measured with VmHWM per rank on real launches
(scripts/rehearse_scale.py; docs/planner.md, "What a run's peak counts").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from collage_train.planning.memory_plan import GIB, MemoryEstimate, ModelShape, Setting

# A CPU rank's resident bytes besides its tensors: Python, torch, transformers, DeepSpeed,
# gloo and the allocator's slack (VmHWM of gpt_tiny ZeRO-3 ranks: 0.60 GiB; the intercept of
# gpt_125m and gpt_350m ranks, 2 ranks, seq 64: 0.74 GiB).
PROCESS_HOST_BYTES = 0.75 * GIB
# Each ZeRO rank's resident bytes grow with the ranks on its host beyond the two that
# PROCESS_HOST_BYTES was measured with: DeepSpeed's shared-memory all-reduce on CPU maps
# every local rank's 66 MiB workspace into each rank (gpt_350m and gpt_1.3b over 4 ZeRO-3
# ranks: 0.23-0.25 GiB a rank above 2 ranks' intercept). Shared: the host holds it once.
PEER_HOST_BYTES = 0.12 * GIB
# ZeRO-3 on CPU ranks, per parameter of this rank's partition: the fp32 flat gradient
# DeepSpeed builds at its step (``_prepare_fp32_grad_for_sub_group``), the norm's and the
# unscale's temporaries and the flat copies of its initialisation (the fp16 partitions'
# defragmentation, the zero gradients ``initialize_optimizer_states`` steps) that the
# allocator keeps: 7.8-8.3 bytes measured (gpt_125m, gpt_350m, collage_plus, 2 ranks).
ZERO3_CPU_STEP_BYTES = 8.0
# ZeRO-1/2 on CPU ranks, per element of this rank's partition: the flat gradient partition
# DeepSpeed builds at its step in the master's dtype and the norm's and the step's
# temporaries the allocator keeps. Without an fp32 master (bf16 partitions: Collage, bf16
# strategies) 4.8-5.0 bytes measured (gpt_350m, collage_8bit and collage_plus, 2 ranks);
# with fp32 partitions (mixed_fp32's master, fp32 weights) 2.5, the fp32 gradient planned.
ZERO12_CPU_STEP_BYTES = 5.0
ZERO12_CPU_STEP_BYTES_FP32 = 2.5


@dataclass(frozen=True)
class RunPeak:
    """Bytes per rank of a run's peak moments: the step (with DeepSpeed's CPU copies) and
    the end of the run (the export), and the process itself on a CPU rank."""

    step: float
    run_end: float
    process: float = 0.0

    @property
    def total(self) -> float:
        return self.process + max(self.step, self.run_end)

    def moment(self) -> str:
        return "the export to hf/ at the end of the run" if self.run_end > self.step else "its step"


def deepspeed_cpu_bytes(shape: ModelShape, setting: Setting) -> float:
    """DeepSpeed's own copies at the step on a CPU rank (ZeRO; 0 in one process)."""
    if setting.stage == 0:
        return 0.0
    if setting.stage == 3:
        per_element = ZERO3_CPU_STEP_BYTES
    elif torch.float32 in (setting.strategy.master_dtype, setting.strategy.param_dtype):
        per_element = ZERO12_CPU_STEP_BYTES_FP32
    else:
        per_element = ZERO12_CPU_STEP_BYTES
    return per_element * shape.num_params / setting.gpus


def run_end_bytes(shape: ModelShape, setting: Setting, plan: MemoryEstimate) -> float:
    """What a rank holds while the run exports ``hf/``: the persistent state, the gradient
    partitions and buckets DeepSpeed keeps, and under ZeRO-3 every weight gathered whole on
    every rank (``engine.full_weights``), beside this rank's share."""
    gathered = 0.0
    if setting.stage == 3:
        param = setting.strategy.param_dtype.itemsize
        gathered = shape.num_params * param * (1 - 1 / setting.gpus)
    return plan.persistent + plan.gradients + plan.buffers + gathered


def process_bytes(setting: Setting, local_ranks: int) -> float:
    """A CPU rank's process beside its tensors, with ``local_ranks`` ZeRO ranks on its host."""
    peers = max(0, local_ranks - 2) if setting.stage else 0
    return PROCESS_HOST_BYTES + peers * PEER_HOST_BYTES


def run_peak(
    shape: ModelShape,
    setting: Setting,
    plan: MemoryEstimate,
    *,
    cpu: bool,
    local_ranks: int | None = None,
) -> RunPeak:
    """The run's peak per rank for the step ``plan`` (``memory_plan.estimate``): on CPU
    ranks with the process (``local_ranks`` on its host: default every rank of the
    setting) and DeepSpeed's CPU copies, on a GPU the device's bytes."""
    extra = deepspeed_cpu_bytes(shape, setting) if cpu else 0.0
    ranks = setting.gpus if local_ranks is None else local_ranks
    return RunPeak(
        step=plan.peak + extra,
        run_end=run_end_bytes(shape, setting, plan) + extra,
        process=process_bytes(setting, ranks) if cpu else 0.0,
    )
