"""Read and validate the ``data`` section of the run configuration."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from collage_train.data.errors import DataError

SOURCES = ("stdlib", "files", "hf")


@dataclass(frozen=True)
class DataSettings:
    """Validated, typed copy of the data configuration."""

    source: str
    paths: tuple[str, ...]
    name: str | None
    config_name: str | None
    split: str
    streaming: bool
    data_files: tuple[str, ...] | None
    text_field: str
    max_documents: int | None
    vocab_size: int
    tokenizer_train_chars: int
    val_fraction: float
    cache_dir: Path
    tokenizer: Path | None = None
    shard_tokens: int = 1 << 26
    num_workers: int | None = None
    revision: str | None = None

    @classmethod
    def from_config(cls, cfg: Any) -> DataSettings:
        """Build settings from an attribute-style config (DictConfig, namespace, dataclass)."""
        source = str(getattr(cfg, "source", "stdlib"))
        if source not in SOURCES:
            raise DataError(f"data.source: {source!r} is not one of {', '.join(SOURCES)}")
        paths = _strings(getattr(cfg, "paths", None)) or ()
        if source == "files" and not paths:
            raise DataError("data.paths: list at least one file or directory for source 'files'")
        name = getattr(cfg, "name", None)
        if source == "hf" and not name:
            raise DataError("data.name: set a dataset name or local path for source 'hf'")
        max_documents = getattr(cfg, "max_documents", None)
        if max_documents is not None:
            max_documents = _positive_int("max_documents", max_documents)
        val_fraction = getattr(cfg, "val_fraction", 0.01)
        if isinstance(val_fraction, bool) or not isinstance(val_fraction, (int, float)):
            raise DataError(f"data.val_fraction: {val_fraction!r} must be a number in (0, 0.5]")
        if not 0.0 < val_fraction <= 0.5:
            raise DataError(f"data.val_fraction: {val_fraction} must be in (0, 0.5]")
        config_name = getattr(cfg, "config_name", None)
        tokenizer = getattr(cfg, "tokenizer", None)
        num_workers = getattr(cfg, "num_workers", None)
        return cls(
            source=source,
            paths=paths,
            name=None if name is None else str(name),
            config_name=None if config_name is None else str(config_name),
            split=str(getattr(cfg, "split", "train")),
            streaming=bool(getattr(cfg, "streaming", False)),
            data_files=_strings(getattr(cfg, "data_files", None)),
            text_field=str(getattr(cfg, "text_field", "text")),
            max_documents=max_documents,
            vocab_size=_positive_int("vocab_size", getattr(cfg, "vocab_size", 8192)),
            tokenizer_train_chars=_positive_int(
                "tokenizer_train_chars", getattr(cfg, "tokenizer_train_chars", 4_000_000)
            ),
            val_fraction=float(val_fraction),
            cache_dir=Path(str(getattr(cfg, "cache_dir", "~/.cache/collage_train"))).expanduser(),
            tokenizer=None if tokenizer in (None, "") else Path(str(tokenizer)).expanduser(),
            shard_tokens=_positive_int("shard_tokens", getattr(cfg, "shard_tokens", 1 << 26)),
            revision=None if getattr(cfg, "revision", None) is None else str(cfg.revision),
            num_workers=None if num_workers is None else _positive_int("num_workers", num_workers),
        )


def _strings(value: Any) -> tuple[str, ...] | None:
    """Return a list-like config value (or a lone string) as a tuple of strings."""
    if value is None:
        return None
    if isinstance(value, str):
        return (value,)
    return tuple(str(item) for item in value)


def _positive_int(field: str, value: Any) -> int:
    """Return ``value`` as an int, or raise DataError if it is not a positive integer."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise DataError(f"data.{field}: {value!r} must be a positive integer")
    return value
