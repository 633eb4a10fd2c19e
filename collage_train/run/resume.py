"""What a resumed run continues from, and which of its settings it may change.

Invariant: a resume continues from the newest checkpoint that every rank found intact
(``checkpoint.damage``: metadata, file sizes and CRC-32s against those written at save
time), and only with settings that leave the run the same run. A damaged newer
checkpoint is set aside (renamed ``step-N.damaged``, so that rotation never counts it)
with one printed line saying why; with none intact, or with a setting that defines the
run changed, the resume is refused in one line and nothing in the run directory changes.
Another engine or number of ranks is an elastic resume (the checkpoint is read per
parameter, ``checkpoint.full_state``), refused only for replicas, whose states are
their own, for strategies that do not run under ZeRO, and for a world size that does
not divide the global batch. Another ``precision`` is a switch of strategy (the state
converted through the canonical form, ``checkpoint.switch``), refused only for replicas
and for strategies without a state form.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from collage_train import checkpoint
from collage_train.checkpoint.full_state import ZERO_ENGINES, layout_of, needs_reshard
from collage_train.checkpoint.switch import check_switch
from collage_train.checkpoint.universal import UNIVERSAL
from collage_train.comm.settings import comm_name, uses_replicas
from collage_train.config.schema import RENAMED_CHOICES, current_choice
from collage_train.errors import CheckpointError, ConfigError
from collage_train.planning.batch import accumulation_steps

# Layouts an elastic resume reads per parameter on any engine and number of ranks.
RESHARDABLE = ("unsharded", *ZERO_ENGINES, UNIVERSAL)

# Settings a run is defined by: changing one on resume would make another run (another
# model, numerics, data or token count per step) under the same name.
IDENTITY = ("model.", "precision.", "data.", "train.global_batch_size", "train.seed")
# ... except where the data is cached and how many processes prepare it, which do not
# change what is read.
NOT_IDENTITY = ("data.cache_dir", "data.num_workers")
# Not worth reporting: a resume says it resumes, a branch records its origin (run.branch).
UNREPORTED = ("train.resume", "train.branch_from", "train.branch_data_seed")
RESUMES = "resumes.jsonl"  # in the run directory: one line per resume that changed something
# The switch of strategy in resumes.jsonl, summary.json (a list) and W&B's config.
SWITCH_FIELD = "precision_switch"

Gather = Callable[[Any], list[Any]]


def _alone(value: Any) -> list[Any]:
    return [value]


def choose_checkpoint(
    run_dir: Path,
    *,
    rank: int = 0,
    world_size: int = 1,
    gather: Gather = _alone,
    announce: Callable[[str], None] = print,
) -> Path:
    """The newest checkpoint of ``run_dir`` that every rank finds intact.

    Each rank checks its share of the checksums and ``gather`` (an all-gather of Python
    objects over the launch's ranks) combines the verdicts, so every rank takes the same
    checkpoint. Rank 0 announces and sets aside each damaged newer one. Raises
    CheckpointError, changing nothing, when none is intact.
    """
    skipped: list[tuple[Path, str]] = []
    for _, path in reversed(checkpoint.list_checkpoints(run_dir)):
        reasons = [r for r in gather(checkpoint.damage(path, rank, world_size)) if r]
        if not reasons:
            for damaged, why in skipped:
                if rank == 0:
                    aside = _set_aside(damaged)
                    announce(f"skipped {damaged.name}: {why}; moved to {aside.name}")
            return path
        skipped.append((path, reasons[0]))
    found = "; ".join(f"{path.name}: {why}" for path, why in skipped)
    raise CheckpointError(
        f"no intact checkpoint in {checkpoint.checkpoint_dir(run_dir)} ({found}); restore one "
        "from a copy, or start the run again in another hydra.run.dir"
    )


def _set_aside(path: Path) -> Path:
    """Rename ``step-N`` to ``step-N.damaged`` (numbered if taken): no longer a checkpoint."""
    target = path.with_name(f"{path.name}.damaged")
    number = 1
    while target.exists():
        number += 1
        target = path.with_name(f"{path.name}.damaged-{number}")
    path.rename(target)
    return target


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        flat: dict[str, Any] = {}
        for key, value in tree.items():
            flat.update(_flatten(value, f"{prefix}{key}."))
        return flat or {prefix.rstrip("."): {}}
    return {prefix.rstrip("."): tree}


def changed_settings(saved: dict[str, Any], current: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """Dotted keys whose value differs between the saved and the current config.

    Keys the saved config does not have (options added since it was written) count as
    unchanged; choices renamed since (``config.schema.RENAMED_CHOICES``) compare by their new name.
    """
    before, after = _flatten(saved), _flatten(current)
    for group in RENAMED_CHOICES:
        if f"{group}.name" in before:
            before[f"{group}.name"] = current_choice(group, before[f"{group}.name"])
    return {
        key: (before[key], after.get(key))
        for key in sorted(before)
        if key in after and before[key] != after[key] and key not in UNREPORTED
    }


def _defines_run(key: str) -> bool:
    if key.startswith(NOT_IDENTITY):
        return False
    return any(key == item or key.startswith(item) for item in IDENTITY)


def check_settings(path: Path, saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """Refuse a resume that changes a setting the run is defined by; return the other
    changed settings as ``key old -> new`` lines."""
    changed = changed_settings(saved, current)
    refused = [key for key in changed if _defines_run(key)]
    if refused:
        listed = ", ".join(f"{key} {changed[key][0]!r} -> {changed[key][1]!r}" for key in refused)
        raise ConfigError(
            f"{path} was written with other settings that define the run ({listed}); resume "
            "with the values it was written with, or start a new run in another hydra.run.dir"
        )
    return [f"{key} {old!r} -> {new!r}" for key, (old, new) in changed.items()]


def identity(cfg: DictConfig, checkpoint_holds: tuple[str, ...], world_size: int) -> dict[str, Any]:
    """What ``meta.json`` records of the run that wrote a checkpoint: the fields
    ``check_resume`` compares (strategy, communication, engine, ranks, whole config)."""
    return {
        "precision": cfg.precision.name,
        "holds": list(checkpoint_holds),
        "model": cfg.model.name,
        "distributed": cfg.distributed.name,
        "comm": comm_name(cfg.comm),
        "world_size": world_size,
        "config": OmegaConf.to_container(cfg, resolve=True, enum_to_str=True),
    }


def check_resume(path: Path, cfg: DictConfig, world_size: int) -> list[str]:
    """Refuse resuming ``path`` with ``cfg`` on ``world_size`` ranks where the run would not
    be the same run; return the settings it changes as ``key old -> new`` lines.

    Reads only the checkpoint's metadata, so it runs before data preparation and before
    anything is written into the run directory.
    """
    meta = checkpoint.read_meta(path)
    written = meta.get("precision")
    switching = written != cfg.precision.name
    if switching:
        _check_switch(path, cfg, written)
    written_comm = current_choice("comm", meta.get("comm", "every_step"))
    if written_comm != comm_name(cfg.comm):
        raise ConfigError(
            f"{path} was written with comm={written_comm}, this run uses "
            f"comm={comm_name(cfg.comm)}; resume with the same communication"
        )
    layout = layout_of(meta)
    saved_world = int(meta.get("world_size", 1))
    if needs_reshard(meta, cfg.distributed.name, world_size):
        _check_reshard(path, cfg, layout, saved_world, world_size)
    current = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    saved = meta.get("config", {})
    if switching:  # the strategy's own options change with it
        saved = {key: value for key, value in saved.items() if key != "precision"}
        changes = [f"precision.name {written!r} -> {str(cfg.precision.name)!r}"]
        return changes + check_settings(path, saved, current)
    return check_settings(path, saved, current)


def _check_switch(path: Path, cfg: DictConfig, written: str | None) -> None:
    """Refuse, in one line, a switch of strategy that cannot be made."""
    if written is None:
        raise ConfigError(f"{path} does not record the strategy that wrote it; resume with it")
    if uses_replicas(cfg.comm):
        raise ConfigError(
            f"{path} was written with precision={written}, this run uses "
            f"precision={cfg.precision.name}: replicas resume only with the strategy that "
            "wrote them"
        )
    try:
        check_switch(written, cfg.precision.name)
    except ConfigError as err:
        raise ConfigError(f"{path} was written with precision={written}: {err}") from None


def _check_reshard(
    path: Path, cfg: DictConfig, layout: str, saved_world: int, world_size: int
) -> None:
    """Refuse an elastic resume (another engine or number of ranks) where it cannot work."""
    if uses_replicas(cfg.comm):
        raise ConfigError(
            f"{path} was written by {saved_world} replicas and this run has {world_size}; "
            "each replica's inner state is its own: resume with "
            f"{saved_world} processes (torchrun --nproc_per_node {saved_world})"
        )
    train = cfg.train
    try:
        accumulation_steps(train.global_batch_size, train.micro_batch_size, world_size)
    except ConfigError as err:
        raise ConfigError(f"{path} cannot continue on {world_size} rank(s): {err}") from None
    if layout not in RESHARDABLE:
        raise ConfigError(
            f"{path} was written by distributed={layout}, which cannot be resharded; resume "
            "with the engine and number of ranks that wrote it"
        )


def record_changes(
    run_dir: Path, step: int, changes: list[str], switch: dict[str, Any] | None = None
) -> None:
    """Append the settings a resume changed, and its switch of strategy (``Switch.record``)
    where it made one, to ``resumes.jsonl`` in the run directory."""
    entry: dict[str, Any] = {"step": step, "time": time.time(), "changed": changes}
    if switch is not None:
        entry[SWITCH_FIELD] = switch
    with (run_dir / RESUMES).open("a") as handle:
        handle.write(json.dumps(entry) + "\n")


def recorded_switches(run_dir: Path) -> list[dict[str, Any]]:
    """Every switch of strategy the run's resumes recorded, oldest first; one made again
    (the same from, to and step: a resume of the same checkpoint after a crash) once."""
    try:
        lines = (run_dir / RESUMES).read_text().splitlines()
    except OSError:
        return []
    found = []
    for line in lines:
        try:
            entry = json.loads(line)
        except ValueError:  # a line cut short by a crash
            continue
        switch = entry.get(SWITCH_FIELD) if isinstance(entry, dict) else None
        if isinstance(switch, dict):
            key = (switch.get("from"), switch.get("to"), switch.get("step"))
            found = [
                known
                for known in found
                if (known.get("from"), known.get("to"), known.get("step")) != key
            ]
            found.append(switch)  # fmt: skip
    return found
