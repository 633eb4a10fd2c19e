"""Any checkpoint of a run, read as rank-independent state of each parameter.

``open_full_state`` reads a single-process checkpoint, a ZeRO-1/2/3 checkpoint of any
number of ranks, or the rank-independent layout (``collage_train.checkpoint.universal``)
behind one interface, ``param_state.FullState``: ``read(name, start, stop)`` returns, for
elements ``[start, stop)`` of the flattened parameter ``name``, one 1-D tensor per
component (listed there).

Invariants: values are returned bit for bit as saved (no dtype conversion; the weight
of a ZeRO checkpoint is DeepSpeed's master partition rounded to the model's dtype, which
is exactly how DeepSpeed sets the weights); files are opened with the restricted
unpickler and memory-mapped, so reading one range touches only that range's bytes and
never more than one parameter's state is in memory; a checkpoint whose parameters do not
tile this model's is refused in one line (``pieces.check_tiling``).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from collage_train import checkpoint
from collage_train.checkpoint import whole_tensor
from collage_train.checkpoint.param_state import INDEX_COMPONENTS, FullState
from collage_train.checkpoint.pieces import (
    Piece,
    check_tiling,
    overlapping,
    zero3_rank_pieces,
    zero12_pieces,
)
from collage_train.checkpoint.universal import UNIVERSAL, read_trainer_state
from collage_train.config.schema import current_choice
from collage_train.errors import CheckpointError
from collage_train.scalify.params import SCALE_SUFFIX

ZERO_ENGINES = ("zero1", "zero2", "zero3")


def _slice_index(ties: torch.Tensor, lo: int, hi: int, shift: int) -> torch.Tensor:
    """Positions in ``[lo, hi)`` of a flat tensor, moved by ``shift``."""
    inside = ties[(ties >= lo) & (ties < hi)]
    return inside - lo + shift


def _weight_and_master(out: dict[str, torch.Tensor], weight_dtype: torch.dtype) -> None:
    """Name a master partition ``weight`` where it is the weight, else add its rounding."""
    master = out.pop("master")
    if master.dtype == weight_dtype:
        out["weight"] = master
    else:
        out["weight"] = master.to(weight_dtype)
        out["master"] = master


# ----------------------------------------------------------------- one process


def _single(path: Path, names_by_index: list[str] | None) -> FullState:
    model = checkpoint.open_restricted(path / "model.pt")
    optimizer = checkpoint.open_restricted(path / "optimizer.pt")
    trainer = checkpoint.open_restricted(path / "trainer.pt")
    names = optimizer.get("param_names") or names_by_index
    order = [i for group in optimizer["param_groups"] for i in group["params"]]
    if names is None or len(names) != len(order):
        raise CheckpointError(
            f"{path} does not name its optimizer's parameters; resume it on one process"
        )
    state_of = {names[position]: optimizer["state"].get(index, {}) for position, index in
                enumerate(order)}  # fmt: skip
    missing = [name for name in state_of if name not in model]
    if missing:
        raise CheckpointError(f"{path}: model.pt lacks parameter {missing[0]}")
    shapes = {name: tuple(model[name].shape) for name in state_of}

    def read(name: str, start: int, stop: int) -> dict[str, torch.Tensor]:
        out = {"weight": model[name].reshape(-1)[start:stop].clone()}
        scale = model.get(name + SCALE_SUFFIX)  # a scalify parameter's scale buffer
        if scale is not None:
            out["weight_scale"] = whole_tensor.scale_buffer(scale, stop - start)
        state = state_of[name]
        out.update(whole_tensor.element_range(state, start, stop))
        for key in INDEX_COMPONENTS:
            if key in state:
                out[key] = _slice_index(state[key], start, stop, 0)
        return out

    steps = {name: int(state.get("step", 0)) for name, state in state_of.items()}
    return FullState("unsharded", 1, shapes, steps, trainer, False, read)


# ------------------------------------------------------------------------ ZeRO


def _zero(path: Path, stage: int, world_size: int) -> FullState:
    optim_files = [
        sorted(path.glob(f"*zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"))
        for rank in range(world_size)
    ]
    if any(len(found) != 1 for found in optim_files):
        raise CheckpointError(
            f"{path} does not hold one optimizer shard per rank of its {world_size} ranks"
        )
    optims = [checkpoint.open_restricted(found[0])["optimizer_state_dict"] for found in optim_files]
    model_name = f"{'' if stage < 3 else 'zero_pp_rank_0_'}mp_rank_00_model_states.pt"
    model_states = checkpoint.open_restricted(path / model_name)
    group_shapes = [dict(group) for group in model_states["param_shapes"]]
    shapes = {name: tuple(shape) for group in group_shapes for name, shape in group.items()}
    module = model_states["module"]
    weight_dtype = next(module[name].dtype for name in shapes if name in module)
    if stage < 3:
        layout = zero12_pieces([optim["param_slice_mappings"] for optim in optims])
        states = [_group_states(optim["base_optimizer_state"], len(group_shapes))
                  for optim in optims]  # fmt: skip
        masters = [optim["single_partition_of_fp32_groups"] for optim in optims]
    else:
        numels = [[(name, math.prod(shape)) for name, shape in group.items()]
                  for group in group_shapes]  # fmt: skip
        layout = [zero3_rank_pieces(numels, rank, world_size) for rank in range(world_size)]
        states = [_group_states(optim["optimizer_state_dict"], len(group_shapes))
                  for optim in optims]  # fmt: skip
        masters = [optim["fp32_flat_groups"] for optim in optims]
    check_tiling(layout, {name: math.prod(shape) for name, shape in shapes.items()}, str(path))
    by_name: dict[str, list[tuple[int, Piece]]] = {}
    for rank, pieces in enumerate(layout):
        for piece in pieces:
            by_name.setdefault(piece.name, []).append((rank, piece))

    def read(name: str, start: int, stop: int) -> dict[str, torch.Tensor]:
        parts: dict[str, list[torch.Tensor]] = {}
        for rank, piece in by_name[name]:
            if not overlapping([piece], name, start, stop):
                continue
            lo, hi = max(start, piece.param_start), min(stop, piece.param_stop)
            flat_lo = piece.flat_start + lo - piece.param_start
            flat_hi = flat_lo + hi - lo
            group = states[rank][piece.group]
            parts.setdefault("master", []).append(masters[rank][piece.group][flat_lo:flat_hi])
            for key, value in whole_tensor.element_range(group, flat_lo, flat_hi).items():
                parts.setdefault(key, []).append(value)
            for key in INDEX_COMPONENTS:
                if key in group:
                    parts.setdefault(key, []).append(
                        _slice_index(group[key], flat_lo, flat_hi, lo - start)
                    )
        out = {key: torch.cat(values) for key, values in parts.items()}
        _weight_and_master(out, weight_dtype)
        return out

    steps = {
        piece.name: int(states[rank][piece.group].get("step", 0))
        for rank, pieces in enumerate(layout)
        for piece in pieces
    }
    return FullState(
        f"zero{stage}", world_size, shapes, steps, model_states["trainer"],
        world_size > 1, read,
    )  # fmt: skip


def _group_states(saved: Any, flat_count: int) -> list[dict[str, Any]]:
    """The client optimizer's state of each of a rank's ``flat_count`` flat tensors (one per
    parameter group; at stage 3 one per sub-group, several where a group is cut)."""
    if isinstance(saved, dict) and "state" in saved:
        state = saved["state"]
        return [state.get(index, {}) for index in range(flat_count)]
    return list(saved)  # DeepSpeed's elastic form: a list, one state per group


# ------------------------------------------------------------- rank-independent


def _universal(path: Path, meta: dict[str, Any]) -> FullState:
    params = meta["parameters"]
    shapes = {name: tuple(entry["shape"]) for name, entry in params.items()}
    steps = {name: int(entry["step"]) for name, entry in params.items()}

    def read(name: str, start: int, stop: int) -> dict[str, torch.Tensor]:
        out = {}
        with safe_open(path / params[name]["file"], framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                if key in INDEX_COMPONENTS:
                    out[key] = _slice_index(handle.get_tensor(key), start, stop, 0)
                else:
                    out[key] = handle.get_slice(key)[start:stop]
        return out

    source = meta.get("converted_from", {})
    return FullState(
        UNIVERSAL, int(source.get("world_size", 1)), shapes, steps,
        read_trainer_state(path), bool(source.get("per_rank_rng")), read,
    )  # fmt: skip


def layout_of(meta: dict[str, Any]) -> str:
    """``unsharded``, ``zero1``..``zero3`` or ``universal``: how a checkpoint is laid out
    (``distributed=single``, the old name of ``unsharded``, read as it)."""
    if meta.get("layout") == UNIVERSAL:
        return UNIVERSAL
    return current_choice("distributed", str(meta.get("distributed", "unsharded")))


def open_full_state(path: Path, names_by_index: list[str] | None = None) -> FullState:
    """The per-parameter state of checkpoint ``path``; ``names_by_index`` names the
    optimizer's parameters of a single-process checkpoint written before it named them."""
    meta = checkpoint.read_meta(path)
    layout = layout_of(meta)
    try:
        if layout == UNIVERSAL:
            return _universal(path, meta)
        if layout in ZERO_ENGINES:
            return _zero(path, int(layout[-1]), int(meta.get("world_size", 1)))
        if layout == "unsharded":
            return _single(path, names_by_index)
    except (KeyError, IndexError, TypeError, ValueError, OSError, json.JSONDecodeError) as err:
        raise CheckpointError(
            f"{path} is not a readable {layout} checkpoint ({type(err).__name__}: {err})"
        ) from None
    raise CheckpointError(f"{path} was written by distributed={layout}, which cannot be resharded")


def needs_reshard(meta: dict[str, Any], distributed: str, world_size: int) -> bool:
    """Whether a checkpoint with ``meta`` must be read per parameter (another layout or
    number of ranks) rather than by the engine's own loader."""
    if layout_of(meta) != distributed:
        return True
    return int(meta.get("world_size", 1)) != world_size
