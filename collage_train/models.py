"""GPT and OPT decoders from transformers configs, randomly initialised.

Nothing here downloads from a hub, and nothing here knows about precision or
parallelism: the builder returns an fp32 model that the precision strategy casts.
"""

from __future__ import annotations

import difflib
from typing import Any

import torch
from transformers import AutoModelForCausalLM, GPT2Config, OPTConfig, PretrainedConfig

from collage_train.errors import ConfigError


def build_hf_config(cfg: Any, *, vocab_size: int, seq_len: int, eot_id: int) -> PretrainedConfig:
    """Translate the ``model`` sub-config into a transformers config.

    ``vocab_size`` and ``seq_len`` come from the tokenizer and data config; an explicit
    ``cfg.vocab_size`` may pad the embedding but never shrink it below the tokenizer's.
    """
    if cfg.hidden_size % cfg.num_heads != 0:
        raise ConfigError(
            f"model.hidden_size={cfg.hidden_size} is not divisible by "
            f"model.num_heads={cfg.num_heads}"
        )
    model_vocab = cfg.vocab_size if cfg.vocab_size is not None else vocab_size
    if model_vocab < vocab_size:
        raise ConfigError(
            f"the tokenizer has {vocab_size} tokens but model.vocab_size={model_vocab}; "
            f"set model.vocab_size >= {vocab_size} (or null to follow the tokenizer)"
        )
    check_model_extra(cfg)
    config_class, fixed, defaults = _builder_fields(
        cfg, vocab_size=model_vocab, seq_len=seq_len, eot_id=eot_id
    )
    return config_class(**fixed, **{**defaults, **dict(cfg.extra or {})})


def _builder_fields(
    cfg: Any, *, vocab_size: int, seq_len: int, eot_id: int
) -> tuple[type[PretrainedConfig], dict[str, Any], dict[str, Any]]:
    """The transformers config class, the fields set from the model/data config, and the
    defaults that ``model.extra`` may override."""
    ffn = cfg.ffn_hidden_size or 4 * cfg.hidden_size
    if cfg.family == "gpt":
        fixed = {
            "vocab_size": vocab_size,
            "n_positions": seq_len,
            "n_embd": cfg.hidden_size,
            "n_layer": cfg.num_layers,
            "n_head": cfg.num_heads,
            "n_inner": ffn,
            "resid_pdrop": cfg.dropout,
            "embd_pdrop": cfg.dropout,
            "attn_pdrop": cfg.dropout,
            "initializer_range": cfg.init_std,
            "bos_token_id": eot_id,
            "eos_token_id": eot_id,
        }
        return GPT2Config, fixed, {}
    if cfg.family == "opt":
        fixed = {
            "vocab_size": vocab_size,
            "max_position_embeddings": seq_len,
            "hidden_size": cfg.hidden_size,
            "num_hidden_layers": cfg.num_layers,
            "num_attention_heads": cfg.num_heads,
            "ffn_dim": ffn,
            "dropout": cfg.dropout,
            "attention_dropout": cfg.dropout,
            "init_std": cfg.init_std,
            "bos_token_id": eot_id,
            "eos_token_id": eot_id,
            "pad_token_id": eot_id,
        }
        return OPTConfig, fixed, {"word_embed_proj_dim": cfg.hidden_size}
    raise ConfigError(f"model.family must be 'gpt' or 'opt', got {cfg.family!r}")


def check_model_extra(cfg: Any) -> None:
    """Refuse a ``model.extra`` key that the transformers config class does not define, or
    that names (directly or through the class's aliases) a field set from the model config."""
    config_class, fixed, _ = _builder_fields(cfg, vocab_size=1, seq_len=1, eot_id=0)
    aliases = dict(config_class.attribute_map)
    known = sorted(set(vars(config_class())) | set(aliases))
    for key in cfg.extra or {}:
        if key not in known:
            guess = difflib.get_close_matches(key, known, n=1)
            hint = f" (did you mean {guess[0]}?)" if guess else ""
            raise ConfigError(
                f"model.extra.{key} is not a field of transformers' {config_class.__name__}"
                f"{hint}; remove it or fix its spelling"
            )
        field = aliases.get(key, key)
        if field in fixed or any(aliases.get(name, name) == field for name in fixed):
            raise ConfigError(
                f"model.extra.{key} duplicates {config_class.__name__}.{field}, which is set "
                "from model.*, data.seq_len or the tokenizer; change that setting and remove "
                f"{key} from model.extra"
            )


def build_model(
    cfg: Any, *, vocab_size: int, seq_len: int, eot_id: int, seed: int
) -> torch.nn.Module:
    """Build a randomly initialised causal LM (fp32) from the ``model`` sub-config."""
    hf_config = build_hf_config(cfg, vocab_size=vocab_size, seq_len=seq_len, eot_id=eot_id)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(
        hf_config, attn_implementation=cfg.attn_implementation
    ).float()
    model.config.use_cache = False
    return model


def planned_parameter_count(cfg: Any, *, vocab_size: int, seq_len: int, eot_id: int) -> int:
    """Parameters the model would have, counted on the meta device (no memory used)."""
    hf_config = build_hf_config(cfg, vocab_size=vocab_size, seq_len=seq_len, eot_id=eot_id)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    return count_parameters(model)


def count_parameters(model: torch.nn.Module) -> int:
    """Number of distinct parameter elements (tied weights counted once)."""
    return sum(p.numel() for p in model.parameters())


def flops_per_token(model: torch.nn.Module, seq_len: int) -> float:
    """Training FLOPs per token: 6 x matmul parameters + causal attention (PaLM appendix B).

    Position embeddings do no matmul work and are excluded; the tied input/output
    embedding is counted once, for the output projection.
    """
    cfg = model.config
    positional = sum(
        p.numel()
        for name, p in model.named_parameters()
        if "wpe" in name or "embed_positions" in name
    )
    hidden = getattr(cfg, "n_embd", None) or cfg.hidden_size
    layers = getattr(cfg, "n_layer", None) or cfg.num_hidden_layers
    return 6.0 * (count_parameters(model) - positional) + 12.0 * layers * hidden * seq_len
