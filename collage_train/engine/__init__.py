"""Execution engines: how many processes train, on which devices, and how they talk.

``single`` is one process on one device; ``zero1``/``zero2``/``zero3`` are DeepSpeed
ZeRO stages over every rank of a ``deepspeed`` or ``torchrun`` launch. With
``comm=diloco`` or ``comm=sparseloco``, ``single`` means one whole replica per process,
merged every ``comm.sync_every`` steps (``ReplicaEngine``, any number of ranks).
``agreement``: a check that refuses on one rank refuses on every rank, in one line.
"""

from __future__ import annotations

from typing import Any

from collage_train.comm.settings import check_engine, uses_replicas
from collage_train.engine.base import Engine, Segment, StepOutcome
from collage_train.engine.launch import launched_world_size
from collage_train.engine.single import SingleProcessEngine, resolve_device
from collage_train.errors import ConfigError
from collage_train.precision.base import PrecisionStrategy

ENGINES = ("unsharded", "zero1", "zero2", "zero3")


def build_engine(
    cfg: Any,
    comm_cfg: Any = None,
    *,
    device: str,
    strategy: PrecisionStrategy | None = None,
) -> Engine:
    """The engine named by the ``distributed`` and ``comm`` sub-configs, on ``train.device``;
    refused in one line, before any process group or DeepSpeed import, where ``comm`` or
    the precision ``strategy`` cannot run under it."""
    if cfg.name not in ENGINES:
        raise ConfigError(
            f"unknown distributed engine {cfg.name!r}; choose one of: {', '.join(ENGINES)}"
        )
    check_engine(comm_cfg, cfg.name)
    if strategy is not None:
        strategy.check_engine(cfg.name)
    if uses_replicas(comm_cfg):
        from collage_train.engine.replicas import ReplicaEngine

        return ReplicaEngine(comm_cfg, resolve_device(device), cfg.timeout_minutes)
    if cfg.name == "unsharded":
        if launched_world_size() > 1:
            raise ConfigError(
                f"this process is one of {launched_world_size()} launched ranks but "
                "distributed=unsharded; choose distributed=zero1, zero2 or zero3 (or "
                "comm=diloco|sparseloco for one whole replica per process)"
            )
        return SingleProcessEngine(device=resolve_device(device))
    from collage_train.engine.zero import ZeroEngine  # imports DeepSpeed, which is slow

    return ZeroEngine(cfg, resolve_device(device))


__all__ = [
    "ENGINES",
    "Engine",
    "Segment",
    "SingleProcessEngine",
    "StepOutcome",
    "build_engine",
    "resolve_device",
]
