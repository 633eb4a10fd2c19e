"""The single-process engine: one process, one device (CUDA when present, else CPU)."""

from __future__ import annotations

import contextlib
import logging
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from collage_train import checkpoint
from collage_train.checkpoint import whole_tensor
from collage_train.checkpoint.param_state import INDEX_COMPONENTS, FullState
from collage_train.engine.base import (
    CompileBackend,
    Segment,
    StepGate,
    StepOutcome,
    declare_layout,
    step_tracked,
    unchanged,
)
from collage_train.errors import ConfigError
from collage_train.metrics import model_state_bytes
from collage_train.metrics.edq import layer_group_of
from collage_train.optim import clip_grad_norm
from collage_train.precision.base import PrecisionStrategy

log = logging.getLogger(__name__)


def resolve_device(name: str) -> torch.device:
    """``auto`` picks CUDA when available, else CPU; ``cuda`` without a GPU is an error.

    ``auto`` on a machine with an NVIDIA driver (``nvidia-smi``) whose torch sees no CUDA
    device warns before training on the CPU: a CPU build of torch, or a CUDA build the
    driver is too old for, would otherwise go unnoticed for hours.
    """
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if shutil.which("nvidia-smi"):
            build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
            log.warning(
                "train.device=auto: nvidia-smi is present but torch %s (%s) sees no CUDA "
                "device, so this run trains on the CPU; install a torch build that matches "
                "the NVIDIA driver (nvidia-smi shows its CUDA version), or set "
                "train.device=cpu to train on the CPU knowingly",
                torch.__version__,
                build,
            )
        return torch.device("cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device=cuda but no CUDA device is visible; use train.device=auto")
    if name not in ("cpu", "cuda"):
        raise ConfigError(f"train.device must be auto, cpu or cuda, got {name!r}")
    return torch.device(name)


@dataclass
class SingleProcessEngine:
    """Rank 0 of a world of one: plain backward, fp32-accumulated clipping, optimizer step."""

    device: torch.device
    rank: int = 0
    world_size: int = 1
    model: torch.nn.Module | None = field(default=None, repr=False)
    optimizer: torch.optim.Optimizer | None = field(default=None, repr=False)
    accum_steps: int = 1
    grad_clip: float = 0.0
    _state_bytes: int | None = field(default=None, repr=False)
    name = "unsharded"  # engine.base.Engine
    independent_replicas = False  # one rank steps alone anyway
    masters_built_at_prepare = False  # the client optimizer's masters
    forward_on_every_rank = False  # whole weights in each process

    @property
    def is_main(self) -> bool:
        return True

    def place_parameters(self, params: list[torch.nn.Parameter]) -> None:
        """One whole model per process: the unit stays as it was materialised."""

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
        del micro_batch_size  # one process does not need it
        if compile_backend is not None:  # in place: parameters, state-dict keys, hooks kept
            model.compile(backend=compile_backend)
        self.model, self.optimizer = model, optimizer
        self.accum_steps, self.grad_clip = accum_steps, grad_clip
        segments = self.edq_segments(layer_group_of(model))
        declare_layout(optimizer, model, segments, self.peak_state_bytes_per_param(strategy))
        return model

    def backward(self, loss: torch.Tensor) -> None:
        (loss / self.accum_steps).backward()

    def step(self, lr: float, track_edq: bool, gate: StepGate | None = None) -> StepOutcome:
        return step_tracked(
            self.optimizer, self.model, self.device, lr, track_edq, self._apply, gate
        )

    def _apply(self, gate: StepGate | None) -> tuple[torch.Tensor, bool | torch.Tensor]:
        grad_norm = clip_grad_norm(self.model.parameters(), self.grad_clip)  # stays on device
        applied: bool | torch.Tensor = True
        if gate is not None:
            applied = gate.judge(grad_norm)
            if not gate.on_device:
                applied = bool(applied)  # the step's one host read
            if applied is False:  # refused: nothing changes
                self.optimizer.zero_grad(set_to_none=True)
                return grad_norm, False
        if torch.is_tensor(applied):  # the update masked on the device: nothing read here
            self.optimizer.step_mask = applied
            try:
                self.optimizer.step()
            finally:
                self.optimizer.step_mask = None
        else:
            self.optimizer.step()
        if self._state_bytes is None:  # gradients are still present here
            self._state_bytes = model_state_bytes(self.model, self.optimizer)
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm, applied

    def rewind_steps(self, count: int) -> None:
        self.optimizer.rewind_steps(count)  # no counters of its own

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def barrier(self) -> None:
        """One process: there is no one to wait for."""

    def edq_segments(self, group_of: dict[torch.Tensor, str]) -> dict[torch.Tensor, list[Segment]]:
        return {param: [(group, 0, param.numel())] for param, group in group_of.items()}

    def local_weights(self) -> list[torch.Tensor]:
        return list(self.model.parameters())

    state_bytes_measure = "weights + gradients + optimizer state"

    def state_bytes(self) -> int:
        """Weights, gradients and optimizer state, measured at the first step."""
        return self._state_bytes or 0

    def expected_state_bytes_per_param(self, strategy: PrecisionStrategy) -> float:
        """The analytic counterpart of ``state_bytes`` per parameter."""
        return strategy.expected_state_bytes_per_param

    def peak_state_bytes_per_param(self, strategy: PrecisionStrategy) -> float:
        """Model-state bytes per parameter at the optimizer step (for the memory check)."""
        return strategy.expected_state_bytes_per_param

    def close(self) -> None:
        """One process: no process group to leave."""

    def state_files(
        self, directory: Path, client_state: dict[str, Any], *, staged: bool
    ) -> dict[str, Any]:
        """model.pt, optimizer.pt (its state by index, and ``param_names`` naming each
        index, so that other layouts can read it per parameter) and trainer.pt."""
        names = {param: name for name, param in self.model.named_parameters()}
        param_names = [names[p] for group in self.optimizer.param_groups for p in group["params"]]
        return {
            "model.pt": self.model.state_dict(),
            "optimizer.pt": {**self.optimizer.state_dict(), "param_names": param_names},
            "trainer.pt": client_state,
        }

    def load(self, directory: Path) -> dict[str, Any]:
        self.model.load_state_dict(checkpoint.load_checkpoint_file(directory, "model", self.device))
        self.optimizer.load_state_dict(checkpoint.load_checkpoint_file(directory, "optimizer"))
        return checkpoint.load_checkpoint_file(directory, "trainer")

    def load_full(self, state: FullState) -> dict[str, Any]:
        """Elastic resume: weights and optimizer state of each parameter from the
        rank-independent ``state``, bit for bit but for 8-bit blocks that the source cut
        elsewhere (``whole_tensor.compact``); returns the client state."""
        for name, param in self.model.named_parameters():
            components = whole_tensor.compact(state.read(name))  # blocks, scales: per tensor
            with torch.no_grad():
                param.copy_(components.pop("weight").view(param.shape))
            whole_tensor.set_weight_scale(param, components.pop("weight_scale", None))
            restored: dict[str, Any] = {"step": state.steps[name]}
            for key, value in components.items():
                per_element = key not in INDEX_COMPONENTS and key not in whole_tensor.LAYOUT_KEYS
                shaped = value.view(param.shape) if per_element else value
                restored[key] = shaped.to(self.device, copy=True)
            self.optimizer.state[param] = restored
        return state.trainer

    def full_weights(self) -> contextlib.AbstractContextManager[torch.nn.Module]:
        return unchanged(self.model)

    def run_files(self) -> dict[str, Any]:
        """No settings beyond the run's own config."""
        return {}

    def comm_metrics(self) -> dict[str, Any]:
        """One process exchanges nothing."""
        return {}
