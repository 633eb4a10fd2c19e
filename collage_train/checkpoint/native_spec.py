"""What a checkpoint in an engine's own layout is written for, and from, without its values.

``Target``: the engine and number of ranks (``native.check_target`` builds it, refusing a
target the run could not resume on); ``ModelLayout``: the trainer's parameter groups,
shapes, tied names, state-dict keys and dtypes (``native.model_layout`` rebuilds them from
the checkpoint's record of the run). ``native`` writes the one-process layout from them,
``zero_layout`` DeepSpeed's ZeRO files.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from collage_train.checkpoint.full_state import ZERO_ENGINES


@dataclass(frozen=True)
class Target:
    """The engine and number of ranks a checkpoint is written for."""

    engine: str  # unsharded | zero1 | zero2 | zero3
    world_size: int

    @property
    def stage(self) -> int:
        """The ZeRO stage; 0 for one process."""
        return int(self.engine[-1]) if self.engine in ZERO_ENGINES else 0


@dataclass(frozen=True)
class ModelLayout:
    """What the trainer's model and optimizer look like, without their values."""

    groups: list[list[str]]  # the optimizer's parameter groups, each parameter's name in order
    shapes: dict[str, torch.Size]
    aliases: dict[str, str]  # a tied weight's other name -> the parameter's own name
    keys: list[str]  # the module's state-dict keys, in order
    settings: list[dict[str, Any]]  # each group's hyperparameters, as the optimizer saves them
    param_dtype: torch.dtype
    master_dtype: torch.dtype  # of DeepSpeed's flat master partitions

    def numel(self, name: str) -> int:
        return math.prod(self.shapes[name])
