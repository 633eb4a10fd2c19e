"""The configuration reference is generated from the schema's attribute docstrings:
docs/config.md is current, every setting is documented, and ``--help`` shows the chosen
options' settings with their values and documentation."""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path

from hydra import compose, initialize_config_dir

from collage_train.config import schema as config
from collage_train.config.options import config_dir
from collage_train.config.reference import field_docs, main, reference, register_help_resolver

DOC = Path(__file__).resolve().parent.parent.parent / "docs" / "config.md"


def test_docs_config_md_is_the_generated_reference():
    assert DOC.read_text() == reference(), (
        "docs/config.md is stale: python -m collage_train.config.reference > docs/config.md"
    )


def all_schemas() -> list[type]:
    found: list[type] = []

    def add(schema: type) -> None:
        found.append(schema)
        for kind in typing.get_type_hints(schema).values():
            if dataclasses.is_dataclass(kind):
                add(kind)

    for schemas in config.SCHEMAS.values():
        for schema in schemas.values():
            add(schema)
    for schema in config.SINGLE_SCHEMAS.values():
        add(schema)
    return found


def test_every_setting_of_every_schema_has_its_documentation():
    schemas = all_schemas()
    assert config.GuardConfig in schemas and config.WandbConfig in schemas
    for schema in schemas:
        docs = field_docs(schema)
        missing = [f.name for f in dataclasses.fields(schema) if not docs.get(f.name)]
        assert not missing, f"{schema.__name__} documents none of {missing}"


def test_the_reference_shows_each_options_own_settings():
    text = reference(("model", "comm"))
    llama = text.index("### model=llama_1b|llama_3b|llama_8b|llama_tiny")
    assert text.index("| `model.num_kv_heads` | int or null | null | Key/value heads") > llama
    sparse = text.index("### comm=sparseloco")
    assert text.index("| `comm.topk` | int | 64 | Entries kept per chunk") > sparse
    assert "comm.topk" not in text[text.index("### comm=diloco") : sparse]


def test_help_shows_the_chosen_options_settings_with_values_and_docs():
    """The help template of configs/config.yaml, resolved as ``--help`` resolves it."""
    register_help_resolver()
    with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
        cfg = compose(
            config_name="config",
            overrides=["model=llama_tiny", "comm=sparseloco"],
            return_hydra_config=True,
        )
    text = cfg.hydra.help.template
    assert "  model.num_kv_heads=2\n      Key/value heads of grouped-query attention" in text
    assert "  comm.topk=64\n      Entries kept per chunk" in text
    assert "distributed (UnshardedConfig)" in text and "offload_optimizer" not in text


def test_an_unknown_group_is_one_error_line(capsys):
    assert main(["modle"]) == 2
    assert capsys.readouterr().err == (
        "error: no config group 'modle'; choose among model, data, precision, optim, train, "
        "logging, distributed, comm, metrics, plan, eval\n"
    )
    assert main(["plan"]) == 0 and "`plan.gpu_mem_gb` | float | 80.0" in capsys.readouterr().out
