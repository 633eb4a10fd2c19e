"""``python -m collage_train.prepare``: the same Hydra data settings as training, its output,
its progress line, and one ``error:`` line with exit status 2 for bad input."""

from __future__ import annotations

import io
import json
import time
from pathlib import Path

import pytest
from tiny_config import compose_tiny, tiny_model_and_data

from collage_train import prepare
from collage_train.data import build_data
from collage_train.data.progress import PrepareProgress


def overrides(corpus: Path, cache: Path, *extra: str) -> list[str]:
    return [
        "data=files",
        f"data.paths=[{corpus}]",
        "data.vocab_size=512",
        "data.shard_tokens=5000",
        f"data.cache_dir={cache}",
        *extra,
    ]


@pytest.mark.slow
def test_prepares_the_entry_training_reuses(
    code_corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # exactly the overrides of a training run (model settings are accepted and ignored)
    argv = [*tiny_model_and_data(code_corpus, tmp_path), "data.shard_tokens=5000"]
    assert prepare.main(argv) == 0
    out = capsys.readouterr().out
    (entry,) = [p for p in tmp_path.iterdir() if (p / "manifest.json").is_file()]
    manifest = json.loads((entry / "manifest.json").read_text())
    assert out.startswith(f"prepared {manifest['total_tokens']} tokens of 100 documents in ")
    assert f"in {manifest['num_shards']} shards (sentencepiece tokenizer, vocabulary 512)" in out
    cfg = compose_tiny(code_corpus, tmp_path, "data.shard_tokens=5000")
    assert build_data(cfg.data, seq_len=32, micro_batch_size=2, seed=0).meta["cache_dir"] == str(
        entry
    )


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["data.paths=[/nonexistent/corpus]"], "data.paths: /nonexistent/corpus does not exist"),
        (["data.tokenizer=/nonexistent/tok"], "tokenizer: /nonexistent/tok does not exist"),
        (["data.shard_tokens=0"], "data.shard_tokens: 0 must be a positive integer"),
        (["data.no_such_key=1"], "bad override"),
    ],
)
def test_bad_input_is_one_error_line_and_exit_2(
    code_corpus: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    extra: list[str],
    message: str,
) -> None:
    assert prepare.main(overrides(code_corpus, tmp_path, *extra)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err


def test_progress_line_has_rate_and_eta(tmp_path: Path) -> None:
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    stream = Terminal()
    progress = PrepareProgress(tmp_path, total_chars=1000, stream=stream)
    progress.started -= 2.0  # two seconds in
    progress._last_beat = 0.0
    progress.update(tokens=500, chars=250, shards=1)
    line = stream.getvalue()
    assert line.startswith("\rprepare: 500 tokens in 1 shards, ")
    assert " tokens/s, ~25% of the input, ETA ~6s" in line
    beat = json.loads((tmp_path / "progress.json").read_text())
    assert beat["state"] == "preparing" and beat["tokens"] == 500
    assert abs(beat["time"] - time.time()) < 60
