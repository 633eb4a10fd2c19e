"""Collage8bitAdamW: Collage-light's compensated bf16 weight with 8-bit blockwise moments.

The weight is Collage's multi-component float (theta, dtheta) in bf16, updated exactly as
``CollageAdamW(mode="light")`` does it; the moments are 8-bit blockwise
(``optim.blockwise8``): m with the signed map rounded to nearest, v with the unsigned map
rounded stochastically (so beta2 = 0.999's decay survives in expectation) and never to 0
for a positive v. The random bits are ``rounding_noise.random_bits`` of (seed, the
tensor's stream, step, index): resumed and chunked steps draw an uninterrupted, whole
step's bits. ``kernel="compiled"`` runs one fused pass per tensor (C on CPU, Triton on
CUDA), bitwise equal to ``kernel="eager"``; ``"auto"`` decides at the first step as
``optim.kernel=auto`` does (``kernels.choose_kernel``). State per parameter: ``step``,
``stream``, bf16 ``dtheta``, uint8 moments and their fp32 absmax per block of 256.

The step, why v is rounded stochastically, the kernels: docs/strategies.md,
'The collage_8bit step and its state (Collage8bitAdamW)'.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from collage_train.metrics.edq import partials_close
from collage_train.optim import rounding_noise
from collage_train.optim.base import (
    STEP_BYTES_PER_ELEMENT,
    TrackingOptimizer,
    flat_view,
    write_back,
)
from collage_train.optim.blockwise8 import BLOCK_SIZE, QuantizedMoment
from collage_train.optim.blockwise_adamw import MOMENTS, block_chunks
from collage_train.optim.collage import eight_bit_kernel, mcf
from collage_train.optim.collage.kernels import (
    EIGHT_BIT_MODE,
    EIGHT_BIT_PROBE_NUMEL,
    PROBE_STEPS,
    choose_kernel,
    register_parity_probe,
)
from collage_train.optim.collage.step_math import StepScalars

# Bytes of temporaries per element of a chunk during the eager step (measured: the peak
# RSS of one step over a single 4M-element chunk); the int64 hash of the rounding bits
# is most of the excess over STEP_BYTES_PER_ELEMENT
STEP_TRANSIENT_BYTES = 76
KERNELS = ("auto", "eager", "compiled")


def sqrt_rn(values: torch.Tensor) -> torch.Tensor:
    """The correctly rounded fp32 square root of fp32 ``values``, on every device.

    torch's CPU fp32 ``sqrt`` is not correctly rounded on every host (torch 2.13 on a
    Zen 4 EPYC: 1 ulp off for 17 % of random fp32 inputs, ``pow(0.5)`` alike), while
    the fused kernel's ``sqrtf`` is; the float64 root rounded to fp32 is correctly
    rounded (double rounding is innocuous for sqrt with 53 >= 2 * 24 + 2 bits: Figueroa,
    "When is double rounding innocuous?", SIGNUM Newsletter 1995, even from a float64
    root 1 ulp off), so the eager and the fused step agree bit for bit.
    """
    return values.double().sqrt_().float()


class Collage8bitAdamW(TrackingOptimizer):
    """AdamW on bf16 parameters: Collage-light weight, 8-bit blockwise moments.

    The eager step works in chunks of whole blocks, the same bits as a whole step; a
    chunk holds ``step_chunk_numel`` scaled by ``STEP_BYTES_PER_ELEMENT /
    STEP_TRANSIENT_BYTES``, so that its temporaries fit the budget the trainer sized
    ``step_chunk_numel`` for. The fused kernels step a whole tensor at once: they
    allocate nothing the size of it.
    """

    unshaped_state = ("step", "exp_avg_absmax", "exp_avg_sq_absmax")
    low_part = "dtheta"
    masks_on_device = True  # eager, C and Triton steps all honour ``step_mask``

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        block_size: int = BLOCK_SIZE,
        seed: int = 0,
        kernel: str = "auto",
    ) -> None:
        if int(block_size) < 1:
            raise ValueError(f"block_size must be a positive integer, got {block_size}")
        if str(kernel) not in KERNELS:
            raise ValueError(
                f"Collage8bitAdamW kernel must be auto, eager or compiled, got {kernel!r}"
            )
        super().__init__(params, lr, betas, eps, weight_decay)
        self.kernel = str(kernel)
        self._require_bf16_params("keeps the weight as a bf16 (theta, dtheta) pair")
        self.block_size = int(block_size)
        self.seed = int(seed)
        self.streams = rounding_noise.StreamCounter()

    def _state_for(self, param: torch.Tensor) -> dict[str, Any]:
        state = self.state[param]
        if not state:
            state["step"] = 0
            state["dtheta"] = torch.zeros(param.shape, dtype=torch.bfloat16, device=param.device)
            for name, _ in MOMENTS:
                state.update(QuantizedMoment.new_state(name, param, self.block_size))
        if "stream" not in state:
            # New, or restored by an elastic resume, which carries the moments and the step
            # but not the writer's streams: those named the tensors of its own layout.
            state["stream"] = self.streams.next()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the state; states created later get streams after the restored ones."""
        super().load_state_dict(state_dict)
        self.streams.resume_after([s["stream"] for s in self.state.values() if "stream" in s])

    def _chunks(self, numel: int) -> list[tuple[int, int]]:
        chunk = self.step_chunk_numel * STEP_BYTES_PER_ELEMENT // STEP_TRANSIENT_BYTES
        return block_chunks(numel, chunk, self.block_size)

    def _resolve_kernel(self) -> None:
        """``kernel="auto"`` becomes eager or compiled, once, where the parameters now are."""
        if self.kernel != "auto":
            return
        params = self.ordered_params()
        device = params[0].device if params else torch.device("cpu")
        numel = sum(p.numel() for p in params)
        self.kernel = choose_kernel("auto", device, numel, EIGHT_BIT_MODE)

    def _fused_kind(self, param: torch.Tensor) -> str | None:
        """Which fused kernel steps this parameter now: ``cpu`` (the C kernel), ``cuda``
        (the Triton kernel: power-of-two blocks, EDQ of a flat partition eagerly), or None
        (the eager step)."""
        if (
            self.kernel != "compiled"
            or param.grad.dtype != torch.bfloat16
            or self.edq_view_dtype not in (None, torch.bfloat16)
        ):
            return None
        device = param.device.type
        if device == "cpu" and self.block_size <= eight_bit_kernel.MAX_BLOCK:
            return "cpu"
        power_of_two = self.block_size & (self.block_size - 1) == 0
        segmented = self.track_edq and param in self.edq_segments
        if device == "cuda" and power_of_two and not segmented:
            return "cuda"
        return None

    def _step_group(self, group: dict[str, Any], params: list[torch.Tensor]) -> None:
        self._resolve_kernel()
        for param in params:
            self._step_param(group, param)

    def _step_param(self, group: dict[str, Any], param: torch.Tensor) -> None:
        state = self._state_for(param)
        state["step"] += 1
        step = state["step"]
        s = StepScalars.of(group, step)  # the host numbers, shared with the fused kernels
        pending: list[tuple[torch.Tensor, torch.Tensor]] = []
        theta = flat_view(param.detach(), pending)
        dtheta = state["dtheta"].view(-1)
        grad = param.grad.reshape(-1)
        fused = self._fused_kind(param)
        if fused is not None:
            moments = (state["exp_avg"].view(-1), state["exp_avg_absmax"])
            moments += (state["exp_avg_sq"].view(-1), state["exp_avg_sq_absmax"])
            keys = {"block_size": self.block_size, "seed": self.seed, "stream": state["stream"]}
            segments = self.edq_segments.get(param)
            if fused == "cpu":
                bounds = [(first, last) for _, first, last in segments or [("", 0, theta.numel())]]
                tensors = eight_bit_kernel.EightBitState(theta, dtheta, *moments, grad.contiguous())
                sums = eight_bit_kernel.eight_bit_step(
                    tensors,
                    s,
                    step=step,
                    segments=bounds if self.track_edq else None,
                    mask=self.step_mask,
                    **keys,
                )
                if sums is not None and segments is None:
                    sums = sums[0]
            else:
                from collage_train.optim.collage.eight_bit_triton import triton_eight_bit_step

                sums = triton_eight_bit_step(
                    theta,
                    dtheta,
                    grad.contiguous(),
                    *moments,
                    s,
                    step=step,
                    track=self.track_edq,
                    mask=self.step_mask,
                    **keys,
                )
            write_back(pending)
            if sums is not None:
                self.last_edq[param] = sums
            return
        m_state, v_state = (QuantizedMoment.of(state, *spec, self.block_size) for spec in MOMENTS)
        edq = self._edq_sums(param)
        mask = self.step_mask
        for start, stop in self._chunks(theta.numel()):
            g = grad[start:stop].float()
            m = m_state.load(start, stop)
            m = m + s.one_minus_beta1 * (g - m)
            v = v_state.load(start, stop) * s.beta2 + s.one_minus_beta2 * (g * g)
            denom = sqrt_rn(v) * s.inv_sqrt_bias2 + s.eps
            old_theta, old_dtheta = theta[start:stop], dtheta[start:stop]
            update = ((m / denom) * s.step_size + s.decay * old_theta.float()).to(torch.bfloat16)
            new_theta, new_dtheta = mcf.grow(old_theta, old_dtheta, update)
            m_state.store(start, stop, m, mask=mask)
            bits = rounding_noise.random_bits(
                stop - start,
                seed=self.seed,
                stream=state["stream"],
                step=step,
                offset=start,
                device=theta.device,
            )
            noise = rounding_noise.uniform(bits)
            v_state.store(start, stop, v, noise, keep_nonzero=True, mask=mask)
            if mask is not None:  # a False one: unchanged, and zero partials
                new_theta = torch.where(mask, new_theta, old_theta)
                new_dtheta = torch.where(mask, new_dtheta, old_dtheta)
                update = torch.where(mask, update, 0.0)
            if edq is not None:
                low = new_dtheta if mask is None else torch.where(mask, new_dtheta, 0.0)
                edq.add(start, old_theta, new_theta, update, low)
            old_dtheta.copy_(new_dtheta)
            old_theta.copy_(new_theta)
        write_back(pending)
        self._keep_edq(param, edq)


def eight_bit_matches_eager(device_type: str) -> bool:
    """``kernels.compiled_matches_eager`` for ``Collage8bitAdamW``: the fused and the eager step
    of the same state, a partial last block and a block of zero gradients included,
    with and without EDQ sums; weights, dtheta, codes and absmax compared bitwise."""
    gen = torch.Generator().manual_seed(0)
    numel = EIGHT_BIT_PROBE_NUMEL
    start = (torch.randn(numel, generator=gen) * 0.05).to(device_type, torch.bfloat16)
    grads = []
    for _ in range(PROBE_STEPS):  # magnitudes over six decades: v below the smallest code
        scale = 10.0 ** torch.randint(-6, 1, (numel,), generator=gen).float()
        grads.append(torch.randn(numel, generator=gen) * scale)
        grads[-1][256:512] = 0.0
    params = [torch.nn.Parameter(start.clone()) for _ in range(2)]
    optimizers = [
        Collage8bitAdamW([p], lr=3e-3, weight_decay=0.1, seed=7, kernel=kernel)
        for p, kernel in zip(params, ("eager", "compiled"), strict=True)
    ]
    for t, grad in enumerate(grads, start=1):
        sums = []
        for param, optimizer in zip(params, optimizers, strict=True):
            param.grad = grad.to(device_type, torch.bfloat16)
            optimizer.track_edq = t % 2 == 0
            optimizer.step()
            sums.append(optimizer.last_edq.get(param))
        if t % 2 == 0 and not partials_close(sums[0], sums[1]):
            return False
    states = [optimizer.state[param] for param, optimizer in zip(params, optimizers, strict=True)]
    pairs = [(params[0].detach(), params[1].detach())]
    pairs += [
        (value, states[1][name]) for name, value in states[0].items() if torch.is_tensor(value)
    ]
    return all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in pairs)


register_parity_probe(EIGHT_BIT_MODE, eight_bit_matches_eager)
