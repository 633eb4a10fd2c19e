"""Saving and restoring a whole training run across its ranks.

``save`` is the collective half of ``checkpoint``'s invariant: every rank writes its
files into one temporary directory, each checksums its share of them, and only then
does rank 0 write ``meta.json`` and rename the directory into place; non-finite weights
are never saved over the last good checkpoint. ``restore`` reads a checkpoint written
by the same engine on the same number of ranks directly, and any other (another
engine, another world size, the universal layout) per parameter, naming in one printed
line what carried over and what did not.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from collage_train import checkpoint
from collage_train.checkpoint.full_state import needs_reshard, open_full_state
from collage_train.engine import Engine
from collage_train.errors import CheckpointError, TrainingDiverged, first_line


def all_weights_finite(engine: Engine) -> bool:
    """True when every rank's weights are finite (one collective, one transfer)."""
    weights = engine.local_weights()
    finite = torch.stack([torch.isfinite(w).all() for w in weights]).all()
    failures = (~finite).to(engine.device, torch.float32).reshape(1)
    if engine.world_size > 1:
        engine.all_reduce_sum(failures)
    return failures.item() == 0


def save(
    engine: Engine,
    run_dir: Path,
    step: int,
    *,
    client_state: dict[str, Any],
    meta: dict[str, Any],
    keep: int,
    extra_files: dict[str, bytes],
) -> Path:
    """Checkpoint ``step`` on every rank into ``run_dir/checkpoints/step-N``; return it.

    ``meta`` is the run's identity (``resume.identity``), ``extra_files`` small files
    rank 0 writes beside the state (model config, tokenizer). Raises
    ``TrainingDiverged`` before writing anything when any weight is not finite.
    """
    if not all_weights_finite(engine):
        raise TrainingDiverged(
            f"the weights became NaN or infinite at step {step}; nothing was saved "
            "over the last good checkpoint. Lower optim.lr or use a more precise strategy"
        )
    if engine.is_main:
        checkpoint.begin_checkpoint(run_dir, step)
    engine.barrier()
    tmp = checkpoint.temporary_dir(run_dir, step)
    engine.save(tmp, client_state)
    engine.barrier()
    # every file is written: each rank checksums its share of them for meta.json
    checkpoint.manifest_share(tmp, engine.rank, engine.world_size)
    engine.barrier()
    final = checkpoint.checkpoint_dir(run_dir) / f"step-{step}"
    if engine.is_main:
        final = checkpoint.commit_checkpoint(
            run_dir, step, tmp, meta, keep=keep, extra_files=extra_files
        )
    engine.barrier()
    return final


def restore(
    engine: Engine,
    model: torch.nn.Module,
    path: Path,
    *,
    distributed: str,
    param_order: list[str],
) -> dict[str, Any]:
    """Load model and optimizer state from checkpoint ``path`` into ``engine``; return the
    trainer's client state (step, loader position, RNG).

    ``param_order`` names the parameters in the optimizer's order (its parameter
    groups), which a per-parameter read needs to match state to parameters.
    """
    meta = checkpoint.read_meta(path)
    try:
        if needs_reshard(meta, distributed, engine.world_size):
            return _restore_resharded(engine, model, path, distributed, param_order)
        return engine.load(path)
    except (RuntimeError, ValueError, KeyError) as err:
        raise CheckpointError(
            f"{path} does not match this model or optimizer ({first_line(err)}); "
            "resume with the configuration it was written with"
        ) from None


def _restore_resharded(
    engine: Engine, model: torch.nn.Module, path: Path, distributed: str, param_order: list[str]
) -> dict[str, Any]:
    """Elastic resume: every rank reads its share of each parameter's state."""
    named = list(model.named_parameters())
    state = open_full_state(path, param_order)
    state.check_model({n: tuple(getattr(p, "ds_shape", p.shape)) for n, p in named}, path)
    client_state = engine.load_full(state)
    loader = client_state["loader"]  # its position counts samples: rank-independent
    client_state["loader"] = {**loader, "world_size": engine.world_size}
    if engine.is_main:
        kept = ", ".join(sorted(state.read(named[0][0], 0, 1)))
        lost = (
            "per-rank RNG streams (every rank continues from rank 0's generator)"
            if max(state.world_size, engine.world_size) > 1
            else "nothing"
        )
        print(
            f"elastic resume: {path.name} was written by {state.layout} on "
            f"{state.world_size} rank(s), continuing with distributed={distributed} on "
            f"{engine.world_size}; carried over: {kept}, step, data position, rank 0's RNG; "
            f"not carried over: {lost}",
            flush=True,
        )
    return client_state
