"""Deterministic, resumable batches of fixed-length token windows over a token sequence.

The tokens are a numpy array (or memmap) or a ``ShardedTokens`` view over many shard files.
The shuffled order is a keyed bijection of the sample indices (a Feistel network with
cycle walking) computed for each batch, not a stored permutation, so the loader's memory
is the same for a 10 MB and a 1 TB corpus.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from collage_train.data.errors import DataError
from collage_train.data.store import ConcatTokens, ShardedTokens

CHECKED_STATE_FIELDS = ("seed", "num_samples", "seq_len", "world_size")
FEISTEL_ROUNDS = 6
MIX_1 = np.uint64(0xBF58476D1CE4E5B9)
MIX_2 = np.uint64(0x94D049BB133111EB)


def mix64(values: np.ndarray) -> np.ndarray:
    """SplitMix64's finalizer: a fast, well-mixing bijection of uint64 values."""
    values = (values ^ (values >> np.uint64(30))) * MIX_1
    values = (values ^ (values >> np.uint64(27))) * MIX_2
    return values ^ (values >> np.uint64(31))


class SampleOrder:
    """A seeded bijection of ``[0, count)``: ``order[i]`` is the ``i``-th sample of an epoch.

    A balanced Feistel network over the smallest even number of bits that covers ``count``
    (a domain under four times ``count``), keyed by ``np.random.default_rng([seed, epoch])``
    (plus ``salt``, which tells apart the sources of a mixture);
    values that land outside ``[0, count)`` are encrypted again until they fall inside (cycle
    walking), which keeps it a bijection. Nothing proportional to ``count`` is stored.
    Without ``shuffle`` it is the identity.
    """

    def __init__(
        self, count: int, seed: int, epoch: int, shuffle: bool = True, salt: tuple[int, ...] = ()
    ) -> None:
        self.count = count
        self.shuffle = shuffle
        bits = max(2, (max(count - 1, 1)).bit_length())
        self.half = np.uint64((bits + 1) // 2)
        self.mask = np.uint64((1 << int(self.half)) - 1)
        self.keys = np.random.default_rng([seed, epoch, *salt]).integers(
            0, 2**63, size=FEISTEL_ROUNDS, dtype=np.uint64
        )

    def _encrypt(self, values: np.ndarray) -> np.ndarray:
        left, right = values >> self.half, values & self.mask
        for key in self.keys:
            left, right = right, left ^ (mix64(right ^ key) & self.mask)
        return (left << self.half) | right

    def __getitem__(self, index: slice) -> np.ndarray:
        start, stop, _ = index.indices(self.count)
        return self.at(np.arange(start, stop, dtype=np.int64))

    def at(self, indices: np.ndarray) -> np.ndarray:
        """``order[i]`` for each ``i`` of ``indices`` (int64, each in ``[0, count)``)."""
        if not self.shuffle:
            return indices.astype(np.int64)
        values = self._encrypt(indices.astype(np.uint64))
        outside = values >= self.count
        while outside.any():
            values[outside] = self._encrypt(values[outside])
            outside = values >= self.count
        return values.astype(np.int64)


class ReorderedTail:
    """``base`` with the entries in ``[start, end)`` visited in another seeded order: a run
    branched mid-epoch with a data-order seed sees the parent's unseen samples of that epoch
    (``end``: the epoch's served entries), each once, in the order of
    ``SampleOrder(end - start, seed, epoch, salt=(start,))``."""

    def __init__(
        self, base: SampleOrder | ReorderedTail, start: int, end: int, seed: int, epoch: int
    ) -> None:
        self.base, self.start, self.end, self.count = base, start, end, base.count
        self.tail = SampleOrder(end - start, seed, epoch, salt=(start,))

    def __getitem__(self, index: slice) -> np.ndarray:
        start, stop, _ = index.indices(self.count)
        return self.at(np.arange(start, stop, dtype=np.int64))

    def at(self, indices: np.ndarray) -> np.ndarray:
        moved = (indices >= self.start) & (indices < self.end)
        source = indices.astype(np.int64)
        if moved.any():
            source[moved] = self.start + self.tail.at(indices[moved] - self.start)
        return self.base.at(source)


def check_loader_shape(
    seq_len: int, batch_size: int, rank: int, world_size: int, counter: str, value: int
) -> None:
    """Refuse a loader shape that cannot serve batches (``counter`` names the loader's own
    non-negative setting: the prepared loader's seed, the streaming loader's skip)."""
    if seq_len < 1 or batch_size < 1 or world_size < 1 or value < 0:
        raise DataError(
            f"data loader: seq_len ({seq_len}), batch_size ({batch_size}) and world_size "
            f"({world_size}) must be positive and {counter} ({value}) non-negative"
        )
    if not 0 <= rank < world_size:
        raise DataError(f"data loader: rank {rank} is outside [0, {world_size})")


class TokenLoader:
    """Serve ``[batch_size, seq_len + 1]`` LongTensors of consecutive tokens.

    Sample ``i`` is ``tokens[i * seq_len : i * seq_len + seq_len + 1]``: windows do not overlap
    except for the one token they share at their boundary (the last input token's target is the
    next window's first input); with sharded tokens a window may span two shards. Each epoch
    visits the samples in the order of a ``SampleOrder`` keyed by ``(seed, epoch)`` (identity
    order when ``shuffle`` is false).
    A global batch is ``batch_size * world_size`` consecutive permutation entries; rank ``r``
    takes the contiguous slice ``[r * batch_size, (r + 1) * batch_size)`` of it. The incomplete
    global batch at the end of an epoch is dropped. State is rank-independent: every rank stores
    the same ``epoch`` and ``position`` (index of the next global batch in the permutation).
    """

    def __init__(
        self,
        tokens: np.ndarray | ShardedTokens | ConcatTokens,
        seq_len: int,
        batch_size: int,
        seed: int,
        shuffle: bool = True,
        rank: int = 0,
        world_size: int = 1,
        split: str = "train",
    ) -> None:
        check_loader_shape(seq_len, batch_size, rank, world_size, "seed", seed)
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
        # data-order seeds of branches (run.branch): {seed, epoch, position} each, oldest first
        self._reorders: list[dict[str, int]] = []
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

    def _permutation(self, epoch: int) -> SampleOrder | ReorderedTail:
        """Return the sample order of ``epoch`` (sliceable; nothing stored per sample): keyed
        by ``(seed, epoch)`` and the data-order seeds of branches made in earlier epochs,
        its tail reordered by those made within it (``reorder``)."""
        earlier = tuple(r["seed"] for r in self._reorders if r["epoch"] < epoch)
        order: SampleOrder | ReorderedTail = SampleOrder(
            self.num_samples, self.seed, epoch, shuffle=self.shuffle, salt=earlier
        )
        for reorder in (r for r in self._reorders if r["epoch"] == epoch):
            served = self.batches_per_epoch * self.global_batch_size
            order = ReorderedTail(order, reorder["position"], served, reorder["seed"], epoch)
        return order

    def reorder(self, seed: int) -> None:
        """From the next batch on, visit the samples in an order keyed by ``seed`` too: the
        unseen samples of this epoch (each once), then every later epoch. Kept in the state,
        so a resumed run continues in the new order."""
        if seed < 0:
            raise DataError(f"a data-order seed must be non-negative, got {seed}")
        self._reorders.append({"seed": seed, "epoch": self._epoch, "position": self._position})
        self._order = self._permutation(self._epoch)

    def next_batch(self) -> torch.Tensor:
        """Return this rank's next ``[batch_size, seq_len + 1]`` int64 batch and advance."""
        start = self._position + self.rank * self.batch_size
        samples = self._order[start : start + self.batch_size]
        offsets = samples[:, None] * self.seq_len + np.arange(self.seq_len + 1)
        if isinstance(self.tokens, np.ndarray):
            windows = np.asarray(self.tokens[offsets], dtype=np.int64)
        else:  # ShardedTokens, ConcatTokens
            windows = self.tokens.take(offsets)
        batch = torch.from_numpy(windows)
        self._position += self.global_batch_size
        self._roll_epoch_if_done()
        return batch

    def __iter__(self) -> Iterator[torch.Tensor]:
        return self

    def __next__(self) -> torch.Tensor:
        return self.next_batch()

    def metrics(self) -> dict[str, int]:
        """Loader facts for metrics records and the summary (none for one source)."""
        return {}

    def state_dict(self) -> dict[str, int]:
        """Return the position to resume from, plus fields that must match on resume."""
        return {
            "epoch": self._epoch,
            "position": self._position,
            "seed": self.seed,
            "num_samples": self.num_samples,
            "seq_len": self.seq_len,
            "world_size": self.world_size,
            **({"reorders": [dict(r) for r in self._reorders]} if self._reorders else {}),
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
        self._reorders = [
            {key: int(r[key]) for key in ("seed", "epoch", "position")}
            for r in state.get("reorders", [])
        ]
        self._order = self._permutation(epoch)
        self._roll_epoch_if_done()

    def _roll_epoch_if_done(self) -> None:
        """Start the next epoch when no complete global batch is left in this one."""
        if self._position + self.global_batch_size > self.num_samples:
            self._epoch += 1
            self._position = 0
            self._order = self._permutation(self._epoch)
