"""What the benchmark scripts share: their common flags, the markdown table they print and
record, and the record itself.

A script builds its parser on ``flags(...)`` (``--json``, ``--record``/``--no-record`` and
whichever of ``--model``, ``--steps``, ``--repeats``, ``--seq-len``, ``--device`` and the
Hydra overrides it takes, with its own defaults), prints its rows with ``table`` and hands
the text to ``publish``, which prints it, writes ``--json`` and appends a dated entry to
docs/results-history.md, the log that docs/RESULTS.md's current entries are copied from
(docs/development.md).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
from collections.abc import Collection, Iterable, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "docs" / "RESULTS.md"
HISTORY = REPO / "docs" / "results-history.md"

# Every precision strategy (configs/precision/), in the order tables list them.
STRATEGIES = (
    "fp32",
    "mixed_fp32",
    "split_fp32",
    "bf16_moments",
    "bf16",
    "bf16_sr",
    "bf16_kahan",
    "adamw_8bit",
    "collage_light",
    "collage_plus",
    "collage_8bit",
    "scalify",
    "scalify_fp32_params",
)

# The flags a script may take, with their help; the script gives the default.
NAMED_FLAGS = {
    "model": {"help": "model preset (configs/model/)"},
    "steps": {"type": int, "help": "training (or timed) steps per run"},
    "repeats": {"type": int, "help": "runs of each configuration, in rotating order"},
    "seq_len": {"type": int, "help": "sequence length (data.seq_len)"},
    "device": {"help": "cpu or cuda (auto: cuda where there is one)"},
}


def flags(*, json: bool = True, record: bool = True, **named: Any) -> argparse.ArgumentParser:
    """The common flags, as a parent parser (``ArgumentParser(parents=[flags(...)])``).

    ``json``: ``--json PATH``, also write the rows as JSON. ``record``: ``--record`` (the
    default) appends the table to docs/results-history.md, ``--no-record`` only prints
    it. Each keyword of ``named`` adds that flag with the value as its default, or with
    ``(default, help)``: ``model``, ``steps``, ``repeats``, ``seq_len``, ``device``;
    ``overrides=True`` adds the positional extra Hydra overrides for every run and
    ``worker=True`` the hidden ``--worker-out`` of a launched rank (``runs.launch_ranks``).
    """
    parent = argparse.ArgumentParser(add_help=False)
    if json:
        parent.add_argument("--json", type=Path, help="also write the rows as JSON here")
    if record:
        parent.add_argument(
            "--record",
            action=argparse.BooleanOptionalAction,
            default=True,
            help="append the table to docs/results-history.md (default: on)",
        )
        # the spelling of the commands in docs/results-history.md before --no-record
        parent.add_argument(
            "--no-append", dest="record", action="store_false", help=argparse.SUPPRESS
        )
    if named.pop("worker", False):
        parent.add_argument("--worker-out", type=Path, help=argparse.SUPPRESS)
    overrides = named.pop("overrides", False)
    for name, value in named.items():
        default, help_text = value if isinstance(value, tuple) else (value, None)
        options = dict(NAMED_FLAGS[name])
        if help_text:
            options["help"] = help_text
        parent.add_argument("--" + name.replace("_", "-"), default=default, **options)
    if overrides:
        parent.add_argument("overrides", nargs="*", help="extra Hydra overrides for every run")
    return parent


def parser(doc: str, **common: Any) -> argparse.ArgumentParser:
    """A script's parser: its docstring's first line as the description, ``flags(**common)``."""
    return argparse.ArgumentParser(description=doc.split("\n\n")[0], parents=[flags(**common)])


def table(
    header: Sequence[str], rows: Iterable[Sequence[object]], *, right: Collection[int] = ()
) -> str:
    """A markdown table: ``header``, then one line per row of cells (``right``: the indices
    of right-aligned columns). A row may carry cells past the header's (a note)."""
    rule = "|".join("---:" if index in right else "---" for index in range(len(header)))
    lines = [f"| {' | '.join(header)} |", f"|{rule}|"]
    lines += [f"| {' | '.join(str(cell) for cell in row)} |" for row in rows]
    return "\n".join(lines)


def ratio(value: float | None, base: float | None) -> str:
    """``value / base`` to two places, or ``-`` where either is missing."""
    return f"{value / base:.2f}" if value and base else "-"


def write_json(path: Path | None, data: object) -> None:
    if path is not None:
        path.write_text(json.dumps(data, indent=2) + "\n")


def publish(
    args: argparse.Namespace, text: str, data: object, title: str, description: str
) -> None:
    """Print ``text``, write ``data`` to ``--json`` and, with ``--record``, append
    ``text`` under ``title`` and ``description`` to docs/results-history.md."""
    print(text)
    write_json(getattr(args, "json", None), data)
    if getattr(args, "record", False):
        append_results(title, description, text)


def default_device() -> str:
    """cuda where torch sees a GPU, else cpu."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def machine() -> str:
    """The device a benchmark ran on, in words."""
    import torch

    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name()}, torch {torch.__version__}"
    return f"{os.cpu_count()}-core {platform.machine()} CPU, torch {torch.__version__}"


def append_results(title: str, description: str, text: str) -> None:
    """Append a dated entry, with the command that produced it and the machine, to the
    dated log docs/results-history.md, and say which section of docs/RESULTS.md (the
    current numbers, curated by hand) to update with it."""
    script = Path(sys.argv[0]).resolve().relative_to(REPO).as_posix()
    command = "python " + " ".join([script, *sys.argv[1:]])
    entry = (
        f"\n## {title} ({datetime.date.today()})\n\n"
        f"Command: `{command}`. Machine: {machine()}. {description}\n\n{text}\n"
    )
    with HISTORY.open("a") as handle:
        handle.write(entry)
    print(
        f"appended to {HISTORY.relative_to(REPO)}: if it is the newest run of its measure, "
        f"update the matching section of {RESULTS.relative_to(REPO)} with it ({title!r})"
    )
