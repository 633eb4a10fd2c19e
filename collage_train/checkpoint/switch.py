"""Switching precision strategy on resume: a checkpoint's state read as another strategy's.

``switched(state, source, target)`` is the ``FullState`` that strategy ``target`` would
have saved: each range read from ``state`` goes through the canonical form
(``precision.state_form``: ``target.from_canonical(source.to_canonical(...))``), so every
engine's elastic resume and every layout writer takes it as it takes any checkpoint. The
step counts, the trainer's client state (step, data position, lr-schedule position, RNG)
pass through unchanged; ``betas`` (the source run's, this run's) turn moments stored
bias-corrected into Adam's own and back. ``measure`` reports what the switch cost, measured: each
parameter converted, read back to canonical and compared with the source's canonical
values (the largest relative error of an element, per canonical value).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from collage_train.checkpoint.param_state import FullState
from collage_train.errors import ConfigError
from collage_train.precision import get_strategy
from collage_train.precision.state_form import CANONICAL, AdamStep, StateForm, contains

# meta.json's record of a switch made offline (``convert --precision``).
SWITCHED = "switched"


def form_of(name: str) -> StateForm:
    """Strategy ``name``'s state form; a one-line ConfigError where it has none."""
    form = get_strategy(name).state_form
    if form is None:
        raise ConfigError(
            f"precision={name} cannot be switched to or from yet (its state is not "
            "converted to the canonical form); resume with the strategy that wrote it"
        )
    return form


def check_switch(source: str, target: str) -> None:
    """Refuse, in one line, a switch from ``source`` to ``target`` that cannot be made."""
    form_of(source)
    form_of(target)


def exact(source: str, target: str) -> bool:
    """Whether ``target`` holds every canonical value of ``source`` exactly."""
    if source == target:
        return True
    held, holding = form_of(source).holds, form_of(target).holds
    return all(contains(holding[key], held[key]) for key in CANONICAL)


Betas = tuple[tuple[float, float], tuple[float, float]]  # the source run's, the target's


def betas_of(config: dict[str, Any]) -> tuple[float, float]:
    """AdamW's betas in a run's resolved ``config`` (meta.json's)."""
    first, second = config["optim"]["betas"]
    return float(first), float(second)


def switched(state: FullState, source: str, target: str, betas: Betas) -> FullState:
    """``state`` (written by ``source``) as strategy ``target`` holds it."""
    if source == target:
        return state
    read_from, write_to = form_of(source), form_of(target)

    def read(name: str, start: int, stop: int) -> dict[str, torch.Tensor]:
        step = state.steps[name]
        canonical = read_from.to_canonical(state.read(name, start, stop), AdamStep(step, betas[0]))
        return write_to.from_canonical(canonical, AdamStep(step, betas[1]))

    return FullState(
        state.layout, state.world_size, state.shapes, state.steps, state.trainer,
        state.per_rank_rng, read,
    )  # fmt: skip


def relative_error(value: torch.Tensor, reference: torch.Tensor) -> float:
    """The largest ``|value - reference| / |reference|`` of an element (float64); an element
    whose reference is 0 counts 0 when the value is 0 too, infinity otherwise."""
    diff = (value.to(torch.float64) - reference).abs()
    scale = reference.abs()
    ratio = torch.where(scale > 0, diff / scale.clamp_min(torch.finfo(torch.float64).tiny),
                        torch.where(diff > 0, torch.inf, 0.0))  # fmt: skip
    return float(ratio.max()) if ratio.numel() else 0.0


@dataclass(frozen=True)
class Switch:
    """One switch of strategy: from, to, at which step, and what it cost (``errors``: the
    largest relative error per canonical value, measured)."""

    source: str
    target: str
    step: int
    errors: dict[str, float]

    @property
    def exact(self) -> bool:
        return all(error == 0 for error in self.errors.values())

    def line(self) -> str:
        """The one line a resume and ``convert --precision`` print."""
        cost = ", ".join(f"{key} {self.errors[key]:.2g}" for key in CANONICAL)
        kind = "exact" if self.exact else "rounded"
        return (
            f"switched precision {self.source} -> {self.target} at step {self.step}: converted "
            f"{form_of(self.source).describe()} -> {form_of(self.target).describe()}; step, "
            f"data and lr-schedule position kept; {kind}, largest relative error against "
            f"the source: {cost}"
        )

    def record(self) -> dict[str, Any]:
        """The switch as JSON (summary.json, W&B's config, meta.json of a conversion)."""
        return {"from": self.source, "to": self.target, "step": self.step,
                "exact": self.exact, "max_rel_error": dict(self.errors)}  # fmt: skip

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> Switch:
        return cls(record["from"], record["to"], int(record["step"]),
                   dict(record["max_rel_error"]))  # fmt: skip


def measure(state: FullState, source: str, target: str, betas: Betas) -> Switch:
    """Convert every parameter of ``state`` from ``source`` to ``target``, read it back to
    canonical and compare with the source's canonical values (one parameter at a time)."""
    read_from, write_to = form_of(source), form_of(target)
    errors = dict.fromkeys(CANONICAL, 0.0)
    for name in state.shapes:
        there, here = AdamStep(state.steps[name], betas[0]), AdamStep(state.steps[name], betas[1])
        before = read_from.to_canonical(state.read(name), there)
        after = write_to.to_canonical(write_to.from_canonical(before, here), here)
        for key in CANONICAL:
            errors[key] = max(errors[key], relative_error(after[key], before[key]))
    return Switch(source, target, int(state.trainer["step"]), errors)
