"""Model builder: GPT/OPT/Llama from configs, random init, vocab checks, FLOPs, presets."""

from types import SimpleNamespace

import pytest
import torch

from collage_train.errors import ConfigError
from collage_train.metrics.edq import layer_group
from collage_train.model.build import (
    build_model,
    count_parameters,
    flops_per_token,
    planned_parameter_count,
)


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
        "num_kv_heads": None,
        "rope_theta": None,
        "rms_norm_eps": None,
        "tie_embeddings": None,
        "extra": {},
    }
    return SimpleNamespace(**(base | kw))


def llama(**kw):
    fields = {"family": "llama", "num_kv_heads": 2, "ffn_hidden_size": 88, "rope_theta": 5e5}
    return cfg(**(fields | kw))


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
    with pytest.raises(ConfigError, match="family must be one of gpt, opt, llama"):
        build_model(cfg(family="mamba"), vocab_size=100, seq_len=16, eot_id=2, seed=0)
    with pytest.raises(ConfigError, match="divisible"):
        build_model(cfg(num_heads=5), vocab_size=100, seq_len=16, eot_id=2, seed=0)
    with pytest.raises(ConfigError, match=r"not a multiple of model\.num_kv_heads=3"):
        build_model(cfg(family="llama", num_kv_heads=3), vocab_size=100, seq_len=16,
                    eot_id=2, seed=0)  # fmt: skip


def test_llama_family_gqa_untied_rope_rmsnorm():
    model = build_model(llama(), vocab_size=100, seq_len=16, eot_id=2, seed=0)
    assert type(model).__name__ == "LlamaForCausalLM"
    config, layer = model.config, model.model.layers[0]
    assert config.rope_parameters["rope_theta"] == 500000.0 and config.rms_norm_eps == 1e-5
    assert config.max_position_embeddings == 16 and config.eos_token_id == 2
    head_dim = 32 // 4
    assert layer.self_attn.q_proj.weight.shape == (32, 32)
    assert layer.self_attn.k_proj.weight.shape == (2 * head_dim, 32)  # 2 key/value heads
    assert layer.mlp.gate_proj.weight.shape == (88, 32) and layer.mlp.down_proj.weight.shape == (
        32,
        88,
    )
    assert model.lm_head.weight is not model.model.embed_tokens.weight  # untied
    tied = build_model(llama(tie_embeddings=True), vocab_size=100, seq_len=16, eot_id=2, seed=0)
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    ids = torch.randint(0, 100, (2, 16))
    out = model(input_ids=ids, labels=ids)
    assert out.logits.shape == (2, 16, 100) and out.loss.item() == pytest.approx(4.6, abs=0.2)
    groups = {layer_group(name) for name, _ in model.named_parameters()}
    assert groups == {"embeddings", "block_0", "block_1", "head"}
    assert layer_group("model.layers.1.mlp.up_proj.weight") == "block_1"


def test_llama_ffn_default_is_the_swiglu_rule():
    model = build_model(
        llama(ffn_hidden_size=None, hidden_size=384, num_heads=4),
        vocab_size=100, seq_len=16, eot_id=2, seed=0,
    )  # fmt: skip
    assert model.config.intermediate_size == 1024  # 8/3 x 384 = 1024, a multiple of 256


def test_llama_flops_count_gqa_and_swiglu():
    """By hand: per layer q, o (h x h), k, v (h x kv width), gate, up, down (h x f) and two
    RMSNorm gains; the final norm and the untied head; the token embedding is a lookup."""
    h, layers, heads, kv, f, vocab, seq = 32, 2, 4, 2, 88, 100, 16
    model = build_model(llama(), vocab_size=vocab, seq_len=seq, eot_id=2, seed=0)
    kv_width = kv * (h // heads)
    per_layer = 2 * h * h + 2 * h * kv_width + 3 * h * f + 2 * h
    matmul_params = layers * per_layer + h + vocab * h
    assert count_parameters(model) == matmul_params + vocab * h  # + the embedding
    assert flops_per_token(model, seq) == 6 * matmul_params + 12 * layers * h * seq


@pytest.mark.parametrize(
    "preset,params",
    [("llama_1b", 1_498_482_688), ("llama_3b", 3_606_752_256), ("llama_8b", 8_030_261_248)],
)
def test_llama_presets_have_llama3_shapes(preset, params):
    from hydra import compose, initialize_config_dir

    from collage_train.cli import config_dir

    with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
        job = compose(config_name="config", overrides=[f"model={preset}"])
    assert job.model.num_kv_heads == 8 and job.model.rope_theta == 500000.0
    assert not job.model.tie_embeddings
    count = planned_parameter_count(job.model, vocab_size=128256, seq_len=2048, eot_id=0)
    assert count == params  # Llama 3.1 8B: 8.03B; the 1B and 3B untied (their own tie)


def test_llama_experiment_recipe():
    from hydra import compose, initialize_config_dir

    from collage_train.cli import config_dir

    with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
        job = compose(config_name="config", overrides=["+experiment=llama_1b"])
    assert job.model.name == "llama_1b" and job.data.seq_len == 2048
    assert list(job.optim.betas) == [0.9, 0.95] and job.train.global_batch_size == 1024


def test_flops_per_token_formula():
    model = build_model(cfg(), vocab_size=100, seq_len=16, eot_id=2, seed=0)
    positional = 16 * 32
    expected = 6 * (count_parameters(model) - positional) + 12 * 2 * 32 * 16
    assert flops_per_token(model, 16) == expected
