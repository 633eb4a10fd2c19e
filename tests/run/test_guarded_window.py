"""The guarded step window on its own: counters, held batches, settles and rollbacks, with
a one-rank stand-in engine and host tensors (the trainer's runs: tests/run/test_guard.py)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from collage_train.engine.base import StepOutcome
from collage_train.errors import TrainingDiverged
from collage_train.run.guard import GuardSettings
from collage_train.run.guarded_window import Action, GuardedWindow

FACTS = SimpleNamespace(tokens_per_step=64)


class OneRank:
    """What the window asks of an engine, on one CPU rank."""

    def __init__(self) -> None:
        self.device = torch.device("cpu")
        self.world_size = 1
        self.independent_replicas = False
        self.rewound: list[int] = []

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def rewind_steps(self, count: int) -> None:
        self.rewound.append(count)


def batches():
    """Host batches numbered 1, 2, ... (their first element)."""
    number = 0

    def next_batch() -> torch.Tensor:
        nonlocal number
        number += 1
        return torch.full((1, 2), number)

    return next_batch


def window(*, masks: bool, max_skips: int = 3, engine: OneRank | None = None) -> GuardedWindow:
    settings = GuardSettings(min_history=2, max_consecutive_skips=max_skips, max_rollbacks=1)
    return GuardedWindow(
        settings,
        engine or OneRank(),
        batches(),
        enabled=True,
        optimizer_masks=masks,
        layer_groups=["all"],
        with_dtheta=False,
    )


def take(win: GuardedWindow, loss: float, accum: int = 1) -> list[int]:
    """One step through the window as the trainer takes it; the batches' numbers."""
    win.begin_step()
    drawn = [int(win.next_batch()[0, 0]) for _ in range(accum)]
    gate = win.gate(torch.tensor(loss))
    grad_norm = torch.tensor(1.0)
    applied = gate.judge(grad_norm)
    outcome = StepOutcome(grad_norm, applied if gate.on_device else bool(applied))
    win.end_step(torch.tensor(loss), 1e-3, outcome, 0.0, None)
    return drawn


def test_steps_are_counted_and_each_settled_record_logged_once():
    win = window(masks=False)
    for loss in (3.0, 2.9, 2.8):
        take(win, loss)
    assert (win.step, win.applied_steps, win.skipped_steps) == (3, 3, 0)
    settled = win.settle(FACTS)
    assert settled.action is Action.GO_ON and settled.skip_records == []
    assert [r.loss for r in win.unlogged()] == pytest.approx([3.0, 2.9, 2.8])
    assert win.unlogged() == []
    assert win.state_dict()["step"] == 3 and win.state_dict()["applied_steps"] == 3


def test_a_refusal_read_at_once_is_counted_and_recorded():
    win = window(masks=False)
    take(win, 3.0)
    take(win, math.nan)
    assert (win.step, win.applied_steps, win.skipped_steps) == (2, 1, 1)
    settled = win.settle(FACTS)
    assert settled.action is Action.GO_ON
    (record,) = settled.skip_records
    assert record["step"] == 2 and record["skip_reason"] == "non-finite loss"
    assert win.skips == [
        {"step": 2, "reason": "non-finite loss", "loss_z": 0.0, "grad_norm_z": 0.0}
    ]


def test_a_masked_refusal_takes_the_held_steps_again_from_the_same_state():
    engine = OneRank()
    win = window(masks=True, engine=engine)
    assert win.verdicts_on_device
    take(win, 3.0, accum=2)  # batches 1, 2
    torch.manual_seed(7)
    rng = torch.get_rng_state()
    take(win, math.nan, accum=2)  # batches 3, 4: refused on the device
    torch.rand(5)  # the held steps draw from the generator
    take(win, 2.9, accum=2)  # batches 5, 6: held back behind it
    take(win, 2.8, accum=2)  # batches 7, 8
    assert win.step == 4 and win.applied_steps == 4  # counted as applied until the settle
    assert win.wants_settle(due=True)
    settled = win.settle(FACTS)
    assert settled.action is Action.TAKEN_BACK
    assert (win.step, win.applied_steps, win.skipped_steps) == (2, 1, 1)
    assert engine.rewound == [3]  # the refused step and the two held behind it
    assert torch.equal(torch.get_rng_state(), rng)  # as the refused step found it
    assert win.holding and win.wants_settle(due=False)  # careful: one step at a time
    assert take(win, 2.9, accum=2) == [5, 6]  # the held batches again, in order
    assert take(win, 2.8, accum=2) == [7, 8]
    assert take(win, 2.7, accum=2) == [9, 10] and not win.holding
    assert win.settle(FACTS).action is Action.GO_ON
    assert [r.step for r in win.history] == [1, 2, 3, 4, 5]
    assert [r.applied for r in win.history] == [True, False, True, True, True]


def test_too_many_refusals_roll_back_or_stop_in_one_line():
    win = window(masks=False, max_skips=2)
    take(win, 3.0)
    checkpointed = win.state_dict()  # step 1's, before any refusal
    take(win, math.nan)
    assert not win.wants_settle(due=False)
    take(win, math.nan)
    assert win.wants_settle(due=False)  # stuck: roll back at once
    assert win.settle(FACTS).action is Action.ROLL_BACK
    with pytest.raises(TrainingDiverged, match=r"skipped steps 2-3 in a row .non-finite loss.*no"):
        win.check_rollback(None)
    win.check_rollback(newest=object())  # a checkpoint and a rollback left: go ahead
    tally = win.tally()
    win.load_state_dict(checkpointed)  # its tally is older: the rollback puts the run's back
    assert win.skipped_steps == 0 and win.skips == []
    line, record = win.rolled_back(from_step=3, tokens_per_step=64, tally=tally)
    assert win.skipped_steps == 2 and [skip["step"] for skip in win.skips] == [2, 3]
    assert line.startswith("warning: the step guard skipped steps 2-3 in a row (non-finite")
    assert record == {
        "step": 1,
        "tokens": 64,
        "rollback_from_step": 3,
        "rollbacks": 1,
        "skipped_steps": 2,
    }
    assert win.rollbacks == [{"from_step": 3, "to_step": 1, "skipped": [2, 3]}]
    with pytest.raises(TrainingDiverged, match=r"after 1 rollback\(s\) \(3 -> 1\)"):
        win.check_rollback(newest=object())


def test_a_resumed_window_goes_on_from_the_checkpoints_tally():
    """Skips, skipped steps and rollbacks are the run's, not a launch's: a checkpoint carries
    them, and ``train.guard.max_rollbacks`` (1 here) counts the rollbacks of earlier
    launches. A checkpoint written before the tally was kept starts it at zero."""
    win = window(masks=False, max_skips=2)
    take(win, 3.0)
    checkpointed = win.state_dict()
    take(win, math.nan)
    take(win, math.nan)
    assert win.settle(FACTS).action is Action.ROLL_BACK
    tally = win.tally()
    win.load_state_dict(checkpointed)
    win.rolled_back(from_step=3, tokens_per_step=64, tally=tally)
    take(win, 2.9)
    win.settle(FACTS)
    saved = win.state_dict()

    resumed = window(masks=False, max_skips=2)  # the next launch
    resumed.load_state_dict(saved)
    assert resumed.step == 2 and resumed.skipped_steps == resumed.skipped_steps_all_ranks == 2
    assert [skip["step"] for skip in resumed.skips] == [2, 3]
    assert resumed.rollbacks == [{"from_step": 3, "to_step": 1, "skipped": [2, 3]}]
    take(resumed, math.nan)
    take(resumed, math.nan)
    assert resumed.settle(FACTS).action is Action.ROLL_BACK
    with pytest.raises(TrainingDiverged, match=r"3-4 in a row .* after 1 rollback\(s\) \(3 -> 1\)"):
        resumed.check_rollback(newest=object())

    older = window(masks=False)
    older.load_state_dict({"step": 2, "applied_steps": 1})
    assert (older.skipped_steps, older.skips, older.rollbacks) == (0, [], [])
