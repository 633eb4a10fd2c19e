"""StochasticRoundingAdamW: AdamW on bf16 weights rounded stochastically, no master copy.

Weights, gradients and both moments are bf16 (8 bytes per parameter of model state).
The step is torchao 0.18's ``_AdamW(bf16_stochastic_round=True)``, operation for
operation, in fp32: decoupled weight decay, ``lerp`` moments stored round-to-nearest
bf16, the update computed from their fp32 values, then ``theta = SR(p)``: rounded away
from zero with probability (low 16 bits of p) / 2^16, so E[theta_new] = p. Bias
corrections come from the integer step in float64 on the host. The random bits are
``rounding_noise.random_bits(seed, stream, step, index)`` with ``state["stream"]`` fixed
when the state is created, so a resumed or chunked step draws the bits of an
uninterrupted, whole-tensor one. A drop-in for ``torch.optim.AdamW`` on bf16 parameters.

The step, its agreement with torchao and EDQ under SR: docs/strategies.md,
'Stochastic rounding (`bf16_sr`: `StochasticRoundingAdamW`)'.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from collage_train.optim import rounding_noise
from collage_train.optim.base import (
    TrackingOptimizer,
    bias_corrections,
    chunk_ranges,
    commit_,
)

# (numel, stream, step, offset, device) -> int64 tensor of 32-bit values, one per element
BitsSource = Callable[[int, int, int, int, torch.device], torch.Tensor]

# On CPU a step works on at most this many elements at a time whatever step_chunk_numel
# says: the hash's int64 temporaries then stay in cache (about 3x faster than 2^22 on a
# 2-core EPYC); the result is the same bits for any chunking.
CPU_PIECE_NUMEL = 1 << 17


def sr_adamw_piece(
    weight: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    grad: torch.Tensor,
    bits: torch.Tensor,
    scalars: tuple[float, ...],
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """One step of a (piece of a) tensor in place; returns the intended update, fp32.

    ``scalars`` = (lr, lr * wd, 1 - beta1, 1 - beta2, c1, sqrt(c2), eps) as ``step_scalars``
    makes them. The intended update is p - theta_old, the change SR realises in expectation.
    ``mask`` (``TrackingOptimizer.step_mask``) holding False: nothing changes, update zero.
    """
    lr, decay, one_minus_beta1, one_minus_beta2, bias1, sqrt_bias2, eps = scalars
    old = weight.float()
    grad32 = grad.float()
    target = old - decay * old
    m32 = exp_avg.float().lerp(grad32, one_minus_beta1)
    v32 = exp_avg_sq.float().lerp(grad32.square(), one_minus_beta2)
    commit_(exp_avg, m32, mask)
    commit_(exp_avg_sq, v32, mask)
    denom = v32.sqrt() / sqrt_bias2 + eps
    target = target - lr * (m32 / bias1) / denom
    del grad32, m32, v32, denom  # freed before the rounding's int64 temporaries
    commit_(weight, rounding_noise.stochastic_round_to_bf16(target, bits), mask)
    update = target - old
    return update if mask is None else torch.where(mask, update, 0.0)


def step_scalars(
    lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, step: int
) -> tuple[float, ...]:
    """The host scalars of ``sr_adamw_piece`` for integer ``step``, in float64."""
    bias1, sqrt_bias2 = bias_corrections(beta1, beta2, step)
    return (lr, lr * weight_decay, 1.0 - beta1, 1.0 - beta2, bias1, sqrt_bias2, eps)


class StochasticRoundingAdamW(TrackingOptimizer):
    """AdamW on bf16 parameters with bf16 moments, the weight rounded stochastically.

    ``seed`` with each tensor's ``state["stream"]`` and step count determines every random
    bit. ``bits_source``, when set, replaces ``rounding_noise.random_bits`` (a test hook:
    replaying another implementation's draws). The full-precision value of a weight is
    the bf16 weight itself (``TrackingOptimizer``'s default: read as fp32, loaded
    round-to-nearest): nothing is kept beside it.
    """

    bits_source: BitsSource | None = None
    masks_on_device = True  # ``step_mask``: each piece's new values written where it holds

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        seed: int = 0,
    ) -> None:
        super().__init__(params, lr, betas, eps, weight_decay)
        self._require_bf16_params("rounds its bf16 weights stochastically")
        self.seed = int(seed)
        self.streams = rounding_noise.StreamCounter()

    def _state_for(self, param: torch.Tensor) -> dict[str, Any]:
        state = self.state[param]
        if not state:
            state["step"] = 0
            state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        if "stream" not in state:
            # New, or restored by an elastic resume, which carries the moments and the step
            # but not the writer's streams: those named the tensors of its own layout.
            state["stream"] = self.streams.next()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore state; tensors created later get streams after every restored one."""
        super().load_state_dict(state_dict)
        self.streams.resume_after([s["stream"] for s in self.state.values() if "stream" in s])

    def _bits(self, numel: int, stream: int, step: int, offset: int, device: torch.device):
        if self.bits_source is not None:
            return self.bits_source(numel, stream, step, offset, device)
        return rounding_noise.random_bits(
            numel, seed=self.seed, stream=stream, step=step, offset=offset, device=device
        )

    def _step_group(self, group: dict[str, Any], params: list[torch.Tensor]) -> None:
        beta1, beta2 = group["betas"]
        for param in params:
            state = self._state_for(param)
            state["step"] += 1
            if param.numel() == 0:
                continue
            scalars = step_scalars(
                group["lr"], beta1, beta2, group["eps"], group["weight_decay"], state["step"]
            )
            self._step_tensor(param, state, scalars)

    def _step_tensor(
        self, param: torch.Tensor, state: dict[str, Any], scalars: tuple[float, ...]
    ) -> None:
        """One tensor's step in ``_pieces`` (on CPU at most ``CPU_PIECE_NUMEL`` elements at
        a time), the same bits as one pass (elementwise arithmetic, bits indexed by
        position in the tensor), its EDQ partials kept when descent is tracked."""
        chunk = self.step_chunk_numel
        if param.device.type == "cpu":
            chunk = min(chunk, CPU_PIECE_NUMEL)
        sums = self._edq_sums(param)
        tensors = [param.detach(), state["exp_avg"], state["exp_avg_sq"], param.grad]
        for start, piece in self._pieces(tensors, chunk_ranges(param.numel(), chunk)):
            weight = piece[0]
            bits = self._bits(weight.numel(), state["stream"], state["step"], start, param.device)
            before = weight.reshape(-1).clone() if sums is not None else None
            update = sr_adamw_piece(*piece, bits, scalars, self.step_mask)
            if sums is not None:
                sums.add(start, before, weight.reshape(-1), update.reshape(-1))
        self._keep_edq(param, sums)
