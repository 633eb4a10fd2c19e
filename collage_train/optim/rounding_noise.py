"""Random bits for stochastic rounding, as a pure function of where and when they are used.

Stochastic rounding (SR) needs one random number per element per step. Here it is a
hash of (seed, stream, step, element index), not a draw from a generator whose state
moves (counter-based, in the manner of Philox), so a run resumed from a checkpoint, a
tensor stepped a chunk at a time (the index is ``offset`` + the position in the chunk)
and a fused CPU or GPU kernel all draw the very same bits as an uninterrupted,
whole-tensor eager step. The hash is ``lowbias32`` applied twice with keys derived from
seed, stream and step on the host; element indices are taken modulo 2^32.

Reasoning and references: docs/strategies.md, "Counter-based random bits".
"""

from __future__ import annotations

import torch

MASK32 = 0xFFFFFFFF
_MUL_A, _MUL_B = 0x7FEB352D, 0x846CA68B


def mix32(x: int) -> int:
    """``lowbias32`` of a Python integer (its low 32 bits)."""
    x &= MASK32
    x ^= x >> 16
    x = (x * _MUL_A) & MASK32
    x ^= x >> 15
    x = (x * _MUL_B) & MASK32
    x ^= x >> 16
    return x


def _mix32_tensor(x: torch.Tensor) -> torch.Tensor:
    """``lowbias32`` elementwise on int64 tensors holding 32-bit values (products wrap
    modulo 2^64 and are masked back to 32 bits, so every device computes the same bits)."""
    x = x ^ (x >> 16)
    x = (x * _MUL_A) & MASK32
    x = x ^ (x >> 15)
    x = (x * _MUL_B) & MASK32
    return x ^ (x >> 16)


def stream_keys(seed: int, stream: int, step: int) -> tuple[int, int]:
    """The two 32-bit keys of (seed, stream, step), mixed on the host."""
    first = mix32(mix32(mix32(seed) ^ stream) ^ step)
    return first, mix32(first ^ 0x9E3779B9)


def random_bits(
    numel: int,
    *,
    seed: int,
    stream: int,
    step: int,
    offset: int = 0,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """32 random bits (as int64 values in [0, 2^32)) for elements ``offset`` ..
    ``offset + numel - 1`` of ``stream`` at ``step``: ``mix32(mix32(i ^ k1) ^ k2)``."""
    first, second = stream_keys(seed, stream, step)
    index = torch.arange(offset, offset + numel, dtype=torch.int64, device=device) & MASK32
    return _mix32_tensor(_mix32_tensor(index ^ first) ^ second)


def stochastic_round_to_bf16(x: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """fp32 ``x`` rounded to bf16 away from zero with probability (low 16 bits of x) /
    2^16, using the top 16 of the 32 random ``bits`` (torchao's rule for
    ``bf16_stochastic_round``). Values already representable in bf16 stay exact;
    infinities and NaNs pass through as round-to-nearest gives them."""
    raw = x.float().contiguous().view(torch.int32).to(torch.int64) & MASK32
    fraction = raw & 0xFFFF
    toward_zero = raw & 0xFFFF0000
    rounded = torch.where((bits.view(x.shape) >> 16) < fraction, toward_zero + 0x10000, toward_zero)
    signed = torch.where(rounded >= 1 << 31, rounded - (1 << 32), rounded).to(torch.int32)
    result = signed.view(torch.float32).to(torch.bfloat16)
    return torch.where(torch.isfinite(x), result, x.to(torch.bfloat16))


def uniform(bits: torch.Tensor) -> torch.Tensor:
    """fp32 uniforms in [0, 1) from the top 24 of 32 random bits (exact in fp32)."""
    return (bits >> 8).to(torch.float32) * (1.0 / (1 << 24))


STREAM_RANK_SHIFT = 20  # stream = (rank << 20) + the tensor's creation counter on that rank


class StreamCounter:
    """Hands each tensor state an optimizer creates its stream: (rank << 20) + the number
    of states this rank created before it, fixed in the state (so a resumed run keeps it;
    ``resume_after`` makes states created after a restore follow the restored ones)."""

    def __init__(self) -> None:
        self.created = 0

    def next(self) -> int:
        dist = torch.distributed
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        stream = (rank << STREAM_RANK_SHIFT) + self.created
        self.created += 1
        return stream

    def resume_after(self, streams: list[int]) -> None:
        """Continue counting after the restored ``streams``."""
        counts = [stream & ((1 << STREAM_RANK_SHIFT) - 1) for stream in streams]
        self.created = max(counts, default=-1) + 1
