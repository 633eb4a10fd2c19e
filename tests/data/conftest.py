"""Fixtures for the data pipeline tests: a generated code corpus, configs, a trained tokenizer."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from collage_train.data import Tokenizer
from collage_train.data.settings import DataSettings
from collage_train.data.shards import prepare_tokenizer
from collage_train.data.sources import open_source
from collage_train.data.tokenizer import TokenizerSettings

SMALL_VOCAB = 512
WORDS = [
    "alpha", "beta", "gamma", "delta", "value", "index", "result", "items", "count", "name",
    "parser", "buffer", "token", "node", "state", "config", "path", "data", "total", "offset",
]  # fmt: skip


def code_document(rng: random.Random, lines: int) -> str:
    """Return Python-like text with nested indentation, tabs, blank lines and comments."""
    out = [f'"""Module {rng.choice(WORDS)} — generated, ünïcode ok."""', ""]
    depth = 0
    for _ in range(lines):
        indent = ("\t" * depth) if rng.random() < 0.1 else ("    " * depth)
        a, b = rng.sample(WORDS, 2)
        kind = rng.random()
        if kind < 0.15 and depth < 4:
            out.append(f"{indent}def {a}_{b}(self, {a}, {b}={rng.randint(0, 999)}):")
            depth += 1
        elif kind < 0.25 and depth < 4:
            out.append(f"{indent}for {a} in range(len({b})):")
            depth += 1
        elif kind < 0.35:
            out.append("")
            depth = max(0, depth - rng.randint(0, 2))
        elif kind < 0.45:
            out.append(f"{indent}# {a} {b}  {rng.choice(WORDS)}   trailing  ")
        else:
            out.append(f"{indent}{a} = {b}[{rng.randint(0, 99)}] + {a}.{rng.choice(WORDS)}()")
    return "\n".join(out) + "\n"


def write_code_corpus(root: Path, files: int, seed: int = 0) -> Path:
    """Write ``files`` generated .txt documents (about 3 KB each) under ``root``."""
    rng = random.Random(seed)
    root.mkdir(parents=True, exist_ok=True)
    for index in range(files):
        (root / f"doc_{index:04d}.txt").write_text(code_document(rng, 100), encoding="utf-8")
    return root


def data_cfg(**overrides: Any) -> SimpleNamespace:
    """A data config with the framework defaults and a small vocabulary."""
    fields: dict[str, Any] = {
        "source": "files",
        "paths": [],
        "name": None,
        "config_name": None,
        "split": "train",
        "streaming": False,
        "data_files": None,
        "text_field": "text",
        "max_documents": None,
        "vocab_size": SMALL_VOCAB,
        "tokenizer_train_chars": 4_000_000,
        "val_fraction": 0.05,
        "cache_dir": "unused",
    }
    fields.update(overrides)
    return SimpleNamespace(**fields)


@pytest.fixture(scope="session")
def code_corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """About 300 KB of generated Python-like .txt files."""
    return write_code_corpus(tmp_path_factory.mktemp("code_corpus"), files=100)


@pytest.fixture(scope="session")
def session_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("data_cache")


@pytest.fixture(scope="session")
def small_tokenizer(code_corpus: Path, session_cache: Path) -> Tokenizer:
    """A 512-piece tokenizer trained on the generated corpus."""
    settings = DataSettings.from_config(
        data_cfg(paths=[str(code_corpus)], cache_dir=str(session_cache))
    )
    source = open_source(settings)
    return prepare_tokenizer(
        source,
        source.fingerprint(),
        TokenizerSettings(settings.vocab_size, settings.tokenizer_train_chars),
        settings.cache_dir,
    )


@pytest.fixture
def make_cfg(tmp_path: Path, code_corpus: Path) -> Callable[..., SimpleNamespace]:
    """Build configs over the generated corpus with a per-test cache directory."""

    def make(**overrides: Any) -> SimpleNamespace:
        fields = {"paths": [str(code_corpus)], "cache_dir": str(tmp_path / "cache")}
        fields.update(overrides)
        return data_cfg(**fields)

    return make


@pytest.fixture
def corpus_writer() -> Callable[..., Path]:
    """Return the generator of code corpora, for tests that need their own copy."""
    return write_code_corpus
