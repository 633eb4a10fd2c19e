"""Hydra composition: groups, presets, experiments, schema validation."""

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf.errors import ConfigKeyError, ValidationError

from collage_train.__main__ import strip_local_rank
from collage_train.cli import config_dir
from collage_train.config import register_schemas

register_schemas()

PAPER = {  # hidden, layers, heads, global batch, peak lr (REFERENCE.md section 3)
    "gpt_125m": (768, 12, 12, 1024, 6e-4),
    "gpt_1.3b": (2048, 24, 16, 1024, 2e-4),
    "gpt_2.7b": (2560, 32, 32, 512, 1.6e-4),
    "gpt_6.7b": (4096, 32, 32, 256, 1.2e-4),
}


def compose_cfg(*overrides):
    with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def test_default_config(monkeypatch):
    from collage_train.metrics.sinks import wandb_mode

    monkeypatch.delenv("WANDB_MODE", raising=False)
    cfg = compose_cfg()
    assert cfg.model.name == "gpt_tiny" and cfg.data.source == "stdlib"
    assert cfg.precision.name == "mixed_fp32" and cfg.distributed.name == "single"
    assert cfg.logging.wandb.mode is None and wandb_mode(cfg.logging.wandb) == "offline"


@pytest.mark.parametrize("name", sorted(PAPER))
def test_experiments_carry_paper_recipe(name):
    cfg = compose_cfg(f"+experiment={name}")
    hidden, layers, heads, batch, lr = PAPER[name]
    assert (cfg.model.hidden_size, cfg.model.num_layers, cfg.model.num_heads) == (
        hidden,
        layers,
        heads,
    )
    assert cfg.train.global_batch_size == batch and cfg.optim.lr == lr
    assert cfg.optim.min_lr == pytest.approx(lr / 10)
    assert cfg.data.seq_len == 2048 and list(cfg.optim.betas) == [0.9, 0.95]
    assert cfg.optim.warmup_steps == 200 and cfg.train.max_steps == 20000
    assert cfg.model.init_std == 0.021 and cfg.optim.weight_decay == 0.1


@pytest.mark.parametrize(
    "preset,shape",
    [
        ("opt_125m", (768, 12, 12)),
        ("opt_350m", (1024, 24, 16)),
        ("opt_1.3b", (2048, 24, 32)),
        ("opt_2.7b", (2560, 32, 32)),
        ("opt_6.7b", (4096, 32, 32)),
        ("gpt_350m", (1024, 24, 16)),
    ],
)
def test_model_presets(preset, shape):
    cfg = compose_cfg(f"model={preset}")
    assert (cfg.model.hidden_size, cfg.model.num_layers, cfg.model.num_heads) == shape


def test_misspelt_key_is_rejected():
    with pytest.raises((ConfigCompositionException, ConfigKeyError)):
        compose_cfg("train.max_step=5")


def test_wrong_type_is_rejected():
    with pytest.raises((ConfigCompositionException, ValidationError)):
        compose_cfg("train.max_steps=many")


def test_unknown_group_option_is_rejected():
    with pytest.raises(ConfigCompositionException):
        compose_cfg("precision=fp8")


def test_strip_local_rank(monkeypatch):
    # setenv first records the variable's state, so that it is restored after the test:
    # a LOCAL_RANK left behind makes later in-process runs wait for another rank's data
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.delenv("LOCAL_RANK")
    assert strip_local_rank(["prog", "--local_rank=3", "model=gpt_tiny"]) == [
        "prog",
        "model=gpt_tiny",
    ]
    import os

    assert os.environ["LOCAL_RANK"] == "3"
    assert strip_local_rank(["prog", "--local_rank", "1", "x=1"]) == ["prog", "x=1"]
