"""data.mixture: settings and their errors, weighted deterministic resumable sampling,
tokens per source, and a mixture prepared end to end (also through the prepare command)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from collage_train import prepare
from collage_train.data import DataError, build_data
from collage_train.data.mixture import MixtureLoader
from collage_train.data.settings import DataSettings

MakeCfg = Callable[..., SimpleNamespace]
OFFSET = 100_000  # source b's token values start here, so a window names its source


def two_sources(n_a: int = 401, n_b: int = 201) -> list[np.ndarray]:
    return [np.arange(n_a, dtype=np.int64), OFFSET + np.arange(n_b, dtype=np.int64)]


def loader(**overrides: object) -> MixtureLoader:
    arguments = {
        "sources": two_sources(),
        "labels": ["a", "b"],
        "weights": [3.0, 1.0],
        "seq_len": 4,
        "batch_size": 8,
        "seed": 11,
    } | overrides
    return MixtureLoader(**arguments)  # type: ignore[arg-type]


@pytest.mark.slow
def test_draws_follow_the_weights_and_each_source_its_own_order() -> None:
    mix = loader()
    rows = torch.cat([mix.next_batch() for _ in range(400)])
    from_b = rows[:, 0] >= OFFSET
    assert all(bool(((row >= OFFSET) == b).all()) for row, b in zip(rows, from_b, strict=True))
    assert abs(from_b.float().mean().item() - 0.25) < 0.03  # weights 3:1
    tokens = mix.tokens_per_source()
    assert tokens == {"a": int((~from_b).sum()) * 4, "b": int(from_b.sum()) * 4}
    assert mix.metrics() == {"tokens_a": tokens["a"], "tokens_b": tokens["b"]}
    # source b (50 samples) in draw order: every sample once per pass, a new order each pass
    b_samples = ((rows[from_b, 0] - OFFSET) // 4).tolist()
    first, second = b_samples[:50], b_samples[50:100]
    assert sorted(first) == sorted(second) == list(range(50)) and first != second
    assert mix.epoch == min(tokens["a"] // 4 // 100, tokens["b"] // 4 // 50)


def test_resume_is_exact_and_ranks_split_the_global_batch() -> None:
    reference = loader()
    expected = [reference.next_batch() for _ in range(30)]
    interrupted = loader()
    for _ in range(13):
        interrupted.next_batch()
    resumed = loader()
    resumed.load_state_dict(interrupted.state_dict())
    for batch in expected[13:]:
        assert torch.equal(resumed.next_batch(), batch)
    ranks = [loader(batch_size=4, rank=r, world_size=2) for r in (0, 1)]
    for batch in expected[:5]:
        assert torch.equal(torch.cat([r.next_batch() for r in ranks]), batch)
    assert ranks[0].state_dict() == ranks[1].state_dict()
    other = loader(weights=[1.0, 1.0])
    with pytest.raises(DataError, match=r"^the data loader state does not match this run: weights"):
        other.load_state_dict(reference.state_dict())


@pytest.mark.parametrize(
    ("mixture", "message"),
    [
        ([{"weight": 0, "paths": ["x"]}], r"^data\.mixture\[0\]\.weight: 0 must be a positive"),
        ([{"weight": "a", "paths": ["x"]}], r"^data\.mixture\[0\]\.weight: 'a' must be a positive"),
        ([{"paths": ["x"]}], r"^data\.mixture\[0\]\.weight: None must be a positive"),
        ([{"weight": 1, "path": ["x"]}], r"^data\.mixture\[0\]: unknown key 'path'"),
        ([{"weight": 1}], r"^data\.mixture\[0\] \(source0\): data\.paths: list at least one"),
        (
            [
                {"label": "a", "weight": 1, "paths": ["x"]},
                {"label": "a", "weight": 1, "paths": ["y"]},
            ],
            r"^data\.mixture: labels must differ",
        ),
    ],
)
def test_bad_mixtures_are_refused(
    make_cfg: MakeCfg, mixture: list[dict[str, object]], message: str
) -> None:
    with pytest.raises(DataError, match=message):
        DataSettings.from_config(make_cfg(mixture=mixture))


def test_a_missing_source_is_named(make_cfg: MakeCfg, code_corpus: Path, tmp_path: Path) -> None:
    mixture = [
        {"label": "code", "weight": 1, "paths": [str(code_corpus)]},
        {"label": "web", "weight": 1, "paths": [str(tmp_path / "absent")]},
    ]
    with pytest.raises(DataError, match=r"^data\.mixture \(web\): data\.paths: .*absent does not"):
        build_data(make_cfg(mixture=mixture), seq_len=16, micro_batch_size=2, seed=0)
    assert not (tmp_path / "cache").exists() or not any(
        (p / "manifest.json").exists() for p in (tmp_path / "cache").iterdir()
    )


@pytest.mark.slow
def test_a_mixture_prepared_and_served(
    code_corpus: Path, tmp_path: Path, corpus_writer: Callable[..., Path]
) -> None:
    other = corpus_writer(tmp_path / "other", files=20, seed=5)
    argv = [
        "data=files",
        f"data.cache_dir={tmp_path / 'cache'}",
        "data.vocab_size=512",
        "data.shard_tokens=5000",
        f"data.mixture=[{{label:code,weight:3,paths:[{code_corpus}]}},"
        f"{{label:other,weight:1,paths:[{other}]}}]",
    ]
    assert prepare.main(argv) == 0  # data.paths of data=files may stay unset
    from tiny_config import compose_tiny

    cfg = compose_tiny(
        code_corpus, tmp_path / "cache", *argv[3:], "data.tokenizer_train_chars=4000000"
    )
    bundle = build_data(cfg.data, seq_len=16, micro_batch_size=4, seed=1)
    meta = bundle.meta
    assert meta["source"] == {
        "source": "mixture",
        "labels": ["code", "other"],
        "weights": [3.0, 1.0],
    }
    assert [m["num_documents"] for m in meta["mixture"]] == [100, 20]
    assert meta["train_tokens"] == sum(m["train_tokens"] for m in meta["mixture"])
    assert len({m["cache_dir"] for m in meta["mixture"]}) == 2
    assert bundle.tokenizer.vocab_size == 512
    batches = [bundle.train_loader.next_batch() for _ in range(20)]
    assert all(b.shape == (4, 17) for b in batches)
    seen = bundle.train_loader.tokens_per_source()
    assert seen["code"] > seen["other"] > 0 and sum(seen.values()) == 20 * 4 * 16
    validation = list(bundle.validation_batches(bundle.validation_plan(2, 3)))
    assert len(validation) == 3 and all(counted for _, counted in validation)
    assert [tuple(batch.shape) for batch, _ in validation] == [(2, 17)] * 3
