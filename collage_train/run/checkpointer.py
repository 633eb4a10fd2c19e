"""The run's checkpoints as the loop sees them: when one is due, saving, restoring.

``Checkpointer`` saves every ``train.checkpoint_every`` steps and at the run's end (a stop
saves through it too), in the background when ``train.async_checkpoint``, through
``run.checkpoint_saver.CheckpointSaver``; it restores the newest checkpoint or any other,
also one written by another engine or number of ranks (``run.checkpoint_saver.restore``).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from collage_train import checkpoint
from collage_train.checkpoint.switch import SWITCHED, Switch, betas_of
from collage_train.engine.base import Engine
from collage_train.run import checkpoint_saver
from collage_train.run.checkpoint_saver import CheckpointSaver


class Checkpointer:
    """When the run checkpoints (``train``: the ``train`` config), and its saves and
    restores. ``identity`` gives what
    ``meta.json`` records of the run (``run.resume.identity``), ``extra_files`` the small
    files rank 0 writes beside the state (model config, tokenizer)."""

    def __init__(
        self,
        engine: Engine,
        run_dir: Path,
        train: Any,
        *,
        identity: Callable[[], dict[str, Any]],
        extra_files: Callable[[], dict[str, bytes]],
    ) -> None:
        self._engine = engine
        self._run_dir = run_dir
        self._every, self._keep = train.checkpoint_every, train.keep_checkpoints
        self._end = train.stop_at_step or train.max_steps
        self.background = background = train.async_checkpoint
        self._identity = identity
        self._extra_files = extra_files
        self.saver = CheckpointSaver(engine, run_dir, background=background)
        self.switch: Switch | None = None  # set by ``restore``

    def due(self, step: int) -> bool:
        return step % self._every == 0 or step == self._end

    def prepare(self, client_state: dict[str, Any]) -> None:
        """Allocate the background saves' host buffers (``CheckpointSaver.prepare``), once
        the optimizer holds its state; nothing for foreground saves."""
        if self.background:
            self.saver.prepare(client_state)

    def save(
        self, step: int, client_state: dict[str, Any], *, background: bool | None = None
    ) -> Path:
        """Checkpoint ``step`` on every rank (in the background unless told otherwise),
        refusing to store non-finite weights."""
        return self.saver.save(
            step,
            background=self.background if background is None else background,
            client_state=client_state,
            meta=self._identity(),
            keep=self._keep,
            extra_files=self._extra_files(),
        )

    def finish(self) -> None:
        """Wait for a save in the background; stop, on every rank, when it failed on any."""
        self.saver.wait()
        self.saver.stop_on_failure()

    @property
    def failed(self) -> bool:
        """Whether a save in the background failed on this rank."""
        return self.saver.failure is not None

    def newest(self) -> Path | None:
        return checkpoint.latest_checkpoint(self._run_dir)

    def restore(self, path: Path, model: torch.nn.Module, param_order: list[str]) -> dict[str, Any]:
        """Model and optimizer state from ``path`` (any engine, any number of ranks, any
        strategy: converted to this run's); returns the client state saved beside them.
        ``switch`` is then the switch of strategy it made, or the one ``convert
        --precision`` made offline (None: none)."""
        identity = self._identity()
        precision = identity["precision"]
        client_state = checkpoint_saver.restore(
            self._engine, model, path, distributed=self._engine.name, param_order=param_order,
            precision=precision, betas=betas_of(identity["config"]),
            options=identity["config"].get("precision"),
        )  # fmt: skip
        self.switch = client_state.pop(checkpoint_saver.SWITCH_KEY, None)
        offline = checkpoint.read_meta(path).get(SWITCHED)
        if self.switch is None and offline and offline.get("to") == precision:
            self.switch = Switch.from_record(offline)
        return client_state

    def times(self) -> dict[str, Any]:
        """The saves' blocked and written seconds (``SaveTimes.summary``)."""
        return self.saver.times.summary()
