"""Open a ``data.streaming`` corpus for training: tokenizer, validation head and loader.

Nothing is prepared into shards. What runs before step 0 is bounded:

- the tokenizer: ``data.tokenizer``, or a SentencePiece model trained on the first
  ``data.tokenizer_train_chars`` characters of the stream, cached under ``data.cache_dir``
  by the stream's reference and the tokenizer settings (the ranks of a node take turns on a
  file lock, so one trains and the others load its model);
- validation: the first ``data.val_documents`` documents of the stream, tokenized into
  memory (at least one window of ``seq_len + 1`` tokens; ``collage_train.data.validation``
  shares their windows among the ranks); training never sees them (it starts at the next
  document);
- the first batch of this rank's share (``StreamingLoader``), read and tokenized on the fly
  like every later one.
"""

from __future__ import annotations

import fcntl
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Any

import numpy as np

from collage_train.data.cache import cache_key, staged_directory
from collage_train.data.errors import DataError
from collage_train.data.settings import DataSettings
from collage_train.data.shards import encode_task, prepare_tokenizer
from collage_train.data.sources import Source, open_source
from collage_train.data.store import token_dtype
from collage_train.data.streaming import StreamingLoader
from collage_train.data.tokenizer import Tokenizer, TokenizerSettings

logger = logging.getLogger(__name__)


@dataclass
class StreamData:
    """What a streaming run trains and validates on."""

    tokenizer: Tokenizer
    train_loader: StreamingLoader
    val_tokens: np.ndarray
    meta: dict[str, Any]


def open_stream(
    settings: DataSettings, *, seq_len: int, micro_batch_size: int, rank: int, world_size: int
) -> StreamData:
    """Tokenizer, validation tokens and this rank's streaming loader for ``settings``."""
    source = open_source(settings)
    fingerprint = source.fingerprint()
    tokenizer = stream_tokenizer(settings, source, fingerprint)
    val_tokens, held_out = validation_head(source, tokenizer, settings.val_documents)
    needed = seq_len + 1  # one window: collage_train.data.validation shares what there is
    if val_tokens.size < needed:
        raise DataError(
            f"the first {held_out} documents of the stream, held out for validation "
            f"(data.val_documents={settings.val_documents}), hold {val_tokens.size} tokens, too "
            f"few for one validation window of seq_len {seq_len} (needs {needed}); raise "
            "data.val_documents or lower seq_len"
        )
    loader = StreamingLoader(
        source.documents,
        tokenizer,
        seq_len=seq_len,
        batch_size=micro_batch_size,
        rank=rank,
        world_size=world_size,
        skip=held_out,
        stream=fingerprint,
    )
    meta = {
        "source": {**source.metadata(), "streaming": True},
        "vocab_size": tokenizer.vocab_size,
        "eot_id": tokenizer.eot_id,
        "tokenizer": tokenizer.describe(),
        "val_documents": held_out,
        "val_tokens": int(val_tokens.size),
        "cache_dir": str(settings.cache_dir),
    }
    logger.info(
        "data: streaming %s, rank %d of %d reads every %d-th document after the %d (%d tokens) "
        "held out for validation",
        settings.name,
        rank,
        world_size,
        world_size,
        held_out,
        val_tokens.size,
    )
    return StreamData(tokenizer, loader, val_tokens, meta)


def validation_head(source: Source, tokenizer: Tokenizer, count: int) -> tuple[np.ndarray, int]:
    """The tokens of the stream's first ``count`` documents (each followed by the end-of-text
    id) and how many documents there were (fewer when the stream is shorter)."""
    texts = list(islice(source.documents(), count))
    _, _, tokens, _ = encode_task((0, texts), tokenizer, token_dtype(tokenizer.vocab_size).name)
    return tokens, len(texts)


def stream_tokenizer(settings: DataSettings, source: Source, fingerprint: str) -> Tokenizer:
    """``data.tokenizer`` copied into the cache in its canonical form (the file checkpoints
    keep), else the SentencePiece model trained on the head of the stream."""
    if settings.tokenizer is not None:
        given = Tokenizer.load(settings.tokenizer)
        target = settings.cache_dir / f"tokenizer-{cache_key({'given': given.describe()})}"
        if not (target / given.canonical_filename()).is_file():
            with staged_directory(target) as staging:
                given.copy_to(staging)
        return Tokenizer.load(target / given.canonical_filename())
    trained = TokenizerSettings(settings.vocab_size, settings.tokenizer_train_chars)
    with exclusive(settings.cache_dir / f".tokenizer-{fingerprint[:16]}.lock"):
        return prepare_tokenizer(source, fingerprint, trained, settings.cache_dir)


@contextmanager
def exclusive(lock_path: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``lock_path`` (waiting for it) for the block."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with lock_path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
