"""CollageAdamW: AdamW whose state is all bf16, compensated with multi-component floats.

Collage (Yu et al., ICML 2024) keeps no fp32 copy of anything. Mode "none" adds the bf16
update u (weight decay included) to the bf16 weight theta; "light" grows the pair
(theta, dtheta) by u, keeping the update's lost bits; "plus" also keeps the second
moment as a pair (v, dv), so beta2 = 0.999's decay is not rounded away. The model always
computes with theta. Bias corrections come from an integer step count, in float64 on the
host. The arithmetic is ``step_math.collage_tensor_step``; ``kernel="compiled"`` runs it
as one fused kernel per tensor (C on CPU, Triton on CUDA), bitwise identical to
``kernel="eager"``, and ``"auto"`` decides at the first step as the trainer's
``optim.kernel=auto`` does (``kernels.choose_kernel``). A drop-in for
``torch.optim.AdamW`` on bf16 parameters.

The step per element and its constants: docs/strategies.md, "The CollageAdamW step".
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from collage_train.optim.base import TrackingOptimizer, chunk_numel_for

__all__ = ["CollageAdamW", "chunk_numel_for"]
from collage_train.optim.collage.kernels import choose_kernel, fused_tensor_step, min_fused_numel
from collage_train.optim.collage.step_math import StepScalars, collage_tensor_step

MODES = ("none", "light", "plus")
KERNELS = ("auto", "eager", "compiled")


class CollageAdamW(TrackingOptimizer):
    """AdamW on bf16 parameters with bf16 state; ``mode`` is "none", "light" or "plus".

    ``step_chunk_numel`` (``TrackingOptimizer``) bounds what one step allocates beyond
    the state: tensors are stepped that many elements at a time (``_step_in_chunks``).
    """

    low_part = "dtheta"  # modes light and plus: the weight is theta + dtheta
    masks_on_device = True  # eager, C and Triton steps all honour ``step_mask``

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        mode: str = "plus",
        kernel: str = "auto",
    ) -> None:
        mode, kernel = str(mode), str(kernel)
        if mode not in MODES:
            raise ValueError(f"CollageAdamW mode must be one of {', '.join(MODES)}, got {mode!r}")
        if kernel not in KERNELS:
            raise ValueError(f"CollageAdamW kernel must be auto, eager or compiled, got {kernel!r}")
        super().__init__(params, lr, betas, eps, weight_decay)
        self.mode = mode
        self.kernel = kernel
        self._require_bf16_params("keeps bf16 state")

    def _state_for(self, param: torch.Tensor) -> dict[str, Any]:
        state = self.state[param]
        if not state:
            state["step"] = 0
            state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            if self.mode in ("light", "plus"):
                state["dtheta"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            if self.mode == "plus":
                state["dv"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        return state

    def _runs_fused(self, tensors: list[torch.Tensor | None]) -> bool:
        """Whether this tensor's step runs as the fused kernel (Triton on CUDA, inductor on CPU)."""
        return (
            self.kernel == "compiled"
            and tensors[0].numel() >= min_fused_numel(tensors[0].device.type)
            and all(t is None or t.is_contiguous() for t in tensors)
        )

    def _resolve_kernel(self) -> None:
        """``kernel="auto"`` becomes eager or compiled, once, where the parameters now are."""
        if self.kernel != "auto":
            return
        params = self.ordered_params()
        device = params[0].device if params else torch.device("cpu")
        self.kernel = choose_kernel("auto", device, sum(p.numel() for p in params), self.mode)

    def _step_group(self, group: dict[str, Any], params: list[torch.Tensor]) -> None:
        self._resolve_kernel()
        for param in params:
            state = self._state_for(param)
            state["step"] += 1  # an integer: the bias corrections are exact in float64
            if param.numel() == 0:
                continue
            tensors = [
                param.detach(),
                state.get("dtheta"),
                state["exp_avg"],
                state["exp_avg_sq"],
                state.get("dv"),
                param.grad,
            ]
            self._step_tensor(param, tensors, StepScalars.of(group, state["step"]))

    def _step_tensor(
        self, param: torch.Tensor, tensors: list[torch.Tensor | None], scalars: StepScalars
    ) -> None:
        """One tensor's step in ``_pieces``, its EDQ partials kept when tracked.

        The eager step's fp32 temporaries, and under EDQ tracking of a flat partition
        (``edq_segments``) the copy of the weights before the step and the intended
        update, exist for one chunk at a time; otherwise the step sums the partials itself.
        """
        sums = self._edq_sums(param)
        segmented = sums is not None and sums.segmented
        for start, piece in self._pieces(tensors):
            if not segmented:
                partials = self._step_piece(piece, scalars, track=sums is not None)
                if sums is not None:
                    sums.add_partials(partials)
                continue
            before = piece[0].reshape(-1).clone()  # sums per layer-group range, flattened
            update = self._step_piece(piece, scalars, track=True, return_update=True)
            low = piece[1].reshape(-1) if piece[1] is not None else None
            sums.add(start, before, piece[0].reshape(-1), update.reshape(-1), low)
        self._keep_edq(param, sums)

    def _step_piece(
        self,
        tensors: list[torch.Tensor | None],
        scalars: StepScalars,
        *,
        track: bool,
        return_update: bool = False,
    ) -> torch.Tensor | None:
        """The fused kernel where it runs (contiguous pieces), else the eager step."""
        flags = {"track": track, "return_update": return_update, "mask": self.step_mask}
        if self._runs_fused(tensors):
            step = fused_tensor_step(self.mode, tensors[0].device.type)
            return step(*tensors, scalars, **flags)
        return collage_tensor_step(*tensors, scalars, mode=self.mode, **flags)
