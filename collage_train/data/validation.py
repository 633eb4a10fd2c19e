"""Which held-out windows a validation pass evaluates, and how the ranks share them.

A pass evaluates the first ``windows`` windows (``seq_len + 1`` tokens at stride
``seq_len``, unshuffled) of the held-out split, in micro-batches of ``batch_size``
windows that the ranks take in turn (rank ``r`` of ``W``: ``r, r + W, r + 2W, ...``).
``plan_validation``'s contract: the windows depend on the settings and the split only,
never on the world size (``train.eval_batches x train.micro_batch_size`` when the split
holds them, else fewer whole micro-batches, else all); the validation micro-batch is at
most ``train.micro_batch_size`` and divides the windows evenly; every rank runs the same
number of forwards (a rank whose turn finds none left repeats the first, uncounted). The
held-out share is never changed; a split without a window is refused in one line
(``no_window_error``). ``ValidationPlan.note`` says in one start-up line how a pass
differs from ``train.eval_batches`` micro-batches of ``train.micro_batch_size`` windows.
The policy step by step, with an example: docs/data.md, "The validation windows".
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from collage_train.data.errors import DataError
from collage_train.data.store import ConcatTokens, ShardedTokens, validation_spans

MAX_VAL_FRACTION = 0.5  # the bound data.val_fraction accepts (DataSettings)


@dataclass(frozen=True)
class ValidationPlan:
    """One validation pass: the first ``windows`` held-out windows in micro-batches of
    ``batch_size``, shared by ``world_size`` ranks (the same object on every rank)."""

    windows: int
    batch_size: int
    world_size: int
    available: int  # windows the held-out split holds
    seq_len: int
    eval_batches: int  # train.eval_batches
    micro_batch_size: int  # train.micro_batch_size

    @property
    def batches(self) -> int:
        """Micro-batches evaluated (counted), all ranks together."""
        return self.windows // self.batch_size

    @property
    def rounds(self) -> int:
        """Forwards every rank runs per pass."""
        return math.ceil(self.batches / self.world_size)

    @property
    def padding(self) -> int:
        """Forwards run, all ranks together, on a rank whose turn found no micro-batch left."""
        return self.rounds * self.world_size - self.batches

    def batches_of(self, rank: int) -> Iterator[tuple[int, bool]]:
        """Rank ``rank``'s micro-batches as (index, counted): the padding ones repeat the first."""
        for turn in range(self.rounds):
            index = turn * self.world_size + rank
            yield (index, True) if index < self.batches else (0, False)

    def note(self) -> str | None:
        """The line saying how the pass differs from ``train.eval_batches`` micro-batches of
        ``train.micro_batch_size`` windows shared evenly; None where it does not."""
        asked = self.eval_batches * self.micro_batch_size
        if (self.windows, self.batch_size, self.padding) == (asked, self.micro_batch_size, 0):
            return None
        line = f"validation: the first {self.windows} held-out windows of seq_len {self.seq_len}"
        if self.windows < asked:
            line += (
                f" (the split holds {self.available}; train.eval_batches={self.eval_batches} x "
                f"train.micro_batch_size={self.micro_batch_size} asks for {asked})"
            )
        line += f", {self.batches} micro-batch(es) of {self.batch_size}"
        if self.batch_size != self.micro_batch_size:
            if self.windows < self.world_size:
                why = "fewer windows than ranks"
            elif self.windows < self.micro_batch_size:
                why = "fewer windows than one micro-batch"
            else:
                why = "so that every rank has one"
            line += f" (not {self.micro_batch_size}: {why})"
        line += f" on {self.world_size} rank(s), the same windows at any number of ranks"
        if self.padding:
            line += (
                f"; {self.padding} padding forward(s), on ranks whose turn finds no micro-batch "
                "left, are not counted"
            )
        return line


def plan_validation(
    available: int, *, seq_len: int, world_size: int, micro_batch_size: int, eval_batches: int
) -> ValidationPlan:
    """The pass over a held-out split of ``available`` windows (at least one) by the policy
    of this module's docstring."""
    if available < 1 or min(seq_len, world_size, micro_batch_size, eval_batches) < 1:
        raise ValueError(
            f"plan_validation: available ({available}), seq_len ({seq_len}), world_size "
            f"({world_size}), micro_batch_size ({micro_batch_size}) and eval_batches "
            f"({eval_batches}) must be positive"
        )
    asked = eval_batches * micro_batch_size
    if available >= asked:
        windows = asked
    elif available >= micro_batch_size:
        windows = available // micro_batch_size * micro_batch_size
    else:
        windows = available
    batch_size = max(
        size
        for size in range(1, min(micro_batch_size, windows) + 1)
        if windows % size == 0 and (windows // size >= world_size or size == 1)
    )
    return ValidationPlan(
        windows=windows,
        batch_size=batch_size,
        world_size=world_size,
        available=available,
        seq_len=seq_len,
        eval_batches=eval_batches,
        micro_batch_size=micro_batch_size,
    )


def window_batch(
    tokens: np.ndarray | ShardedTokens | ConcatTokens, seq_len: int, first: int, count: int
) -> torch.Tensor:
    """Windows ``first .. first + count - 1`` of ``tokens`` as a ``[count, seq_len + 1]``
    int64 tensor (window ``i`` starts at token ``i * seq_len``, as ``TokenLoader``'s)."""
    offsets = (first + np.arange(count))[:, None] * seq_len + np.arange(seq_len + 1)
    if isinstance(tokens, np.ndarray):
        return torch.from_numpy(np.asarray(tokens[offsets], dtype=np.int64))
    return torch.from_numpy(tokens.take(offsets))


def val_fraction_for(totals: Sequence[int], needed: int) -> float | None:
    """The smallest ``data.val_fraction`` (two significant digits, rounded up) whose held-out
    stretches of corpora of ``totals`` tokens hold ``needed`` tokens together; None above 0.5."""
    raw = needed / max(sum(totals), 1)
    if raw > MAX_VAL_FRACTION:
        return None
    digits = 1 - math.floor(math.log10(raw))
    step = 10.0**-digits
    fraction = math.ceil(raw / step - 1e-9) * step
    while fraction <= MAX_VAL_FRACTION:
        fraction = round(fraction, digits)
        held = sum(
            end - start for total in totals for start, end in validation_spans(total, fraction)
        )
        if held >= needed:
            return fraction
        fraction += step
    return None


def no_window_error(meta: dict[str, Any], val_tokens: int, seq_len: int) -> DataError:
    """The one-line error of a held-out split too short for a single window, naming the
    ``data.val_fraction`` (computed) or the other setting that would hold one."""
    needed = seq_len + 1
    short = (
        f"{val_tokens} tokens, fewer than one validation window of seq_len {seq_len} needs "
        f"({needed})"
    )
    if "val_documents" in meta:  # data.streaming: the stream's head is held out
        return DataError(
            f"the first {meta['val_documents']} documents of the stream, held out for "
            f"validation (data.val_documents), hold {short}; raise data.val_documents or lower "
            "data.seq_len"
        )
    sources = meta.get("mixture") or [meta]
    totals = [int(source["train_tokens"]) + int(source["val_tokens"]) for source in sources]
    fraction = val_fraction_for(totals, needed)
    remedy = (
        f"set data.val_fraction={fraction:g} or lower data.seq_len"
        if fraction is not None
        else f"add data or lower data.seq_len (data.val_fraction={MAX_VAL_FRACTION} holds too few)"
    )
    return DataError(
        f"the validation split (data.val_fraction={meta.get('val_fraction')} of "
        f"{sum(totals)} tokens) holds {short}; {remedy}"
    )
