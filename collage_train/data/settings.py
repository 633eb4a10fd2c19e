"""Read and validate the ``data`` section of the run configuration."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from omegaconf.errors import MissingMandatoryValue

from collage_train.data.errors import DataError

SOURCES = ("stdlib", "files", "hf")
# What a data.mixture entry may set; every other data setting is shared by all entries.
MIXTURE_KEYS = (
    "label", "weight", "source", "paths", "name", "config_name", "revision", "split",
    "streaming", "data_files", "text_field", "max_documents",
)  # fmt: skip
SHARED_KEYS = (
    "vocab_size", "tokenizer_train_chars", "val_fraction", "cache_dir", "tokenizer",
    "shard_tokens", "num_workers", "text_field",
)  # fmt: skip


@dataclass(frozen=True)
class MixtureEntry:
    """One source of ``data.mixture``: its label, weight and complete settings."""

    label: str
    weight: float
    settings: DataSettings


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
    mixture: tuple[MixtureEntry, ...] | None = None
    val_documents: int = 1000  # data.streaming: documents held out at the stream's head

    @classmethod
    def from_config(cls, cfg: Any) -> DataSettings:
        """Build settings from an attribute-style config (DictConfig, namespace, dataclass)."""
        mixture = _field(cfg, "mixture")
        if mixture and _field(cfg, "streaming"):
            raise DataError(
                "data.streaming: a data.mixture cannot be streamed; set data.streaming=false "
                "to prepare its sources into shards"
            )
        if mixture:
            return cls._with_mixture(cfg, mixture)
        source = str(getattr(cfg, "source", "stdlib"))
        if source not in SOURCES:
            raise DataError(f"data.source: {source!r} is not one of {', '.join(SOURCES)}")
        paths = _strings(getattr(cfg, "paths", None)) or ()
        if source == "files" and not paths:
            raise DataError("data.paths: list at least one file or directory for source 'files'")
        name = getattr(cfg, "name", None)
        if source == "hf" and not name:
            raise DataError("data.name: set a dataset name or local path for source 'hf'")
        streaming = bool(getattr(cfg, "streaming", False))
        if streaming and source != "hf":
            raise DataError(
                f"data.streaming: applies to data=hf only, not source {source!r}; local files "
                "are prepared into shards (drop data.streaming)"
            )
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
            streaming=streaming,
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
            val_documents=_positive_int("val_documents", getattr(cfg, "val_documents", 1000)),
        )

    @classmethod
    def _with_mixture(cls, cfg: Any, mixture: Any) -> DataSettings:
        """Settings whose ``mixture`` holds one complete ``DataSettings`` per entry."""
        shared = {key: _field(cfg, key) for key in SHARED_KEYS if _field(cfg, key) is not None}
        entries: list[MixtureEntry] = []
        for index, raw in enumerate(mixture):
            where = f"data.mixture[{index}]"
            if not hasattr(raw, "keys"):
                raise DataError(
                    f"{where}: {raw!r} must be a mapping like {{weight: 1, paths: [...]}}"
                )
            unknown = sorted(set(raw.keys()) - set(MIXTURE_KEYS))
            if unknown:
                raise DataError(
                    f"{where}: unknown key {unknown[0]!r}; an entry may set "
                    f"{', '.join(MIXTURE_KEYS)}"
                )
            weight = raw.get("weight")
            if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight > 0:
                raise DataError(f"{where}.weight: {weight!r} must be a positive number")
            label = str(raw.get("label") or f"source{index}")
            fields = {**shared, **{k: raw[k] for k in raw if k not in ("label", "weight")}}
            fields.setdefault("source", "hf" if "name" in fields else "files")
            try:
                settings = cls.from_config(SimpleNamespace(**fields))
            except DataError as exc:
                raise DataError(f"{where} ({label}): {exc}") from None
            entries.append(MixtureEntry(label, float(weight), settings))
            if settings.streaming:
                raise DataError(
                    f"{where} ({label}): a mixture cannot stream its sources (data.streaming); "
                    "set streaming: false to prepare them into shards"
                )
        labels = [entry.label for entry in entries]
        if len(set(labels)) != len(labels):
            raise DataError(f"data.mixture: labels must differ, got {labels}")
        first = entries[0].settings
        return replace(first, source="mixture", paths=(), mixture=tuple(entries))


def _field(cfg: Any, key: str) -> Any:
    """``cfg.key``, or None when it is absent or a mandatory value left unset (``???``)."""
    try:
        return getattr(cfg, key, None)
    except MissingMandatoryValue:
        return None


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
