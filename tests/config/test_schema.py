"""Hydra composition: groups, presets, experiments, schema validation."""

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf.errors import ConfigKeyError, ValidationError
from tiny_config import compose_cfg

from collage_train.__main__ import strip_local_rank
from collage_train.config.schema import register_schemas

register_schemas()

# hidden, layers, heads, global batch, peak lr (Brown et al., 2020, Table 2.1, as the
# Collage paper trains them)
PAPER = {
    "gpt_125m": (768, 12, 12, 1024, 6e-4),
    "gpt_1.3b": (2048, 24, 16, 1024, 2e-4),
    "gpt_2.7b": (2560, 32, 32, 512, 1.6e-4),
    "gpt_6.7b": (4096, 32, 32, 256, 1.2e-4),
}


def test_default_config(monkeypatch):
    from collage_train.metrics.sinks import wandb_mode

    monkeypatch.delenv("WANDB_MODE", raising=False)
    cfg = compose_cfg()
    assert cfg.model.name == "gpt_tiny" and cfg.data.source == "stdlib"
    assert cfg.precision.name == "mixed_fp32" and cfg.distributed.name == "unsharded"
    assert cfg.logging.wandb.mode is None and wandb_mode(cfg.logging.wandb) == "offline"


@pytest.mark.parametrize("name", sorted(PAPER))
def test_experiments_carry_paper_recipe(name):
    cfg = compose_cfg(f"+experiment={name}")
    hidden, layers, heads, batch, lr = PAPER[name]
    assert (cfg.model.hidden_size, cfg.model.num_layers, cfg.model.num_heads) == (
        hidden,
        layers,
        heads,
    )
    assert cfg.train.global_batch_size == batch and cfg.optim.lr == lr
    assert cfg.optim.min_lr == pytest.approx(lr / 10)
    assert cfg.data.seq_len == 2048 and list(cfg.optim.betas) == [0.9, 0.95]
    assert cfg.optim.warmup_steps == 200 and cfg.train.max_steps == 20000
    assert cfg.model.init_std == 0.021 and cfg.optim.weight_decay == 0.1


@pytest.mark.parametrize(
    "preset,shape",
    [
        ("opt_125m", (768, 12, 12)),
        ("opt_350m", (1024, 24, 16)),
        ("opt_1.3b", (2048, 24, 32)),
        ("opt_2.7b", (2560, 32, 32)),
        ("opt_6.7b", (4096, 32, 32)),
        ("gpt_350m", (1024, 24, 16)),
    ],
)
def test_model_presets(preset, shape):
    cfg = compose_cfg(f"model={preset}")
    assert (cfg.model.hidden_size, cfg.model.num_layers, cfg.model.num_heads) == shape


def test_misspelt_key_is_rejected():
    with pytest.raises((ConfigCompositionException, ConfigKeyError)):
        compose_cfg("train.max_step=5")


def test_wrong_type_is_rejected():
    with pytest.raises((ConfigCompositionException, ValidationError)):
        compose_cfg("train.max_steps=many")


def test_unknown_group_option_is_rejected():
    with pytest.raises(ConfigCompositionException):
        compose_cfg("precision=fp8")


def choice_fields() -> list[tuple[str, type, tuple[str, ...]]]:
    """Every field of every schema whose type is a closed choice (or a list of one), with
    the group option that selects that schema."""
    import dataclasses
    import typing

    from collage_train.config import schema as config
    from collage_train.config.options import option_schemas

    found = []

    def walk(schema: type, prefix: str, select: tuple[str, ...]) -> None:
        hints = typing.get_type_hints(schema)
        for item in dataclasses.fields(schema):
            kind = hints[item.name]
            if dataclasses.is_dataclass(kind):
                walk(kind, f"{prefix}{item.name}.", select)
                continue
            args = [a for a in typing.get_args(kind) if a is not type(None)] or [kind]
            args = [typing.get_args(a)[0] if typing.get_args(a) else a for a in args]  # list[X]
            if isinstance(args[0], type) and issubclass(args[0], config.Choice):
                found.append((f"{prefix}{item.name}", args[0], select))

    for group in config.SCHEMAS:
        schemas = option_schemas(group)
        for schema in dict.fromkeys(schemas.values()):
            option = next(name for name, used in schemas.items() if used is schema)
            walk(schema, f"{group}.", (f"{group}={option}",))
    for group, schema in config.SINGLE_SCHEMAS.items():
        walk(schema, f"{group}.", ())
    return found


def test_the_schema_declares_its_closed_choices():
    keys = {key for key, _, _ in choice_fields()}
    expected = {
        *("model.family", "optim.kernel", "train.device", "train.cpu_bf16_gemm"),
        *("logging.console", "logging.wandb.mode", "distributed.name", "comm.name"),
        *("distributed.reduce_dtype", "precision.matmul", "precision.rescale"),
    }
    assert expected <= keys


@pytest.mark.parametrize(
    "key,choice,select", choice_fields(), ids=[":".join((*s, k)) for k, _, s in choice_fields()]
)
@pytest.mark.slow
def test_a_value_outside_a_closed_choice_is_one_line_naming_the_choices(key, choice, select):
    from collage_train.compose import compose_job
    from collage_train.errors import ConfigError

    value = "[nonsense]" if key == "precision.rescale" else "nonsense"
    with pytest.raises(ConfigError) as refused:
        compose_job([*select, f"{key}={value}"])
    message = str(refused.value)
    assert "\n" not in message and message.startswith(f"{key}={value}: "), message
    assert f"expected one of [{', '.join(member.value for member in choice)}]" in message


def test_a_choice_reads_and_serialises_as_its_plain_value():
    import json

    from omegaconf import OmegaConf

    cfg = compose_cfg("logging.console=plain", "train.device=cpu")
    console = cfg.logging.console
    assert console == "plain" and f"{console}" == "plain" and str(console) == "plain"
    assert {"plain": 1}[console] == 1 and console in ("rich", "plain")
    saved = json.loads(json.dumps(OmegaConf.to_container(cfg, resolve=True)))
    assert saved["logging"]["console"] == "plain" and saved["train"]["device"] == "cpu"


def test_hydra_errors_become_one_line():
    from collage_train.compose import compose_job
    from collage_train.errors import ConfigError

    cases = {
        "train.max_steps=many": "train.max_steps=many: Value 'many' of type 'str' could not be "
        "converted to Integer",
        "train.max_stepz=3": "Could not override 'train.max_stepz'.; To append to your config "
        "use +train.max_stepz=3; Key 'max_stepz' not in 'TrainConfig'",
        "precision=fp4": "In 'config': Could not find 'precision/fp4'; options in 'precision': "
        "adamw_8bit, bf16, bf16_kahan, bf16_moments, bf16_sr, collage_8bit, collage_light",
    }
    for override, expected in cases.items():
        with pytest.raises(ConfigError) as refused:
            compose_job([override])
        assert str(refused.value).startswith(expected), str(refused.value)


def test_the_entry_point_refuses_bad_overrides_in_one_line_with_exit_2(capsys):
    from collage_train.__main__ import check_overrides

    with pytest.raises(SystemExit) as refused:
        check_overrides(["train.cpu_bf16_gemm=fast"])
    assert refused.value.code == 2
    assert capsys.readouterr().err == (
        "error: train.cpu_bf16_gemm=fast: Invalid value 'fast', expected one of "
        "[auto, native, fp32]\n"
    )
    check_overrides(["train.max_steps=3", "hydra.run.dir=/tmp/x"])  # a good launch passes
    check_overrides(["--cfg", "job", "train.max_steps=oops"])  # Hydra's flags: Hydra reports


def test_strip_local_rank(monkeypatch):
    # setenv first records the variable's state, so that it is restored after the test:
    # a LOCAL_RANK left behind makes later in-process runs wait for another rank's data
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.delenv("LOCAL_RANK")
    assert strip_local_rank(["prog", "--local_rank=3", "model=gpt_tiny"]) == [
        "prog",
        "model=gpt_tiny",
    ]
    import os

    assert os.environ["LOCAL_RANK"] == "3"
    assert strip_local_rank(["prog", "--local_rank", "1", "x=1"]) == ["prog", "x=1"]


@pytest.mark.parametrize(
    "override,new",
    [
        ("distributed=single", "distributed=unsharded"),
        ("comm=ddp", "comm=every_step"),
        ("comm.name=ddp", "comm.name=every_step"),
        ("distributed.name=single", "distributed.name=unsharded"),
    ],
)
def test_a_renamed_choice_names_its_new_spelling_in_one_line(override, new, capsys):
    from collage_train.__main__ import check_overrides

    with pytest.raises(SystemExit) as refused:
        check_overrides(["train.max_steps=3", override])
    assert refused.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {override} was renamed: use {new} ") and err.count("\n") == 1
