"""Token shards: dtype choice, validation spread, exact packing, caching and atomic writes."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from collage_train.data import DataError, Tokenizer, build_data
from collage_train.data import shards as shards_module
from collage_train.data.cache import staged_directory
from collage_train.data.settings import DataSettings
from collage_train.data.shards import (
    prepare_shards,
    split_stream,
    token_dtype,
    validation_spans,
    write_shards,
)

MakeCfg = Callable[..., SimpleNamespace]


def fail(*args: object, **kwargs: object) -> None:
    raise AssertionError("the cache should have been reused")


def test_token_dtype_choice() -> None:
    assert token_dtype(512) == np.uint16
    assert token_dtype(65_536) == np.uint16
    assert token_dtype(65_537) == np.uint32
    assert token_dtype(200_000) == np.uint32


@pytest.mark.parametrize("total", [10_000, 12_345, 1_000_003])
@pytest.mark.parametrize("fraction", [0.01, 0.1, 0.5])
def test_validation_spans_are_spread_and_sized(total: int, fraction: float) -> None:
    spans = validation_spans(total, fraction)
    assert len(spans) == 16
    assert sum(end - start for start, end in spans) == round(total * fraction)
    segment = total / 16
    for index, (start, end) in enumerate(spans):
        assert index * segment - 1 <= start < end <= (index + 1) * segment + 1
    lengths = [end - start for start, end in spans]
    assert max(lengths) - min(lengths) <= 1


def test_validation_spans_for_tiny_streams() -> None:
    assert validation_spans(20, 0.01) == []
    assert validation_spans(40, 0.1) == [(0, 1), (2, 3), (5, 6), (7, 8)]


@pytest.mark.parametrize("dtype", [np.uint16, np.uint32])
def test_split_stream_partitions_tokens(tmp_path: Path, dtype: type) -> None:
    stream = np.arange(100_000, dtype=np.int64) * 7 % 70_000
    stream.astype(dtype).tofile(tmp_path / "stream.bin")
    spans = validation_spans(stream.size, 0.2)
    split_stream(
        tmp_path / "stream.bin", tmp_path / "t.bin", tmp_path / "v.bin", spans, np.dtype(dtype)
    )
    val = np.fromfile(tmp_path / "v.bin", dtype=dtype)
    train = np.fromfile(tmp_path / "t.bin", dtype=dtype)
    in_val = np.zeros(stream.size, dtype=bool)
    for start, end in spans:
        in_val[start:end] = True
    assert np.array_equal(val, stream[in_val].astype(dtype))
    assert np.array_equal(train, stream[~in_val].astype(dtype))


def test_shards_hold_every_document_then_eot(make_cfg: MakeCfg, code_corpus: Path) -> None:
    bundle = build_data(make_cfg(val_fraction=0.1), seq_len=32, micro_batch_size=4, seed=0)
    meta = bundle.meta
    directory = Path(meta["cache_dir"])
    assert json.loads((directory / "meta.json").read_text()) | {"cache_dir": str(directory)} == meta
    assert meta["dtype"] == "uint16" and meta["vocab_size"] == 512 and meta["eot_id"] == 2
    train = np.fromfile(directory / "train.bin", dtype=np.uint16)
    val = np.fromfile(directory / "val.bin", dtype=np.uint16)
    assert train.size == meta["train_tokens"] and val.size == meta["val_tokens"]
    assert train.size + val.size == meta["total_tokens"]
    assert meta["val_tokens"] == round(meta["total_tokens"] * 0.1)
    stream = np.empty(meta["total_tokens"], dtype=np.uint16)
    in_val = np.zeros(stream.size, dtype=bool)
    for start, end in meta["val_spans"]:
        in_val[start:end] = True
    stream[in_val], stream[~in_val] = val, train
    documents = [p.read_text(encoding="utf-8") for p in sorted(code_corpus.glob("*.txt"))]
    tokenizer = bundle.tokenizer
    expected = [i for text in documents for i in [*tokenizer.encode(text), tokenizer.eot_id]]
    assert stream.tolist() == expected
    assert meta["num_documents"] == len(documents)
    assert meta["source"]["num_files"] == len(documents)
    assert meta["tokenizer"]["vocab_size"] == 512


def test_second_build_reuses_everything(make_cfg: MakeCfg, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = make_cfg()
    first = build_data(cfg, seq_len=32, micro_batch_size=4, seed=0)
    directory = Path(first.meta["cache_dir"])
    mtimes = {p.name: p.stat().st_mtime_ns for p in directory.iterdir()}
    monkeypatch.setattr(shards_module, "train_model", fail)
    monkeypatch.setattr(shards_module, "write_shards", fail)
    second = build_data(cfg, seq_len=32, micro_batch_size=4, seed=0)
    assert second.meta == first.meta
    assert {p.name: p.stat().st_mtime_ns for p in directory.iterdir()} == mtimes
    assert sorted(p.name for p in directory.iterdir()) == [
        "meta.json",
        "tokenizer.model",
        "train.bin",
        "val.bin",
    ]


def test_new_val_fraction_reuses_tokenizer(
    make_cfg: MakeCfg, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = build_data(make_cfg(val_fraction=0.05), seq_len=32, micro_batch_size=4, seed=0)
    monkeypatch.setattr(shards_module, "train_model", fail)
    second = build_data(make_cfg(val_fraction=0.2), seq_len=32, micro_batch_size=4, seed=0)
    assert second.meta["cache_dir"] != first.meta["cache_dir"]
    assert second.meta["tokenizer"] == first.meta["tokenizer"]
    assert second.meta["total_tokens"] == first.meta["total_tokens"]
    assert second.meta["val_tokens"] > first.meta["val_tokens"]


def test_changed_corpus_or_vocab_rebuilds(
    make_cfg: MakeCfg, tmp_path: Path, corpus_writer: Callable[..., Path]
) -> None:
    corpus = corpus_writer(tmp_path / "corpus", files=40)
    first = build_data(make_cfg(paths=[str(corpus)]), seq_len=32, micro_batch_size=4, seed=0)
    bigger = build_data(
        make_cfg(paths=[str(corpus)], vocab_size=600), seq_len=32, micro_batch_size=4, seed=0
    )
    assert bigger.meta["cache_dir"] != first.meta["cache_dir"]
    assert bigger.tokenizer.vocab_size == 600
    (corpus / "extra.txt").write_text("def extra():\n    return 1\n")
    changed = build_data(make_cfg(paths=[str(corpus)]), seq_len=32, micro_batch_size=4, seed=0)
    assert changed.meta["cache_dir"] != first.meta["cache_dir"]
    assert changed.meta["num_documents"] == first.meta["num_documents"] + 1


def test_crash_leaves_no_cache_entry(make_cfg: MakeCfg, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = make_cfg()
    settings = DataSettings.from_config(cfg)

    def crash(documents: object, tokenizer: Tokenizer, directory: Path, fraction: float) -> None:
        (directory / "train.bin").write_bytes(b"partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(shards_module, "write_shards", crash)
    with pytest.raises(KeyboardInterrupt):
        prepare_shards(settings)
    entries = sorted(p.name for p in settings.cache_dir.iterdir())
    assert len(entries) == 1 and entries[0].startswith("tokenizer-")
    monkeypatch.undo()
    assert (prepare_shards(settings) / "meta.json").is_file()


def test_staged_directory_keeps_the_first_published_entry(tmp_path: Path) -> None:
    target = tmp_path / "entry"
    with staged_directory(target) as staging:
        (staging / "f").write_text("first")
        with staged_directory(target) as racing:
            (racing / "f").write_text("second")
    assert (target / "f").read_text() == "second"
    assert [p.name for p in tmp_path.iterdir()] == ["entry"]


def test_too_few_tokens_for_validation_raises(small_tokenizer: Tokenizer, tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"^data\.val_fraction: 0\.01 of \d+ tokens leaves no"):
        write_shards(["ab"], small_tokenizer, tmp_path, 0.01)


def test_uint32_shards_when_the_vocabulary_is_large(
    small_tokenizer: Tokenizer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(shards_module, "token_dtype", lambda vocab_size: np.dtype(np.uint32))
    documents = ["def f():\n    return 1\n"] * 50
    meta = write_shards(documents, small_tokenizer, tmp_path, 0.1)
    assert meta["dtype"] == "uint32"
    train = np.fromfile(tmp_path / "train.bin", dtype=np.uint32)
    assert train.size == meta["train_tokens"]
    assert small_tokenizer.eot_id in train.tolist()


def test_source_errors_surface_from_build(tmp_path: Path, make_cfg: MakeCfg) -> None:
    (tmp_path / "empty.txt").write_text("   \n")
    with pytest.raises(DataError, match="no text found in"):
        build_data(make_cfg(paths=[str(tmp_path)]), seq_len=32, micro_batch_size=4, seed=0)
