"""TokenLoader: sample layout, determinism, exact resume, epochs, coverage and rank splits."""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from collage_train.data import DataError, TokenLoader
from collage_train.data.store import MAX_OPEN_SHARDS, ShardedTokens


def sample_ids(batch: torch.Tensor, seq_len: int) -> list[int]:
    """Recover sample indices from batches over ``np.arange`` tokens."""
    return (batch[:, 0] // seq_len).tolist()


def arange_tokens(tmp_path: Path, count: int) -> np.ndarray:
    np.arange(count, dtype=np.uint32).tofile(tmp_path / "tokens.bin")
    return np.memmap(tmp_path / "tokens.bin", dtype=np.uint32, mode="r")


def test_samples_are_windows_sharing_one_boundary_token(tmp_path: Path) -> None:
    tokens = arange_tokens(tmp_path, 1_000)
    loader = TokenLoader(tokens, seq_len=10, batch_size=3, seed=0, shuffle=False)
    assert loader.num_samples == 99
    batch = loader.next_batch()
    assert batch.dtype == torch.int64 and batch.shape == (3, 11)
    assert batch.tolist() == [list(range(i * 10, i * 10 + 11)) for i in range(3)]
    assert next(iter(loader)).tolist() == [list(range(i * 10, i * 10 + 11)) for i in range(3, 6)]


def test_uses_last_token_only_as_a_target() -> None:
    loader = TokenLoader(np.arange(21, dtype=np.uint16), seq_len=10, batch_size=2, seed=0)
    assert loader.num_samples == 2
    assert sorted(loader.next_batch()[:, -1].tolist()) == [10, 20]


def test_too_few_tokens_raises() -> None:
    with pytest.raises(DataError, match=r"^the train split has 20 tokens, too few for one global"):
        TokenLoader(np.arange(20, dtype=np.uint16), seq_len=10, batch_size=2, seed=0)
    with pytest.raises(DataError, match="lower seq_len or the batch size"):
        TokenLoader(np.arange(41, dtype=np.uint16), seq_len=10, batch_size=3, seed=0, world_size=2)


@pytest.mark.parametrize(
    "kwargs",
    [{"seq_len": 0}, {"batch_size": 0}, {"seed": -1}, {"rank": 2, "world_size": 2}],
)
def test_rejects_bad_arguments(kwargs: dict[str, int]) -> None:
    arguments = {"seq_len": 4, "batch_size": 2, "seed": 0} | kwargs
    with pytest.raises(DataError):
        TokenLoader(np.arange(1_000, dtype=np.uint16), **arguments)


def test_same_seed_same_batches_other_seed_other_batches() -> None:
    tokens = np.arange(10_000, dtype=np.uint16)
    first = TokenLoader(tokens, seq_len=8, batch_size=4, seed=3)
    second = TokenLoader(tokens, seq_len=8, batch_size=4, seed=3)
    other = TokenLoader(tokens, seq_len=8, batch_size=4, seed=4)
    a = [first.next_batch() for _ in range(5)]
    assert all(torch.equal(x, second.next_batch()) for x in a)
    assert not all(torch.equal(x, other.next_batch()) for x in a)


def test_every_sample_exactly_once_per_epoch_then_a_new_order() -> None:
    seq_len, batch_size = 5, 4
    loader = TokenLoader(np.arange(5 * 103 + 1, dtype=np.uint16), seq_len, batch_size, seed=1)
    assert loader.num_samples == 103
    assert loader.batches_per_epoch == 25 and loader.samples_per_epoch == 100
    epochs = []
    for expected_epoch in range(3):
        assert loader.epoch == expected_epoch
        ids = [i for _ in range(25) for i in sample_ids(loader.next_batch(), seq_len)]
        assert len(set(ids)) == 100 and set(ids) <= set(range(103))
        epochs.append(ids)
    assert loader.epoch == 3
    assert epochs[0] != sorted(epochs[0])
    assert epochs[0] != epochs[1] != epochs[2]


def test_unshuffled_order_is_identity_every_epoch() -> None:
    loader = TokenLoader(np.arange(41, dtype=np.uint16), 4, 3, seed=0, shuffle=False)
    first = [i for _ in range(3) for i in sample_ids(loader.next_batch(), 4)]
    second = [i for _ in range(3) for i in sample_ids(loader.next_batch(), 4)]
    assert first == second == list(range(9))


@pytest.mark.parametrize("consumed", [0, 1, 7, 24, 25, 26, 60])
def test_resume_matches_uninterrupted_run(consumed: int) -> None:
    tokens = np.arange(5 * 103 + 1, dtype=np.uint16)
    reference = TokenLoader(tokens, 5, 4, seed=9)
    expected = [reference.next_batch() for _ in range(consumed + 30)]
    interrupted = TokenLoader(tokens, 5, 4, seed=9)
    for _ in range(consumed):
        interrupted.next_batch()
    state = interrupted.state_dict()
    assert all(type(value) is int for value in state.values())
    resumed = TokenLoader(tokens, 5, 4, seed=9)
    resumed.load_state_dict(state)
    assert resumed.epoch == interrupted.epoch == consumed // 25
    for batch in expected[consumed:]:
        assert torch.equal(resumed.next_batch(), batch)


def test_state_keys() -> None:
    loader = TokenLoader(np.arange(1_001, dtype=np.uint16), 10, 2, seed=5, world_size=2, rank=1)
    loader.next_batch()
    assert loader.state_dict() == {
        "epoch": 0,
        "position": 4,
        "seed": 5,
        "num_samples": 100,
        "seq_len": 10,
        "world_size": 2,
    }


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"seq_len": 20}, "seq_len 10 != 20"),
        ({"seed": 6}, "seed 5 != 6"),
        ({"world_size": 2}, "world_size 1 != 2"),
        ({"tokens": np.arange(2_001, dtype=np.uint16)}, "num_samples 100 != 200"),
    ],
)
def test_load_state_from_another_run_raises(kwargs: dict[str, object], message: str) -> None:
    state = TokenLoader(np.arange(1_001, dtype=np.uint16), 10, 2, seed=5).state_dict()
    arguments = {"tokens": np.arange(1_001, dtype=np.uint16), "seq_len": 10, "seed": 5} | kwargs
    loader = TokenLoader(batch_size=2, **arguments)
    prefix = "^the data loader state does not match this run: "
    with pytest.raises(DataError, match=prefix + ".*" + message):
        loader.load_state_dict(state)


def test_load_state_with_out_of_range_position_raises() -> None:
    loader = TokenLoader(np.arange(1_001, dtype=np.uint16), 10, 2, seed=5)
    state = loader.state_dict() | {"position": 101}
    with pytest.raises(DataError, match="out of range"):
        loader.load_state_dict(state)


def test_two_ranks_split_the_global_batch() -> None:
    tokens = np.arange(8 * 50 + 1, dtype=np.uint16)
    single = TokenLoader(tokens, 8, batch_size=6, seed=2)
    ranks = [TokenLoader(tokens, 8, batch_size=3, seed=2, rank=r, world_size=2) for r in (0, 1)]
    for _ in range(20):
        parts = [loader.next_batch() for loader in ranks]
        assert not set(sample_ids(parts[0], 8)) & set(sample_ids(parts[1], 8))
        assert torch.equal(torch.cat(parts), single.next_batch())
    assert ranks[0].state_dict() == ranks[1].state_dict()


@settings(max_examples=60, deadline=None)
@given(
    num_samples=st.integers(1, 200),
    seq_len=st.integers(1, 6),
    batch_size=st.integers(1, 5),
    world_size=st.integers(1, 4),
    seed=st.integers(0, 2**32),
)
@pytest.mark.slow
def test_one_epoch_over_all_ranks_covers_disjoint_samples(
    num_samples: int, seq_len: int, batch_size: int, world_size: int, seed: int
) -> None:
    tokens = np.arange(num_samples * seq_len + 1, dtype=np.uint32)
    if num_samples < batch_size * world_size:
        with pytest.raises(DataError):
            TokenLoader(tokens, seq_len, batch_size, seed, world_size=world_size)
        return
    loaders = [
        TokenLoader(tokens, seq_len, batch_size, seed, rank=r, world_size=world_size)
        for r in range(world_size)
    ]
    seen = [
        i
        for _ in range(loaders[0].batches_per_epoch)
        for loader in loaders
        for i in sample_ids(loader.next_batch(), seq_len)
    ]
    assert len(seen) == len(set(seen)) == loaders[0].samples_per_epoch * world_size
    assert num_samples - len(seen) < batch_size * world_size
    assert all(loader.epoch == 1 for loader in loaders)


def sharded(tmp_path: Path, stream: np.ndarray, shard_tokens: int, spans=None) -> ShardedTokens:
    """``stream`` cut into shard files of ``shard_tokens`` tokens, viewed through ``spans``."""
    paths = []
    for index, start in enumerate(range(0, stream.size, shard_tokens)):
        path = tmp_path / f"{index:06d}.bin"
        stream[start : start + shard_tokens].tofile(path)
        paths.append(path)
    return ShardedTokens(paths, shard_tokens, stream.size, stream.dtype, spans)


def test_sharded_windows_equal_the_flat_stream_across_shards_and_gaps(tmp_path: Path) -> None:
    stream = (np.arange(5_003, dtype=np.int64) * 7919 % 65_000).astype(np.uint16)
    spans = [(0, 700), (731, 2_050), (2_051, 5_003)]  # gaps as where validation is cut out
    kept = np.concatenate([stream[a:b] for a, b in spans])
    tokens = sharded(tmp_path, stream, shard_tokens=97, spans=spans)
    assert len(tokens) == tokens.size == kept.size
    assert np.array_equal(np.asarray(tokens), kept)
    flat = TokenLoader(kept, seq_len=33, batch_size=4, seed=5)
    many = TokenLoader(tokens, seq_len=33, batch_size=4, seed=5)
    for _ in range(3 * flat.batches_per_epoch + 2):  # windows straddle shards; epochs roll
        assert torch.equal(many.next_batch(), flat.next_batch())
    state = many.state_dict()
    resumed = TokenLoader(sharded(tmp_path, stream, 97, spans), 33, 4, seed=5)
    resumed.load_state_dict(state)
    for _ in range(flat.batches_per_epoch + 1):
        assert torch.equal(resumed.next_batch(), flat.next_batch())
    assert len(tokens._open) <= MAX_OPEN_SHARDS  # memory maps are bounded, not one per shard


class HugeTokens(ShardedTokens):
    """A 10^13-token stream (about 20 TB as uint16) that is never read."""

    def __init__(self) -> None:
        super().__init__([], shard_tokens=1 << 26, total=10**13, dtype=np.dtype(np.uint16))

    def take(self, positions: np.ndarray) -> np.ndarray:
        return np.asarray(positions, dtype=np.int64) % 50_000


def test_loader_memory_does_not_grow_with_the_corpus() -> None:
    tracemalloc.start()
    loader = TokenLoader(HugeTokens(), seq_len=2048, batch_size=8, seed=1, world_size=64)
    for _ in range(3):
        loader.next_batch()
    loader.load_state_dict(loader.state_dict() | {"epoch": 7, "position": 64 * 8 * 10**6})
    batch = loader.next_batch()
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert loader.num_samples == (10**13 - 1) // 2048
    assert peak < 4 << 20, peak  # a per-sample order alone would take 39 GB
    assert batch.shape == (8, 2049)


def mapped_kib(paths: list[Path]) -> int:
    """Resident KiB of this process's mappings of ``paths`` (from /proc/self/smaps)."""
    names, total, inside = {str(p) for p in paths}, 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and len(fields) >= 5:  # a mapping's header line
            inside = len(fields) >= 6 and fields[-1] in names
        elif inside and fields[0] == "Rss:":
            total += int(fields[1])
    return total


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="Linux /proc only")
def test_reading_windows_leaves_no_shard_pages_resident(tmp_path: Path) -> None:
    stream = np.random.default_rng(0).integers(0, 60_000, 4 << 20, dtype=np.uint16)
    tokens = sharded(tmp_path, stream, shard_tokens=1 << 20)  # four 2 MB shards, hot in cache
    loader = TokenLoader(tokens, seq_len=512, batch_size=8, seed=3)
    for _ in range(50):
        loader.next_batch()
    assert len(tokens._open) == 4
    assert mapped_kib(tokens.paths) == 0  # every read gave its pages back


@pytest.mark.parametrize(
    ("shape", "message"),
    [
        ({"seq_len": 0}, r"seq_len \(0\).* must be positive"),
        ({"batch_size": 0}, r"batch_size \(0\)"),
        ({"rank": 2, "world_size": 2}, r"rank 2 is outside \[0, 2\)"),
    ],
)
def test_both_loaders_refuse_a_shape_that_cannot_serve_batches(shape, message):
    """The prepared and the streaming loader share one check and its messages."""
    from collage_train.data.streaming import StreamingLoader

    args = {"seq_len": 8, "batch_size": 2, "rank": 0, "world_size": 1, **shape}
    with pytest.raises(DataError, match=message):
        TokenLoader(np.arange(100, dtype=np.uint16), seed=0, **args)
    with pytest.raises(DataError, match=message):
        StreamingLoader(lambda: iter(()), tokenizer=None, **args)
    with pytest.raises(DataError, match=r"seed \(-1\) non-negative"):
        TokenLoader(np.arange(100, dtype=np.uint16), seq_len=8, batch_size=2, seed=-1)
    with pytest.raises(DataError, match=r"skip \(-1\) non-negative"):
        StreamingLoader(lambda: iter(()), tokenizer=None, seq_len=8, batch_size=2, skip=-1)


@pytest.mark.parametrize("consumed", [7, 25])  # mid-epoch, and at an epoch's start
def test_a_data_order_seed_reorders_the_unseen_samples_then_every_later_epoch(
    consumed: int,
) -> None:
    """A branch's data-order seed (run.branch): the rest of the epoch visits the samples
    the parent had not reached, each once, in another order; later epochs differ too; the
    state keeps it, so a resumed branch continues in that order (two branches in a row too)."""
    seq_len, tokens = 5, np.arange(5 * 103 + 1, dtype=np.uint16)
    parent = TokenLoader(tokens, seq_len, 4, seed=1)
    for _ in range(consumed):
        parent.next_batch()
    branch = TokenLoader(tokens, seq_len, 4, seed=1)
    branch.load_state_dict(parent.state_dict())
    branch.reorder(7)
    left = 25 - consumed % 25
    kept = [i for _ in range(left) for i in sample_ids(parent.next_batch(), seq_len)]
    moved = [i for _ in range(left) for i in sample_ids(branch.next_batch(), seq_len)]
    assert moved != kept and sorted(moved) == sorted(kept)  # the same samples, reordered
    assert parent.epoch == branch.epoch == consumed // 25 + 1
    state = branch.state_dict()
    resumed = TokenLoader(tokens, seq_len, 4, seed=1)
    resumed.load_state_dict(state)
    later = [branch.next_batch() for _ in range(30)]
    assert all(torch.equal(batch, resumed.next_batch()) for batch in later)
    next_epoch = [i for batch in later[:25] for i in sample_ids(batch, seq_len)]
    assert len(set(next_epoch)) == 100
    assert next_epoch != [i for _ in range(25) for i in sample_ids(parent.next_batch(), seq_len)]
    again = TokenLoader(tokens, seq_len, 4, seed=1)  # a branch of the branch, mid-epoch
    again.load_state_dict(resumed.state_dict())
    again.reorder(8)
    rest = [i for _ in range(20) for i in sample_ids(again.next_batch(), seq_len)]
    own = [i for _ in range(20) for i in sample_ids(resumed.next_batch(), seq_len)]
    assert rest != own and sorted(rest) == sorted(own)
