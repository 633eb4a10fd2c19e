"""Start-up checks of the composed configuration, before anything is prepared or written.

Hydra's schema (``collage_train/config/schema.py``: one per kind of option) already refuses
misspelt keys, keys the chosen option does not have and wrongly typed values; this module
refuses what it lets through: keys added with ``+`` under the project's own groups, a
ZeRO stage other than the engine's name says, replicas (DiLoCo, SparseLoCo) on a sharded
engine or with comm settings out of range, values of the right type that cannot work
(a negative learning rate, a cadence of 0 steps, betas outside [0, 1), a loss block size
that is neither ``auto``, ``off`` nor a count, or a count for Scalify, a non-deterministic
CUBLAS_WORKSPACE_CONFIG under ``train.deterministic``), ``model.extra`` keys that the
transformers config does not know or that the model builder already sets, an embedding
with fewer rows than the tokenizer has ids (``run.vocabulary``), and W&B ``online``
without credentials (which would otherwise hang in ``wandb.init``). ``validate`` runs once
per launch, in the Hydra callback that also locks the run directory
(``collage_train/run/directory.py``): a refused run has prepared no data, touched no run directory.
"""

from __future__ import annotations

import dataclasses
import difflib
import netrc
import os
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from omegaconf import DictConfig, OmegaConf

from collage_train.comm.settings import check_engine
from collage_train.config.options import chosen_option, not_a_setting
from collage_train.errors import ConfigError
from collage_train.metrics.sinks import wandb_mode
from collage_train.model.build import check_model_extra
from collage_train.model.loss_settings import resolve_chunk_tokens
from collage_train.precision import get_strategy
from collage_train.run import branch
from collage_train.run.determinism import check_cublas_config
from collage_train.run.vocabulary import check_vocabulary


def validate(cfg: DictConfig) -> None:
    """Raise ConfigError, with one actionable sentence, for the first setting that cannot work."""
    check_known_keys(cfg)
    check_optim(cfg.optim)
    check_train(cfg.train)
    branch.check_settings(cfg)
    check_loss_chunk(cfg)
    check_positive("logging.log_every", cfg.logging.log_every, "step")
    if cfg.logging.sample_tokens < 0:
        raise ConfigError(
            f"logging.sample_tokens must be 0 (no sample) or more, got {cfg.logging.sample_tokens}"
        )
    if cfg.metrics.edq_every is not None and cfg.metrics.edq_every < 0:
        raise ConfigError(f"metrics.edq_every must be 0 (off) or more, got {cfg.metrics.edq_every}")
    check_model_extra(cfg.model)
    check_vocabulary(cfg)
    check_zero_stage(cfg)
    check_engine(cfg.comm, str(cfg.distributed.name))  # and again where the engine is built
    check_wandb(cfg.logging.wandb)
    check_eval(cfg)


def check_zero_stage(cfg: DictConfig) -> None:
    """Refuse a ZeRO stage other than the engine's name says (``distributed=zero2
    distributed.zero_stage=3``)."""
    name, stage = str(cfg.distributed.name), getattr(cfg.distributed, "zero_stage", None)
    if name.startswith("zero") and stage is not None and f"zero{stage}" != name:
        raise ConfigError(
            f"distributed.zero_stage={stage} contradicts distributed={name}: the stage follows "
            f"from the engine's name; choose distributed=zero{stage} and drop zero_stage"
        )


def check_known_keys(cfg: DictConfig) -> None:
    """Refuse keys the chosen options' schemas do not define (Hydra admits them when added
    with ``+``), naming the options that have such a key where one does."""
    unknown = _unknown_keys(cfg, "")
    if not unknown:
        return
    path, known, node = unknown[0]
    group, _, key = path.rpartition(".")
    sentence = not_a_setting(group, key, chosen_option(group, node)) if group else None
    if sentence is not None:
        raise ConfigError(f"{path}: {sentence}")
    guess = difflib.get_close_matches(key, known, n=1)
    hint = f" (did you mean {guess[0]}?)" if guess else ""
    raise ConfigError(
        f"unknown setting {path}{hint}: {group or 'the root config'} has no key {key!r}; remove "
        "it or fix its spelling (python -m collage_train --cfg job prints every setting)"
    )


def _unknown_keys(node: DictConfig, prefix: str) -> list[tuple[str, list[str], DictConfig]]:
    """(dotted key, the keys its node's schema has, that node) for each key of ``node`` and
    of its schema-typed children that their schema (the node's runtime type) lacks."""
    schema = OmegaConf.get_type(node)
    if not dataclasses.is_dataclass(schema):
        return []  # free-form dict fields (model.extra, distributed.deepspeed)
    names = [field.name for field in dataclasses.fields(schema)]
    found: list[tuple[str, list[str], DictConfig]] = []
    for key in node:
        path = f"{prefix}{key}"
        if key == "hydra" and not prefix:
            continue  # Hydra's own node, present in the config callbacks see
        if key not in names:
            found.append((path, names, node))
            continue
        child = node._get_node(key)
        if isinstance(child, DictConfig):
            found += _unknown_keys(child, f"{path}.")
    return found


def check_positive(name: str, value: Any, unit: str) -> None:
    if value is None or value < 1:
        raise ConfigError(f"{name} must be at least 1 {unit}, got {value}")


def check_optim(optim: DictConfig) -> None:
    """AdamW's hyper-parameters: each in the range where the update is defined."""
    for key in ("lr", "min_lr", "weight_decay", "warmup_steps", "grad_clip"):
        if optim[key] < 0:
            raise ConfigError(f"optim.{key} must not be negative, got {optim[key]}")
    if optim.eps <= 0:
        raise ConfigError(
            f"optim.eps must be positive (it keeps AdamW's division finite), got {optim.eps}"
        )
    betas = list(optim.betas)
    if len(betas) != 2:
        raise ConfigError(
            f"optim.betas must hold two values (beta1, beta2), got {len(betas)}: {betas}"
        )
    for index, beta in enumerate(betas, start=1):
        if not 0 <= beta < 1:
            raise ConfigError(f"optim.betas: beta{index}={beta} must lie in [0, 1)")


def check_eval(cfg: DictConfig) -> None:
    """Downstream tasks (``eval``): a whole model on rank 0, a cadence, tasks that
    lm-evaluation-harness knows and can load, checked before any training (on rank 0,
    whose verdict every rank of a launch follows: the others download nothing)."""
    ev = cfg.eval
    if ev.every < 0:
        raise ConfigError(f"eval.every must be 0 (at the end only) or more, got {ev.every}")
    check_positive("eval.batch_size", ev.batch_size, "sequence")
    if not ev.tasks:
        return
    if cfg.distributed.name == "zero3":
        raise ConfigError(
            "eval.tasks needs the whole model on rank 0, which distributed=zero3 partitions; "
            "evaluate its checkpoints with python -m collage_train.evaluate instead"
        )
    from collage_train.engine.launch import launched_rank
    from collage_train.evaluation.downstream import check_tasks_load

    if launched_rank() == 0:
        check_tasks_load(list(ev.tasks), ev.include_path)


def check_steps(train: DictConfig) -> None:
    """``train.max_steps`` at least 1, ``train.stop_at_step`` within it (checked again
    where a ``Trainer`` is built, for programmatic use)."""
    if train.max_steps < 1:
        raise ConfigError(f"train.max_steps must be at least 1, got {train.max_steps}")
    if train.stop_at_step is not None and not 0 < train.stop_at_step <= train.max_steps:
        raise ConfigError(
            f"train.stop_at_step={train.stop_at_step} must lie in 1..{train.max_steps}"
        )


def check_train(train: DictConfig) -> None:
    """Cadences and batch sizes that are counts of at least one; under
    ``train.deterministic``, a CUBLAS_WORKSPACE_CONFIG that cuBLAS would not honour."""
    check_steps(train)
    for key in ("checkpoint_every", "eval_every"):
        check_positive(f"train.{key}", train[key], "step")
    check_positive("train.eval_batches", train.eval_batches, "micro-batch")
    for key in ("micro_batch_size", "global_batch_size"):
        check_positive(f"train.{key}", train[key], "sequence")
    if train.deterministic:
        check_cublas_config()
    check_guard(train.guard)


def check_guard(guard: DictConfig) -> None:
    """``train.guard``: a window and a history of at least two steps (a standard deviation
    needs two), a positive threshold, counts that are not negative."""
    for key in ("window", "min_history"):
        if guard[key] < 2:
            raise ConfigError(
                f"train.guard.{key} must be at least 2 steps (a standard deviation needs two), "
                f"got {guard[key]}"
            )
    if guard.min_history > guard.window:
        raise ConfigError(
            f"train.guard.min_history={guard.min_history} can never be reached by a window "
            f"of train.guard.window={guard.window} steps; make it at most the window"
        )
    if not guard.z_threshold > 0:
        raise ConfigError(f"train.guard.z_threshold must be positive, got {guard.z_threshold}")
    for key in ("max_consecutive_skips", "max_rollbacks"):
        if guard[key] < 0:
            raise ConfigError(f"train.guard.{key} must not be negative, got {guard[key]}")


def check_loss_chunk(cfg: DictConfig) -> None:
    """``train.loss_chunk_tokens``: auto, off or a positive count, and not a count for a
    precision that replaces the LM head (Scalify)."""
    chunkable = get_strategy(cfg.precision.name).chunked_loss
    resolve_chunk_tokens(cfg.train.loss_chunk_tokens, vocab_size=1, chunkable=chunkable)


def check_wandb(wandb_cfg: DictConfig) -> None:
    """``online`` needs credentials; without them wandb.init would wait about 100 s, then fail.

    Looked up as W&B does, without the network: WANDB_API_KEY or WANDB_IDENTITY_TOKEN_FILE,
    else an entry for the W&B host (WANDB_BASE_URL) in the netrc file (NETRC, ~/.netrc).
    """
    if wandb_mode(wandb_cfg) != "online" or wandb_credentials_found():
        return
    raise ConfigError(
        "logging.wandb.mode=online needs W&B credentials and none were found "
        "(WANDB_API_KEY, WANDB_IDENTITY_TOKEN_FILE or a netrc entry from `wandb login`); "
        "log in, export WANDB_API_KEY, or use logging.wandb.mode=offline and `wandb sync` later"
    )


def wandb_credentials_found() -> bool:
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    path = Path(os.environ.get("NETRC") or Path.home() / ".netrc")
    try:
        entries = netrc.netrc(path)
    except (OSError, netrc.NetrcParseError):
        return False
    return any(entries.authenticators(host) is not None for host in _wandb_hosts())


def _wandb_hosts() -> list[str]:
    """The host ``wandb login`` writes to the netrc file: WANDB_BASE_URL's, else the
    installed client's default (it changed between W&B releases, so ask the client)."""
    url = os.environ.get("WANDB_BASE_URL")
    if not url:
        import wandb  # only for an online run without a key in the environment

        url = wandb.Settings.model_fields["base_url"].default
    return [urlsplit(url).netloc] if urlsplit(url).netloc else []
