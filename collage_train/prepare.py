"""``python -m collage_train.prepare <data overrides>``: tokenize a corpus into shards.

Takes the same Hydra overrides as training (``data=files data.paths=[a/,b.jsonl]``,
``data.tokenizer=PATH``, ``data.num_workers=N``, ``data.cache_dir=DIR``...) and prepares
exactly the cache entry (one per source of a ``data.mixture``) that a training run with
those settings will reuse: parallel over
every core, resumable after a crash (run it again), with a progress line. Run it once per
node (a node-local ``data.cache_dir``) or once on a shared file system. Prints the entry's
directory and counts; bad input ends in one ``error:`` line and exit status 2.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.errors import HydraException
from omegaconf.errors import OmegaConfBaseException

from collage_train.config import register_schemas
from collage_train.data.errors import DataError
from collage_train.data.settings import DataSettings
from collage_train.data.shards import load_prepared, prepare_mixture, prepare_shards
from collage_train.errors import CollageError

USAGE = "usage: python -m collage_train.prepare [data=files data.paths=[...]] [data.KEY=VALUE ...]"


def config_dir() -> str:
    """The configs shipped inside the package (wheel), else the repository's ``configs/``."""
    packaged = Path(__file__).resolve().parent / "configs"
    if (packaged / "config.yaml").is_file():
        return str(packaged)
    return str(Path(__file__).resolve().parent.parent / "configs")


def prepare(overrides: list[str]) -> list[Path]:
    """Compose the run configuration from ``overrides`` and prepare its corpus (or each source
    of its ``data.mixture``); return the prepared directories."""
    register_schemas()
    try:
        with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
            cfg = compose(config_name="config", overrides=overrides)
        data = cfg.data
        settings = DataSettings.from_config(data)
    except (HydraException, OmegaConfBaseException) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise DataError(f"bad override ({first}); {USAGE}") from None
    if settings.streaming:
        raise DataError(
            "data.streaming: a stream is not prepared, training reads and tokenizes it on the "
            "fly; drop data.streaming to prepare the dataset into shards"
        )
    if settings.mixture is not None:
        return prepare_mixture(settings)
    return [prepare_shards(settings)]


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if any(arg in ("-h", "--help") for arg in args):
        print(__doc__.strip() + "\n\n" + USAGE)
        return 0
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        prepared = [(directory, *load_prepared(directory)) for directory in prepare(args)]
    except CollageError as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        return 2
    for directory, manifest, tokenizer in prepared:
        print(
            f"prepared {manifest['total_tokens']} tokens of {manifest['num_documents']} "
            f"documents in {manifest['num_shards']} shards ({tokenizer.kind} tokenizer, "
            f"vocabulary {tokenizer.vocab_size}) in {directory}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
