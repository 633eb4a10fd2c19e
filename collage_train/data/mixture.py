"""Mixtures of corpora: several prepared sources sampled by weight, deterministically.

``data.mixture`` lists sources, each a partial data config with a ``weight`` (and an
optional ``label``), e.g. ``[{label: web, weight: 3, paths: [/data/web]}, {label: code,
weight: 1, paths: [/data/code]}]``; every other data setting (tokenizer, ``seq_len``,
``shard_tokens``, ``cache_dir``...) is shared. Each source is prepared into its own cache
entry with the same tokenizer: ``data.tokenizer``, or one trained on the sources'
documents interleaved by weight. ``MixtureLoader`` draws sample ``g`` of the run (counted
over the whole run, across epochs) from source ``i`` with probability ``weight_i /
sum(weights)``, decided by a keyed hash of ``(seed, g)``: no stored schedule, the same on
every rank, and rank-independent. The ``j``-th sample drawn from a source is its
``j mod n``-th sample in the order of its epoch ``j div n`` (``SampleOrder``, salted by
the source's index). The state is the run position and the samples drawn per source, so
a resume continues bit for bit; ``tokens_per_source`` reports what each source supplied.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from collage_train.data.errors import DataError
from collage_train.data.loader import SampleOrder, mix64
from collage_train.data.sources import Source

CHECKED_STATE_FIELDS = ("seed", "seq_len", "world_size", "labels", "weights", "num_samples")
DRAW_SALT = np.uint64(0x6D697874757265)  # keys the source draw apart from sample orders


@dataclass(frozen=True)
class InterleavedSource:
    """The documents of several sources interleaved by weight (for tokenizer training)."""

    sources: tuple[Source, ...]
    weights: tuple[float, ...]
    fingerprints: tuple[str, ...]

    def documents(self) -> Iterator[str]:
        """Smooth weighted round robin over the sources' documents until all are exhausted."""
        streams = [iter(source.documents()) for source in self.sources]
        credit = [0.0] * len(streams)
        live = list(range(len(streams)))
        while live:
            total = sum(self.weights[i] for i in live)
            for i in live:
                credit[i] += self.weights[i]
            chosen = max(live, key=lambda i: credit[i])
            credit[chosen] -= total
            try:
                yield next(streams[chosen])
            except StopIteration:
                live.remove(chosen)

    def fingerprint(self) -> str:
        """Hash of the sources' fingerprints and weights."""
        encoded = json.dumps({"fingerprints": self.fingerprints, "weights": self.weights})
        return hashlib.sha256(encoded.encode()).hexdigest()

    def metadata(self) -> dict[str, Any]:
        return {"source": "mixture", "weights": list(self.weights)}


class MixtureLoader:
    """Batches of ``[batch_size, seq_len + 1]`` windows drawn from several sources by weight.

    Offers the loader interface the trainer uses (``next_batch``, ``epoch``, ``state_dict``,
    ``load_state_dict``) plus ``tokens_per_source``. A global batch is ``batch_size *
    world_size`` consecutive draws; rank ``r`` takes the slice ``[r * batch_size, (r + 1) *
    batch_size)``.
    """

    def __init__(
        self,
        sources: Sequence[Any],
        labels: Sequence[str],
        weights: Sequence[float],
        seq_len: int,
        batch_size: int,
        seed: int,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        if not 0 <= rank < world_size:
            raise DataError(f"data loader: rank {rank} is outside [0, {world_size})")
        self.sources = list(sources)
        self.labels = list(labels)
        self.weights = [float(w) for w in weights]
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.global_batch_size = batch_size * world_size
        self.num_samples = [max(len(tokens) - 1, 0) // seq_len for tokens in self.sources]
        for label, count, tokens in zip(self.labels, self.num_samples, self.sources, strict=True):
            if count < 1:
                raise DataError(
                    f"data.mixture: source {label!r} has {len(tokens)} training tokens, too few "
                    f"for one sequence of seq_len {seq_len}; add data or drop the source"
                )
        shares = np.asarray(self.weights) / sum(self.weights)
        self._bounds = np.cumsum(shares)[:-1]
        self._position = 0
        self._counts = [0] * len(self.sources)
        self._orders: dict[tuple[int, int], SampleOrder] = {}

    @property
    def epoch(self) -> int:
        """The fewest complete passes made over any source."""
        return min(c // n for c, n in zip(self._counts, self.num_samples, strict=True))

    def tokens_per_source(self) -> dict[str, int]:
        """Training tokens (inputs) each source has supplied so far, over all ranks."""
        return {
            label: count * self.seq_len
            for label, count in zip(self.labels, self._counts, strict=True)
        }

    def metrics(self) -> dict[str, int]:
        """``tokens_<label>``: the training tokens each source has supplied so far."""
        return {f"tokens_{label}": tokens for label, tokens in self.tokens_per_source().items()}

    def draws(self, start: int, count: int) -> np.ndarray:
        """The source index of run samples ``start .. start + count - 1``."""
        keys = np.arange(start, start + count, dtype=np.uint64) ^ mix64(
            np.asarray([self.seed], dtype=np.uint64) ^ DRAW_SALT
        )
        uniform = (mix64(keys) >> np.uint64(11)).astype(np.float64) / float(1 << 53)
        return np.searchsorted(self._bounds, uniform, side="right")

    def _order(self, source: int, epoch: int) -> SampleOrder:
        key = (source, epoch)
        if key not in self._orders:
            if len(self._orders) > 4 * len(self.sources):
                self._orders.clear()
            self._orders[key] = SampleOrder(
                self.num_samples[source], self.seed, epoch, salt=(source,)
            )
        return self._orders[key]

    def next_batch(self) -> torch.Tensor:
        """Return this rank's next batch and advance every rank's shared state."""
        sources = self.draws(self._position, self.global_batch_size)
        draws = np.empty(self.global_batch_size, dtype=np.int64)
        for index in range(len(self.sources)):
            mask = sources == index
            taken = int(mask.sum())
            draws[mask] = self._counts[index] + np.arange(taken)
            self._counts[index] += taken
        self._position += self.global_batch_size
        mine = slice(self.rank * self.batch_size, (self.rank + 1) * self.batch_size)
        windows = np.empty((self.batch_size, self.seq_len + 1), dtype=np.int64)
        span = np.arange(self.seq_len + 1)
        for row, (source, draw) in enumerate(zip(sources[mine], draws[mine], strict=True)):
            count = self.num_samples[source]
            sample = self._order(int(source), int(draw) // count)[
                int(draw) % count : int(draw) % count + 1
            ][0]
            tokens = self.sources[source]
            offsets = sample * self.seq_len + span
            if isinstance(tokens, np.ndarray):
                windows[row] = tokens[offsets]
            else:
                windows[row] = tokens.take(offsets)
        return torch.from_numpy(windows)

    def __iter__(self) -> Iterator[torch.Tensor]:
        return self

    def __next__(self) -> torch.Tensor:
        return self.next_batch()

    def state_dict(self) -> dict[str, Any]:
        """The run position and per-source draws, plus the fields that must match on resume."""
        return {
            "position": self._position,
            "counts": list(self._counts),
            "seed": self.seed,
            "seq_len": self.seq_len,
            "world_size": self.world_size,
            "labels": list(self.labels),
            "weights": list(self.weights),
            "num_samples": list(self.num_samples),
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
        counts = [int(c) for c in state["counts"]]
        position = int(state["position"])
        if position < 0 or sum(counts) != position or min(counts) < 0:
            raise DataError(
                "the data loader state does not match this run: "
                f"position {position} / counts {counts} are inconsistent"
            )
        self._position, self._counts = position, counts
