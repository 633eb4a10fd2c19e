"""build_data end to end: bundle contents, loaders and validation batches."""

from __future__ import annotations

import logging
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


def test_val_loader_is_unshuffled_and_deterministic(bundle: DataBundle) -> None:
    loader = bundle.val_loader(batch_size=2)
    assert not loader.shuffle and loader.seed == 0
    first = loader.next_batch()
    expected = np.asarray(bundle.val_tokens[:17], dtype=np.int64)
    assert first[0].tolist() == expected.tolist()
    assert torch.equal(bundle.val_loader(batch_size=2).next_batch(), first)


def test_validation_batches(bundle: DataBundle) -> None:
    full = list(bundle.validation_batches(batch_size=2))
    per_epoch = bundle.val_loader(batch_size=2).batches_per_epoch
    assert len(full) == per_epoch > 3
    limited = list(bundle.validation_batches(batch_size=2, max_batches=3))
    assert all(torch.equal(a, b) for a, b in zip(limited, full[:3], strict=True))


def test_ranks_get_disjoint_validation_windows(make_cfg: MakeCfg) -> None:
    cfg = make_cfg(val_fraction=0.1)
    ranks = [
        build_data(cfg, seq_len=16, micro_batch_size=4, seed=7, rank=r, world_size=2)
        for r in (0, 1)
    ]
    batches = [list(b.validation_batches(batch_size=2)) for b in ranks]
    assert len(batches[0]) == len(batches[1]) > 0
    single = list(build_data(cfg, seq_len=16, micro_batch_size=4, seed=7).validation_batches(4))
    for zero, one, together in zip(batches[0], batches[1], single, strict=False):
        assert torch.equal(torch.cat([zero, one]), together)


def test_validation_split_too_small_for_the_batch(bundle: DataBundle) -> None:
    with pytest.raises(DataError, match=r"^the validation split has"):
        bundle.val_loader(batch_size=10_000)


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
