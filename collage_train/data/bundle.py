"""Assemble tokenizer, token shards and loaders for a training run.

The first process of each node (``LOCAL_RANK`` 0, or rank 0 when unset) prepares the
corpus if it is not prepared yet; the others wait for its manifest on the file system,
printing progress (no collective, so no ``distributed.timeout_minutes`` bound).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from collage_train.data.loader import TokenLoader
from collage_train.data.settings import DataSettings
from collage_train.data.shards import load_prepared, prepare_shards
from collage_train.data.store import ShardedTokens, open_splits
from collage_train.data.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


@dataclass
class DataBundle:
    """Everything the trainer needs from the data pipeline."""

    tokenizer: Tokenizer
    train_loader: TokenLoader
    val_tokens: ShardedTokens | np.ndarray
    meta: dict[str, Any]
    seq_len: int
    rank: int = 0
    world_size: int = 1

    def val_loader(self, batch_size: int) -> TokenLoader:
        """Return an unshuffled loader over the validation tokens (seed 0, this rank's share)."""
        return TokenLoader(
            self.val_tokens,
            seq_len=self.seq_len,
            batch_size=batch_size,
            seed=0,
            shuffle=False,
            rank=self.rank,
            world_size=self.world_size,
            split="validation",
        )

    def validation_batches(
        self, batch_size: int, max_batches: int | None = None
    ) -> Iterator[torch.Tensor]:
        """Yield one pass over the validation split, at most ``max_batches`` batches.

        Every rank yields the same number of batches, each rank its own share of the windows.
        """
        loader = self.val_loader(batch_size)
        count = loader.batches_per_epoch
        if max_batches is not None:
            count = min(count, max_batches)
        for _ in range(count):
            yield loader.next_batch()


def build_data(
    cfg: Any,
    *,
    seq_len: int,
    micro_batch_size: int,
    seed: int,
    rank: int = 0,
    world_size: int = 1,
) -> DataBundle:
    """Prepare (or reuse, or wait for) the corpus for ``cfg`` and build the loaders."""
    settings = DataSettings.from_config(cfg)
    directory = prepare_shards(settings, prepare=prepares_data(rank))
    manifest, tokenizer = load_prepared(directory)
    train_tokens, val_tokens, spans = open_splits(directory, manifest, settings.val_fraction)
    meta = {key: value for key, value in manifest.items() if key != "shards"}
    meta.update(
        train_tokens=train_tokens.size,
        val_tokens=val_tokens.size,
        val_fraction=settings.val_fraction,
        val_spans=[list(span) for span in spans],
        cache_dir=str(directory),
    )
    logger.info(
        "data: %d train and %d validation tokens in %d shards of %s",
        train_tokens.size,
        val_tokens.size,
        manifest["num_shards"],
        directory,
    )
    return DataBundle(
        tokenizer=tokenizer,
        train_loader=TokenLoader(
            train_tokens,
            seq_len=seq_len,
            batch_size=micro_batch_size,
            seed=seed,
            shuffle=True,
            rank=rank,
            world_size=world_size,
        ),
        val_tokens=val_tokens,
        meta=meta,
        seq_len=seq_len,
        rank=rank,
        world_size=world_size,
    )


def prepares_data(rank: int) -> bool:
    """Whether this process prepares a missing corpus: the first of its node, else waits."""
    local = os.environ.get("LOCAL_RANK")
    return int(local) == 0 if local is not None else rank == 0
