"""Scaled tensors read and written a chunk at a time, one power-of-two scale per piece.

A tensor ``ScaledAdamW`` updates is either a whole model tensor (one piece, a 0-d scale)
or a flat ZeRO partition holding pieces of many model tensors (``optim.base.FlatPieces``:
one scale per piece). ``PieceChunks`` gives, for any range ``[lo, hi)`` of the flattened
tensor, the per-element scale of that range only (``scale_of``), and accumulates float64
sums of squares per piece from chunks (``add_squares``) so that a fresh scale per piece
(``scales``) can be taken without ever holding an fp32 copy of the whole tensor: the
step's temporaries then scale with the chunk, not with the partition.
"""

from __future__ import annotations

import torch

from collage_train.optim.base import FlatPieces
from collage_train.scalify.scale import rms_scales_from_sums


class PieceChunks:
    """The pieces of one tensor of ``numel`` elements (``pieces``: None for one piece)."""

    def __init__(self, numel: int, pieces: FlatPieces | None, device: torch.device) -> None:
        self.single = pieces is None
        lengths = (
            torch.tensor([numel], dtype=torch.long) if pieces is None else pieces.lengths.cpu()
        )
        self.whole = None if pieces is None else pieces.whole
        self.device = device
        self.lengths = lengths
        self.stops = torch.cumsum(lengths, 0)
        self.starts = self.stops - lengths
        if int(self.stops[-1]) != numel:
            raise ValueError(f"the pieces cover {int(self.stops[-1])} elements of {numel}")

    def _overlap(self, lo: int, hi: int) -> tuple[int, int, torch.Tensor]:
        """First and stop index of the pieces overlapping ``[lo, hi)``, and how many of
        their elements lie in it."""
        first = int(torch.searchsorted(self.stops, lo, right=True))
        stop = int(torch.searchsorted(self.starts, hi, right=False))
        starts = self.starts[first:stop].clamp(min=lo)
        stops = self.stops[first:stop].clamp(max=hi)
        return first, stop, stops - starts

    def scale_of(self, scale: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        """The scale to multiply the data of ``[lo, hi)`` by: a 0-d scale as is, one per
        piece repeated over the range's elements of each piece."""
        if scale.dim() == 0:
            return scale
        first, stop, counts = self._overlap(lo, hi)
        return torch.repeat_interleave(
            scale[first:stop], counts.to(scale.device), output_size=hi - lo
        )

    def zero_sums(self) -> torch.Tensor:
        return torch.zeros(len(self.lengths), dtype=torch.float64, device=self.device)

    def add_squares(self, sums: torch.Tensor, values: torch.Tensor, lo: int, hi: int) -> None:
        """Add the float64 squares of ``values`` (the elements ``[lo, hi)``) to their
        pieces' entries of ``sums``."""
        squares = values.detach().to(torch.float64).square()
        if self.single:
            sums += squares.sum()
            return
        first, stop, counts = self._overlap(lo, hi)
        sums[first:stop] += torch.segment_reduce(squares, "sum", lengths=counts.to(squares.device))

    def scales(self, sums: torch.Tensor, scaled: bool = True) -> torch.Tensor:
        """A fresh power-of-two RMS scale per piece from the summed squares (the whole
        tensor's, over every rank, where the pieces say how); all 1 without ``scaled``.
        0-d for one piece. Every rank sharing the pieces' ``whole`` calls it together."""
        if not scaled:
            ones = torch.ones(len(self.lengths), device=self.device)
            return ones[0] if self.single else ones
        counts = self.lengths.to(device=sums.device, dtype=torch.float64)
        if self.whole is not None:
            sums, counts = self.whole(sums, counts)
        scales = rms_scales_from_sums(sums, counts)
        return scales[0] if self.single else scales
