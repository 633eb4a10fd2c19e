"""Checks the checkpoint tests share: one trainer's state, bit-for-bit comparison of states
and of DeepSpeed's files and step counters, ZeRO partitions against a one-process state,
planted remainder ties, a resharded state against its source (tests/checkpoint/,
tests/engine/test_zero.py)."""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch

from collage_train import checkpoint
from collage_train.checkpoint import whole_tensor
from collage_train.checkpoint.param_state import FullState
from collage_train.optim import remainder
from collage_train.trainer import Trainer


def state_of(trainer: Trainer) -> dict[str, dict]:
    """Weight and optimizer state of every parameter of a one-process trainer."""
    out = {}
    for name, param in trainer.model.named_parameters():
        out[name] = {"weight": param.detach().clone(), **trainer.optimizer.state[param]}
    return out


def assert_bitwise(mine: dict, theirs: dict) -> None:
    assert mine.keys() == theirs.keys()
    for name in mine:
        assert mine[name].keys() == theirs[name].keys(), name
        for key, value in mine[name].items():
            other = theirs[name][key]
            if torch.is_tensor(value):
                assert value.dtype == other.dtype and torch.equal(value, other), (name, key)
            else:
                assert value == other, (name, key)


def assert_zero_state_matches(zero: Trainer, expected: dict[str, dict]) -> None:
    """Each master partition and optimizer-state tensor of an in-process ZeRO rank, and each
    weight, holds the one-process state ``expected`` (``state_of``) element for element,
    tie positions renumbered into the flat partition, Scalify's scales per piece as one per
    element (``whole_tensor.element_range``)."""
    flats = zero.engine.master_partitions()
    for pieces, flat in zip(zero.engine.partition_pieces(), flats, strict=True):
        state, ties = zero.optimizer.state[flat], []
        scales = whole_tensor.element_range(state, 0, flat.numel())
        for piece in pieces:
            want = expected[piece.name]
            span = slice(piece.flat_start, piece.flat_start + piece.numel)
            master = want.get("master", want["weight"])
            assert torch.equal(flat[span], master.reshape(-1)), piece.name
            assert state["step"] == want["step"]
            for key, value in want.items():
                if key == "remainder_ties":
                    ties.append(value + piece.flat_start)
                elif key not in ("weight", "master", "step", "stream"):  # streams: per layout
                    held = scales[key] if key in whole_tensor.SCALE_KEYS else state[key]
                    assert torch.equal(held[span], value.reshape(-1)), (piece, key)
        if ties:
            assert torch.equal(state["remainder_ties"], torch.cat(ties))
    with zero.engine.full_weights() as model:
        for name, param in model.named_parameters():
            assert torch.equal(param.detach(), expected[name]["weight"]), name


def plant_ties(trainer: Trainer) -> torch.Tensor:
    """Make elements 3 and 7 of the first weight's fp32 master exact ties (low half 0x8000),
    which split_fp32 stores as positions beside its remainder."""
    param = next(trainer.model.parameters())
    master = trainer.optimizer._full_precision(param).reshape(-1)
    bits = master.view(torch.int32)
    bits[[3, 7]] = (bits[[3, 7]] & ~0x1FFFF) | 0x8000  # even bf16 half: the tie rounds down
    trainer.optimizer._load_full_precision(param, master.view(param.shape))
    ties = trainer.optimizer.state[param]["remainder_ties"]
    # the planted ties among them (a drawn weight may hold a natural tie too)
    assert {3, 7} <= set(ties.tolist()) and torch.equal(remainder.split(master)[2], ties)
    return ties


def assert_same_tree(mine: Any, theirs: Any, where: str = "") -> None:
    """Equal structure and values, tensors bit for bit with their dtype; DeepSpeed's records
    by their state; the keys of an OrderedDict (``module``, ``param_shapes``, slice mappings)
    in order, of a plain dict as a set (the order of a parameter's optimizer-state components
    is the source's). Learning rates (set again at every step) and ``ds_config`` (the
    converter records the layout's settings only) are not compared."""
    if torch.is_tensor(theirs):
        assert torch.is_tensor(mine) and mine.dtype == theirs.dtype, where
        assert mine.shape == theirs.shape and torch.equal(mine, theirs), where
    elif isinstance(theirs, dict):
        assert type(mine) is type(theirs), where
        if isinstance(theirs, OrderedDict):
            assert list(mine) == list(theirs), where
        assert set(mine) == set(theirs), where
        for key in theirs:
            if key not in ("lr", "ds_config"):
                assert_same_tree(mine[key], theirs[key], f"{where}.{key}")
    elif isinstance(theirs, list | tuple):
        assert type(mine) is type(theirs) and len(mine) == len(theirs), where
        for index, (a, b) in enumerate(zip(mine, theirs, strict=True)):
            assert_same_tree(a, b, f"{where}[{index}]")
    elif type(theirs).__name__ == "_Record":
        assert type(mine).__name__ == "_Record" and vars(mine) == vars(theirs), where
    else:
        assert mine == theirs, (where, mine, theirs)


def assert_same_deepspeed_files(mine: Path, theirs: Path) -> None:
    names = sorted(p.name for p in theirs.glob("*.pt"))
    assert sorted(p.name for p in mine.glob("*.pt")) == names and names
    for name in names:
        ours = checkpoint.open_restricted(mine / name)
        assert isinstance(ours["ds_config"], dict)  # DeepSpeed's universal converter needs one
        assert_same_tree(ours, checkpoint.open_restricted(theirs / name), name)


def deepspeed_counters(directory: Path) -> dict[str, tuple[int, int, int]]:
    """DeepSpeed's own step counters (``global_steps``, ``global_samples``,
    ``skipped_steps``) in each model-states file of checkpoint ``directory``."""
    counters = {}
    for file in sorted(directory.glob("*model_states.pt")):
        saved = checkpoint.open_restricted(file)
        if "global_steps" in saved:
            keys = ("global_steps", "global_samples", "skipped_steps")
            counters[file.name] = tuple(int(saved[key]) for key in keys)
    assert counters, f"no DeepSpeed model-states file in {directory}"
    return counters


# components carried bit for bit through every layout
EXACT = ("weight", "master", "dtheta", "exp_avg_scale", "exp_avg_sq_scale", "master_scale")


def assert_carried(new: FullState, old: FullState) -> dict[str, int]:
    """Every component of every parameter of ``new`` is ``old``'s: bit for bit, but for
    8-bit moments re-quantised into another block (within ``REQUANTISE_BOUND`` of the new
    block's absmax; the same code where the element's block scale is the same). Returns
    per 8-bit moment how many elements were carried exactly."""
    assert new.shapes == old.shapes and new.steps == old.steps
    exact: dict[str, int] = {}
    for name in old.shapes:
        mine, theirs = new.read(name), old.read(name)
        assert mine.keys() == theirs.keys(), name
        for key in mine.keys() & set(EXACT):
            assert mine[key].dtype == theirs[key].dtype, (name, key)
            assert torch.equal(mine[key], theirs[key]), (name, key)
        ours, others = whole_tensor.values(mine), whole_tensor.values(theirs)
        for moment, signed in (("exp_avg", True), ("exp_avg_sq", False)):
            absmax = mine.get(f"{moment}_absmax")
            if absmax is None:  # Scalify: the data itself, bit for bit
                assert torch.equal(mine[moment], theirs[moment]), (name, moment)
                continue
            same = absmax == theirs[f"{moment}_absmax"]
            assert torch.equal(mine[moment][same], theirs[moment][same]), (name, moment)
            gap = (ours[moment] - others[moment]).abs()
            assert bool((gap <= whole_tensor.REQUANTISE_BOUND[signed] * absmax).all()), name
            exact[moment] = exact.get(moment, 0) + int(same.sum())
    return exact
