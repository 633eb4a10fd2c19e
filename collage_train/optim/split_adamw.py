"""SplitMasterAdamW: fp32-master AdamW whose master costs 2 bytes beyond the bf16 weight.

The fp32 master weight is never stored whole: its bf16 rounding *is* the model's weight
and the optimizer keeps only the 16-bit remainder (``optim.remainder``). Each step
joins weight and remainder into the exact fp32 master, runs the very AdamW update of
``AdamW(master_dtype=torch.float32)`` (fp32 moments, same kernels, same order), rounds
the result into the weight and splits off the new remainder. The trajectory is
therefore bit for bit that of the fp32-master baseline (``mixed_fp32``) while the
state is 14 bytes per parameter instead of 16 (weight 2, gradient 2, remainder 2,
m 4, v 4).
"""

from __future__ import annotations

from typing import Any

import torch

from collage_train.optim import remainder
from collage_train.optim.adamw import AdamW


class SplitMasterAdamW(AdamW):
    """AdamW on bf16 parameters with an exact fp32 master held as a 16-bit remainder."""

    unshaped_state = ("step", "remainder_ties")
    # The masters are rebuilt whole from weight and remainder (``_masters``) and split
    # again after the update, so a tracked step snapshots whole tensors as well.
    tracks_in_chunks = False
    masters_rebuilt = True
    # Under a ``step_mask`` the rebuilt masters are stepped a chunk at a time, written where
    # it holds, and split again: a refused step's masters split into the same weight,
    # remainder and ties (``remainder``: join and split are exact inverses).
    masks_on_device = True

    def __init__(self, params: Any, **hyperparameters: Any) -> None:
        super().__init__(params, master_dtype=torch.float32, **hyperparameters)
        self._require_bf16_params("splits an fp32 master around a bf16 weight")

    def _state_for(self, param: torch.Tensor) -> dict[str, Any]:
        state = self.state[param]
        if not state:
            state["step"] = 0
            state["exp_avg"] = torch.zeros_like(param, dtype=torch.float32)
            state["exp_avg_sq"] = torch.zeros_like(param, dtype=torch.float32)
            state["remainder"] = torch.zeros_like(param, dtype=torch.int16)
            state["remainder_ties"] = torch.zeros(0, dtype=torch.int64, device=param.device)
        return state

    def _full_precision(self, param: torch.Tensor) -> torch.Tensor:
        """The exact fp32 master joined from weight and remainder."""
        state = self.state[param]
        if not state:
            return param.detach().to(torch.float32, copy=True)
        return remainder.join(param.detach(), state["remainder"], state["remainder_ties"])

    def _load_full_precision(self, param: torch.Tensor, value: torch.Tensor) -> None:
        """Split ``value`` exactly into weight (its bf16 rounding) and remainder."""
        state = self._state_for(param)
        high, low, ties = remainder.split(value)
        param.detach().copy_(high)
        state["remainder"].copy_(low)
        state["remainder_ties"] = ties

    def _masters(self, params: list[torch.Tensor], states: list[dict[str, Any]]) -> list:
        return [
            remainder.join(p.detach(), s["remainder"], s["remainder_ties"])
            for p, s in zip(params, states, strict=True)
        ]

    def _store_masters(
        self, params: list[torch.Tensor], states: list[dict[str, Any]], masters: list
    ) -> None:
        for param, state, master in zip(params, states, masters, strict=True):
            high, low, ties = remainder.split(master)
            param.detach().copy_(high)
            state["remainder"].copy_(low)
            state["remainder_ties"] = ties
