"""SentencePiece BPE tokenizer that round-trips source code, whitespace and newlines included.

SentencePiece normally collapses whitespace and treats its input as single lines. Here the
normalizer is the identity, whitespace-only pieces are allowed (so indentation becomes a few
``▁▁▁▁`` pieces), unknown characters fall back to bytes, and ``"\\n"`` is a user-defined symbol:
it is always its own token (id 3) and the trainer sees the corpus one line at a time.
Any text then decodes back exactly, except that U+2581 (``▁``, SentencePiece's own space
marker) decodes to an ordinary space.
"""

from __future__ import annotations

import io
import os
import shutil
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import sentencepiece as spm

from collage_train.data.errors import DataError

MODEL_FILENAME = "tokenizer.model"
NEWLINE = "\n"
MAX_SENTENCE_CHARS = 4096
TOKENIZER_VERSION = 1
TRAINER_OPTIONS: dict[str, Any] = {
    "model_type": "bpe",
    "normalization_rule_name": "identity",
    "remove_extra_whitespaces": False,
    "add_dummy_prefix": False,
    "allow_whitespace_only_pieces": True,
    "byte_fallback": True,
    "split_digits": True,
    "user_defined_symbols": [NEWLINE],
    "character_coverage": 0.9995,
    "unk_id": 0,
    "bos_id": 1,
    "eos_id": 2,
    "pad_id": -1,
    "max_sentence_length": 4 * MAX_SENTENCE_CHARS,
    "input_sentence_size": 2_000_000,
    "shuffle_input_sentence": True,
    "minloglevel": 2,
}


@dataclass(frozen=True)
class TokenizerSettings:
    """What determines a trained tokenizer besides the corpus."""

    vocab_size: int
    train_chars: int

    def as_dict(self) -> dict[str, Any]:
        """Return the settings plus the trainer version, for cache keys and metadata."""
        return {**asdict(self), "version": TOKENIZER_VERSION}


def available_cpus() -> int:
    """Return the number of CPUs this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def split_after_newlines(text: str, min_chars: int) -> Iterator[str]:
    """Cut ``text`` into consecutive pieces, each ending at the first newline after ``min_chars``.

    ``"\\n"`` is an atomic token that no BPE merge crosses, so concatenating the encodings of
    the pieces gives exactly the encoding of ``text``; short pieces encode faster and spread
    evenly over threads.
    """
    start = 0
    while start < len(text):
        end = text.find(NEWLINE, start + min_chars) + 1 or len(text)
        yield text[start:end]
        start = end


def training_sentences(documents: Iterable[str], max_chars: int) -> list[str]:
    """Split the first ``max_chars`` characters of the corpus into non-empty, newline-free lines.

    Lines longer than ``MAX_SENTENCE_CHARS`` are cut into chunks so the trainer keeps them.
    """
    sentences: list[str] = []
    remaining = max_chars
    for document in documents:
        text = document[:remaining]
        remaining -= len(text)
        for line in text.split(NEWLINE):
            sentences.extend(
                line[start : start + MAX_SENTENCE_CHARS]
                for start in range(0, len(line), MAX_SENTENCE_CHARS)
            )
        if remaining <= 0:
            break
    return sentences


def train_model(sentences: Sequence[str], settings: TokenizerSettings) -> bytes:
    """Train a SentencePiece BPE model in memory and return the serialized model."""
    model = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(sentences),
            model_writer=model,
            vocab_size=settings.vocab_size,
            num_threads=available_cpus(),
            **TRAINER_OPTIONS,
        )
    except RuntimeError as exc:
        raise DataError(
            f"data.vocab_size: SentencePiece cannot build {settings.vocab_size} pieces from "
            f"this corpus ({exc}); change data.vocab_size or data.tokenizer_train_chars"
        ) from exc
    return model.getvalue()


class Tokenizer:
    """A trained SentencePiece model; ``eot_id`` ends every document in the token stream."""

    def __init__(self, model_path: Path) -> None:
        self.model_path = model_path
        self._processor = spm.SentencePieceProcessor(model_file=str(model_path))
        self._num_threads = available_cpus()

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """Load a ``.model`` file, or ``tokenizer.model`` inside a directory."""
        model_path = Path(path).expanduser()
        if model_path.is_dir():
            model_path = model_path / MODEL_FILENAME
        if not model_path.is_file():
            raise DataError(f"tokenizer: {model_path} does not exist")
        return cls(model_path)

    @property
    def vocab_size(self) -> int:
        """Number of token ids, special and byte pieces included."""
        return self._processor.get_piece_size()

    @property
    def eot_id(self) -> int:
        """End-of-text id appended after every document."""
        return self._processor.eos_id()

    def encode(self, text: str) -> list[int]:
        """Encode one string (no special tokens added)."""
        return self._processor.encode(text)

    def encode_batch(self, texts: Iterable[str]) -> list[list[int]]:
        """Encode several strings using SentencePiece's thread pool."""
        return self._processor.encode(list(texts), num_threads=self._num_threads)

    def decode(self, ids: Iterable[int]) -> str:
        """Decode ids back to text; the end-of-text id decodes to nothing."""
        return self._processor.decode([int(i) for i in ids])

    def save(self, directory: str | os.PathLike[str]) -> Path:
        """Copy the model to ``directory/tokenizer.model`` and return that path."""
        target = Path(directory) / MODEL_FILENAME
        target.parent.mkdir(parents=True, exist_ok=True)
        if not (target.exists() and target.samefile(self.model_path)):
            shutil.copyfile(self.model_path, target)
        return target
