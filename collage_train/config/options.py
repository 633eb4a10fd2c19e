"""Where the config files are, which schema each option of a config group uses, and the
one line that refuses a setting the chosen option does not have.

Each ``configs/<group>/<option>.yaml`` of a group in ``config.schema.SCHEMAS`` names its schema
first in its defaults list (``- /base_llama_model``); this module reads those lists, so
an error can say which options do have a setting (``model.num_kv_heads`` belongs to
``model=llama_1b|llama_3b|...``) and the config reference can say which options a schema
serves.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

from omegaconf import OmegaConf

from collage_train.config.schema import NAMING_KEY, SCHEMAS


def config_dir() -> str:
    """The configs shipped inside the package (wheel), else the repository's ``configs/``."""
    packaged = Path(__file__).resolve().parent.parent / "configs"
    if (packaged / "config.yaml").is_file():
        return str(packaged)
    return str(Path(__file__).resolve().parent.parent.parent / "configs")


@functools.cache
def option_schemas(group: str) -> dict[str, type]:
    """``{option: schema}`` for every ``configs/<group>/*.yaml`` of a group with kinds of
    options (``config.schema.SCHEMAS``)."""
    found: dict[str, type] = {}
    for path in sorted((Path(config_dir()) / group).glob("*.yaml")):
        defaults = OmegaConf.to_container(OmegaConf.load(path)).get("defaults") or []
        names = [entry.lstrip("/") for entry in defaults if isinstance(entry, str)]
        schema = next((SCHEMAS[group][n] for n in names if n in SCHEMAS[group]), None)
        if schema is None:
            raise ValueError(f"{path} names none of the schemas of {group}: {list(SCHEMAS[group])}")
        found[path.stem] = schema
    return found


def fields_of(schema: type) -> list[str]:
    return [item.name for item in dataclasses.fields(schema)]


def options_with(group: str, key: str) -> list[str]:
    """The options of ``group`` whose schema has the setting ``key``."""
    return [option for option, schema in option_schemas(group).items() if key in fields_of(schema)]


def chosen_option(group: str, node: object) -> str:
    """The option a composed ``group`` node is (its ``name``, or ``source`` for data)."""
    return str(getattr(node, NAMING_KEY.get(group, "name"), "?"))


def not_a_setting(group: str, key: str, chosen: str) -> str | None:
    """The sentence refusing ``group.key`` for ``group=chosen`` where another option has
    that setting; None where no option has it (a misspelling: Hydra's message says so)."""
    if group not in SCHEMAS:
        return None
    others = [option for option in options_with(group, key) if option != chosen]
    if not others:
        return None
    listed = f"{group}={'|'.join(others)}"
    if len(others) == 1:
        return (
            f"{group}={chosen} has no setting {key}; only {listed} has it: remove it, or "
            f"choose {listed}"
        )
    return (
        f"{group}={chosen} has no setting {key}; only {listed} have it: remove it, or choose "
        "one of those"
    )
