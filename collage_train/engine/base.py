"""What every execution engine offers the trainer.

An engine owns how gradients are reduced and applied, how the model state is laid
out across processes and how it is checkpointed. The trainer only calls these
methods, so the training loop is the same for one process and for DeepSpeed ZeRO.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from collage_train.checkpoint.full_state import FullState
from collage_train.precision.base import PrecisionStrategy

# A contiguous run [start, stop) of a flat optimizer tensor that belongs to one layer group.
Segment = tuple[str, int, int]


@dataclass(frozen=True)
class StepOutcome:
    """What one optimizer step did: the pre-clipping gradient norm and whether it was applied.

    The norm may be a device tensor: the trainer reads it at its next settle, so that a
    step never waits for the device just to report it.
    """

    grad_norm: torch.Tensor | float
    applied: bool


class Engine(Protocol):
    """The interface of ``SingleProcessEngine``, ``ZeroEngine`` and ``ReplicaEngine``."""

    device: torch.device
    rank: int
    world_size: int

    @property
    def is_main(self) -> bool: ...

    def prepare(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        strategy: PrecisionStrategy,
        micro_batch_size: int,
        accum_steps: int,
        grad_clip: float,
    ) -> torch.nn.Module:
        """Take ownership of model and optimizer; return the module to run forward with."""

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of one micro-batch's mean loss (scaled for gradient accumulation here)."""

    def step(self) -> StepOutcome:
        """Clip, apply the optimizer at the accumulation boundary, and clear gradients."""

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over all ranks, in place; returns it."""

    def barrier(self) -> None: ...

    def descent_segments(
        self, group_of: dict[torch.Tensor, str]
    ) -> dict[torch.Tensor, list[Segment]]:
        """Layer-group segments of every tensor the optimizer updates on this rank."""

    def local_weights(self) -> list[torch.Tensor]:
        """The weights this rank holds (its partitions under ZeRO-3)."""

    state_bytes_measure: str  # what ``state_bytes`` counts, for the run summary

    def state_bytes(self) -> int:
        """Measured bytes of the model state held on this rank."""

    def expected_state_bytes_per_param(self, strategy: PrecisionStrategy) -> float:
        """The analytic counterpart of ``state_bytes`` per parameter."""

    def peak_state_bytes_per_param(self, strategy: PrecisionStrategy) -> float:
        """Model-state bytes per parameter on this rank at the optimizer step."""

    def close(self) -> None:
        """Leave the process group (if any)."""

    def save(self, directory: Path, client_state: dict[str, Any]) -> None:
        """Write the model and optimizer state of this rank into ``directory``."""

    def load(self, directory: Path) -> dict[str, Any]:
        """Restore model and optimizer state from ``directory``; return the client state."""

    def load_full(self, state: FullState) -> dict[str, Any]:
        """Elastic resume: take this rank's share of a rank-independent state; return the
        client state (not offered by the replica engine)."""

    def full_weights(self) -> contextlib.AbstractContextManager[torch.nn.Module]:
        """A context in which the module holds all of its weights (for export)."""

    def comm_metrics(self) -> dict[str, Any]:
        """Communication counters for the logs ({} when the engine reports none)."""


@contextlib.contextmanager
def unchanged(module: torch.nn.Module) -> Iterator[torch.nn.Module]:
    yield module
