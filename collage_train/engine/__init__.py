"""Execution engines: how many processes train, on which devices, and how they talk."""

from __future__ import annotations

from typing import Any

from collage_train.engine.single import SingleProcessEngine, resolve_device
from collage_train.errors import ConfigError


def build_engine(cfg: Any, *, device: str) -> SingleProcessEngine:
    """The engine named by the ``distributed`` sub-config."""
    if cfg.name == "single":
        return SingleProcessEngine(device=resolve_device(device))
    raise ConfigError(f"unknown distributed engine {cfg.name!r}; choose one of: single")


__all__ = ["SingleProcessEngine", "build_engine", "resolve_device"]
