"""GPT, OPT and Llama decoders from transformers configs, randomly initialised.

Nothing here downloads from a hub, and nothing here knows about precision or
parallelism: ``build_meta_model`` returns the model on the meta device, and
``collage_train.model.materialise`` draws its weights in the dtype and on the device the run
chooses (``build_model``: fp32 on the CPU).
Llama (``family: llama``) is the modern layout: RMSNorm, SwiGLU MLP, rotary positions,
grouped-query attention (``num_kv_heads``) and, by default, an untied LM head.
``model.init_from`` loads a local Hugging Face directory instead
(``collage_train.model.init_from``).
"""

from __future__ import annotations

import difflib
from typing import Any

import torch
from transformers import GPT2Config, LlamaConfig, OPTConfig, PretrainedConfig

from collage_train.errors import ConfigError
from collage_train.model.materialise import materialise
from collage_train.model.shapes import full_numel

FAMILIES = ("gpt", "opt", "llama")
LLAMA_ROPE_THETA = 10000.0  # transformers' default; the Llama 3 presets set 500000
LLAMA_RMS_NORM_EPS = 1e-5
LLAMA_FFN_MULTIPLE = 256  # Llama rounds its SwiGLU width up to a multiple of this


def ffn_width(cfg: Any) -> int:
    """The MLP's inner width: ``ffn_hidden_size``, else the family's default.

    GPT and OPT: 4 x hidden. Llama: the SwiGLU rule (two thirds of 4 x hidden, so that
    its three matrices cost what two 4 x hidden ones do) rounded up to a multiple of 256.
    """
    if cfg.ffn_hidden_size:
        return int(cfg.ffn_hidden_size)
    if cfg.family == "llama":
        width = 8 * cfg.hidden_size // 3
        return -(-width // LLAMA_FFN_MULTIPLE) * LLAMA_FFN_MULTIPLE
    return 4 * cfg.hidden_size


def kv_heads(cfg: Any) -> int:
    """Key/value heads: ``num_kv_heads`` (Llama's grouped-query attention), else one per head."""
    value = getattr(cfg, "num_kv_heads", None)
    return cfg.num_heads if value is None else int(value)


def _check_shape(cfg: Any) -> None:
    """Refuse an unknown family, or heads that do not divide the width or the query heads.
    (The Llama-only fields are the Llama schema's: Hydra refuses them for GPT/OPT.)"""
    if cfg.family not in FAMILIES:
        raise ConfigError(f"model.family must be one of {', '.join(FAMILIES)}, got {cfg.family!r}")
    if cfg.hidden_size % cfg.num_heads != 0:
        raise ConfigError(
            f"model.hidden_size={cfg.hidden_size} is not divisible by "
            f"model.num_heads={cfg.num_heads}"
        )
    if cfg.family != "llama":
        return
    kv = kv_heads(cfg)
    if kv < 1 or cfg.num_heads % kv != 0:
        raise ConfigError(
            f"model.num_heads={cfg.num_heads} is not a multiple of model.num_kv_heads={kv}; "
            "grouped-query attention shares each key/value head among a whole number of heads"
        )


def build_hf_config(cfg: Any, *, vocab_size: int, seq_len: int, eot_id: int) -> PretrainedConfig:
    """Translate the ``model`` sub-config into a transformers config.

    ``vocab_size`` and ``seq_len`` come from the tokenizer and data config; an explicit
    ``cfg.vocab_size`` may pad the embedding but never shrink it below the tokenizer's.
    With ``cfg.init_from`` the config is that directory's (``collage_train.model.init_from``).
    """
    if getattr(cfg, "init_from", None):
        from collage_train.model.init_from import pretrained_config

        return pretrained_config(cfg, vocab_size=vocab_size, seq_len=seq_len)
    _check_shape(cfg)
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
    ffn = ffn_width(cfg)
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
    if cfg.family == "llama":
        theta = getattr(cfg, "rope_theta", None)
        eps = getattr(cfg, "rms_norm_eps", None)
        tie = getattr(cfg, "tie_embeddings", None)
        fixed = {
            "vocab_size": vocab_size,
            "max_position_embeddings": seq_len,
            "hidden_size": cfg.hidden_size,
            "num_hidden_layers": cfg.num_layers,
            "num_attention_heads": cfg.num_heads,
            "num_key_value_heads": kv_heads(cfg),
            "intermediate_size": ffn,
            "attention_dropout": cfg.dropout,
            "initializer_range": cfg.init_std,
            "rms_norm_eps": LLAMA_RMS_NORM_EPS if eps is None else float(eps),
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": LLAMA_ROPE_THETA if theta is None else float(theta),
            },
            "tie_word_embeddings": bool(tie),
            "bos_token_id": eot_id,
            "eos_token_id": eot_id,
            "pad_token_id": eot_id,
        }
        return LlamaConfig, fixed, {}
    raise ConfigError(f"model.family must be one of {', '.join(FAMILIES)}, got {cfg.family!r}")


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


def build_meta_model(cfg: Any, *, vocab_size: int, seq_len: int, eot_id: int) -> torch.nn.Module:
    """The causal LM the ``model`` sub-config describes, on the meta device (no memory, no
    values): ``model.materialise.materialise`` draws its weights where and in what dtype a run
    stores them."""
    # here, not at the top: start-up validation imports this module, and transformers'
    # modeling stack (TorchDynamo with it) takes seconds (tests/model/test_loss_settings.py)
    from collage_train.model.hf_modeling import AutoModelForCausalLM

    hf_config = build_hf_config(cfg, vocab_size=vocab_size, seq_len=seq_len, eot_id=eot_id)
    with torch.device("meta"):
        # A plain str: the config's Choice member (a str subclass) reached Dynamo as an
        # opaque object, a graph break in every attention layer under torch.compile.
        model = AutoModelForCausalLM.from_config(
            hf_config, attn_implementation=str(cfg.attn_implementation)
        )
    model.config.use_cache = False
    return model


def build_model(
    cfg: Any, *, vocab_size: int, seq_len: int, eot_id: int, seed: int
) -> torch.nn.Module:
    """Build a randomly initialised causal LM (fp32, on the CPU) from the ``model``
    sub-config (weights drawn as ``model.materialise.materialise`` draws them), or load the one
    in ``cfg.init_from`` (a local Hugging Face directory; fp32)."""
    if getattr(cfg, "init_from", None):
        from collage_train.model.init_from import load_pretrained

        return load_pretrained(cfg, vocab_size=vocab_size, seq_len=seq_len)
    model = build_meta_model(cfg, vocab_size=vocab_size, seq_len=seq_len, eot_id=eot_id)
    return materialise(model, seed=seed, dtype=torch.float32, device=torch.device("cpu"))


def planned_parameter_count(cfg: Any, *, vocab_size: int, seq_len: int, eot_id: int) -> int:
    """Parameters the model would have, counted on the meta device (no memory used)."""
    model = build_meta_model(cfg, vocab_size=vocab_size, seq_len=seq_len, eot_id=eot_id)
    return count_parameters(model)


def count_parameters(model: torch.nn.Module) -> int:
    """Number of distinct parameter elements (tied weights counted once), whole also where
    an engine holds only a shard of each (``full_numel``)."""
    return sum(full_numel(p) for p in model.parameters())


def flops_per_token(model: torch.nn.Module, seq_len: int) -> float:
    """Training FLOPs per token: 6 x matmul parameters + attention (PaLM appendix B).

    Lookups do no matmul work: position embeddings are excluded, and so is an untied
    token embedding (Llama); a tied input/output embedding is counted once, for the
    output projection. Grouped-query attention and SwiGLU need nothing special here:
    their smaller key/value and three MLP projections are what the parameters count. The
    attention term is 12 x layers x (query heads x head width) x seq_len: scores and the
    weighted sum run over every query head, however many key/value heads they share.
    """
    cfg = model.config
    lookups = {
        id(p) for name, p in model.named_parameters() if "wpe" in name or "embed_positions" in name
    }
    tokens, head = model.get_input_embeddings(), model.get_output_embeddings()
    if head is None or tokens.weight is not head.weight:
        lookups.add(id(tokens.weight))
    lookup_numel = sum(full_numel(p) for p in model.parameters() if id(p) in lookups)
    layers = getattr(cfg, "n_layer", None) or cfg.num_hidden_layers
    heads = getattr(cfg, "n_head", None) or cfg.num_attention_heads
    hidden = getattr(cfg, "n_embd", None) or cfg.hidden_size
    head_dim = getattr(cfg, "head_dim", None) or hidden // heads
    attention = 12.0 * layers * heads * head_dim * seq_len
    return 6.0 * (count_parameters(model) - lookup_numel) + attention


def enable_activation_checkpointing(model: torch.nn.Module) -> None:
    """Keep each block's input and recompute the rest in backward, with transformers' own
    switch (``gradient_checkpointing_enable``, renamed ``activation_checkpointing_enable``
    in transformers 5.x), non-reentrant so that it composes with ZeRO and compile."""
    enable = getattr(model, "activation_checkpointing_enable", None)
    enable = enable or model.gradient_checkpointing_enable
    enable({"use_reentrant": False})
