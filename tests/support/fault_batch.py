"""Bad batches at chosen steps, for the step guard's tests (tests/run/test_guard.py).

``inject(trainer_class, kind, steps)`` patches the class, so that runs built afterwards
(in this process, or in a launched one: ``torchrun ... tests/support/fault_batch.py ARGS`` with
``FAULT_KIND`` and ``FAULT_STEPS`` in the environment, ``FAULT_RANK`` to fault one rank
only) see:

- ``nan``: the loss of each micro-batch of those steps times NaN (its gradients NaN),
- ``spike``: the loss times 1000 (its gradients too), as a corrupt batch would,
- ``drop``: the reference, a run whose data lacks those steps' batches: they are read
  and thrown away before the step that would have taken them.

Steps are 1-based optimizer steps: ``"5,7"``, or ``"6-"`` for every step from 6 on.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

SPIKE = 1000.0


def parse_steps(text: str) -> Callable[[int], bool]:
    """``"5,7"`` or ``"6-"`` as a test of a 1-based step number."""
    if text.endswith("-"):
        first = int(text[:-1])
        return lambda step: step >= first
    chosen = {int(part) for part in text.split(",") if part}
    return lambda step: step in chosen


def inject(trainer_class: type, kind: str, steps: str) -> None:
    """Patch ``trainer_class`` (``collage_train.trainer.Trainer``) with the fault.

    Steps are counted as the run draws their batches from the loader: a step taken again
    after a rollback is a later one, with other batches, as in a run whose bad batches
    were transient (``"6,7"``) or persistent (``"6-"``: every batch from the 6th step's
    on); a batch taken again behind a refused step (``GuardedWindow``'s rewind) keeps its
    fault. ``nan`` and ``spike`` wrap each built trainer's window (``next_batch``) and
    stepper (``loss``).
    """
    bad = parse_steps(steps)
    if kind == "drop":
        step = trainer_class._take_step

        def step_without_bad_batches(self):
            taken = getattr(self, "_steps_taken", 0)
            while bad(taken + 1):
                for _ in range(self.accum_steps):
                    self.data.train_loader.next_batch()
                taken += 1
            self._steps_taken = taken + 1
            return step(self)

        trainer_class._take_step = step_without_bad_batches
        return
    factor = {"nan": float("nan"), "spike": SPIKE}[kind]
    init = trainer_class.__init__
    drawn, mark = f"_batches_drawn_{kind}", f"_fault_{kind}"  # one per fault: faults stack

    def init_with_faults(self, *args, **kwargs) -> None:
        init(self, *args, **kwargs)
        next_batch, loss = self.window.next_batch, self.stepper.loss

        def next_batch_with_faults() -> torch.Tensor:
            batch = next_batch()
            if not hasattr(batch, mark):  # drawn for the first time: the batch of which step?
                count = getattr(self, drawn, 0) + 1
                setattr(self, drawn, count)
                setattr(batch, mark, bad(-(-count // self.accum_steps)))
            self._fault_factors = getattr(self, "_fault_factors", {})
            self._fault_factors[kind] = factor if getattr(batch, mark) else None
            return batch

        def faulty_loss(batch: torch.Tensor) -> torch.Tensor:
            value = loss(batch)
            chosen = getattr(self, "_fault_factors", {}).get(kind)
            return value if chosen is None else value * chosen

        self.window.next_batch = next_batch_with_faults
        self.stepper.loss = faulty_loss

    trainer_class.__init__ = init_with_faults


if __name__ == "__main__":
    from collage_train import trainer
    from collage_train.__main__ import main

    only_rank = os.environ.get("FAULT_RANK")  # unset: every rank
    if only_rank is None or only_rank == os.environ.get("RANK", "0"):
        for kind, steps in zip(
            os.environ["FAULT_KIND"].split(";"), os.environ["FAULT_STEPS"].split(";"), strict=True
        ):
            inject(trainer.Trainer, kind, steps)
    main()
