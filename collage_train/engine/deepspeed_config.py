"""Render a DeepSpeed config from the trainer's own settings.

The user never writes batch sizes, clipping or precision flags twice: they come from
``train.*``, ``optim.grad_clip`` and the precision strategy. ``distributed.deepspeed``
may add any other DeepSpeed key; setting one of the derived keys there to a different
value is an error that names the setting to change instead.
"""

from __future__ import annotations

from typing import Any

from omegaconf import OmegaConf

from collage_train.errors import ConfigError
from collage_train.precision.base import PrecisionStrategy

ZERO_STAGES = (1, 2, 3)

# Keys the trainer derives, and the setting a user changes instead.
_DERIVED = {
    "train_micro_batch_size_per_gpu": "train.micro_batch_size",
    "gradient_accumulation_steps": "train.global_batch_size",
    "train_batch_size": "train.global_batch_size",
    "gradient_clipping": "optim.grad_clip",
    "bf16": "precision",
    "fp16": "precision",
    "zero_optimization.stage": "distributed=zero1|zero2|zero3",
}


def precision_section(strategy: PrecisionStrategy) -> dict[str, Any]:
    """DeepSpeed's ``bf16`` section for a strategy.

    bf16 parameters with fp32 masters use DeepSpeed's standard bf16 mode; bf16 parameters
    without masters (bf16, collage_*) keep bf16 master weights and bf16 optimizer state,
    so the project's optimizer owns every state component and nothing is fp32.
    """
    import torch

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
) -> dict[str, Any]:
    """The DeepSpeed config dict for one run (``dist_cfg`` is the ``distributed`` sub-config)."""
    stage = dist_cfg.zero_stage
    if stage not in ZERO_STAGES:
        raise ConfigError(f"distributed.zero_stage must be 1, 2 or 3, got {stage!r}")
    if dist_cfg.offload_param and stage != 3:
        raise ConfigError(
            f"distributed.offload_param=true needs ZeRO stage 3 (this run uses stage {stage}); "
            "use distributed=zero3"
        )
    bf16 = precision_section(strategy)
    if dist_cfg.offload_optimizer and bf16.get("bf16_master_weights_and_grads"):
        raise ConfigError(
            f"distributed.offload_optimizer=true with precision={strategy.name}: DeepSpeed "
            "offloads bf16 master weights only with its own CPU Adam, not with this project's "
            "optimizer; use precision=mixed_fp32 (or fp32) or keep the optimizer on the GPU"
        )
    zero: dict[str, Any] = {"stage": stage}
    if dist_cfg.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if dist_cfg.offload_param:
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": accum_steps,
        "train_batch_size": micro_batch_size * accum_steps * world_size,
        "gradient_clipping": grad_clip,
        "bf16": bf16,
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
    _refuse_bf16_optimizer_wrapper(config, stage)
    return config


_FP32_NAMES = ("fp32", "float32", "float", "torch.float32")


def _refuse_bf16_optimizer_wrapper(config: dict[str, Any], stage: int) -> None:
    """bf16 weights with fp32 gradient accumulation under ZeRO-1 (without offload) make
    DeepSpeed wrap the optimizer in its BF16_Optimizer instead of its ZeRO optimizer,
    whose partitions the ZeRO engine reads; say so instead of failing inside it."""
    accum = str((config.get("data_types") or {}).get("grad_accum_dtype", "")).lower()
    offload = "offload_optimizer" in config["zero_optimization"]
    if stage == 1 and config["bf16"].get("enabled") and accum in _FP32_NAMES and not offload:
        raise ConfigError(
            "distributed.deepspeed.data_types.grad_accum_dtype=fp32 with bf16 weights under "
            "ZeRO stage 1 makes DeepSpeed use its BF16_Optimizer, which this trainer does not "
            "drive; use distributed=zero2 (or zero3) for fp32 gradient accumulation"
        )
