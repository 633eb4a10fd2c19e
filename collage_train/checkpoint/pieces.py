"""Where each parameter's elements lie in the flat tensors an optimizer updates.

Invariant: over all ranks of a layout, the pieces of a parameter tile ``[0, numel)``
exactly once; padding belongs to no piece. ``check_tiling`` refuses a layout that breaks
this, so a checkpoint that does not describe this model is never silently misread.

A ``Piece`` says that elements ``[param_start, param_start + numel)`` of the flattened
parameter ``name`` sit at ``[flat_start, flat_start + numel)`` of flat tensor ``group`` of
one rank. Every layout is a list of pieces per rank: one process (a piece per parameter),
ZeRO stages 1-2 (DeepSpeed's ``param_slice_mappings``) and stage 3 (``ceil(numel / N)``
shards per parameter, in sub-groups: ``zero3_sub_groups``). The ``*_rank_pieces``
functions compute where DeepSpeed puts each element for a given number of ranks, for
writing a checkpoint in its layout (``checkpoint.native``).
Each layout's arithmetic: docs/design.md, "Checkpoint layouts".
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from collage_train.errors import CheckpointError


@dataclass(frozen=True)
class Piece:
    """A contiguous run of one parameter's elements inside one flat tensor of one rank."""

    name: str
    group: int
    param_start: int
    flat_start: int
    numel: int

    @property
    def param_stop(self) -> int:
        return self.param_start + self.numel


def zero12_pieces(slice_mappings: list[list[dict[str, Any]]]) -> list[list[Piece]]:
    """Pieces of every rank of a ZeRO-1/2 checkpoint from its ranks' ``param_slice_mappings``
    (per rank, per group: parameter name -> fragment with ``start`` and ``numel``)."""
    consumed: dict[str, int] = {}
    layout: list[list[Piece]] = []
    for per_group in slice_mappings:
        pieces = []
        for group, fragments in enumerate(per_group):
            for name, fragment in fragments.items():
                numel, start = int(fragment.numel), int(fragment.start)
                pieces.append(Piece(name, group, consumed.get(name, 0), start, numel))
                consumed[name] = consumed.get(name, 0) + numel
        layout.append(pieces)
    return layout


def zero12_partition_numel(group_numel: int, world_size: int) -> int:
    """Elements of each rank's partition of a ZeRO-1/2 flat group of ``group_numel``
    elements: DeepSpeed pads the group to a multiple of ``2 * world_size``."""
    alignment = 2 * world_size
    return math.ceil(group_numel / alignment) * alignment // world_size


def zero12_rank_pieces(
    group_numels: list[list[tuple[str, int]]], rank: int, world_size: int
) -> list[Piece]:
    """Pieces of ``rank`` at ZeRO stages 1-2 from each group's (name, numel) in flat order
    (DeepSpeed's defaults: no ``round_robin_gradients``, no ``parameter_alignment``)."""
    pieces = []
    for group, params in enumerate(group_numels):
        size = zero12_partition_numel(sum(numel for _, numel in params), world_size)
        low, high = rank * size, (rank + 1) * size
        offset = 0
        for name, numel in params:
            start, stop = max(low, offset), min(high, offset + numel)
            if start < stop:
                pieces.append(Piece(name, group, start - offset, start - low, stop - start))
            offset += numel
    return pieces


def zero3_sub_groups(
    group_numels: list[list[tuple[str, int]]], world_size: int, sub_group_size: int
) -> tuple[list[list[tuple[str, int]]], list[int]]:
    """DeepSpeed's stage-3 sub-groups of each group (a sub-group ends with the parameter
    whose shard brings its running size to ``sub_group_size``) and the group of each."""
    sub_groups: list[list[tuple[str, int]]] = []
    group_of: list[int] = []
    for group, params in enumerate(group_numels):
        shard = [math.ceil(numel / world_size) for _, numel in params]
        if sub_group_size >= sum(shard):
            sub_groups.append(list(params))
            group_of.append(group)
            continue
        current: list[tuple[str, int]] = []
        running = 0
        for index, (param, size) in enumerate(zip(params, shard, strict=True)):
            current.append(param)
            running += size
            if running >= sub_group_size or index == len(params) - 1:
                sub_groups.append(current)
                group_of.append(group)
                current, running = [], 0
    return sub_groups, group_of


def zero3_rank_pieces(
    group_numels: list[list[tuple[str, int]]], rank: int, world_size: int
) -> list[Piece]:
    """Pieces of ``rank`` at ZeRO-3 from each group's (name, numel) in flat order."""
    pieces = []
    for group, params in enumerate(group_numels):
        offset = 0
        for name, numel in params:
            shard = math.ceil(numel / world_size)
            start = rank * shard
            count = max(0, min(shard, numel - start))
            if count:
                pieces.append(Piece(name, group, start, offset, count))
            offset += shard
    return pieces


def check_tiling(layout: Iterable[list[Piece]], numels: dict[str, int], where: str) -> None:
    """Refuse a layout whose pieces do not tile every parameter of ``numels`` exactly once."""
    covered: dict[str, list[tuple[int, int]]] = {}
    for pieces in layout:
        for piece in pieces:
            covered.setdefault(piece.name, []).append((piece.param_start, piece.param_stop))
    foreign = sorted(set(covered) - set(numels))
    missing = sorted(set(numels) - set(covered))
    if foreign or missing:
        names = ", ".join((foreign or missing)[:3])
        what = "parameters this model does not have" if foreign else "no state for parameters"
        raise CheckpointError(f"{where} holds {what} ({names}): it is another model's")
    for name, spans in covered.items():
        position = 0
        for start, stop in sorted(spans):
            if start != position:
                break
            position = stop
        if position != numels[name]:
            raise CheckpointError(
                f"{where} does not hold parameter {name} whole ({numels[name]} elements "
                "expected): it is another model's or damaged"
            )


def overlapping(pieces: list[Piece], name: str, start: int, stop: int) -> list[Piece]:
    """The pieces of ``name`` that hold any element of ``[start, stop)``."""
    return [p for p in pieces if p.name == name and p.param_start < stop and start < p.param_stop]


def segment_lengths(pieces: Iterable[Piece], numel: int) -> list[int]:
    """The lengths of the segments that one flat tensor of ``numel`` elements is cut into:
    its ``pieces`` in flat order, each run of padding before, between or after them a
    segment of its own (``optim.base.FlatPieces.lengths``, as ``ZeroEngine.flat_pieces``)."""
    lengths, position = [], 0
    for piece in sorted(pieces, key=lambda piece: piece.flat_start):
        if piece.flat_start > position:
            lengths.append(piece.flat_start - position)
        lengths.append(piece.numel)
        position = piece.flat_start + piece.numel
    if numel > position:
        lengths.append(numel - position)
    return lengths
