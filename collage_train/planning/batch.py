"""How a global batch splits into micro-batches: the one rule the trainer and the planner share.

A step of ``train.global_batch_size`` sequences runs on ``world_size`` data-parallel ranks,
each taking ``accumulation`` micro-batches of ``train.micro_batch_size`` sequences, so

    global_batch = micro_batch * accumulation * world_size

exactly: a split that does not divide would train on another number of tokens per step
than the one the run is defined by. The micro-batches a planner may recommend are the
divisors of ``global_batch / world_size``.
"""

from __future__ import annotations

from collage_train.errors import ConfigError


def accumulation_steps(global_batch: int, micro_batch: int, world_size: int) -> int:
    """Micro-batches per optimizer step on each rank; the global batch must split evenly."""
    per_pass = micro_batch * world_size
    if micro_batch < 1:
        raise ConfigError(f"train.micro_batch_size must be at least 1 sequence, got {micro_batch}")
    if global_batch < 1 or global_batch % per_pass != 0:
        raise ConfigError(
            f"train.global_batch_size={global_batch} is not divisible by "
            f"train.micro_batch_size={micro_batch} x world size {world_size}; "
            f"use a global batch that is a multiple of {per_pass}"
        )
    return global_batch // per_pass


def micro_batch_choices(global_batch: int, world_size: int) -> list[int]:
    """Every micro-batch that splits ``global_batch`` over ``world_size`` ranks, ascending."""
    if global_batch < 1 or global_batch % world_size != 0:
        raise ConfigError(
            f"train.global_batch_size={global_batch} is not divisible by the world size "
            f"{world_size}; use a multiple of {world_size}"
        )
    per_rank = global_batch // world_size
    return [micro for micro in range(1, per_rank + 1) if per_rank % micro == 0]
