"""Prepared corpora: fixed-size shards and manifest, parallel = serial, reuse, crash resume,
waiting ranks, existing tokenizers, and bad input refused without deleting anything."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from collage_train.data import DataError, build_data
from collage_train.data import shards as shards_module
from collage_train.data.progress import wait_for_preparation
from collage_train.data.settings import DataSettings
from collage_train.data.shards import load_prepared, prepare_shards
from collage_train.data.store import token_dtype, validation_spans

MakeCfg = Callable[..., SimpleNamespace]
SHARD = 4_000  # tokens per shard in these tests: the generated corpus makes about 25 shards


def fail(*args: object, **kwargs: object) -> None:
    raise AssertionError("the cache should have been reused")


def stream_of(directory: Path) -> np.ndarray:
    manifest = json.loads((directory / "manifest.json").read_text())
    return np.concatenate(
        [np.fromfile(directory / s["file"], dtype=manifest["dtype"]) for s in manifest["shards"]]
    )


def snapshot(directory: Path) -> dict[str, tuple[int, int]]:
    """(inode, mtime) of every file: equal snapshots mean nothing was rewritten."""
    return {
        str(p.relative_to(directory)): (p.stat().st_ino, p.stat().st_mtime_ns)
        for p in directory.rglob("*")
        if p.is_file() and p.name != "progress.json"
    }


def test_token_dtype_choice() -> None:
    assert token_dtype(512) == np.uint16
    assert token_dtype(65_536) == np.uint16
    assert token_dtype(65_537) == np.uint32


@pytest.mark.parametrize("total", [10_000, 1_000_003])
@pytest.mark.parametrize("fraction", [0.01, 0.5])
def test_validation_spans_are_spread_and_sized(total: int, fraction: float) -> None:
    spans = validation_spans(total, fraction)
    assert len(spans) == 16
    assert sum(end - start for start, end in spans) == round(total * fraction)
    segment = total / 16
    for index, (start, end) in enumerate(spans):
        assert index * segment - 1 <= start < end <= (index + 1) * segment + 1
    assert validation_spans(20, 0.01) == []


@pytest.mark.slow
def test_shards_hold_every_document_then_eot(make_cfg: MakeCfg, code_corpus: Path) -> None:
    bundle = build_data(
        make_cfg(val_fraction=0.1, shard_tokens=SHARD), seq_len=32, micro_batch_size=4, seed=0
    )
    directory = Path(bundle.meta["cache_dir"])
    manifest = json.loads((directory / "manifest.json").read_text())
    shards = manifest["shards"]
    assert manifest["num_shards"] == len(shards) > 5
    assert all(s["tokens"] == SHARD for s in shards[:-1]) and 0 < shards[-1]["tokens"] <= SHARD
    assert manifest["tokenizer"]["sha256"] == bundle.tokenizer.sha256()
    assert manifest["source"]["num_files"] == 100 and manifest["num_documents"] == 100
    stream = stream_of(directory)
    tokenizer = bundle.tokenizer
    documents = [p.read_text(encoding="utf-8") for p in sorted(code_corpus.glob("*.txt"))]
    expected = [i for text in documents for i in [*tokenizer.encode(text), tokenizer.eot_id]]
    assert stream.tolist() == expected and manifest["total_tokens"] == len(expected)
    # document boundaries: every end offset is one past an end-of-text id, and all are listed
    ends = np.concatenate(
        [
            np.fromfile(directory / s["ends"], dtype="<u8") + index * SHARD
            for index, s in enumerate(shards)
        ]
    )
    assert ends.tolist() == (np.flatnonzero(stream == tokenizer.eot_id) + 1).tolist()
    per_shard = [
        int(((ends > i * SHARD) & (ends <= (i + 1) * SHARD)).sum()) for i in range(len(shards))
    ]
    assert [s["documents"] for s in shards] == per_shard
    # the splits: validation is the 16 stretches, training the rest, in order
    in_val = np.zeros(stream.size, dtype=bool)
    for start, end in bundle.meta["val_spans"]:
        in_val[start:end] = True
    assert np.asarray(bundle.val_tokens).tolist() == stream[in_val].tolist()
    assert np.asarray(bundle.train_loader.tokens).tolist() == stream[~in_val].tolist()


@pytest.mark.slow
def test_parallel_preparation_writes_the_same_shards(make_cfg: MakeCfg, tmp_path: Path) -> None:
    serial = prepare_shards(DataSettings.from_config(make_cfg(shard_tokens=SHARD, num_workers=1)))
    parallel = prepare_shards(
        DataSettings.from_config(
            make_cfg(shard_tokens=SHARD, num_workers=2, cache_dir=str(tmp_path / "other"))
        )
    )
    assert serial.name == parallel.name  # the key does not depend on the worker count
    assert np.array_equal(stream_of(serial), stream_of(parallel))
    for name in ("000000.ends", "000003.json"):
        assert (serial / "shards" / name).read_bytes() == (parallel / "shards" / name).read_bytes()


@pytest.mark.slow
def test_second_build_reuses_everything(make_cfg: MakeCfg, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = make_cfg(shard_tokens=SHARD)
    first = build_data(cfg, seq_len=32, micro_batch_size=4, seed=0)
    directory = Path(first.meta["cache_dir"])
    before = snapshot(directory)
    monkeypatch.setattr(shards_module, "train_model", fail)
    monkeypatch.setattr(shards_module, "write_shards", fail)
    monkeypatch.setattr(shards_module, "sha256_of_file", fail)  # digests are remembered
    second = build_data(cfg, seq_len=32, micro_batch_size=4, seed=0)
    assert second.meta == first.meta
    assert snapshot(directory) == before


def test_changed_corpus_or_vocab_prepares_again(
    make_cfg: MakeCfg, tmp_path: Path, corpus_writer: Callable[..., Path]
) -> None:
    corpus = corpus_writer(tmp_path / "corpus", files=30)
    first = build_data(make_cfg(paths=[str(corpus)]), seq_len=32, micro_batch_size=4, seed=0)
    bigger = build_data(
        make_cfg(paths=[str(corpus)], vocab_size=600), seq_len=32, micro_batch_size=4, seed=0
    )
    assert bigger.meta["cache_dir"] != first.meta["cache_dir"]
    assert bigger.tokenizer.vocab_size == 600
    time.sleep(0.01)
    (corpus / "doc_0000.txt").write_text("def changed():\n    return 1\n")
    changed = build_data(make_cfg(paths=[str(corpus)]), seq_len=32, micro_batch_size=4, seed=0)
    assert changed.meta["cache_dir"] != first.meta["cache_dir"]


@pytest.mark.slow
def test_a_crash_keeps_the_complete_shards_and_resumes(
    make_cfg: MakeCfg, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    clean = prepare_shards(
        DataSettings.from_config(make_cfg(shard_tokens=SHARD, cache_dir=str(tmp_path / "clean")))
    )
    settings = DataSettings.from_config(make_cfg(shard_tokens=SHARD))
    flush = shards_module.ShardWriter.flush

    def crash_after_five(writer: shards_module.ShardWriter, position: tuple[int, int]) -> None:
        if len(writer.records) == 5:
            (writer.directory / ".000005.bin.99.tmp").write_bytes(b"in flight")
            raise KeyboardInterrupt
        flush(writer, position)

    monkeypatch.setattr(shards_module.ShardWriter, "flush", crash_after_five)
    with pytest.raises(KeyboardInterrupt):
        prepare_shards(settings)
    directory = settings.cache_dir / clean.name
    assert not (directory / "manifest.json").exists()
    assert json.loads((directory / "progress.json").read_text())["state"] == "interrupted"
    kept = {k: v for k, v in snapshot(directory).items() if k.startswith("shards/00000")}
    assert len(kept) == 15  # five shards of .bin, .ends and .json
    monkeypatch.undo()
    monkeypatch.setattr(shards_module, "train_model", fail)  # the tokenizer is reused too
    assert prepare_shards(settings) == directory
    assert {k: v for k, v in snapshot(directory).items() if k in kept} == kept
    assert np.array_equal(stream_of(directory), stream_of(clean))
    assert not list((directory / "shards").glob(".*.tmp"))  # the shard in flight is gone
    assert (directory / "manifest.json").read_text().replace(str(settings.cache_dir), "") == (
        clean / "manifest.json"
    ).read_text().replace(str(tmp_path / "clean"), "")


@pytest.mark.slow
def test_kill_9_at_any_moment_then_resume(make_cfg: MakeCfg, tmp_path: Path) -> None:
    clean = prepare_shards(
        DataSettings.from_config(
            make_cfg(shard_tokens=SHARD, num_workers=1, cache_dir=str(tmp_path / "clean"))
        )
    )
    settings = DataSettings.from_config(make_cfg(shard_tokens=SHARD, num_workers=1))
    shards = settings.cache_dir / clean.name / "shards"
    for wanted in (2, 9):  # kill it twice, mid-way each time
        child = os.fork()
        if child == 0:  # pragma: no cover - the child never returns
            try:
                prepare_shards(settings)
            finally:
                os._exit(0)
        deadline = time.monotonic() + 30
        while len(list(shards.glob("*.json"))) < wanted and time.monotonic() < deadline:
            time.sleep(0.002)
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)
    assert not (shards.parent / "manifest.json").exists()
    assert (
        9
        <= len(list(shards.glob("*.json")))
        < len(json.loads((clean / "manifest.json").read_text())["shards"])
    )
    directory = prepare_shards(settings)
    assert np.array_equal(stream_of(directory), stream_of(clean))


@pytest.mark.slow
def test_other_ranks_wait_for_the_manifest(make_cfg: MakeCfg, tmp_path: Path) -> None:
    settings = DataSettings.from_config(make_cfg(shard_tokens=SHARD, num_workers=1))
    child = os.fork()
    if child == 0:  # pragma: no cover - the preparing "rank 0"
        try:
            time.sleep(0.3)
            prepare_shards(settings)
        finally:
            os._exit(0)
    try:
        directory = prepare_shards(settings, prepare=False)  # a rank that only waits
        assert (directory / "manifest.json").is_file()
        load_prepared(directory)
    finally:
        os.waitpid(child, 0)


def test_waiters_stop_on_a_failed_or_dead_preparation(tmp_path: Path) -> None:
    (tmp_path / "progress.json").write_text(
        json.dumps({"state": "failed", "error": "no text found in x", "time": time.time()})
    )
    with pytest.raises(DataError, match=r"preparation in .* failed \(no text found in x\)"):
        wait_for_preparation(tmp_path, tmp_path / "manifest.json", poll_seconds=0.01)
    (tmp_path / "progress.json").write_text(json.dumps({"state": "failed", "time": 0}))  # stale
    with pytest.raises(DataError, match=r"^no progress from the corpus preparation"):
        wait_for_preparation(
            tmp_path, tmp_path / "manifest.json", stall_seconds=0.05, poll_seconds=0.01
        )
    (tmp_path / "progress.json").write_text(json.dumps({"state": "preparing", "time": 0}))
    with pytest.raises(DataError, match=r"^no progress from the corpus preparation"):
        wait_for_preparation(
            tmp_path, tmp_path / "manifest.json", stall_seconds=0.05, poll_seconds=0.01
        )


@pytest.mark.slow
def test_an_existing_tokenizer_sets_the_vocabulary(make_cfg: MakeCfg, tmp_path: Path) -> None:
    from tokenizers import Tokenizer as BackendTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    backend = BackendTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=700,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    backend.train_from_iterator(["def f(x):\n    return x\n"] * 50, trainer=trainer)
    backend.save(str(tmp_path / "tokenizer.json"))
    cfg = make_cfg(tokenizer=str(tmp_path / "tokenizer.json"), shard_tokens=SHARD)
    bundle = build_data(cfg, seq_len=32, micro_batch_size=4, seed=0)
    assert bundle.tokenizer.kind == "hf" and bundle.tokenizer.eot_id == 0
    assert bundle.tokenizer.vocab_size == backend.get_vocab_size() == bundle.meta["vocab_size"]
    assert bundle.meta["tokenizer"]["plan"]["given"]["kind"] == "hf"
    directory = Path(bundle.meta["cache_dir"])
    assert (directory / "hf_tokenizer.json").is_file()
    assert (
        stream_of(directory)[:10].tolist()
        == bundle.tokenizer.encode(sorted(Path(cfg.paths[0]).glob("*.txt"))[0].read_text())[:10]
    )


def broken(make_cfg: MakeCfg, how: str) -> tuple[DataSettings, Path, dict[str, tuple[int, int]]]:
    settings = DataSettings.from_config(make_cfg(shard_tokens=SHARD))
    directory = prepare_shards(settings)
    manifest = json.loads((directory / "manifest.json").read_text())
    if how == "missing":
        (directory / "shards/000002.bin").unlink()
    elif how == "truncated":
        with (directory / "shards/000003.bin").open("r+b") as handle:
            handle.truncate(100)
    elif how == "tokenizer":
        manifest["tokenizer"]["sha256"] = "0" * 64
    elif how == "dtype":
        manifest["vocab_size"] = 70_000
    (directory / "manifest.json").write_text(json.dumps(manifest))
    return settings, directory, snapshot(directory)


@pytest.mark.parametrize(
    ("how", "message"),
    [
        ("missing", r"^shard .*000002\.bin is missing; restore it, or remove .* and prepare"),
        ("truncated", r"^shard .*000003\.bin has 100 bytes, the manifest says 8000 \(truncated"),
        ("tokenizer", r"was written with tokenizer 000000000000, not this run's"),
        ("dtype", r"a vocabulary of 70000 ids does not fit the shards' uint16 tokens"),
    ],
)
@pytest.mark.slow
def test_a_damaged_corpus_is_refused_and_kept(make_cfg: MakeCfg, how: str, message: str) -> None:
    _, directory, before = broken(make_cfg, how)
    with pytest.raises(DataError, match=message):
        build_data(make_cfg(shard_tokens=SHARD), seq_len=32, micro_batch_size=4, seed=0)
    assert snapshot(directory) == before


def test_a_path_that_is_not_a_tokenizer_is_refused(make_cfg: MakeCfg, code_corpus: Path) -> None:
    text_file = sorted(code_corpus.glob("*.txt"))[0]
    with pytest.raises(DataError, match=r"^tokenizer: .* is neither a SentencePiece model nor"):
        build_data(make_cfg(tokenizer=str(text_file)), seq_len=32, micro_batch_size=4, seed=0)


def test_source_errors_surface_from_build(tmp_path: Path, make_cfg: MakeCfg) -> None:
    (tmp_path / "empty.txt").write_text("   \n")
    with pytest.raises(DataError, match="no text found in"):
        build_data(make_cfg(paths=[str(tmp_path)]), seq_len=32, micro_batch_size=4, seed=0)
