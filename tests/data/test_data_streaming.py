"""data.streaming: unprepared training on a stream, rank shares, packing, bitwise resume, errors."""

from __future__ import annotations

import itertools
import json
import multiprocessing
import random
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import datasets
import numpy as np
import pytest
import torch

from collage_train import prepare
from collage_train.data import DataError, Tokenizer, TokenLoader, build_data, stream_data
from collage_train.data.settings import DataSettings
from collage_train.data.shards import load_prepared, prepare_shards
from collage_train.data.streaming import StreamingLoader

MakeCfg = Callable[..., SimpleNamespace]
SEQ_LEN, BATCH = 16, 3
WORDS = ["alpha", "beta", "gamma", "delta", "value", "index", "token", "state", "    pass"]


def document(rng: random.Random, index: int) -> str:
    """Documents from a few tokens (shorter than a window) to several batches long."""
    lines = rng.choice([1, 2, 4, 8, 30])
    return f"# doc {index}\n" + "\n".join(" ".join(rng.sample(WORDS, 3)) for _ in range(lines))


def write_stream(path: Path, count: int, *, blank_every: int = 0, seed: int = 0) -> list[str]:
    """Write ``count`` JSONL rows (every ``blank_every``-th one blank); return the documents."""
    rng = random.Random(seed)
    rows, documents = [], []
    for index in range(count):
        if blank_every and index % blank_every == blank_every - 1:
            rows.append({"text": "   "})
            continue
        documents.append(document(rng, index))
        rows.append({"text": documents[-1]})
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return documents


@pytest.fixture
def hf_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Keep the datasets library's cache inside the test's temporary directory."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_cache")


@pytest.fixture
def stream(tmp_path: Path, hf_cache: None) -> tuple[Path, list[str]]:
    """A local JSONL stream of 120 rows, every 10th blank (skipped by the source)."""
    path = tmp_path / "stream.jsonl"
    return path, write_stream(path, 120, blank_every=10)


@pytest.fixture
def stream_cfg(
    make_cfg: MakeCfg, small_tokenizer: Tokenizer, stream: tuple[Path, list[str]]
) -> Callable[..., SimpleNamespace]:
    """``data=hf data.streaming=true`` over ``stream`` with the small tokenizer given."""

    def make(**overrides: Any) -> SimpleNamespace:
        fields = {
            "source": "hf",
            "name": "json",
            "data_files": [str(stream[0])],
            "streaming": True,
            "val_documents": 8,
            "tokenizer": str(small_tokenizer.model_path),
        }
        return make_cfg(**{**fields, **overrides})

    return make


def encoded(tokenizer: Tokenizer, documents: list[str]) -> np.ndarray:
    """The token stream of ``documents``: each one's ids, then the end-of-text id."""
    ids = [[*tokenizer.encode(text), tokenizer.eot_id] for text in documents]
    return np.asarray(list(itertools.chain.from_iterable(ids)), dtype=np.int64)


def windows(tokens: np.ndarray, count: int) -> np.ndarray:
    """The first ``count`` windows of ``SEQ_LEN + 1`` tokens at a stride of ``SEQ_LEN``."""
    return np.stack([tokens[i * SEQ_LEN : i * SEQ_LEN + SEQ_LEN + 1] for i in range(count)])


def open_loader(cfg: SimpleNamespace, rank: int = 0, world_size: int = 1) -> StreamingLoader:
    """The training loader of ``cfg`` for ``rank`` of ``world_size``."""
    bundle = build_data(
        cfg, seq_len=SEQ_LEN, micro_batch_size=BATCH, seed=0, rank=rank, world_size=world_size
    )
    assert isinstance(bundle.train_loader, StreamingLoader)
    return bundle.train_loader


def batches(loader: StreamingLoader, count: int) -> list[torch.Tensor]:
    return [loader.next_batch() for _ in range(count)]


def test_training_starts_without_preparing_the_stream(
    stream_cfg: MakeCfg, tmp_path: Path, stream: tuple[Path, list[str]]
) -> None:
    bundle = build_data(stream_cfg(), seq_len=SEQ_LEN, micro_batch_size=BATCH, seed=0)
    batch = bundle.train_loader.next_batch()
    assert batch.shape == (BATCH, SEQ_LEN + 1) and batch.dtype == torch.int64
    cache = tmp_path / "cache"
    assert not list(cache.rglob("manifest.json")) and not list(cache.rglob("*.bin"))
    assert not list(cache.rglob("shards"))
    # validation: the stream's first 8 documents, packed like the training stream
    documents = stream[1]
    assert bundle.meta["val_documents"] == 8 and bundle.meta["source"]["streaming"]
    np.testing.assert_array_equal(
        bundle.val_tokens, encoded(bundle.tokenizer, documents[:8]).astype(bundle.val_tokens.dtype)
    )
    val, counted = next(bundle.validation_batches(bundle.validation_plan(BATCH, 1)))
    np.testing.assert_array_equal(val.numpy(), windows(bundle.val_tokens, BATCH))
    assert counted
    # training starts at the 9th document
    expected = windows(encoded(bundle.tokenizer, documents[8:]), BATCH)
    np.testing.assert_array_equal(batch.numpy(), expected)


def test_two_ranks_read_disjoint_shares_whose_union_is_the_stream(
    stream_cfg: MakeCfg, stream: tuple[Path, list[str]]
) -> None:
    loaders = [open_loader(stream_cfg(), r, 2) for r in range(2)]
    shares = [list(loader.share()) for loader in loaders]
    training = stream[1][8:]
    assert shares[0] == training[0::2] and shares[1] == training[1::2]
    assert sorted(shares[0] + shares[1]) == sorted(training)
    assert len(shares[0]) + len(shares[1]) == len(training)
    # each rank packs its own share, nothing else
    for loader, share in zip(loaders, shares, strict=True):
        tokens = encoded(loader.tokenizer, share)
        got = torch.cat(batches(loader, 4)).numpy()
        np.testing.assert_array_equal(got, windows(tokens, 4 * BATCH))


def test_packing_equals_the_prepared_path(stream_cfg: MakeCfg, tmp_path: Path) -> None:
    """The same documents prepared into shards (data=hf, not streaming) and read in order give
    the same windows, once the validation head's tokens are skipped."""
    bundle = build_data(stream_cfg(), seq_len=SEQ_LEN, micro_batch_size=BATCH, seed=0)
    settings = DataSettings.from_config(
        stream_cfg(streaming=False, shard_tokens=500, num_workers=1, cache_dir=str(tmp_path / "p"))
    )
    manifest, _ = load_prepared(directory := prepare_shards(settings))
    prepared = np.concatenate(
        [np.fromfile(directory / s["file"], dtype=manifest["dtype"]) for s in manifest["shards"]]
    )
    assert manifest["num_shards"] > 2  # windows cross shard boundaries
    ordered = TokenLoader(prepared[bundle.val_tokens.size :], SEQ_LEN, BATCH, seed=0, shuffle=False)
    for _ in range(ordered.batches_per_epoch):
        assert torch.equal(bundle.train_loader.next_batch(), ordered.next_batch())


@pytest.mark.parametrize(("rank", "world_size"), [(0, 1), (1, 2)])
@pytest.mark.slow
def test_resume_gives_bitwise_the_same_batches(
    stream_cfg: MakeCfg, rank: int, world_size: int
) -> None:
    """From every step of more than two epochs (mid-document offsets, document and epoch
    boundaries), a fresh loader given the state continues exactly like the running one."""

    def loader() -> StreamingLoader:
        return open_loader(stream_cfg(), rank, world_size)

    running, states, seen = loader(), [], []
    while running.epoch < 2:
        assert len(seen) < 500, "two epochs of the share never ended"
        states.append(running.state_dict())
        seen.append(running.next_batch())
    seen.extend(batches(running, 3))
    positions = [s["positions"][str(rank)] for s in states]
    assert any(p["offset"] for p in positions) and any(not p["offset"] for p in positions[1:])
    assert {p["epoch"] for p in positions} == {0, 1}
    resumed = loader()
    for step in range(0, len(states), 3):
        resumed.load_state_dict(states[step])
        for expected in seen[step : step + 4]:
            assert torch.equal(resumed.next_batch(), expected)


def test_an_endless_stream_starts_at_once_and_trains_its_tokenizer_on_the_head(
    make_cfg: MakeCfg, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No full pass: an infinite stream gives a trained tokenizer (cached), validation and
    batches."""

    class Endless:
        def documents(self) -> Iterator[str]:
            rng = random.Random(0)
            return (document(rng, i) for i in itertools.count())

        def fingerprint(self) -> str:
            return "endless"

        def metadata(self) -> dict[str, Any]:
            return {"source": "hf", "name": "endless"}

    monkeypatch.setattr(stream_data, "open_source", lambda settings: Endless())
    cfg = make_cfg(
        source="hf",
        name="endless",
        streaming=True,
        val_documents=20,
        vocab_size=300,
        tokenizer_train_chars=20_000,
    )
    bundle = build_data(cfg, seq_len=SEQ_LEN, micro_batch_size=BATCH, seed=0)
    assert bundle.tokenizer.kind == "sentencepiece" and bundle.train_loader.next_batch().numel()
    trained = list((tmp_path / "cache").glob("tokenizer-*/tokenizer.model"))
    assert len(trained) == 1
    stamp = trained[0].stat().st_mtime_ns
    again = build_data(cfg, seq_len=SEQ_LEN, micro_batch_size=BATCH, seed=0)
    assert trained[0].stat().st_mtime_ns == stamp  # the cached tokenizer, not trained again
    assert again.tokenizer.sha256() == bundle.tokenizer.sha256()


def _gather_worker(rank: int, store: str, cfg: SimpleNamespace, queue: Any) -> None:
    torch.distributed.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=2
    )
    try:
        loader = open_loader(cfg, rank, 2)
        batches(loader, rank + 2)  # the ranks stand at different positions
        queue.put((rank, loader.position(), loader.state_dict(), loader.next_batch().numpy()))
    finally:
        torch.distributed.destroy_process_group()


def test_state_holds_every_ranks_position_under_a_process_group(
    stream_cfg: MakeCfg, tmp_path: Path
) -> None:
    """With two gloo ranks, each state holds both positions, so one rank's saved state
    (DeepSpeed keeps rank 0's) resumes the other exactly."""
    cfg = stream_cfg()
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    store = tmp_path / "store"
    workers = [
        context.Process(target=_gather_worker, args=(r, str(store), cfg, queue)) for r in range(2)
    ]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=120)
        assert worker.exitcode == 0
    results = {rank: rest for rank, *rest in (queue.get(timeout=10) for _ in workers)}
    own = {rank: results[rank][0] for rank in (0, 1)}
    for rank in (0, 1):
        assert results[rank][1]["positions"] == {"0": own[0], "1": own[1]}
    resumed = open_loader(cfg, 1, 2)
    resumed.load_state_dict(results[0][1])  # rank 0's state
    np.testing.assert_array_equal(resumed.next_batch().numpy(), results[1][2])


def test_bad_inputs_are_one_line_errors(
    stream_cfg: MakeCfg, tmp_path: Path, make_cfg: MakeCfg
) -> None:
    def build(**overrides: Any) -> StreamingLoader:
        cfg = stream_cfg(**overrides)
        return open_loader(cfg)

    empty = tmp_path / "empty.jsonl"
    empty.write_text('{"text": ""}\n{"text": "  "}\n')
    with pytest.raises(DataError, match="no text found"):
        build(data_files=[str(empty)])
    short = tmp_path / "short.jsonl"
    write_stream(short, 30)
    tiny_head = tmp_path / "tiny_head.jsonl"  # its first document is shorter than a window
    tiny_head.write_text('{"text": "x = 1"}\n' + short.read_text())
    with pytest.raises(DataError, match=r"val_documents=1\), hold \d+ tokens, too few for one"):
        build(data_files=[str(tiny_head)], val_documents=1)
    with pytest.raises(DataError, match="gets no training documents"):
        build(data_files=[str(short)], val_documents=30)
    with pytest.raises(DataError, match="mixture cannot"):
        build(mixture=[{"weight": 1, "name": "json", "data_files": [str(short)]}])
    with pytest.raises(DataError, match="mixture cannot stream"):
        build(
            streaming=False,
            mixture=[{"weight": 1, "name": "json", "streaming": True, "data_files": [str(short)]}],
        )
    with pytest.raises(DataError, match="applies to data=hf only"):
        open_loader(make_cfg(streaming=True))
    with pytest.raises(DataError, match="val_documents"):
        build(val_documents=0)


def test_a_state_of_another_run_is_refused(stream_cfg: MakeCfg, tmp_path: Path) -> None:
    loader = open_loader(stream_cfg())
    batches(loader, 2)
    state = loader.state_dict()
    two = open_loader(stream_cfg(), 1, 2)
    with pytest.raises(DataError, match="world_size 1 != 2"):
        two.load_state_dict(state)
    other = tmp_path / "other.jsonl"
    write_stream(other, 40, seed=1)
    elsewhere = open_loader(stream_cfg(data_files=[str(other)]))
    with pytest.raises(DataError, match="stream"):
        elsewhere.load_state_dict(state)
    beyond = {**state, "positions": {"0": {"epoch": 0, "document": 10_000, "offset": 0}}}
    with pytest.raises(DataError, match="the stream changed"):
        loader.load_state_dict(beyond)


def test_prepare_refuses_a_stream_in_one_line(
    stream: tuple[Path, list[str]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Training would not reuse shards of a stream, so the prepare command writes none."""
    argv = ["data=hf", "data.name=json", f"data.data_files=[{stream[0]}]", "data.streaming=true"]
    assert prepare.main([*argv, f"data.cache_dir={tmp_path / 'cache'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: data.streaming: a stream is not prepared")
    assert not (tmp_path / "cache").exists()
