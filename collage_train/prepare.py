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

from collage_train.compose import compose_job
from collage_train.data.errors import DataError
from collage_train.data.settings import DataSettings
from collage_train.data.shards import load_prepared, prepare_mixture, prepare_shards
from collage_train.errors import CollageError, ConfigError

USAGE = "usage: python -m collage_train.prepare [data=files data.paths=[...]] [data.KEY=VALUE ...]"


def prepare(overrides: list[str]) -> list[Path]:
    """Compose the run configuration from ``overrides`` and prepare its corpus (or each source
    of its ``data.mixture``); return the prepared directories."""
    try:
        cfg = compose_job(overrides)
    except ConfigError as err:
        raise DataError(f"bad override ({err}); {USAGE}") from None
    settings = DataSettings.from_config(cfg.data)
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
