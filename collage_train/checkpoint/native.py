"""Any checkpoint written in an engine's own layout: DeepSpeed ZeRO-1/2/3 on N ranks, or one
process (``unsharded``), as that engine's ``save`` would have written it on that many ranks.

The engine's own loader then reads it (``engine.load``: a plain, non-elastic resume with
that engine and number of ranks), and so do DeepSpeed's tools (``zero_to_fp32``). Input is
any checkpoint ``full_state`` reads (one process, ZeRO-k on M ranks, the universal layout).

Files, as DeepSpeed 0.19 writes them (``engine._save_checkpoint``/``_save_zero_checkpoint``):

- stages 1-2: per rank R ``[bf16_]zero_pp_rank_R_mp_rank_00_optim_states.pt``: the client
  optimizer's ``state_dict`` for the rank's flat partition of each parameter group
  (``base_optimizer_state``; tensors of the whole partition, end padding included), the
  partition's master (``single_partition_of_fp32_groups``, whatever its dtype, without the
  group's end padding), ``param_slice_mappings`` (where each parameter's fragment starts in
  the partition), paddings, partition counts and DeepSpeed's records; and one
  ``mp_rank_00_model_states.pt``: the module's state dict (the weights), ``param_shapes``
  per group, ``shared_params`` (tied weights), DeepSpeed's step counters, and the trainer's
  state under ``trainer``;
- stage 3: per rank the optimizer file (``fp32_flat_groups``: one flat tensor per sub-group,
  shard R of each parameter) and ``zero_pp_rank_R_mp_rank_00_model_states.pt`` (the
  module's tensors empty, as DeepSpeed saves partitioned weights);
- one process: ``model.pt``, ``optimizer.pt`` (state by index and ``param_names``),
  ``trainer.pt`` (``engine.single``).

Where elements lie is ``pieces``' DeepSpeed arithmetic with the defaults that fix it (no
``round_robin_gradients``, no ``parameter_alignment``: a run that set either is refused in
one line). The parameter groups are the trainer's (``optim.decay_param_groups`` of the model
rebuilt on the meta device from ``model_config.json``, which also names tied weights); their
hyperparameters are the strategy's optimizer's, built from the recorded config (the trainer
sets the learning rate again before every step). ``meta.json`` says that engine on that many
ranks wrote it (``distributed``, ``world_size``, the config's ``distributed``), so that a resume
with them takes the engine's own loader; ``converted_from`` names the source. What a rank
resumes besides its partitions is rank 0's trainer state (step, loader position with the new
world size, RNG), as DeepSpeed's single model-states file gives every rank at stages 1-2.
DeepSpeed's own counters are derived (``global_steps`` = the step, ``skipped_steps`` 0: bf16
and fp32 runs never skip), and ``ds_config`` records the settings the layout depends on
(batch split, clipping, bf16, ZeRO section), not every key the engine renders at launch.

Memory: the source is read one parameter (or one rank's piece of it) at a time. What is held
is one output file's tensors while they are filled: for ZeRO one rank's flat partitions with
their optimizer state (the run's state bytes per parameter / N: what that rank holds when it
trains) and, at stages 1-2, the weights in their own dtype (all go into the one model-states
file); for one process the whole model state, as the one process that resumes it holds.
Writes are atomic: a hidden temporary directory, ``meta.json`` last, then a rename.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import shutil
import sys
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from collage_train import checkpoint
from collage_train.checkpoint.full_state import INDEX_COMPONENTS, ZERO_ENGINES, FullState
from collage_train.checkpoint.pieces import (
    Piece,
    zero3_rank_pieces,
    zero3_sub_groups,
    zero12_partition_numel,
    zero12_rank_pieces,
)
from collage_train.checkpoint.universal import COPIED
from collage_train.config import current_choice
from collage_train.errors import CheckpointError, ConfigError
from collage_train.optim.param_groups import decay_param_groups
from collage_train.precision import PrecisionStrategy, strategy_for

ENGINES = ("unsharded", *ZERO_ENGINES)
SUB_GROUP_SIZE = 1_000_000_000  # DeepSpeed's default zero_optimization.sub_group_size
# zero_optimization settings that put elements elsewhere in DeepSpeed's flat partitions
MOVES_ELEMENTS = ("round_robin_gradients", "parameter_alignment")


@dataclass(frozen=True)
class Target:
    """The engine and number of ranks a checkpoint is written for."""

    engine: str  # unsharded | zero1 | zero2 | zero3
    world_size: int

    @property
    def stage(self) -> int:
        """The ZeRO stage; 0 for one process."""
        return int(self.engine[-1]) if self.engine in ZERO_ENGINES else 0


def _zero_settings(config: dict[str, Any]) -> dict[str, Any]:
    """The ``zero_optimization`` keys a run added through ``distributed.deepspeed``."""
    extra = (config.get("distributed") or {}).get("deepspeed") or {}
    return dict(extra.get("zero_optimization") or {})


def check_target(meta: dict[str, Any], engine: str, world_size: int | None) -> Target:
    """The target ``engine`` on ``world_size`` ranks for a checkpoint with ``meta``; raises a
    one-line ConfigError where that engine could not resume the run there."""
    if engine not in ENGINES:
        raise ConfigError(
            f"unknown layout {engine!r}; choose one of: universal, {', '.join(ENGINES)}"
        )
    if engine == "unsharded":
        if world_size not in (None, 1):
            raise ConfigError("--to unsharded is one process: --world-size must be 1 (or left out)")
        world_size = 1
    if world_size is None:
        raise ConfigError(f"--to {engine} needs --world-size N, the number of ranks to write")
    if world_size < 1:
        raise ConfigError(f"--world-size must be at least 1, got {world_size}")
    config = meta.get("config")
    if not isinstance(config, dict) or "train" not in config or "precision" not in config:
        raise CheckpointError("meta.json records no run configuration to write a layout for")
    comm = current_choice("comm", str(meta.get("comm", "every_step")))
    if comm != "every_step":
        raise ConfigError(
            f"the checkpoint was written by comm={comm} replicas, each with a state of its own; "
            "it resumes only with the replicas that wrote it"
        )
    strategy = strategy_for(OmegaConf.create(config["precision"]))
    if engine in ZERO_ENGINES and not strategy.runs_under_zero:
        raise ConfigError(
            f"precision={strategy.name} does not run under DeepSpeed ZeRO; convert it --to "
            "unsharded or --to universal"
        )
    global_batch = int(config["train"]["global_batch_size"])
    micro_batch = int(config["train"]["micro_batch_size"])
    if global_batch % (micro_batch * world_size):
        sizes = [
            n
            for n in range(1, global_batch // micro_batch + 1)
            if global_batch % (micro_batch * n) == 0
        ]
        raise ConfigError(
            f"train.global_batch_size={global_batch} (recorded in meta.json) does not split into "
            f"train.micro_batch_size={micro_batch} x {world_size} ranks; choose a world size "
            f"among {sizes}"
        )
    moved = [key for key in MOVES_ELEMENTS if _zero_settings(config).get(key)]
    if engine in ZERO_ENGINES and moved:
        raise ConfigError(
            f"the run sets distributed.deepspeed.zero_optimization.{moved[0]}, which moves "
            "elements within DeepSpeed's partitions; this converter writes DeepSpeed's default "
            "layout only (convert --to universal: every engine resumes from it)"
        )
    return Target(engine, world_size)


# ------------------------------------------------------------------ the model


@dataclass(frozen=True)
class ModelLayout:
    """What the trainer's model and optimizer look like, without their values."""

    groups: list[list[str]]  # the optimizer's parameter groups, each parameter's name in order
    shapes: dict[str, torch.Size]
    aliases: dict[str, str]  # a tied weight's other name -> the parameter's own name
    keys: list[str]  # the module's state-dict keys, in order
    settings: list[dict[str, Any]]  # each group's hyperparameters, as the optimizer saves them
    param_dtype: torch.dtype
    master_dtype: torch.dtype  # of DeepSpeed's flat master partitions

    def numel(self, name: str) -> int:
        return math.prod(self.shapes[name])


def model_layout(source: Path, meta: dict[str, Any], strategy: PrecisionStrategy) -> ModelLayout:
    """The trainer's model rebuilt on the meta device from ``source``'s ``model_config.json``:
    parameter groups (``decay_param_groups``), tied names, state-dict keys."""
    from transformers import AutoConfig, AutoModelForCausalLM

    file = source / "model_config.json"
    if not file.is_file():
        raise CheckpointError(f"{source} holds no model_config.json, which describes its model")
    fields = json.loads(file.read_text())
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(
            AutoConfig.for_model(fields.pop("model_type"), **fields)
        )
    own: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in own:
            aliases[name] = own[id(param)]
        else:
            own[id(param)] = name
    keys = list(model.state_dict())
    buffers = [key for key in keys if key not in aliases and key not in own.values()]
    if buffers:
        raise CheckpointError(
            f"the model has buffers ({', '.join(buffers[:3])}), which this converter does not "
            "write; convert --to universal"
        )
    optim_cfg = OmegaConf.create(meta["config"]["optim"])
    groups = decay_param_groups(model, optim_cfg.weight_decay)
    stand_ins = [
        {**group, "params": [torch.zeros(1, dtype=strategy.param_dtype, requires_grad=True)]}
        for group in groups
    ]
    saved_groups = strategy.build_optimizer(stand_ins, optim_cfg).state_dict()["param_groups"]
    return ModelLayout(
        groups=[[own[id(param)] for param in group["params"]] for group in groups],
        shapes={name: model.get_parameter(name).shape for name in own.values()},
        aliases=aliases,
        keys=keys,
        settings=[{k: v for k, v in group.items() if k != "params"} for group in saved_groups],
        param_dtype=strategy.param_dtype,
        master_dtype=strategy.master_dtype or strategy.param_dtype,
    )


# ---------------------------------------------------------- DeepSpeed's files


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
            key: torch.zeros(numel, dtype=value.dtype)
            for key, value in template.items()
            if key not in INDEX_COMPONENTS
        }
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
        """The client optimizer's state of this flat tensor (None: it has none yet)."""
        if not self.state and not self.positions:
            return None
        positions = {key: torch.cat(parts) for key, parts in self.positions.items()}
        return {"step": step, **self.state, **positions}


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


def _ds_config(config: dict[str, Any], layout: ModelLayout, target: Target) -> dict[str, Any]:
    train = config["train"]
    micro, total = int(train["micro_batch_size"]), int(train["global_batch_size"])
    return {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": total // (micro * target.world_size),
        "train_batch_size": total,
        "gradient_clipping": config["optim"]["grad_clip"],
        "bf16": {"enabled": layout.param_dtype == torch.bfloat16},
        "zero_optimization": {**_zero_settings(config), "stage": target.stage},
    }


@dataclass
class _Writer:
    """Writes one checkpoint of ``state`` for ``target`` into directory ``tmp``."""

    tmp: Path
    state: FullState
    layout: ModelLayout
    target: Target
    config: dict[str, Any]

    def trainer(self) -> dict[str, Any]:
        """Rank 0's trainer state; its loader position counts samples, so only the world
        size it was written for changes."""
        trainer = dict(self.state.trainer)
        trainer["loader"] = {**trainer["loader"], "world_size": self.target.world_size}
        return trainer

    def template(self) -> dict[str, torch.Tensor]:
        """Every optimizer-state component (name and dtype) of one element."""
        components = self.state.read(self.layout.groups[0][0], 0, 1)
        components.pop("weight")
        components.pop("master", None)
        return components

    def read(self, piece: Piece) -> dict[str, torch.Tensor]:
        return self.state.read(piece.name, piece.param_start, piece.param_stop)

    # ------------------------------------------------------------ one process

    def unsharded(self) -> None:
        layout, weights, entries = self.layout, {}, {}
        names = [name for group in layout.groups for name in group]
        for index, name in enumerate(names):
            components, shape = self.state.read(name), layout.shapes[name]
            weights[name] = components.pop("weight").view(shape)
            if components:
                entry: dict[str, Any] = {"step": self.state.steps[name]}
                for key, value in components.items():
                    entry[key] = value if key in INDEX_COMPONENTS else value.view(shape)
                entries[index] = entry
        starts = [sum(len(group) for group in layout.groups[:g]) for g in range(len(layout.groups))]
        groups = [
            {**setting, "params": list(range(start, start + len(group)))}
            for setting, start, group in zip(layout.settings, starts, layout.groups, strict=True)
        ]
        checkpoint.write_tensors(
            self.tmp,
            {
                "model": OrderedDict(
                    (key, weights[layout.aliases.get(key, key)]) for key in layout.keys
                ),
                "optimizer": {"state": entries, "param_groups": groups, "param_names": names},
                "trainer": self.trainer(),
            },
        )

    # ------------------------------------------------------------------- ZeRO

    def zero(self) -> None:
        ds = _deepspeed()
        if self.target.stage < 3:
            self._zero12(ds)
        else:
            self._zero3(ds)

    def _group_numels(self) -> list[list[tuple[str, int]]]:
        return [[(name, self.layout.numel(name)) for name in group] for group in self.layout.groups]

    def _optim_file(self, ds: _DeepSpeed, rank: int, optimizer_state: dict[str, Any]) -> None:
        prefix = "bf16_" if self.layout.param_dtype == torch.bfloat16 else ""
        saved = {
            "optimizer_state_dict": optimizer_state,
            "ds_config": _ds_config(self.config, self.layout, self.target),
            "ds_version": ds.version,
        }
        name = f"{prefix}zero_pp_rank_{rank}_mp_rank_00_optim_states"
        checkpoint.write_tensors(self.tmp, {name: saved})

    def _model_states(
        self,
        ds: _DeepSpeed,
        name: str,
        module: dict[str, torch.Tensor],
        param_shapes: list[OrderedDict[str, torch.Size]],
        shared: dict[str, str],
    ) -> None:
        step = int(self.state.trainer["step"])
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
            "skipped_steps": 0,
            "global_steps": step,
            "global_samples": step * total,
            "dp_world_size": self.target.world_size,
            "mp_world_size": 1,
            "checkpoint_parallel_dimensions": {"pp_degree": 1, "tp_degree": 1},
            "ds_config": _ds_config(self.config, self.layout, self.target),
            "ds_version": ds.version,
            "trainer": self.trainer(),
        }
        checkpoint.write_tensors(self.tmp, {name: saved})

    def _steps(self, groups: list[list[tuple[str, int]]]) -> list[int]:
        return [self.state.steps[group[0][0]] for group in groups]

    def _zero12(self, ds: _DeepSpeed) -> None:
        layout, world = self.layout, self.target.world_size
        groups, template = self._group_numels(), self.template()
        totals = [sum(numel for _, numel in group) for group in groups]
        sizes = [zero12_partition_numel(total, world) for total in totals]
        weights = {
            name: torch.empty(layout.shapes[name], dtype=layout.param_dtype)
            for group in layout.groups
            for name in group
        }
        group_of = list(range(len(groups)))
        for rank in range(world):
            partitions = [_Partition(size, layout.master_dtype, template) for size in sizes]
            pieces = zero12_rank_pieces(groups, rank, world)
            for piece in pieces:
                weight = partitions[piece.group].put(piece, self.read(piece))
                if weight.dtype != layout.param_dtype:
                    raise CheckpointError(f"the checkpoint holds {piece.name} in {weight.dtype}")
                weights[piece.name].view(-1)[piece.param_start : piece.param_stop] = weight
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
            self._optim_file(
                ds,
                rank,
                {
                    "loss_scaler": ds.loss_scaler(scale=1.0),
                    "dynamic_loss_scale": False,
                    "overflow": False,
                    "clip_grad": float(self.config["optim"]["grad_clip"]),
                    "base_optimizer_state": _client_state_dict(
                        partitions, self._steps(groups), layout.settings, group_of
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
        self._model_states(ds, "mp_rank_00_model_states", weights, shapes, dict(layout.aliases))

    def _zero3(self, ds: _DeepSpeed) -> None:
        layout, world = self.layout, self.target.world_size
        size = int(_zero_settings(self.config).get("sub_group_size", SUB_GROUP_SIZE))
        sub_groups, group_of = zero3_sub_groups(self._group_numels(), world, size)
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
            for piece in zero3_rank_pieces(sub_groups, rank, world):
                partitions[piece.group].put(piece, self.read(piece))
            self._optim_file(
                ds,
                rank,
                {
                    "zero_stage": ds.stage_enum(3),
                    "loss_scaler": ds.loss_scaler(scale=1.0),
                    "dynamic_loss_scale": False,
                    "overflow": False,
                    "partition_count": world,
                    "optimizer_state_dict": _client_state_dict(
                        partitions, self._steps(sub_groups), layout.settings, group_of
                    ),
                    "fp32_flat_groups": [partition.master for partition in partitions],
                },
            )
            shared = dict(layout.aliases) if rank == 0 else {}  # DeepSpeed lists them on rank 0
            name = f"zero_pp_rank_{rank}_mp_rank_00_model_states"
            self._model_states(ds, name, partitioned, shapes, shared)


def _meta(meta: dict[str, Any], state: FullState, target: Target) -> dict[str, Any]:
    """``meta`` of the source as ``target``'s engine would have recorded it."""
    written = {
        key: value
        for key, value in meta.items()
        if key not in ("files", "layout", "converted_from", "parameters")
    }
    config = copy.deepcopy(written["config"])
    config.setdefault("distributed", {}).update(name=target.engine, zero_stage=target.stage or None)
    return {
        **written,
        "distributed": target.engine,
        "world_size": target.world_size,
        "config": config,
        "converted_from": {
            "distributed": state.layout,
            "world_size": state.world_size,
            "per_rank_rng": state.per_rank_rng,
        },
    }


def write_native(source: Path, state: FullState, out: Path, target: Target) -> Path:
    """Write ``state`` (read from checkpoint ``source``) into the new directory ``out`` in
    ``target``'s layout; ``target`` comes from ``check_target``."""
    meta = checkpoint.read_meta(source)
    strategy = strategy_for(OmegaConf.create(meta["config"]["precision"]))
    layout = model_layout(source, meta, strategy)
    state.check_model({name: tuple(shape) for name, shape in layout.shapes.items()}, source)
    tmp = checkpoint.begin_new_directory(out)
    try:
        writer = _Writer(tmp, state, layout, target, meta["config"])
        if target.stage:
            writer.zero()
        else:
            writer.unsharded()
        extra = {name: (source / name).read_bytes() for name in COPIED if (source / name).is_file()}
        return checkpoint.publish_directory(tmp, out, _meta(meta, state, target), extra)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def describe(out: Path) -> str:
    """One line on a checkpoint ``write_native`` wrote: what it is and what carried over."""
    meta = checkpoint.read_meta(out)
    engine, world = meta["distributed"], meta["world_size"]
    source = meta["converted_from"]
    lost = (
        "per-rank RNG streams (every rank continues from rank 0's generator)"
        if max(int(source["world_size"]), world) > 1
        else "nothing"
    )
    return (
        f"wrote {out} (distributed={engine} on {world} rank(s), the engine's own layout: it "
        f"resumes there without resharding); carried over: {', '.join(meta.get('holds', []))}, "
        f"step, data position, rank 0's RNG; not carried over: {lost}"
    )
