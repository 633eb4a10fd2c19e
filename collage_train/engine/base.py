"""What every execution engine offers the trainer.

An engine owns how gradients are reduced and applied, how the model state is laid
out across processes and how it is checkpointed. The trainer only calls these
methods, so the training loop is the same for one process and for DeepSpeed ZeRO.

The contract of a step: the trainer calls ``engine.step(lr, track_edq)`` once per
optimizer step and gets a ``StepOutcome``; it never touches the optimizer. The engine
sets the lr, asks the optimizer for EDQ partial sums when told to (``step_tracked``),
and reduces them to layer groups in the layout it gave the optimizer at ``prepare``
(``declare_layout``). What an engine holds in memory is a separate protocol
(``StateMemory``), read by the run summary and the start-up memory check.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from collage_train.checkpoint.param_state import FullState
from collage_train.metrics.edq import layer_group_partials, layer_groups
from collage_train.optim.base import FlatPieces, TrackingOptimizer, chunk_numel_for
from collage_train.precision.base import PrecisionStrategy

# A contiguous run [start, stop) of a flat optimizer tensor that belongs to one layer group.
Segment = tuple[str, int, int]
# What ``torch.compile`` takes as its backend: a name ("inductor") or a backend callable.
CompileBackend = str | Callable[..., Any]


@dataclass(frozen=True)
class StepGate:
    """The step guard's say over one step (``Trainer``, collage_train/run/guard.py).

    An engine calls ``judge`` once per step on every rank with the step's global gradient
    norm (before clipping), after the norm is known and before the optimizer changes
    anything; it returns whether to apply the step, a 0-d bool device tensor.
    ``on_device``: the engine hands that tensor to the optimizer as its ``step_mask``
    (``optim.base.TrackingOptimizer``) and never reads it; else the engine reads it and
    skips a refused step (the one host read of the step).
    """

    judge: Callable[[torch.Tensor | float], torch.Tensor]
    on_device: bool = False


@dataclass(frozen=True)
class StepOutcome:
    """What one optimizer step did.

    Attributes:
        grad_norm: the gradient norm before clipping, of the whole model.
        applied: False when the update was skipped: refused by the step gate, or by
            DeepSpeed's own overflow check (then the gate was not asked); the gate's
            device tensor when it masked the update (``StepGate.on_device``).
        edq: this rank's EDQ partial sums, one row of ``metrics.edq.FIELDS`` per
            layer group (``metrics.edq.layer_groups`` order); None unless the step
            was tracked and applied. The trainer sums them over ranks.

    Tensors may live on the device: the trainer reads them at its next settle, so that
    a step never waits for the device just to report it.
    """

    grad_norm: torch.Tensor | float
    applied: bool | torch.Tensor
    edq: torch.Tensor | None = None


class Engine(Protocol):
    """The interface of ``SingleProcessEngine``, ``ZeroEngine`` and ``ReplicaEngine``."""

    device: torch.device
    rank: int
    world_size: int
    # The engine's name as ``distributed`` spells it and checkpoints record it (unsharded,
    # zero1..3; the replica engine is unsharded).
    name: str
    # True where each rank steps its own model between synchronisations (the replica
    # engine): a step is then judged on each rank alone, not on every rank together.
    independent_replicas: bool
    # True where the engine builds the master weights the optimizer updates at ``prepare``
    # (DeepSpeed ZeRO's flat fp32 partitions): what seeds the masters (``model.init_from``)
    # writes into them after ``prepare``; False: the client optimizer's, before it.
    masters_built_at_prepare: bool
    # True where every rank must run each forward of the model together (ZeRO-3 gathers
    # each layer's weights from every rank as it runs): generation is then done by all.
    forward_on_every_rank: bool

    @property
    def is_main(self) -> bool: ...

    def place_parameters(self, params: list[torch.nn.Parameter]) -> None:
        """Keep a freshly materialised unit of the model as this engine stores it, before the
        next unit is drawn (``model.materialise.materialise``): whole (one process, ZeRO-1/2,
        replicas) or partitioned across the ranks (ZeRO-3). Every rank calls it alike."""

    def prepare(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        strategy: PrecisionStrategy,
        micro_batch_size: int,
        accum_steps: int,
        grad_clip: float,
        compile_backend: CompileBackend | None = None,
    ) -> torch.nn.Module:
        """Take ownership of model and optimizer; return the module to run forward with,
        compiled with ``compile_backend`` (``train.compile``) the way the engine supports."""

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of one micro-batch's mean loss (scaled for gradient accumulation here)."""

    def step(self, lr: float, track_edq: bool, gate: StepGate | None = None) -> StepOutcome:
        """Set ``lr``, clip, apply the optimizer at the accumulation boundary unless ``gate``
        refuses the step, clear the gradients; with ``track_edq`` measure the step's
        descent quality."""

    def rewind_steps(self, count: int) -> None:
        """Take back the last ``count`` steps, which ran masked (``StepGate.on_device``) and
        changed nothing: the optimizer's step counts and the engine's own counters
        (DeepSpeed's), which then count applied steps only."""

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over all ranks, in place; returns it."""

    def barrier(self) -> None: ...

    def local_weights(self) -> list[torch.Tensor]:
        """The weights this rank holds (its partitions under ZeRO-3)."""

    def close(self) -> None:
        """Leave the process group (if any)."""

    def state_files(
        self, directory: Path, client_state: dict[str, Any], *, staged: bool
    ) -> dict[str, Any]:
        """This rank's part of a checkpoint in ``directory``, as relative file name -> what
        to ``torch.save`` there (tensors still the live ones; the caller writes them).
        ``staged``: the caller copies every tensor before training goes on."""

    def load(self, directory: Path) -> dict[str, Any]:
        """Restore model and optimizer state from ``directory``; return the client state."""

    def load_full(self, state: FullState) -> dict[str, Any]:
        """Elastic resume: take this rank's share of a rank-independent state; return the
        client state (not offered by the replica engine)."""

    def full_weights(self) -> contextlib.AbstractContextManager[torch.nn.Module]:
        """A context in which the module holds all of its weights (for export)."""

    def comm_metrics(self) -> dict[str, Any]:
        """Communication counters for the logs ({} when the engine reports none)."""

    def run_files(self) -> dict[str, Any]:
        """What the run directory keeps of the engine's settings, as file name -> JSON
        content (ZeRO: ``deepspeed_config.json``, the config DeepSpeed was given; {} when
        there is none)."""


class StateMemory(Protocol):
    """What an engine's model state costs on one rank (every engine also offers this)."""

    state_bytes_measure: str  # what ``state_bytes`` counts, for the run summary

    def state_bytes(self) -> int:
        """Measured bytes of the model state held on this rank."""

    def expected_state_bytes_per_param(self, strategy: PrecisionStrategy) -> float:
        """The analytic counterpart of ``state_bytes`` per parameter."""

    def peak_state_bytes_per_param(self, strategy: PrecisionStrategy) -> float:
        """Model-state bytes per parameter on this rank at the optimizer step."""


def declare_layout(
    optimizer: torch.optim.Optimizer,
    model: torch.nn.Module,
    segments: dict[torch.Tensor, list[Segment]],
    state_bytes_per_param: float,
    flat_pieces: dict[torch.Tensor, FlatPieces] | None = None,
) -> None:
    """Tell the optimizer what the engine decided at ``prepare``: which layer group each
    range of each tensor it updates belongs to (EDQ), where the pieces of model tensors
    lie in the flat tensors it updates (``flat_pieces``, ZeRO), and how many elements a
    step may work on at a time so that its transients stay small next to the state this
    rank holds (``optim.base.chunk_numel_for``)."""
    if not isinstance(optimizer, TrackingOptimizer):
        return
    optimizer.edq_segments = segments
    optimizer.flat_pieces = flat_pieces or {}
    num_params = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())  # ZeRO-3
    optimizer.step_chunk_numel = chunk_numel_for(num_params * state_bytes_per_param)


def step_tracked(
    optimizer: torch.optim.Optimizer,
    model: torch.nn.Module,
    device: torch.device,
    lr: float,
    track_edq: bool,
    apply: Callable[[StepGate | None], tuple[torch.Tensor | float, bool | torch.Tensor]],
    gate: StepGate | None = None,
) -> StepOutcome:
    """Set ``lr`` on every parameter group, run ``apply(gate)`` (the engine's own
    clip-and-step, returning the gradient norm and whether the update was applied) with
    EDQ tracked if asked, and reduce the tracked partials to this rank's rows per layer
    group."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.track_edq = track_edq
    try:
        grad_norm, applied = apply(gate)
        edq = None
        if track_edq and applied is not False:  # a masked step's partials: zero if refused
            edq = layer_group_partials(
                optimizer.last_edq, optimizer.edq_segments, layer_groups(model), device
            )
    finally:
        optimizer.track_edq = False
    return StepOutcome(grad_norm=grad_norm, applied=applied, edq=edq)


@contextlib.contextmanager
def unchanged(module: torch.nn.Module) -> Iterator[torch.nn.Module]:
    yield module


class GateOnce:
    """``gate`` asked at most once per step, however many times the optimizer's ``step`` is
    called in it (DeepSpeed steps the client optimizer once per parameter group), with
    the gradient norm that ``read_norm`` returns at the first call: the verdict's device
    tensor where the optimizer masks its step with it (``StepGate.on_device``), else read
    as a bool."""

    def __init__(self, gate: StepGate, read_norm: Callable[[], torch.Tensor | float]) -> None:
        self.gate, self.read_norm = gate, read_norm
        self.decision: bool | torch.Tensor | None = None  # None: not asked (never stepped)

    def __call__(self) -> bool | torch.Tensor:
        if self.decision is None:
            ok = self.gate.judge(self.read_norm())
            self.decision = ok if self.gate.on_device else bool(ok)
        return self.decision
