"""W&B's own step for each metric record, never below one already used.

W&B drops a row logged below its current step ("Tried to log to step N that is less than
the current step M"), offline too, while a run's training steps go back: after a rollback
of the step guard (its record and the steps trained again), in a resumed run (the steps
between its checkpoint and the interruption), and in results appended afterwards
(``python -m collage_train.evaluate``, at a checkpoint's step). Every record carries its
training step as the ``step`` metric W&B plots against (``WandbSink``), so W&B's own step
only has to keep order; docs/wandb.md says why W&B's rewind is not used for this.
"""

from __future__ import annotations

import os
from pathlib import Path

# In the run directory: the highest W&B step its records took, for the next process.
STEP_FILE = "wandb_step"


class WandbSteps:
    """The W&B step of each record: its training step plus an offset, 0 until the training
    step goes back; a record below the previous one moves the offset so that it takes the
    next W&B step, and the records after it follow it. Records of one training step share
    a row (W&B merges a step's calls).

    ``continued``: the run continues a W&B run of this run directory, whose highest step is
    read from ``STEP_FILE`` (offline, W&B itself cannot tell); ``first``: the first step W&B
    will take (``run.starting_step``: online, the resumed run's next step). The highest
    step is written back before each new row is logged, so a killed run leaves it.
    """

    def __init__(self, run_dir: Path, *, continued: bool, first: int = 0) -> None:
        self.path = run_dir / STEP_FILE
        saved = _read_step(self.path) if continued else None
        self.last = max(first - 1, -1 if saved is None else saved)  # highest W&B step used
        self.offset = 0
        self.step: int | None = None  # training step of the last record

    def place(self, step: int) -> int:
        """The W&B step to log the record of training step ``step`` at."""
        if step == self.step:
            return self.last
        wandb_step = step + self.offset
        if wandb_step <= self.last:  # back in training steps (or a continued run's start)
            self.offset = self.last + 1 - step
            wandb_step = self.last + 1
        self.step, self.last = step, wandb_step
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        tmp.write_text(f"{wandb_step}\n")
        os.replace(tmp, self.path)
        return wandb_step


def _read_step(path: Path) -> int | None:
    """The step in ``path``; None when it is missing or not a number."""
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None
