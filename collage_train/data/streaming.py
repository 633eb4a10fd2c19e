"""Training batches read, tokenized and packed from a document stream on the fly.

``data.streaming=true`` (with ``data=hf``) trains without preparing shards. After the
``skip`` documents held out for validation, rank ``r`` of ``W`` takes the documents ``i``
with ``i % W == r`` (its share), encodes each as the preparation does
(``shards.encode_task``) and cuts its token stream as ``TokenLoader`` cuts a prepared one:
windows of ``seq_len + 1`` tokens at a stride of ``seq_len``, in stream order; an
exhausted share starts its next epoch, packing across the boundary. The position is
``(epoch, document, offset)``; a resume reads past documents without tokenizing them, so
the batches that follow are bitwise those of an uninterrupted run. ``state_dict`` holds
every rank's position, gathered with one ``all_gather_object`` when a process group is up
(DeepSpeed keeps only rank 0's trainer state): its call is collective.
How and why: docs/design.md, "Data"; what a user sees: docs/data.md.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator
from itertools import islice
from typing import Any

import numpy as np
import torch

from collage_train.data.errors import DataError
from collage_train.data.loader import check_loader_shape
from collage_train.data.shards import encode_task
from collage_train.data.store import token_dtype
from collage_train.data.tokenizer import Tokenizer

CHECKED_STATE_FIELDS = ("seq_len", "world_size", "skip", "stream")
ENCODE_DOCUMENTS = 16  # documents read and encoded together (one encode_batch call)

Position = dict[str, int]
Gather = Callable[[Position], dict[str, Position]]


class StreamingLoader:
    """Serve ``[batch_size, seq_len + 1]`` LongTensors packed from this rank's share of a stream.

    ``documents`` opens the stream afresh (from its first document) each time it is called.
    ``stream`` names the stream (its fingerprint); a state of another stream is refused.
    ``gather`` collects every rank's position (default: ``gather_positions``).
    """

    def __init__(
        self,
        documents: Callable[[], Iterable[str]],
        tokenizer: Tokenizer,
        seq_len: int,
        batch_size: int,
        rank: int = 0,
        world_size: int = 1,
        skip: int = 0,
        stream: str = "",
        gather: Gather | None = None,
    ) -> None:
        check_loader_shape(seq_len, batch_size, rank, world_size, "skip", skip)
        self.documents = documents
        self.tokenizer = tokenizer
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.rank = rank
        self.world_size = world_size
        self.skip = skip
        self.stream = stream
        self.gather = gather or (lambda own: gather_positions(own, rank, world_size))
        self.dtype = token_dtype(tokenizer.vocab_size).name
        self._seek(0, 0, 0)
        self._fill(self.batch_size * self.seq_len + 1)  # an empty share fails now, not at step 0

    # ----------------------------------------------------------------- reading

    def share(self) -> Iterator[str]:
        """This rank's documents, in stream order, for one epoch."""
        training = islice(self.documents(), self.skip, None)
        return islice(training, self.rank, None, self.world_size)

    def _seek(self, epoch: int, document: int, offset: int) -> None:
        """Reopen the share at ``document`` of ``epoch`` with ``offset`` tokens of it used."""
        self._reader = self.share()
        skipped = sum(1 for _ in islice(self._reader, document))
        if skipped < document:
            raise DataError(
                f"the data loader state does not match this run: rank {self.rank}'s share of the "
                f"stream has {skipped} documents, the state resumes at document {document} (the "
                "stream changed?); resume on the same stream or start a new run"
            )
        self._read_epoch, self._read_document = epoch, document
        # buffered documents: (epoch, number in the share, tokens used, tokens)
        self._buffer: deque[tuple[int, int, int, np.ndarray]] = deque()
        self._buffered = 0
        self._position = (epoch, document, offset)
        if offset:
            self._read_documents()
            entry = self._buffer[0] if self._buffer else None
            if entry is None or entry[:2] != (epoch, document) or offset >= entry[3].size:
                raise DataError(
                    f"the data loader state does not match this run: document {document} of rank "
                    f"{self.rank}'s share has fewer than the {offset + 1} tokens the state "
                    "resumes in (the stream or tokenizer changed?); resume on the same stream"
                )
            self._buffer[0] = (entry[0], entry[1], offset, entry[3][offset:])
            self._buffered -= offset

    def _read_documents(self) -> None:
        """Read and encode the next few documents of the share, starting a new epoch at its end."""
        texts = list(islice(self._reader, ENCODE_DOCUMENTS))
        if not texts:
            if self._read_document == 0:
                raise DataError(
                    f"rank {self.rank} of {self.world_size} gets no training documents: the "
                    f"stream holds fewer than {self.world_size} after the {self.skip} held out "
                    "for validation (data.val_documents); lower data.val_documents or add data"
                )
            self._reader = self.share()
            self._read_epoch += 1
            self._read_document = 0
            return
        _, lengths, tokens, _ = encode_task((0, texts), self.tokenizer, self.dtype)
        ends = np.cumsum(lengths)
        for length, end in zip(lengths.tolist(), ends.tolist(), strict=True):
            ids = tokens[end - length : end]
            self._buffer.append((self._read_epoch, self._read_document, 0, ids))
            self._buffered += length
            self._read_document += 1

    def _fill(self, count: int) -> None:
        """Read until at least ``count`` tokens are buffered."""
        while self._buffered < count:
            self._read_documents()

    # ----------------------------------------------------------------- batches

    def next_batch(self) -> torch.Tensor:
        """Return this rank's next ``[batch_size, seq_len + 1]`` int64 batch and advance."""
        used = self.batch_size * self.seq_len
        self._fill(used + 1)
        parts, gathered = [], 0
        for entry in self._buffer:
            parts.append(entry[3])
            gathered += entry[3].size
            if gathered > used:
                break
        flat = np.concatenate(parts)
        offsets = np.arange(self.batch_size)[:, None] * self.seq_len + np.arange(self.seq_len + 1)
        batch = torch.from_numpy(flat[offsets].astype(np.int64))
        self._consume(used)
        return batch

    def _consume(self, count: int) -> None:
        """Drop ``count`` buffered tokens (fewer than are buffered) and move the position."""
        while count:
            epoch, document, used, ids = self._buffer[0]
            if ids.size <= count:
                self._buffer.popleft()
                count -= ids.size
                self._buffered -= ids.size
            else:
                self._buffer[0] = (epoch, document, used + count, ids[count:])
                self._buffered -= count
                count = 0
        epoch, document, used, _ = self._buffer[0]
        self._position = (epoch, document, used)

    def __iter__(self) -> Iterator[torch.Tensor]:
        return self

    def __next__(self) -> torch.Tensor:
        return self.next_batch()

    @property
    def epoch(self) -> int:
        """Epoch of this rank's share that the next batch starts in (starting at 0)."""
        return self._position[0]

    def metrics(self) -> dict[str, int]:
        """Loader facts for metrics records and the summary (none for a stream)."""
        return {}

    # ----------------------------------------------------------------- state

    def position(self) -> Position:
        """This rank's position: the first token of its next window."""
        epoch, document, offset = self._position
        return {"epoch": epoch, "document": document, "offset": offset}

    def state_dict(self) -> dict[str, Any]:
        """Every rank's position (collective under a process group), plus checked fields."""
        return {
            "positions": self.gather(self.position()),
            "seq_len": self.seq_len,
            "world_size": self.world_size,
            "skip": self.skip,
            "stream": self.stream,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from ``state_dict()`` output; raise DataError if it belongs to another run."""
        mismatches = [
            f"{field} {state.get(field)!r} != {getattr(self, field)!r}"
            for field in CHECKED_STATE_FIELDS
            if state.get(field) != getattr(self, field)
        ]
        if mismatches:
            raise DataError(
                f"the data loader state does not match this run: {', '.join(mismatches)} "
                "(a stream resumes only on the same stream, seq_len and world size)"
            )
        own = state.get("positions", {}).get(str(self.rank))
        if own is None:
            raise DataError(
                f"the data loader state holds no stream position for rank {self.rank}; resume "
                "from a checkpoint written by this run's ranks"
            )
        epoch, document, offset = (int(own[key]) for key in ("epoch", "document", "offset"))
        if min(epoch, document, offset) < 0:
            raise DataError(f"the data loader state has a negative stream position {own}")
        self._seek(epoch, document, offset)


def gather_positions(own: Position, rank: int, world_size: int) -> dict[str, Position]:
    """Every rank's position keyed by rank: gathered when a process group of ``world_size``
    ranks is up (a collective), else only this rank's."""
    import torch.distributed as dist

    if (
        world_size > 1
        and dist.is_available()
        and dist.is_initialized()
        and dist.get_world_size() == world_size
    ):
        everyone: list[Any] = [None] * world_size
        dist.all_gather_object(everyone, own)
        return {str(index): dict(position) for index, position in enumerate(everyone)}
    return {str(rank): dict(own)}
