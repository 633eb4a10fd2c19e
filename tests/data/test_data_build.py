"""build_data end to end: bundle contents, loaders and validation batches."""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from collage_train.data import DataBundle, DataError, TokenLoader, build_data
from collage_train.data.store import ShardedTokens

MakeCfg = Callable[..., SimpleNamespace]


@pytest.fixture
def bundle(make_cfg: MakeCfg) -> DataBundle:
    return build_data(make_cfg(val_fraction=0.1), seq_len=16, micro_batch_size=4, seed=7)


def test_bundle_contents(bundle: DataBundle) -> None:
    assert bundle.tokenizer.vocab_size == 512
    assert isinstance(bundle.val_tokens, ShardedTokens)
    assert isinstance(bundle.train_loader.tokens, ShardedTokens)
    assert bundle.train_loader.shuffle and bundle.train_loader.seed == 7
    assert bundle.val_tokens.size == bundle.meta["val_tokens"]
    assert Path(bundle.meta["cache_dir"]).is_dir()
    assert bundle.tokenizer.model_path == Path(bundle.meta["cache_dir"]) / "tokenizer.model"
    batch = bundle.train_loader.next_batch()
    assert batch.shape == (4, 17) and batch.dtype == torch.int64
    assert int(batch.max()) < bundle.tokenizer.vocab_size


def test_validation_windows_are_the_split_in_order(bundle: DataBundle) -> None:
    plan = bundle.validation_plan(micro_batch_size=2, eval_batches=3)
    assert (plan.windows, plan.batch_size, plan.world_size) == (6, 2, 1)
    batches = list(bundle.validation_batches(plan))
    assert [counted for _, counted in batches] == [True] * 3
    tokens = np.asarray(bundle.val_tokens[: 6 * 16 + 1], dtype=np.int64)
    expected = np.stack([tokens[i * 16 : i * 16 + 17] for i in range(6)])
    np.testing.assert_array_equal(torch.cat([b for b, _ in batches]).numpy(), expected)
    again = [b for b, _ in bundle.validation_batches(plan)]
    assert all(torch.equal(a, b) for a, b in zip(again, (b for b, _ in batches), strict=True))


def test_ranks_share_the_windows_of_one_process(make_cfg: MakeCfg) -> None:
    """Two ranks evaluate, in micro-batches of 2 taken in turn, the 8 windows one process
    evaluates in micro-batches of 4 (eval_batches=2 of micro-batch 4 on both)."""
    cfg = make_cfg(val_fraction=0.1)
    single = build_data(cfg, seq_len=16, micro_batch_size=4, seed=7)
    alone = [b for b, _ in single.validation_batches(single.validation_plan(4, 2))]
    ranks = [
        build_data(cfg, seq_len=16, micro_batch_size=4, seed=7, rank=r, world_size=2)
        for r in (0, 1)
    ]
    plans = [rank.validation_plan(4, 2) for rank in ranks]
    assert plans[0] == plans[1] and (plans[0].batch_size, plans[0].rounds) == (4, 1)
    shares = [[b for b, _ in rank.validation_batches(plans[0])] for rank in ranks]
    assert torch.equal(torch.cat([shares[0][0], shares[1][0]]), torch.cat(alone))
    four = [
        build_data(cfg, seq_len=16, micro_batch_size=4, seed=7, rank=r, world_size=4)
        for r in range(4)
    ]
    plan = four[0].validation_plan(4, 2)
    assert (plan.windows, plan.batch_size, plan.padding) == (8, 2, 0)
    quarter = [next(rank.validation_batches(plan))[0] for rank in four]
    assert torch.equal(torch.cat(quarter), torch.cat(alone))


def test_a_validation_split_without_a_window_names_the_val_fraction_that_works(
    bundle: DataBundle, make_cfg: MakeCfg
) -> None:
    seq_len = len(bundle.val_tokens)  # one token short of a window
    short = dataclasses.replace(bundle, seq_len=seq_len)
    with pytest.raises(
        DataError, match=r"^the validation split \(data\.val_fraction=0\.1 of"
    ) as err:
        short.validation_plan(micro_batch_size=1, eval_batches=1)
    suggested = re.search(r"set data\.val_fraction=([0-9.]+) ", str(err.value))
    assert suggested is not None, str(err.value)
    enough = build_data(
        make_cfg(val_fraction=float(suggested.group(1))),
        seq_len=seq_len,
        micro_batch_size=1,
        seed=7,
    )
    assert enough.validation_plan(micro_batch_size=1, eval_batches=1).windows == 1


def test_logs_progress(make_cfg: MakeCfg, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="collage_train.data")
    build_data(make_cfg(), seq_len=16, micro_batch_size=4, seed=0)
    messages = [record.getMessage() for record in caplog.records]
    assert any(m.startswith("training a 512-piece tokenizer on") for m in messages)
    assert any(m.startswith("prepared ") and " tokens/s)" in m for m in messages)
    assert all("\n" not in m for m in messages)


def test_exports() -> None:
    import collage_train.data as data

    assert set(data.__all__) == {
        "DataBundle",
        "DataError",
        "TokenLoader",
        "Tokenizer",
        "build_data",
    }
    assert data.TokenLoader is TokenLoader


def test_only_a_rank_of_several_waits_for_another_to_prepare(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from collage_train.data.bundle import prepares_data

    monkeypatch.setenv("LOCAL_RANK", "3")  # left behind by a launcher: a lone process prepares
    assert prepares_data(0, world_size=1)
    assert not prepares_data(3, world_size=8)
    monkeypatch.setenv("LOCAL_RANK", "0")  # the first rank of its node prepares
    assert prepares_data(8, world_size=16)
    monkeypatch.delenv("LOCAL_RANK")
    assert prepares_data(0, world_size=2) and not prepares_data(1, world_size=2)
