"""Model builder: GPT/OPT from configs, random init, vocab checks, FLOPs."""

from types import SimpleNamespace

import pytest
import torch

from collage_train.errors import ConfigError
from collage_train.models import build_model, count_parameters, flops_per_token


def cfg(**kw):
    base = {
        "family": "gpt",
        "name": "t",
        "hidden_size": 32,
        "num_layers": 2,
        "num_heads": 4,
        "ffn_hidden_size": None,
        "init_std": 0.02,
        "dropout": 0.0,
        "vocab_size": None,
        "attn_implementation": "sdpa",
        "extra": {},
    }
    return SimpleNamespace(**(base | kw))


def test_gpt_shapes_and_sdpa():
    model = build_model(cfg(), vocab_size=100, seq_len=16, eot_id=2, seed=0)
    assert type(model).__name__ == "GPT2LMHeadModel"
    assert model.config._attn_implementation == "sdpa"
    assert model.config.vocab_size == 100 and model.config.n_positions == 16
    logits = model(input_ids=torch.zeros(2, 16, dtype=torch.long)).logits
    assert logits.shape == (2, 16, 100)


def test_opt_family_and_extra_fields():
    model = build_model(
        cfg(family="opt", extra={"word_embed_proj_dim": 16}),
        vocab_size=100,
        seq_len=16,
        eot_id=2,
        seed=0,
    )
    assert type(model).__name__ == "OPTForCausalLM"
    assert model.config.word_embed_proj_dim == 16 and model.config.ffn_dim == 128


def test_init_std_is_applied_and_seeded():
    a = build_model(cfg(init_std=0.1), vocab_size=500, seq_len=16, eot_id=2, seed=3)
    b = build_model(cfg(init_std=0.1), vocab_size=500, seq_len=16, eot_id=2, seed=3)
    wte = a.transformer.wte.weight
    assert wte.std().item() == pytest.approx(0.1, rel=0.05)
    assert torch.equal(wte, b.transformer.wte.weight)


def test_model_vocab_smaller_than_tokenizer_is_an_error():
    with pytest.raises(ConfigError, match=r"tokenizer has 100 tokens but model\.vocab_size=50"):
        build_model(cfg(vocab_size=50), vocab_size=100, seq_len=16, eot_id=2, seed=0)


def test_padded_vocab_is_allowed():
    model = build_model(cfg(vocab_size=128), vocab_size=100, seq_len=16, eot_id=2, seed=0)
    assert model.config.vocab_size == 128


def test_bad_family_and_head_split():
    with pytest.raises(ConfigError, match="family"):
        build_model(cfg(family="llama"), vocab_size=100, seq_len=16, eot_id=2, seed=0)
    with pytest.raises(ConfigError, match="divisible"):
        build_model(cfg(num_heads=5), vocab_size=100, seq_len=16, eot_id=2, seed=0)


def test_flops_per_token_formula():
    model = build_model(cfg(), vocab_size=100, seq_len=16, eot_id=2, seed=0)
    positional = 16 * 32
    expected = 6 * (count_parameters(model) - positional) + 12 * 2 * 32 * 16
    assert flops_per_token(model, 16) == expected
