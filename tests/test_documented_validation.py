"""Every documented training command validates on the embedded corpus at its world size.

The commands are read from README.md, docs/*.md, docker/README.md and the usage lines of
scripts/slurm_train.sbatch: ``python -m collage_train``, ``deepspeed ... --module
collage_train``, ``torchrun ... -m collage_train`` and ``sbatch ... slurm_train.sbatch``,
in code blocks (joined across ``\\`` line ends) and in inline code. Their overrides are
composed with the real Hydra config (``compose.compose_job``); those that train on the
default data (``data=stdlib``) get the validation pass of their world size on the real
embedded corpus, prepared once per session into the shared test cache, with every rank's
batches drawn (no rank is launched, no model built).

World sizes: ``--num_gpus N``; ``--nproc_per_node N`` x ``--nnodes M``; ``sbatch --nodes N``
x the script's ``#SBATCH --gpus-per-node`` (8; ``--nodes`` defaults to its ``#SBATCH`` line);
a ``--hostfile`` launch is docs/distributed.md's example hostfile, 2 nodes x 8 slots; a
``deepspeed`` launch naming neither runs on every GPU of one node, 8. Skipped: other
tools (``collage_train.plan``, ``.export``...), Hydra's own flags (``--help``, ``--cfg``),
other data; ``...`` ends a command (more overrides). ``model.init_from`` is dropped: the
documented one is a run of the default corpus, whose tokenizer is the default one.
"""

from __future__ import annotations

import dataclasses
import re
import shlex
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from collage_train.compose import compose_job
from collage_train.data import DataBundle, build_data

REPO = Path(__file__).resolve().parent.parent
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


def test_the_commands_of_the_issue_are_found() -> None:
    """The extraction sees the launches issue 31 named: gpt_1.3b on one 8-GPU node (docker),
    gpt_6.7b on 2 nodes (hostfile) and ``sbatch --nodes 4`` (32 ranks)."""
    seen = {(c.world_size, c.overrides[0] if c.overrides else "") for c in COMMANDS}
    assert {
        (8, "+experiment=gpt_1.3b"),
        (16, "+experiment=gpt_6.7b"),
        (32, "+experiment=gpt_6.7b"),
        (1, ""),
    } <= seen, sorted(seen)
    assert any(c.where.startswith("scripts/slurm_train.sbatch") for c in COMMANDS)
    assert any(c.where.startswith("docker/README.md") for c in COMMANDS)


@pytest.fixture(scope="module")
def bundles() -> dict[tuple[int, int, int], DataBundle]:
    """Bundles of the embedded corpus by (seq_len, micro-batch, world size), rank 0."""
    return {}


@pytest.mark.parametrize("documented", COMMANDS, ids=str)
def test_documented_command_validates_on_the_embedded_corpus(
    documented: Command, cache_dir: Path, bundles: dict[tuple[int, int, int], DataBundle]
) -> None:
    cfg = compose_job([*documented.overrides, f"data.cache_dir={cache_dir}"])
    if cfg.data.source != "stdlib" or cfg.data.mixture:
        pytest.skip("not the default data")
    seq_len, micro, world = cfg.data.seq_len, cfg.train.micro_batch_size, documented.world_size
    key = (seq_len, micro, world)
    if key not in bundles:  # the training loader of the launch's rank 0 is built too
        bundles[key] = build_data(
            cfg.data, seq_len=seq_len, micro_batch_size=micro, seed=cfg.train.seed, world_size=world
        )
    bundle = bundles[key]
    plan = bundle.validation_plan(micro, cfg.train.eval_batches)
    assert plan.world_size == world and 1 <= plan.batch_size <= micro
    counted: dict[int, torch.Tensor] = {}
    for rank in range(world):
        drawn = list(dataclasses.replace(bundle, rank=rank).validation_batches(plan))
        assert len(drawn) == plan.rounds  # every rank runs as many forwards
        indices = (index for index, _ in plan.batches_of(rank))
        for index, (batch, is_counted) in zip(indices, drawn, strict=True):
            assert batch.shape == (plan.batch_size, seq_len + 1) and batch.dtype == torch.int64
            if is_counted:
                assert index not in counted
                counted[index] = batch
    assert sorted(counted) == list(range(plan.batches))
    # the windows one process evaluates, whatever the world size
    alone = dataclasses.replace(bundle, world_size=1)
    single = alone.validation_plan(micro, cfg.train.eval_batches)
    assert single.windows == plan.windows
    expected = torch.cat([batch for batch, _ in alone.validation_batches(single)])
    together = torch.cat([counted[index] for index in sorted(counted)])
    np.testing.assert_array_equal(together.numpy(), expected.numpy())
