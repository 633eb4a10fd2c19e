"""``python -m collage_train.checkpoint convert SRC OUT [--to LAYOUT] [--world-size N]
[--precision NAME]``: any checkpoint into another layout, or another strategy's state.

``--to universal`` (the default) writes the rank-independent layout (``universal``) that
every engine resumes from on any number of ranks; ``--to zero1|zero2|zero3 --world-size N``
and ``--to unsharded`` write an engine's own layout (``native``), loaded without
resharding. ``--precision NAME`` writes the state as strategy NAME holds it, universal
layout, and prints the switch's one line (``switch``; docs/runs.md, "Switching strategy
on resume").

SRC is a ``checkpoints/step-N`` directory or a run directory (its newest checkpoint); OUT
must not exist. SRC is checked against its CRC-32s and the restricted unpickler first and
never changed; at most one parameter's state is in memory at a time. Bad input ends in one
``error:`` line and exit status 2.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

from collage_train import checkpoint
from collage_train.checkpoint import native
from collage_train.checkpoint.full_state import open_full_state
from collage_train.checkpoint.switch import (
    SWITCHED,
    betas_of,
    check_switch,
    measure,
    switched,
)
from collage_train.checkpoint.universal import UNIVERSAL, write_universal
from collage_train.errors import (
    BAD_INPUT,
    WEIGHT_LOAD_ERRORS,
    CheckpointError,
    CollageError,
    ConfigError,
    first_line,
)
from collage_train.precision import get_strategy

LAYOUTS = (UNIVERSAL, *native.ENGINES)


def _resolve(path: Path) -> Path:
    if (path / checkpoint.META).is_file():
        return path
    latest = checkpoint.latest_checkpoint(path)
    if latest is None:
        raise CheckpointError(f"{path} is neither a checkpoint nor a run directory holding one")
    return latest


def convert(
    source: Path,
    out: Path,
    to: str = UNIVERSAL,
    world_size: int | None = None,
    precision: str | None = None,
    announce: Callable[[str], None] = print,
) -> Path:
    """Write checkpoint ``source`` (or a run's newest) into ``out`` in layout ``to``: the
    universal layout, or ``unsharded``/``zero1..3`` for ``world_size`` ranks; with
    ``precision``, as that strategy's state (universal layout), announcing the switch's
    line (``checkpoint.switch.Switch.line``)."""
    if to not in LAYOUTS:
        raise ConfigError(f"unknown layout --to {to}; choose one of: {', '.join(LAYOUTS)}")
    if precision is not None and to != UNIVERSAL:
        raise ConfigError(
            "--precision writes the universal layout, which every engine resumes from on any "
            "number of ranks; leave out --to (or convert its output with --to afterwards)"
        )
    if to == UNIVERSAL and world_size is not None:
        raise ConfigError(
            "--world-size applies to --to unsharded|zero1|zero2|zero3; the "
            "universal layout is the same on any number of ranks"
        )
    if out.exists():
        raise CheckpointError(f"{out} already exists; name a new directory")
    source = _resolve(source)
    why = checkpoint.damage(source)
    if why:
        raise CheckpointError(f"{source} is damaged: {why}")
    checkpoint.verify_checkpoint_files(source)
    if precision is not None:
        written = str(checkpoint.read_meta(source).get("precision"))
        check_switch(written, str(get_strategy(precision).name))
        return _write_switched(source, out, written, precision, announce)
    if to == UNIVERSAL:
        return write_universal(source, open_full_state(source), out)
    target = native.check_target(checkpoint.read_meta(source), to, world_size)
    return native.write_native(source, open_full_state(source), out, target)


def _write_switched(
    source: Path, out: Path, written: str, precision: str, announce: Callable[[str], None]
) -> Path:
    """The universal layout of ``source`` as strategy ``precision`` holds it."""
    state = open_full_state(source)
    config = checkpoint.read_meta(source)["config"]
    betas = (betas_of(config), betas_of(config))  # the run's betas, unchanged offline
    options = (config.get("precision"), None)  # the target's defaults: its meta says so
    switch = measure(state, written, precision, betas, options)
    changes = {
        "precision": precision,
        "holds": list(get_strategy(precision).checkpoint_holds),
        "config": {**config, "precision": {"name": precision}},
        SWITCHED: switch.record(),
    }
    state = switched(state, written, precision, betas, options)
    written_out = write_universal(source, state, out, changes)
    announce(switch.line())
    return written_out


class _Parser(argparse.ArgumentParser):
    """argparse whose usage errors are one ``error:`` line and exit status 2."""

    def error(self, message: str) -> NoReturn:
        print(f"error: {message} (see --help)", file=sys.stderr)
        raise SystemExit(BAD_INPUT)


def main(argv: list[str] | None = None) -> int:
    parser = _Parser(prog="python -m collage_train.checkpoint", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    command = commands.add_parser("convert", help="write a checkpoint in another layout")
    command.add_argument("source", type=Path, help="checkpoints/step-N or a run directory")
    command.add_argument("out", type=Path, help="new directory for the converted checkpoint")
    command.add_argument(
        "--to",
        default=UNIVERSAL,
        metavar="LAYOUT",
        help=f"{', '.join(LAYOUTS)} (default: {UNIVERSAL})",
    )
    command.add_argument(
        "--world-size", type=int, metavar="N", help="ranks to write for (zero1|zero2|zero3)"
    )
    command.add_argument(
        "--precision",
        metavar="NAME",
        help="write the state as this strategy holds it (switch strategy; universal layout)",
    )
    args = parser.parse_args(argv)
    try:
        out = convert(args.source, args.out, args.to, args.world_size, args.precision)
    except (CollageError, *WEIGHT_LOAD_ERRORS) as err:
        print(f"error: cannot convert {args.source}: {first_line(err)}", file=sys.stderr)
        return BAD_INPUT
    if args.to == UNIVERSAL:
        print(f"wrote {out} (universal layout: one safetensors file per parameter)")
    else:
        print(native.describe(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
