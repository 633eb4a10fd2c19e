"""DeepSpeed ZeRO's communication buckets, sized from the model, and the bytes they hold.

DeepSpeed 0.19.8 leaves ``overlap_comm`` off at stages 1-2 and fixes its buckets whatever
the model (``reduce_bucket_size`` 5e8 elements, allocated whole). ``zero_tuning`` derives
them from the model instead, by Hugging Face transformers' rules for DeepSpeed's
``"auto"`` values: ``overlap_comm`` and ``contiguous_gradients`` at every stage,
``reduce_bucket_size`` = hidden^2 (at most the parameter count) and
``allgather_bucket_size`` the same (even); at stage 3 ``stage3_prefetch_bucket_size`` =
0.9 hidden^2, ``stage3_param_persistence_threshold`` = 10 hidden, and
``stage3_max_live_parameters`` = ``stage3_max_reuse_distance`` = two blocks' parameters.
``distributed.deepspeed.zero_optimization`` overrides any of these (a user value wins),
and ``zero_buffers`` reads the merged section, so ``memory_plan`` counts the buffers the
engine allocates: the trainer and the planner call the same two functions.
Each value's reason: docs/distributed.md, "Buckets and overlap, sized from the model".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from collage_train.metrics.edq import layer_group
from collage_train.model.shapes import full_numel

# DeepSpeed 0.19.8 asserts allgather_bucket_size % 2 == 0 (4-byte aligned fp16 shards).
_ALLGATHER_ALIGNMENT = 2
PREFETCH_FRACTION = 0.9  # stage3_prefetch_bucket_size = 0.9 hidden^2
PERSISTENCE_PER_HIDDEN = 10  # stage3_param_persistence_threshold = 10 hidden
LIVE_BLOCKS = 2  # stage3_max_live_parameters = max_reuse_distance = 2 blocks


@dataclass(frozen=True)
class ModelSize:
    """What the bucket rules need of a model: its width, its parameter count and the
    parameters of its largest transformer block."""

    hidden: int
    num_params: int
    block_params: int

    @classmethod
    def of(cls, model: torch.nn.Module) -> ModelSize:
        """The size of a transformers model (``config.hidden_size``; blocks are the
        ``h.N`` / ``layers.N`` modules, as ``metrics.edq.layer_group`` names them)."""
        blocks: dict[str, int] = {}
        total = 0
        for name, param in model.named_parameters():
            numel = full_numel(param)  # whole, also once ZeRO-3 partitioned it
            total += numel
            group = layer_group(name)
            if group.startswith("block_"):
                blocks[group] = blocks.get(group, 0) + numel
        return cls(
            hidden=int(model.config.hidden_size),
            num_params=total,
            block_params=max(blocks.values(), default=total),
        )


def zero_tuning(stage: int, size: ModelSize) -> dict[str, Any]:
    """The ``zero_optimization`` keys for throughput at ZeRO ``stage`` (module docstring)."""
    bucket = max(1, min(size.hidden * size.hidden, size.num_params))
    tuning: dict[str, Any] = {
        "overlap_comm": True,
        "contiguous_gradients": True,
        "reduce_bucket_size": bucket,
    }
    if stage < 3:
        tuning["allgather_bucket_size"] = -(-bucket // _ALLGATHER_ALIGNMENT) * _ALLGATHER_ALIGNMENT
        return tuning
    live = LIVE_BLOCKS * size.block_params
    tuning.update(
        {
            "stage3_prefetch_bucket_size": int(PREFETCH_FRACTION * size.hidden * size.hidden),
            "stage3_param_persistence_threshold": PERSISTENCE_PER_HIDDEN * size.hidden,
            "stage3_max_live_parameters": live,
            "stage3_max_reuse_distance": live,
        }
    )
    return tuning


# DeepSpeed's defaults where a section leaves a key out (deepspeed.runtime.zero.config).
_DEFAULTS = {
    "contiguous_gradients": True,
    "reduce_bucket_size": 500_000_000,
    "stage3_max_live_parameters": 1_000_000_000,
}


@dataclass(frozen=True)
class ZeroBuffers:
    """Bytes of DeepSpeed's communication buffers on one rank, by kind."""

    buckets: float  # the reduce bucket(s) gradients are copied into
    cast: float  # the bucket cast to the reduce dtype for the collective
    gathered: float  # stage 3: whole weights gathered for the blocks computed

    @property
    def total(self) -> float:
        return self.buckets + self.cast + self.gathered


def zero_buffers(
    zero: dict[str, Any],
    *,
    num_params: int,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    accumulate_dtype: torch.dtype,
) -> ZeroBuffers:
    """DeepSpeed 0.19.8's communication buffers on one rank for the rendered
    ``zero_optimization`` section ``zero`` (its ``stage`` and the keys above).

    Stages 1-2: with ``contiguous_gradients`` one reduce bucket (two with ``overlap_comm``)
    in the weights' dtype, or at stage 1 in the accumulation dtype (DeepSpeed's
    ``grad_accum`` path where the two differ); without it, the flattened bucket of the
    reduction. A reduce in another dtype than the bucket's casts one bucket for the
    collective. Stage 3: one bucket in the reduce dtype (``communication_data_type``),
    and the gathered weights, at most ``stage3_max_live_parameters`` (and the model).
    """
    stage = int(zero["stage"])
    settings = {**_DEFAULTS, **zero}
    bucket = int(settings["reduce_bucket_size"])
    contiguous = bool(settings["contiguous_gradients"])
    overlap = bool(settings.get("overlap_comm", stage == 3))  # DeepSpeed's own default
    if stage == 3:
        live = min(int(settings["stage3_max_live_parameters"]), num_params)
        buckets = bucket * reduce_dtype.itemsize if contiguous else 0.0
        return ZeroBuffers(buckets, 0.0, live * param_dtype.itemsize)
    buffer_dtype = accumulate_dtype if stage == 1 else param_dtype
    copies = 2 if overlap and contiguous else 1
    cast = bucket * reduce_dtype.itemsize if reduce_dtype != buffer_dtype else 0.0
    return ZeroBuffers(copies * bucket * buffer_dtype.itemsize, cast, 0.0)
