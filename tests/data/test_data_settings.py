"""Configuration parsing: defaults, DictConfig input, and every rejected value."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest
from omegaconf import OmegaConf

from collage_train.data import DataError
from collage_train.data.settings import DataSettings

MakeCfg = Callable[..., SimpleNamespace]


def test_reads_dictconfig_and_expands_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = OmegaConf.create(
        {"source": "files", "paths": ["a.txt", "dir"], "data_files": None, "cache_dir": "~/c"}
    )
    settings = DataSettings.from_config(cfg)
    assert settings.paths == ("a.txt", "dir")
    assert settings.cache_dir == tmp_path / "c"
    assert (settings.vocab_size, settings.tokenizer_train_chars) == (8192, 4_000_000)
    assert (settings.val_fraction, settings.text_field, settings.split) == (0.01, "text", "train")


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"source": "web"}, r"^data\.source: 'web' is not one of stdlib, files, hf$"),
        ({"paths": []}, r"^data\.paths: list at least one file or directory"),
        ({"source": "hf", "name": None}, r"^data\.name: set a dataset name"),
        ({"val_fraction": 0.0}, r"^data\.val_fraction: 0\.0 must be in \(0, 0\.5\]$"),
        ({"val_fraction": 0.6}, r"^data\.val_fraction: 0\.6 must be in \(0, 0\.5\]$"),
        ({"val_fraction": "a"}, r"^data\.val_fraction: 'a' must be a number in \(0, 0\.5\]$"),
        ({"max_documents": 0}, r"^data\.max_documents: 0 must be a positive integer$"),
        ({"vocab_size": "big"}, r"^data\.vocab_size: 'big' must be a positive integer$"),
        ({"tokenizer_train_chars": -1}, r"^data\.tokenizer_train_chars: -1 must be"),
    ],
)
def test_rejects_bad_values(make_cfg: MakeCfg, overrides: dict[str, object], message: str) -> None:
    with pytest.raises(DataError, match=message):
        DataSettings.from_config(make_cfg(**overrides))


def test_a_lone_path_string_is_one_path(make_cfg: MakeCfg) -> None:
    settings = DataSettings.from_config(make_cfg(paths="corpus.txt", data_files="d.jsonl"))
    assert settings.paths == ("corpus.txt",)
    assert settings.data_files == ("d.jsonl",)


def test_data_error_is_a_value_error() -> None:
    assert issubclass(DataError, ValueError)
