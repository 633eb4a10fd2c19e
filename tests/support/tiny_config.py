"""The tiny test configuration: a 2-layer GPT on the small test corpus, composed in-process.

Lives in its own uniquely named module (not ``conftest``): pytest puts every test
directory that has a ``conftest.py`` on ``sys.path``, so ``from conftest import ...``
can resolve to the wrong one depending on which files are collected.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import torch
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig
from suite_device import device_overrides

from collage_train.cli import config_dir
from collage_train.data import Tokenizer
from collage_train.data.tokenizer import TokenizerSettings, train_model, training_sentences
from collage_train.model.build import build_model


def tiny_model_and_data(corpus: Path, cache: Path, hidden_size: int = 32) -> list[str]:
    """Overrides for a 2-layer GPT trained on ``corpus`` with a 512-token vocabulary."""
    return [
        f"model.hidden_size={hidden_size}",
        "model.num_layers=2",
        "model.num_heads=2",
        "data=files",
        f"data.paths=[{corpus}]",
        "data.vocab_size=512",
        "data.seq_len=32",
        "data.tokenizer_train_chars=200000",
        "data.val_fraction=0.05",
        f"data.cache_dir={cache}",
    ]


def compose_tiny(corpus: Path, cache: Path, *overrides: str) -> DictConfig:
    """The real config of the tiny model on the suite's device (``--device``), quiet (no
    console, W&B, plots, export); overrides win."""
    quiet = [
        "train.eval_batches=2",
        "logging.console=none",
        "logging.wandb.mode=disabled",
        "logging.plots=false",
        "train.export_hf=false",
    ]
    with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
        return compose(
            config_name="config",
            overrides=[
                *device_overrides(),
                *tiny_model_and_data(corpus, cache),
                *quiet,
                *overrides,
            ],
        )


def tiny_transformer(family: str = "gpt", layers: int = 2, **extra: object) -> torch.nn.Module:
    """A 32-wide, 4-head GPT-2 or OPT from the model registry (vocabulary 96, 16 tokens);
    ``extra`` goes to the transformers config (e.g. OPT's ``do_layer_norm_before``)."""
    cfg = SimpleNamespace(
        family=family,
        name="t",
        hidden_size=32,
        num_layers=layers,
        num_heads=4,
        ffn_hidden_size=None,
        init_std=0.02,
        dropout=0.0,
        vocab_size=None,
        attn_implementation="eager",
        extra=extra,
    )
    return build_model(cfg, vocab_size=96, seq_len=16, eot_id=2, seed=0)


def logits_and_grads(model: torch.nn.Module) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One seeded forward and backward of a ``tiny_transformer``: logits and gradients."""
    ids = torch.randint(0, 96, (3, 16), generator=torch.Generator().manual_seed(1))
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def assert_same_logits_and_grads(original: torch.nn.Module, other: torch.nn.Module) -> None:
    """``other`` gives ``original``'s logits and gradients to 1e-6."""
    logits, grads = logits_and_grads(original)
    other_logits, other_grads = logits_and_grads(other)
    assert torch.allclose(other_logits, logits, rtol=1e-6, atol=1e-6)
    for name, grad in grads.items():
        assert torch.allclose(other_grads[name], grad, rtol=1e-6, atol=1e-6), name


def compose_cfg(*overrides: str) -> DictConfig:
    """The default configuration with ``overrides``, composed in-process."""
    with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def train_tokenizer(corpus: Path, target: Path, vocab_size: int = 512) -> Tokenizer:
    """A SentencePiece tokenizer of ``vocab_size`` pieces trained on the first 100000
    characters of ``corpus`` (a fraction of a second), written to ``target``."""
    documents = (path.read_text() for path in sorted(corpus.glob("*.txt")))
    settings = TokenizerSettings(vocab_size, 100_000)
    target.write_bytes(train_model(training_sentences(documents, 100_000), settings))
    return Tokenizer.load(target)


def favouring_padded_rows(family: str, tokenizer: Tokenizer, rows: int) -> torch.nn.Module:
    """A 2-layer ``family`` model of ``rows`` embedding rows whose padded rows (ids from
    the tokenizer's size on) score 30 above any other id: every draw picks one unless
    they are masked."""
    cfg = SimpleNamespace(
        family=family, name="t", hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
        ffn_hidden_size=None, init_std=0.02, dropout=0.0, vocab_size=rows,
        attn_implementation="eager", extra={},
    )  # fmt: skip
    model = build_model(cfg, vocab_size=tokenizer.vocab_size, seq_len=32, eot_id=2, seed=0)
    favour = torch.zeros(rows)
    favour[tokenizer.vocab_size :] = 30.0
    model.get_output_embeddings().register_forward_hook(lambda _m, _i, out: out + favour)
    return model.eval()
