"""Each strategy's optimizer state of one flat tensor <-> its whole-tensor form.

Most optimizer state is one value per element, cut and joined like the weight. This module
is the one place that knows the entries that are not: the 8-bit strategies' per-block
``exp_avg_absmax`` / ``exp_avg_sq_absmax``, Scalify's ``*_scale`` (per tensor or per piece)
and a ``scalify`` weight's ``weight_scale``, with ``piece_lengths``. In the whole-tensor
form every such entry holds one value per element (the absmax or scale it is under):
nothing lost, independent of the writer's layout. ``element_range`` makes it from a flat
tensor's state; ``compact`` rebuilds a flat tensor's state for a new layout (scales bit
for bit; an 8-bit element re-quantised, within ``REQUANTISE_BOUND``, only where the new
block's absmax is another); ``restore_flat`` fills a ZeRO partition from any checkpoint, a
window at a time. ``values`` gives the canonical fp32 ``weight``, ``exp_avg`` and
``exp_avg_sq``; ``quantised_elements`` and ``scaled_elements`` go back.
Design and measurements: docs/design.md, "Resharding state that is not per element".
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from collage_train.checkpoint.param_state import INDEX_COMPONENTS, FullState
from collage_train.checkpoint.pieces import Piece
from collage_train.errors import CheckpointError
from collage_train.optim.blockwise8 import BLOCK_SIZE, dynamic_map, quantize
from collage_train.scalify.scale import SCALE_ATTR, STORAGE_DTYPE, store_scaled

# entry -> (the per-element entry it quantises, whether its map is signed)
ABSMAX_KEYS = {"exp_avg_absmax": ("exp_avg", True), "exp_avg_sq_absmax": ("exp_avg_sq", False)}
# entry -> the per-element entry whose data it scales ("weight" for a scalify parameter;
# "master" where a copy is kept, else the fp32 parameter, which holds its value exactly)
SCALE_KEYS = {
    "exp_avg_scale": "exp_avg",
    "exp_avg_sq_scale": "exp_avg_sq",
    "master_scale": "master",
    "weight_scale": "weight",
}
PIECE_LENGTHS = "piece_lengths"
# entries of a flat tensor's state that are not one value per element
LAYOUT_KEYS = (*ABSMAX_KEYS, *SCALE_KEYS, PIECE_LENGTHS)


def _max_half_gap(signed: bool) -> float:
    code = dynamic_map(signed)
    return float((code[1:] - code[:-1]).max()) / 2


# What an elastic resume or conversion of 8-bit moments says it did not carry bit for bit.
EIGHT_BIT_RECUT = (
    "the 8-bit codes of blocks cut elsewhere than in the source (re-quantised, each within "
    "half a step of the map)"
)


# The most a re-quantised element moves, as a fraction of its new block's absmax: half the
# widest gap of its map (signed: the top decade's 0.0141 / 2; unsigned: 0.0070 / 2).
REQUANTISE_BOUND = {signed: _max_half_gap(signed) for signed in (True, False)}


# ------------------------------------------------------- flat state -> whole-tensor form


def _scale_range(scale: torch.Tensor, lengths: torch.Tensor | None, lo: int, hi: int):
    """The scale of each element ``[lo, hi)``: a 0-d scale repeated, or its piece's."""
    if scale.dim() == 0 or lengths is None:
        return scale.reshape(()).expand(hi - lo).clone()
    stops = torch.cumsum(lengths.to(torch.long).cpu(), 0)
    index = torch.searchsorted(stops, torch.arange(lo, hi), right=True)
    return scale[index.to(scale.device)].clone()


def element_range(state: Mapping[str, Any], lo: int, hi: int) -> dict[str, torch.Tensor]:
    """Elements ``[lo, hi)`` of one flat tensor's state (a parameter's, or a ZeRO
    partition's), every tensor entry one value per element: absmax per element of its
    block, scales per element of their piece; ``piece_lengths``, non-tensors and 0-d
    counters left out, and index entries (``param_state.INDEX_COMPONENTS``: the caller's)."""
    lengths = state.get(PIECE_LENGTHS)
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if not torch.is_tensor(value) or key == PIECE_LENGTHS or key in INDEX_COMPONENTS:
            continue
        if key in ABSMAX_KEYS:
            blocks = torch.arange(lo, hi, device=value.device) // BLOCK_SIZE
            out[key] = value[blocks]
        elif key in SCALE_KEYS:
            out[key] = _scale_range(value, lengths, lo, hi)
        elif value.dim() > 0:
            out[key] = value.reshape(-1)[lo:hi].clone()
    return out


def scale_buffer(weight_scale: torch.Tensor, numel: int) -> torch.Tensor:
    """A ``scalify`` parameter's 0-d scale (its model buffer) as the whole-tensor form's
    ``weight_scale``: one value per element."""
    return weight_scale.reshape(()).expand(numel).clone()


# ------------------------------------------------------- whole-tensor form -> flat state


def blank(key: str, numel: int, dtype: torch.dtype, device: Any = "cpu") -> torch.Tensor:
    """A flat tensor's per-element entry before any piece is copied in: zeros (the value 0:
    code 0 under absmax 0, data 0), scales 1 (what ``ScaledAdamW`` gives a zero tensor)."""
    fill = 1 if key in SCALE_KEYS else 0
    return torch.full((numel,), fill, dtype=dtype, device=device)


def _compact_absmax(codes: torch.Tensor, absmax: torch.Tensor, signed: bool) -> tuple:
    """Per-element codes and absmax -> codes and one absmax per block (module docstring)."""
    numel = codes.numel()
    full = -(-numel // BLOCK_SIZE) * BLOCK_SIZE
    padded = torch.zeros(full, dtype=absmax.dtype, device=absmax.device)
    padded[:numel] = absmax
    per_block = padded.view(-1, BLOCK_SIZE).amax(dim=1)
    new = per_block.repeat_interleave(BLOCK_SIZE)[:numel]
    moved = absmax != new
    if bool(moved.any()):
        code = dynamic_map(signed, codes.device)
        value = code[codes[moved].long()] * absmax[moved]
        scaled = torch.clamp(value / new[moved], -1, 1)
        midpoints = (code[:-1] + code[1:]) / 2
        index = torch.bucketize(scaled, midpoints)
        if not signed:  # a positive second moment never becomes 0 (blockwise8.quantize)
            index = torch.where((index == 0) & (scaled > 0), 1, index)
        codes = codes.clone()
        codes[moved] = index.to(torch.uint8)
    return codes, per_block


def _compact_scale(
    data: torch.Tensor | None, scale: torch.Tensor, lengths: torch.Tensor | None
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Per-element scales -> one per piece (0-d without ``lengths``): each piece's largest;
    data under another scale of its piece is stored again under that one."""
    segments = [scale.numel()] if lengths is None else [int(n) for n in lengths]
    per_piece = torch.stack(
        [part.max() if part.numel() else scale.new_ones(()) for part in scale.split(segments)]
    )
    new = torch.repeat_interleave(per_piece, torch.tensor(segments, device=scale.device))
    moved = scale != new
    if data is not None and data.dtype != torch.float32 and bool(moved.any()):
        data = data.clone()
        data[moved] = (data[moved].float() * scale[moved] / new[moved]).to(data.dtype)
    return data, per_piece.reshape(()) if lengths is None else per_piece


def compact(
    components: Mapping[str, torch.Tensor], lengths: torch.Tensor | None = None
) -> dict[str, torch.Tensor]:
    """The state of one new flat tensor from its whole-tensor form (``components``: 1-D,
    one value per element of the flat tensor, zero-padded where no piece lies):
    absmax per block, scales per piece of ``lengths`` (``optim.base.FlatPieces``; None for
    one tensor: 0-d scales) with ``piece_lengths`` beside them. Other entries as given."""
    out = dict(components)
    for key, (data_key, signed) in ABSMAX_KEYS.items():
        if key in out:
            out[data_key], out[key] = _compact_absmax(out[data_key], out[key], signed)
    for key, data_key in SCALE_KEYS.items():
        if key in out:
            data, out[key] = _compact_scale(out.get(data_key), out[key], lengths)
            if data is not None:
                out[data_key] = data
    if lengths is not None and any(key in out for key in SCALE_KEYS):
        out[PIECE_LENGTHS] = lengths.clone()
    return out


# Elements of a flat tensor ``restore_flat`` builds the whole-tensor form of at once (a
# multiple of BLOCK_SIZE): an elastic resume's transient is this many elements' form, about
# 20 bytes each for 8-bit state, not a partition's (gpt_1.3b over 2 ranks: 12 GB a rank).
RESTORE_WINDOW = 2**24


def restore_flat(
    state: FullState,
    pieces: list[Piece],
    flat: torch.Tensor,
    lengths: torch.Tensor | None = None,
    *,
    window: int = RESTORE_WINDOW,
) -> tuple[int | None, dict[str, torch.Tensor]]:
    """Copy the weights (fp32 master where kept) of ``pieces`` of ``state`` into ``flat``;
    return the optimizer's step count and the flat tensor's state (``compact``; None and
    {} when only padding lies here). Built ``window`` elements at a time, bit for bit as
    at once: windows start at block boundaries, and a flat tensor with scales per piece
    (``lengths``) is one window."""
    if window % BLOCK_SIZE:
        raise ValueError(f"window {window} is not a multiple of the block, {BLOCK_SIZE}")
    if not pieces:
        return None, {}
    first = pieces[0]
    probe = state.read(first.name, first.param_start, first.param_start + 1)
    numel = flat.numel()
    if any(key in SCALE_KEYS for key in probe):
        window = numel  # a piece's scale is the largest over all its elements
    out: dict[str, torch.Tensor] = {}
    positions: dict[str, list[torch.Tensor]] = {}  # index components, e.g. remainder ties
    step = None
    for lo in range(0, numel, max(window, 1)):
        hi = min(lo + window, numel)
        restored: dict[str, torch.Tensor] = {}
        for piece in pieces:
            start, stop = max(lo, piece.flat_start), min(hi, piece.flat_start + piece.numel)
            if start >= stop:
                continue
            shift = piece.param_start - piece.flat_start
            components = state.read(piece.name, start + shift, stop + shift)
            weight, master = components.pop("weight"), components.pop("master", None)
            source = master if master is not None else weight
            if source.dtype != flat.dtype:
                raise CheckpointError(
                    f"the checkpoint holds {piece.name}'s master in {source.dtype}, this run "
                    f"in {flat.dtype}: it was written with another precision strategy"
                )
            flat.data[start:stop].copy_(source)
            for key, value in components.items():
                if key in INDEX_COMPONENTS:
                    positions.setdefault(key, []).append(value.to(flat.device) + start)
                    continue
                if key not in restored:
                    restored[key] = blank(key, hi - lo, value.dtype, flat.device)
                restored[key][start - lo : stop - lo].copy_(value)
            step = state.steps[piece.name]
        for key, value in compact(restored, lengths).items():
            _place(out, key, value, lo, numel)
    if step is None:
        return None, {}
    out.update({key: torch.cat(parts) for key, parts in positions.items()})
    return step, out


def _place(out: dict[str, torch.Tensor], key: str, value: torch.Tensor, lo: int, numel: int):
    """Window ``lo``'s compacted ``value`` of ``key`` into the flat tensor's ``out``."""
    if key in SCALE_KEYS or key == PIECE_LENGTHS:  # the one window
        out[key] = value
        return
    per_block = key in ABSMAX_KEYS
    total, at = (-(-numel // BLOCK_SIZE), lo // BLOCK_SIZE) if per_block else (numel, lo)
    if key not in out:  # the value of an element no piece covers, in every window
        if per_block:
            out[key] = torch.zeros(total, dtype=value.dtype, device=value.device)
        else:
            out[key] = blank(key, total, value.dtype, value.device)
    out[key][at : at + value.numel()].copy_(value)


def set_weight_scale(param: torch.Tensor, scale: torch.Tensor | None) -> None:
    """Give a ``scalify`` parameter its restored 0-d scale, in place (every module holding
    it sees the same tensor); nothing for a parameter without one."""
    if scale is not None:
        getattr(param, SCALE_ATTR).copy_(scale)


# ----------------------------------------------------- whole-tensor form <-> fp32 values


def values(components: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The fp32 values of one parameter's whole-tensor form (any strategy): ``weight``
    (the fp32 master where one is kept; a scaled weight's data x scale; Collage's
    theta + dtheta and split_fp32's weight + remainder rounded to fp32 otherwise: the
    caller that needs split_fp32's exact master joins it with ``optim.remainder``),
    ``exp_avg`` and ``exp_avg_sq`` (8-bit codes x absmax, scaled data x scale, Collage's
    v + dv; exact in fp32 but for v + dv), each where ``components`` hold it, their
    elements as there."""
    out: dict[str, torch.Tensor] = {}
    if "master" in components:
        out["weight"] = _descaled(components, "master", "master_scale")
    elif "weight" in components:
        weight = _descaled(components, "weight", "weight_scale")
        if "dtheta" in components:
            weight = weight + components["dtheta"].float()
        if "remainder" in components:
            from collage_train.optim import remainder

            ties = components.get("remainder_ties", torch.empty(0, dtype=torch.long))
            weight = remainder.join(components["weight"], components["remainder"], ties)
        out["weight"] = weight
    for name, signed in (("exp_avg", True), ("exp_avg_sq", False)):
        if name not in components:
            continue
        if f"{name}_absmax" in components:
            code = dynamic_map(signed, components[name].device)
            value = code[components[name].long()] * components[f"{name}_absmax"]
        else:
            value = _descaled(components, name, f"{name}_scale")
        if name == "exp_avg_sq" and "dv" in components:
            value = value + components["dv"].float()
        out[name] = value
    return out


def _descaled(components: Mapping[str, torch.Tensor], key: str, scale_key: str) -> torch.Tensor:
    value = components[key].float()
    return value * components[scale_key] if scale_key in components else value


def quantised_elements(
    value: torch.Tensor, signed: bool, keep_nonzero: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``value`` (one parameter, flattened) as 8-bit codes and the absmax of each
    element's block, the blocks on the whole tensor (round to nearest)."""
    codes, absmax = quantize(value.reshape(-1), signed, keep_nonzero=keep_nonzero)
    blocks = torch.arange(codes.numel(), device=codes.device) // BLOCK_SIZE
    return codes, absmax[blocks]


def scaled_elements(value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``value`` (one parameter, flattened) as fp16 data under the whole tensor's
    power-of-two RMS scale, and that scale per element (``scalify.scale.store_scaled``)."""
    data, scale = store_scaled(value.reshape(-1), True, STORAGE_DTYPE)
    return data, scale.expand(data.numel()).clone()
