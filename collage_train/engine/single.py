"""The single-process engine: one process, one device (CUDA when present, else CPU)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from collage_train.errors import ConfigError


def resolve_device(name: str) -> torch.device:
    """``auto`` picks CUDA when available, else CPU; ``cuda`` without a GPU is an error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device=cuda but no CUDA device is visible; use train.device=auto")
    if name not in ("cpu", "cuda"):
        raise ConfigError(f"train.device must be auto, cpu or cuda, got {name!r}")
    return torch.device(name)


@dataclass(frozen=True)
class SingleProcessEngine:
    """Rank 0 of a world of one."""

    device: torch.device
    rank: int = 0
    world_size: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0
