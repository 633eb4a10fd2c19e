"""``python -m collage_train.checkpoint convert SRC OUT``: any checkpoint into the
rank-independent layout (``collage_train.checkpoint.universal``).

SRC is a ``checkpoints/step-N`` directory or a run directory (its newest checkpoint);
OUT must not exist. SRC is checked against its recorded sizes and CRC-32s and its pickled
files against the restricted unpickler before anything is read, and is never changed.
One parameter's state is in memory at a time. Bad input ends in one ``error:`` line
and exit status 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from collage_train import checkpoint
from collage_train.checkpoint.full_state import open_full_state
from collage_train.checkpoint.universal import write_universal
from collage_train.errors import (
    BAD_INPUT,
    WEIGHT_LOAD_ERRORS,
    CheckpointError,
    CollageError,
    first_line,
)


def _resolve(path: Path) -> Path:
    if (path / checkpoint.META).is_file():
        return path
    latest = checkpoint.latest_checkpoint(path)
    if latest is None:
        raise CheckpointError(f"{path} is neither a checkpoint nor a run directory holding one")
    return latest


def convert(source: Path, out: Path) -> Path:
    """Write checkpoint ``source`` (or a run's newest) into ``out`` in the universal layout."""
    source = _resolve(source)
    why = checkpoint.damage(source)
    if why:
        raise CheckpointError(f"{source} is damaged: {why}")
    checkpoint.verify_checkpoint_files(source)
    return write_universal(source, open_full_state(source), out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m collage_train.checkpoint", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    command = commands.add_parser("convert", help="write a checkpoint in the universal layout")
    command.add_argument("source", type=Path, help="checkpoints/step-N or a run directory")
    command.add_argument("out", type=Path, help="new directory for the universal layout")
    args = parser.parse_args(argv)
    try:
        out = convert(args.source, args.out)
    except (CollageError, *WEIGHT_LOAD_ERRORS) as err:
        print(f"error: cannot convert {args.source}: {first_line(err)}", file=sys.stderr)
        return BAD_INPUT
    print(f"wrote {out} (universal layout: one safetensors file per parameter)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
