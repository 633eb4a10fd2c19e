"""Defaults compose: every option of every config group, every experiment and every training
command README.md and the docs show is accepted with the other defaults (composed by Hydra,
then the start-up checks); a setting the chosen option would ignore is one error line."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from documented_commands import COMMANDS, Command
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from collage_train import cli, config
from collage_train.batch import accumulation_steps
from collage_train.comm.settings import align_to_outer_steps, check_engine
from collage_train.errors import ConfigError
from collage_train.precision import strategy_for
from collage_train.run.validate import validate

CONFIGS = Path(cli.config_dir())
GROUPS = ("model", "precision", "data", "distributed", "comm", "optim", "train", "logging")


def compose_and_check(overrides: list[str], ranks: int = 2):
    """What a launch of ``ranks`` processes checks before it builds anything (one process
    unless a ZeRO engine or replicas): the composed config, validate(), the strategy record,
    the engine/comm pairing, the batch split."""
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides)
    validate(cfg)
    strategy_for(cfg.precision)
    check_engine(cfg.comm, cfg.distributed.name)
    single = cfg.distributed.name == "unsharded" and cfg.comm.name == "every_step"
    accumulation_steps(
        cfg.train.global_batch_size, cfg.train.micro_batch_size, 1 if single else ranks
    )
    align_to_outer_steps(cfg.comm, OmegaConf.create(OmegaConf.to_container(cfg.train)))
    return cfg


def group_options() -> list[str]:
    options = [
        f"{group}={path.stem}"
        for group in GROUPS
        for path in sorted((CONFIGS / group).glob("*.yaml"))
    ]
    options += [f"+experiment={p.stem}" for p in sorted((CONFIGS / "experiment").glob("*.yaml"))]
    return options


@pytest.mark.parametrize("override", group_options())
def test_every_group_option_works_with_the_other_defaults(override):
    cfg = compose_and_check([override])
    group, _, option = override.lstrip("+").partition("=")
    if group in ("model", "precision", "distributed", "comm"):
        assert cfg[group].name == option


def readme_commands() -> list[Command]:
    """The training launches README.md shows (tests/run/test_documented_validation.py
    finds them)."""
    return [c for c in COMMANDS if c.where.startswith("README.md:")]


def test_the_readme_shows_training_commands():
    """The front page launches on a CPU or one GPU, on one node of 8 GPUs, on several nodes
    (a hostfile or Slurm: more than 8 ranks) and as SparseLoCo replicas."""
    commands = readme_commands()
    assert len(commands) >= 5, commands
    launches = {(c.world_size, c.overrides) for c in commands}
    assert (2, ("comm=sparseloco", "comm.sync_every=10")) in launches
    sizes = {c.world_size for c in commands}
    assert {1, 8} <= sizes and max(sizes) > 8, sorted(sizes)


@pytest.mark.parametrize("documented", COMMANDS, ids=str)
def test_every_documented_training_command_composes(documented: Command):
    """Every launch of README.md, docs/*.md, docker/README.md and the Slurm script's usage
    passes the start-up checks at its world size."""
    compose_and_check(list(documented.overrides), documented.world_size)


def test_sparseloco_with_its_own_sync_every_needs_nothing_else():
    """The README's kind of example: only comm.sync_every changes; eval_every (default 100)
    and max_steps follow it instead of refusing the run."""
    cfg = compose_and_check(["comm=sparseloco", "comm.sync_every=7"])
    notes = align_to_outer_steps(cfg.comm, cfg.train)
    assert cfg.train.eval_every % 7 == 0 and cfg.train.max_steps % 7 == 0
    assert len(notes) == 2


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["comm=diloco", "comm.topk=8"], "comm.topk=8 applies to comm=sparseloco only"),
        (["comm.sync_every=4"], "comm.sync_every=4 applies to comm=diloco|sparseloco only"),
        (
            ["distributed.offload_optimizer=true"],
            "distributed.offload_optimizer=true applies to distributed=zero1|zero2|zero3 only",
        ),
        (
            ["distributed=zero2", "distributed.offload_param=true"],
            "distributed.offload_param=true applies to distributed=zero3 only",
        ),
        (
            ["+distributed.deepspeed.zero_optimization={overlap_comm: true}"],
            "distributed.deepspeed={'zero_optimization': {'overlap_comm': True}} applies to",
        ),
        (
            ["distributed=zero2", "distributed.zero_stage=3"],
            "distributed.zero_stage=3 contradicts distributed=zero2",
        ),
    ],
)
def test_a_setting_the_choice_would_ignore_is_one_error(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)) as error:
        compose_and_check(overrides)
    assert "\n" not in str(error.value)


SCHEMAS = {
    "model": config.ModelConfig,
    "data": config.DataConfig,
    "precision": config.PrecisionConfig,
    "optim": config.OptimConfig,
    "train": config.TrainConfig,
    "logging": config.LoggingConfig,
    "distributed": config.DistributedConfig,
    "comm": config.CommConfig,
}
NAMING_KEYS = ("name", "family", "source")  # say which option a file is, default or not


def repeated_defaults(node: Any, defaults: Any, prefix: str) -> list[str]:
    found = []
    for key, value in node.items():
        default = defaults.get(key) if isinstance(defaults, dict) else None
        if isinstance(value, dict) and isinstance(default, dict) and value:
            found += repeated_defaults(value, default, f"{prefix}{key}.")
        elif key not in NAMING_KEYS and key in defaults and value == default:
            found.append(f"{prefix}{key}")
    return found


@pytest.mark.parametrize("group", sorted(SCHEMAS))
def test_the_schema_is_the_one_source_of_defaults(group):
    """A YAML file sets only what its option changes: a value equal to the schema's default
    would be a second source that can drift from it (train.eval_every once read 50 in
    configs/ and 100 in the schema)."""
    defaults = OmegaConf.to_container(OmegaConf.structured(SCHEMAS[group]))
    for path in sorted((CONFIGS / group).glob("*.yaml")):
        values = OmegaConf.to_container(OmegaConf.load(path)) or {}
        repeated = repeated_defaults(values, defaults, f"{group}.")
        assert not repeated, f"{path.name} repeats the schema's defaults: {repeated}"


def test_the_check_finds_a_repeated_default():
    defaults = {"a": 1, "b": {"c": None, "d": 2}, "name": "x"}
    assert repeated_defaults({"a": 1, "b": {"c": None, "d": 3}, "name": "x"}, defaults, "") == [
        "a",
        "b.c",
    ]
