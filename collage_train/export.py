"""``python -m collage_train.export PATH [--out DIR]``: a transformers model from a checkpoint.

PATH is a run directory (its newest checkpoint is used) or a ``checkpoints/step-N``
directory, written by one process, by DeepSpeed ZeRO on any number of ranks, or by
DiLoCo/SparseLoCo replicas (rank 0's replica; the shared model at an outer step). ZeRO
shards are consolidated on the CPU (no launcher or GPU needed) and the weights are
written in the run's parameter dtype (bf16 for every strategy but fp32 and the Scalify
ones; precision=scalify's scaled fp16 data is written as its fp32 values). The output,
``<run dir>/hf-step-N`` by default, loads with ``AutoModelForCausalLM.from_pretrained``.
Every ``.pt`` file of the checkpoint is verified to unpickle without running code before
any of it is loaded, whatever its ``meta.json`` claims (``checkpoint.verify_checkpoint_files``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from transformers import AutoConfig

from collage_train import checkpoint
from collage_train.checkpoint.full_state import layout_of
from collage_train.data import Tokenizer
from collage_train.data.hf_files import save_tokenizer
from collage_train.errors import BAD_INPUT, WEIGHT_LOAD_ERRORS, CollageError, first_line
from collage_train.model.cast import cast_model
from collage_train.model.hf_modeling import AutoModelForCausalLM, PreTrainedModel
from collage_train.precision import get_strategy
from collage_train.scalify.params import has_scaled_parameters, unscale_weights

if TYPE_CHECKING:
    from collage_train.engine import Engine


def export_from_engine(engine: Engine, tokenizer: Any, target: Path) -> None:
    """Export a training run's model from its engine: under ZeRO-3 every rank takes part in
    gathering the weights (``engine.full_weights``); rank 0 writes. Every rank meets the
    others at the closing barrier, also when rank 0's writing fails (then raises there)."""
    try:
        with engine.full_weights() as model:
            if engine.is_main:
                export_model(model, tokenizer, target)
    finally:
        engine.barrier()


def export_model(model: torch.nn.Module, tokenizer: Any, target: Path) -> None:
    """``save_pretrained`` plus the tokenizer into ``target``, replacing it atomically.

    A model whose parameters are scaled fp16 (precision=scalify) is written as its fp32
    values, ordinary weights (``scalify.params.unscale_weights``)."""
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    # precision=scalify holds scaled fp16 data and scales: write the values (fp32) instead
    scaled = has_scaled_parameters(model)
    model.save_pretrained(tmp, state_dict=unscale_weights(model.state_dict()) if scaled else None)
    if scaled:  # save_pretrained records the parameters' dtype (fp16); the weights are fp32
        config_file = tmp / "config.json"
        config = json.loads(config_file.read_text())
        config_file.write_text(json.dumps({**config, "dtype": "float32"}, indent=2) + "\n")
    save_tokenizer(tokenizer, tmp)
    if target.exists():
        shutil.rmtree(target)
    os.rename(tmp, target)


def resolve_checkpoint(path: Path) -> Path:
    """``path`` itself if it is a checkpoint, else the newest checkpoint of the run in it."""
    if (path / checkpoint.META).is_file():
        return path
    latest = checkpoint.latest_checkpoint(path)
    if latest is None:
        raise FileNotFoundError(f"{path} is neither a checkpoint nor a run directory holding one")
    return latest


def checkpoint_weights(path: Path) -> dict[str, torch.Tensor]:
    """The whole model's weights from checkpoint ``path``, in the run's parameter dtype
    (fp32 values for precision=scalify's scaled fp16 data)."""
    checkpoint.verify_checkpoint_files(path)  # before DeepSpeed's unrestricted torch.load
    meta = checkpoint.read_meta(path)
    if (path / "replica-0").is_dir():  # comm=diloco|sparseloco: rank 0's replica
        return unscale_weights(checkpoint.load_checkpoint_file(path / "replica-0", "model"))
    if layout_of(meta) == "unsharded":  # scalify's scaled data: the values
        return unscale_weights(checkpoint.load_checkpoint_file(path, "model"))
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed narrates the consolidation
        weights = get_fp32_state_dict_from_zero_checkpoint(str(path.parent), tag=path.name)
    dtype = get_strategy(meta["precision"]).param_dtype
    return {name: tensor.to(dtype) for name, tensor in weights.items()}


def load_checkpoint_model(path: Path) -> tuple[PreTrainedModel, Tokenizer]:
    """The transformers model and tokenizer stored with checkpoint ``path``."""
    fields = json.loads((path / "model_config.json").read_text())
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    weights = checkpoint_weights(path)
    model = cast_model(AutoModelForCausalLM.from_config(config), next(iter(weights.values())).dtype)
    model.load_state_dict(weights)
    return model, Tokenizer.load(path / "tokenizer.model")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m collage_train.export", description=__doc__)
    parser.add_argument("path", type=Path, help="run directory or checkpoints/step-N directory")
    parser.add_argument("--out", type=Path, help="output directory (default: <run>/hf-step-N)")
    args = parser.parse_args(argv)
    try:
        path = resolve_checkpoint(args.path)
        model, tokenizer = load_checkpoint_model(path)
    except (CollageError, *WEIGHT_LOAD_ERRORS) as err:
        print(f"error: cannot export {args.path}: {first_line(err)}", file=sys.stderr)
        return BAD_INPUT
    target = args.out or path.parent.parent / f"hf-{path.name}"
    export_model(model, tokenizer, target)
    print(f"exported {path} to {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
