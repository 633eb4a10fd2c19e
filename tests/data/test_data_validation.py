"""The validation pass's policy (collage_train.data.validation): which held-out windows, in
which micro-batches, on which ranks, and the one-line error of a split without a window."""

from __future__ import annotations

import re

import pytest

from collage_train.data import DataError
from collage_train.data.store import validation_spans
from collage_train.data.validation import (
    ValidationPlan,
    no_window_error,
    plan_validation,
    val_fraction_for,
)


def plan(available: int, world_size: int, micro: int, eval_batches: int) -> ValidationPlan:
    return plan_validation(
        available,
        seq_len=2048,
        world_size=world_size,
        micro_batch_size=micro,
        eval_batches=eval_batches,
    )


def held(totals: list[int], fraction: float) -> int:
    """Tokens the validation stretches of corpora of ``totals`` tokens hold together."""
    return sum(end - start for total in totals for start, end in validation_spans(total, fraction))


def test_the_settings_are_kept_where_they_fit() -> None:
    for world_size in (1, 2, 8):
        kept = plan(144, world_size, micro=8, eval_batches=8)
        assert (kept.windows, kept.batch_size, kept.padding) == (64, 8, 0)
        assert kept.rounds == 8 // world_size
        assert kept.note() is None


def test_a_smaller_micro_batch_gives_every_rank_one() -> None:
    """16 ranks share train.eval_batches=8 micro-batches of 8: 16 micro-batches of 4."""
    smaller = plan(1000, 16, micro=8, eval_batches=8)
    assert (smaller.windows, smaller.batch_size, smaller.batches, smaller.rounds) == (64, 4, 16, 1)
    assert smaller.padding == 0
    note = smaller.note()
    assert note is not None and "\n" not in note
    assert "16 micro-batch(es) of 4 (not 8: so that every rank has one) on 16 rank(s)" in note


def test_a_short_split_gives_fewer_batches_of_the_training_micro_batch() -> None:
    """gpt_1.3b on the embedded corpus: 18 windows of 2048 tokens hold 2 micro-batches of 8."""
    short = plan(18, 1, micro=8, eval_batches=8)
    assert (short.windows, short.batch_size, short.batches) == (16, 8, 2)
    assert "(the split holds 18; train.eval_batches=8 x train.micro_batch_size=8 asks for 64)" in (
        short.note() or ""
    )
    tiny = plan(5, 1, micro=8, eval_batches=8)  # fewer windows than one micro-batch: all of them
    assert (tiny.windows, tiny.batch_size) == (5, 5)


def test_fewer_windows_than_ranks_pad_the_last_ranks() -> None:
    """``sbatch --nodes 4 ... +experiment=gpt_6.7b``: 32 ranks, 16 windows of the 18."""
    padded = plan(18, 32, micro=2, eval_batches=8)
    assert (padded.windows, padded.batch_size, padded.rounds, padded.padding) == (16, 1, 1, 16)
    assert list(padded.batches_of(5)) == [(5, True)]
    assert list(padded.batches_of(20)) == [(0, False)]
    assert "16 padding forward(s)" in (padded.note() or "")


@pytest.mark.parametrize("available", [1, 5, 18, 64, 144, 1000])
@pytest.mark.parametrize(("micro", "eval_batches"), [(1, 1), (2, 8), (3, 3), (8, 8), (16, 8)])
def test_every_world_size_evaluates_the_windows_of_one_process(
    available: int, micro: int, eval_batches: int
) -> None:
    alone = plan(available, 1, micro, eval_batches)
    assert alone.windows <= available
    for world_size in range(1, 41):
        shared = plan(available, world_size, micro, eval_batches)
        assert shared.windows == alone.windows
        size = shared.batch_size
        assert 1 <= size <= micro and shared.windows % size == 0
        fits = [  # micro-batches that cut the windows evenly and give every rank one
            s for s in range(1, micro + 1) if shared.windows % s == 0
            and shared.windows // s >= world_size
        ]  # fmt: skip
        assert size == max(fits, default=1)
        turns = [list(shared.batches_of(rank)) for rank in range(world_size)]
        assert all(len(t) == shared.rounds for t in turns)  # as many forwards on every rank
        counted = sorted(index for t in turns for index, is_counted in t if is_counted)
        assert counted == list(range(shared.batches))  # each micro-batch once
        assert sum(not c for t in turns for _, c in t) == shared.padding


def test_bad_plan_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="must be positive"):
        plan(0, 1, 8, 8)


def test_the_computed_val_fraction_is_the_smallest_that_holds_a_window() -> None:
    for totals, needed in (([3_693_195], 2049), ([3_693_195], 65_537), ([1_000, 30_007], 513)):
        fraction = val_fraction_for(totals, needed)
        assert fraction is not None
        assert held(totals, fraction) >= needed
        digits = len(repr(fraction).split(".")[1])
        assert held(totals, round(fraction - 10.0**-digits, digits)) < needed
    assert val_fraction_for([1_000], 501) is None  # more than half the corpus


def test_a_split_without_a_window_is_one_line_naming_what_works() -> None:
    meta = {"train_tokens": 3_656_263, "val_tokens": 36_932, "val_fraction": 0.01}
    error = no_window_error(meta, 36_932, seq_len=40_000)
    assert isinstance(error, DataError) and "\n" not in str(error)
    found = re.search(r"set data\.val_fraction=([0-9.]+) or lower data\.seq_len$", str(error))
    assert found is not None, str(error)
    assert held([3_656_263 + 36_932], float(found.group(1))) >= 40_001
    too_long = no_window_error(meta, 36_932, seq_len=3_000_000)
    assert str(too_long).endswith(
        "add data or lower data.seq_len (data.val_fraction=0.5 holds too few)"
    )
    mixture = {
        "val_fraction": 0.01,
        "mixture": [
            {"train_tokens": 990, "val_tokens": 10},
            {"train_tokens": 29_707, "val_tokens": 300},
        ],
    }
    found = re.search(r"val_fraction=([0-9.]+) or", str(no_window_error(mixture, 310, 512)))
    assert found is not None and held([1_000, 30_007], float(found.group(1))) >= 513
    stream = str(no_window_error({"val_documents": 3}, 12, 16))
    assert stream.startswith("the first 3 documents") and "raise data.val_documents" in stream
