"""Start-up check: the model's token embedding has a row for every id of its tokenizer.

``model.vocab_size`` may pad the embedding past the tokenizer (the extra rows are never
drawn: ``collage_train.model.decodable``) but never leave ids without a row. The tokenizer is
the one the run will use (``model.init_from.data_config``): ``data.tokenizer``, else
``model.init_from``'s own, else one trained with ``data.vocab_size`` pieces (exactly that
many). The embedding is ``model.vocab_size`` rows, or ``model.init_from``'s (its
``config.json``, which ``model.vocab_size`` may only repeat); a model that follows its
tokenizer (``model.vocab_size: null``, no ``model.init_from``) needs no check and no
tokenizer is opened.
"""

from __future__ import annotations

from omegaconf import DictConfig

from collage_train.data import Tokenizer
from collage_train.errors import ConfigError
from collage_train.model.init_from import data_config, embedding_rows


def check_vocabulary(cfg: DictConfig) -> None:
    """Raise ConfigError (one line) when the embedding has fewer rows than the tokenizer
    has ids, or when ``model.vocab_size`` contradicts ``model.init_from``."""
    model = cfg.model
    if model.init_from:
        rows = embedding_rows(model.init_from)
        if model.vocab_size is not None and model.vocab_size != rows:
            raise ConfigError(
                f"model.vocab_size={model.vocab_size} cannot resize the model in "
                f"model.init_from={model.init_from}, whose embedding has {rows} rows; drop "
                "model.vocab_size"
            )
    elif model.vocab_size is not None:
        rows = int(model.vocab_size)
    else:
        return
    ids, source = tokenizer_ids(cfg)
    if rows >= ids:
        return
    if model.init_from:
        raise ConfigError(
            f"the data's tokenizer ({source}) has {ids} ids but the model in "
            f"model.init_from={model.init_from} embeds {rows}; use the model's own tokenizer "
            "(leave data.tokenizer unset) or one whose vocabulary fits"
        )
    raise ConfigError(
        f"model.vocab_size={rows} is smaller than the tokenizer's {ids} ids ({source}): every "
        f"id needs an embedding row; set model.vocab_size >= {ids} (padded to a multiple of "
        "64 for faster GEMMs, if you like) or null to follow the tokenizer"
    )


def tokenizer_ids(cfg: DictConfig) -> tuple[int, str]:
    """The number of ids of the tokenizer the run will use, and the setting naming it."""
    data = data_config(cfg.data, cfg.model.init_from)
    if not data.get("tokenizer"):
        return int(data.vocab_size), f"data.vocab_size={data.vocab_size}"
    source = (
        f"data.tokenizer={data.tokenizer}"
        if cfg.data.get("tokenizer")
        else f"the tokenizer in model.init_from={cfg.model.init_from}"
    )
    return Tokenizer.load(str(data.tokenizer)).vocab_size, source
