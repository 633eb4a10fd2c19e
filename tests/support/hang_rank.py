"""``python -m collage_train`` with rank 1 asleep inside one optimizer step.

For the hang watchdog's test only (tests/run/test_watchdog.py): run as each rank's entry
(``cli_runner.run_ranks(..., entry="tests/support/hang_rank.py")``), rank 1 sleeps for
ten minutes at the start of step ``HANG_STEP + 1`` (in ``_sleep_inside_step``, the frame
its stack dump must name), as a rank stuck on a file system or a device would; rank 0
waits for it in the step's collectives. A launch that finds ``hang-rank1-*.txt`` in
``hydra.run.dir`` already (the resumed run) does not sleep.
"""

from __future__ import annotations

import os
import time

from collage_train import trainer
from collage_train.__main__ import main

HANG_STEP = 5
_step = trainer.Trainer._take_step


def _sleep_inside_step() -> None:
    time.sleep(600)


def _step_sleeping_on_rank_one(self: trainer.Trainer) -> dict:
    if self.step == HANG_STEP and not any(self.run_dir.glob("hang-rank1-*.txt")):
        _sleep_inside_step()
    return _step(self)


if os.environ.get("RANK") == "1":
    trainer.Trainer._take_step = _step_sleeping_on_rank_one

if __name__ == "__main__":
    main()
