"""Assemble tokenizer, token shards and loaders for a training run.

The first process of each node (``LOCAL_RANK`` 0, or rank 0 when unset) prepares the
corpus if it is not prepared yet; the others wait for its manifest on the file system,
printing progress (no collective, so no ``distributed.timeout_minutes`` bound).
With ``data.streaming`` nothing is prepared: each rank reads, tokenizes and packs its share
of the stream on the fly (``collage_train.data.stream_data``). Which held-out windows a
validation pass evaluates, the same at any world size, is ``collage_train.data.validation``'s
policy.
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
from collage_train.data.mixture import MixtureLoader
from collage_train.data.settings import DataSettings
from collage_train.data.shards import load_prepared, prepare_mixture, prepare_shards
from collage_train.data.store import ConcatTokens, ShardedTokens, open_splits
from collage_train.data.stream_data import open_stream
from collage_train.data.streaming import StreamingLoader
from collage_train.data.tokenizer import Tokenizer
from collage_train.data.validation import (
    ValidationPlan,
    no_window_error,
    plan_validation,
    window_batch,
)

logger = logging.getLogger(__name__)


@dataclass
class DataBundle:
    """Everything the trainer needs from the data pipeline."""

    tokenizer: Tokenizer
    train_loader: TokenLoader | MixtureLoader | StreamingLoader
    val_tokens: ShardedTokens | ConcatTokens | np.ndarray
    meta: dict[str, Any]
    seq_len: int
    rank: int = 0
    world_size: int = 1

    def validation_plan(self, micro_batch_size: int, eval_batches: int) -> ValidationPlan:
        """The validation pass of ``train.micro_batch_size`` and ``train.eval_batches`` on
        this split and world size (the policy of ``collage_train.data.validation``);
        DataError, naming what would work, when the split holds no window at all."""
        available = max(len(self.val_tokens) - 1, 0) // self.seq_len
        if available == 0:
            raise no_window_error(self.meta, len(self.val_tokens), self.seq_len)
        return plan_validation(
            available,
            seq_len=self.seq_len,
            world_size=self.world_size,
            micro_batch_size=micro_batch_size,
            eval_batches=eval_batches,
        )

    def validation_batches(self, plan: ValidationPlan) -> Iterator[tuple[torch.Tensor, bool]]:
        """This rank's ``[plan.batch_size, seq_len + 1]`` batches of one pass with whether
        each counts (every rank yields as many; see ``ValidationPlan.batches_of``)."""
        for index, counted in plan.batches_of(self.rank):
            first = index * plan.batch_size
            yield window_batch(self.val_tokens, self.seq_len, first, plan.batch_size), counted


def build_data(
    cfg: Any,
    *,
    seq_len: int,
    micro_batch_size: int,
    seed: int,
    rank: int = 0,
    world_size: int = 1,
) -> DataBundle:
    """Prepare (or reuse, or wait for) the corpus for ``cfg`` and build the loaders; a stream
    (``data.streaming``) is opened instead, unprepared."""
    settings = DataSettings.from_config(cfg)
    if settings.streaming:
        stream = open_stream(
            settings,
            seq_len=seq_len,
            micro_batch_size=micro_batch_size,
            rank=rank,
            world_size=world_size,
        )
        return DataBundle(
            tokenizer=stream.tokenizer,
            train_loader=stream.train_loader,
            val_tokens=stream.val_tokens,
            meta=stream.meta,
            seq_len=seq_len,
            rank=rank,
            world_size=world_size,
        )
    if settings.mixture is not None:
        return build_mixture(
            settings,
            seq_len=seq_len,
            micro_batch_size=micro_batch_size,
            seed=seed,
            rank=rank,
            world_size=world_size,
        )
    directory = prepare_shards(settings, prepare=prepares_data(rank, world_size))
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


def build_mixture(
    settings: DataSettings,
    *,
    seq_len: int,
    micro_batch_size: int,
    seed: int,
    rank: int,
    world_size: int,
) -> DataBundle:
    """The bundle of ``data.mixture``: a ``MixtureLoader`` over the sources' training splits,
    validation on their validation splits one after another."""
    assert settings.mixture is not None
    entries = settings.mixture
    directories = prepare_mixture(settings, prepare=prepares_data(rank, world_size))
    trains, vals, described = [], [], []
    tokenizer = None
    for entry, directory in zip(entries, directories, strict=True):
        manifest, tokenizer = load_prepared(directory)
        train, val, _ = open_splits(directory, manifest, settings.val_fraction)
        trains.append(train)
        vals.append(val)
        described.append(
            {
                "label": entry.label,
                "weight": entry.weight,
                "cache_dir": str(directory),
                "num_documents": manifest["num_documents"],
                "train_tokens": train.size,
                "val_tokens": val.size,
                **manifest["source"],
            }
        )
    assert tokenizer is not None
    meta = {
        "source": {
            "source": "mixture",
            "labels": [e.label for e in entries],
            "weights": [e.weight for e in entries],
        },
        "vocab_size": tokenizer.vocab_size,
        "eot_id": tokenizer.eot_id,
        "num_documents": sum(d["num_documents"] for d in described),
        "train_tokens": sum(d["train_tokens"] for d in described),
        "val_tokens": sum(d["val_tokens"] for d in described),
        "val_fraction": settings.val_fraction,
        "cache_dir": str(settings.cache_dir),
        "mixture": described,
    }
    logger.info(
        "data: a mixture of %s",
        ", ".join(f"{d['label']} ({d['weight']:g}, {d['train_tokens']} tokens)" for d in described),
    )
    return DataBundle(
        tokenizer=tokenizer,
        train_loader=MixtureLoader(
            trains,
            [e.label for e in entries],
            [e.weight for e in entries],
            seq_len=seq_len,
            batch_size=micro_batch_size,
            seed=seed,
            rank=rank,
            world_size=world_size,
        ),
        val_tokens=ConcatTokens(vals),
        meta=meta,
        seq_len=seq_len,
        rank=rank,
        world_size=world_size,
    )


def prepares_data(rank: int, world_size: int) -> bool:
    """Whether this process prepares a missing corpus: the only one, or the first of its node
    (``LOCAL_RANK`` 0, else rank 0); the others wait for it."""
    if world_size == 1:  # nobody else would: a stray LOCAL_RANK must not make it wait
        return True
    local = os.environ.get("LOCAL_RANK")
    return int(local) == 0 if local is not None else rank == 0
