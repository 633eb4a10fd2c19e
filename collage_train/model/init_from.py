"""``model.init_from=PATH``: start a new run from a local Hugging Face model directory.

The directory is our own ``hf/`` export or any local GPT-2, OPT or Llama directory
written by ``save_pretrained``; nothing is downloaded. Its ``config.json`` is the
architecture (``model.dropout`` and ``model.attn_implementation`` still apply), its
tokenizer the run's unless ``data.tokenizer`` names another (``data_config``).
Contract: the weights are read unit by unit into the model built on the meta device
(``PretrainedWeights``, given to ``model.materialise.materialise``), so no rank holds the
whole model; the values are ``load_pretrained``'s (``from_pretrained`` in fp32) cast to
the storage dtype, bit for bit; a higher-precision master is seeded from the fp32 values
(``seed_masters``, ``seed_zero_masters``); the optimizer state starts from zero. Bad input
raises ConfigError (one ``error:`` line) before any weight is read.
What is read when, and which input is refused: docs/design.md, "Starting from a Hugging
Face directory".
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from transformers import AutoConfig, PretrainedConfig
from transformers.utils import logging as hf_logging

from collage_train.errors import WEIGHT_LOAD_ERRORS, ConfigError, first_line
from collage_train.model.cast import cast_model
from collage_train.model.hf_weights import WEIGHT_FILES, WeightFiles
from collage_train.model.materialise import Load

# transformers' model_type -> our family
SUPPORTED = {"gpt2": "gpt", "opt": "opt", "llama": "llama"}
TOKENIZER_FILES = ("hf_tokenizer.json", "tokenizer.json", "tokenizer.model")
# Dropout fields per model type, set from model.dropout.
DROPOUT_FIELDS = {
    "gpt2": ("resid_pdrop", "embd_pdrop", "attn_pdrop"),
    "opt": ("dropout", "attention_dropout", "activation_dropout"),
    "llama": ("attention_dropout",),
}
# Learned position tables: a longer sequence has no embedding.
POSITION_FIELDS = {"gpt2": "n_positions", "opt": "max_position_embeddings"}


def _directory(init_from: str) -> tuple[Path, str]:
    """The directory and its model type, once it is known to hold a supported model."""
    path = Path(init_from).expanduser()
    if not path.is_dir():
        raise ConfigError(f"model.init_from={init_from}: no such directory")
    if not (path / "config.json").is_file():
        raise ConfigError(
            f"model.init_from={init_from} holds no config.json; point it to a Hugging Face "
            "model directory (written by save_pretrained, or a run's hf/ export)"
        )
    if not any((path / name).is_file() for name in WEIGHT_FILES):
        raise ConfigError(
            f"model.init_from={init_from} holds no weights ({' or '.join(WEIGHT_FILES[::2])}); "
            "export the run first (python -m collage_train.export RUN_DIR)"
        )
    try:
        model_type = json.loads((path / "config.json").read_text()).get("model_type")
    except (UnicodeDecodeError, json.JSONDecodeError, AttributeError) as err:
        raise ConfigError(
            f"model.init_from={init_from}: config.json is not a JSON object ({first_line(err)})"
        ) from None
    if model_type not in SUPPORTED:
        raise ConfigError(
            f"model.init_from={init_from} is a {model_type!r} model; supported "
            f"architectures: {', '.join(SUPPORTED)}"
        )
    return path, model_type


def pretrained_config(cfg: Any, *, vocab_size: int, seq_len: int) -> PretrainedConfig:
    """The transformers config of ``cfg.init_from``, checked against the data.

    ``vocab_size`` is the data tokenizer's: it must fit the embedding. ``seq_len`` must
    fit a learned position table (GPT-2, OPT); Llama's rotary positions have none.
    """
    path, model_type = _directory(cfg.init_from)
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    if vocab_size > config.vocab_size:
        raise ConfigError(
            f"the data's tokenizer has {vocab_size} tokens but the model in "
            f"{cfg.init_from} embeds {config.vocab_size}; use the model's own tokenizer "
            "(leave data.tokenizer unset) or one whose vocabulary fits"
        )
    positions = POSITION_FIELDS.get(model_type)
    if positions is not None and seq_len > getattr(config, positions):
        raise ConfigError(
            f"data.seq_len={seq_len} is longer than the {getattr(config, positions)} positions "
            f"the model in {cfg.init_from} learned; set data.seq_len <= "
            f"{getattr(config, positions)}"
        )
    for field in DROPOUT_FIELDS[model_type]:
        setattr(config, field, float(cfg.dropout))
    config.use_cache = False
    return config


def embedding_rows(init_from: str) -> int:
    """The token embedding's rows of the model in ``init_from`` (its config's vocab_size)."""
    path, _ = _directory(init_from)
    return int(AutoConfig.from_pretrained(path, local_files_only=True).vocab_size)


def _from_pretrained(path: str, **kwargs: Any) -> torch.nn.Module:
    """``AutoModelForCausalLM.from_pretrained`` of a local directory, fp32, quietly (no
    progress bar, no load report: what matters is checked and refused in one line)."""
    from collage_train.model.hf_modeling import AutoModelForCausalLM  # seconds: when used

    shown, verbosity = hf_logging.is_progress_bar_enabled(), hf_logging.get_verbosity()
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    try:
        return AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, local_files_only=True, **kwargs
        )
    finally:
        hf_logging.set_verbosity(verbosity)
        if shown:
            hf_logging.enable_progress_bar()


def load_pretrained(cfg: Any, *, vocab_size: int, seq_len: int) -> torch.nn.Module:
    """The fp32 model stored in ``cfg.init_from`` (checked by ``pretrained_config``).

    Every parameter must come from the directory: weights that do not load, or a weight
    the model expects and the files lack (transformers would initialise it at random), are
    refused.
    """
    config = pretrained_config(cfg, vocab_size=vocab_size, seq_len=seq_len)
    try:
        model, info = _from_pretrained(
            cfg.init_from,
            config=config,
            attn_implementation=str(cfg.attn_implementation),  # a plain str, as model/build.py
            output_loading_info=True,
        )
    except WEIGHT_LOAD_ERRORS as err:
        raise ConfigError(
            f"model.init_from={cfg.init_from}: cannot load its weights ({first_line(err)})"
        ) from None
    missing = sorted(info.get("missing_keys") or [])
    if missing:
        raise ConfigError(
            f"model.init_from={cfg.init_from}: its weights lack {len(missing)} tensor(s) the "
            f"{config.model_type} model needs (e.g. {missing[0]}); the files do not match "
            "config.json"
        )
    model.config.use_cache = False
    return cast_model(model, torch.float32)


def data_config(data_cfg: DictConfig, init_from: str | None) -> DictConfig:
    """``data_cfg`` with the tokenizer of ``init_from``, unless ``data.tokenizer`` is set.

    A directory without a tokenizer needs ``data.tokenizer``: a tokenizer trained afresh
    would give the loaded embeddings meaningless ids.
    """
    if not init_from or data_cfg.get("tokenizer"):
        return data_cfg
    path, _ = _directory(init_from)
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise ConfigError(
            f"model.init_from={init_from} holds no tokenizer ({', '.join(TOKENIZER_FILES)}); "
            "set data.tokenizer=PATH to the tokenizer the model was trained with"
        )
    copy = OmegaConf.create(OmegaConf.to_container(data_cfg, resolve=True))
    copy.tokenizer = str(path)
    return copy


def _keeps_master(strategy: Any) -> bool:
    """A master to seed: an fp32 copy, a split remainder, or (precision=scalify) the scaled
    fp16 parameter itself, which the fp32 values give its best rounding (the model's
    cast to fp16 before scaling flushes values below 2**-14 to fp16's subnormals)."""
    return (
        strategy.master_dtype is not None
        or strategy.optimizer.kind == "split_master"
        or getattr(strategy, "scaled_params", False)
    )


class PretrainedWeights:
    """The values ``cfg.init_from`` holds for ``model``'s parameters and persistent buffers,
    by the model's names, read a tensor at a time.

    A name is found as it is in the files or without transformers' base-model prefix (a
    directory saved from the base model, as ``from_pretrained`` accepts). Raises
    ConfigError, before anything is read, when the files do not load, lack a tensor the
    model needs or hold one of another shape.
    """

    def __init__(self, init_from: str, model: torch.nn.Module, *, buffers: bool = True) -> None:
        self.init_from = init_from
        prefix = f"{getattr(model, 'base_model_prefix', '')}."
        try:
            self.files = WeightFiles(Path(init_from).expanduser())
            stored = set(self.files.keys())
            self.key_of: dict[str, str] = {}
            missing, wrong = [], []
            for name, shape in needed_tensors(model, buffers=buffers).items():
                key = name if name in stored else name.removeprefix(prefix)
                if key not in stored:
                    missing.append(name)
                elif tuple(self.files.shape(key)) != tuple(shape):
                    wrong.append(f"{key} is {list(self.files.shape(key))}, not {list(shape)}")
                self.key_of[name] = key
        except WEIGHT_LOAD_ERRORS as err:
            raise self._unloadable(err) from None
        if missing:
            raise ConfigError(
                f"model.init_from={init_from}: its weights lack {len(missing)} tensor(s) the "
                f"{model.config.model_type} model needs (e.g. {missing[0]}); the files do not "
                "match config.json"
            )
        if wrong:
            raise ConfigError(
                f"model.init_from={init_from}: cannot load its weights ({wrong[0]}, as "
                "config.json makes it); the files do not match config.json"
            )

    def _unloadable(self, err: BaseException) -> ConfigError:
        return ConfigError(
            f"model.init_from={self.init_from}: cannot load its weights ({first_line(err)})"
        )

    def stored(self, name: str) -> torch.Tensor:
        """The tensor named ``name`` in the model, in its stored dtype (a view of the file)."""
        try:
            return self.files.tensor(self.key_of[name])
        except WEIGHT_LOAD_ERRORS as err:
            raise self._unloadable(err) from None

    def load(self, name: str, tensor: torch.Tensor) -> None:
        """Fill ``tensor`` (``model.materialise.materialise``'s fp32 host tensor of ``name``)."""
        tensor.copy_(self.stored(name))

    def fp32(self, name: str) -> torch.Tensor:
        """The fp32 value of ``name`` (as ``from_pretrained`` in fp32 gives it), a copy."""
        return self.stored(name).to(torch.float32, copy=True)


def weights_loader(init_from: str | None, model: torch.nn.Module) -> Load | None:
    """``model.materialise.materialise``'s ``load`` for ``model.init_from`` (checked against the
    meta model ``model``: ConfigError), None without one."""
    return PretrainedWeights(init_from, model).load if init_from else None


def needed_tensors(model: torch.nn.Module, *, buffers: bool = True) -> dict[str, torch.Size]:
    """The shapes of what ``from_pretrained`` reads into ``model``: every parameter (a
    shared one by its first name) and, with ``buffers``, every persistent buffer (the
    state dict's tensors); non-persistent buffers (rotary tables) are computed, not read.
    (The seeding of masters, after the strategy's ``prepare_model``, reads parameters only:
    Scalify adds buffers of its own.)"""
    found: dict[str, torch.Size] = {}
    seen: set[int] = set()
    for prefix, module in model.named_modules():
        dot = f"{prefix}." if prefix else ""
        for key, param in module.named_parameters(recurse=False):
            if id(param) not in seen:
                seen.add(id(param))
                found[dot + key] = getattr(param, "ds_shape", param.shape)  # ZeRO-3: whole
        for key, buffer in module.named_buffers(recurse=False) if buffers else ():
            if key not in module._non_persistent_buffers_set:
                found[dot + key] = buffer.shape
    return found


def seed_masters(
    optimizer: torch.optim.Optimizer, model: torch.nn.Module, strategy: Any, init_from: str
) -> bool:
    """Give a strategy's master weights the directory's fp32 values (True if it keeps one).

    The model's own weights were cast (bf16) from those values; a fp32 master or a split
    remainder built from the cast weights would drop their low bits. Collage's dtheta is
    left at zero (its compensation starts empty, as in any new run).
    """
    if not _keeps_master(strategy) or not hasattr(optimizer, "load_full_precision_weights"):
        return False
    weights = PretrainedWeights(init_from, model, buffers=False)
    name_of = {id(p): name for name, p in model.named_parameters()}
    optimizer.load_full_precision_weights(
        [weights.fp32(name_of[id(p)]) for p in optimizer.ordered_params()]
    )
    return True


def seed_zero_masters(engine: Any, optimizer: Any, strategy: Any, init_from: str) -> bool:
    """``seed_masters`` under ZeRO, after ``engine.prepare``: DeepSpeed's flat master
    partitions (what the client optimizer updates) get this rank's slices of the fp32
    weights (mixed_fp32: the fp32 partition; split_fp32: the bf16 partition's remainder),
    read a tensor at a time. The bf16 weights are the rounding of the same values already;
    padding is left as it is.
    """
    if not _keeps_master(strategy):
        return False
    weights = PretrainedWeights(init_from, engine.model, buffers=False)
    for pieces, flat in zip(engine.partition_pieces(), engine.master_partitions(), strict=True):
        value = flat.detach().to(torch.float32, copy=True)
        for piece in pieces:
            source = weights.stored(piece.name).reshape(-1)
            value[piece.flat_start : piece.flat_start + piece.numel] = source[
                piece.param_start : piece.param_start + piece.numel
            ]
        optimizer.load_full_precision_weight(flat, value)
    return True
