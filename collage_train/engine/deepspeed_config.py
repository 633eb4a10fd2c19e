"""Render a DeepSpeed config from the trainer's own settings.

The user never writes batch sizes, clipping or precision flags twice: they come from
``train.*``, ``optim.grad_clip`` and the precision strategy; the ZeRO section's
communication buckets and overlap come from the model's size (``engine.zero_buckets``).
``distributed.deepspeed`` may add any other DeepSpeed key or override a bucket; setting
one of the keys derived from a trainer setting there to a different value is an error
that names the setting to change instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from omegaconf import OmegaConf

from collage_train.engine.zero_buckets import ModelSize, zero_tuning
from collage_train.errors import ConfigError
from collage_train.precision.base import PrecisionStrategy

ZERO_STAGES = (1, 2, 3)

# Keys the trainer derives from its settings, and the setting a user changes instead (the
# buckets of ``zero_buckets.zero_tuning`` are derived too, but a user value wins).
_DERIVED = {
    "train_micro_batch_size_per_gpu": "train.micro_batch_size",
    "gradient_accumulation_steps": "train.global_batch_size",
    "train_batch_size": "train.global_batch_size",
    "gradient_clipping": "optim.grad_clip",
    "bf16": "precision",
    "fp16": "precision",
    "zero_optimization.stage": "distributed=zero1|zero2|zero3",
    "communication_data_type": "distributed.reduce_dtype",
    "data_types.grad_accum_dtype": "distributed.grad_accum_dtype",
}

GRADIENT_DTYPE_CHOICES = ("auto", "fp32", "bf16")
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
_NAMES = {dtype: name for name, dtype in _DTYPES.items()}


@dataclass(frozen=True)
class GradientDtypes:
    """The dtypes DeepSpeed reduces gradients across ranks in and accumulates them in.

    ``auto`` follows the strategy. A strategy with fp32 master weights (``mixed_fp32``,
    ``fp32``) is the fp32 baseline, so its gradients are summed in fp32 as Megatron-LM
    and PyTorch FSDP setups for bf16 do: a bf16 sum over N ranks or K micro-batches
    loses about log2(N*K) of bf16's 8 significant bits on small components. A strategy
    without fp32 copies (``bf16``, ``collage_*``) keeps gradients in bf16 as well: that
    halves the reduce-scatter traffic and the gradient partition, and its optimizer
    reads bf16 gradients in any case. One exception: at ZeRO stage 1 DeepSpeed
    accumulates bf16 weights' gradients in fp32 only by replacing its ZeRO optimizer
    with its BF16_Optimizer, so ``auto`` accumulates in bf16 there (reduction in fp32
    still applies) and an explicit ``fp32`` is refused.
    """

    reduce: torch.dtype
    accumulate: torch.dtype

    def summary(self) -> dict[str, str]:
        return {"reduce_dtype": _NAMES[self.reduce], "grad_accum_dtype": _NAMES[self.accumulate]}


def _gradient_dtype_setting(dist_cfg: Any, key: str) -> str:
    value = str(getattr(dist_cfg, key, "auto") or "auto").lower()
    if value not in GRADIENT_DTYPE_CHOICES:
        raise ConfigError(
            f"distributed.{key}={value!r} is not a gradient dtype; choose one of: "
            f"{', '.join(GRADIENT_DTYPE_CHOICES)}"
        )
    return value


def gradient_dtypes(dist_cfg: Any, strategy: PrecisionStrategy, stage: int) -> GradientDtypes:
    """Resolve ``distributed.reduce_dtype`` and ``distributed.grad_accum_dtype`` for a run."""
    reduce = _gradient_dtype_setting(dist_cfg, "reduce_dtype")
    accumulate = _gradient_dtype_setting(dist_cfg, "grad_accum_dtype")
    bf16_weights = strategy.param_dtype == torch.bfloat16
    fp32_baseline = not bf16_weights or strategy.master_dtype == torch.float32
    offload = bool(getattr(dist_cfg, "offload_optimizer", False))
    if reduce == "auto":
        reduce = "fp32" if fp32_baseline else "bf16"
    if accumulate == "auto":
        accumulate = (
            "fp32" if fp32_baseline and (stage > 1 or offload or not bf16_weights) else "bf16"
        )
    if accumulate == "bf16" and not bf16_weights:
        raise ConfigError(
            f"distributed.grad_accum_dtype=bf16 with precision={strategy.name}, whose weights "
            "and gradients are fp32; DeepSpeed accumulates fp32 gradients in fp32 (use auto)"
        )
    if accumulate == "fp32" and bf16_weights and stage == 1 and not offload:
        raise ConfigError(
            "distributed.grad_accum_dtype=fp32 with bf16 weights under ZeRO stage 1 makes "
            "DeepSpeed use its BF16_Optimizer, which this trainer does not drive; use "
            "distributed=zero2 (or zero3) for fp32 gradient accumulation"
        )
    return GradientDtypes(reduce=_DTYPES[reduce], accumulate=_DTYPES[accumulate])


def precision_section(strategy: PrecisionStrategy) -> dict[str, Any]:
    """DeepSpeed's ``bf16`` section for a strategy.

    bf16 parameters with fp32 masters use DeepSpeed's standard bf16 mode; bf16 parameters
    without masters (bf16, collage_*) keep bf16 master weights and bf16 optimizer state,
    so the project's optimizer owns every state component and nothing is fp32.
    """
    if strategy.param_dtype != torch.bfloat16:
        return {"enabled": False}
    if strategy.master_dtype is not None:
        return {"enabled": True}
    return {
        "enabled": True,
        "bf16_master_weights_and_grads": True,
        "bf16_optimizer_states": True,
    }


def _deep_merge(base: dict[str, Any], extra: dict[str, Any], path: str = "") -> None:
    for key, value in extra.items():
        dotted = f"{path}{key}"
        if dotted in ("bf16", "fp16"):
            raise ConfigError(
                f"distributed.deepspeed.{dotted} is set by the precision strategy; "
                "choose precision=NAME instead"
            )
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            _deep_merge(base[key], value, f"{dotted}.")
            continue
        if dotted in _DERIVED and key in base and base[key] != value:
            raise ConfigError(
                f"distributed.deepspeed.{dotted}={value!r} conflicts with the value "
                f"{base[key]!r} derived from the run's settings; set {_DERIVED[dotted]} instead"
            )
        base[key] = value


def render_deepspeed_config(
    dist_cfg: Any,
    strategy: PrecisionStrategy,
    *,
    micro_batch_size: int,
    accum_steps: int,
    world_size: int,
    grad_clip: float,
    model_size: ModelSize,
) -> dict[str, Any]:
    """The DeepSpeed config dict for one run (``dist_cfg`` is the ``distributed`` sub-config)
    of a model of ``model_size`` (its buckets: ``zero_buckets.zero_tuning``)."""
    stage = dist_cfg.zero_stage
    if stage not in ZERO_STAGES:
        raise ConfigError(f"distributed.zero_stage must be 1, 2 or 3, got {stage!r}")
    offload_param = bool(getattr(dist_cfg, "offload_param", False))  # distributed=zero3's
    bf16 = precision_section(strategy)
    grads = gradient_dtypes(dist_cfg, strategy, stage)
    if dist_cfg.offload_optimizer and bf16.get("bf16_master_weights_and_grads"):
        raise ConfigError(
            f"distributed.offload_optimizer=true with precision={strategy.name}: DeepSpeed "
            "offloads bf16 master weights only with its own CPU Adam, not with this project's "
            "optimizer; use precision=mixed_fp32 (or fp32) or keep the optimizer on the GPU"
        )
    zero: dict[str, Any] = {"stage": stage, **zero_tuning(stage, model_size)}
    if dist_cfg.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if offload_param:
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": accum_steps,
        "train_batch_size": micro_batch_size * accum_steps * world_size,
        "gradient_clipping": grad_clip,
        "bf16": bf16,
        "communication_data_type": grads.summary()["reduce_dtype"],
        "data_types": {"grad_accum_dtype": grads.summary()["grad_accum_dtype"]},
        "zero_optimization": zero,
        # The optimizer is the project's (CollageAdamW / AdamW), not one DeepSpeed knows.
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 2**31 - 1,  # the trainer logs; keep DeepSpeed quiet
        "wall_clock_breakdown": False,
    }
    extra = dist_cfg.deepspeed
    if extra:
        if not isinstance(extra, dict):
            extra = OmegaConf.to_container(extra, resolve=True)
        _deep_merge(config, dict(extra))
    return config
