"""``python -m collage_train`` with one rank refusing alone, as a rank on a fuller GPU or
node, or one that reads other files, would.

Each rank's entry (``cli_runner.run_ranks(..., entry="tests/support/refusing_rank.py")``)
for tests/run/test_agreement.py; ``REFUSING_CHECK`` says which check refuses on one rank:

- ``memory``: rank 1's free memory probe reports 1 KiB (``planning.fit_check.available_memory``:
  its host on a CPU run, its GPU and host on a CUDA run): the start-up host check on a
  CPU run, the state check on a CUDA run;
- ``data``: rank 1's corpus refuses (``build_data`` raises a DataError);
- ``downstream``: rank 0's in-run downstream evaluation refuses (the harness rejects a
  task; every task name passes the start-up check), while the other ranks wait for it.
"""

from __future__ import annotations

import os

from collage_train import trainer
from collage_train.__main__ import main
from collage_train.data import DataError
from collage_train.errors import ConfigError
from collage_train.evaluation import downstream
from collage_train.planning import fit_check

CHECK = os.environ.get("REFUSING_CHECK")
RANK = int(os.environ.get("RANK", "0"))


def _refuse_data(*args: object, **kwargs: object) -> None:
    raise DataError("the corpus in data.paths is unreadable on this node (a test's refusal)")


def _refuse_task(*args: object, **kwargs: object) -> None:
    raise ConfigError("lm-eval rejected task some_task (a test's refusal)")


if CHECK == "memory" and RANK == 1:
    fit_check.available_memory = lambda device: 2**10
    fit_check.process_memory = lambda: 0  # the host check adds back nothing
elif CHECK == "data" and RANK == 1:
    trainer.build_data = _refuse_data
elif CHECK == "downstream":
    downstream.check_tasks_load = lambda tasks, include_path: None  # loads at start-up
    if RANK == 0:
        downstream.evaluate_model = _refuse_task

if __name__ == "__main__":
    main()
