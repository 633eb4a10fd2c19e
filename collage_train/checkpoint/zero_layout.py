"""DeepSpeed's ZeRO checkpoint files for N ranks, written from per-parameter state.

Writes what DeepSpeed 0.19's ``save_checkpoint`` writes (``engine._save_checkpoint``,
``_save_zero_checkpoint``; the optimizers' ``state_dict``): at stages 1-2, per rank R,
``[bf16_]zero_pp_rank_R_mp_rank_00_optim_states.pt`` and one ``mp_rank_00_model_states.pt``
(rank 0); at stage 3, per rank R, the optimizer file and
``zero_pp_rank_R_mp_rank_00_model_states.pt``. Where each element lies is ``pieces``'
arithmetic. Contract, checked against DeepSpeed itself: the files equal what it saves after
loading them (1 rank, stages 1-3) and what a 2-rank ZeRO-2 run saved
(tests/checkpoint/test_convert_native.py, tests/engine/test_zero.py). Memory: one rank's
flat partitions with their optimizer state at a time (at stages 1-2 the weights in their
own dtype too), filled from reads of one parameter's piece each.
Every key of every file: docs/design.md, "Checkpoint layouts".
"""

from __future__ import annotations

import contextlib
import copy
import math
import os
import sys
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from collage_train import checkpoint
from collage_train.checkpoint import whole_tensor
from collage_train.checkpoint.native_spec import ModelLayout, Target
from collage_train.checkpoint.param_state import INDEX_COMPONENTS, FullState, applied_steps
from collage_train.checkpoint.pieces import (
    Piece,
    segment_lengths,
    zero3_rank_pieces,
    zero3_sub_groups,
    zero12_partition_numel,
    zero12_rank_pieces,
)
from collage_train.errors import CheckpointError, ConfigError

SUB_GROUP_SIZE = 1_000_000_000  # DeepSpeed's default zero_optimization.sub_group_size


def zero_settings(config: dict[str, Any]) -> dict[str, Any]:
    """The ``zero_optimization`` keys a run added through ``distributed.deepspeed``."""
    extra = (config.get("distributed") or {}).get("deepspeed") or {}
    return dict(extra.get("zero_optimization") or {})


@dataclass(frozen=True)
class _DeepSpeed:
    """The classes DeepSpeed pickles into its checkpoints, and its version."""

    version: str
    loss_scaler: Any
    stage_enum: Any
    fragment_address: Any


def _deepspeed() -> _DeepSpeed:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # only its records are used: no device
    try:
        with contextlib.redirect_stdout(sys.stderr):  # it announces its accelerator
            import deepspeed
            from deepspeed.runtime.fp16.loss_scaler import LossScaler
            from deepspeed.runtime.zero.config import ZeroStageEnum
            from deepspeed.utils.tensor_fragment import fragment_address
    except ImportError as err:
        raise ConfigError(
            f"writing a ZeRO layout needs DeepSpeed, which failed to import ({err})"
        ) from None
    return _DeepSpeed(deepspeed.__version__, LossScaler, ZeroStageEnum, fragment_address)


class _Partition:
    """One rank's flat tensor of one (sub-)group being filled: the master and each optimizer
    state tensor, zero where DeepSpeed pads, and index components' positions."""

    def __init__(self, numel: int, master_dtype: torch.dtype, template: dict[str, torch.Tensor]):
        self.master = torch.zeros(numel, dtype=master_dtype)
        self.state = {
            key: whole_tensor.blank(key, numel, value.dtype)
            for key, value in template.items()
            if key not in INDEX_COMPONENTS
        }
        self.pieces: list[Piece] = []
        self.positions = {
            key: [value.new_empty(0)] for key, value in template.items() if key in INDEX_COMPONENTS
        }

    def put(self, piece: Piece, components: dict[str, torch.Tensor]) -> torch.Tensor:
        """Copy ``piece``'s components into place; return its weight."""
        weight, master = components.pop("weight"), components.pop("master", None)
        source = master if master is not None else weight
        if source.dtype != self.master.dtype:
            raise CheckpointError(
                f"the checkpoint holds {piece.name}'s master in {source.dtype}, its strategy's "
                f"ZeRO partitions are {self.master.dtype}"
            )
        span = slice(piece.flat_start, piece.flat_start + piece.numel)
        self.pieces.append(piece)
        self.master[span] = source
        for key, value in components.items():
            if key in self.positions:
                self.positions[key].append(value + piece.flat_start)
            elif key in self.state:
                self.state[key][span] = value
            else:
                raise CheckpointError(f"{piece.name} has optimizer state {key!r} others lack")
        return weight

    def optimizer_state(self, step: int) -> dict[str, Any] | None:
        """The client optimizer's state of this flat tensor (None: it has none yet): 8-bit
        blocks over it, Scalify's scales per piece (``whole_tensor.compact``)."""
        if not self.state and not self.positions:
            return None
        positions = {key: torch.cat(parts) for key, parts in self.positions.items()}
        lengths = torch.tensor(segment_lengths(self.pieces, self.master.numel()))
        return {"step": step, **whole_tensor.compact(self.state, lengths), **positions}


def _client_state_dict(
    partitions: list[_Partition],
    steps: list[int],
    settings: list[dict[str, Any]],
    group_of: list[int],
) -> dict[str, Any]:
    """The client optimizer's ``state_dict`` when flat tensor k belongs to group ``group_of[k]``."""
    state = {}
    for index, (partition, step) in enumerate(zip(partitions, steps, strict=True)):
        saved = partition.optimizer_state(step)
        if saved is not None:
            state[index] = saved
    groups = [
        {**setting, "params": [k for k, g in enumerate(group_of) if g == group]}
        for group, setting in enumerate(settings)
    ]
    return {"state": state, "param_groups": groups}


@dataclass
class _ZeroWriter:
    """Writes the ZeRO files of ``state`` for ``target`` into directory ``tmp``."""

    tmp: Path
    state: FullState
    layout: ModelLayout
    target: Target
    config: dict[str, Any]
    trainer: dict[str, Any]
    ds: _DeepSpeed
    weights: dict[str, torch.Tensor] | None = None  # the module's weights, at stages 1-2

    def ds_config(self) -> dict[str, Any]:
        """The settings the layout depends on (the engine renders the rest at launch)."""
        train = self.config["train"]
        micro, total = int(train["micro_batch_size"]), int(train["global_batch_size"])
        return {
            "train_micro_batch_size_per_gpu": micro,
            "gradient_accumulation_steps": total // (micro * self.target.world_size),
            "train_batch_size": total,
            "gradient_clipping": self.config["optim"]["grad_clip"],
            "bf16": {"enabled": self.layout.param_dtype == torch.bfloat16},
            "zero_optimization": {**zero_settings(self.config), "stage": self.target.stage},
        }

    def template(self) -> dict[str, torch.Tensor]:
        """Every optimizer-state component (name and dtype) of one element."""
        components = self.state.read(self.layout.groups[0][0], 0, 1)
        components.pop("weight")
        components.pop("master", None)
        return components

    def group_numels(self) -> list[list[tuple[str, int]]]:
        return [[(name, self.layout.numel(name)) for name in group] for group in self.layout.groups]

    def steps(self, groups: list[list[tuple[str, int]]]) -> list[int]:
        return [self.state.steps[group[0][0]] for group in groups]

    def fill(self, pieces: list[Piece], partitions: list[_Partition]) -> None:
        """Read each piece (one parameter's elements on this rank) into its partition."""
        for piece in pieces:
            components = self.state.read(piece.name, piece.param_start, piece.param_stop)
            weight = partitions[piece.group].put(piece, components)
            if self.weights is not None:
                if weight.dtype != self.layout.param_dtype:
                    raise CheckpointError(f"the checkpoint holds {piece.name} in {weight.dtype}")
                self.weights[piece.name].view(-1)[piece.param_start : piece.param_stop] = weight

    def optim_file(self, rank: int, optimizer_state: dict[str, Any]) -> None:
        prefix = "bf16_" if self.layout.param_dtype == torch.bfloat16 else ""
        saved = {
            "optimizer_state_dict": optimizer_state,
            "ds_config": self.ds_config(),
            "ds_version": self.ds.version,
        }
        name = f"{prefix}zero_pp_rank_{rank}_mp_rank_00_optim_states"
        checkpoint.write_tensors(self.tmp, {name: saved})

    def model_states(
        self,
        name: str,
        module: dict[str, torch.Tensor],
        param_shapes: list[OrderedDict[str, torch.Size]],
        shared: dict[str, str],
    ) -> None:
        step = applied_steps(self.trainer)  # a step the guard refused is not counted
        total = int(self.config["train"]["global_batch_size"])
        frozen = OrderedDict() if self.target.stage >= 2 else None  # saved from stage 2 on
        saved = {
            "module": OrderedDict(
                (key, module[self.layout.aliases.get(key, key)]) for key in self.layout.keys
            ),
            "buffer_names": [],
            "optimizer": None,
            "param_shapes": param_shapes,
            "frozen_param_shapes": frozen,
            "shared_params": shared,
            "frozen_param_fragments": copy.copy(frozen),
            "lr_scheduler": None,
            "data_sampler": None,
            "random_ltd": None,
            "skipped_steps": 0,  # DeepSpeed's overflow skips: bf16 and fp32 runs have none
            "global_steps": step,
            "global_samples": step * total,
            "dp_world_size": self.target.world_size,
            "mp_world_size": 1,
            "checkpoint_parallel_dimensions": {"pp_degree": 1, "tp_degree": 1},
            "ds_config": self.ds_config(),
            "ds_version": self.ds.version,
            "trainer": self.trainer,
        }
        checkpoint.write_tensors(self.tmp, {name: saved})

    def stages_1_2(self) -> None:
        layout, world, ds = self.layout, self.target.world_size, self.ds
        groups, template = self.group_numels(), self.template()
        totals = [sum(numel for _, numel in group) for group in groups]
        sizes = [zero12_partition_numel(total, world) for total in totals]
        self.weights = {
            name: torch.empty(layout.shapes[name], dtype=layout.param_dtype)
            for group in layout.groups
            for name in group
        }
        group_of = list(range(len(groups)))
        for rank in range(world):
            partitions = [_Partition(size, layout.master_dtype, template) for size in sizes]
            pieces = zero12_rank_pieces(groups, rank, world)
            self.fill(pieces, partitions)
            # DeepSpeed's padding of this rank: what of its partition lies past the group's end
            paddings = [
                min(size, max(0, (rank + 1) * size - total))
                for size, total in zip(sizes, totals, strict=True)
            ]
            mappings = [
                OrderedDict(
                    (p.name, ds.fragment_address(numel=p.numel, start=p.flat_start))
                    for p in pieces
                    if p.group == group
                )
                for group in group_of
            ]
            self.optim_file(
                rank,
                {
                    "loss_scaler": ds.loss_scaler(scale=1.0),
                    "dynamic_loss_scale": False,
                    "overflow": False,
                    "clip_grad": float(self.config["optim"]["grad_clip"]),
                    "base_optimizer_state": _client_state_dict(
                        partitions, self.steps(groups), layout.settings, group_of
                    ),
                    "single_partition_of_fp32_groups": [
                        p.master[: p.master.numel() - padding]
                        for p, padding in zip(partitions, paddings, strict=True)
                    ],
                    "zero_stage": ds.stage_enum(self.target.stage),
                    "group_paddings": paddings,
                    "param_alignment_paddings": [[0] * len(group) for group in groups],
                    "partition_count": [world] * len(groups),
                    "ds_version": ds.version,
                    "param_slice_mappings": mappings,
                },
            )
        shapes = [OrderedDict((name, layout.shapes[name]) for name, _ in group) for group in groups]
        self.model_states("mp_rank_00_model_states", self.weights, shapes, dict(layout.aliases))

    def stage_3(self) -> None:
        layout, world, ds = self.layout, self.target.world_size, self.ds
        size = int(zero_settings(self.config).get("sub_group_size", SUB_GROUP_SIZE))
        sub_groups, group_of = zero3_sub_groups(self.group_numels(), world, size)
        template = self.template()
        partitioned = {
            name: torch.empty(0, dtype=layout.param_dtype)
            for group in layout.groups
            for name in group
        }
        shapes = [
            OrderedDict((name, layout.shapes[name]) for name, _ in group) for group in sub_groups
        ]
        for rank in range(world):
            partitions = [
                _Partition(
                    sum(math.ceil(n / world) for _, n in group), layout.master_dtype, template
                )
                for group in sub_groups
            ]
            self.fill(zero3_rank_pieces(sub_groups, rank, world), partitions)
            self.optim_file(
                rank,
                {
                    "zero_stage": ds.stage_enum(3),
                    "loss_scaler": ds.loss_scaler(scale=1.0),
                    "dynamic_loss_scale": False,
                    "overflow": False,
                    "partition_count": world,
                    "optimizer_state_dict": _client_state_dict(
                        partitions, self.steps(sub_groups), layout.settings, group_of
                    ),
                    "fp32_flat_groups": [partition.master for partition in partitions],
                },
            )
            shared = dict(layout.aliases) if rank == 0 else {}  # DeepSpeed lists them on rank 0
            name = f"zero_pp_rank_{rank}_mp_rank_00_model_states"
            self.model_states(name, partitioned, shapes, shared)


def write_zero(
    tmp: Path,
    state: FullState,
    layout: ModelLayout,
    target: Target,
    config: dict[str, Any],
    trainer: dict[str, Any],
) -> None:
    """Write ``state`` into ``tmp`` as DeepSpeed's ``target.stage`` on ``target.world_size``
    ranks saves it; ``config`` is the run's recorded config, ``trainer`` the client state."""
    writer = _ZeroWriter(tmp, state, layout, target, config, trainer, _deepspeed())
    if target.stage < 3:
        writer.stages_1_2()
    else:
        writer.stage_3()
