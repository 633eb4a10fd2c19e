"""BlockwiseAdamW: AdamW with 8-bit blockwise moments, the update of bitsandbytes' AdamW8bit.

m is stored with the signed dynamic map, v with the unsigned one, in blocks of
``block_size`` elements of the flattened parameter under an fp32 absmax per block, both
rounded to nearest (``optim.blockwise8``). A step dequantises a range of whole blocks to
fp32, runs bitsandbytes 0.50.2's ``AdamW8bit`` arithmetic (CPU, op for op) with the bias
corrections from the integer step in float64 on the host, and quantises m and v back;
the parameter update uses the moments before quantisation. ``master_dtype=torch.float32``
on bf16 parameters keeps an fp32 master (the ``adamw_8bit`` strategy); under ZeRO the
fp32 flat partitions are their own masters and blocks may straddle model tensors. Unlike
bitsandbytes, small tensors are quantised too. ``keep_nonzero_v=True`` never stores a
positive v as 0 (``Collage8bitAdamW``'s rule); the default is bitsandbytes' bit for bit.

The step, its bytes and why a zero v matters: docs/strategies.md,
'The adamw_8bit step (BlockwiseAdamW)'.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from collage_train.optim.adamw import (
    AdamW,
    adamw_denominators,
    adamw_directions,
    second_moments_,
)
from collage_train.optim.base import bias_corrections, chunk_ranges, commit_, flat_view, write_back
from collage_train.optim.blockwise8 import BLOCK_SIZE, QuantizedMoment

MOMENTS = (("exp_avg", True), ("exp_avg_sq", False))  # (state name, signed map)


def block_chunks(numel: int, chunk_numel: int, block_size: int) -> list[tuple[int, int]]:
    """``[start, stop)`` ranges covering ``numel`` elements, each at most ``chunk_numel``
    elements rounded down to whole blocks (one block at least)."""
    return chunk_ranges(numel, max(block_size, chunk_numel // block_size * block_size))


class BlockwiseAdamW(AdamW):
    """AdamW whose ``exp_avg`` / ``exp_avg_sq`` are 8-bit codes with an absmax per block.

    State per parameter: ``step``; ``exp_avg``, ``exp_avg_sq`` (uint8, the parameter's
    shape); ``exp_avg_absmax``, ``exp_avg_sq_absmax`` (fp32, one per block); ``master``
    (fp32) when one is kept. Steps ``step_chunk_numel`` elements at a time, rounded down
    to whole blocks, so that chunked and whole steps are the same bits.
    """

    unshaped_state = ("step", "exp_avg_absmax", "exp_avg_sq_absmax")
    masks_on_device = True  # ``step_mask``: each chunk's new values written where it holds

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        master_dtype: torch.dtype | None = None,
        block_size: int = BLOCK_SIZE,
        keep_nonzero_v: bool = False,
    ) -> None:
        if master_dtype not in (None, torch.float32):
            raise ValueError(f"BlockwiseAdamW keeps an fp32 master or none, got {master_dtype}")
        if int(block_size) < 1:
            raise ValueError(f"block_size must be a positive integer, got {block_size}")
        super().__init__(params, lr, betas, eps, weight_decay, master_dtype)
        self.block_size = int(block_size)
        self.keep_nonzero_v = bool(keep_nonzero_v)

    def _state_for(self, param: torch.Tensor) -> dict[str, Any]:
        state = self.state[param]
        if not state:
            state["step"] = 0
            if self._keeps_master(param):
                state["master"] = torch.empty(
                    param.shape, dtype=self.master_dtype, device=param.device
                ).copy_(param.detach())
            for name, _ in MOMENTS:
                state.update(QuantizedMoment.new_state(name, param, self.block_size))
        return state

    def _chunks(self, numel: int) -> list[tuple[int, int]]:
        return block_chunks(numel, self.step_chunk_numel, self.block_size)

    def _step_group(self, group: dict[str, Any], params: list[torch.Tensor]) -> None:
        for param in params:
            self._step_param(group, param)

    def _step_param(self, group: dict[str, Any], param: torch.Tensor) -> None:
        state = self._state_for(param)
        state["step"] += 1
        beta1, beta2 = group["betas"]
        lr, weight_decay, eps = group["lr"], group["weight_decay"], group["eps"]
        bias1, sqrt_bias2 = bias_corrections(beta1, beta2, state["step"])
        step_size = -lr / bias1
        pending: list[tuple[torch.Tensor, torch.Tensor]] = []
        weight = flat_view(param.detach(), pending)
        master = state["master"].view(-1) if "master" in state else None
        grad = param.grad.reshape(-1)
        m_state, v_state = (QuantizedMoment.of(state, *spec, self.block_size) for spec in MOMENTS)
        edq = self._edq_sums(param)
        mask = self.step_mask  # a False one: every chunk computed, nothing written
        for start, stop in self._chunks(weight.numel()):
            g = grad[start:stop].float()
            m, v = m_state.load(start, stop), v_state.load(start, stop)
            m.mul_(beta1).add_(g, alpha=1.0 - beta1)  # bitsandbytes' m, not AdamW's lerp
            second_moments_([v], [g], beta2)
            denom = adamw_denominators([v], [sqrt_bias2], eps)[0]
            target = (master if master is not None else weight)[start:stop]
            in_place = target.dtype == torch.float32 and mask is None
            p = target if in_place else target.to(torch.float32, copy=True)
            if edq is not None:
                before = weight[start:stop].clone()
                update = adamw_directions([m], [denom], [step_size])[0]
                if weight_decay > 0.0:
                    update += p * (-lr * weight_decay)
                if mask is not None:
                    update = torch.where(mask, update, 0.0)
            if weight_decay > 0.0:
                p.mul_(1.0 - lr * weight_decay)
            p.addcdiv_(m, denom, value=step_size)
            if p is not target:
                commit_(target, p, mask)
            if master is not None:
                commit_(weight[start:stop], p, mask)
            m_state.store(start, stop, m, mask=mask)
            v_state.store(start, stop, v, keep_nonzero=self.keep_nonzero_v, mask=mask)
            if edq is not None:
                edq.add(start, before, weight[start:stop], update)
        write_back(pending)
        self._keep_edq(param, edq)
