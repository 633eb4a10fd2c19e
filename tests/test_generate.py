"""The end-of-run sample (``logging.sample_tokens``, collage_train/generate.py): it leaves
the run's random streams and the model's mode as they were, is off at 0, and is drawn
under ZeRO-3 from the gathered weights. The command's own checks: tests/test_cli_e2e.py."""

from __future__ import annotations

import pytest
import torch
from zero_rank import one_zero_rank

from collage_train.errors import ConfigError
from collage_train.generate import generate, sample_after_training
from collage_train.trainer import Trainer


def test_the_sample_is_the_commands_and_leaves_the_rng_and_the_mode(make_cfg, tmp_path):
    trainer = Trainer(make_cfg("logging.sample_tokens=16", "train.max_steps=2"), tmp_path / "run")
    try:
        summary = trainer.fit()
        model, tokenizer = trainer.model, trainer.data.tokenizer
        model.train()
        torch.manual_seed(7)
        before = torch.get_rng_state()
        again = sample_after_training(model, tokenizer, "def ", max_new_tokens=16, seed=1234)
        assert torch.equal(torch.get_rng_state(), before) and model.training
    finally:
        trainer.engine.close()
    assert again == summary["sample"] and again.startswith("def ")
    model.eval()
    assert again == generate(
        model, tokenizer, "def ", max_new_tokens=16, temperature=0.8, top_k=50, seed=1234
    )
    other = sample_after_training(model, tokenizer, "class ", max_new_tokens=16, seed=1234)
    assert other.startswith("class ")


def test_no_sample_at_zero_tokens(make_cfg, tmp_path):
    trainer = Trainer(make_cfg("logging.sample_tokens=0", "train.max_steps=1"), tmp_path / "run")
    try:
        assert "sample" not in trainer.fit()
    finally:
        trainer.engine.close()


@pytest.mark.slow
def test_a_zero3_run_samples_from_its_gathered_weights(make_cfg, tmp_path, monkeypatch):
    one_zero_rank(monkeypatch)
    cfg = make_cfg("distributed=zero3", "logging.sample_tokens=12", "train.max_steps=2")
    (tmp_path / "run").mkdir()
    trainer = Trainer(cfg, tmp_path / "run")
    try:
        summary = trainer.fit()
    finally:
        trainer.engine.close()
    assert summary["sample"].startswith("def ") and len(summary["sample"]) > len("def ")


def test_a_prompt_that_fills_the_context_is_refused_before_training(make_cfg, tmp_path):
    """The tiny model reads 32 positions (data.seq_len); the sample stops where they end."""
    long = make_cfg("logging.sample_prompt='" + "return x " * 40 + "'")
    with pytest.raises(ConfigError, match=r"logging.sample_prompt is \d+ tokens .* at most 31"):
        Trainer(long, tmp_path / "long")
    assert not (tmp_path / "long").exists()
    fits = Trainer(make_cfg("logging.sample_tokens=100", "train.max_steps=1"), tmp_path / "run")
    try:
        sample = fits.fit()["sample"]
    finally:
        fits.engine.close()
    assert sample.startswith("def ")  # 100 tokens asked, as many as the 32 positions hold
