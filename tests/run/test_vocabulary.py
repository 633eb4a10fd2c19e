"""Start-up check of the model's embedding against its tokenizer
(collage_train/run/vocabulary.py, run by ``validate``): fewer rows than the tokenizer has
ids is one ConfigError line, whether the rows are ``model.vocab_size`` or a
``model.init_from`` directory's and the tokenizer trained, ``data.tokenizer`` or the
directory's own; padding is accepted, and a model that follows its tokenizer opens none."""

from __future__ import annotations

import shutil

import pytest
from tiny_config import train_tokenizer
from transformers import GPT2Config, GPT2LMHeadModel

from collage_train.data import Tokenizer
from collage_train.errors import ConfigError
from collage_train.run.validate import validate


@pytest.fixture(scope="module")
def tokenizer_file(corpus_dir, tmp_path_factory):
    """A 512-piece SentencePiece model file."""
    path = tmp_path_factory.mktemp("tokenizer") / "tokenizer.model"
    train_tokenizer(corpus_dir, path)
    return path


def hf_directory(path, rows: int, tokenizer_file=None):
    """A GPT-2 directory (save_pretrained) of ``rows`` embedding rows, with a tokenizer."""
    config = GPT2Config(vocab_size=rows, n_positions=64, n_embd=32, n_layer=1, n_head=4)
    GPT2LMHeadModel(config).save_pretrained(path)
    if tokenizer_file is not None:
        shutil.copy(tokenizer_file, path / "tokenizer.model")
    return path


def refusal(cfg) -> str:
    with pytest.raises(ConfigError) as refused:
        validate(cfg)
    assert "\n" not in str(refused.value)
    return str(refused.value)


def test_a_model_vocabulary_below_the_tokenizers_is_refused(make_cfg, monkeypatch):
    assert refusal(make_cfg("model.vocab_size=511")).startswith(
        "model.vocab_size=511 is smaller than the tokenizer's 512 ids (data.vocab_size=512)"
    )
    for fits in ("512", "576", "1024"):  # exactly the tokenizer's, or padded past it
        validate(make_cfg(f"model.vocab_size={fits}"))
    monkeypatch.setattr(Tokenizer, "load", None)  # the default follows the tokenizer:
    validate(make_cfg())  # nothing to open, nothing to check


def test_data_tokenizer_is_measured(make_cfg, tokenizer_file):
    cfg = make_cfg(
        f"data.tokenizer={tokenizer_file}", "data.vocab_size=8192", "model.vocab_size=500"
    )
    assert f"the tokenizer's 512 ids (data.tokenizer={tokenizer_file})" in refusal(cfg)
    validate(make_cfg(f"data.tokenizer={tokenizer_file}", "model.vocab_size=512"))


def test_an_init_from_directory_must_embed_its_tokenizer(make_cfg, tokenizer_file, tmp_path):
    small = hf_directory(tmp_path / "small", rows=300)
    cfg = make_cfg(f"model.init_from={small}", f"data.tokenizer={tokenizer_file}")
    assert refusal(cfg) == (
        f"the data's tokenizer (data.tokenizer={tokenizer_file}) has 512 ids but the model in "
        f"model.init_from={small} embeds 300; use the model's own tokenizer (leave "
        "data.tokenizer unset) or one whose vocabulary fits"
    )
    own = hf_directory(tmp_path / "own", rows=300, tokenizer_file=tokenizer_file)
    message = refusal(make_cfg(f"model.init_from={own}"))
    assert f"the data's tokenizer (the tokenizer in model.init_from={own}) has 512" in message
    padded = hf_directory(tmp_path / "padded", rows=576, tokenizer_file=tokenizer_file)
    validate(make_cfg(f"model.init_from={padded}"))
    validate(make_cfg(f"model.init_from={padded}", "model.vocab_size=576"))
    assert refusal(make_cfg(f"model.init_from={padded}", "model.vocab_size=640")) == (
        f"model.vocab_size=640 cannot resize the model in model.init_from={padded}, whose "
        "embedding has 576 rows; drop model.vocab_size"
    )
    bare = hf_directory(tmp_path / "bare", rows=576)  # no tokenizer, none named
    assert "holds no tokenizer" in refusal(make_cfg(f"model.init_from={bare}"))
