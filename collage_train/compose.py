"""The job configuration composed from overrides outside Hydra's own entry point, and
Hydra's composition errors turned into one line.

``python -m collage_train`` composes its overrides here first, so that a misspelt key, a
wrongly typed value or a value outside a closed choice (``config.schema.Choice``) ends in one
``error:`` line and exit status 2 before Hydra starts the run; ``collage_train.plan`` and
``collage_train.prepare`` compose through the same function.
"""

from __future__ import annotations

import re

from hydra import compose, initialize_config_dir
from hydra.errors import HydraException
from omegaconf import DictConfig
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

from collage_train.config.options import chosen_option, config_dir, not_a_setting
from collage_train.config.schema import RENAMED_CHOICES, register_schemas
from collage_train.errors import ConfigError

# Lines of Hydra's and OmegaConf's messages that locate rather than explain.
_NOISE = re.compile(r"^(full_key|reference_type|object_type|Set the environment variable)")


def error_line(err: BaseException) -> str:
    """Hydra's (or OmegaConf's) several-line composition error as one line.

    ``Error merging override K=V`` becomes the prefix ``K=V:``, a list of available
    options is joined with commas, and the lines that only locate the error (full key,
    types, the search path, the HYDRA_FULL_ERROR hint) are dropped.
    """
    chain: list[BaseException] = [err]
    while chain[-1].__cause__ is not None:  # Hydra wraps OmegaConf's error without its text
        chain.append(chain[-1].__cause__)
    text = "\n".join(str(link).split("Config search path")[0] for link in chain)
    lines = list(dict.fromkeys(line.strip() for line in text.splitlines()))
    lines = [line for line in lines if line and not _NOISE.match(line)]
    prefix, parts, options = "", [], []
    for line in lines:
        merging = re.match(r"Error merging override (.*)", line)
        if merging:
            prefix = f"{merging.group(1)}: "
        elif line.startswith("Available options in"):
            parts.append(line.rstrip(":").replace("Available options", "options"))
        elif parts and parts[-1].startswith("options in") and " " not in line:
            options.append(line)
        else:
            parts.append(line)
    if options:
        parts = [f"{part}: {', '.join(options)}" if part.startswith("options in") else part
                 for part in parts]  # fmt: skip
    return prefix + "; ".join(parts) if parts else type(err).__name__


def check_renamed(overrides: list[str]) -> None:
    """Refuse, naming the new spelling, a choice renamed since (``config.schema.RENAMED_CHOICES``):
    ``distributed=single`` or ``comm.name=ddp``."""
    for override in overrides:
        key, _, value = override.lstrip("+~").partition("=")
        group = key.removesuffix(".name")
        new = RENAMED_CHOICES.get(group, {}).get(value)
        if new is not None:
            raise ConfigError(
                f"{key}={value} was renamed: use {key}={new} (the same behaviour, a name that "
                "says what it does)"
            )


def compose_job(overrides: list[str]) -> DictConfig:
    """The configuration ``python -m collage_train OVERRIDES`` would run with (without its
    ``hydra`` node); ConfigError with ``error_line`` when Hydra refuses the overrides, or
    naming the new spelling of a renamed choice."""
    check_renamed(overrides)
    register_schemas()
    try:
        with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
            return compose(config_name="config", overrides=overrides)
    except (HydraException, OmegaConfBaseException) as err:
        raise ConfigError(_not_the_options_setting(err, overrides) or error_line(err)) from None


def _not_the_options_setting(err: BaseException, overrides: list[str]) -> str | None:
    """``model.num_kv_heads=4: model=gpt_tiny has no setting num_kv_heads (...)`` where
    Hydra refused an override of a key that the chosen option's schema lacks and another
    option's has; None for any other error."""
    cause = err.__cause__
    if not isinstance(cause, ConfigAttributeError | ConfigKeyError):
        return None
    group, _, key = str(cause.full_key).partition(".")
    if "." in key or cause.parent_node is None:
        return None
    sentence = not_a_setting(group, key, chosen_option(group, cause.parent_node))
    if sentence is None:
        return None
    named = [o for o in overrides if o.lstrip("+~").partition("=")[0] == cause.full_key]
    return f"{named[-1] if named else cause.full_key}: {sentence}"
