"""Any checkpoint written in an engine's own layout: DeepSpeed ZeRO-1/2/3 on N ranks, or one
process (``unsharded``), as that engine's ``save`` would have written it on that many ranks.

Input is any checkpoint ``full_state`` reads; the engine's own loader then reads the
output (``engine.load``: a plain, non-elastic resume with that engine and number of
ranks), and so do DeepSpeed's tools (``zero_to_fp32``). The one-process files are
``engine.single``'s, DeepSpeed's ``zero_layout``'s. What the engine would have held is
rebuilt from the checkpoint's record of the run; ``meta.json`` says that engine on that
many ranks wrote it, ``converted_from`` names the source. A target the run could not
resume on is refused in one line before anything is written. The source is read one
parameter (or one rank's piece of it) at a time; writes are atomic (``checkpoint.seal``).
What is rebuilt from what, and what is held: docs/design.md, "Checkpoint layouts".
"""

from __future__ import annotations

import copy
import json
import shutil
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from collage_train import checkpoint
from collage_train.checkpoint import whole_tensor
from collage_train.checkpoint.full_state import ZERO_ENGINES
from collage_train.checkpoint.native_spec import ModelLayout, Target
from collage_train.checkpoint.param_state import INDEX_COMPONENTS, FullState
from collage_train.checkpoint.universal import COPIED
from collage_train.checkpoint.zero_layout import write_zero, zero_settings
from collage_train.config.schema import current_choice
from collage_train.errors import CheckpointError, ConfigError
from collage_train.optim.param_groups import decay_param_groups
from collage_train.precision import PrecisionStrategy, strategy_for
from collage_train.scalify.params import SCALE_SUFFIX

ENGINES = ("unsharded", *ZERO_ENGINES)
# zero_optimization settings that put elements elsewhere in DeepSpeed's flat partitions
MOVES_ELEMENTS = ("round_robin_gradients", "parameter_alignment")


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
    if engine in ZERO_ENGINES:  # e.g. scalify: fp16 parameters DeepSpeed cannot shard
        strategy_for(OmegaConf.create(config["precision"])).check_engine(engine)
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
    moved = [key for key in MOVES_ELEMENTS if zero_settings(config).get(key)]
    if engine in ZERO_ENGINES and moved:
        raise ConfigError(
            f"the run sets distributed.deepspeed.zero_optimization.{moved[0]}, which moves "
            "elements within DeepSpeed's partitions; this converter writes DeepSpeed's default "
            "layout only (convert --to universal: every engine resumes from it)"
        )
    return Target(engine, world_size)


# ------------------------------------------------------------------ the model


def model_layout(source: Path, meta: dict[str, Any], strategy: PrecisionStrategy) -> ModelLayout:
    """The trainer's model rebuilt on the meta device from ``source``'s ``model_config.json``:
    parameter groups (``decay_param_groups``), tied names, state-dict keys."""
    from transformers import AutoConfig

    from collage_train.model.hf_modeling import AutoModelForCausalLM

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


def _trainer_state(state: FullState, target: Target) -> dict[str, Any]:
    """Rank 0's trainer state; its loader position counts samples, so only the world size it
    was written for changes."""
    trainer = dict(state.trainer)
    trainer["loader"] = {**trainer["loader"], "world_size": target.world_size}
    return trainer


def _module_state(
    layout: ModelLayout, weights: dict[str, torch.Tensor], scales: dict[str, torch.Tensor]
) -> OrderedDict[str, torch.Tensor]:
    """The module's state dict: each weight under every name of it, and after it the scale
    buffer of a ``scalify`` parameter (``scalify.params``: one per holding module)."""
    module: OrderedDict[str, torch.Tensor] = OrderedDict()
    for key in layout.keys:
        name = layout.aliases.get(key, key)
        module[key] = weights[name]
        if name in scales:
            module[key + SCALE_SUFFIX] = scales[name]
    return module


def _write_unsharded(
    tmp: Path, state: FullState, layout: ModelLayout, trainer: dict[str, Any]
) -> None:
    """``model.pt``, ``optimizer.pt`` and ``trainer.pt`` as ``engine.single`` saves them."""
    weights, scales, entries = {}, {}, {}
    names = [name for group in layout.groups for name in group]
    for index, name in enumerate(names):
        components, shape = whole_tensor.compact(state.read(name)), layout.shapes[name]
        weights[name] = components.pop("weight").view(shape)
        if "weight_scale" in components:  # a scalify parameter's scale: a model buffer
            scales[name] = components.pop("weight_scale")
        if components:
            entry: dict[str, Any] = {"step": state.steps[name]}
            for key, value in components.items():
                kept = key in INDEX_COMPONENTS or key in whole_tensor.LAYOUT_KEYS
                entry[key] = value if kept else value.view(shape)
            entries[index] = entry
    starts = [sum(len(group) for group in layout.groups[:g]) for g in range(len(layout.groups))]
    groups = [
        {**setting, "params": list(range(start, start + len(group)))}
        for setting, start, group in zip(layout.settings, starts, layout.groups, strict=True)
    ]
    checkpoint.write_tensors(
        tmp,
        {
            "model": _module_state(layout, weights, scales),
            "optimizer": {"state": entries, "param_groups": groups, "param_names": names},
            "trainer": trainer,
        },
    )


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
        trainer = _trainer_state(state, target)
        if target.stage:
            write_zero(tmp, state, layout, target, meta["config"], trainer)
        else:
            _write_unsharded(tmp, state, layout, trainer)
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
    lost = []
    if max(int(source["world_size"]), world) > 1:
        lost.append("per-rank RNG streams (every rank continues from rank 0's generator)")
    precision = meta.get("config", {}).get("precision")
    spec = strategy_for(OmegaConf.create(precision)).optimizer if precision else None
    if spec and (spec.kind == "stochastic_rounding" or spec.fused_mode == "light_blockwise8"):
        # a stream names a tensor of the writer's layout (optim.rounding_noise)
        lost.append("stochastic-rounding streams (each tensor there draws a new one)")
    if spec and spec.moments == "blockwise8":
        lost.append(whole_tensor.EIGHT_BIT_RECUT)
    return (
        f"wrote {out} (distributed={engine} on {world} rank(s), the engine's own layout: it "
        f"resumes there without resharding); carried over: {', '.join(meta.get('holds', []))}, "
        f"step, data position, rank 0's RNG; not carried over: {'; '.join(lost) or 'nothing'}"
    )
