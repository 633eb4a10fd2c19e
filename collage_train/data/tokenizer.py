"""Tokenizers: a SentencePiece BPE trained on the corpus (the default) or an existing one.

``Tokenizer.load`` opens either kind behind one interface (``encode``, ``encode_batch``,
``decode``, ``vocab_size``, ``eot_id``). Each is held in one file, ``model_path``, which the
cache and the checkpoints copy: ``tokenizer.model`` (a SentencePiece model) or
``hf_tokenizer.json`` (a Hugging Face ``tokenizers`` tokenizer plus its end-of-text token).
``hf_files.save_tokenizer`` writes that file plus the files ``AutoTokenizer.from_pretrained``
reads, giving the same ids.

SentencePiece normally collapses whitespace and treats its input as single lines. For the
trained model the normalizer is the identity, whitespace-only pieces are allowed (so
indentation becomes a few ``▁▁▁▁`` pieces), unknown characters fall back to bytes, and
``"\\n"`` is a user-defined symbol: it is always its own token (id 3) and the trainer
sees the corpus one line at a time. Any text then decodes back exactly, except that
U+2581 (``▁``, SentencePiece's own space marker) decodes to an ordinary space.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import sentencepiece as spm

from collage_train.data.errors import DataError
from collage_train.errors import first_line

MODEL_FILENAME = "tokenizer.model"
HF_BUNDLE_FILENAME = "hf_tokenizer.json"
HF_BUNDLE_FORMAT = "collage_train.hf_tokenizer"
HF_TOKENIZER_FILENAME = "tokenizer.json"
HF_CONFIG_FILENAME = "tokenizer_config.json"
# End-of-text tokens of common tokenizers, tried in order when no eos_token is configured.
KNOWN_EOT_TOKENS = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>")
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
    """A tokenizer held in one file; ``eot_id`` ends every document in the token stream."""

    kind = "abstract"

    def __init__(self, model_path: Path) -> None:
        self.model_path = model_path

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """Open a tokenizer file or directory of either kind.

        A directory is searched for ``hf_tokenizer.json``, then ``tokenizer.json`` (its
        ``tokenizer_config.json`` names the end-of-text token), then ``tokenizer.model``.
        A file is a SentencePiece model unless it holds JSON. Anything else raises DataError.
        """
        model_path = Path(path).expanduser()
        if model_path.is_dir():
            for name in (HF_BUNDLE_FILENAME, HF_TOKENIZER_FILENAME, MODEL_FILENAME):
                if (model_path / name).is_file():
                    model_path = model_path / name
                    break
            else:
                raise DataError(
                    f"tokenizer: {model_path} holds no {HF_TOKENIZER_FILENAME} or "
                    f"{MODEL_FILENAME}; point to a tokenizer directory or file"
                )
        if not model_path.is_file():
            raise DataError(f"tokenizer: {model_path} does not exist")
        with model_path.open("rb") as handle:
            start = handle.read(64).lstrip()
        if start.startswith(b"{"):
            return HFTokenizer.from_json_file(model_path)
        return SentencePieceTokenizer(model_path)

    @property
    def vocab_size(self) -> int:
        """Number of token ids (one more than the largest id), special tokens included."""
        raise NotImplementedError

    @property
    def eot_id(self) -> int:
        """End-of-text id appended after every document."""
        raise NotImplementedError

    def encode(self, text: str) -> list[int]:
        """Encode one string (no special tokens added)."""
        return self.encode_batch([text])[0]

    def encode_batch(self, texts: Iterable[str]) -> list[list[int]]:
        """Encode several strings (no special tokens added), in parallel where supported."""
        raise NotImplementedError

    def decode(self, ids: Iterable[int]) -> str:
        """Decode ids back to text; the end-of-text id decodes to nothing."""
        raise NotImplementedError

    def single_threaded(self) -> None:
        """Encode on one thread (in a worker process that is one of several)."""

    def sha256(self) -> str:
        """Hash of the tokenizer's file: its identity in cache keys and manifests."""
        return hashlib.sha256(self.model_path.read_bytes()).hexdigest()

    def describe(self) -> dict[str, Any]:
        """Kind, vocabulary, end-of-text id and hash, for manifests and summaries."""
        return {
            "kind": self.kind,
            "vocab_size": self.vocab_size,
            "eot_id": self.eot_id,
            "sha256": self.sha256(),
        }

    def copy_to(self, directory: str | os.PathLike[str]) -> Path:
        """Copy the tokenizer's one file into ``directory`` under its canonical name."""
        target = Path(directory) / self.canonical_filename()
        target.parent.mkdir(parents=True, exist_ok=True)
        if not (target.exists() and target.samefile(self.model_path)):
            shutil.copyfile(self.model_path, target)
        return target

    def canonical_filename(self) -> str:
        """The name of the tokenizer's one file in caches and exports."""
        raise NotImplementedError


class SentencePieceTokenizer(Tokenizer):
    """A SentencePiece model, trained here (the default) or given as ``data.tokenizer``."""

    kind = "sentencepiece"

    def __init__(self, model_path: Path) -> None:
        super().__init__(model_path)
        try:
            self._processor = spm.SentencePieceProcessor(model_file=str(model_path))
        except (RuntimeError, OSError) as exc:
            raise DataError(
                f"tokenizer: {model_path} is neither a SentencePiece model nor a tokenizer.json "
                f"({first_line(exc)})"
            ) from None
        if self._processor.eos_id() < 0:
            raise DataError(
                f"tokenizer: {model_path} has no end-of-text piece (eos_id is unset); "
                "use a SentencePiece model trained with an eos piece"
            )
        self._num_threads = available_cpus()

    @property
    def vocab_size(self) -> int:
        return self._processor.get_piece_size()

    @property
    def eot_id(self) -> int:
        return self._processor.eos_id()

    def single_threaded(self) -> None:
        self._num_threads = 1

    @property
    def processor(self) -> spm.SentencePieceProcessor:
        """The underlying SentencePiece processor."""
        return self._processor

    def encode(self, text: str) -> list[int]:
        return self._processor.encode(text)

    def encode_batch(self, texts: Iterable[str]) -> list[list[int]]:
        return self._processor.encode(list(texts), num_threads=self._num_threads)

    def decode(self, ids: Iterable[int]) -> str:
        return self._processor.decode([int(i) for i in ids])

    def canonical_filename(self) -> str:
        return MODEL_FILENAME


class HFTokenizer(Tokenizer):
    """A Hugging Face ``tokenizers`` tokenizer and the name of its end-of-text token.

    Its one file, ``hf_tokenizer.json``, bundles ``tokenizer.json``, the end-of-text token
    and the original ``tokenizer_config.json`` (if any). Documents are encoded without the
    tokenizer's special-token template (no BOS) and special tokens written literally in a
    document stay text; the end-of-text id follows each document.
    """

    kind = "hf"

    def __init__(
        self,
        model_path: Path,
        tokenizer_json: str,
        eot_token: str,
        config: dict[str, Any] | None,
    ) -> None:
        from tokenizers import Tokenizer as BackendTokenizer

        super().__init__(model_path)
        try:
            self._backend = BackendTokenizer.from_str(tokenizer_json)
        except Exception as exc:  # tokenizers raises a bare Exception for a bad file
            raise DataError(
                f"tokenizer: {model_path} is not a Hugging Face tokenizer.json ({first_line(exc)})"
            ) from None
        self._backend.encode_special_tokens = True  # literal "</s>" in a document is text
        eot_id = self._backend.token_to_id(eot_token)
        if eot_id is None:
            raise DataError(f"tokenizer: {model_path} has no end-of-text token {eot_token!r}")
        self._eot_id = eot_id
        self.eot_token = eot_token
        self.tokenizer_json = tokenizer_json
        self.config = config
        vocabulary = self._backend.get_vocab(with_added_tokens=True)
        self._vocab_size = max(vocabulary.values()) + 1

    @classmethod
    def from_json_file(cls, path: Path) -> HFTokenizer:
        """Open ``hf_tokenizer.json`` (our bundle) or a plain ``tokenizer.json``."""
        try:
            document = json.loads(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise DataError(f"tokenizer: {path} is not valid JSON ({exc})") from None
        if not isinstance(document, dict) or not (
            "model" in document or document.get("format") == HF_BUNDLE_FORMAT
        ):
            raise DataError(f"tokenizer: {path} is not a Hugging Face tokenizer.json")
        if document.get("format") == HF_BUNDLE_FORMAT:
            return cls(
                path, json.dumps(document["tokenizer"]), document["eot_token"], document["config"]
            )
        config_path = path.parent / HF_CONFIG_FILENAME
        config = json.loads(config_path.read_text()) if config_path.is_file() else None
        return cls(
            path, path.read_text(encoding="utf-8"), find_eot_token(path, document, config), config
        )

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def eot_id(self) -> int:
        return self._eot_id

    def encode_batch(self, texts: Iterable[str]) -> list[list[int]]:
        encodings = self._backend.encode_batch(list(texts), add_special_tokens=False)
        return [encoding.ids for encoding in encodings]

    def decode(self, ids: Iterable[int]) -> str:
        return self._backend.decode([int(i) for i in ids], skip_special_tokens=True)

    def canonical_filename(self) -> str:
        return HF_BUNDLE_FILENAME

    def copy_to(self, directory: str | os.PathLike[str]) -> Path:
        """Write the bundle (tokenizer, end-of-text token, original config) into ``directory``."""
        target = Path(directory) / HF_BUNDLE_FILENAME
        target.parent.mkdir(parents=True, exist_ok=True)
        if target.exists() and target.samefile(self.model_path):
            return target
        if self.model_path.name == HF_BUNDLE_FILENAME:
            shutil.copyfile(self.model_path, target)
            return target
        bundle = {
            "format": HF_BUNDLE_FORMAT,
            "eot_token": self.eot_token,
            "config": self.config,
            "tokenizer": json.loads(self.tokenizer_json),
        }
        tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(bundle, ensure_ascii=False) + "\n", encoding="utf-8")
        os.replace(tmp, target)
        return target


def find_eot_token(path: Path, document: dict[str, Any], config: dict[str, Any] | None) -> str:
    """The end-of-text token of a tokenizer.json: its config's ``eos_token``, else a known name."""
    eos = (config or {}).get("eos_token")
    if isinstance(eos, dict):  # a serialized AddedToken
        eos = eos.get("content")
    if isinstance(eos, str) and eos:
        return eos
    added = {token.get("content") for token in document.get("added_tokens") or []}
    vocabulary = (document.get("model") or {}).get("vocab")
    names = set(vocabulary) if isinstance(vocabulary, dict) else set()
    for candidate in KNOWN_EOT_TOKENS:
        if candidate in added or candidate in names:
            return candidate
    raise DataError(
        f"tokenizer: {path} names no end-of-text token; put a {HF_CONFIG_FILENAME} with an "
        f"eos_token beside it (or use one of {', '.join(KNOWN_EOT_TOKENS)})"
    )
