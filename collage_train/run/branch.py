"""Branching a run: a new run that starts from another run's checkpoint.

``train.branch_from=RUN/checkpoints/step-N`` starts a run in its own directory from that
checkpoint, restored exactly as a resume restores it (``run.resume.check_resume``, then
``Trainer.resume_from``: what a resume accepts and converts, a branch does too), with the
settings that do not define the run free to change; ``train.branch_data_seed`` reorders
the data after the branch point. The parent is only read: its checkpoint is checked and
loaded, never set aside, rotated or written.

The branch's lineage (parent run directory, checkpoint, step, data-order seed, the settings
it changed) is written to ``branch.json`` in the branch's directory once the branch is
accepted, and goes into ``summary.json`` (``branch``), the W&B config (``branch``) and the
W&B group (``branch-<parent directory name>-step-N``, unless ``logging.wandb.group`` is
set). A resume of the branch (``train.resume=true`` in its directory) continues the branch:
from its own newest checkpoint, or from the branch point again if it wrote none yet.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from collage_train import checkpoint
from collage_train.data.progress import write_json_atomic
from collage_train.errors import CheckpointError, ConfigError

BRANCH_FILE = "branch.json"


@dataclass(frozen=True)
class Lineage:
    """Where a branch comes from: ``parent_run_dir`` and its ``checkpoint`` of ``step``,
    the data-order seed after the branch (None: the parent's order) and the settings the
    branch changed (``key old -> new`` lines)."""

    parent_run_dir: str
    checkpoint: str
    step: int
    data_seed: int | None = None
    changed: list[str] = field(default_factory=list)

    @property
    def group(self) -> str:
        """The W&B group of every branch from this checkpoint."""
        return f"branch-{Path(self.parent_run_dir).name}-step-{self.step}"

    def record(self) -> dict[str, Any]:
        """What summary.json, branch.json and the W&B config hold."""
        return {**asdict(self), "group": self.group}


def check_settings(cfg: DictConfig) -> None:
    """Refuse branch settings that cannot work, from the config alone (``run.validate``)."""
    train, data = cfg.train, cfg.data
    seed = train.branch_data_seed
    if seed is None:
        return
    if train.branch_from is None:
        raise ConfigError(
            f"train.branch_data_seed={seed} reorders the data after a branch point: set "
            "train.branch_from=RUN/checkpoints/step-N too, or leave it out"
        )
    if seed < 0:
        raise ConfigError(f"train.branch_data_seed must be 0 or more, got {seed}")
    if data.get("mixture") is not None or data.get("streaming"):
        raise ConfigError(
            "train.branch_data_seed reorders a prepared corpus of one source; a mixture or a "
            "streamed corpus keeps the parent's order: leave train.branch_data_seed out"
        )


def check_directory(cfg: DictConfig, run_dir: Path) -> None:
    """Refuse a branch whose run directory is its parent's or lies inside it (checked
    before the directory is created and locked: the parent is never written)."""
    given = cfg.train.branch_from
    if given is None or _located(given).parent.name != "checkpoints":  # not RUN/checkpoints/X
        return
    parent, here = _located(given).parent.parent, run_dir.absolute()
    if here == parent or parent in here.parents:
        raise ConfigError(
            f"train.branch_from={cfg.train.branch_from}: this run's directory {run_dir} lies "
            f"in the parent run's {parent}, which a branch never writes; set hydra.run.dir "
            "(or hydra.sweep.dir) outside it"
        )


def recorded(run_dir: Path) -> Lineage | None:
    """The lineage ``run_dir``'s ``branch.json`` records (None: not a branch)."""
    try:
        data = json.loads((run_dir / BRANCH_FILE).read_text())
    except (OSError, ValueError):
        return None
    data.pop("group", None)
    return Lineage(**data)


def source(cfg: DictConfig, run_dir: Path, existing: Path | None) -> Path | None:
    """The checkpoint this launch branches from; None where it resumes its own ``existing``
    checkpoint or is no branch. Raises CheckpointError for a ``train.branch_from`` that is
    not an intact checkpoint, ConfigError for one given with ``train.resume=true`` to a run
    directory whose checkpoints are not of that branch. Reads only; writes nothing."""
    given, mine = cfg.train.branch_from, recorded(run_dir)
    if existing is not None:  # a resume (a fresh start there is refused before this)
        if given is not None and (mine is None or Path(mine.checkpoint) != _located(given)):
            what = "another run" if mine is None else f"a branch of {mine.checkpoint}"
            raise ConfigError(
                f"train.branch_from={given} with train.resume=true: {run_dir} holds the "
                f"checkpoints of {what}; resume it without train.branch_from, or branch into "
                "a new hydra.run.dir"
            )
        return None
    if given is None and cfg.train.resume and mine is not None:
        given = mine.checkpoint  # a branch stopped before its first checkpoint: again
    if given is None:
        return None
    path = _located(given)
    _check_checkpoint(path, given, run_dir)
    return path


def _located(given: str) -> Path:
    return Path(given).expanduser().absolute()


def _check_checkpoint(path: Path, given: str, run_dir: Path) -> None:
    hint = "name a checkpoint directory, RUN/checkpoints/step-N"
    if not path.is_dir():
        raise CheckpointError(f"train.branch_from={given}: no such directory; {hint}")
    if not (path / checkpoint.META).is_file():
        raise CheckpointError(
            f"train.branch_from={given} is not a checkpoint (it has no {checkpoint.META}); {hint}"
        )
    if run_dir.absolute() in path.parents:
        raise ConfigError(
            f"train.branch_from={given} lies in this run's own directory {run_dir}; a branch "
            "runs in a new hydra.run.dir (resume a run with train.resume=true)"
        )
    why = checkpoint.damage(path)
    if why is not None:
        raise CheckpointError(
            f"train.branch_from={given} is damaged ({why}); branch from another checkpoint"
        )


def lineage(path: Path, cfg: DictConfig, changed: list[str]) -> Lineage:
    """The lineage of a branch from checkpoint ``path`` with ``cfg``."""
    meta = checkpoint.read_meta(path)
    return Lineage(
        parent_run_dir=str(path.parent.parent),
        checkpoint=str(path),
        step=int(meta["step"]),
        data_seed=cfg.train.branch_data_seed,
        changed=list(changed),
    )


def start(loader: Any, run_dir: Path, found: Lineage, *, main: bool) -> str:
    """Begin the branch once its checkpoint is restored: reorder ``loader`` by the
    data-order seed, record the lineage (rank 0, ``main``); returns the line saying so."""
    if found.data_seed is not None:
        if not hasattr(loader, "reorder"):
            raise ConfigError("train.branch_data_seed needs a prepared corpus of one source")
        loader.reorder(found.data_seed)
    if main:
        write_json_atomic(run_dir / BRANCH_FILE, found.record())
    order = (
        "the parent's data order"
        if found.data_seed is None
        else (f"data order seed {found.data_seed}")
    )
    also = f", changed: {', '.join(found.changed)}" if found.changed else ""
    return f"branched from {found.checkpoint} at step {found.step} ({order}{also})"
