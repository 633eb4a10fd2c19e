"""An fp32 master weight stored as its bf16 rounding (the model's weight) plus a remainder.

The model computes with ``hi = bf16(x)`` (round to nearest even, exactly what copying an
fp32 master into a bf16 weight does). The rest of ``x`` is the 32-bit pattern difference
``d = bits(x) - bits(hi) << 16``, which lies in [-2^15, 2^15]: 2^16 + 1 values, one more
than an int16 holds. Both ends occur only at exact ties (the low half of ``x`` is
0x8000), and they are told apart by listing, per tensor, the flat indices where
``d = +2^15`` (stored as -2^15 in the int16). Ties are rare (about 2^-17 of the
elements at any time), so the list is tiny, and ``join(split(x)) == x`` bitwise for
every finite fp32 ``x``.
"""

from __future__ import annotations

import torch

_HALF = 1 << 15


def split(master: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 ``master`` -> (bf16 weight, int16 remainder, int64 flat indices of +2^15 ties)."""
    high = master.to(torch.bfloat16)
    diff = master.view(torch.int32) - (high.view(torch.int16).to(torch.int32) << 16)
    ties = torch.nonzero(diff.flatten() == _HALF).flatten()
    return high, diff.to(torch.int16), ties


def join(high: torch.Tensor, remainder: torch.Tensor, ties: torch.Tensor) -> torch.Tensor:
    """The fp32 master that ``split`` took apart."""
    bits = (high.view(torch.int16).to(torch.int32) << 16) + remainder.to(torch.int32)
    if ties.numel():
        bits.view(-1)[ties] += 2 * _HALF
    return bits.view(torch.float32)
