"""Deterministic, resumable batches of fixed-length token windows from a token memmap."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from collage_train.data.errors import DataError

CHECKED_STATE_FIELDS = ("seed", "num_samples", "seq_len", "world_size")


class TokenLoader:
    """Serve ``[batch_size, seq_len + 1]`` LongTensors of consecutive tokens.

    Sample ``i`` is ``tokens[i * seq_len : i * seq_len + seq_len + 1]``: windows do not overlap
    except for the one token they share at their boundary (the last input token's target is the
    next window's first input). Each epoch visits the samples in the order of a permutation drawn
    from ``np.random.default_rng([seed, epoch])`` (identity order when ``shuffle`` is false).
    A global batch is ``batch_size * world_size`` consecutive permutation entries; rank ``r``
    takes the contiguous slice ``[r * batch_size, (r + 1) * batch_size)`` of it. The incomplete
    global batch at the end of an epoch is dropped. State is rank-independent: every rank stores
    the same ``epoch`` and ``position`` (index of the next global batch in the permutation).
    """

    def __init__(
        self,
        tokens: np.ndarray,
        seq_len: int,
        batch_size: int,
        seed: int,
        shuffle: bool = True,
        rank: int = 0,
        world_size: int = 1,
        split: str = "train",
    ) -> None:
        if seq_len < 1 or batch_size < 1 or world_size < 1 or seed < 0:
            raise DataError(
                f"data loader: seq_len ({seq_len}), batch_size ({batch_size}) and world_size "
                f"({world_size}) must be positive and seed ({seed}) non-negative"
            )
        if not 0 <= rank < world_size:
            raise DataError(f"data loader: rank {rank} is outside [0, {world_size})")
        self.tokens = tokens
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.rank = rank
        self.world_size = world_size
        self.num_samples = max(len(tokens) - 1, 0) // seq_len
        self.global_batch_size = batch_size * world_size
        if self.num_samples < self.global_batch_size:
            raise DataError(
                f"the {split} split has {len(tokens)} tokens, too few for one global batch of "
                f"{self.global_batch_size} sequences of seq_len {seq_len} (needs "
                f"{self.global_batch_size * seq_len + 1}); lower seq_len or the batch size, "
                "or add data"
            )
        self._epoch = 0
        self._position = 0
        self._order = self._permutation(0)

    @property
    def epoch(self) -> int:
        """Epoch that the next batch belongs to (starting at 0)."""
        return self._epoch

    @property
    def batches_per_epoch(self) -> int:
        """Number of batches per epoch (the same on every rank)."""
        return self.num_samples // self.global_batch_size

    @property
    def samples_per_epoch(self) -> int:
        """Samples this rank receives per epoch (the dropped incomplete batch excluded)."""
        return self.batches_per_epoch * self.batch_size

    def _permutation(self, epoch: int) -> np.ndarray:
        """Return the sample order of ``epoch``."""
        if not self.shuffle:
            return np.arange(self.num_samples)
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)

    def next_batch(self) -> torch.Tensor:
        """Return this rank's next ``[batch_size, seq_len + 1]`` int64 batch and advance."""
        start = self._position + self.rank * self.batch_size
        samples = self._order[start : start + self.batch_size]
        offsets = samples[:, None] * self.seq_len + np.arange(self.seq_len + 1)
        batch = torch.from_numpy(np.asarray(self.tokens[offsets], dtype=np.int64))
        self._position += self.global_batch_size
        self._roll_epoch_if_done()
        return batch

    def __iter__(self) -> Iterator[torch.Tensor]:
        return self

    def __next__(self) -> torch.Tensor:
        return self.next_batch()

    def state_dict(self) -> dict[str, int]:
        """Return the position to resume from, plus fields that must match on resume."""
        return {
            "epoch": self._epoch,
            "position": self._position,
            "seed": self.seed,
            "num_samples": self.num_samples,
            "seq_len": self.seq_len,
            "world_size": self.world_size,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from ``state_dict()`` output; raise DataError if it belongs to another run."""
        mismatches = [
            f"{field} {state.get(field)} != {getattr(self, field)}"
            for field in CHECKED_STATE_FIELDS
            if state.get(field) != getattr(self, field)
        ]
        if mismatches:
            raise DataError(
                f"the data loader state does not match this run: {', '.join(mismatches)}"
            )
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position <= self.num_samples:
            raise DataError(
                "the data loader state does not match this run: "
                f"epoch {epoch} / position {position} is out of range"
            )
        self._epoch = epoch
        self._position = position
        self._order = self._permutation(epoch)
        self._roll_epoch_if_done()

    def _roll_epoch_if_done(self) -> None:
        """Start the next epoch when no complete global batch is left in this one."""
        if self._position + self.global_batch_size > self.num_samples:
            self._epoch += 1
            self._position = 0
            self._order = self._permutation(self._epoch)
