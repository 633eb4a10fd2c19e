"""Defaults compose: every option of every config group, every experiment and every training
command README.md and the docs show is accepted with the other defaults (composed by Hydra,
then the start-up checks); a setting the chosen option does not have is one error line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from documented_commands import COMMANDS, Command
from omegaconf import OmegaConf

from collage_train import cli
from collage_train.comm.settings import align_to_outer_steps, check_engine
from collage_train.compose import compose_job
from collage_train.config import schema as config
from collage_train.config.options import option_schemas
from collage_train.errors import ConfigError
from collage_train.planning.batch import accumulation_steps
from collage_train.precision import strategy_for
from collage_train.run.validate import validate

CONFIGS = Path(cli.config_dir())
GROUPS = ("model", "precision", "data", "distributed", "comm", "optim", "train", "logging")


def compose_and_check(overrides: list[str], ranks: int = 2):
    """What a launch of ``ranks`` processes checks before it builds anything (one process
    unless a ZeRO engine or replicas): the composed config, validate(), the strategy record,
    the engine/comm pairing, the batch split."""
    cfg = compose_job(overrides)
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
@pytest.mark.slow
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
@pytest.mark.slow
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
    ("overrides", "line"),
    [
        (
            ["comm=diloco", "comm.topk=8"],
            "comm.topk=8: comm=diloco has no setting topk; only comm=sparseloco has it: "
            "remove it, or choose comm=sparseloco",
        ),
        (
            ["comm.sync_every=4"],
            "comm.sync_every=4: comm=every_step has no setting sync_every; only "
            "comm=diloco|sparseloco have it: remove it, or choose one of those",
        ),
        (
            ["distributed.offload_optimizer=true"],
            "distributed.offload_optimizer=true: distributed=unsharded has no setting "
            "offload_optimizer; only distributed=zero1|zero2|zero3 have it",
        ),
        (
            ["distributed.reduce_dtype=fp32"],
            "distributed.reduce_dtype=fp32: distributed=unsharded has no setting reduce_dtype",
        ),
        (
            ["distributed=zero2", "distributed.offload_param=true"],
            "distributed.offload_param=true: distributed=zero2 has no setting offload_param; "
            "only distributed=zero3 has it",
        ),
        (
            ["+distributed.deepspeed.zero_optimization={overlap_comm: true}"],
            "distributed.deepspeed: distributed=unsharded has no setting deepspeed; only "
            "distributed=zero1|zero2|zero3 have it",
        ),
        (
            ["model.num_kv_heads=4"],
            "model.num_kv_heads=4: model=gpt_tiny has no setting num_kv_heads; only "
            "model=llama_1b|llama_3b|llama_8b|llama_tiny have it",
        ),
        (
            ["+experiment=gpt_125m", "+model.rope_theta=5"],
            "model.rope_theta: model=gpt_125m has no setting rope_theta; only model=llama_1b",
        ),
        (
            ["model=opt_125m", "model.tie_embeddings=false"],
            "model.tie_embeddings=false: model=opt_125m has no setting tie_embeddings",
        ),
        (
            ["precision=collage_plus", "precision.matmul=fp8"],
            "precision.matmul=fp8: precision=collage_plus has no setting matmul; only "
            "precision=scalify|scalify_fp32_params have it",
        ),
        (
            ["data.streaming=true"],
            "data.streaming=true: data=stdlib has no setting streaming; only data=hf has it",
        ),
        (["comm=diloco", "comm.name=sparseloco"], "comm.name=sparseloco: Invalid value"),
        (["model=llama_tiny", "model.family=gpt"], "model.family=gpt: Invalid value 'gpt'"),
        (
            ["distributed=zero2", "distributed.zero_stage=3"],
            "distributed.zero_stage=3 contradicts distributed=zero2",
        ),
    ],
)
@pytest.mark.slow
def test_a_setting_the_chosen_option_does_not_have_is_one_error_line(overrides, line):
    """Each option's schema has only its own settings: Hydra refuses another option's (or
    the start-up check does, for one added with +), in one line naming the setting, the
    chosen option and the options that have it."""
    with pytest.raises(ConfigError) as error:
        compose_and_check(overrides)
    assert str(error.value).startswith(line) and "\n" not in str(error.value), error.value


@pytest.mark.slow
def test_every_option_is_typed_by_its_own_schema():
    """The schema each option's YAML names is the type of the composed group node."""
    for group in config.SCHEMAS:
        for option, schema in option_schemas(group).items():
            cfg = compose_job([f"{group}={option}"])
            assert OmegaConf.get_type(cfg[group]) is schema, (group, option)


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


@pytest.mark.parametrize("group", GROUPS)
def test_the_schema_is_the_one_source_of_defaults(group):
    """A YAML file sets only what its option changes: a value equal to its schema's default
    would be a second source that can drift from it (train.eval_every once read 50 in
    configs/ and 100 in the schema)."""
    for path in sorted((CONFIGS / group).glob("*.yaml")):
        schema = (
            option_schemas(group)[path.stem]
            if group in config.SCHEMAS
            else config.SINGLE_SCHEMAS[group]
        )
        defaults = OmegaConf.to_container(OmegaConf.structured(schema))
        values = OmegaConf.to_container(OmegaConf.load(path)) or {}
        values.pop("defaults", None)
        repeated = repeated_defaults(values, defaults, f"{group}.")
        assert not repeated, f"{path.name} repeats the schema's defaults: {repeated}"


def test_the_check_finds_a_repeated_default():
    defaults = {"a": 1, "b": {"c": None, "d": 2}, "name": "x"}
    assert repeated_defaults({"a": 1, "b": {"c": None, "d": 3}, "name": "x"}, defaults, "") == [
        "a",
        "b.c",
    ]
