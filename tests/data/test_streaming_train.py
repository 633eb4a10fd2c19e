"""data=hf with data.streaming=true through the real Trainer: no shards, resume from a
checkpoint continues the stream exactly, bad input is one error line (never the network)."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from collage_train.cli import config_dir, run
from collage_train.trainer import Trainer


@pytest.fixture
def stream(corpus_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The test corpus as a local JSONL stream, one document per source file."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_cache")
    path = tmp_path / "stream.jsonl"
    rows = (json.dumps({"text": p.read_text()}) for p in sorted(corpus_dir.glob("*.txt")))
    path.write_text("\n".join(rows) + "\n")
    return path


def compose_stream(stream: Path, cache: Path, *overrides: str) -> DictConfig:
    """The tiny GPT on ``stream``, streamed; quiet (no console, W&B, plots, export)."""
    with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
        return compose(
            config_name="config",
            overrides=[
                "model.hidden_size=32",
                "model.num_layers=2",
                "model.num_heads=2",
                "data=hf",
                "data.name=json",
                f"data.data_files=[{stream}]",
                "data.streaming=true",
                "data.val_documents=3",
                "data.vocab_size=512",
                "data.seq_len=32",
                "data.tokenizer_train_chars=200000",
                f"data.cache_dir={cache}",
                "train.micro_batch_size=4",
                "train.global_batch_size=4",
                "train.max_steps=4",
                "train.eval_batches=2",
                "logging.console=none",
                "logging.wandb.mode=disabled",
                "logging.plots=false",
                "train.export_hf=false",
                *overrides,
            ],
        )


@pytest.mark.slow
def test_streaming_run_resumes_from_a_checkpoint_exactly(stream: Path, tmp_path: Path) -> None:
    cfg = compose_stream(stream, tmp_path / "cache")
    first = Trainer(cfg, tmp_path / "run")
    for _ in range(2):
        first.train_step()
    assert first.evaluate()["val_loss"] > 0
    saved = first.save_checkpoint()
    expected = [first.data.train_loader.next_batch() for _ in range(2)]
    cache = tmp_path / "cache"
    assert not list(cache.rglob("manifest.json")) and not list(cache.rglob("*.bin"))

    resumed = Trainer(cfg, tmp_path / "run")
    resumed.resume_from(saved)
    assert resumed.step == 2
    for batch in expected:
        assert torch.equal(resumed.data.train_loader.next_batch(), batch)


def test_a_stream_too_short_for_validation_is_one_error_line(
    stream: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    head = tmp_path / "head.jsonl"  # validation holds one tiny document
    head.write_text('{"text": "x = 1"}\n' + stream.read_text())
    cfg = compose_stream(head, tmp_path / "cache", "data.val_documents=1")
    assert run(cfg, tmp_path / "run") == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    assert "data.val_documents" in lines[0]
