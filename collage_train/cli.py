"""The Hydra application behind ``python -m collage_train``.

``train`` prepares the run directory (refusing to overwrite a finished run unless
resuming), builds the trainer and the sinks, and runs it. ``hydra_main`` wraps it so
that bad input ends in one ``error:`` line and a non-zero exit. Before ``hydra_main``
runs, the Hydra callback of ``collage_train/run/directory.py`` has validated the configuration
and locked the run directory against a second launch.
"""

from __future__ import annotations

import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, NamedTuple

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from collage_train import checkpoint
from collage_train.compose import config_dir
from collage_train.config.reference import register_help_resolver
from collage_train.config.schema import register_schemas
from collage_train.engine.agreement import agreement, gathered, the_same
from collage_train.engine.launch import (
    close_process_group,
    exit_launched,
    gather_objects,
    launched_rank,
    launched_world_size,
)
from collage_train.errors import (
    BAD_INPUT,
    RUN_FAILED,
    CollageError,
    ConfigError,
    OutOfMemory,
    is_disk_full,
)
from collage_train.metrics import ConsoleSink, JsonlSink, Sink, WandbSink
from collage_train.metrics.sinks import wandb_mode
from collage_train.run import branch, determinism
from collage_train.run.directory import write_hydra_record
from collage_train.run.resume import (
    SWITCH_FIELD,
    check_resume,
    choose_checkpoint,
    record_changes,
)


def build_sinks(
    cfg: Any,
    run_dir: Path,
    config: dict[str, Any],
    *,
    max_steps: int,
    start_step: int,
    resume: bool,
) -> list[Sink]:
    """Console, metrics.jsonl and W&B sinks from the ``logging`` sub-config."""
    sinks: list[Sink] = []
    if cfg.console != "none":
        sinks.append(ConsoleSink(cfg.console, max_steps=max_steps, start_step=start_step))
    # From the step the run starts at: a fresh start (step 0) in a directory whose earlier
    # run never checkpointed must not append to that run's records.
    sinks.append(JsonlSink(run_dir / "metrics.jsonl", resume_step=start_step))
    if wandb_mode(cfg.wandb) != "disabled":
        sinks.append(WandbSink(cfg.wandb, run_dir, config, resume=resume))
    return sinks


def train(cfg: DictConfig, run_dir: Path, extra_sinks: list[Sink] | None = None) -> dict | None:
    """Run (or resume) one training job in ``run_dir``; return its summary.

    ``train.deterministic`` takes effect here, before the trainer's first matrix product
    (cuBLAS reads its workspace setting then), and is undone when the job returns. The
    process group is closed however the job ends."""
    with determinism.applied(cfg.train.deterministic):
        try:
            return _train(cfg, run_dir, extra_sinks)
        finally:  # also when a check refuses before the engine exists to close it
            close_process_group()


def _existing_checkpoint(cfg: DictConfig, run_dir: Path) -> Path | None:
    """The newest checkpoint in ``run_dir`` (None: none), refused unless resuming."""
    wandb_mode(cfg.logging.wandb)  # a bad mode (setting or WANDB_MODE): one line, now
    existing = checkpoint.latest_checkpoint(run_dir)
    if existing is not None and not cfg.train.resume:
        raise ConfigError(
            f"{run_dir} already holds checkpoints; continue it with train.resume=true "
            "or start a new run in another hydra.run.dir"
        )
    return existing


def _train(cfg: DictConfig, run_dir: Path, extra_sinks: list[Sink] | None) -> dict | None:
    # Every check that reads this rank's own state is agreed by every rank before any
    # refuses (collage_train.engine.agreement): none stops alone while the others wait.
    existing = the_same(
        gathered(lambda: _existing_checkpoint(cfg, run_dir)),
        f"the newest checkpoint in {run_dir}",
        "hydra.run.dir must be a directory every rank shares",
    )
    origin = the_same(  # the checkpoint a new branch starts from (run.branch)
        gathered(lambda: branch.source(cfg, run_dir, existing)),
        "the checkpoint of train.branch_from",
        "train.branch_from must name a checkpoint every rank shares",
    )
    if cfg.train.resume and existing is None and origin is None:
        print(f"no checkpoint in {run_dir} yet: starting from step 0", flush=True)
    if existing is not None:  # before data preparation, and before DeepSpeed opens them
        rank = launched_rank()
        existing = choose_checkpoint(
            run_dir,
            rank=rank,
            world_size=launched_world_size(),
            gather=gather_objects,
            announce=lambda line: print(line, flush=True) if rank == 0 else None,
        )
    restored = existing or origin  # a branch is restored, and checked, as a resume is
    if restored is not None:
        with agreement():
            checkpoint.verify_checkpoint_files(restored)
            changes = check_resume(restored, cfg, launched_world_size())
    run_dir.mkdir(parents=True, exist_ok=True)
    # Imported here: ``--help``, ``--cfg job`` and a refused setting need no model code
    # (transformers' model stack takes seconds to import).
    from collage_train.run import finish
    from collage_train.trainer import Trainer

    trainer = Trainer(cfg, run_dir)
    try:
        main = trainer.engine.is_main
        if main:
            print(trainer.describe(), flush=True)
        switch, restoring = None, time.perf_counter()
        if restored is not None:
            trainer.resume_from(restored)
            switch = trainer.checkpointer.switch  # another strategy's state, converted
            switch = switch.record() if switch else None
        if origin is not None:  # a new branch (run.branch): the parent is only read
            started = branch.lineage(origin, cfg, changes)
            line = branch.start(trainer.data.train_loader, run_dir, started, main=main)
            if main:
                print(line, flush=True)
        lineage = branch.recorded(run_dir)
        if lineage is not None:  # this run is a branch: its summary says of what
            trainer.facts = replace(trainer.facts, branch=lineage.record())
        if main and switch is not None and existing is None:  # a branch that switched
            record_changes(run_dir, trainer.step, [], switch)
        if existing is not None and main:
            also = f" with changed settings: {', '.join(changes)}" if changes else ""
            took = time.perf_counter() - restoring  # a reshard or a switch included
            line = f"resumed from {existing} at step {trainer.step} in {took:.1f} s{also}"
            print(line, flush=True)
            if changes or switch:
                record_changes(run_dir, trainer.step, changes, switch)
        if main:  # the run is accepted: record what it runs
            write_hydra_record(cfg, run_dir)
        sinks: list[Sink] = []
        if main:  # only rank 0 logs
            config = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
            if lineage is not None:
                config["branch"] = lineage.record()  # W&B's config, and its group
            if switch is not None:
                config[SWITCH_FIELD] = switch  # W&B's config: the switch, in one run
            sinks = build_sinks(
                cfg.logging,
                run_dir,
                config,
                max_steps=cfg.train.max_steps,
                start_step=trainer.step,
                resume=existing is not None,
            ) + list(extra_sinks or [])
        try:
            return trainer.fit(sinks)
        finally:  # the console last: its sample ends the output
            finish.close_sinks(sinks, run_dir)
    finally:
        trainer.engine.close()


def _is_out_of_memory(err: BaseException) -> bool:
    if isinstance(err, torch.OutOfMemoryError | MemoryError):
        return True
    text = str(err)
    return isinstance(err, RuntimeError) and (
        "can't allocate memory" in text or "not enough memory" in text or "out of memory" in text
    )


def _disk_full_message(err: BaseException, run_dir: Path) -> str:
    """Remove the unfinished checkpoint and say which complete one a resume would use."""
    checkpoint.remove_temporary_dirs(run_dir)
    where = getattr(err, "filename", None) or run_dir
    latest = checkpoint.latest_checkpoint(run_dir)
    kept = (
        f"the newest complete checkpoint, {latest}, is intact"
        if latest is not None
        else "no checkpoint had been completed"
    )
    return (
        f"no space left on the device while writing {where}; the unfinished checkpoint was "
        f"removed and {kept}: free some space, then continue with train.resume=true"
    )


def run(cfg: DictConfig, run_dir: Path) -> int:
    """``train`` with bad input turned into one error line; returns the exit status."""
    return run_reporting(cfg, run_dir).exit_status


class Outcome(NamedTuple):
    """How a job ended: its exit status, its one error line (None: it succeeded) and its
    summary (None when it failed or stopped before ``train.max_steps``)."""

    exit_status: int
    error: str | None = None
    summary: dict[str, Any] | None = None


def run_reporting(cfg: DictConfig, run_dir: Path) -> Outcome:
    """``train``, with bad input turned into one ``error:`` line on stderr."""
    rank = launched_rank()
    try:
        return Outcome(0, summary=train(cfg, run_dir))
    except CollageError as err:
        if err.quiet:  # another rank failed and reports why
            return Outcome(err.exit_status, str(err))
        if isinstance(err, OutOfMemory) and not err.agreed:  # this rank alone: it reports
            return _report(err.exit_status, f"{_rank_prefix(rank)}{err}", rank, every_rank=True)
        return _report(err.exit_status, str(err), rank)  # the same on every rank: rank 0
    except (OSError, RuntimeError, MemoryError) as err:
        if is_disk_full(err):
            message = f"{_rank_prefix(rank)}{_disk_full_message(err, run_dir)}"
            return _report(RUN_FAILED, message, rank, every_rank=True)
        refused = determinism.nondeterministic_operation(err)
        if refused is not None:  # the same on every rank: rank 0 reports it
            return _report(BAD_INPUT, refused, rank)
        if not _is_out_of_memory(err):
            raise
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        message = OutOfMemory(
            f"out of memory ({first}); lower train.micro_batch_size (gradient accumulation "
            "keeps train.global_batch_size), pick a smaller model, or spread the model state "
            "over several GPUs with DeepSpeed ZeRO"
        )
        return _report(message.exit_status, f"{_rank_prefix(rank)}{message}", rank, every_rank=True)


def _report(status: int, message: str, rank: int, *, every_rank: bool = False) -> Outcome:
    if every_rank or rank == 0:
        print(f"error: {message}", file=sys.stderr, flush=True)
    return Outcome(status, message)


def _rank_prefix(rank: int) -> str:
    return f"[rank {rank}] " if rank else ""


register_schemas()
register_help_resolver()


@hydra.main(version_base="1.3", config_path=config_dir(), config_name="config")
def hydra_main(cfg: DictConfig) -> float | None:
    """One run; or, under ``-m``, one job of a sweep (``collage_train.run.sweep``). Returns the
    final validation loss, the objective of Hydra's optimising sweepers."""
    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir)
    if hydra_cfg.mode == RunMode.MULTIRUN:
        from collage_train.run.sweep import run_sweep_job

        return run_sweep_job(cfg, run_dir, run_reporting)
    outcome = run_reporting(cfg, run_dir)
    if outcome.exit_status:
        exit_launched(outcome.exit_status)
    return (outcome.summary or {}).get("final_val_loss")
