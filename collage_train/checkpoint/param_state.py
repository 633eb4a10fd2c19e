"""``FullState``: a checkpoint's state of each parameter, whatever layout wrote it.

The one interface between the readers of every layout (``full_state.open_full_state``) and
its consumers: the layout writers (``universal``, ``native``, ``zero_layout``) and the
engines' elastic resume (``load_full``). ``read(name, start, stop)`` returns, for elements
``[start, stop)`` of the flattened parameter ``name``, one 1-D tensor per component:
``weight`` (the model's dtype); ``master`` where the strategy keeps an fp32 master apart
from the weight; every optimizer-state tensor under its own name, in its saved dtype;
``remainder_ties`` (split_fp32: tie positions as indices from ``start``, the components of
``INDEX_COMPONENTS``); and state kept per block or per piece as one fp32 value per element
(``whole_tensor``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from collage_train.errors import CheckpointError

INDEX_COMPONENTS = ("remainder_ties",)  # positions, not one value per element

Reader = Callable[[str, int, int], dict[str, torch.Tensor]]


def applied_steps(trainer: dict[str, Any]) -> int:
    """The optimizer steps a run applied, from its client state ``trainer``: its steps less
    those the step guard refused (all of them in checkpoints older than that count).
    What DeepSpeed's ``global_steps`` count under ZeRO (``engine.zero``)."""
    return int(trainer.get("applied_steps", trainer["step"]))


@dataclass
class FullState:
    """Per-parameter state of one checkpoint, whatever layout wrote it."""

    layout: str  # unsharded | zero1 | zero2 | zero3 | universal
    world_size: int  # ranks that wrote it
    shapes: dict[str, tuple[int, ...]]  # every parameter, in the model's order
    steps: dict[str, int]  # the optimizer's step count of each parameter
    trainer: dict[str, Any]  # the trainer's client state (rank 0's)
    per_rank_rng: bool  # the writer's ranks had RNG streams of their own
    _reader: Reader = field(repr=False)

    def numel(self, name: str) -> int:
        return math.prod(self.shapes[name])

    def read(self, name: str, start: int = 0, stop: int | None = None) -> dict[str, torch.Tensor]:
        """Every component of elements ``[start, stop)`` of parameter ``name`` (1-D)."""
        stop = self.numel(name) if stop is None else stop
        return self._reader(name, start, stop)

    def check_model(self, shapes: dict[str, tuple[int, ...]], where: Path) -> None:
        """Refuse in one line unless this state has exactly the parameters ``shapes``."""
        if self.shapes == shapes:
            return
        if set(self.shapes) != set(shapes):
            differ = sorted(set(self.shapes) ^ set(shapes))[:3]
            raise CheckpointError(
                f"{where} holds another model (parameters differ: {', '.join(differ)}); "
                "resume with the model it was written with"
            )
        name = next(n for n in shapes if self.shapes[n] != shapes[n])
        raise CheckpointError(
            f"{where} holds another model ({name} is {list(self.shapes[name])} there, "
            f"{list(shapes[name])} here); resume with the model it was written with"
        )
