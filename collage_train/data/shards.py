"""Tokenize the corpus once into cached, packed ``train.bin``/``val.bin`` token shards."""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Iterable, Iterator
from itertools import chain, islice
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

import numpy as np

from collage_train.data.cache import cache_key, remove_stale_staging, staged_directory
from collage_train.data.errors import DataError
from collage_train.data.settings import DataSettings
from collage_train.data.sources import Source, open_source
from collage_train.data.tokenizer import (
    MODEL_FILENAME,
    Tokenizer,
    TokenizerSettings,
    split_after_newlines,
    train_model,
    training_sentences,
)

logger = logging.getLogger(__name__)
T = TypeVar("T")

PIPELINE_VERSION = 1
META_FILENAME = "meta.json"
VAL_STRETCHES = 16
ENCODE_BATCH_PIECES = 256
PIECE_CHARS = 4096
COPY_BLOCK_TOKENS = 1 << 22
PROGRESS_SECONDS = 30.0


def token_dtype(vocab_size: int) -> np.dtype:
    """Return the smallest unsigned dtype that holds every id of ``vocab_size``."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def validation_spans(total: int, fraction: float) -> list[tuple[int, int]]:
    """Place ``round(total * fraction)`` validation tokens in 16 evenly spaced stretches.

    The stream is cut into 16 equal segments and each stretch starts where its segment
    starts, so validation text is drawn from the whole corpus rather than its tail.
    """
    val_total = round(total * fraction)
    spans = []
    for index in range(VAL_STRETCHES):
        length = val_total // VAL_STRETCHES + (index < val_total % VAL_STRETCHES)
        start = index * total // VAL_STRETCHES
        end = min(start + length, (index + 1) * total // VAL_STRETCHES)
        if end > start:
            spans.append((start, end))
    return spans


def prepare_shards(settings: DataSettings) -> Path:
    """Return the cache directory holding the shards for ``settings``, building it if needed."""
    for stale in remove_stale_staging(settings.cache_dir):
        logger.info("removed %s, left by a preparation that was killed", stale)
    source = open_source(settings)
    fingerprint = source.fingerprint()
    tokenizer_settings = TokenizerSettings(settings.vocab_size, settings.tokenizer_train_chars)
    key = cache_key(
        {
            "fingerprint": fingerprint,
            "tokenizer": tokenizer_settings.as_dict(),
            "val_fraction": settings.val_fraction,
            "version": PIPELINE_VERSION,
        }
    )
    target = settings.cache_dir / key
    if (target / META_FILENAME).is_file():
        logger.info("reusing token shards in %s", target)
        return target
    tokenizer = prepare_tokenizer(source, fingerprint, tokenizer_settings, settings.cache_dir)
    with staged_directory(target) as staging:
        tokenizer.copy_to(staging)
        meta = write_shards(source.documents(), tokenizer, staging, settings.val_fraction)
        meta.update(
            key=key,
            version=PIPELINE_VERSION,
            fingerprint=fingerprint,
            source=source.metadata(),
            tokenizer={
                **tokenizer_settings.as_dict(),
                "sha256": hashlib.sha256(tokenizer.model_path.read_bytes()).hexdigest(),
            },
        )
        (staging / META_FILENAME).write_text(json.dumps(meta, indent=2) + "\n")
    return target


def prepare_tokenizer(
    source: Source, fingerprint: str, settings: TokenizerSettings, cache_dir: Path
) -> Tokenizer:
    """Load the cached tokenizer for this corpus and settings, training it if needed."""
    key = cache_key({"fingerprint": fingerprint, **settings.as_dict()})
    target = cache_dir / f"tokenizer-{key}"
    if not (target / MODEL_FILENAME).is_file():
        started = time.perf_counter()
        sentences = training_sentences(source.documents(), settings.train_chars)
        chars = sum(map(len, sentences))
        logger.info(
            "training a %d-piece tokenizer on %d characters in %d lines",
            settings.vocab_size,
            chars,
            len(sentences),
        )
        model = train_model(sentences, settings)
        with staged_directory(target) as staging:
            (staging / MODEL_FILENAME).write_bytes(model)
        logger.info("trained the tokenizer in %.1f s", time.perf_counter() - started)
    return Tokenizer.load(target)


def write_shards(
    documents: Iterable[str], tokenizer: Tokenizer, directory: Path, val_fraction: float
) -> dict[str, Any]:
    """Write ``train.bin`` and ``val.bin`` into ``directory`` and return their metadata."""
    dtype = token_dtype(tokenizer.vocab_size)
    stream_path = directory / "stream.bin"
    num_documents, total = write_token_stream(documents, tokenizer, stream_path, dtype)
    spans = validation_spans(total, val_fraction)
    val_tokens = sum(end - start for start, end in spans)
    if val_tokens == 0:
        raise DataError(
            f"data.val_fraction: {val_fraction} of {total} tokens leaves no validation tokens; "
            "add data or raise data.val_fraction"
        )
    split_stream(stream_path, directory / "train.bin", directory / "val.bin", spans, dtype)
    stream_path.unlink()
    return {
        "dtype": dtype.name,
        "vocab_size": tokenizer.vocab_size,
        "eot_id": tokenizer.eot_id,
        "num_documents": num_documents,
        "total_tokens": total,
        "train_tokens": total - val_tokens,
        "val_tokens": val_tokens,
        "val_fraction": val_fraction,
        "val_spans": [list(span) for span in spans],
    }


def write_token_stream(
    documents: Iterable[str], tokenizer: Tokenizer, path: Path, dtype: np.dtype
) -> tuple[int, int]:
    """Encode documents in batched pieces, appending each one's ids plus ``eot`` to ``path``.

    Returns the number of documents and of tokens written.
    """
    started = last_report = time.perf_counter()
    num_documents = total = 0
    with path.open("wb") as handle:
        for batch in batches(document_pieces(documents), ENCODE_BATCH_PIECES):
            encoded = tokenizer.encode_batch(piece for piece, _ in batch)
            for ids, (_, ends_document) in zip(encoded, batch, strict=True):
                if ends_document:
                    ids.append(tokenizer.eot_id)
                    num_documents += 1
            tokens = np.fromiter(chain.from_iterable(encoded), dtype=dtype)
            tokens.tofile(handle)
            total += tokens.size
            if time.perf_counter() - last_report > PROGRESS_SECONDS:
                last_report = time.perf_counter()
                logger.info("tokenized %d documents, %d tokens so far", num_documents, total)
    logger.info(
        "tokenized %d documents into %d tokens in %.1f s",
        num_documents,
        total,
        time.perf_counter() - started,
    )
    return num_documents, total


def document_pieces(documents: Iterable[str]) -> Iterator[tuple[str, bool]]:
    """Yield ``(piece, ends_document)`` for newline-aligned pieces of every document."""
    for document in documents:
        pieces = list(split_after_newlines(document, PIECE_CHARS))
        for index, piece in enumerate(pieces):
            yield piece, index == len(pieces) - 1


def split_stream(
    stream_path: Path,
    train_path: Path,
    val_path: Path,
    spans: list[tuple[int, int]],
    dtype: np.dtype,
) -> None:
    """Copy the ``spans`` of the token stream to ``val_path`` and the rest to ``train_path``."""
    stream = np.memmap(stream_path, dtype=dtype, mode="r")
    with train_path.open("wb") as train, val_path.open("wb") as val:
        cursor = 0
        for start, end in spans:
            copy_range(stream, cursor, start, train)
            copy_range(stream, start, end, val)
            cursor = end
        copy_range(stream, cursor, stream.size, train)


def copy_range(stream: np.ndarray, start: int, end: int, handle: BinaryIO) -> None:
    """Write ``stream[start:end]`` to an open binary file in bounded blocks."""
    for block_start in range(start, end, COPY_BLOCK_TOKENS):
        stream[block_start : min(block_start + COPY_BLOCK_TOKENS, end)].tofile(handle)


def batches(items: Iterable[T], size: int) -> Iterator[list[T]]:
    """Yield consecutive lists of at most ``size`` items."""
    iterator = iter(items)
    while batch := list(islice(iterator, size)):
        yield batch


def load_meta(directory: Path) -> dict[str, Any]:
    """Read a shard directory's ``meta.json``."""
    return json.loads((directory / META_FILENAME).read_text())
