"""Read a prepared corpus: its manifest, checked, and its shards as one memory-mapped stream.

A prepared corpus is a directory (``collage_train.data.shards`` writes it) holding the
tokenizer's file, ``shards/NNNNNN.bin`` (fixed-size runs of the token stream, every
document followed by the end-of-text id; the last shard is shorter) and ``manifest.json``,
which names every shard with its token count and is written last, atomically.

``ShardedTokens`` presents some stretches of that stream as one flat sequence: the
training split is the stream minus the validation stretches, the validation split those
stretches. Windows are gathered across shard and stretch boundaries from memory maps,
of which at most ``MAX_OPEN_SHARDS`` stay open and whose pages are unmapped again after
each read: resident memory does not grow with the number or size of the shards.
"""

from __future__ import annotations

import json
import mmap
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from collage_train.data.errors import DataError

MANIFEST_FILENAME = "manifest.json"
MANIFEST_FORMAT = "collage_train.token_shards"
MANIFEST_VERSION = 2
VAL_STRETCHES = 16
MAX_OPEN_SHARDS = 8


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


def complement(spans: Sequence[tuple[int, int]], total: int) -> list[tuple[int, int]]:
    """The stretches of ``[0, total)`` outside the sorted, disjoint ``spans``."""
    kept, cursor = [], 0
    for start, end in spans:
        if start > cursor:
            kept.append((cursor, start))
        cursor = end
    if cursor < total:
        kept.append((cursor, total))
    return kept


def load_manifest(directory: Path) -> dict[str, Any]:
    """Read ``manifest.json``; raise DataError if it is unreadable or not a shard manifest."""
    path = directory / MANIFEST_FILENAME
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise DataError(f"{path} does not exist; prepare the corpus first") from None
    except (OSError, ValueError) as exc:
        raise DataError(f"{path} is unreadable ({exc}); prepare the corpus again") from None
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        raise DataError(f"{path} is not a token-shard manifest")
    if manifest.get("version") != MANIFEST_VERSION:
        raise DataError(
            f"{path} has version {manifest.get('version')}, this code reads "
            f"{MANIFEST_VERSION}; prepare the corpus again into another data.cache_dir"
        )
    return manifest


def check_prepared(directory: Path, manifest: dict[str, Any], tokenizer_sha256: str) -> None:
    """Refuse a corpus whose shards are missing or truncated, or that another tokenizer wrote.

    Nothing is deleted: the message says what to remove or re-run.
    """
    if manifest["tokenizer"]["sha256"] != tokenizer_sha256:
        raise DataError(
            f"{directory / MANIFEST_FILENAME} was written with tokenizer "
            f"{manifest['tokenizer']['sha256'][:12]}, not this run's {tokenizer_sha256[:12]}; "
            f"remove {directory} and prepare the corpus again"
        )
    dtype = np.dtype(manifest["dtype"])
    if manifest["vocab_size"] > np.iinfo(dtype).max + 1:
        raise DataError(
            f"{directory / MANIFEST_FILENAME}: a vocabulary of {manifest['vocab_size']} ids does "
            f"not fit the shards' {dtype.name} tokens; remove {directory} and prepare again"
        )
    for shard in manifest["shards"]:
        path = directory / shard["file"]
        expected = shard["tokens"] * dtype.itemsize
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            raise DataError(
                f"shard {path} is missing; restore it, or remove {directory} and prepare again"
            ) from None
        if size != expected:
            raise DataError(
                f"shard {path} has {size} bytes, the manifest says {expected} (truncated or "
                f"replaced); restore it, or remove {directory} and prepare again"
            )


class TokenMap:
    """A read-only memory map of a token file whose pages are given back after each read.

    The kernel may map much more than was read (a whole large folio of a recently written
    file), so resident memory would grow with the file; ``release`` (``MADV_DONTNEED``)
    unmaps the pages again: they stay in the page cache, and a later read maps them back.
    """

    def __init__(self, path: Path, dtype: np.dtype) -> None:
        with path.open("rb") as handle:
            self._mapped = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        if hasattr(mmap, "MADV_RANDOM"):
            self._mapped.madvise(mmap.MADV_RANDOM)  # no read-ahead on a fault
        self.tokens = np.frombuffer(self._mapped, dtype=dtype)

    def release(self) -> None:
        """Unmap the pages read so far (their data stays in the page cache)."""
        if hasattr(mmap, "MADV_DONTNEED"):
            self._mapped.madvise(mmap.MADV_DONTNEED)


class ShardedTokens:
    """Stretches of a token stream stored in fixed-size shards, read as one flat sequence.

    ``spans`` are sorted, disjoint ``[start, end)`` stretches of the stream; position ``i``
    of this sequence is the ``i``-th token inside them.
    """

    def __init__(
        self,
        paths: Sequence[Path],
        shard_tokens: int,
        total: int,
        dtype: np.dtype,
        spans: Sequence[tuple[int, int]] | None = None,
    ) -> None:
        self.paths = list(paths)
        self.shard_tokens = shard_tokens
        self.dtype = np.dtype(dtype)
        spans = [(0, total)] if spans is None else [s for s in spans if s[1] > s[0]]
        lengths = np.array([end - start for start, end in spans], dtype=np.int64)
        self._logical_starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
        self._physical_starts = np.array([start for start, _ in spans], dtype=np.int64)
        self._length = int(lengths.sum())
        self._open: OrderedDict[int, TokenMap] = OrderedDict()

    def __len__(self) -> int:
        return self._length

    @property
    def size(self) -> int:
        """Number of tokens (as for a numpy array)."""
        return self._length

    def _shard(self, index: int) -> TokenMap:
        """The memory map of shard ``index``; the least recently used one is closed beyond 8."""
        shard = self._open.get(index)
        if shard is None:
            shard = TokenMap(self.paths[index], self.dtype)
            self._open[index] = shard
            if len(self._open) > MAX_OPEN_SHARDS:
                self._open.popitem(last=False)
        else:
            self._open.move_to_end(index)
        return shard

    def physical(self, positions: np.ndarray) -> np.ndarray:
        """Map positions of this sequence to positions in the stream."""
        stretch = np.searchsorted(self._logical_starts, positions, side="right") - 1
        return positions - self._logical_starts[stretch] + self._physical_starts[stretch]

    def take(self, positions: np.ndarray) -> np.ndarray:
        """Tokens at ``positions`` (any shape) as int64."""
        stream = self.physical(np.asarray(positions, dtype=np.int64))
        shard_of = stream // self.shard_tokens
        offsets = stream - shard_of * self.shard_tokens
        out = np.empty(stream.shape, dtype=np.int64)
        for index in np.unique(shard_of):
            mask = shard_of == index
            shard = self._shard(int(index))
            out[mask] = shard.tokens[offsets[mask]]
            shard.release()
        return out

    def __getitem__(self, index: slice) -> np.ndarray:
        if not isinstance(index, slice):
            raise TypeError("ShardedTokens supports slices and take(positions)")
        start, stop, step = index.indices(self._length)
        return self.take(np.arange(start, stop, step))

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        array = self.take(np.arange(self._length))
        return array if dtype is None else array.astype(dtype)


class ConcatTokens:
    """Several token sequences read as one (the validation splits of a mixture)."""

    def __init__(self, parts: Sequence[ShardedTokens]) -> None:
        self.parts = list(parts)
        lengths = np.array([len(part) for part in self.parts], dtype=np.int64)
        self._starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
        self._length = int(lengths.sum())

    def __len__(self) -> int:
        return self._length

    @property
    def size(self) -> int:
        """Number of tokens (as for a numpy array)."""
        return self._length

    def take(self, positions: np.ndarray) -> np.ndarray:
        """Tokens at ``positions`` (any shape) as int64."""
        positions = np.asarray(positions, dtype=np.int64)
        part_of = np.searchsorted(self._starts, positions, side="right") - 1
        out = np.empty(positions.shape, dtype=np.int64)
        for index in np.unique(part_of):
            mask = part_of == index
            out[mask] = self.parts[index].take(positions[mask] - self._starts[index])
        return out

    def __getitem__(self, index: slice) -> np.ndarray:
        if not isinstance(index, slice):
            raise TypeError("ConcatTokens supports slices and take(positions)")
        start, stop, step = index.indices(self._length)
        return self.take(np.arange(start, stop, step))

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        array = self.take(np.arange(self._length))
        return array if dtype is None else array.astype(dtype)


def open_splits(
    directory: Path, manifest: dict[str, Any], val_fraction: float
) -> tuple[ShardedTokens, ShardedTokens, list[tuple[int, int]]]:
    """The training and validation splits of a prepared corpus, and the validation spans."""
    total = manifest["total_tokens"]
    spans = validation_spans(total, val_fraction)
    if not spans:
        raise DataError(
            f"data.val_fraction: {val_fraction} of {total} tokens leaves no validation tokens; "
            "add data or raise data.val_fraction"
        )
    paths = [directory / shard["file"] for shard in manifest["shards"]]
    dtype = np.dtype(manifest["dtype"])
    shard_tokens = manifest["shard_tokens"]
    train = ShardedTokens(paths, shard_tokens, total, dtype, complement(spans, total))
    val = ShardedTokens(paths, shard_tokens, total, dtype, spans)
    return train, val, spans
