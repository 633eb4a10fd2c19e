"""The rank-independent checkpoint layout: one safetensors file of full tensors per parameter.

Invariants: nothing in it is pickled, so reading it can run no code; it is written into
a hidden temporary directory next to its final place and renamed into place after
``meta.json`` (``checkpoint.seal``), as every checkpoint; the writer holds one
parameter's state in memory at a time.

A directory holds ``params/NAME.safetensors`` (each component of parameter ``NAME``, the
full tensor flattened to 1-D in its saved dtype), ``trainer.json`` and
``trainer.safetensors`` (the trainer's client state), ``model_config.json`` and
``tokenizer.model`` copied from the source, and ``meta.json`` (``layout: universal``,
``converted_from``, ``parameters``, ``files``). Any engine resumes from it on any number
of ranks (``collage_train.checkpoint.full_state``); its next checkpoint is again in that
engine's own layout. Every file: docs/distributed.md, "The rank-independent layout".
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from collage_train import checkpoint
from collage_train.checkpoint.param_state import FullState
from collage_train.errors import CheckpointError

UNIVERSAL = "universal"
COPIED = ("model_config.json", "tokenizer.model")
_TENSOR = "__tensor__"


def _split_tensors(tree: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """``tree`` with each tensor replaced by a reference into ``tensors``."""
    if torch.is_tensor(tree):
        key = f"t{len(tensors)}"
        tensors[key] = tree.contiguous()
        return {_TENSOR: key}
    if isinstance(tree, dict):
        return {str(key): _split_tensors(value, tensors) for key, value in tree.items()}
    if isinstance(tree, list | tuple):
        return [_split_tensors(value, tensors) for value in tree]
    return tree


def _join_tensors(tree: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(tree, dict):
        if set(tree) == {_TENSOR}:
            return tensors[tree[_TENSOR]]
        return {key: _join_tensors(value, tensors) for key, value in tree.items()}
    if isinstance(tree, list):
        return [_join_tensors(value, tensors) for value in tree]
    return tree


def read_trainer_state(path: Path) -> dict[str, Any]:
    """The trainer's client state of a checkpoint in this layout."""
    tensors = load_file(path / "trainer.safetensors")
    return _join_tensors(json.loads((path / "trainer.json").read_text()), tensors)


def _file_name(name: str) -> str:
    if "/" in name or name.startswith("."):
        raise CheckpointError(f"parameter name {name!r} cannot name a file")
    return f"params/{name}.safetensors"


def write_universal(
    source: Path, state: FullState, out: Path, meta_changes: dict[str, Any] | None = None
) -> Path:
    """Write ``state`` (read from checkpoint ``source``) into directory ``out`` in this layout,
    with the source's metadata updated by ``meta_changes`` (a switch of strategy).

    ``out`` must not exist; an unfinished write leaves only a hidden ``.NAME.tmp``.
    """
    tmp = checkpoint.begin_new_directory(out)
    (tmp / "params").mkdir()
    parameters = {}
    for name, shape in state.shapes.items():
        components = {key: value.contiguous() for key, value in state.read(name).items()}
        file = _file_name(name)
        save_file(components, str(tmp / file))
        parameters[name] = {"shape": list(shape), "step": state.steps.get(name, 0), "file": file}
    tensors: dict[str, torch.Tensor] = {}
    tree = _split_tensors(state.trainer, tensors)
    save_file(tensors, str(tmp / "trainer.safetensors"))
    (tmp / "trainer.json").write_text(json.dumps(tree))
    extra = {name: (source / name).read_bytes() for name in COPIED if (source / name).is_file()}
    source_meta = checkpoint.read_meta(source)
    meta = {
        **{key: value for key, value in source_meta.items() if key != "files"},
        "layout": UNIVERSAL,
        "converted_from": {
            "distributed": state.layout,
            "world_size": state.world_size,
            "per_rank_rng": state.per_rank_rng,
        },
        "parameters": parameters,
        **(meta_changes or {}),
    }
    return checkpoint.publish_directory(tmp, out, meta, extra)
