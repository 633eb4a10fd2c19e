"""Saving and restoring a whole training run across its ranks.

``CheckpointSaver.save`` is the collective half of ``checkpoint``'s invariant: every rank
writes its files into one temporary directory and records their sizes and CRC-32s (taken
as the bytes are written) in its manifest share; once every rank's share is there, rank 0
writes ``meta.json`` and renames the directory into place. Non-finite weights are never
saved over the last good checkpoint. In the background (``train.async_checkpoint``) the
loop waits only for a copy of this rank's state into reused host buffers
(``checkpoint.staging``); a thread that joins no collective writes and commits. A save in
flight is waited for before the next one and at the end; a failure in the background is
kept (``failure``) for the loop to stop on, on every rank at the same step. ``restore``
reads a checkpoint of the same engine and ranks directly, any other per parameter, naming
in one printed line what carried over and what did not.
Why: docs/design.md, "Checkpoints"; docs/distributed.md, "Checkpoints, resuming and export".
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch

from collage_train import checkpoint
from collage_train.checkpoint.full_state import needs_reshard, open_full_state
from collage_train.checkpoint.staging import HostStaging
from collage_train.checkpoint.switch import Betas, Options, betas_of, measure, switched
from collage_train.checkpoint.whole_tensor import EIGHT_BIT_RECUT
from collage_train.engine import Engine
from collage_train.errors import (
    CheckpointError,
    CheckpointWriteFailed,
    TrainingDiverged,
    first_line,
    is_disk_full,
)
from collage_train.optim.rounding_noise import StreamCounter

# How long rank 0's writer waits for the other ranks' manifest shares after its own: at
# least this, or ten times what its own part took (the ranks write parts of a size).
SHARE_WAIT_MIN_SECONDS = 600.0
_POLL_SECONDS = 0.05
# Where ``restore`` hands a switch of strategy (``checkpoint.switch.Switch``) to the caller.
SWITCH_KEY = "precision_switch"


def all_weights_finite(engine: Engine) -> bool:
    """True when every rank's weights are finite (one collective, one transfer)."""
    weights = engine.local_weights()
    finite = torch.stack([torch.isfinite(w).all() for w in weights]).all()
    failures = (~finite).to(engine.device, torch.float32).reshape(1)
    if engine.world_size > 1:
        engine.all_reduce_sum(failures)
    return failures.item() == 0


@dataclass
class SaveTimes:
    """Seconds of each save: the loop blocked (waiting for the previous save, checking the
    weights, copying the state to the host) and the files written (in the background or
    not), one entry per save."""

    blocked: list[float] = field(default_factory=list)
    written: list[float] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        if not self.blocked:
            return {}
        record = {
            "checkpoint_saves": len(self.blocked),
            "checkpoint_blocked_s_max": round(max(self.blocked), 3),
            "checkpoint_blocked_s_mean": round(sum(self.blocked) / len(self.blocked), 3),
        }
        if self.written:
            record["checkpoint_write_s_mean"] = round(sum(self.written) / len(self.written), 3)
        return record


class CheckpointSaver:
    """Writes a run's checkpoints, in the background when ``background`` (one at a time).

    ``host_staging_bytes`` is what the background copies hold on the host (the size of
    this rank's checkpointed state) once ``prepare`` or the first save has allocated it.
    """

    def __init__(self, engine: Engine, run_dir: Path, *, background: bool) -> None:
        self.engine = engine
        self.run_dir = run_dir
        self.background = background
        self.staging = HostStaging(engine.device) if background else None
        self.times = SaveTimes()
        self._thread: threading.Thread | None = None
        self._preparing: threading.Thread | None = None
        self._failure: str | None = None
        self._error: BaseException | None = None

    def prepare(self, client_state: dict[str, Any]) -> None:
        """Allocate the background saves' host buffers in a thread now, so that the first
        save copies into memory that is already there (allocating and faulting in a
        checkpoint's worth of host memory takes seconds). Call it on every rank at the same
        step (the engine may build its state collectively), once the optimizer holds its
        state; the first save waits for it. Does nothing for foreground saves."""
        if self.staging is None or self._preparing is not None:
            return
        engine, staging = self.engine, self.staging
        if engine.is_main:
            checkpoint.begin_checkpoint(self.run_dir, 0)  # scratch: the library may write
        engine.barrier()
        scratch = checkpoint.temporary_dir(self.run_dir, 0)
        specs = staging.layout(engine.state_files(scratch, client_state, staged=True))
        engine.barrier()
        if engine.is_main:
            checkpoint.remove_temporary_dirs(self.run_dir)
        self._preparing = threading.Thread(
            target=staging.allocate, args=(specs,), name="checkpoint-buffers", daemon=True
        )
        self._preparing.start()

    @property
    def host_staging_bytes(self) -> int:
        return self.staging.nbytes if self.staging is not None else 0

    @property
    def failure(self) -> str | None:
        """Why a save failed on this rank (its background write or rank 0's commit), or None."""
        return self._failure

    def raise_failure(self) -> None:
        """Raise what made a save fail, if one did: a full disk as itself (the CLI's line
        for it removes the unfinished checkpoint), anything else as one
        ``CheckpointWriteFailed`` line."""
        if self._error is not None and is_disk_full(self._error):
            raise self._error
        if self._failure is not None:
            raise CheckpointWriteFailed(self._failure)

    @property
    def in_flight(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait(self) -> None:
        """Wait for a save in flight to be written and committed (failures stay in ``failure``)."""
        if self._preparing is not None:
            self._preparing.join()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def save(
        self,
        step: int,
        *,
        client_state: dict[str, Any],
        meta: dict[str, Any],
        keep: int,
        extra_files: dict[str, bytes],
        background: bool | None = None,
    ) -> Path:
        """Checkpoint ``step`` on every rank into ``run_dir/checkpoints/step-N``; return it.

        In the background (the default when the saver was built so) the checkpoint exists
        once ``wait`` has returned without a ``failure``; otherwise when this returns.
        ``meta`` is the run's identity (``resume.identity``), ``extra_files`` small files
        rank 0 writes beside the state (model config, tokenizer). Raises
        ``TrainingDiverged`` before writing anything when any weight is not finite, and
        ``CheckpointWriteFailed`` when a save written in the foreground fails.
        """
        background = self.background if background is None else background
        since = time.perf_counter()
        self.wait()  # the host buffers are reused, and one save at a time commits
        self.stop_on_failure()
        if not all_weights_finite(self.engine):
            raise TrainingDiverged(
                f"the weights became NaN or infinite at step {step}; nothing was saved "
                "over the last good checkpoint. Lower optim.lr or use a more precise strategy"
            )
        engine, run_dir = self.engine, self.run_dir
        if engine.is_main:
            checkpoint.begin_checkpoint(run_dir, step)
        engine.barrier()
        tmp = checkpoint.temporary_dir(run_dir, step)
        staged = background and self.staging is not None
        files = engine.state_files(tmp, client_state, staged=staged)
        # Files the engine's library wrote itself (DeepSpeed's recovery scripts, rank 0):
        # listed before any rank starts writing its own.
        engine.barrier()
        direct = checkpoint.written_files(tmp) if engine.is_main else []
        final = checkpoint.checkpoint_dir(run_dir) / f"step-{step}"
        job = _SaveJob(
            tmp=tmp,
            step=step,
            rank=engine.rank,
            world_size=engine.world_size,
            files=files,
            direct=direct,
            meta=meta,
            keep=keep,
            extra_files=extra_files if engine.is_main else {},
            run_dir=run_dir,
        )
        if staged:
            assert self.staging is not None
            job.staged = self.staging.stage(files)
            job.files = job.staged.files
            self.times.blocked.append(time.perf_counter() - since)
            self._thread = threading.Thread(
                target=self._run, args=(job,), name=f"checkpoint-step-{step}", daemon=True
            )
            self._thread.start()
            return final
        self._run(job)
        self.times.blocked.append(time.perf_counter() - since)
        self.stop_on_failure()  # every rank returns once rank 0 has committed
        return final

    def stop_on_failure(self) -> None:
        """Raise, on every rank together (a collective), when the last save failed on any
        rank (the loop's stop flag may not have carried it yet)."""
        failed = torch.tensor([float(self._failure is not None)], device=self.engine.device)
        if self.engine.world_size > 1:
            self.engine.all_reduce_sum(failed)
        if failed.item():
            self.raise_failure()
            raise CheckpointWriteFailed(
                "a checkpoint could not be written on another rank (its error line says "
                "why); the newest complete checkpoint is intact: continue with "
                "train.resume=true once the cause is fixed"
            )

    def _run(self, job: _SaveJob) -> None:
        since = time.perf_counter()
        try:
            job.run()
        except Exception as err:  # kept for the loop: every rank stops on it together
            self._error = err
            self._failure = (
                f"the checkpoint of step {job.step} could not be written on rank "
                f"{job.rank} ({first_line(err)}); the newest complete checkpoint in "
                f"{checkpoint.checkpoint_dir(job.run_dir)} is intact: continue with "
                "train.resume=true once the cause is fixed"
            )
        finally:
            job.files = {}
            job.staged = None
        self.times.written.append(time.perf_counter() - since)


@dataclass
class _SaveJob:
    """The part of one save that needs no collective: write this rank's files and its
    manifest share; on rank 0, wait for every share and commit."""

    tmp: Path
    step: int
    rank: int
    world_size: int
    files: dict[str, Any]
    direct: list[str]
    meta: dict[str, Any]
    keep: int
    extra_files: dict[str, bytes]
    run_dir: Path
    staged: Any = None

    def run(self) -> None:
        started = time.monotonic()
        try:
            if self.staged is not None:
                self.staged.ready()  # the device-to-host copies have landed
            entries = {
                name: checkpoint.write_checksummed(self.tmp / name, obj)
                for name, obj in self.files.items()
            }
            for name in self.direct:
                entries[name] = checkpoint.checksum_file(self.tmp / name)
            checkpoint.write_manifest_share(self.tmp, self.rank, entries)
        except Exception as err:  # rank 0 must not wait for a share that will never come
            checkpoint.write_share_failure(self.tmp, self.rank, first_line(err))
            raise
        if self.rank == 0:
            own = time.monotonic() - started
            checkpoint.wait_for_shares(
                self.tmp,
                self.world_size,
                timeout=max(SHARE_WAIT_MIN_SECONDS, 10 * own),
                poll=_POLL_SECONDS,
            )
            checkpoint.commit_checkpoint(
                self.run_dir,
                self.step,
                self.tmp,
                self.meta,
                keep=self.keep,
                extra_files=self.extra_files,
            )


def restore(
    engine: Engine,
    model: torch.nn.Module,
    path: Path,
    *,
    distributed: str,
    param_order: list[str],
    precision: str | None = None,
    betas: tuple[float, float] | None = None,
    options: Options = None,
) -> dict[str, Any]:
    """Load model and optimizer state from checkpoint ``path`` into ``engine``; return the
    trainer's client state (step, loader position, RNG).

    ``param_order`` names the parameters in the optimizer's order (its parameter
    groups), which a per-parameter read needs to match state to parameters. ``precision``
    names this run's strategy (``betas``: its AdamW betas; ``options``: its ``precision``
    config): a checkpoint of another is converted to it (``checkpoint.switch``), and the
    client state then holds the measured ``Switch`` under ``SWITCH_KEY`` (None: the
    checkpoint's own).
    """
    meta = checkpoint.read_meta(path)
    written = meta.get("precision", precision)
    try:
        if written != precision or needs_reshard(meta, distributed, engine.world_size):
            switch = None
            if written != precision and precision is not None:
                there = betas_of(meta["config"])
                sides = (meta["config"].get("precision"), options)
                switch = _Switching(written, precision, (there, betas or there), sides)
            return _restore_resharded(engine, model, path, distributed, param_order, switch)
        return engine.load(path)
    except (RuntimeError, ValueError, KeyError) as err:
        raise CheckpointError(
            f"{path} does not match this model or optimizer ({first_line(err)}); "
            "resume with the configuration it was written with"
        ) from None


class _Switching(NamedTuple):
    """A switch of strategy to make on restore (``checkpoint.switch.switched``'s arguments)."""

    source: str
    target: str
    betas: Betas
    options: tuple[Options, Options]


def _restore_resharded(
    engine: Engine,
    model: torch.nn.Module,
    path: Path,
    distributed: str,
    param_order: list[str],
    switching: _Switching | None,
) -> dict[str, Any]:
    """Elastic resume: every rank reads its share of each parameter's state, converted
    to this run's strategy where ``switching``."""
    named = list(model.named_parameters())
    state = open_full_state(path, param_order)
    state.check_model({n: tuple(getattr(p, "ds_shape", p.shape)) for n, p in named}, path)
    switch = None
    if switching is not None:
        if engine.is_main:  # the cost, measured once
            switch = measure(state, *switching)
            print(switch.line(), flush=True)
        state = switched(state, *switching)
    client_state = engine.load_full(state)
    if switch is not None:
        client_state[SWITCH_KEY] = switch
    loader = client_state["loader"]  # its position counts samples: rank-independent
    client_state["loader"] = {**loader, "world_size": engine.world_size}
    if engine.is_main and (state.layout, state.world_size) != (distributed, engine.world_size):
        kept = ", ".join(sorted(state.read(named[0][0], 0, 1)))
        lost = []
        if max(state.world_size, engine.world_size) > 1:
            lost.append("per-rank RNG streams (every rank continues from rank 0's generator)")
        if isinstance(getattr(getattr(engine, "optimizer", None), "streams", None), StreamCounter):
            # a stream names a tensor of the writer's layout (optim.rounding_noise)
            lost.append("stochastic-rounding streams (each tensor here draws a new one)")
        if "exp_avg_absmax" in kept:
            lost.append(EIGHT_BIT_RECUT)
        print(
            f"elastic resume: {path.name} was written by {state.layout} on "
            f"{state.world_size} rank(s), continuing with distributed={distributed} on "
            f"{engine.world_size}; carried over: {kept}, step, data position, rank 0's RNG; "
            f"not carried over: {'; '.join(lost) or 'nothing'}",
            flush=True,
        )
    return client_state
