"""The guarded step window: the run's position and what the step guard makes of each step.

``GuardedWindow`` counts the steps taken, applied and skipped, hands each step its batches
(a held-back batch first), gives the engine the guard's gate, and keeps this launch's
``StepRecord``s. At a settle it turns the unsettled records into host numbers and returns
one ``Settled`` to the loop: go on, the window was taken back to just after a refused
step whose verdict stayed on the device (its held steps are taken again), or roll back
to the newest checkpoint (too many refusals in a row). The guard's judgement itself is
``collage_train.run.guard``; docs/runs.md, "The step guard", says what a user sees.
"""

from __future__ import annotations

import collections
import enum
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from collage_train.engine.base import Engine, StepGate, StepOutcome
from collage_train.errors import TrainingDiverged
from collage_train.run import report
from collage_train.run.guard import GuardSettings, StepGuard, Verdict
from collage_train.run.step_window import StepRecord, settle


class Action(enum.Enum):
    """What the loop does after a settle."""

    GO_ON = "go on"  # log, validate, evaluate, save as due
    TAKEN_BACK = "taken back"  # a held step is taken again before anything else
    ROLL_BACK = "roll back"  # to the newest checkpoint (``GuardedWindow.rolled_back``)


@dataclass
class Settled:
    """A settle's outcome: the action, and one record (with its console ``line``) per
    step the settle found refused."""

    action: Action
    skip_records: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class _RedoPoint:
    """What taking a step again needs, should a verdict read later refuse it or an earlier
    step: the RNG and counters it started from, and its batches as drawn."""

    rng: dict[str, torch.Tensor]
    applied_steps: int
    skipped_steps: int
    skip_run: list[int]
    batches: list[torch.Tensor] = field(default_factory=list)


class GuardedWindow:
    """The run's step counters, the step guard's window and this launch's step records."""

    def __init__(
        self,
        settings: GuardSettings,
        engine: Engine,
        next_loader_batch: Callable[[], torch.Tensor],
        *,
        enabled: bool,
        optimizer_masks: bool,
        layer_groups: Sequence[str],
        with_dtheta: bool,
    ) -> None:
        self.settings = settings
        self._engine = engine
        self._device = engine.device
        self._next_loader_batch = next_loader_batch
        self._layer_groups = layer_groups
        self._with_dtheta = with_dtheta
        self.guard = StepGuard(settings, self._device) if enabled else None
        # Whether the verdict gates the update on the device, read by the host only at the
        # next settle (one process and ZeRO, with an optimizer that masks its step).
        self.verdicts_on_device = (
            self.guard is not None and not engine.independent_replicas and optimizer_masks
        )
        self.step = 0  # optimizer steps taken, applied or not: the data consumed
        self.applied_steps = 0  # of them applied: the lr schedule's position
        self.skipped_steps = 0  # refused by the guard or by DeepSpeed's overflow check
        self.skipped_steps_all_ranks = 0  # replicas: the sum over replicas, at each settle
        self.skips: list[dict[str, Any]] = []  # settled skips: step, reason, z-scores
        self.rollbacks: list[dict[str, Any]] = []  # {"from_step", "to_step", "skipped"}
        self._skip_run: list[int] = []  # the steps skipped in a row, up to the last one
        self._held: collections.deque[torch.Tensor] = collections.deque()
        self._redo: dict[int, _RedoPoint] = {}  # by step, until its verdict is settled
        self._masked: set[int] = set()  # steps whose verdict stayed on the device
        self._current: _RedoPoint | None = None  # the step being taken
        self._verdicts: list[Verdict] = []  # the step being taken's
        self._loss = torch.zeros(())  # the loss the guard judged for it
        self.start_launch()

    # ------------------------------------------------------------- a launch

    def start_launch(self) -> None:
        """Start this launch's records at the current step (the summary times this
        launch's steps)."""
        self.history: list[StepRecord] = []
        self._settled = self._logged = 0
        self._clock: float | None = None
        self._launch_step = self.step

    @property
    def first_of_launch(self) -> bool:
        """Whether the step just taken is this launch's first (settled alone: it pays for
        warm-up)."""
        return self.step == self._launch_step + 1

    def steady(self) -> list[StepRecord]:
        """This launch's records, less the first (warm-up) where there are others."""
        return self.history[1:] or self.history

    # ------------------------------------------------------------- a step

    def begin_step(self) -> None:
        """Before a step: start the clock if a settle stopped it, and keep what taking the
        step again needs where its verdict is read later."""
        if self._clock is None:
            self._clock = time.perf_counter()
        self._current, self._verdicts = None, []
        if self.verdicts_on_device:
            rng = {"torch": torch.get_rng_state()}
            if self._device.type == "cuda":  # kept on the host: no wait
                rng["cuda"] = torch.cuda.get_rng_state(self._device)
            self._current = _RedoPoint(
                rng, self.applied_steps, self.skipped_steps, list(self._skip_run)
            )

    def next_batch(self) -> torch.Tensor:
        """The step's next micro-batch on the host: one held back behind a refused step,
        else the loader's next."""
        batch = self._held.popleft() if self._held else self._next_loader_batch()
        if self._current is not None:
            self._current.batches.append(batch)
        return batch

    def gate(self, loss_share: torch.Tensor) -> StepGate | None:
        """The guard's gate for the step whose loss share is ``loss_share`` (None: no
        guard). It judges the step's mean loss and the gradient norm the engine hands it
        and records an applied step in the guard's window; on the device the answer masks
        the update (a step after a refused one is held back until the settle), else the
        engine reads it."""
        if self.guard is None:
            return None
        guard = self.guard
        self._loss = loss = self._guard_loss(loss_share)

        def judge(grad_norm: torch.Tensor | float) -> torch.Tensor:
            verdict = guard.judge(loss, grad_norm)
            self._verdicts.append(verdict)
            if self.verdicts_on_device:
                return guard.admit(verdict)
            guard.accept(verdict)
            return verdict.ok

        return StepGate(judge=judge, on_device=self.verdicts_on_device)

    def _guard_loss(self, loss_share: torch.Tensor) -> torch.Tensor:
        """The loss the guard judges: the step's mean over the ranks that step in lockstep
        (one one-element all-reduce, not a host wait), so every rank decides alike; a
        replica judges its own, as it steps alone between outer steps."""
        engine = self._engine
        if engine.world_size == 1:
            return loss_share
        if engine.independent_replicas:
            return loss_share * engine.world_size
        return engine.all_reduce_sum(loss_share.clone())

    def end_step(
        self,
        loss_share: torch.Tensor,
        lr: float,
        outcome: StepOutcome,
        data_time: float,
        edq: torch.Tensor | None,
    ) -> StepRecord:
        """Count the step taken and keep its record (device tensors until the settle)."""
        verdicts = self._verdicts
        if self.guard is not None and outcome.applied is False and not verdicts:
            # refused before the gate was asked (DeepSpeed's overflow check): say why
            verdicts.append(self.guard.judge(self._loss, outcome.grad_norm))
        self.step += 1
        record = StepRecord(
            step=self.step,
            loss=loss_share,
            lr=lr,
            grad_norm=outcome.grad_norm,
            data_time=data_time,
            edq=edq,
            applied=outcome.applied,
            verdict=verdicts[0] if verdicts and outcome.applied is not True else None,
        )
        if self._current is not None:
            self._redo[self.step] = self._current
            self._current = None
        if torch.is_tensor(outcome.applied):  # known at the next settle
            self._masked.add(self.step)
            self.applied_steps += 1
        elif outcome.applied:
            self.applied_steps += 1
            self._skip_run.clear()
        else:
            self.skipped_steps += 1
            self._skip_run.append(self.step)
        self.history.append(record)
        return record

    # ------------------------------------------------------------- a settle

    def wants_settle(self, due: bool) -> bool:
        """Whether to settle now: something is ``due``, this is the launch's first step, a
        lockstep rank has refused too many steps in a row (roll back at once), or a refused
        step's verdict stayed on the device (settle each step until one is applied)."""
        stuck = self._stuck() and not self._engine.independent_replicas
        careful = self.verdicts_on_device and bool(self._skip_run)
        return due or self.first_of_launch or stuck or careful

    def settle(self, facts: report.RunFacts) -> Settled:
        """Settle the unsettled records as host numbers; act on verdicts read only now;
        decide whether to roll back (the one collective replicas need for it)."""
        window = self.history[self._settled :]
        self.settle_records(window, since=self._clock or time.perf_counter())
        self._clock = None
        stand = self._rewind(window)
        taken_back = stand is not None and stand < len(window)
        if taken_back:  # back to just after a refused step, before this settle
            del self.history[self._settled + stand :]
            self._logged = min(self._logged, len(self.history))
        window = self.history[self._settled :]
        self.skips += report.skips_in(window)[: report.SKIPS_KEPT - len(self.skips)]
        settled = Settled(Action.GO_ON, report.skip_records(facts, window, self.skipped_steps))
        self._settled = len(self.history)
        if self._guard_consensus():
            settled.action = Action.ROLL_BACK
            self._logged = len(self.history)
        elif taken_back:
            settled.action = Action.TAKEN_BACK
        return settled

    def settle_alone(self, record: StepRecord, *, since: float) -> None:
        """Settle one step's record outside the loop's windows (``Trainer.train_step``):
        its numbers only; a verdict read only now is not acted on."""
        self.settle_records([record], since=since)
        self._redo.pop(record.step, None)
        self._masked.discard(record.step)

    def settle_records(self, records: Sequence[StepRecord], *, since: float) -> None:
        """``records`` as host numbers (``run.step_window.settle``)."""
        settle(
            records,
            all_reduce_sum=self._engine.all_reduce_sum,
            device=self._device,
            layer_groups=self._layer_groups,
            with_dtheta=self._with_dtheta,
            since=since,
            world_size=self._engine.world_size,
        )

    @property
    def holding(self) -> bool:
        """Whether batches of refused-and-held steps wait to be taken again."""
        return bool(self._held)

    def unlogged(self) -> list[StepRecord]:
        """The settled records not yet logged, now counted as logged."""
        records = self.history[self._logged : self._settled]
        self._logged = self._settled
        return records

    def _rewind(self, window: list[StepRecord]) -> int | None:
        """Act on the verdicts of the settled ``window`` that stayed on the device.

        Every step from the first refused one on changed nothing (the refused one by its
        verdict, the later ones held back: ``StepGuard.admit``). The window goes back to
        just after the refused step as if it had been refused at once: the counters and RNG
        it started from, the engine's step counts taken back, the batches of the held steps
        queued to be taken again. Returns how many steps of ``window`` stand (the refused
        one last), or None when none was refused.
        """
        redos = [self._redo.pop(record.step, None) for record in window]
        masked = [record.step in self._masked for record in window]
        self._masked.difference_update(record.step for record in window)
        if not window or redos[0] is None:
            return None
        refused = next((i for i, r in enumerate(window) if masked[i] and not r.applied), None)
        stand = len(window) if refused is None else refused + 1
        run = redos[0].skip_run  # the steps skipped in a row, recounted in step order
        for record in window[:stand]:
            run = [] if record.applied else [*run, record.step]
        self._skip_run = run
        if refused is None:
            return None
        redo = redos[refused]
        self.step = window[refused].step
        self.applied_steps = redo.applied_steps
        self.skipped_steps = redo.skipped_steps + 1
        self._engine.rewind_steps(sum(masked[refused:]))
        again = [batch for later in redos[refused + 1 :] for batch in later.batches]
        self._held.extendleft(reversed(again))
        torch.set_rng_state(redo.rng["torch"])
        if "cuda" in redo.rng:
            torch.cuda.set_rng_state(redo.rng["cuda"], self._device)
        self.guard.release()
        return stand

    def _stuck(self) -> bool:
        """Whether this rank refused ``train.guard.max_consecutive_skips`` steps in a row."""
        limit = self.settings.max_consecutive_skips
        return self.guard is not None and limit > 0 and len(self._skip_run) >= limit

    def _guard_consensus(self) -> bool:
        """Whether any rank is ``_stuck`` (a lockstep engine's ranks agree already;
        replicas, which judge their steps alone, agree with one collective that also sums
        their skipped steps into ``skipped_steps_all_ranks``)."""
        self.skipped_steps_all_ranks = self.skipped_steps
        if self.guard is None:
            return False
        engine = self._engine
        if not engine.independent_replicas or engine.world_size == 1:
            return self._stuck()
        flags = torch.tensor([float(self._stuck()), self.skipped_steps], device=self._device)
        stuck, skipped = engine.all_reduce_sum(flags).tolist()
        self.skipped_steps_all_ranks = int(skipped)
        return stuck > 0

    # ------------------------------------------------------------- a rollback

    def check_rollback(self, newest: Path | None) -> None:
        """Raise ``TrainingDiverged`` naming the refused steps when there is no checkpoint
        to roll back to or ``train.guard.max_rollbacks`` are spent."""
        if newest is not None and len(self.rollbacks) < self.settings.max_rollbacks:
            return
        before = [f"{r['from_step']} -> {r['to_step']}" for r in self.rollbacks]
        after = f" after {len(before)} rollback(s) ({', '.join(before)})" if before else ""
        hint = "" if newest is not None else " and there is no checkpoint to roll back to"
        raise TrainingDiverged(
            f"the step guard skipped steps {self._describe_run()}{after}{hint}; the "
            "last good checkpoint is kept. Look at the data of those steps, lower optim.lr, "
            "or raise train.guard.max_consecutive_skips / train.guard.z_threshold"
        )

    def rolled_back(
        self, from_step: int, tokens_per_step: int, tally: dict[str, Any]
    ) -> tuple[str, dict[str, Any]]:
        """After the newest checkpoint was restored (``load_state_dict``) with the data
        position kept past the refused steps: put back the run's ``tally`` of before the
        restore (the checkpoint's is older) and record the rollback; return its console
        line and its record."""
        self.restore_tally(tally)
        steps = self._describe_run()
        skipped = list(self._skip_run)  # empty on a replica whose steps were applied
        self._skip_run.clear()
        self.rollbacks.append({"from_step": from_step, "to_step": self.step, "skipped": skipped})
        line = (
            f"warning: the step guard skipped steps {steps}: rolled back to the "
            f"checkpoint of step {self.step}, the data continuing after step {from_step} "
            f"(rollback {len(self.rollbacks)} of at most {self.settings.max_rollbacks})"
        )
        record = {
            "step": self.step,
            "tokens": self.step * tokens_per_step,
            "rollback_from_step": from_step,
            "rollbacks": len(self.rollbacks),
            "skipped_steps": self.skipped_steps_all_ranks,  # replicas: every one's, as logged
        }
        return line, record

    def _describe_run(self) -> str:
        """The steps refused in a row, with why: "5-9 in a row (loss spike)"."""
        skipped = self._skip_run
        if not skipped:
            steps = "of another replica"
        else:
            steps = f"{skipped[0]}-{skipped[-1]}" if len(skipped) > 1 else f"{skipped[0]}"
        reasons = sorted({s["reason"] for s in self.skips if s["step"] in set(skipped)})
        return f"{steps} in a row" + (f" ({', '.join(reasons)})" if reasons else "")

    # ------------------------------------------------------------- state

    def tally(self) -> dict[str, Any]:
        """What the guard refused over the whole run (every launch so far): this rank's
        skipped steps and every rank's (as of the last settle), the skips kept
        (``report.SKIPS_KEPT``) and the rollbacks."""
        return {"skipped_steps": self.skipped_steps,
                "skipped_steps_all_ranks": self.skipped_steps_all_ranks,
                "skips": list(self.skips), "rollbacks": list(self.rollbacks)}  # fmt: skip

    def restore_tally(self, tally: dict[str, Any]) -> None:
        self.skipped_steps = int(tally["skipped_steps"])
        self.skipped_steps_all_ranks = int(tally["skipped_steps_all_ranks"])
        self.skips, self.rollbacks = list(tally["skips"]), list(tally["rollbacks"])

    def state_dict(self) -> dict[str, Any]:
        """The counters a resumed run needs, the guard's window, and its tally: a resumed
        run goes on counting its skips and rollbacks (``train.guard.max_rollbacks`` is the
        run's) from where the checkpoint's left them."""
        state: dict[str, Any] = {"step": self.step, "applied_steps": self.applied_steps,
                                 "guard_tally": self.tally()}  # fmt: skip
        if self.guard is not None:
            state["guard"] = self.guard.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self.applied_steps = int(state.get("applied_steps", self.step))  # older checkpoints
        if "guard_tally" in state:  # older checkpoints: counted from this launch
            self.restore_tally(state["guard_tally"])
        if self.guard is not None and "guard" in state:
            self.guard.load_state_dict(state["guard"])
