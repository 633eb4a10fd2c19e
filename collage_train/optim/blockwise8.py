"""8-bit blockwise quantisation of optimizer moments (Dettmers et al., "8-bit Optimizers via
Block-wise Quantization", ICLR 2022, arXiv 2110.02861).

A tensor is cut into blocks of ``block_size`` consecutive elements of its flattened
(row-major) order; the last block may be shorter. Each block stores its absolute
maximum ``absmax`` in fp32 and each element one byte: the index of a value of a fixed
256-entry *dynamic map* in [-1, 1] (bitsandbytes 0.50.2's, ``signed=True`` for the
first moment, ``signed=False`` for the second). The element stands for
``code[index] * absmax``. ``quantize`` computes ``clamp(value * (1 / absmax), -1, 1)`` in
fp32 and rounds it to the nearest value (ties to the lower; bitsandbytes' default
backend, bit for bit) or, given ``noise``, stochastically between its two neighbouring
values (one ``rounding_noise.uniform`` number per element), so that the stored value is
exact in expectation. A block of zeros quantises to the index of 0 and back to zeros.

The maps, the error bounds and why v needs SR: docs/strategies.md, "The format".
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from collage_train.optim.base import commit_

BLOCK_SIZE = 256
_EXPONENT_BITS = 7  # decades of the map; bitsandbytes' default (8 bits in all)


@functools.cache
def _map_values(signed: bool) -> tuple[float, ...]:
    """The 256 sorted values of the dynamic map (Python floats holding fp32 values)."""
    values: list[float] = [0.0, 1.0]
    for decade in range(_EXPONENT_BITS):
        # bitsandbytes: 2^decade splits per decade when signed (each value also negated),
        # 2^(decade + 1) unsigned; every map has exactly 256 values
        splits = 2**decade if signed else 2 ** (decade + 1)
        edges = torch.linspace(0.1, 1, splits + 1, dtype=torch.float32)
        centres = (edges[:-1] + edges[1:]) / 2.0
        scaled = (10 ** (decade - (_EXPONENT_BITS - 1)) * centres).tolist()
        values += scaled
        if signed:
            values += (-(10 ** (decade - (_EXPONENT_BITS - 1))) * centres).tolist()
    if len(values) != 256:
        raise AssertionError(f"dynamic map has {len(values)} values, expected 256")
    return tuple(sorted(values))


@functools.cache
def dynamic_map(signed: bool, device: torch.device | str = "cpu") -> torch.Tensor:
    """The 256 sorted fp32 values of bitsandbytes' dynamic map (signed: first moment;
    unsigned: second moment), on ``device``. Cached: treat it as read-only."""
    return torch.tensor(_map_values(signed), dtype=torch.float32, device=device)


@functools.cache
def _midpoints(signed: bool, device: torch.device | str) -> torch.Tensor:
    code = dynamic_map(signed, device)
    return (code[:-1] + code[1:]) / 2


def num_blocks(numel: int, block_size: int = BLOCK_SIZE) -> int:
    """Blocks of ``block_size`` covering ``numel`` elements (the last may be shorter)."""
    return -(-numel // block_size)


def _scaled(values: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each element over its block's absmax, clamped to [-1, 1], and the absmax per block.

    Whole blocks multiply by the fp32 reciprocal of their absmax, a final partial block
    divides by its absmax, which is kept at 1e-38 or more (a whole block of zeros keeps
    absmax 0 and scales by the reciprocal of 1e-38): bitsandbytes' default backend exactly.
    """
    flat = values.reshape(-1).float()
    numel = flat.numel()
    full = numel - numel % block_size
    head = flat[:full].view(-1, block_size)
    absmax = head.abs().amax(dim=1) if full else flat.new_zeros(0)
    scaled = torch.clamp(head * (1.0 / absmax.clamp(min=1e-38).view(-1, 1)), -1, 1).view(-1)
    if full < numel:
        tail = flat[full:]
        tail_max = tail.abs().max().clamp(min=1e-38)
        absmax = torch.cat([absmax, tail_max.view(1)])
        scaled = torch.cat([scaled, torch.clamp(tail / tail_max, -1, 1)])
    return scaled, absmax


def quantize(
    values: torch.Tensor,
    signed: bool,
    block_size: int = BLOCK_SIZE,
    noise: torch.Tensor | None = None,
    keep_nonzero: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes, absmax)`` of ``values``: uint8 codes shaped like ``values`` and one fp32
    absmax per block of its flattened elements.

    Without ``noise``: round to nearest (ties to the lower value). With ``noise`` (one
    uniform [0, 1) fp32 number per element, flattened order): stochastic rounding between
    the two values of the map around each element. ``keep_nonzero`` (unsigned map only):
    a positive value never becomes 0 but at least the smallest positive value of the map,
    3.25e-7 of its block's absmax (a second moment stored as 0 beside a first moment
    that is not would make the step divide by eps alone).
    """
    if keep_nonzero and signed:
        raise ValueError("keep_nonzero applies to the unsigned map (the second moment)")
    scaled, absmax = _scaled(values, block_size)
    code = dynamic_map(signed, scaled.device)
    if noise is None:
        index = torch.bucketize(scaled, _midpoints(signed, scaled.device), out_int32=True)
    else:
        below = torch.searchsorted(code, scaled, right=True, out_int32=True).sub_(1)
        below.clamp_(0, code.numel() - 2)  # x = 1 rounds between the last two values
        low, high = code[below], code[below + 1]
        up = noise.reshape(-1) < (scaled - low) / (high - low)
        index = below + up
    if keep_nonzero:
        index = torch.where((index == 0) & (scaled > 0), 1, index)
    return index.to(torch.uint8).view(values.shape), absmax


def dequantize(
    codes: torch.Tensor, absmax: torch.Tensor, signed: bool, block_size: int = BLOCK_SIZE
) -> torch.Tensor:
    """fp32 ``code[index] * absmax`` of every element, shaped like ``codes`` (one fp32
    multiplication each, as bitsandbytes dequantises)."""
    flat = codes.reshape(-1)
    numel = flat.numel()
    values = dynamic_map(signed, flat.device)[flat.int()]
    full = numel - numel % block_size
    out = torch.empty_like(values)
    out[:full].view(-1, block_size).copy_(
        values[:full].view(-1, block_size) * absmax[: full // block_size].view(-1, 1)
    )
    if full < numel:
        out[full:] = values[full:] * absmax[-1]
    return out.view(codes.shape)


@dataclass
class QuantizedMoment:
    """One 8-bit moment in an optimizer's state: ``state[name]`` (uint8 codes shaped like
    the parameter, contiguous) and ``state[name + "_absmax"]`` (fp32, one per block of the
    flattened parameter), read and written a range of whole blocks at a time."""

    codes: torch.Tensor
    absmax: torch.Tensor
    signed: bool
    block_size: int = BLOCK_SIZE

    @staticmethod
    def new_state(
        name: str, param: torch.Tensor, block_size: int = BLOCK_SIZE
    ) -> dict[str, torch.Tensor]:
        """Zero state entries of a moment of ``param`` (codes 0, absmax 0: the value 0)."""
        return {
            name: torch.zeros(param.shape, dtype=torch.uint8, device=param.device),
            f"{name}_absmax": torch.zeros(
                num_blocks(param.numel(), block_size), dtype=torch.float32, device=param.device
            ),
        }

    @classmethod
    def of(
        cls, state: dict, name: str, signed: bool, block_size: int = BLOCK_SIZE
    ) -> QuantizedMoment:
        return cls(state[name].view(-1), state[f"{name}_absmax"], signed, block_size)

    def _blocks(self, start: int, stop: int) -> slice:
        if start % self.block_size or (stop % self.block_size and stop != self.codes.numel()):
            raise ValueError(f"range [{start}, {stop}) is not made of whole blocks")
        return slice(start // self.block_size, num_blocks(stop, self.block_size))

    def load(self, start: int, stop: int) -> torch.Tensor:
        """fp32 values of flattened elements ``[start, stop)`` (``start`` on a block
        boundary, ``stop`` on one or at the end)."""
        return dequantize(
            self.codes[start:stop],
            self.absmax[self._blocks(start, stop)],
            self.signed,
            self.block_size,
        )

    def store(
        self,
        start: int,
        stop: int,
        values: torch.Tensor,
        noise: torch.Tensor | None = None,
        keep_nonzero: bool = False,
        mask: torch.Tensor | None = None,
    ) -> None:
        """Quantise fp32 ``values`` into elements ``[start, stop)`` (see ``quantize``);
        nothing is written where ``mask`` (``TrackingOptimizer.step_mask``) holds False."""
        codes, absmax = quantize(values, self.signed, self.block_size, noise, keep_nonzero)
        commit_(self.codes[start:stop], codes.view(-1), mask)
        commit_(self.absmax[self._blocks(start, stop)], absmax, mask)
