"""The training commands the documentation shows, found and parsed with their world sizes.

Read from README.md, docs/*.md, docker/README.md and the usage lines of
scripts/slurm_train.sbatch (tests/run/test_documented_validation.py validates each one;
tests/test_config_compose.py composes README's).
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


DOCUMENTS = sorted(
    [REPO / "README.md", REPO / "docker" / "README.md", *(REPO / "docs").glob("*.md")]
)


SBATCH = REPO / "scripts" / "slurm_train.sbatch"


GPUS_PER_NODE = int(re.findall(r"#SBATCH --gpus-per-node=(\d+)", SBATCH.read_text())[0])


SBATCH_NODES = int(re.findall(r"#SBATCH --nodes=(\d+)", SBATCH.read_text())[0])


HOSTFILE_NODES = 2  # docs/distributed.md's example hostfile: node-a and node-b, 8 slots each


LAUNCHER = re.compile(r"(?:^|\s)(\S*python3?|deepspeed|torchrun|sbatch)\s")


@dataclass(frozen=True)
class Command:
    """A documented training launch: where it is, its world size and its overrides."""

    where: str
    world_size: int
    overrides: tuple[str, ...]

    def __str__(self) -> str:
        return f"{self.where} W={self.world_size} {' '.join(self.overrides)}"


def snippets(path: Path) -> Iterator[tuple[int, str]]:
    """(line, text) of each code-block line (``\\`` continuations joined) and each inline
    code span (a paragraph's lines joined) of a Markdown file."""
    lines = path.read_text().splitlines()
    fenced, paragraph, start = False, [], 0
    index = 0
    while index < len(lines):
        line = lines[index]
        if line.lstrip().startswith("```"):
            fenced = not fenced
            yield from spans(paragraph, start)
            paragraph = []
        elif fenced:
            first = index
            while line.endswith("\\") and index + 1 < len(lines):
                index += 1
                line = line[:-1] + " " + lines[index]
            yield first + 1, line
        elif line.strip():
            if not paragraph:
                start = index + 1
            paragraph.append(line)
        else:
            yield from spans(paragraph, start)
            paragraph = []
        index += 1
    yield from spans(paragraph, start)


def spans(paragraph: list[str], start: int) -> Iterator[tuple[int, str]]:
    for span in re.findall(r"`([^`]+)`", " ".join(paragraph)):
        yield start, span


def usage_lines(path: Path) -> Iterator[tuple[int, str]]:
    """The commands in the script's header comment (``#   sbatch ...``)."""
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.startswith("#   "):
            yield number, line[1:]


def parse(where: str, text: str) -> list[Command] | None:
    """The training launch in ``text`` (one per job of a sweep), None when it holds none
    (or another tool's)."""
    match = LAUNCHER.search(" " + text + " ")
    if match is None:
        return None
    try:
        tokens = shlex.split(text[max(match.start(1) - 1, 0) :], comments=True)
    except ValueError:
        return None
    launcher = Path(tokens[0]).name
    if launcher == "sbatch":
        script = next((i for i, t in enumerate(tokens) if t.endswith("slurm_train.sbatch")), None)
        if script is None:
            return None
        nodes = int(flag(tokens[:script], "--nodes") or SBATCH_NODES)
        return command(where, nodes * GPUS_PER_NODE, tokens[script + 1 :])
    module = next(
        (i for i, t in enumerate(tokens) if t in ("-m", "--module") and i + 1 < len(tokens)),
        None,
    )
    if module is None or tokens[module + 1] != "collage_train":
        return None  # another tool, or no module at all
    launch, args = tokens[:module], tokens[module + 2 :]
    if launcher == "deepspeed":
        if flag(launch, "--num_gpus"):
            world = int(flag(launch, "--num_gpus"))
        elif flag(launch, "--hostfile"):
            world = HOSTFILE_NODES * GPUS_PER_NODE
        else:
            world = GPUS_PER_NODE
    elif launcher == "torchrun":
        world = int(flag(launch, "--nproc_per_node") or 1) * int(flag(launch, "--nnodes") or 1)
    else:
        world = 1
    return command(where, world, args)


def flag(tokens: list[str], name: str) -> str | None:
    """The value of ``--name V`` or ``--name=V`` in ``tokens``."""
    for index, token in enumerate(tokens):
        if token == name and index + 1 < len(tokens):
            return tokens[index + 1]
        if token.startswith(name + "="):
            return token.split("=", 1)[1]
    return None


def command(where: str, world_size: int, args: list[str]) -> list[Command] | None:
    """The launch's overrides; a sweep (``-m``, ``key=a,b``) gives one command per job."""
    overrides, sweep = [], False
    for arg in args:
        if arg == "...":
            break  # "more overrides"
        if arg in ("-m", "--multirun"):
            sweep = True
            continue
        if arg.startswith("-"):
            return None  # Hydra's own flags (--help, --cfg job): not a training launch
        assert "=" in arg, f"{where}: {arg!r} is not an override"
        if not arg.startswith(("hydra.", "model.init_from=")):
            overrides.append(arg)
    jobs: list[tuple[str, ...]] = [()]
    for override in overrides:
        key, _, value = override.partition("=")
        values = value.split(",") if sweep and "[" not in value else [value]
        jobs = [(*job, f"{key}={v}") for job in jobs for v in values]
    return [Command(where, world_size, job) for job in jobs]


def documented_commands() -> list[Command]:
    found: list[Command] = []
    sources = [(path, snippets(path)) for path in DOCUMENTS] + [(SBATCH, usage_lines(SBATCH))]
    for path, texts in sources:
        for line, text in texts:
            for parsed in parse(f"{path.relative_to(REPO)}:{line}", text) or []:
                if parsed not in found:
                    found.append(parsed)
    return found


COMMANDS = documented_commands()
